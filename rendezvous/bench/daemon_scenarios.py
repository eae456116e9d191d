"""The scenarios of ``bench-daemon`` (see :mod:`rendezvous.bench.daemon`): the
local hop, small tensors and the rate, cross-node; each a round-robin of its
contenders, run on the processes of a :class:`rendezvous.bench.daemon_fleet.Fleet`,
each sample timed in the worker process that makes the call.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .daemon_fleet import Fleet, transfer_timeout
from .samples import key
from .procs import NO_MPIEXEC, BenchError, Worker, mpiexec
from .stats import format_size

__all__ = ["Bench", "WARMUP"]

MiB = 1 << 20
WARMUP = 2  # untimed samples of each kind per contender and size


#: the client a contender of the local hop receives with (``lent`` sends with the blocking one)
_CLIENTS = {"lent": "blocking"}

class Bench:
    """One run's scenarios, in turn, on ``fleet``'s processes; ``progress(done, total,
    label)`` after every round of a contender."""

    def __init__(self, args: argparse.Namespace, fleet: Fleet, progress: Callable[[int, int, str], None]) -> None:
        self.args = args
        self.fleet = fleet
        self.workers = fleet.workers
        self.progress = progress
        self.counter = 0
        self.done = 0
        self.total = 1

    def step(self, label: str) -> None:
        self.done += 1
        self.progress(self.done, self.total, label)

    def stamp(self) -> int:
        self.counter += 1
        return self.counter

    # -- measuring ---------------------------------------------------------------------------

    def per_round(self, size: int) -> int:
        """Timed samples of each kind per contender, size and round."""
        a = self.args
        wanted = a.samples if a.samples is not None else max(a.least, min(a.most, a.budget // size))
        return max(1, math.ceil(wanted / a.rounds))

    def samples(self, size: int) -> int:
        return self.per_round(size) * self.args.rounds

    def seq_sample(self, A: Worker, B: Worker, client: str, size: int, ring: int, src: int, dst: int
                   ) -> tuple[int, int]:
        """(send ns, recv ns): A sends, then B receives what is already there."""
        stamp = self.stamp()
        k = key(f"t{stamp}", src, dst)
        t = transfer_timeout(size)
        s0, s1 = self._send(A, client, k, size, ring, stamp, t)
        r0, r1 = B.call("recv", _CLIENTS.get(client, client), k, size, stamp, False, t, client == "lent",
                        timeout=t + 15)
        return s1 - s0, r1 - r0

    @staticmethod
    def _send(A: Worker, client: str, k: str, size: int, ring: int, stamp: int, t: float) -> tuple[int, int]:
        """A's send of sample ``stamp``: one of its preallocated arrays, or (``lent``)
        an array of ``Client.empty``."""
        if client == "lent":
            return A.call("send_lent", "blocking", k, size, stamp, timeout=t)
        return A.call("send", client, k, stamp % ring, stamp, timeout=t)

    def hop_sample(self, A: Worker, B: Worker, client: str, size: int, ring: int, src: int, dst: int) -> int:
        """Hop ns: B's recv is posted, A's send starts the clock, B holding the array stops it."""
        stamp = self.stamp()
        k = key(f"t{stamp}", src, dst)
        t = transfer_timeout(size)
        B.post("recv", _CLIENTS.get(client, client), k, size, stamp, True, t, client == "lent")
        B.wait(30, expect="ready")
        s0, _ = self._send(A, client, k, size, ring, stamp, t)
        _, r1 = B.wait(t + 15)
        return r1 - s0

    # -- 1. the local hop ------------------------------------------------------------------------

    def local_hop(self) -> dict[str, Any]:
        a = self.args
        A, B = self.workers["A"], self.workers["B"]
        cells: dict[str, dict[str, dict[str, list[int]]]] = {"local_blocking": {}, "local_lent": {},
                                                              "local_aio": {}, "memcpy": {}}
        for size in a.sizes:
            per_round = self.per_round(size)
            ring = int(min(64, max(2, (256 * MiB) // size)))
            A.call("ring", size, ring, timeout=120)
            src = np.ones(size, np.uint8)
            dst = np.empty(size, np.uint8)
            np.copyto(dst, src)  # both warm
            names = ["local_blocking", "local_lent"] + (["local_aio"] if size in a.aio_sizes else []) + ["memcpy"]
            for name in names:
                cells[name][str(size)] = {"send": [], "recv": [], "hop": []} if name != "memcpy" else {"copy": []}
            for name in names:  # warm-up: segments made and mapped on both sides
                if name == "memcpy":
                    continue
                client = name.split("_")[1]
                for _ in range(WARMUP):
                    self.seq_sample(A, B, client, size, ring, 0, 0)
                    self.hop_sample(A, B, client, size, ring, 0, 0)
            order = list(names)
            for _ in range(a.rounds):
                for name in order:
                    cell = cells[name][str(size)]
                    for _ in range(per_round):
                        if name == "memcpy":
                            t0 = time.perf_counter_ns()
                            np.copyto(dst, src)
                            cell["copy"].append(time.perf_counter_ns() - t0)
                            continue
                        client = name.split("_")[1]
                        s, r = self.seq_sample(A, B, client, size, ring, 0, 0)
                        cell["send"].append(s)
                        cell["recv"].append(r)
                        cell["hop"].append(self.hop_sample(A, B, client, size, ring, 0, 0))
                    self.step(f"local hop {format_size(size)} {name}")
                order = order[1:] + order[:1]
            del src, dst
            A.call("ring", 0, 0)
        return cells

    # -- 2. small tensors ------------------------------------------------------------------------

    def small(self) -> dict[str, Any]:
        a = self.args
        A, B = self.workers["A"], self.workers["B"]
        size = 1024
        n = a.small_ops
        ops: dict[str, list[int]] = {k: [] for k in ("send_blocking", "recv_blocking", "send_aio", "recv_aio",
                                                      "grpc_aio_unary", "grpc_sync_unary")}
        t = 60 + n * 0.05

        def group(name: str, record: bool) -> None:
            if name in ("blocking", "aio"):
                prefix = f"s{self.stamp()}"
                sent = A.call("small_send", name, prefix, n if record else min(n, 50), size, timeout=t)
                got = B.call("small_recv", name, prefix, n if record else min(n, 50), size, 30.0, timeout=t)
                if record:
                    ops[f"send_{name}"] += sent
                    ops[f"recv_{name}"] += got
            else:
                kind = name.split("_")[1]
                took = B.call("grpc_ops", kind, n if record else min(n, 50), size, timeout=t)
                if record:
                    ops[f"{name}_unary"] += took

        order = ["blocking", "aio", "grpc_aio", "grpc_sync"]
        for name in order:
            group(name, record=False)  # warm-up
        for _ in range(a.rounds):
            for name in order:
                group(name, record=True)
                self.step(f"small tensors {name}")
            order = order[1:] + order[:1]

        m = a.outstanding
        rate: dict[str, dict[str, Any]] = {"rate_aio_recv": {"ns": [], "failures": 0, "errors": []},
                                           "rate_grpc_aio": {"ns": [], "failures": 0, "errors": []}}
        order = list(rate)
        tr = 120 + m * 0.05
        for r in range(a.rate_rounds + 1):  # round 0: warm-up
            for name in order:
                if name == "rate_aio_recv":
                    prefix = f"r{self.stamp()}"
                    A.call("send_many", "aio", prefix, m, size, timeout=tr)
                    res = B.call("rate_recv", "aio", prefix, m, size, 60.0, timeout=tr)
                else:
                    res = B.call("grpc_rate", m, size, timeout=tr)
                if r:
                    cell = rate[name]
                    cell["ns"].append(res["ns"])
                    cell["failures"] += res["failures"]
                    if res["error"]:
                        cell["errors"].append(res["error"])
                    self.step(f"rate {name}")
            order = order[1:] + order[:1]
        return {"size": size, "ops": ops, "rate": rate, "outstanding": m}

    # -- 3. cross-node ---------------------------------------------------------------------------

    def cross(self) -> dict[str, Any]:
        a = self.args
        pairs = {"daemons_mpi": (self.workers["C0"], self.workers["C1"]),
                 "daemons_grpc": (self.workers["H0"], self.workers["H1"])}
        cells: dict[str, dict[str, dict[str, list[int]]]] = {"daemons_mpi": {}, "daemons_grpc": {}, "raw_mpi": {}}
        for size in a.cross_sizes:
            per_round = self.per_round(size)
            ring = int(min(64, max(2, (256 * MiB) // size)))
            for A, _ in pairs.values():
                A.call("ring", size, ring, timeout=120)
            for name, (A, B) in pairs.items():
                cells[name][str(size)] = {"send": [], "recv": [], "hop": []}
                for _ in range(WARMUP):
                    self.seq_sample(A, B, "blocking", size, ring, 0, 1)
                    self.hop_sample(A, B, "blocking", size, ring, 0, 1)
            cells["raw_mpi"][str(size)] = {"oneway": []}
            self.fleet.raw_run(size, 1)  # warm-up
            order = ["daemons_mpi", "daemons_grpc", "raw_mpi"]
            for _ in range(a.rounds):
                for name in order:
                    cell = cells[name][str(size)]
                    if name == "raw_mpi":
                        cell["oneway"] += self.fleet.raw_run(size, per_round)
                    else:
                        A, B = pairs[name]
                        for _ in range(per_round):
                            s, r = self.seq_sample(A, B, "blocking", size, ring, 0, 1)
                            cell["send"].append(s)
                            cell["recv"].append(r)
                            cell["hop"].append(self.hop_sample(A, B, "blocking", size, ring, 0, 1))
                    self.step(f"cross-node {format_size(size)} {name}")
                order = order[1:] + order[:1]
            for A, _ in pairs.values():
                A.call("ring", 0, 0)
        return cells

    # -- the whole run ---------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Every scenario of ``--scenarios``; their raw cells (None: not run) and the seconds taken."""
        a = self.args
        want = a.scenarios
        fleet = self.fleet
        launcher = mpiexec() if "cross" in want else None
        if "cross" in want and launcher is None:
            raise BenchError(f"{NO_MPIEXEC}; --scenarios local,small skips the cross-node scenario")
        self.total = ((len(a.sizes) * a.rounds * 2 + sum(1 for s in a.sizes if s in a.aio_sizes) * a.rounds
                       if "local" in want else 0) + (4 * a.rounds + 2 * a.rate_rounds if "small" in want else 0)
                      + (3 * a.rounds * len(a.cross_sizes) if "cross" in want else 0))
        started = time.monotonic()
        local_cells = small = cross_cells = None
        if want & {"local", "small"}:
            self.progress(0, self.total, "starting the daemon and its clients")
            procs = fleet.start_local()
            if "local" in want:
                start = fleet.snapshot_start(procs)
                local_cells = self.local_hop()
                fleet.snapshot_end("local_hop", start, ["local"], ["A", "B"])
            if "small" in want:
                procs = {**procs, **fleet.start_echo()}
                start = fleet.snapshot_start(procs)
                small = self.small()
                fleet.snapshot_end("small", start, ["local"], ["A", "B"])
        if "cross" in want:
            assert launcher is not None
            self.progress(self.done, self.total, "starting the daemon pairs and raw MPI ranks")
            start = fleet.snapshot_start(fleet.start_cross(launcher))
            cross_cells = self.cross()
            fleet.snapshot_end("cross", start, ["mpi0", "mpi1", "grpc0", "grpc1"], ["C0", "C1", "H0", "H1"])
        return {"local": local_cells, "small": small, "cross": cross_cells, "seconds": time.monotonic() - started}
