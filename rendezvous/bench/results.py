"""The numbers of the results documents: what each command's raw measurements
come to, the ratios between contenders of one run, and the targets judged.

* ``rendezvous bench``: :func:`build` makes the whole document (schema
  ``rendezvous-bench/1``) from rank 0's raw measurements, :func:`targets`
  judges it, :func:`validate` checks its shape. Every figure is put next to
  the same figure of raw MPI (``vs_mpi``) and raw gRPC (``vs_grpc``) from the
  same run: on a shared, noisy machine only those ratios are comparable
  between runs, not absolute times.
* ``bench-daemon``: :func:`summary` (one cell); its targets are :mod:`.daemon_results`.
* ``bench-scale``: :func:`scale_run` (medians over the ranks of one job),
  :func:`scale_per_peer` (increments per added peer).
* every command: :func:`environment`, the machine a document was measured on.

How the documents look on a terminal and in Markdown is
:mod:`rendezvous.bench.report`'s.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from .stats import format_size, percentile, ratio, summarize

__all__ = ["SCHEMA", "SchemaError", "build", "validate", "targets", "environment", "summary",
           "scale_run", "scale_per_peer"]

SCHEMA = "rendezvous-bench/1"
REFERENCES = ("mpi", "grpc")
KiB, MiB = 1 << 10, 1 << 20


class SchemaError(ValueError):
    """A results document does not have the shape this module writes."""


def environment(memory: bool = True, **more: Any) -> dict[str, Any]:
    """The machine and the libraries a run measured: Python, platform, CPUs, the
    memory (``memory``), numpy, grpcio, then ``more``."""
    import grpc
    import numpy as np

    env: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count()}
    if memory:
        env["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    env.update(numpy=np.__version__, grpcio=grpc.__version__, **more)
    return env


# -- rendezvous bench ---------------------------------------------------------------

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
        "wakeup": [_wakeup(w) for w in raw.get("wakeup") or []],
    }
    doc["targets"] = targets(doc)
    return doc


# -- targets --------------------------------------------------------------------

def _wakeup(w: Mapping[str, Any]) -> dict[str, Any]:
    """One contender and quiet length of the wake-up test, with its median and
    worst recv in µs."""
    us = sorted(ns / 1e3 for ns in w["samples_ns"])
    return {**w, "median_us": percentile(us, 50) if us else None, "max_us": us[-1] if us else None}


def _cell(doc: Mapping[str, Any], name: str, size: int) -> Any:  # a cell of the JSON document, or None
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
    # The README's first pattern, with its default settings (the blocking Server,
    # the optimal path asked over gRPC), and with MPI switched off.
    if _cell(doc, "blocking_optimal", 64 * MiB) is not None:
        b, mpi = _cell(doc, "blocking_optimal", 64 * MiB), _cell(doc, "mpi", 64 * MiB)
        out.append(_target("blocking_default_settings_64m", "blocking Server, default settings, bandwidth at "
                                                            "64 MiB vs raw MPI",
                           ratio(b and b["gbps"], mpi and mpi["gbps"]), ">=", 0.9))
    if _cell(doc, "blocking_grpc_only", 16 * MiB) is not None:
        b, g = _cell(doc, "blocking_grpc_only", 16 * MiB), _cell(doc, "grpc", 16 * MiB)
        out.append(_target("blocking_grpc_only_16m", "blocking Server, MPI_DISABLED=1, bandwidth at 16 MiB vs "
                                                     "raw gRPC unary",
                           ratio(b and b["gbps"], g and g["gbps"]), ">=", 1.0))
    if doc.get("rss"):
        size = doc["rss"]["size"]
        by_name = {r["contender"]: r for r in doc["rss"]["results"]}
        for name, limit in (("default", 3.0), ("optimal", 1.5)):
            r = by_name.get(name)
            worst = max(row["x_size"] for row in r["ranks"]) if r else None
            out.append(_target(f"rss_{name}", f"{name} path RSS a {format_size(size)} transfer adds, worst rank,"
                                              " in tensor sizes", worst, "<=", limit))
    out += _gpu_targets(doc, sizes)
    if doc.get("idle"):
        worst = max(r["cpu_fraction"] for r in doc["idle"])
        out.append(_target("idle_cpu", "idle rank CPU, worst rank, fraction of one core", worst, "<", 0.02))
    return out


def _gpu_targets(doc: Mapping[str, Any], sizes: Sequence[int]) -> list[dict[str, Any]]:
    """Staged GPU->GPU (and each setting of ``--gpu-staging``) against
    min(device->host copy, raw MPI), from 16 MiB."""
    out: list[dict[str, Any]] = []
    swept = [n for n in doc["contenders"] if n.startswith("gpu_staged_")]  # --gpu-staging's settings
    for size in [s for s in sizes if s >= 16 * MiB]:
        d2h, mpi = _cell(doc, "d2h", size), _cell(doc, "mpi", size)
        bound = min(d2h["gbps"], mpi["gbps"]) if d2h and mpi else None
        for name in ("gpu_staged", *swept):
            staged = _cell(doc, name, size)
            if staged is None:
                continue  # GPU contenders not measured in this run
            serial = _cell(doc, "gpu_serial", size)
            overlap = ratio(staged["gbps"], serial["gbps"]) if serial else None
            note = f"{overlap:.2f}x the bandwidth with one chunk in flight" if overlap else ""
            what = "staged GPU->GPU" if name == "gpu_staged" else doc["contenders"][name].replace("rendezvous ", "")
            out.append(_target(f"{name}_{size}", f"{what} bandwidth at {format_size(size)} vs "
                                                 "min(device->host copy, raw MPI)",
                               ratio(staged["gbps"], bound), ">=", 0.8, note))
    return out


def _mpi_request_targets(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Requests over MPI (``optimal_mr``): 1 KiB latency against raw unary and
    gloo, bandwidth against raw MPI, the rate with many recvs outstanding;
    the blocking Server's 1 KiB latency (``blocking_mr``) against raw unary."""
    out = []
    sizes = doc["sizes"]
    b, g = _cell(doc, "blocking_default_mr", 1024), _cell(doc, "grpc", 1024)
    if b is not None:
        out.append(_target("latency_1k_blocking_default_mr", "1 KiB round trip (median), blocking Server, requests over MPI, "
                                                     "vs raw gRPC unary",
                           ratio(b["median_us"], g and g["median_us"]), "<=", 0.5))
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


# -- rendezvous bench-daemon -----------------------------------------------------------

def summary(samples_ns: list[int], nbytes: int) -> dict[str, Any]:
    """One cell: :func:`rendezvous.bench.stats.summarize` and the median in ms."""
    s = summarize(samples_ns, nbytes)
    return {**s, "ms": s["median_us"] / 1e3}


# -- rendezvous bench-scale ------------------------------------------------------------

#: measured numbers summarized per N (median over ranks), before and after
_FIELDS = ("tcp_established", "tcp_peer", "tcp_peer_out", "tcp_peer_in", "tcp_other", "tcp_listen", "threads",
           "fds", "fds_less_pipes", "rss_bytes", "peak_rss_bytes", "rss_anon_bytes", "rss_file_bytes",
           "rss_shmem_bytes", "rss_less_file_bytes")
#: the per-peer increments: (name in the document, field, phase, scale)
_PER_PEER = (("connections", "tcp_established", "after", 1), ("peer_connections", "tcp_peer", "after", 1),
             ("threads", "threads", "after", 1), ("fds", "fds", "after", 1),
             ("fds_less_pipes", "fds_less_pipes", "after", 1),
             ("rss_kib", "rss_bytes", "after", 1 / KiB), ("rss_anon_kib", "rss_anon_bytes", "after", 1 / KiB),
             ("rss_shmem_kib", "rss_shmem_bytes", "after", 1 / KiB),
             ("rss_less_file_kib_before", "rss_less_file_bytes", "before", 1 / KiB))


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def scale_run(raw: dict[str, Any]) -> dict[str, Any]:
    """One job's raw per-rank results with their medians, start-up and transfers by path."""
    ranks = raw["per_rank"]
    med = {phase: {f: _median([r[phase][f] for r in ranks]) for f in _FIELDS} for phase in ("before", "after")}
    start = {"construct_s": _median([r["construct_s"] for r in ranks]),
             "start_s": _median([r["start_s"] for r in ranks]),
             "exchange_s": _median([r["exchange_s"] for r in ranks])}
    # A collective's own cost: from the last rank entering it to the last leaving.
    start["construct_after_last_s"] = (max(r["construct_left"] for r in ranks)
                                       - max(r["construct_entered"] for r in ranks))
    if all("exchange_entered" in r for r in ranks):
        start["allgather_after_last_s"] = (max(r["exchange_left"] for r in ranks)
                                           - max(r["exchange_entered"] for r in ranks))
        start["allgather_s"] = _median([r["exchange_left"] - r["exchange_entered"] for r in ranks])
        start["entry_bytes"] = _median([r["entry_bytes"] for r in ranks])
        start["rank_map_bytes"] = sum(r["entry_bytes"] for r in ranks)  # what every rank receives
    if all("warm_allgather_s" in r for r in ranks):
        start["warm_allgather_s"] = _median([r["warm_allgather_s"] for r in ranks])
    paths: dict[str, int] = {}
    for r in ranks:
        for path, s in r["stats"].items():
            paths[path] = paths.get(path, 0) + s["transfers"]
    return {**raw, "median": med, "startup": start, "transfers_by_path": paths}


def scale_per_peer(runs: list[dict[str, Any]], setup: str) -> dict[str, Any] | None:
    """Increments per added peer of ``setup``, between its smallest and largest job
    (of runs made by :func:`scale_run`); None with fewer than two job sizes."""
    mine = sorted((r for r in runs if r["setup"] == setup), key=lambda r: r["ranks"])
    if len(mine) < 2 or mine[0]["ranks"] == mine[-1]["ranks"]:
        return None
    lo, hi = mine[0], mine[-1]
    peers = hi["ranks"] - lo["ranks"]
    out: dict[str, Any] = {"from_ranks": lo["ranks"], "to_ranks": hi["ranks"]}
    for name, field, phase, scale in _PER_PEER:
        out[name] = (hi["median"][phase][field] - lo["median"][phase][field]) * scale / peers
    return out
