"""``bench-daemon``'s targets: each with the ratio measured in a run and whether
it is met."""

from __future__ import annotations

from typing import Any

from .stats import format_size

__all__ = ["daemon_targets"]

MiB = 1 << 20


def _gbps(doc: dict, section: str, name: str, size: int, metric: str) -> float | None:
    cells = doc.get(section) or {}
    cell = cells.get(name, {}).get(str(size), {}).get(metric)
    return cell["gbps"] if cell else None


def _goal(tid: str, what: str, measured: float | None, op: str, goal: float) -> dict[str, Any]:
    met = None if measured is None else (measured >= goal if op == ">=" else measured <= goal)
    return {"id": tid, "what": what, "measured": measured, "op": op, "goal": goal, "met": met}


def daemon_targets(doc: dict) -> list[dict[str, Any]]:
    """Each target with the ratio measured in this run and whether it is met (None: not measured)."""
    out = []
    hop_cells = doc.get("local_hop") or {}
    sizes = doc["args"]["sizes"]

    def local(tid: str, what: str, name: str, size: int, goal: float) -> None:
        hop, ref = _gbps(doc, "local_hop", name, size, "hop"), _gbps(doc, "local_hop", "memcpy", size, "copy")
        out.append(_goal(tid, what, hop / ref if hop and ref else None, ">=", goal))

    for client in ("blocking", "aio"):
        name = f"local_{client}"
        big = [s for s in sizes if s >= 64 * MiB and str(s) in hop_cells.get(name, {})]
        if client == "blocking" and not big:
            out.append(_goal("local_hop_large_blocking", "local hop >= 64 MiB (blocking): hop GB/s / memcpy GB/s",
                             None, ">=", 0.5))
        for s in big:
            local(f"local_hop_{s}_{client}", f"local hop {format_size(s)} ({client}): hop GB/s / memcpy GB/s",
                  name, s, 0.5)
        if client == "blocking" or str(MiB) in hop_cells.get(name, {}):
            local(f"local_hop_1MiB_{client}", f"local hop 1 MiB ({client}): hop GB/s / memcpy GB/s", name, MiB, 0.25)
    lent = [s for s in sizes if str(s) in hop_cells.get("local_lent", {})]
    if lent:
        def hop_ms(name: str, size: int) -> float | None:
            cell = hop_cells.get(name, {}).get(str(size), {}).get("hop")
            return cell["median_us"] if cell else None

        small_ms, big_ms = hop_ms("local_lent", min(lent)), hop_ms("local_lent", max(lent))
        out.append(_goal("local_lent_flat", f"lent local hop: {format_size(max(lent))} time / "
                                            f"{format_size(min(lent))} time",
                         big_ms / small_ms if big_ms and small_ms and len(lent) > 1 else None, "<=", 2.0))
        if 64 * MiB in lent:
            copy_ms, lent_ms = hop_ms("local_blocking", 64 * MiB), hop_ms("local_lent", 64 * MiB)
            out.append(_goal("local_lent_64MiB", "local hop 64 MiB: the copying send's time / the lent one's",
                             copy_ms / lent_ms if copy_ms and lent_ms else None, ">=", 10.0))
    small = doc.get("small") or {"ops": {}, "rate": {}, "outstanding": 0}
    ops = small["ops"]
    ref = ops.get("grpc_aio_unary", {}).get("median_us")
    for name in ("send_blocking", "recv_blocking", "send_aio", "recv_aio"):
        value = ops.get(name, {}).get("median_us")
        op, client = name.split("_")
        out.append(_goal(f"small_{name}", f"1 KiB {op} ({client}) latency / bare grpc.aio unary latency",
                         value / ref if value and ref else None, "<=", 1.0))
    rate = small["rate"]
    mine, theirs = (rate.get(k, {}).get("median_ops_per_s") for k in ("rate_aio_recv", "rate_grpc_aio"))
    out.append(_goal("rate", f"{small['outstanding'] or doc['args']['outstanding']} recvs outstanding (aio) / "
                             "as many bare grpc.aio unary calls, ops/s",
                     mine / theirs if mine and theirs else None, ">=", 3.0))
    hop, ref = _gbps(doc, "cross", "daemons_mpi", 64 * MiB, "hop"), _gbps(doc, "cross", "raw_mpi", 64 * MiB, "oneway")
    out.append(_goal("cross_mpi_64MiB", "cross-node 64 MiB through two daemons on the MPI path: hop GB/s / raw "
                                        "MPI GB/s", hop / ref if hop and ref else None, ">=", 0.6))
    return out
