"""One rank of a ``bench-scale`` job: a blocking :class:`rendezvous.Server`
that reports to the parent (:mod:`rendezvous.bench.scale`) over its control
socket, phase by phase: started (with its timings), measured before any
traffic, exchanged (every rank sends every other one a small and a large
tensor and receives both), measured after, and under ``grpc+mpi`` the rank
map's allgather again on its own.

The parent starts it as ``python -m rendezvous.bench.scale_rank PATH SETUP N
INDEX BIG_BYTES`` (INDEX -1 under mpiexec: the launcher's rank).
"""

from __future__ import annotations

import os
import resource
import sys
import time
import traceback
from typing import Any

from .control import Link

__all__ = ["JOB", "SMALL_BYTES", "BIG_BYTES", "main"]

JOB = "worker"
SMALL_BYTES = 64       # inline on both setups (below the MPI threshold)
BIG_BYTES = 1 << 20    # the MPI optimal path under grpc+mpi
STEP = 1


class RankControl(Link):
    """The rank's end of the parent's Unix socket: messages ``{"kind": ..., ...}``."""

    def send_kind(self, kind: str, **fields: Any) -> None:
        self.send({"kind": kind, **fields})

    def expect(self, kind: str) -> dict[str, Any]:
        msg = self.recv()
        if msg is None:
            raise ConnectionError(f"the parent went away while this rank waited for {kind!r}")
        if msg.get("kind") != kind:
            raise RuntimeError(f"expected {kind!r} from the parent, got {msg.get('kind')!r}")
        return msg


def _key(src: int, dst: int, name: str) -> str:
    from rendezvous.keys import make_key

    dev = "/job:{}/replica:0/task:{}/device:CPU:0"
    return make_key(dev.format(JOB, src), dev.format(JOB, dst), name).format()


def _peer_addresses(cluster: Any, me: Any) -> set[tuple[str, int]]:
    from rendezvous.cluster import parse_address

    out = set()
    for task in cluster.tasks():
        if task != me:
            host, port = parse_address(cluster.address(task))
            out.add((host, int(port)))
    return out


def main(path: str, setup: str, n: int, index: int, big_bytes: int) -> int:
    ctl = RankControl(path)
    try:
        _rank(ctl, setup, n, index, big_bytes)
    except BaseException:
        try:
            ctl.send_kind("error", traceback=traceback.format_exc())
        except OSError:
            pass
        # Never wait in MPI_Finalize for ranks that will not come: the parent
        # kills the job on this message anyway.
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    return 0


def _rank(ctl: RankControl, setup: str, n: int, index: int, big_bytes: int) -> None:
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    import rendezvous
    from rendezvous.cluster import parse_address
    from rendezvous.rank.launch import launcher_rank

    from .footprint import snapshot
    from .rss import release_free_memory

    exclude = {ctl.sock.fileno()}
    overrides: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    if setup == "grpc+mpi":
        where = launcher_rank()
        if where is None:
            raise RuntimeError("grpc+mpi ranks must run under mpiexec")
        index = where[0]
        overrides["mpi_disabled"] = False
        _time_the_rank_map(timings)
    cluster = {JOB: ["127.0.0.1:0"] * n}
    t0 = time.monotonic()
    server = rendezvous.Server(cluster, JOB, index, setup, **overrides)
    t1 = time.monotonic()
    server.start()
    t2 = time.monotonic()
    try:
        ctl.send_kind("started", rank=index, pid=os.getpid(), address=server.target,
                      construct_s=t1 - t0, construct_entered=t0, construct_left=t1, start_s=t2 - t1,
                      start_entered=t1, start_left=t2, **timings)
        full = ctl.expect("cluster").get("cluster")
        if full:
            server.update_cluster(full)
        own_port = int(parse_address(server.target)[1])
        peers = _peer_addresses(server.aio.cluster, server.task)
        release_free_memory()
        before = snapshot(own_port, peers, exclude)
        ctl.send_kind("before", snapshot=before)
        ctl.expect("go")
        ctl.send_kind("exchanged", **_exchange(server, n, index, big_bytes))
        ctl.expect("measure")
        release_free_memory()
        after = snapshot(own_port, peers, exclude)
        extra: dict[str, Any] = {"nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
                                 "event_loop": f"{type(server.loop).__module__}.{type(server.loop).__name__}"}
        if setup == "grpc+mpi":
            from mpi4py import MPI

            extra["mpi"] = " ".join(MPI.Get_library_version().splitlines()[0].split())
        ctl.send_kind("after", snapshot=after, **extra)
        if setup == "grpc+mpi":
            # A second allgather of the same entries, all ranks lined up by a
            # barrier first: the collective alone, its endpoints already made.
            from mpi4py import MPI

            world = MPI.COMM_WORLD
            entry = (JOB, 0, index, server.target)
            world.Barrier()
            t4 = time.monotonic()
            world.allgather(entry)
            ctl.send_kind("warm", allgather_s=time.monotonic() - t4)
        ctl.expect("exit")
    finally:
        server.stop(1.0)


def _time_the_rank_map(timings: dict[str, Any]) -> None:
    """Time the allgather that builds the rank map, from inside ``start()``: the
    clock is CLOCK_MONOTONIC, shared by every process of this machine, so the
    parent can tell the collective's own cost from ranks arriving late."""
    from rendezvous.keys import TaskName
    from rendezvous.mpi.world import MpiWorld, RankAddress

    exchange = MpiWorld.exchange

    def timed_exchange(self: MpiWorld, task: TaskName, address: str,
                       incarnation: int = 0) -> dict[TaskName, RankAddress]:
        from mpi4py import MPI

        timings["exchange_entered"] = time.monotonic()
        table = exchange(self, task, address, incarnation)
        timings["exchange_left"] = time.monotonic()
        # what each rank contributes, as world.exchange builds and mpi4py pickles it
        timings["entry_bytes"] = len(MPI.pickle.dumps((task.job, task.replica, task.task, address, incarnation)))
        timings["entries"] = len(table)
        return table

    MpiWorld.exchange = timed_exchange  # type: ignore[method-assign]


def _exchange(server: Any, n: int, index: int, big_bytes: int) -> dict[str, Any]:
    """The full mesh: a small and a large tensor to every other rank, both from every
    other rank (checked, then dropped); its time, the bytes received, the paths taken."""
    import numpy as np

    others = [p for p in range(n) if p != index]
    small = np.arange(SMALL_BYTES // 4, dtype=np.float32) + index
    big = np.full(big_bytes // 4, index, dtype=np.float32)  # one array, sent to every peer
    t0 = time.monotonic()
    for p in others:
        server.send(_key(index, p, "small"), small, step_id=STEP)
        server.send(_key(index, p, "big"), big, step_id=STEP)
    received = 0
    for p in others:
        a = server.recv(_key(p, index, "small"), STEP, timeout=120)
        b = server.recv(_key(p, index, "big"), STEP, timeout=120)
        if a.nbytes != SMALL_BYTES or b.nbytes != big.nbytes or a[1] != 1 + p or b[0] != p or b[-1] != p:
            raise AssertionError(f"rank {index}: wrong tensors from rank {p}")
        received += a.nbytes + b.nbytes
        del a, b
    exchange_s = time.monotonic() - t0
    stats = {path: {"transfers": s.get("transfers", 0), "bytes": s.get("bytes", 0), "served": s.get("served", 0)}
             for path, s in server.stats().items() if path in ("local", "grpc", "mpi")}
    return {"exchange_s": exchange_s, "received_bytes": received, "stats": stats}

if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])))
