"""Draw rendezvous timelines (RENDEZVOUS_TIMELINE files) as a picture.

    python tools/render_timeline.py timeline/mpi.json --steps 10:12 --out docs/timeline.png
    python tools/render_timeline.py timeline/mpi/*.json --out job.png

Reads one trace or several (each rank's file, or a merged one: see
`rendezvous.timeline.merge`), and draws one row per lane of each rank: recv
spans coloured by the path the tensor took, serve spans on the producers,
and inside them the phases (wait, transfer, place); sends are ticks on their
rank's `send` row. `--steps A:B` keeps the time from the first span of step
A to the last span of step B. Needs matplotlib (the `dev` or `bench` extra).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rendezvous.timeline import read_trace  # noqa: E402

#: colours of the spans, by what they are
SPAN_COLOURS = {"mpi": "#3a9a5b", "grpc": "#3b73b9", "local": "#8a8a8a", "serve": "#e08a2c", "error": "#c83737"}
PHASE_COLOURS = {"wait": "#d9d9d9", "transfer mpi": "#1f5e3a", "transfer grpc": "#1d3f73", "place": "#7b4fa0"}


def short(task: str) -> str:
    """``/job:worker/replica:0/task:1`` -> ``worker 1``."""
    parts = dict(p.split(":", 1) for p in task.strip("/").split("/") if ":" in p)
    if "job" not in parts:
        return task
    return f"{parts['job']} {parts.get('task', '0')}"


def load(paths: list[str]) -> tuple[list[dict], dict[int, str], dict[tuple[int, int], str]]:
    events, processes, lanes = [], {}, {}
    for path in paths:
        for e in read_trace(path):
            if e.get("ph") == "M":
                if e["name"] == "process_name":
                    processes[e["pid"]] = e["args"]["name"]
                elif e["name"] == "thread_name":
                    lanes[(e["pid"], e["tid"])] = e["args"]["name"]
            else:
                events.append(e)
    return events, processes, lanes


def window(events: list[dict], steps: str | None) -> tuple[float, float]:
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("recv", "serve")]
    if steps:
        first, _, last = steps.partition(":")
        lo, hi = int(first), int(last or first)
        spans = [e for e in spans if lo <= e.get("args", {}).get("step_id", -1) <= hi]
    if not spans:
        raise SystemExit("no recv or serve spans in that window")
    return min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)


def render(paths: list[str], out: str, steps: str | None = None, title: str | None = None) -> int:
    """Draw the traces at ``paths`` into ``out`` (PNG); the number of rows drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    events, processes, lane_names = load(paths)
    start, end = window(events, steps)
    shown = [e for e in events if e["ts"] <= end and e["ts"] + e.get("dur", 0) >= start]
    rows = sorted({(e["pid"], e["tid"]) for e in shown})
    y = {row: i for i, row in enumerate(rows)}

    fig, ax = plt.subplots(figsize=(12, 1.4 + 0.4 * len(rows)))
    ms = lambda t: (t - start) / 1000.0  # noqa: E731
    for e in shown:
        row = y[(e["pid"], e["tid"])]
        args = e.get("args", {})
        if e["ph"] == "i":
            if e.get("cat") == "send":
                ax.plot([ms(e["ts"])] * 2, [row - 0.3, row + 0.3], color="#444444", linewidth=1)
            continue
        left, width = ms(e["ts"]), max(e["dur"] / 1000.0, 0.02)
        cat = e.get("cat")
        if cat in ("recv", "serve"):
            colour = SPAN_COLOURS["error"] if "error" in args else (
                SPAN_COLOURS["serve"] if cat == "serve" else SPAN_COLOURS.get(args.get("path"), "#8a8a8a"))
            ax.barh(row, width, left=left, height=0.8, color=colour, alpha=0.35, edgecolor=colour, linewidth=0.8)
            label = e["name"].split(" ", 1)[-1]
            if width > (end - start) / 1000.0 / 40:
                ax.text(left + width / 2, row + 0.28, label, ha="center", va="center", fontsize=6.5, clip_on=True)
        elif cat == "phase":
            ax.barh(row, width, left=left, height=0.34, color=PHASE_COLOURS.get(e["name"], "#555555"), linewidth=0)
    labels = []
    for pid, tid in rows:
        lane = lane_names.get((pid, tid), str(tid))
        lane = " ".join(short(w) if w.startswith("/job:") else w for w in lane.split(" "))
        labels.append(f"{short(processes.get(pid, str(pid)))}: {lane}")
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    for i in range(1, len(rows)):
        if rows[i][0] != rows[i - 1][0]:  # the next rank
            ax.axhline(i - 0.5, color="#999999", linewidth=0.6)
    ax.invert_yaxis()
    ax.set_xlim(0, (end - start) / 1000.0)
    ax.set_xlabel("ms")
    ax.grid(axis="x", color="#eeeeee")
    ax.set_axisbelow(True)
    legend = [Patch(color=SPAN_COLOURS[k], alpha=0.5, label=t) for k, t in
              (("mpi", "recv over MPI"), ("grpc", "recv over gRPC"), ("local", "recv local"),
               ("serve", "serve (producer)"), ("error", "failed"))]
    legend += [Patch(color=PHASE_COLOURS[k], label=k) for k in PHASE_COLOURS]
    legend.append(Line2D([], [], color="#444444", marker="|", linestyle="none", markersize=8, label="send"))
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=7.5, frameon=False)
    ax.set_title(title or "rendezvous timeline", fontsize=10)
    fig.tight_layout(rect=(0, 0.4 / (1.4 + 0.4 * len(rows)), 1, 1))
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="timeline files (each rank's, or merged)")
    p.add_argument("--out", default="timeline.png", help="the PNG to write (default timeline.png)")
    p.add_argument("--steps", help="A:B: only the time of steps A to B")
    p.add_argument("--title", help="the picture's title")
    args = p.parse_args(argv)
    rows = render(args.traces, args.out, args.steps, args.title)
    print(f"{args.out}: {rows} lanes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
