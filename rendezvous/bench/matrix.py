"""The matrix of ``rendezvous bench``: every public way to move a tensor, each
as a fraction of its raw transport in the same run, and the floors that
guard it.

A *cell* is one way a user moves a tensor: the blocking ``rendezvous.Server``
or ``rendezvous.aio.Server`` x requests over gRPC or over MPI x the inline
(default) or the optimal path, each server also with ``MPI_DISABLED=1``, and
the local client through rendezvousd on its session socket and on its local
gRPC address. Its *raw transport* is what carries its bytes at that size,
measured in the same run: raw MPI for what moves over MPI (requests over
MPI; the optimal path from 1 MiB, where the bytes dominate the gRPC
request), raw ``grpc.aio`` for the rest. Each figure is the cell's median
bandwidth over the raw one's (for 1 KiB, that is the raw median round trip
over the cell's): 1.0 is the raw transport's speed.

The floors (:data:`FLOORS_FILE`, ``rendezvous/bench/floors.json``,
:func:`check`) are the least each
cell may measure at each size: set well below today's figures, so that the
machine's noise never trips them but a path made several times slower does.
:func:`check` judges a run against them and names every cell below its floor.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from .stats import format_size, parse_size

__all__ = ["CELLS", "RAW_CELLS", "FLOORS_FILE", "reference", "cells", "raw_ratios", "rates", "matrix_rows", "Breach", "Floors", "load_floors", "sizes_of",
           "check", "FLOORS_SCHEMA"]

MiB = 1 << 20
FLOORS_SCHEMA = "rendezvous-bench-floors/1"
#: the floors this package ships: ``make bench-guard``'s and ``rendezvous doctor``'s
FLOORS_FILE = Path(__file__).with_name("floors.json")

#: every cell of the matrix, in table order: (name, what it is)
CELLS: tuple[tuple[str, str], ...] = (
    ("blocking_default", "blocking Server, inline path, requests over gRPC"),
    ("blocking_optimal", "blocking Server, optimal path, requests over gRPC (the README's default)"),
    ("blocking_default_mr", "blocking Server, inline path, requests over MPI"),
    ("blocking_optimal_mr", "blocking Server, optimal path, requests over MPI"),
    ("blocking_grpc_only", "blocking Server, MPI_DISABLED=1"),
    ("default", "aio.Server, inline path, requests over gRPC"),
    ("optimal", "aio.Server, optimal path, requests over gRPC"),
    ("default_mr", "aio.Server, inline path, requests over MPI"),
    ("optimal_mr", "aio.Server, optimal path, requests over MPI"),
    ("grpc_only", "aio.Server, MPI_DISABLED=1"),
    ("local_socket", "local Client via rendezvousd, session socket"),
    ("local_grpc", "local Client via rendezvousd, local gRPC address"),
)


def reference(cell: str, size: int) -> str:
    """The raw transport ``cell`` is compared with at ``size``: ``mpi`` or ``grpc``."""
    base = cell.removeprefix("blocking_")
    if base in ("default", "grpc_only", "local_grpc"):
        return "grpc"
    if base.endswith("_mr"):
        return "mpi"
    return "mpi" if size >= MiB else "grpc"  # optimal path, local socket: a gRPC request, MPI bytes


def cells(doc: Mapping[str, Any]) -> dict[tuple[str, int], float | None]:
    """``(cell, size)`` -> the cell's bandwidth over its raw transport's, for every
    cell the run measured (None where the raw transport was not measured)."""
    by = {(t["contender"], t["size"]): t for t in doc["transfers"]}
    out: dict[tuple[str, int], float | None] = {}
    for name, _ in CELLS:
        for size in doc["sizes"]:
            cell = by.get((name, size))
            if cell is None:
                continue
            ref = by.get((reference(name, size), size))
            out[(name, size)] = cell["gbps"] / ref["gbps"] if ref and ref["gbps"] else None
    return out


#: the raw transports judged against the machine itself: raw MPI's bandwidth over a
#: memcpy's of the same bytes in one process (within a node, a single-copy MPI
#: moves close to a memcpy; without one, far less)
RAW_CELLS = ("mpi",)


def raw_ratios(doc: Mapping[str, Any]) -> dict[tuple[str, int], float | None]:
    """``(raw transport, size)`` -> its bandwidth over memcpy's in the same run,
    from each one's fastest transfer where the run has it: what the machine can
    do, which a busy neighbour slows only now and then. (Measured here at 64
    MiB: 0.42-0.43 with CMA off by both statistics; with CMA on 0.82-0.93, and
    in a run on a loaded machine a median of 0.47 where the fastest gave 0.75.)"""
    by = {(t["contender"], t["size"]): t for t in doc["transfers"]}
    out: dict[tuple[str, int], float | None] = {}
    for name in RAW_CELLS:
        for size in doc["sizes"]:
            cell, ref = by.get((name, size)), by.get(("memcpy", size))
            if cell is None or ref is None:
                continue
            if cell.get("min_us") and ref.get("min_us"):
                out[(name, size)] = ref["min_us"] / cell["min_us"]
            else:
                out[(name, size)] = cell["gbps"] / ref["gbps"] if ref["gbps"] else None
    return out


def rates(doc: Mapping[str, Any]) -> dict[str, float | None]:
    """cell -> its recvs/s with many outstanding (the rate test, 1 KiB) over its
    raw transport's, for every cell the rate test measured: each one's best
    round where the run has it. (Rounds of one run differ by up to 2.5 x on
    this machine, on the code before and after a change alike: ``optimal_mr``
    read 0.036-0.040 of raw MPI by median rounds in three runs of seven, where
    its best rounds gave 0.077-0.088.)"""
    if not doc.get("rate"):
        return {}
    by = {r["contender"]: r for r in doc["rate"]["results"]}
    size = doc["rate"]["bytes"]
    out: dict[str, float | None] = {}
    for name, _ in CELLS:
        r = by.get(name)
        if r is not None:
            ref = by.get(reference(name, size))
            stat = "best_per_s" if ref and r.get("best_per_s") and ref.get("best_per_s") else "per_s"
            out[name] = r[stat] / ref[stat] if ref and ref[stat] else None
    return out


class Floors(NamedTuple):
    """The guard's floors: per cell and size, per cell for the rate test, and per
    raw transport and size against memcpy (``raw``; within one node only)."""

    cells: dict[str, dict[int, float]]
    rate: dict[str, float]
    raw: dict[str, dict[int, float]] = {}


def _mark(value: float | None, ref: str, floor: float | None) -> str:
    text = ("-" if value is None else f"{value:.3g}") + " " + ref[0]
    if floor is not None and (value is None or value < floor):
        text += f" <{floor:g}!"
    return text


def matrix_rows(doc: Mapping[str, Any], floors: Floors | None = None) -> tuple[list[str], list[list[str]]]:
    """The matrix as a table: a header (cell, each size, the rate) and one row
    per cell measured: at each size the ratio to its raw transport (``m`` raw
    MPI, ``g`` raw gRPC), ``<floor!`` where it is below the guard's floor."""
    got, rate = cells(doc), rates(doc)
    header = ["cell", *(format_size(size) for size in doc["sizes"])]
    if rate:
        header.append(f"{doc['rate']['outstanding']} in flight")
    rows = []
    for name, _ in CELLS:
        if not any((name, size) in got for size in doc["sizes"]) and name not in rate:
            continue
        row = [name]
        for size in doc["sizes"]:
            floor = floors.cells.get(name, {}).get(size) if floors else None
            row.append(_mark(got[(name, size)], reference(name, size), floor) if (name, size) in got else "")
        if rate:
            floor = floors.rate.get(name) if floors else None
            row.append(_mark(rate[name], reference(name, doc["rate"]["bytes"]), floor) if name in rate else "")
        rows.append(row)
    raw = raw_ratios(doc)
    for name in RAW_CELLS:
        if not any((name, size) in raw for size in doc["sizes"]):
            continue
        row = [f"raw {name} (x memcpy)"]
        for size in doc["sizes"]:
            floor = floors.raw.get(name, {}).get(size) if floors else None
            row.append(_mark(raw[(name, size)], "c", floor) if (name, size) in raw else "")
        if rate:
            row.append("")
        rows.append(row)
    return header, rows


class Breach(NamedTuple):
    """A cell below its floor (``measured`` None: the run did not measure it)."""

    cell: str
    size: int  # 0: the rate test
    measured: float | None
    floor: float
    ref: str

    def __str__(self) -> str:
        ref = "a memcpy" if self.ref == "memcpy" else f"raw {self.ref}"
        got = "not measured" if self.measured is None else f"{self.measured:.3g} x {ref}"
        where = "with many recvs in flight" if self.size == 0 else f"at {format_size(self.size)}"
        return f"{self.cell} {where}: {got}, below its floor {self.floor:g}"


def load_floors(path: str | Path) -> Floors:
    """The floors file, ValueError naming what is wrong in it::

        {"schema": "rendezvous-bench-floors/1",
         "floors": {"blocking_optimal": {"1K": 0.3, "64M": 0.3}, ...},
         "rate": {"optimal": 0.5, ...}}

    sizes in binary units; each floor a fraction of the cell's raw transport."""
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("schema") != FLOORS_SCHEMA:
        raise ValueError(f"schema is {doc.get('schema') if isinstance(doc, dict) else None!r}, "
                         f"expected {FLOORS_SCHEMA!r}")
    known = {name for name, _ in CELLS}

    def cell(name: str) -> str:
        if name not in known:
            raise ValueError(f"unknown cell {name!r}; known: {', '.join(name for name, _ in CELLS)}")
        return name

    def floor(value: Any) -> float:
        if not isinstance(value, (int, float)) or not 0 < value:
            raise ValueError(f"a floor is a positive fraction of the raw transport, not {value!r}")
        return float(value)

    def raw_name(name: str) -> str:
        if name not in RAW_CELLS:
            raise ValueError(f"unknown raw transport {name!r}; known: {', '.join(RAW_CELLS)}")
        return name

    by_cell = {cell(name): {parse_size(size): floor(f) for size, f in by_size.items()}
               for name, by_size in doc.get("floors", {}).items()}
    rate = {cell(name): floor(f) for name, f in doc.get("rate", {}).items()}
    raw = {raw_name(name): {parse_size(size): floor(f) for size, f in by_size.items()}
           for name, by_size in doc.get("raw", {}).items()}
    if not any(by_cell.values()):
        raise ValueError("no floors")
    return Floors(by_cell, rate, raw)


def sizes_of(floors: Floors) -> list[int]:
    """Every size a floor is set for."""
    return sorted({size for by_size in (*floors.cells.values(), *floors.raw.values()) for size in by_size})


def check(doc: Mapping[str, Any], floors: Floors) -> list[Breach]:
    """Every cell of ``floors`` below its floor in ``doc``, or not measured there."""
    got, rate = cells(doc), rates(doc)
    out = []
    for name, by_size in floors.cells.items():
        for size, floor in sorted(by_size.items()):
            value = got.get((name, size))
            if value is None or value < floor:
                out.append(Breach(name, size, value, floor, reference(name, size)))
    rate_bytes = doc["rate"]["bytes"] if doc.get("rate") else 1024
    for name, floor in floors.rate.items():
        value = rate.get(name)
        if value is None or value < floor:
            out.append(Breach(name, 0, value, floor, reference(name, rate_bytes)))
    raw = raw_ratios(doc)
    for name, by_size in floors.raw.items():
        for size, floor in sorted(by_size.items()):
            value = raw.get((name, size))
            if value is None or value < floor:
                out.append(Breach(name, size, value, floor, "memcpy"))
    return out
