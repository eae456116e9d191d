"""One rank of the benchmark job (run under ``mpiexec -n 2``).

Rank 1 produces, rank 0 consumes and times. Both ranks walk the same
schedule, so they always agree on which contender, size and batch come next;
a line-based control connection on loopback (not MPI: a rank waiting there
must not spin a core while the other one measures) says "ready" and "done"
around every batch.

The schedule interleaves the contenders: at each size every contender runs a
batch in turn, and the order rotates every round, so drift in the machine's
speed (other work, thermal, page cache) hits all of them alike.

Phases: warm-up, the size sweep (latency and bandwidth), the rate with many
recvs outstanding, the wake-up (a recv after both ranks were quiet, requests
over MPI), peak RSS during one transfer of the largest size, and the CPU an
idle rank uses. Rank 0 returns the raw measurements;
:mod:`rendezvous.bench.results` turns them into the results document.
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import rss
from .contenders import BlockingRendezvous, Contender, Gloo, Memcpy, RawGrpc, RawMpi, ServerContender, cell_name, pattern
from .gpu import GPU_CONTENDERS, DeviceToHost, GpuRendezvous, gpu_backend, is_gpu_contender, staging_setting
from .local_contenders import LOCAL_CELLS, LocalClient
from .stats import samples_for

__all__ = ["Options", "run_rank", "CONTENDERS", "HOSTS_ENV", "LOOPBACK", "hosts", "address"]

#: the ranks' two hosts, ``A,B`` (rank 0 on A); unset: both on 127.0.0.1
HOSTS_ENV = "RENDEZVOUS_BENCH_HOSTS"
LOOPBACK = "127.0.0.1"


def hosts() -> list[str] | None:
    """The ranks' hosts from ``RENDEZVOUS_BENCH_HOSTS`` (None: unset, both on loopback)."""
    import os

    listed = [h.strip() for h in os.environ.get(HOSTS_ENV, "").split(",") if h.strip()]
    if not listed:
        return None
    if len(listed) != 2:
        raise SystemExit(f"rendezvous bench: {HOSTS_ENV} must name 2 hosts (rank 0's first), not {len(listed)}")
    return listed


def address(host: str, port: int) -> str:
    """``host:port`` (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

#: every contender, in the order tables and plots list them
#: the rank servers' cells: both APIs x inline/optimal x requests over gRPC/MPI, and MPI off
CELLS = tuple(api + cell_name(optimal, mr, False) for api in ("", "blocking_")
              for optimal in (False, True) for mr in (False, True)) + ("grpc_only", "blocking_grpc_only")
CONTENDERS = ("mpi", "mpi_alloc", "grpc", *CELLS, *LOCAL_CELLS, "gloo", "memcpy", *GPU_CONTENDERS)
DEFAULT_SIZES = (1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20)


@dataclass
class Options:
    sizes: tuple[int, ...] = DEFAULT_SIZES
    contenders: tuple[str, ...] = CONTENDERS
    #: bytes to move per contender and size; samples are clamped to [least, most]
    budget_bytes: int = 2 << 30
    least: int = 8
    most: int = 1000
    rounds: int = 10
    outstanding: int = 1000
    rate_bytes: int = 1 << 10
    rate_rounds: int = 7
    rss: bool = True
    idle_seconds: float = 10.0
    #: with requests over MPI: how long both ranks stay quiet before each
    #: recv of the wake-up test (see Rank.wakeup); empty: no such test
    quiet_seconds: tuple[float, ...] = (0.5, 2.0)
    #: recvs per contender and quiet length in that test
    wakeup_repeats: int = 5
    quick: bool = False
    #: GPU contenders: "off", "fake" (host memory standing in) or "cupy"
    gpu: str = "off"

    @classmethod
    def quick_mode(cls, **changes: Any) -> "Options":
        base: dict[str, Any] = dict(budget_bytes=256 << 20, least=3, most=200, rounds=4, rate_rounds=3,
                    idle_seconds=5.0, wakeup_repeats=3, quick=True)
        base.update(changes)
        return cls(**base)


class RunControl:
    """JSON lines over one loopback TCP connection between the two ranks."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, rank: int, comm: Any, hosts: list[str]) -> "RunControl":
        """Rank 1 listens on its host, rank 0 connects to it."""
        if rank == 1:
            family = socket.AF_INET6 if ":" in hosts[1] else socket.AF_INET
            listener = socket.create_server((hosts[1], 0), family=family)
            listener.settimeout(120)
            comm.bcast(listener.getsockname()[1], root=1)
            conn, _ = listener.accept()
            listener.close()
            conn.settimeout(None)
            reader, writer = await asyncio.open_connection(sock=conn, limit=1 << 24)
        else:
            port = comm.bcast(None, root=1)
            reader, writer = await asyncio.open_connection(hosts[1], port, limit=1 << 24)
        return cls(reader, writer)

    async def send(self, obj: Any) -> None:
        self.writer.write(json.dumps(obj).encode() + b"\n")
        await self.writer.drain()

    async def recv(self, timeout: float = 900) -> Any:
        line = await asyncio.wait_for(self.reader.readline(), timeout)
        if not line:
            raise ConnectionError("the other rank closed the control connection")
        return json.loads(line)

    async def expect(self, word: str) -> Any:
        msg = await self.recv()
        if not isinstance(msg, dict) or word not in msg:
            raise RuntimeError(f"control: expected {word!r}, got {msg!r}")
        return msg[word]

    def close(self) -> None:
        self.writer.close()


class Context:
    """What contenders share on one rank. ``hosts``: each rank's host, where its
    servers bind and its peer reaches them (both 127.0.0.1 on one machine)."""

    def __init__(self, MPI: Any, comm: Any, control: RunControl, hosts: list[str] | None = None) -> None:
        self.MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.control = control
        self.hosts = hosts or [LOOPBACK, LOOPBACK]
        self._source: tuple[int, np.ndarray] | None = None

    @property
    def host(self) -> str:
        """This rank's host."""
        return self.hosts[self.rank]

    def cluster(self, job: str) -> dict[str, list[str]]:
        """A cluster of ``job``'s two tasks, each at its rank's host, ports the OS picks."""
        return {job: [address(h, 0) for h in self.hosts]}

    def source(self, n: int) -> np.ndarray:
        """The producer's ``n`` bytes (one array per size, reused by every contender)."""
        if self._source is None or self._source[0] != n:
            self._source = None
            self._source = (n, pattern(n))
        return self._source[1]

    def drop_source(self) -> None:
        self._source = None


def _torch_usable() -> tuple[bool, str]:
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return False, "torch is not installed: gloo not measured"
    if not dist.is_available() or not dist.is_gloo_available():
        return False, f"torch {torch.__version__} has no gloo backend: gloo not measured"
    return True, f"torch {torch.__version__}"


def _build(ctx: Context, names: tuple[str, ...], gpu: Any = None) -> list[Contender]:
    made: dict[str, Contender] = {
        "mpi": RawMpi(ctx), "mpi_alloc": RawMpi(ctx, fresh=True), "grpc": RawGrpc(ctx),
        "gloo": Gloo(ctx), "memcpy": Memcpy(ctx),
    }
    for cls in (ServerContender, BlockingRendezvous):
        for optimal, mr, off in ((False, False, False), (True, False, False), (False, True, False),
                                 (True, True, False), (False, False, True)):
            c = cls(ctx, optimal, mpi_requests=mr, disabled=off)
            if c.name in names:  # a server is made only for the cells measured
                made[c.name] = c
    for session in (True, False):
        local = LocalClient(ctx, session)
        made[local.name] = local
    if gpu is not None:
        made.update({"gpu_staged": GpuRendezvous(ctx, gpu, None), "gpu_serial": GpuRendezvous(ctx, gpu, 1),
                     "d2h": DeviceToHost(ctx, gpu), **{n: GpuRendezvous(ctx, gpu, None, n) for n in names if staging_setting(n)}})
    return [made[n] for n in (*CONTENDERS, *(n for n in names if n not in CONTENDERS)) if n in names and n in made]


def _rotate(items: list, k: int) -> list:
    if not items:
        return items
    k %= len(items)
    return items[k:] + items[:k]


class Rank:
    def __init__(self, opts: Options, ctx: Context, contenders: list[Contender],
                 progress: Callable[[int, int, str], None]) -> None:
        self.opts = opts
        self.ctx = ctx
        self.ctl = ctx.control
        self.contenders = contenders
        self.progress = progress
        self.batch_id = 0
        self.last_cpu = (0.0, 0.0)  # (consumer, producer) CPU seconds of the last batch, on rank 0
        self.done = 0
        self.total = 0

    def _tick(self, label: str) -> None:
        self.done += 1
        if self.ctx.rank == 0:
            self.progress(self.done, self.total, label)

    async def batch(self, c: Contender, n: int, count: int, *, rate: bool = False, quiet: float = 0.0) -> Any:
        """One batch of ``count`` transfers; on rank 0 what ``consume`` measured
        (``quiet``: seconds rank 0 waits, both ranks idle, between the
        tensors being produced and its first recv)."""
        self.batch_id += 1
        bid = self.batch_id
        result = None
        if self.ctx.rank == 1:
            await (c.rate_prepare if rate else c.prepare)(n, count, bid)
            await self.ctl.send({"ready": bid})
            cpu0 = time.process_time()
            await (c.rate_serve if rate else c.serve)(n, count, bid)
            got = await self.ctl.expect("done")
            if got != bid:
                raise RuntimeError(f"control: rank 0 finished batch {got}, expected {bid}")
            await self.ctl.send({"cpu": time.process_time() - cpu0})
        else:
            got = await self.ctl.expect("ready")
            if got != bid:
                raise RuntimeError(f"control: rank 1 prepared batch {got}, expected {bid}")
            if quiet:
                await asyncio.sleep(quiet)  # the quiet being measured, not synchronization
            cpu0 = time.process_time()
            result = await (c.rate_consume if rate else c.consume)(n, count, bid)
            cpu = time.process_time() - cpu0
            await self.ctl.send({"done": bid})
            # CPU of each whole process (every thread) while the batch ran
            self.last_cpu = (cpu, await self.ctl.expect("cpu"))
        await c.finish(n, bid)
        return result

    async def sync(self, payload: Any = None) -> Any:
        """Both ranks meet; each gets the other's ``payload``."""
        await self.ctl.send({"sync": payload})
        return await self.ctl.expect("sync")

    def plan(self) -> list[tuple[int, int, int]]:
        """(size, rounds, per-batch count) for every size."""
        o = self.opts
        out = []
        for n in o.sizes:
            samples = samples_for(n, budget_bytes=o.budget_bytes, least=o.least, most=o.most)
            rounds = max(1, min(o.rounds, samples))
            out.append((n, rounds, -(-samples // rounds)))
        return out

    async def run(self) -> dict[str, Any] | None:
        o = self.opts
        plan = self.plan()
        k = len(self.contenders)
        raters = [c for c in self.contenders if c.rate]
        rss_ones = [c for c in self.contenders if c.rss] if o.rss and rss.supported() else []
        self.total = (1 + sum(1 + rounds for _, rounds, _ in plan)) * k + o.rate_rounds * len(raters) \
            + len(rss_ones) + len(self._wakers()) * len(o.quiet_seconds) + 1
        samples: dict[str, dict[int, list[int]]] = {c.name: {} for c in self.contenders}
        cpu: dict[str, dict[int, list]] = {c.name: {} for c in self.contenders}

        # Warm-up: connections, first-call costs.
        for c in self.contenders:
            await self.batch(c, min(o.sizes), 2)
            self._tick(f"warm-up {c.name}")

        for n, rounds, per in plan:
            for c in self.contenders:  # untimed: buffers of this size touched once
                await self.batch(c, n, 1)
                self._tick(f"{_fmt(n)} warm-up {c.name}")
            for r in range(rounds):
                for c in _rotate(self.contenders, r):
                    got = await self.batch(c, n, per)
                    if got is not None:
                        samples[c.name].setdefault(n, []).extend(got)
                        total = cpu[c.name].setdefault(n, [0.0, 0.0, 0])
                        total[0] += self.last_cpu[0]
                        total[1] += self.last_cpu[1]
                        total[2] += per
                    self._tick(f"{_fmt(n)} {c.name} round {r + 1}/{rounds}")
            self.ctx.drop_source()
            for c in self.contenders:
                c.release()

        rates: dict[str, list[dict[str, int]]] = {c.name: [] for c in raters}
        for r in range(o.rate_rounds):
            for c in _rotate(raters, r):
                got = await self.batch(c, o.rate_bytes, o.outstanding, rate=True)
                if got is not None:
                    rates[c.name].append({"elapsed_ns": got[0], "errors": got[1]})
                self._tick(f"rate {c.name} round {r + 1}/{o.rate_rounds}")
        self.ctx.drop_source()

        wakeup = await self.wakeup()

        peaks: dict[str, list[dict[str, int]]] = {}
        size = max(o.sizes)
        for c in rss_ones:
            peaks[c.name] = await self.peak_rss(c, size)
            self._tick(f"peak RSS {c.name}")

        idle = await self.idle() if o.idle_seconds > 0 else []
        self._tick("idle CPU")
        if self.ctx.rank != 0:
            return None
        return {"samples": samples, "cpu": cpu, "rates": rates, "rss": {"size": size, "by_contender": peaks} if peaks else None,
                "idle": idle, "wakeup": wakeup, "plan": [list(p) for p in plan]}

    def _wakers(self) -> list[Contender]:
        """The contenders with requests over MPI: a rank idle for a while probes
        for requests ever less often (ProgressEngine._listen_pause)."""
        return [c for c in self.contenders if getattr(c, "mpi_requests", False)] if self.opts.quiet_seconds else []

    async def wakeup(self) -> list[dict[str, Any]]:
        """The smallest size's recv when both ranks were quiet for each of
        ``quiet_seconds`` after the tensor was produced (rank 0, ns each):
        what the first request of a step after a pause pays."""
        n = min(self.opts.sizes)
        out = []
        for quiet in self.opts.quiet_seconds:
            for c in self._wakers():
                got: list[int] = []
                for _ in range(self.opts.wakeup_repeats):
                    got.extend(await self.batch(c, n, 1, quiet=quiet) or [])
                self._tick(f"wake-up after {quiet:g} s {c.name}")
                out.append({"contender": c.name, "quiet_s": quiet, "size": n, "samples_ns": got})
        return out

    async def peak_rss(self, c: Contender, n: int) -> list[dict[str, int]]:
        """RSS one transfer of ``n`` bytes brings into each rank: the high-water
        mark is reset, then the producer makes the tensor and sends it, the
        consumer receives it. Buffers kept between batches are dropped first,
        receive buffers kept for reuse too (a cold transfer), and free heap
        memory is handed back, so the baseline holds no earlier transfer."""
        for other in self.contenders:
            other.release()
        self.ctx.drop_source()
        gc.collect()
        rss.release_free_memory()
        await self.sync()
        base = rss.reset_peak()
        own = c if isinstance(c, ServerContender) else None  # a contender that may send copies of its source
        if own is not None:
            distinct, own.distinct = own.distinct, False  # the source is the produced tensor: no copy of its own
        try:
            await self.batch(c, n, 1)
        finally:
            if own is not None:
                own.distinct = distinct
        mine = {"rank": self.ctx.rank, "baseline_bytes": base, "peak_bytes": rss.peak()}
        c.release()
        self.ctx.drop_source()
        theirs = await self.sync(mine)
        return sorted([mine, theirs], key=lambda r: r["rank"])

    async def idle(self) -> list[dict[str, float]]:
        """CPU both ranks use over ``idle_seconds`` with every server, channel and
        process group up and nothing to do."""
        gc.collect()
        await self.sync()
        wall0, cpu0, threads0 = time.monotonic(), time.process_time(), rss.thread_cpu_seconds()
        await asyncio.sleep(self.opts.idle_seconds)  # measuring idleness, not synchronizing
        wall, cpu = time.monotonic() - wall0, time.process_time() - cpu0
        # which threads used it (clock ticks: 10 ms each), busiest first
        spent = {name: t - threads0.get(name, 0.0) for name, t in rss.thread_cpu_seconds().items()}
        threads = {name: round(t, 3) for name, t in sorted(spent.items(), key=lambda kv: -kv[1]) if t > 0}
        mine = {"rank": self.ctx.rank, "seconds": wall, "cpu_seconds": cpu, "cpu_fraction": cpu / wall,
                "threads": threads}
        theirs = await self.sync(mine)
        return sorted([mine, theirs], key=lambda r: r["rank"])


def _fmt(n: int) -> str:
    from .stats import format_size

    return format_size(n)


async def run_rank(opts: Options, progress: Callable[[int, int, str], None]) -> dict[str, Any] | None:
    """Run this rank's part; rank 0 returns the raw measurements, rank 1 None."""
    from rendezvous.mpi.world import import_mpi

    MPI = import_mpi()
    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        raise SystemExit(f"rendezvous bench needs exactly 2 MPI ranks, got {world.Get_size()}")
    comm = world.Dup()
    where = hosts() or [LOOPBACK, LOOPBACK]
    control = await RunControl.connect(comm.Get_rank(), comm, where)
    ctx = Context(MPI, comm, control, where)
    notes: list[str] = []
    names = tuple(opts.contenders)
    if "gloo" in names:
        ok, why = _torch_usable()
        both = comm.allreduce(int(ok), op=MPI.MIN)
        if not both:
            names = tuple(n for n in names if n != "gloo")
            notes.append(why if not ok else "torch is not usable on the other rank: gloo not measured")
        else:
            notes.append(f"gloo measured with {why}")
    gpu = None
    if any(is_gpu_contender(n) for n in names):
        if opts.gpu == "off":
            names = tuple(n for n in names if not is_gpu_contender(n))
            notes.append("GPU contenders not measured: no GPU here (--gpu fake measures the staging "
                         "pipeline with host memory standing in for the GPU)")
        else:
            gpu, why = gpu_backend(opts.gpu)
            notes.append(why)
    contenders = _build(ctx, names, gpu)
    for c in contenders:
        await c.setup()
    try:
        raw = await Rank(opts, ctx, contenders, progress).run()
    finally:
        for c in reversed(contenders):
            await c.close()
        control.close()
    comm.Barrier()
    comm.Free()
    if raw is None:
        return None
    raw["contenders"] = {c.name: c.label for c in contenders}
    raw["notes"] = notes
    raw["environment"] = _environment(MPI)
    return raw


def _environment(MPI: Any) -> dict[str, Any]:
    from .results import environment

    loop = asyncio.get_running_loop()
    env = environment(memory=False, mpi=" ".join(MPI.Get_library_version().splitlines()[0].split()),
                      event_loop=f"{type(loop).__module__}.{type(loop).__name__}")
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch"] = torch.__version__
    return env
