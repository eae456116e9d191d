"""``rendezvous bench-scale``: what one rank costs as the number of peers grows.

For every N of ``--ranks`` and every setup of ``--setups``, N ranks run on
this machine, each one blocking :class:`rendezvous.Server` (job ``worker``,
task = rank), in two setups:

* ``grpc``: protocol ``grpc``; N plain processes, each binds
  ``127.0.0.1:0`` and reports its address, and the parent hands the whole
  cluster back (what :func:`rendezvous.rank.launch.run_local` does);
* ``grpc+mpi``: protocol ``grpc+mpi`` under ``mpiexec -n N``; cluster entries
  ``127.0.0.1:0``, resolved by the MPI allgather in ``Server.start()``.

Each rank times its server's construction (under ``grpc+mpi`` that is
``MPI_Init``, in ``MpiWorld.join``) and ``start()`` (bind and serve; under
``grpc+mpi`` also the allgather that builds the rank map, timed on its own
too), then measures its own process twice: before any traffic, and after a
full-mesh exchange (every rank sends one 64-byte and one 1 MiB tensor to
every other rank and receives both from every other rank) once every rank
is done with it. A measurement is read from ``/proc/self``: established
TCP connections owned by the process (its socket fds matched against the
inodes of ``/proc/net/tcp`` and ``tcp6``), split into connections to peers'
servers (outgoing: one per gRPC channel), connections peers opened to this
rank's server (incoming) and any other; threads (``/proc/self/task``, by
name); open file descriptors (by kind); RSS and its high-water mark
(``VmHWM``). Received arrays are dropped and free heap handed back
(``malloc_trim``) before each measurement, so what stays is what the
connections, channels and tables hold, not the payload.

The parent talks to the ranks over a Unix socket of its own (not TCP; its fd
is left out of the counts), which is also the barrier between phases: no
rank measures "before" while another already sends, and no rank measures
"after" while a peer may still fetch from it. Every job has a deadline
(``--timeout``); on expiry, on a rank's error or on a rank dying, every
process of the job is killed (its process group) and the run fails.

Writes ``scale.json`` and ``scale.md`` into ``--out`` (default
``benchmarks``): per setup and N, the per-rank medians before and after;
the increments per peer between the smallest and the largest N; start-up.

This module is the parent and the command; a rank is
:mod:`rendezvous.bench.scale_rank`, its measurement
:mod:`rendezvous.bench.footprint`, the medians and per-peer increments
:mod:`rendezvous.bench.results`, the tables :mod:`rendezvous.bench.report`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .control import ControlListener
from .procs import NO_MPIEXEC, BenchError, ProcGroup, environ, mpiexec
from .scale_rank import BIG_BYTES, JOB, SMALL_BYTES

__all__ = ["add_arguments", "run", "main", "parser", "options", "HELP", "DESCRIPTION", "EPILOG", "SETUPS",
           "SMALL_BYTES", "JobFailed", "run_job", "build"]

SETUPS = ("grpc", "grpc+mpi")
JSON_NAME = "scale.json"
MARKDOWN_NAME = "scale.md"
#: ``rendezvous --help``'s line for the command, its own --help's description and epilog
HELP = "per-rank connections, threads, fds and memory as the number of peers grows"
DESCRIPTION = ("Run jobs of each of --ranks ranks on this machine (plain processes over gRPC; under mpiexec with "
               "grpc+mpi) and measure what one rank holds before and after a full-mesh exchange: connections, "
               "threads, descriptors, memory, and its start-up. See BENCHMARKS.md.")
EPILOG = f"Writes {JSON_NAME} and {MARKDOWN_NAME} into --out."


# -- one job --------------------------------------------------------------------------------

class JobFailed(BenchError):
    """A job of the run failed, hung or answered wrongly."""


class _Job:
    """N ranks of one setup: their processes and their control connections."""

    def __init__(self, setup: str, n: int, timeout: float, big_bytes: int) -> None:
        self.setup, self.n, self.big_bytes = setup, n, big_bytes
        self.group = ProcGroup(timeout, label=f"{setup} N={n}: ")
        self.dir = tempfile.mkdtemp(prefix="rdv-scale-")
        self.path = os.path.join(self.dir, "ctl")
        self.control = ControlListener(self.group, self.path, backlog=n)
        self.rank_of: dict[int, int] = {}  # connection -> rank, from its "started"

    def launch(self) -> None:
        child = [sys.executable, "-m", "rendezvous.bench.scale_rank", self.path, self.setup, str(self.n)]
        if self.setup == "grpc":
            for i in range(self.n):
                self._spawn(f"rank{i}", [*child, str(i), str(self.big_bytes)])
        else:
            launcher = mpiexec()
            if launcher is None:
                raise JobFailed(NO_MPIEXEC)
            self._spawn("mpiexec", [*launcher, "-n", str(self.n), *child, "-1", str(self.big_bytes)])

    def _spawn(self, name: str, argv: list[str]) -> None:
        # output to a file: a rank counts its descriptors, and they must not be the bench's pipes
        self.group.spawn(name, argv, environ(), log=Path(self.dir) / f"{name}.err")

    def gather(self, kind: str) -> dict[int, dict[str, Any]]:
        """One ``kind`` message from every rank, by rank."""
        def seen(i: int, msg: dict[str, Any]) -> None:
            if msg.get("kind") == "error":
                raise JobFailed(f"{self.group.label}rank {self.rank_of.get(i, '?')} failed:\n"
                                f"{msg.get('traceback')}")
            if msg.get("kind") != kind:
                raise JobFailed(f"{self.group.label}expected {kind!r}, got {msg.get('kind')!r}")
            if kind == "started":
                self.rank_of[i] = int(msg["rank"])
                self.control.names[i] = f"rank {self.rank_of[i]}"

        got = self.control.gather(f"{kind!r} from every rank", seen=seen)
        by_rank = {self.rank_of[i]: m for i, m in enumerate(got)}
        if sorted(by_rank) != list(range(self.n)):
            raise JobFailed(f"{self.group.label}ranks {sorted(by_rank)} answered, expected 0..{self.n - 1}")
        return by_rank

    def close(self) -> None:
        for child in self.group.children:
            child.kill()  # the whole group: mpiexec's ranks may outlive mpiexec
        self.control.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def run_job(setup: str, n: int, timeout: float, big_bytes: int = BIG_BYTES) -> dict[str, Any]:
    """Run one job (``setup`` with ``n`` ranks, each sending every peer a 64-byte and
    a ``big_bytes`` tensor) and return its raw per-rank results."""
    if setup not in SETUPS:
        raise ValueError(f"unknown setup {setup!r}; known: {', '.join(SETUPS)}")
    if n < 2:
        raise ValueError("a job needs at least 2 ranks")
    if big_bytes < 4 or big_bytes % 4:
        raise ValueError("big_bytes must be a positive multiple of 4")
    job = _Job(setup, n, timeout, big_bytes)
    t0 = time.monotonic()
    try:
        job.launch()
        job.control.accept(n, "connection from every rank")
        started = job.gather("started")
        cluster = {JOB: [started[i]["address"] for i in range(n)]} if setup == "grpc" else None
        job.control.send({"kind": "cluster", "cluster": cluster})
        before = job.gather("before")
        job.control.send({"kind": "go"})
        exchanged = job.gather("exchanged")
        job.control.send({"kind": "measure"})
        after = job.gather("after")
        warm = job.gather("warm") if setup == "grpc+mpi" else {}
        job.control.send({"kind": "exit"})
        job.group.finish()
    finally:
        job.close()
    ranks = []
    for i in range(n):
        s = started[i]
        rank = {k: v for k, v in s.items() if k != "kind"}
        rank.update(before=before[i]["snapshot"], after=after[i]["snapshot"],
                    exchange_s=exchanged[i]["exchange_s"], received_bytes=exchanged[i]["received_bytes"],
                    stats=exchanged[i]["stats"], nofile=after[i]["nofile"], event_loop=after[i]["event_loop"])
        if "mpi" in after[i]:
            rank["mpi"] = after[i]["mpi"]
        if i in warm:
            rank["warm_allgather_s"] = warm[i]["allgather_s"]
        ranks.append(rank)
    return {"setup": setup, "ranks": n, "big_bytes": big_bytes, "wall_s": time.monotonic() - t0, "per_rank": ranks}


# -- the results document ------------------------------------------------------------------------

def build(runs: list[dict[str, Any]], args: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The results document from :func:`run_job`'s results."""
    from rendezvous.config import Config

    from .results import environment, scale_per_peer, scale_run

    cfg = Config.load()
    summarized = [scale_run(r) for r in runs]
    setups = [s for s in SETUPS if any(r["setup"] == s for r in runs)]
    env = environment()
    for run in runs:
        first = run["per_rank"][0]
        if "mpi" in first:
            env["mpi"] = first["mpi"]
        env["event_loop"] = first["event_loop"]
        env["nofile"] = "/".join(str(x) for x in first["nofile"])
    return {
        "kind": "rendezvous bench-scale",
        "version": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
        "args": args,
        "environment": env,
        "config": {name: getattr(cfg, name) for name in
                   ("keepalive_time", "keepalive_timeout", "chunk_bytes", "mpi_threshold", "max_waiting_calls",
                    "retry_window", "retry_cache_bytes", "recv_cache_bytes")},
        "tensors": {"small_bytes": SMALL_BYTES, "big_bytes": args["big_bytes"]},
        "runs": summarized,
        "per_peer": {s: scale_per_peer(summarized, s) for s in setups},
    }


# -- the command -----------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``rendezvous bench-scale``."""
    p.add_argument("--ranks", default="2,4,8", metavar="LIST", help="job sizes, comma-separated (default 2,4,8)")
    p.add_argument("--setups", default=",".join(SETUPS), metavar="LIST",
                   help=f"any of {', '.join(SETUPS)} (default both)")
    p.add_argument("--big", default="1M", metavar="SIZE",
                   help="size of the large tensor each rank sends every peer (default 1M; the small one is "
                        f"{SMALL_BYTES} bytes)")
    p.add_argument("--out", default="benchmarks", metavar="DIR",
                   help=f"where {JSON_NAME} and {MARKDOWN_NAME} go (default benchmarks)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="seconds each job (one setup, one N) may take before all its processes are killed "
                        "(default 300)")


def parser() -> argparse.ArgumentParser:
    """``rendezvous bench-scale``'s parser on its own (:func:`main`)."""
    p = argparse.ArgumentParser(prog="rendezvous bench-scale", description=DESCRIPTION, epilog=EPILOG)
    add_arguments(p)
    return p


def options(flags: argparse.Namespace) -> argparse.Namespace:
    """``flags`` (from :func:`add_arguments`) checked, as lists and bytes (a copy)."""
    args = argparse.Namespace(**vars(flags))
    try:
        args.ranks = sorted({int(x) for x in args.ranks.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"rendezvous bench-scale: --ranks {args.ranks!r} is not a list of numbers") from None
    if not args.ranks or min(args.ranks) < 2:
        raise SystemExit("rendezvous bench-scale: --ranks needs sizes of at least 2")
    args.setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = [s for s in args.setups if s not in SETUPS]
    if unknown or not args.setups:
        raise SystemExit(f"rendezvous bench-scale: --setups: unknown {', '.join(unknown) or 'none'}; "
                         f"known: {', '.join(SETUPS)}")
    if args.timeout <= 0:
        raise SystemExit("rendezvous bench-scale: --timeout must be positive")
    from .stats import parse_size

    try:
        args.big = parse_size(args.big)
    except ValueError as exc:
        raise SystemExit(f"rendezvous bench-scale: --big: {exc}") from None
    if args.big % 4:
        raise SystemExit("rendezvous bench-scale: --big must be a multiple of 4 bytes (a float32 tensor)")
    return args


def run(flags: argparse.Namespace) -> int:
    """Run ``rendezvous bench-scale`` with ``flags`` (from :func:`add_arguments`)."""
    args = options(flags)
    from .report import Progress, need_rich

    need_rich("bench-scale")
    jobs = [(setup, n) for setup in args.setups for n in args.ranks]
    bar = Progress(sys.stderr, "bench-scale")
    t0 = time.monotonic()
    runs = []
    try:
        for i, (setup, n) in enumerate(jobs):
            bar.update(i, len(jobs), f"{setup}, {n} ranks")
            runs.append(run_job(setup, n, args.timeout, args.big))
        bar.update(len(jobs), len(jobs), "done")
    except (BenchError, KeyboardInterrupt) as exc:
        bar.close()
        print(f"rendezvous bench-scale: {exc if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 1
    finally:
        bar.close()
    doc = build(runs, {"ranks": args.ranks, "setups": args.setups, "big_bytes": args.big, "timeout": args.timeout},
                time.monotonic() - t0)
    from .report import save, scale_markdown

    save(args.out, doc, scale_markdown(doc), JSON_NAME, MARKDOWN_NAME)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``rendezvous bench-scale`` from a command line."""
    return run(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
