"""The results document: built from rank 0's raw measurements, checked
against its schema, judged against the targets, rendered as a terminal table,
written as JSON and plotted as a PNG.

Every figure is put next to the same figure of raw MPI (``vs_mpi``) and raw
gRPC (``vs_grpc``) from the same run: on a shared, noisy machine only those
ratios are comparable between runs, not absolute times.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .stats import format_size, percentile, ratio, summarize

__all__ = ["SCHEMA", "SchemaError", "build", "validate", "targets", "render", "markdown", "write_json",
           "write_plot", "load"]

SCHEMA = "rendezvous-bench/1"
REFERENCES = ("mpi", "grpc")
MiB = 1 << 20


class SchemaError(ValueError):
    """A results document does not have the shape this module writes."""


# -- building -----------------------------------------------------------------

def _vs(value: float | None, ref: Mapping[str, Any] | None, key: str) -> float | None:
    return ratio(value, None if ref is None else ref.get(key))


def build(raw: Mapping[str, Any], *, quick: bool, args: Mapping[str, Any] | None = None,
          now: datetime.datetime | None = None) -> dict[str, Any]:
    """The results document from what :func:`rendezvous.bench.worker.run_rank` returned."""
    contenders = dict(raw["contenders"])
    cells: dict[tuple[str, int], dict[str, Any]] = {}
    sizes: set[int] = set()
    cpu = raw.get("cpu", {})
    for name, by_size in raw["samples"].items():
        for size, samples in by_size.items():
            size = int(size)
            sizes.add(size)
            cells[(name, size)] = {"contender": name, "size": size, **summarize(samples, size)}
            spent = cpu.get(name, {}).get(size) or cpu.get(name, {}).get(str(size))
            per = (lambda s: s * 1e6 / spent[2]) if spent and spent[2] else (lambda s: None)
            cells[(name, size)]["cpu_us"] = {"consumer": per(spent[0]) if spent else None,
                                             "producer": per(spent[1]) if spent else None}
    transfers = []
    for size in sorted(sizes):
        for name in contenders:
            cell = cells.get((name, size))
            if cell is None:
                continue
            for refname in REFERENCES:
                ref = cells.get((refname, size))
                vs = {k: _vs(cell[k], ref, k) for k in ("gbps", "median_us", "p99_us")}
                for side in ("consumer", "producer"):
                    vs[f"cpu_{side}"] = ratio(cell["cpu_us"][side], ref["cpu_us"][side] if ref else None)
                cell[f"vs_{refname}"] = vs
            transfers.append(cell)

    rate = None
    if raw.get("rates"):
        results = []
        for name, rounds in raw["rates"].items():
            if not rounds:
                continue
            per_s = sorted(raw["outstanding"] / (r["elapsed_ns"] / 1e9) * (1 - r["errors"] / raw["outstanding"])
                           for r in rounds)
            results.append({"contender": name, "rounds": len(rounds), "per_s": percentile(per_s, 50),
                            "best_per_s": per_s[-1], "errors": sum(r["errors"] for r in rounds)})
        by_name = {r["contender"]: r for r in results}
        for r in results:
            for refname in REFERENCES:
                ref = by_name.get(refname)
                r[f"vs_{refname}"] = ratio(r["per_s"], ref["per_s"] if ref else None)
        rate = {"bytes": raw["rate_bytes"], "outstanding": raw["outstanding"], "results": results}

    rss = None
    if raw.get("rss"):
        size = raw["rss"]["size"]
        results = []
        for name, ranks in raw["rss"]["by_contender"].items():
            rows = []
            for r in ranks:
                added = max(0, r["peak_bytes"] - r["baseline_bytes"])
                rows.append({**r, "transfer_bytes": added, "x_size": added / size})
            results.append({"contender": name, "ranks": rows})
        by_name = {r["contender"]: r for r in results}
        for r in results:
            ref = by_name.get("mpi")
            r["vs_mpi"] = [ratio(row["transfer_bytes"], ref["ranks"][i]["transfer_bytes"]) if ref else None
                           for i, row in enumerate(r["ranks"])]
        rss = {"size": size, "results": results}

    doc = {
        "schema": SCHEMA,
        "created": (now or datetime.datetime.now(datetime.timezone.utc)).isoformat(timespec="seconds"),
        "quick": quick,
        "args": dict(args or {}),
        "environment": dict(raw.get("environment", {})),
        "notes": list(raw.get("notes", [])),
        "contenders": contenders,
        "sizes": sorted(sizes),
        "transfers": transfers,
        "rate": rate,
        "rss": rss,
        "idle": list(raw.get("idle", [])),
    }
    doc["targets"] = targets(doc)
    return doc


# -- targets --------------------------------------------------------------------

def _cell(doc: Mapping[str, Any], name: str, size: int) -> Mapping[str, Any] | None:
    for t in doc["transfers"]:
        if t["contender"] == name and t["size"] == size:
            return t
    return None


def _target(tid: str, what: str, measured: float | None, op: str, limit: float, note: str = "") -> dict[str, Any]:
    ok = None
    if measured is not None and not math.isnan(measured):
        ok = {">=": measured >= limit, "<=": measured <= limit, "<": measured < limit}[op]
    return {"id": tid, "what": what, "measured": measured, "op": op, "limit": limit, "ok": ok, "note": note}


def targets(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each target with the ratio measured in this run; ``ok`` is None where the
    run did not measure what the target needs."""
    out = []
    sizes = doc["sizes"]
    for size in [s for s in sizes if s >= MiB]:
        opt, mpi, gloo = _cell(doc, "optimal", size), _cell(doc, "mpi", size), _cell(doc, "gloo", size)
        out.append(_target(f"optimal_vs_mpi_{size}", f"optimal path bandwidth at {format_size(size)} vs raw MPI",
                           ratio(opt and opt["gbps"], mpi and mpi["gbps"]), ">=", 0.90))
        out.append(_target(f"optimal_vs_gloo_{size}", f"optimal path bandwidth at {format_size(size)} vs gloo",
                           ratio(opt and opt["gbps"], gloo and gloo["gbps"]), ">=", 2.0,
                           "" if gloo else "gloo not measured"))
    for size, limit in ((MiB, 1.0), (16 * MiB, 1.0), (128 * MiB, 2.0)):
        if size not in sizes:
            continue
        d, g = _cell(doc, "default", size), _cell(doc, "grpc", size)
        out.append(_target(f"default_vs_grpc_{size}", f"default path bandwidth at {format_size(size)} vs raw gRPC unary",
                           ratio(d and d["gbps"], g and g["gbps"]), ">=", limit))
    if 1024 in sizes:
        g = _cell(doc, "grpc", 1024)
        for name in ("default", "optimal"):
            c = _cell(doc, name, 1024)
            out.append(_target(f"latency_1k_{name}", f"{name} path 1 KiB round trip (median) vs raw gRPC unary",
                               ratio(c and c["median_us"], g and g["median_us"]), "<=", 1.2))
    if doc.get("rate"):
        by_name = {r["contender"]: r for r in doc["rate"]["results"]}
        g = by_name.get("grpc")
        for name in ("default", "optimal"):
            r = by_name.get(name)
            out.append(_target(f"rate_{name}",
                               f"{name} path recvs/s with {doc['rate']['outstanding']} outstanding vs raw gRPC unary",
                               ratio(r and r["per_s"], g and g["per_s"]), ">=", 2.0))
    out.extend(_mpi_request_targets(doc))
    if doc.get("rss"):
        size = doc["rss"]["size"]
        by_name = {r["contender"]: r for r in doc["rss"]["results"]}
        for name, limit in (("default", 3.0), ("optimal", 1.5)):
            r = by_name.get(name)
            worst = max(row["x_size"] for row in r["ranks"]) if r else None
            out.append(_target(f"rss_{name}", f"{name} path RSS a {format_size(size)} transfer adds, worst rank,"
                                              " in tensor sizes", worst, "<=", limit))
    for size in [s for s in sizes if s >= 16 * MiB]:
        staged, d2h, mpi = _cell(doc, "gpu_staged", size), _cell(doc, "d2h", size), _cell(doc, "mpi", size)
        if staged is None:
            continue  # GPU contenders not measured in this run
        bound = min(d2h["gbps"], mpi["gbps"]) if d2h and mpi else None
        serial = _cell(doc, "gpu_serial", size)
        overlap = ratio(staged["gbps"], serial["gbps"]) if serial else None
        note = f"{overlap:.2f}x the bandwidth with one chunk in flight" if overlap else ""
        out.append(_target(f"gpu_staged_{size}", f"staged GPU->GPU bandwidth at {format_size(size)} vs "
                                                 "min(device->host copy, raw MPI)",
                           ratio(staged["gbps"], bound), ">=", 0.8, note))
    if doc.get("idle"):
        worst = max(r["cpu_fraction"] for r in doc["idle"])
        out.append(_target("idle_cpu", "idle rank CPU, worst rank, fraction of one core", worst, "<", 0.02))
    return out


def _mpi_request_targets(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Requests over MPI (``optimal_mr``): 1 KiB latency against raw unary and
    gloo, bandwidth against raw MPI, the rate with many recvs outstanding."""
    out = []
    sizes = doc["sizes"]
    if not any(t["contender"] == "optimal_mr" for t in doc["transfers"]):
        return out
    if 1024 in sizes:
        c, g, gloo = _cell(doc, "optimal_mr", 1024), _cell(doc, "grpc", 1024), _cell(doc, "gloo", 1024)
        out.append(_target("latency_1k_optimal_mr", "1 KiB round trip (median), requests over MPI, vs raw gRPC unary",
                           ratio(c and c["median_us"], g and g["median_us"]), "<=", 1 / 3))
        out.append(_target("latency_1k_optimal_mr_gloo", "1 KiB round trip (median), requests over MPI, vs gloo",
                           ratio(c and c["median_us"], gloo and gloo["median_us"]), "<=", 1.0,
                           "" if gloo else "gloo not measured"))
    for size in [s for s in sizes if s >= MiB]:
        c, mpi = _cell(doc, "optimal_mr", size), _cell(doc, "mpi", size)
        out.append(_target(f"optimal_mr_vs_mpi_{size}",
                           f"optimal path, requests over MPI, bandwidth at {format_size(size)} vs raw MPI",
                           ratio(c and c["gbps"], mpi and mpi["gbps"]), ">=", 0.9 if size >= 16 * MiB else 0.5))
    if doc.get("rate"):
        by_name = {r["contender"]: r for r in doc["rate"]["results"]}
        r, g = by_name.get("optimal_mr"), by_name.get("grpc")
        out.append(_target("rate_optimal_mr", f"recvs/s with {doc['rate']['outstanding']} outstanding, requests "
                                              "over MPI, vs raw gRPC unary",
                           ratio(r and r["per_s"], g and g["per_s"]), ">=", 10.0))
    return out


# -- schema -----------------------------------------------------------------------

_NUM = (int, float)
_OPT_NUM = (int, float, type(None))
_RATIOS = {"gbps": _OPT_NUM, "median_us": _OPT_NUM, "p99_us": _OPT_NUM, "cpu_consumer": _OPT_NUM,
           "cpu_producer": _OPT_NUM}
_SPEC: dict[str, Any] = {
    "schema": str,
    "created": str,
    "quick": bool,
    "args": dict,
    "environment": dict,
    "notes": [str],
    "contenders": {"*": str},
    "sizes": [int],
    "transfers": [{
        "contender": str, "size": int, "samples": int, "median_us": _NUM, "p99_us": _NUM, "min_us": _NUM,
        "mean_us": _NUM, "gbps": _NUM, "vs_mpi": _RATIOS, "vs_grpc": _RATIOS,
        "cpu_us": {"consumer": _OPT_NUM, "producer": _OPT_NUM},
    }],
    "rate": ({"bytes": int, "outstanding": int, "results": [{
        "contender": str, "rounds": int, "per_s": _NUM, "best_per_s": _NUM, "errors": int,
        "vs_mpi": _OPT_NUM, "vs_grpc": _OPT_NUM}]}, None),
    "rss": ({"size": int, "results": [{
        "contender": str, "vs_mpi": [_OPT_NUM], "ranks": [{
            "rank": int, "baseline_bytes": int, "peak_bytes": int, "transfer_bytes": int, "x_size": _NUM}]}]},
            None),
    "idle": [{"rank": int, "seconds": _NUM, "cpu_seconds": _NUM, "cpu_fraction": _NUM}],
    "targets": [{"id": str, "what": str, "measured": _OPT_NUM, "op": str, "limit": _NUM,
                 "ok": (bool, type(None)), "note": str}],
}


def _check(value: Any, spec: Any, path: str) -> None:
    if isinstance(spec, tuple) and len(spec) == 2 and spec[1] is None and not isinstance(spec[0], type):
        if value is None:
            return
        spec = spec[0]
    if isinstance(spec, list):
        if not isinstance(value, list):
            raise SchemaError(f"{path}: expected a list, got {type(value).__name__}")
        for i, item in enumerate(value):
            _check(item, spec[0], f"{path}[{i}]")
        return
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise SchemaError(f"{path}: expected an object, got {type(value).__name__}")
        if "*" in spec:
            for k, v in value.items():
                _check(v, spec["*"], f"{path}.{k}")
            return
        for k, sub in spec.items():
            if k not in value:
                raise SchemaError(f"{path}: missing {k!r}")
            _check(value[k], sub, f"{path}.{k}")
        return
    types = spec if isinstance(spec, tuple) else (spec,)
    # bool is an int in Python; a count or a size must not be a bool
    if isinstance(value, bool) and bool not in types:
        raise SchemaError(f"{path}: expected {'/'.join(t.__name__ for t in types)}, got bool")
    if not isinstance(value, types):
        raise SchemaError(f"{path}: expected {'/'.join(t.__name__ for t in types)}, got {type(value).__name__}")


def validate(doc: Any) -> None:
    """Raise :class:`SchemaError` naming the first field that is missing or of the wrong type."""
    _check(doc, _SPEC, "$")
    if doc["schema"] != SCHEMA:
        raise SchemaError(f"$.schema: expected {SCHEMA!r}, got {doc['schema']!r}")
    names = set(doc["contenders"])
    for i, t in enumerate(doc["transfers"]):
        if t["contender"] not in names:
            raise SchemaError(f"$.transfers[{i}].contender: {t['contender']!r} is not a listed contender")
        if t["size"] not in doc["sizes"]:
            raise SchemaError(f"$.transfers[{i}].size: {t['size']} is not a listed size")


def write_json(doc: Mapping[str, Any], path: Path) -> None:
    validate(doc)
    path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")


def save(out: str | Path, doc: Mapping[str, Any], text: str, json_name: str, md_name: str) -> None:
    """Write a command's results document and its Markdown into folder ``out``,
    then print the Markdown and where both went (bench-steps, -daemon, -scale)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / json_name).write_text(json.dumps(doc, indent=1) + "\n")
    (out / md_name).write_text(text)
    print(text)
    print(f"results: {out / json_name} (Markdown: {out / md_name})")


def load(path: Path) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text())
    validate(doc)
    return doc


# -- rendering --------------------------------------------------------------------


def _rss_rows(r: Mapping[str, Any], labels: Mapping[str, str]) -> list[list[str]]:
    """One row per contender and rank of the peak-RSS test (terminal and Markdown)."""
    rows = []
    for x in r["results"]:
        for row, vs in zip(x["ranks"], x["vs_mpi"]):
            rows.append([labels.get(x["contender"], x["contender"]), f"rank {row['rank']}",
                         f"{row['baseline_bytes'] / MiB:.0f}", f"{row['peak_bytes'] / MiB:.0f}",
                         f"{row['transfer_bytes'] / MiB:.0f}", _f(row["x_size"]), _f(vs)])
    return rows

def _f(value: float | None, digits: int = 2) -> str:
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


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    return [fmt(header), fmt(["-" * w for w in widths]), *[fmt(r) for r in rows]]


def render(doc: Mapping[str, Any]) -> str:
    """The results as text tables, then the targets."""
    labels = doc["contenders"]
    lines = [f"rendezvous bench ({'quick' if doc['quick'] else 'full'}), {doc['created']}",
             "  " + ", ".join(f"{k} {v}" for k, v in doc["environment"].items()), ""]
    rows = []
    last = None
    for t in doc["transfers"]:
        size = format_size(t["size"]) if t["size"] != last else ""
        last = t["size"]
        cpu = t["cpu_us"]
        rows.append([size, labels.get(t["contender"], t["contender"]), _f(t["median_us"]), _f(t["p99_us"]),
                     _f(t["gbps"], 3), _f(t["vs_mpi"]["gbps"]), _f(t["vs_grpc"]["gbps"]),
                     f"{_f(cpu['consumer'])} / {_f(cpu['producer'])}", str(t["samples"])])
    lines.append("Round trips rank 1 -> rank 0 (bandwidth from the median; x = bandwidth ratio, same run;"
                 " cpu = CPU time per transfer of the consumer / producer process)")
    lines += _table(["size", "contender", "median us", "p99 us", "GB/s", "x mpi", "x grpc", "cpu us", "n"], rows)
    if doc.get("rate"):
        r = doc["rate"]
        lines += ["", f"Rate: {format_size(r['bytes'])} tensors, {r['outstanding']} recvs outstanding"]
        lines += _table(["contender", "", "per s", "best", "x mpi", "x grpc", "errors"],
                        [[labels.get(x["contender"], x["contender"]), "", _f(x["per_s"]), _f(x["best_per_s"]),
                          _f(x["vs_mpi"]), _f(x["vs_grpc"]), str(x["errors"])] for x in r["results"]])
    if doc.get("rss"):
        r = doc["rss"]
        lines += ["", f"Peak RSS during one {format_size(r['size'])} transfer (added over the rank's baseline; "
                      "producer = rank 1, consumer = rank 0)"]
        rows = _rss_rows(r, labels)
        lines += _table(["contender", "rank", "base MiB", "peak MiB", "added MiB", "x size", "x mpi"], rows)
    if doc.get("idle"):
        lines += ["", "Idle: " + ", ".join(f"rank {r['rank']} {r['cpu_fraction']:.2%} of a core over "
                                           f"{r['seconds']:.0f} s" for r in doc["idle"])]
    lines += ["", "Targets"]
    for t in doc["targets"]:
        mark = {True: "met   ", False: "MISSED", None: "n/a   "}[t["ok"]]
        note = f" ({t['note']})" if t["note"] else ""
        lines.append(f"  {mark} {t['what']}: {_f(t['measured'])} {t['op']} {t['limit']:g}{note}")
    for n in doc["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def _md(header: list[str], rows: list[list[str]]) -> list[str]:
    align = ["---" if i < 2 else "---:" for i in range(len(header))]
    return ["| " + " | ".join(r) + " |" for r in [header, align, *rows]]


def markdown(doc: Mapping[str, Any]) -> str:
    """The results and targets as Markdown tables (what BENCHMARKS.md shows)."""
    labels = doc["contenders"]
    env = doc["environment"]
    out = [f"Run of {doc['created']} ({'quick' if doc['quick'] else 'full'}): "
           + ", ".join(f"{k} {v}" for k, v in env.items()) + ".", ""]
    rows = []
    for t in doc["transfers"]:
        cpu = t["cpu_us"]
        rows.append([format_size(t["size"]), labels.get(t["contender"], t["contender"]), _f(t["median_us"]),
                     _f(t["p99_us"]), _f(t["gbps"], 3), _f(t["vs_mpi"]["gbps"]), _f(t["vs_grpc"]["gbps"]),
                     f"{_f(cpu['consumer'])} / {_f(cpu['producer'])}", str(t["samples"])])
    out += _md(["size", "contender", "median µs", "p99 µs", "GB/s", "× (a)", "× (b)", "CPU µs cons. / prod.", "n"],
               rows)
    if doc.get("rate"):
        r = doc["rate"]
        out += ["", f"Rate, {format_size(r['bytes'])} tensors, {r['outstanding']} recvs outstanding:", ""]
        out += _md(["contender", "", "recvs/s (median)", "best", "× (a)", "× (b)", "errors"],
                   [[labels.get(x["contender"], x["contender"]), "", _f(x["per_s"]), _f(x["best_per_s"]),
                     _f(x["vs_mpi"]), _f(x["vs_grpc"]), str(x["errors"])] for x in r["results"]])
    if doc.get("rss"):
        r = doc["rss"]
        out += ["", f"Peak RSS during one {format_size(r['size'])} transfer, added over each rank's baseline "
                    "(rank 0 consumes, rank 1 produces):", ""]
        rows = _rss_rows(r, labels)
        out += _md(["contender", "rank", "baseline MiB", "peak MiB", "added MiB", "× size", "× (a)"], rows)
    if doc.get("idle"):
        out += ["", "Idle CPU: " + ", ".join(f"rank {r['rank']} {r['cpu_fraction']:.2%} of one core over "
                                             f"{r['seconds']:.0f} s" for r in doc["idle"]) + "."]
    out += ["", "Targets:", ""]
    out += _md(["target", "", "measured", "required", "status"],
               [[t["what"], "", _f(t["measured"]), f"{t['op']} {t['limit']:g}",
                 {True: "met", False: "**missed**", None: "not measured"}[t["ok"]]
                 + (f" ({t['note']})" if t["note"] else "")] for t in doc["targets"]])
    for n in doc["notes"]:
        out.append(f"\nNote: {n}.")
    return "\n".join(out) + "\n"


_STYLE = {"memcpy": dict(linestyle="--", color="grey"), "mpi": dict(color="black"),
          "mpi_alloc": dict(color="black", linestyle=":"), "grpc": dict(color="tab:red"),
          "default": dict(color="tab:orange"), "optimal": dict(color="tab:blue"), "gloo": dict(color="tab:green"),
          "default_mr": dict(color="tab:orange", linestyle="-."),
          "optimal_mr": dict(color="tab:blue", linestyle="-.")}


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
