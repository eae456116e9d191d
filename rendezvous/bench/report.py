"""Every table, page and results file the bench commands write, and their progress bar.

This module is longer than the others on purpose: the four commands'
tables share its number formats and table writers, and BENCHMARKS.md
quotes what they write byte for byte, so how each figure and table looks is
decided here and nowhere else.

* figures: :func:`figure` (precision by magnitude: ``rendezvous bench``,
  ``bench-scale``), :func:`decimals` (fixed decimals below 100:
  ``bench-daemon``), :func:`whole` (counts);
* tables: :func:`markdown_table` (every file); on the terminal, rich's
  tables (:func:`show`) drawn on :func:`console`;
* files: :func:`write_json` and :func:`load` (``bench.json``, checked
  against its schema), :func:`save` (the other commands' JSON and Markdown,
  printed too), :func:`write_plot` (``bench.png``);
* the pages: :func:`show` (the terminal) and :func:`markdown`
  (``rendezvous bench``), :func:`steps_markdown`, :func:`daemon_markdown`,
  :func:`scale_markdown`;
* :class:`Progress`: the progress of ``bench``, ``bench-daemon`` and
  ``bench-scale``.

What is drawn on a terminal (the progress bar, ``rendezvous bench``'s
tables) is drawn with rich, the ``bench`` extra, imported only when drawing
(:func:`need_rich` lets a command refuse to start without it); the files
are plain Markdown and JSON, written without it. On anything but a terminal
(a log, a pipe) rich's tables come out as plain text, and the progress as a
plain line at every tenth of the run.

The documents themselves (what is measured, the ratios, the targets) are
built by :mod:`rendezvous.bench.results`.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .stats import format_size

__all__ = ["figure", "decimals", "whole", "markdown_table", "write_json", "load", "save", "need_rich", "console",
           "show", "markdown", "write_plot", "steps_markdown", "daemon_markdown", "scale_markdown", "Progress",
           "NO_RICH"]

MiB = 1 << 20
NO_RICH = "rich, which draws the progress bar and tables, is not installed (pip install 'rendezvous[bench]')"
#: the width of a console that is not a terminal: wide enough that no table wraps in a log
LOG_WIDTH = 200


# -- figures and tables -----------------------------------------------------------------

def figure(value: float | None, digits: int = 2) -> str:
    """A measured figure, its precision by its magnitude: ``0.0042``, ``3.14``,
    ``31.4``, ``314``, ``3,142``; ``-`` for None."""
    if value is None:
        return "-"
    if 0 < value < 0.01:
        return f"{value:.2g}"
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.{digits}f}"


def decimals(value: float | None, digits: int = 2) -> str:
    """``digits`` decimals below 100, none from there; ``-`` for None."""
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}f}"


def whole(value: float) -> str:
    """A count: ``3`` for 3.0, ``2.5`` for a median between two counts."""
    return f"{value:g}" if value != int(value) else str(int(value))


def _mib(n: float) -> str:
    return f"{n / MiB:.0f}"


def markdown_table(header: list[str], rows: list[list[str]], numbers_from: int | None = 2) -> list[str]:
    """A Markdown table, columns from ``numbers_from`` on right-aligned; with
    None, the plain ``|---|`` rule (bench-steps, bench-daemon)."""
    if numbers_from is None:
        rule = "|" + "---|" * len(header)
    else:
        rule = "| " + " | ".join("---" if i < numbers_from else "---:" for i in range(len(header))) + " |"
    return ["| " + " | ".join(header) + " |", rule, *("| " + " | ".join(r) + " |" for r in rows)]


# -- files --------------------------------------------------------------------------------

def write_json(doc: Mapping[str, Any], path: Path) -> None:
    """``bench.json``: checked against its schema first."""
    from .results import validate

    validate(doc)
    path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")


def load(path: Path) -> dict[str, Any]:
    """A ``bench.json``, checked against its schema."""
    from .results import validate

    doc = json.loads(Path(path).read_text())
    validate(doc)
    return doc


def save(out: str | Path, doc: Mapping[str, Any], text: str, json_name: str, md_name: str) -> None:
    """Write a command's results document and its Markdown into folder ``out``,
    then print the Markdown and where both went (bench-steps, -daemon, -scale)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / json_name).write_text(json.dumps(doc, indent=1) + "\n")
    (out / md_name).write_text(text)
    print(text)
    print(f"results: {out / json_name} (Markdown: {out / md_name})")


# -- the terminal ----------------------------------------------------------------------------

def need_rich(command: str) -> None:
    """Refuse to start ``rendezvous <command>`` without rich (before anything runs,
    not when its results are ready to draw)."""
    try:
        import rich  # noqa: F401
    except ImportError:
        raise SystemExit(f"rendezvous {command}: {NO_RICH}") from None


def console(file: Any = None) -> Any:
    """A rich console on ``file`` (default stdout) that prints text as given (no
    markup, emoji or highlighting). Not a terminal: no colours, no cursor moves,
    and :data:`LOG_WIDTH` columns, so no table wraps in a log."""
    try:
        from rich.console import Console
    except ImportError:
        raise SystemExit(NO_RICH) from None
    out = Console(file=sys.stdout if file is None else file, markup=False, emoji=False, highlight=False)
    if not out.is_terminal:
        out.width = LOG_WIDTH
    return out


# -- rendezvous bench -----------------------------------------------------------------------

def _transfer_rows(doc: Mapping[str, Any], every_size: bool) -> list[list[str]]:
    """One row per contender and size; the size on its first row only unless ``every_size``."""
    labels = doc["contenders"]
    rows = []
    last = None
    for t in doc["transfers"]:
        size = format_size(t["size"]) if every_size or t["size"] != last else ""
        last = t["size"]
        cpu = t["cpu_us"]
        rows.append([size, labels.get(t["contender"], t["contender"]), figure(t["median_us"]), figure(t["p99_us"]),
                     figure(t["gbps"], 3), figure(t["vs_mpi"]["gbps"]), figure(t["vs_grpc"]["gbps"]),
                     f"{figure(cpu['consumer'])} / {figure(cpu['producer'])}", str(t["samples"])])
    return rows


def _rate_rows(doc: Mapping[str, Any]) -> list[list[str]]:
    labels = doc["contenders"]
    return [[labels.get(x["contender"], x["contender"]), "", figure(x["per_s"]), figure(x["best_per_s"]),
             figure(x["vs_mpi"]), figure(x["vs_grpc"]), str(x["errors"])] for x in doc["rate"]["results"]]


def _idle_threads(r: Mapping[str, Any]) -> str:
    """The busiest threads of an idle rank, as " (MainThread 12 ms, ...)"
    (runs from before the breakdown have none)."""
    busiest = list(r.get("threads", {}).items())[:4]
    if not busiest:
        return ""
    return " (" + ", ".join(f"{name} {t * 1e3:.0f} ms" for name, t in busiest) + ")"


def _wakeup_rows(doc: Mapping[str, Any], every_quiet: bool) -> list[list[str]]:
    """One row per contender and quiet length of the wake-up test (the quiet
    length on its first row only unless ``every_quiet``)."""
    labels = doc["contenders"]
    rows, last = [], None
    for w in doc.get("wakeup") or []:
        quiet = f"{w['quiet_s']:g} s"
        rows.append([quiet if every_quiet or quiet != last else "", labels.get(w["contender"], w["contender"]),
                     figure(w["median_us"]), figure(w["max_us"]), str(len(w["samples_ns"]))])
        last = quiet
    return rows


def _wakeup_caption(doc: Mapping[str, Any]) -> str:
    size = format_size(doc["wakeup"][0]["size"])
    return (f"Wake-up: a {size} recv when both ranks were quiet that long after the tensor was produced "
            "(requests over MPI: an idle rank probes for requests ever less often, at most every 50 ms)")


def _rss_rows(doc: Mapping[str, Any]) -> list[list[str]]:
    """One row per contender and rank of the peak-RSS test."""
    labels = doc["contenders"]
    rows = []
    for x in doc["rss"]["results"]:
        for row, vs in zip(x["ranks"], x["vs_mpi"]):
            rows.append([labels.get(x["contender"], x["contender"]), f"rank {row['rank']}",
                         f"{row['baseline_bytes'] / MiB:.0f}", f"{row['peak_bytes'] / MiB:.0f}",
                         f"{row['transfer_bytes'] / MiB:.0f}", figure(row["x_size"]), figure(vs)])
    return rows


def show(doc: Mapping[str, Any], out: Any = None) -> None:
    """Draw ``rendezvous bench``'s results on the rich console ``out`` (default: a
    :func:`console` on stdout): tables of the transfers, the rate and the peak
    RSS, the idle CPU, then the targets."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    out = console(sys.stdout) if out is None else out

    def table(header: list[str], rows: list[list[str]], caption: str, groups: int | None = None) -> None:
        t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
        for i, h in enumerate(header):
            t.add_column(Text(h), justify="left" if i < 2 else "right", no_wrap=i == 1)
        for i, row in enumerate(rows):
            last_of_group = groups is not None and i + 1 < len(rows) and rows[i + 1][groups] != ""
            t.add_row(*(Text(c) for c in row), end_section=last_of_group)
        out.print(Text(caption, style="bold"), soft_wrap=True)
        out.print(t)
        out.print()

    out.print(Text(f"rendezvous bench ({'quick' if doc['quick'] else 'full'}), {doc['created']}", style="bold"),
              soft_wrap=True)
    out.print(Text("  " + ", ".join(f"{k} {v}" for k, v in doc["environment"].items()), style="dim"),
              soft_wrap=True)
    out.print()
    _matrix(doc, None, table)
    table(["size", "contender", "median us", "p99 us", "GB/s", "x mpi", "x grpc", "cpu us", "n"],
          _transfer_rows(doc, every_size=False),
          "Round trips rank 1 -> rank 0 (bandwidth from the median; x = bandwidth ratio, same run; "
          "cpu = CPU time per transfer of the consumer / producer process)", groups=0)
    if doc.get("rate"):
        r = doc["rate"]
        table(["contender", "", "per s", "best", "x mpi", "x grpc", "errors"], _rate_rows(doc),
              f"Rate: {format_size(r['bytes'])} tensors, {r['outstanding']} recvs outstanding")
    if doc.get("rss"):
        table(["contender", "rank", "base MiB", "peak MiB", "added MiB", "x size", "x mpi"], _rss_rows(doc),
              f"Peak RSS during one {format_size(doc['rss']['size'])} transfer (added over the rank's baseline; "
              "producer = rank 1, consumer = rank 0)")
    if doc.get("wakeup"):
        table(["quiet", "contender", "median us", "max us", "n"], _wakeup_rows(doc, False), _wakeup_caption(doc),
              groups=0)
    if doc.get("idle"):
        out.print(Text("Idle: " + ", ".join(f"rank {r['rank']} {r['cpu_fraction']:.2%} of a core over "
                                            f"{r['seconds']:.0f} s" + _idle_threads(r) for r in doc["idle"])),
                  soft_wrap=True)
        out.print()
    notes = any(t["note"] for t in doc["targets"])
    targets = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    for h, justify in (("", "left"), ("target", "left"), ("measured", "right"), ("required", "left"),
                       *((("note", "left"),) if notes else ())):
        targets.add_column(Text(h), justify=justify)
    for t in doc["targets"]:
        mark = {True: Text("met", style="green"), False: Text("MISSED", style="bold red"),
                None: Text("n/a", style="dim")}[t["ok"]]
        targets.add_row(mark, Text(t["what"]), Text(figure(t["measured"])), Text(f"{t['op']} {t['limit']:g}"),
                        *((Text(t["note"] or "", style="dim"),) if notes else ()))
    out.print(Text("Targets", style="bold"))
    out.print(targets)
    for n in doc["notes"]:
        out.print(Text(f"note: {n}"), soft_wrap=True)


_MATRIX_CAPTION = ("The matrix: each way to move a tensor as a fraction of its raw transport in this run "
                   "(median bandwidth over raw MPI's, m, or raw grpc.aio's, g; raw MPI's over a memcpy's, c; "
                   "1.0 = the reference's speed)")


def _matrix(doc: Mapping[str, Any], floors: Any, table: Any) -> None:
    from .matrix import matrix_rows

    header, rows = matrix_rows(doc, floors)
    if rows:
        table(header, rows, _MATRIX_CAPTION)


def show_guard(doc: Mapping[str, Any], floors: Any, out: Any = None) -> int:
    """The regression guard's verdict on a quick matrix run: the matrix, every
    cell below its floor named, and 1 if there is one (else 0)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from .matrix import check

    out = console(sys.stdout) if out is None else out

    def table(header: list[str], rows: list[list[str]], caption: str) -> None:
        t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
        for i, h in enumerate(header):
            t.add_column(Text(h), justify="left" if i == 0 else "right", no_wrap=True)
        for row in rows:
            t.add_row(*(Text(c, style="bold red" if c.endswith("!") else "") for c in row))
        out.print(Text(caption, style="bold"), soft_wrap=True)
        out.print(t)
        out.print()

    out.print(Text(f"rendezvous bench --guard, {doc['created']}", style="bold"), soft_wrap=True)
    out.print(Text("  " + ", ".join(f"{k} {v}" for k, v in doc["environment"].items()), style="dim"),
              soft_wrap=True)
    out.print()
    _matrix(doc, floors, table)
    breaches = check(doc, floors)
    if not breaches:
        n = sum(len(v) for v in (*floors.cells.values(), *floors.raw.values())) + len(floors.rate)
        out.print(Text(f"guard: every cell at or above its floor ({n} floors)", style="green"), soft_wrap=True)
        return 0
    out.print(Text(f"guard: {len(breaches)} cell(s) below their floor:", style="bold red"), soft_wrap=True)
    for b in breaches:
        out.print(Text(f"  {b}"), soft_wrap=True)
    return 1


def markdown(doc: Mapping[str, Any]) -> str:
    """``rendezvous bench``'s results and targets as Markdown tables (``bench.md``)."""
    out = [f"Run of {doc['created']} ({'quick' if doc['quick'] else 'full'}): "
           + ", ".join(f"{k} {v}" for k, v in doc["environment"].items()) + ".", ""]
    from .matrix import matrix_rows

    header, rows = matrix_rows(doc)
    if rows:
        out += [_MATRIX_CAPTION + ":", ""] + markdown_table(header, rows, numbers_from=1) + [""]
    out += markdown_table(["size", "contender", "median µs", "p99 µs", "GB/s", "× (a)", "× (b)",
                           "CPU µs cons. / prod.", "n"], _transfer_rows(doc, every_size=True))
    if doc.get("rate"):
        r = doc["rate"]
        out += ["", f"Rate, {format_size(r['bytes'])} tensors, {r['outstanding']} recvs outstanding:", ""]
        out += markdown_table(["contender", "", "recvs/s (median)", "best", "× (a)", "× (b)", "errors"],
                              _rate_rows(doc))
    if doc.get("rss"):
        out += ["", f"Peak RSS during one {format_size(doc['rss']['size'])} transfer, added over each rank's "
                    "baseline (rank 0 consumes, rank 1 produces):", ""]
        out += markdown_table(["contender", "rank", "baseline MiB", "peak MiB", "added MiB", "× size", "× (a)"],
                              _rss_rows(doc))
    if doc.get("wakeup"):
        out += ["", _wakeup_caption(doc) + ":", ""]
        out += markdown_table(["quiet", "contender", "median µs", "max µs", "n"], _wakeup_rows(doc, True))
    if doc.get("idle"):
        out += ["", "Idle CPU: " + ", ".join(f"rank {r['rank']} {r['cpu_fraction']:.2%} of one core over "
                                             f"{r['seconds']:.0f} s" + _idle_threads(r) for r in doc["idle"]) + "."]
    out += ["", "Targets:", ""]
    out += markdown_table(["target", "", "measured", "required", "status"],
                          [[t["what"], "", figure(t["measured"]), f"{t['op']} {t['limit']:g}",
                            {True: "met", False: "**missed**", None: "not measured"}[t["ok"]]
                            + (f" ({t['note']})" if t["note"] else "")] for t in doc["targets"]])
    for n in doc["notes"]:
        out.append(f"\nNote: {n}.")
    return "\n".join(out) + "\n"


_STYLE: dict[str, dict[str, Any]] = {  # each contender's line: plot()'s keyword arguments
    "memcpy": dict(linestyle="--", color="grey"), "mpi": dict(color="black"),
    "mpi_alloc": dict(color="black", linestyle=":"), "grpc": dict(color="tab:red"),
    "default": dict(color="tab:orange"), "optimal": dict(color="tab:blue"), "gloo": dict(color="tab:green"),
    "default_mr": dict(color="tab:orange", linestyle="-."), "optimal_mr": dict(color="tab:blue", linestyle="-."),
    "blocking_default_mr": dict(color="tab:purple", linestyle="-.")}


def write_plot(doc: Mapping[str, Any], path: Path) -> bool:
    """Bandwidth against size, log-log, one line per contender. False if
    matplotlib is not installed (``pip install 'rendezvous[bench]'``)."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    try:
        for name, label in doc["contenders"].items():
            pts = [(t["size"], t["gbps"]) for t in doc["transfers"] if t["contender"] == name]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", label=label, **_STYLE.get(name, {}))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        sizes = doc["sizes"]
        ax.set_xticks(sizes, [format_size(s).replace(" ", "\u2009") for s in sizes])
        ax.set_xlabel("tensor size")
        ax.set_ylabel("GB/s (from the median round trip)")
        env = doc["environment"]
        ax.set_title(f"rendezvous bench, 2 ranks on one host ({env.get('cpus', '?')} cpus), {doc['created'][:10]}",
                     fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
    return True


# -- rendezvous bench-steps -----------------------------------------------------------------

def steps_markdown(doc: dict[str, Any]) -> str:
    """``steps.md``: ms per step (median), and ratios in the same run."""
    lines = []
    names = doc["contenders"]
    for model, m in doc["models"].items():
        med = {n: statistics.median(m["seconds"][n]) * 1e3 for n in names if m["seconds"].get(n)}
        lines.append(f"\n**{model}**: {m['tensors']} tensors, {m['bytes'] / 2**20:.1f} MiB per step "
                     f"(median of {len(next(iter(m['seconds'].values())))} steps)\n")
        rows = []
        for n in names:
            if n not in med:
                continue
            lo = min(m["seconds"][n]) * 1e3
            # the consumer-first contenders against the bounds measured the same way
            ref_mpi, ref_gloo = ("mpi_waiting", "gloo_waiting") if "_waiting" in n else ("mpi", "gloo")
            mpi = f"{med[n] / med[ref_mpi]:.2f}" if ref_mpi in med else "-"
            gloo = f"{med[n] / med[ref_gloo]:.2f}" if ref_gloo in med else "-"
            cpu = m.get("cpu_us_per_tensor", {}).get(n)
            rows.append([n, f"{med[n]:.1f}", f"{lo:.1f}", mpi, gloo,
                         f"{cpu['consumer']:.0f} / {cpu['producer']:.0f}" if cpu else "-"])
        lines += markdown_table(["contender", "ms per step", "min", "× raw MPI", "× gloo",
                                 "CPU µs per tensor (consumer / producer)"], rows, None)
    if any("_waiting" in n for n in names):
        lines.append("\nContenders named `_waiting` time the consumer first (its receives posted, then the "
                     "producer's sends, inside the clock); their ratios are to `mpi_waiting` and `gloo_waiting`.")
    return "\n".join(lines) + "\n"


# -- rendezvous bench-daemon ----------------------------------------------------------------

def daemon_markdown(doc: dict) -> str:
    """``daemon.md``: the targets, then each scenario's tables."""
    env = doc["environment"]
    lines = ["# rendezvousd: local hop, small tensors, cross-node", "",
             f"{doc['created']}; {doc['seconds']:.0f} s; {'quick run; ' if doc['quick'] else ''}"
             + ", ".join(f"{k} {v}" for k, v in env.items()), "",
             "Every process runs on this machine; contenders take turns round by round "
             f"({doc['args']['rounds']} rounds); times are medians; every ratio is between contenders of this "
             "run. GB/s = 10^9 bytes/s."
             + (" Daemons' environment: " + ", ".join(f"{k}={v}" for k, v in doc["args"]["daemon_env"].items())
                + "." if doc["args"].get("daemon_env") else ""), "", "## Targets", ""]
    rows = []
    for t in doc["targets"]:
        result = "not measured" if t["met"] is None else ("**met**" if t["met"] else "**missed**")
        rows.append([t["what"], decimals(t["measured"]), f"{'≥' if t['op'] == '>=' else '≤'} {t['goal']:g}", result])
    lines += markdown_table(["target", "measured", "goal", "result"], rows, None)
    if doc.get("local_hop"):
        lines += _daemon_local_hop(doc)
    if doc.get("small"):
        lines += _daemon_small(doc)
    if doc.get("cross"):
        lines += _daemon_cross(doc)
    lines += _daemon_memory(doc["memory"])
    return "\n".join(lines) + "\n"


def _daemon_local_hop(doc: dict) -> list[str]:
    hop_cells = doc["local_hop"]
    lines = ["", "## 1. Local hop: client A → rendezvousd → client B (separate processes)", "",
             "send: A's send, nobody waiting yet; recv: B's recv of the tensor already in the daemon; hop: "
             "B's recv posted first, from A's send starting to B holding the array. A distinct tensor every "
             "sample (B checks it). memcpy: one `numpy.copyto` between two warm preallocated buffers.", ""]
    rows = []
    for size in doc["args"]["sizes"]:
        copy = hop_cells["memcpy"].get(str(size), {}).get("copy")
        for name in ("local_blocking", "local_lent", "local_aio"):
            c = hop_cells.get(name, {}).get(str(size))
            if not c:
                continue
            ratio = c["hop"]["gbps"] / copy["gbps"] if copy else None
            rows.append([format_size(size), name.split("_")[1], decimals(c["send"]["ms"], 3),
                         decimals(c["send"]["gbps"]), decimals(c["recv"]["ms"], 3), decimals(c["recv"]["gbps"]),
                         decimals(c["hop"]["ms"], 3), decimals(c["hop"]["gbps"]),
                         decimals(copy["ms"], 3) if copy else "-", decimals(copy["gbps"]) if copy else "-",
                         decimals(ratio), str(c["hop"]["samples"])])
    return lines + markdown_table(["size", "client", "send ms", "send GB/s", "recv ms", "recv GB/s", "hop ms",
                                   "hop GB/s", "memcpy ms", "memcpy GB/s", "hop ÷ memcpy", "samples"], rows, None)


def _daemon_small(doc: dict) -> list[str]:
    small = doc["small"]
    ops = small["ops"]
    lines = ["", f"## 2. Small tensors ({format_size(small['size'])})", "",
             "One operation after another from a client process (recv: of a tensor already sent); bare gRPC: "
             "a 1 KiB echo (generic handler, raw bytes) over a Unix socket to another process.", ""]
    ref_aio = ops.get("grpc_aio_unary", {}).get("median_us")
    ref_sync = ops.get("grpc_sync_unary", {}).get("median_us")
    rows = []
    for name in ("send_blocking", "recv_blocking", "send_aio", "recv_aio", "grpc_aio_unary", "grpc_sync_unary"):
        s = ops.get(name)
        if not s:
            continue
        rows.append([name, decimals(s["median_us"], 1), decimals(s["p99_us"], 1),
                     decimals(s["median_us"] / ref_aio if ref_aio else None),
                     decimals(s["median_us"] / ref_sync if ref_sync else None), str(s["samples"])])
    lines += markdown_table(["operation", "median µs", "p99 µs", "× grpc.aio unary", "× sync unary", "samples"],
                            rows, None)
    rate = small["rate"]
    ref = rate.get("rate_grpc_aio", {}).get("median_ops_per_s")
    lines += ["", f"**Rate**: {small['outstanding']} operations outstanding at once (asyncio.gather), "
                  "median of the rounds:", ""]
    rows = []
    for name, r in rate.items():
        rows.append([name, f"{r['median_ops_per_s']:.0f}", decimals(r["median_ops_per_s"] / ref if ref else None),
                     str(r["failures"]) + (f" ({r['errors'][0]})" if r["errors"] else ""),
                     str(len(r["ops_per_s"]))])
    return lines + markdown_table(["contender", "ops/s", "× grpc.aio", "failed calls", "rounds"], rows, None)


def _daemon_cross(doc: dict) -> list[str]:
    cross = doc["cross"]
    lines = ["", "## 3. Cross-node: A on rendezvousd 0 → B on rendezvousd 1 (both daemons on this machine)", "",
             "daemons_mpi: two daemons under `mpiexec -n 2`, protocol grpc+mpi (the tensor's bytes over MPI); "
             "daemons_grpc: two daemons, protocol grpc. send/recv/hop as above; recv and hop include daemon "
             "1's fetch from daemon 0. raw_mpi: mpi4py Send/Recv of a preallocated buffer between two ranks, "
             "from the send's start to the receive's end.", ""]
    rows = []
    for size in doc["args"]["cross_sizes"]:
        raw = cross.get("raw_mpi", {}).get(str(size), {}).get("oneway")
        for name in ("daemons_mpi", "daemons_grpc"):
            c = cross.get(name, {}).get(str(size))
            if not c:
                continue
            rows.append([format_size(size), name, decimals(c["send"]["ms"], 3), decimals(c["recv"]["ms"], 3),
                         decimals(c["recv"]["gbps"]), decimals(c["recv"]["gbps"] / raw["gbps"] if raw else None),
                         decimals(c["hop"]["ms"], 3), decimals(c["hop"]["gbps"]),
                         decimals(c["hop"]["gbps"] / raw["gbps"] if raw else None), str(c["hop"]["samples"])])
        if raw:
            rows.append([format_size(size), "raw_mpi", "-", "-", "-", "-", decimals(raw["ms"], 3),
                         decimals(raw["gbps"]), "1.00", str(raw["samples"])])
    return lines + markdown_table(["size", "contender", "send ms", "recv ms", "recv GB/s", "recv ÷ raw MPI",
                                   "hop ms", "hop GB/s", "hop ÷ raw MPI", "samples"], rows, None)


def _daemon_memory(mem: dict) -> list[str]:
    lines = ["", "## 4. Memory and CPU", "",
             "Peak RSS (VmHWM, reset at the scenario's start; it counts the shared-memory pages a process has "
             "touched, which the daemon and its clients share), RSS at the end, and CPU seconds used during the "
             f"scenario; then each daemon's pool after it. Pool limit {format_size(mem['pool_limit'])} per daemon "
             "(RENDEZVOUS_SHM_POOL_BYTES).", ""]
    rows = []
    for scenario, s in mem["scenarios"].items():
        for label, p in s["processes"].items():
            rows.append([scenario, label, _mib(p["start_rss"]), _mib(p["peak_rss"]) + ("" if p["reset"] else " *"),
                         _mib(p["end_rss"]), _mib(p["end_shmem"]), f"{p['cpu_s']:.1f} of {p['wall_s']:.0f}"])
    lines += markdown_table(["scenario", "process", "RSS at start MiB", "peak RSS MiB", "RSS at end MiB",
                             "of which shared memory MiB", "CPU s (of wall s)"], rows, None)
    lines += ["", "Local hop counts of each client since it connected (how its tensors crossed the local hop):", ""]
    rows = []
    for scenario, s in mem["scenarios"].items():
        for worker, clients in s.get("client_stats", {}).items():
            for client, counts in clients.items():
                rows.append([scenario, f"{worker} ({client})",
                             ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))])
    lines += markdown_table(["after scenario", "client", "counts"], rows, None)
    if any(not p["reset"] for s in mem["scenarios"].values() for p in s["processes"].values()):
        lines += ["", "\\* peak since the process started (its peak could not be reset)."]
    lines += [""]
    rows = []
    for scenario, s in mem["scenarios"].items():
        for name, pool in s["pools"].items():
            if "error" in pool:
                rows.append([scenario, name, pool["error"], "", "", "", ""])
                continue
            rows.append([scenario, name, _mib(pool.get("shm_pool_bytes", 0)),
                         _mib(pool.get("shm_pool_free_bytes", 0)), f"{pool.get('shm_pool_segments', 0):.0f}",
                         f"{pool.get('shm_pool_held', 0):.0f}",
                         "yes" if pool.get("shm_pool_bytes", 0) <= mem["pool_limit"] else "NO"])
    return lines + markdown_table(["scenario", "daemon", "pool MiB", "free MiB", "segments", "held by clients",
                                   "within limit"], rows, None)


# -- rendezvous bench-scale -------------------------------------------------------------------

def scale_markdown(doc: dict[str, Any]) -> str:
    """``scale.md``: per rank before and after, per peer, start-up, threads and descriptors."""
    env = doc["environment"]
    lines = ["# Per-rank cost as peers grow", "",
             f"{doc['created']}; {doc['seconds']:.0f} s; " + ", ".join(f"{k} {v}" for k, v in env.items()) + ".",
             "", "Every rank is one process on this machine running one blocking `rendezvous.Server`; all ranks of "
             "a job share its cores. Before: right after `start()` (and the cluster), no traffic yet. After: "
             f"every rank has sent a {doc['tensors']['small_bytes']}-byte and a "
             f"{format_size(doc['tensors']['big_bytes'])} tensor to every other rank and received both from every "
             "other rank, and every rank is done (received arrays dropped, free heap trimmed). Figures are "
             "medians over the ranks of one job. TCP: established connections owned by the process; *to peers* "
             "= to other ranks' servers (one per gRPC channel) plus peers' connections into this rank's server. "
             "fds exclude the benchmark's own control socket.", "",
             "## Per rank, before and after the full-mesh exchange", ""]
    rows = []
    for r in doc["runs"]:
        b, a = r["median"]["before"], r["median"]["after"]
        rows.append([r["setup"], str(r["ranks"]),
                     f"{whole(b['tcp_established'])} / {whole(a['tcp_established'])}",
                     f"{whole(a['tcp_peer_out'])} + {whole(a['tcp_peer_in'])}", whole(a["tcp_other"]),
                     whole(a["tcp_listen"]), f"{whole(b['threads'])} / {whole(a['threads'])}",
                     f"{whole(b['fds'])} / {whole(a['fds'])}",
                     f"{whole(b['fds_less_pipes'])} / {whole(a['fds_less_pipes'])}",
                     f"{figure(b['rss_bytes'] / MiB, 1)} / {figure(a['rss_bytes'] / MiB, 1)}",
                     figure(a["rss_shmem_bytes"] / MiB, 1), figure(a["peak_rss_bytes"] / MiB, 1)])
    lines += markdown_table(["setup", "ranks", "TCP est. before / after", "after: to peers out + in",
                             "after: other est. TCP", "listening TCP", "threads before / after", "fds before / after",
                             "fds less pipes before / after", "RSS MiB before / after",
                             "of which shared memory after", "peak RSS MiB"], rows)

    lines += ["", "## Per peer", "",
              "Increments per added peer, between the smallest and the largest job: (median of the larger job − "
              "median of the smaller) ÷ (difference in peers), after the exchange unless said. RSS counts "
              "file-backed pages too (shared libraries, which the page cache moves by a MiB between runs); the "
              "anonymous and shared-memory parts are what the process holds itself.", ""]
    rows = []
    for setup, p in doc["per_peer"].items():
        if p is None:
            continue
        rows.append([setup, f"N={p['from_ranks']} → N={p['to_ranks']}", figure(p["connections"]),
                     figure(p["peer_connections"]), figure(p["threads"]), figure(p["fds"]),
                     figure(p["fds_less_pipes"]), figure(p["rss_kib"], 0), figure(p["rss_anon_kib"], 0),
                     figure(p["rss_shmem_kib"], 0), figure(p["rss_less_file_kib_before"], 0)])
    lines += markdown_table(["setup", "between", "TCP connections / peer", "of which to or from peers",
                             "threads / peer", "fds / peer", "fds less pipes / peer", "KiB RSS / peer",
                             "of which anonymous", "of which shared memory",
                             "KiB anonymous + shared / peer before traffic"], rows)
    lines += ["", "Pipes: every rank started by mpiexec's one local proxy inherits two pipe ends per rank started "
                  "before it, so under grpc+mpi the pipe count grows with the rank's index on this machine; that is "
                  "the launcher's, not a per-peer cost, hence the column without pipes."]
    keep = doc["config"]["keepalive_time"]
    if keep:
        lines += ["", f"Keepalive (computed, not measured): every channel pings every keepalive_time = {keep:g} s, "
                      f"so a rank with C outgoing channels sends C / {keep:g} pings per second and answers as many "
                      "from its peers' channels."]
    return "\n".join(lines + _scale_startup(doc) + _scale_kinds(doc)) + "\n"


def _scale_startup(doc: dict[str, Any]) -> list[str]:
    lines = ["", "## Start-up", "",
             "construct: `Server(...)` (under grpc+mpi it initializes MPI: `MPI_Init_thread`, collective); "
             "start: `start()` (bind, serve; under grpc+mpi also the rank map's allgather). "
             "After the last rank: from the last rank entering the collective to the last leaving it (every "
             "process reads one CLOCK_MONOTONIC), so ranks that started late do not count. Warm allgather: the "
             "same entries gathered again after a barrier, once the job's traffic is done.", ""]
    rows = []
    for r in doc["runs"]:
        s = r["startup"]
        mpi = "allgather_s" in s
        rows.append([r["setup"], str(r["ranks"]), figure(s["construct_s"] * 1e3, 1),
                     figure(s["construct_after_last_s"] * 1e3, 1) if r["setup"] == "grpc+mpi" else "-",
                     figure(s["start_s"] * 1e3, 1),
                     figure(s["allgather_s"] * 1e3, 2) if mpi else "-",
                     figure(s["allgather_after_last_s"] * 1e3, 2) if mpi else "-",
                     figure(s["warm_allgather_s"] * 1e3, 2) if "warm_allgather_s" in s else "-",
                     f"{whole(s['entry_bytes'])} / {whole(s['rank_map_bytes'])}" if mpi else "-",
                     figure(s["exchange_s"] * 1e3, 1), figure(r["wall_s"], 1)])
    lines += markdown_table(["setup", "ranks", "construct ms", "MPI_Init after the last rank ms", "start() ms",
                             "allgather in start() ms", "allgather after the last rank ms", "warm allgather ms",
                             "rank map bytes: per rank sent / received", "full-mesh exchange ms", "job wall s"], rows)
    return lines + ["", "Transfers by path over the whole job (consumer side): "
                    + "; ".join(f"{r['setup']} N={r['ranks']}: " + ", ".join(
                        f"{k} {v}" for k, v in sorted(r["transfers_by_path"].items()) if v) for r in doc["runs"])
                    + "."]


def _scale_kinds(doc: dict[str, Any]) -> list[str]:
    lines = ["", "## What the threads and descriptors are (rank 0 of the largest job, after)", ""]
    rows = []
    for setup in doc["per_peer"]:
        runs = [r for r in doc["runs"] if r["setup"] == setup]
        if not runs:
            continue
        big = max(runs, key=lambda r: r["ranks"])
        a = big["per_rank"][0]["after"]
        rows.append([setup, str(big["ranks"]), ", ".join(f"{k} {v}" for k, v in a["thread_names"].items()),
                     ", ".join(f"{k} {v}" for k, v in a["fd_kinds"].items())])
    return lines + markdown_table(["setup", "ranks", "threads by name (py: a Python thread)", "fds by kind"], rows)


# -- progress ---------------------------------------------------------------------------------

class Progress:
    """The progress of a run (``update(done, total, label)``). On a terminal,
    rich's bar with the fraction done, the time so far and ``label``; elsewhere a
    plain line at every tenth: ``bench: 40% after 12s (1 MiB mpi)``, ``bench``
    being ``name``. Lines the run prints meanwhile go through :meth:`write`,
    above the bar. :meth:`close` leaves the bar as it last was."""

    def __init__(self, stream: Any = None, name: str = "bench", *, out: Any = None) -> None:
        self.console = out if out is not None else console(sys.stderr if stream is None else stream)
        self.name = name
        self.start = time.monotonic()
        self.last_tenth = -1
        self._bar: Any = None
        self._task: Any = None

    def update(self, done: int, total: int, label: str) -> None:
        total = max(total, 1)
        done = min(max(done, 0), total)
        if self.console.is_terminal:
            if self._bar is None:
                self._open()
            self._bar.update(self._task, completed=done, total=total, description=label)
            return
        tenth = done * 10 // total
        if tenth == self.last_tenth:
            return
        self.last_tenth = tenth
        from rich.text import Text

        self.console.print(Text(f"{self.name}: {done / total:4.0%} after {time.monotonic() - self.start:.0f}s "
                                f"({label})"), soft_wrap=True)

    def _open(self) -> None:
        from rich.progress import BarColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar

        # Another stream's lines go above the bar only when that stream is the
        # terminal too; a redirected stdout stays where it was sent.
        stdout_here = bool(getattr(sys.stdout, "isatty", lambda: False)())
        self._bar = Bar(BarColumn(bar_width=28), TaskProgressColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}", markup=False), console=self.console,
                        redirect_stdout=stdout_here, redirect_stderr=self.console.file is sys.stderr)
        self._task = self._bar.add_task("", total=1)
        self._bar.start()

    def write(self, text: str) -> None:
        """Print ``text`` (a line another process wrote) on stdout; above the bar
        when both are on the terminal."""
        sys.stdout.write(text)
        sys.stdout.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
