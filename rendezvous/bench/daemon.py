"""``rendezvous bench-daemon``: rendezvousd and its local clients, against the bounds.

Everything runs on this machine, in one run, contenders taking turns round
by round so the machine's noise falls on all of them alike; the results are
medians, and every comparison is a ratio between contenders of the same run.

1. **Local hop**: client A (one process) sends, rendezvousd holds, client B
   (another process) receives: the blocking client at every ``--sizes``, the
   asyncio client at ``--aio-sizes``; beside them one ``numpy.copyto``
   between two warm preallocated buffers (the memcpy a local hop can at best
   cost). Each sample sends a distinct tensor: A refills one of a set of
   preallocated arrays with the sample's own stamp before its clock starts,
   and B checks the stamp after its clock stops. *lent*: the blocking client
   sends an array of ``Client.empty`` instead, handed over with no copy; its
   pages were written in an earlier round (a pool segment is reused), and
   before the clock starts only its stamps are (first and last bytes, which B
   checks): the hand-off's own cost. Rewriting a whole 1 GiB array just
   before would leave every cache cold, and the next half millisecond of
   any process slower, whatever it does (measured in BENCHMARKS.md). Two kinds of sample:

   * *sequential*: A's send is timed (no consumer waits yet), then B's recv
     of the tensor, already in the daemon, is timed: **send** and **recv**;
   * *hop*: B's recv is posted first; A's send starts the clock and B
     holding the array stops it (both read ``CLOCK_MONOTONIC``, which every
     process on the machine shares): **hop**.

2. **Small tensors**: 1 KiB sends and recvs (of tensors already sent) over
   the session socket, one after another, against a bare ``grpc.aio`` unary
   call (a 1 KiB echo, generic handler, raw bytes) and a bare sync unary
   call over a Unix socket to another process. **Rate**: ``--outstanding``
   recvs of already-sent 1 KiB tensors gathered at once on the asyncio
   client, against as many bare ``grpc.aio`` unary calls at once.

3. **Cross-node**: two daemons under ``mpiexec -n 2`` (``grpc+mpi``):
   client A on daemon 0 sends, client B on daemon 1 receives (daemon 1
   fetches the tensor from daemon 0, its bytes over MPI); the same through
   two daemons on the gRPC path (``protocol grpc``); and raw MPI between two
   ranks (mpi4py ``Send``/``Recv`` of a preallocated buffer, timed from the
   send's start to the receive's end).

4. **Memory**: the peak RSS (``VmHWM``, reset at each scenario's start) of
   every daemon, client and helper process, and each daemon's pool (its
   Prometheus gauges) after the scenario, beside the pool's limit
   (``--pool-bytes``, given to the daemons as ``RENDEZVOUS_SHM_POOL_BYTES``).

Every wait has a deadline: a daemon, client or rank that fails or hangs ends
the run with an error naming it, and every process started is stopped and
the socket folder removed on the way out.

``--quick`` runs fewer sizes and samples (well under 2 minutes on 2 cores);
``--scenarios`` picks scenarios; ``--daemon-env NAME=VALUE`` passes a setting
to every daemon (e.g. ``RENDEZVOUS_RETRY_CACHE_BYTES=0``). The targets, with
the ratios measured and met or missed, head ``daemon.md``.

This module is the command and its results document; the scenarios are
:mod:`rendezvous.bench.daemon_scenarios`, the processes
:mod:`rendezvous.bench.daemon_fleet`, what runs in the workers
:mod:`rendezvous.bench.daemon_workers`, the targets
:mod:`rendezvous.bench.results`, the tables :mod:`rendezvous.bench.report`.
"""

from __future__ import annotations

import argparse
import datetime
import signal
import statistics
import sys
from typing import Any

from .procs import BenchError
from .stats import format_size, parse_size

__all__ = ["add_arguments", "run", "main", "parser", "options", "HELP", "DESCRIPTION", "EPILOG", "CONTENDERS",
           "document"]

JSON_NAME = "daemon.json"
MARKDOWN_NAME = "daemon.md"
MiB = 1 << 20
#: ``rendezvous --help``'s line for the command, its own --help's description and epilog
HELP = ("rendezvousd: the local hop against memcpy, small tensors against bare gRPC, two daemons against raw "
        "MPI, peak RSS")
DESCRIPTION = ("Measure rendezvousd and its local clients on this machine: the local hop against a memcpy, 1 KiB "
               "tensors and the rate against bare gRPC, two daemons under mpiexec -n 2 against raw MPI, and every "
               "process's peak RSS, the contenders taking turns round by round. See BENCHMARKS.md.")
EPILOG = f"Writes {JSON_NAME} and {MARKDOWN_NAME} into --out."

#: every contender the run measures (the keys of the results document's "contenders")
CONTENDERS = {
    "local_blocking": "local hop, blocking rendezvous.client.Client (A -> rendezvousd -> B)",
    "local_lent": "local hop, blocking Client sending an array of Client.empty (no copy)",
    "local_aio": "local hop, rendezvous.client.aio.Client",
    "memcpy": "one numpy.copyto between two warm preallocated buffers",
    "send_blocking": "1 KiB send over the session socket, blocking client",
    "recv_blocking": "1 KiB recv of an already-sent tensor, blocking client",
    "send_aio": "1 KiB send over the session socket, asyncio client",
    "recv_aio": "1 KiB recv of an already-sent tensor, asyncio client",
    "grpc_aio_unary": "bare grpc.aio unary call, 1 KiB echo over a Unix socket",
    "grpc_sync_unary": "bare sync grpc unary call, 1 KiB echo over a Unix socket",
    "rate_aio_recv": "recvs of already-sent 1 KiB tensors, all outstanding at once (asyncio client)",
    "rate_grpc_aio": "bare grpc.aio unary 1 KiB echoes, all outstanding at once",
    "daemons_mpi": "A on rendezvousd 0 -> B on rendezvousd 1, two daemons under mpiexec -n 2, grpc+mpi",
    "daemons_grpc": "A on rendezvousd 0 -> B on rendezvousd 1, two daemons on the gRPC path",
    "raw_mpi": "raw mpi4py Send/Recv of a preallocated buffer between two ranks",
}

_QUICK = dict(sizes="1K,1M,64M", cross_sizes="1K,1M,64M", budget=64 * MiB, least=3, most=24, rounds=2,
              small_ops=200, rate_rounds=2)
_FULL = dict(sizes="1K,64K,1M,16M,64M,128M,512M", cross_sizes="1K,64K,1M,16M,64M,256M", budget=1 << 30,
             least=5, most=400, rounds=5, small_ops=1000, rate_rounds=7)


# -- the results document ------------------------------------------------------------------

def document(args: argparse.Namespace, raw: dict[str, Any], fleet: Any, samples: Any) -> dict[str, Any]:
    """The results document from :meth:`rendezvous.bench.daemon_scenarios.Bench.run`'s
    cells, ``fleet``'s memory records, and ``samples(size)`` (samples per size)."""
    from .daemon_results import daemon_targets
    from .results import environment, summary

    a = args
    local_cells, small, cross_cells = raw["local"], raw["small"], raw["cross"]

    def summ(cells: dict) -> dict:
        return {name: {size: {metric: summary(ns, int(size)) for metric, ns in m.items() if ns}
                       for size, m in by_size.items()} for name, by_size in cells.items()}

    small_doc = None
    if small is not None:
        rate = {}
        for name, cell in small["rate"].items():
            per_s = [small["outstanding"] / (ns / 1e9) for ns in cell["ns"]]
            rate[name] = {"ops_per_s": per_s, "median_ops_per_s": statistics.median(per_s),
                          "failures": cell["failures"], "errors": cell["errors"][:3]}
        small_doc = {"size": small["size"], "outstanding": small["outstanding"], "rate": rate,
                     "ops": {name: summary(ns, small["size"]) for name, ns in small["ops"].items()}}
    measured = set()
    for section in (local_cells, cross_cells):
        measured |= set(section or {})
    if small is not None:
        measured |= set(small["ops"]) | set(small["rate"])
    contenders = {k: v for k, v in CONTENDERS.items() if k in measured}
    sizes = set(a.sizes if local_cells is not None else []) | set(a.cross_sizes if cross_cells is not None else [])
    doc = {
        "kind": "rendezvous bench-daemon",
        "version": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(raw["seconds"], 1),
        "quick": a.quick,
        "args": {"scenarios": sorted(a.scenarios),
                 "sizes": a.sizes if local_cells is not None else [],
                 "aio_sizes": [s for s in a.sizes if s in a.aio_sizes] if local_cells is not None else [],
                 "cross_sizes": a.cross_sizes if cross_cells is not None else [], "rounds": a.rounds,
                 "samples": {str(s): samples(s) for s in sorted(sizes)},
                 "small_ops": a.small_ops, "outstanding": a.outstanding, "rate_rounds": a.rate_rounds,
                 "pool_bytes": a.pool_bytes, "daemon_env": a.daemon_env},
        "environment": environment(**({"mpi": fleet.mpi_library} if fleet.mpi_library else {})),
        "contenders": contenders,
        "local_hop": summ(local_cells) if local_cells is not None else None,
        "small": small_doc,
        "cross": summ(cross_cells) if cross_cells is not None else None,
        "memory": {"pool_limit": a.pool_bytes, "scenarios": fleet.memory},
    }
    doc["targets"] = daemon_targets(doc)
    return doc


# -- the command ------------------------------------------------------------------------------

def _sizes(text: str, flag: str) -> list[int]:
    try:
        sizes = sorted({parse_size(s) for s in text.split(",") if s.strip()})
    except ValueError as exc:
        raise SystemExit(f"rendezvous bench-daemon: {flag}: {exc}") from None
    if not sizes:
        raise SystemExit(f"rendezvous bench-daemon: {flag} names no size")
    return sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``rendezvous bench-daemon``."""
    p.add_argument("--quick", action="store_true",
                   help=f"sizes {_QUICK['sizes']} (cross-node {_QUICK['cross_sizes']}), fewer samples: "
                        "about 2 minutes on 2 cores")
    p.add_argument("--sizes", metavar="LIST", help=f"local-hop sizes (default {_FULL['sizes']})")
    p.add_argument("--aio-sizes", default="1K,1M,64M", metavar="LIST",
                   help="sizes (of --sizes) at which the asyncio client runs the local hop too (default 1K,1M,64M)")
    p.add_argument("--cross-sizes", metavar="LIST", help=f"cross-node sizes (default {_FULL['cross_sizes']})")
    p.add_argument("--scenarios", default="local,small,cross", metavar="LIST",
                   help="which scenarios to run: any of local (the local hop), small (1 KiB tensors and the "
                        "rate), cross (two daemons and raw MPI); default all")
    p.add_argument("--samples", type=int, metavar="N",
                   help="timed samples of each kind per contender and size (default: enough to move "
                        "--budget bytes, within [5, 400]; quick [3, 24]; rounded up to whole rounds)")
    p.add_argument("--budget", metavar="SIZE", help="bytes each contender moves per size (default 1G, quick 64M)")
    p.add_argument("--rounds", type=int, metavar="N", help="interleaved rounds (default 5, quick 2)")
    p.add_argument("--small-ops", type=int, metavar="N",
                   help="1 KiB operations per contender and round (default 1000, quick 200)")
    p.add_argument("--outstanding", type=int, default=1000, metavar="N",
                   help="operations outstanding at once in the rate test (default 1000)")
    p.add_argument("--rate-rounds", type=int, metavar="N", help="rounds of the rate test (default 7, quick 2)")
    p.add_argument("--pool-bytes", default="2G", metavar="SIZE",
                   help="each daemon's shared-memory pool limit (RENDEZVOUS_SHM_POOL_BYTES; default 2G)")
    p.add_argument("--daemon-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment setting for every daemon started (repeatable), e.g. "
                        "RENDEZVOUS_RETRY_CACHE_BYTES=0")
    p.add_argument("--out", default="bench-results", metavar="DIR",
                   help=f"where {JSON_NAME} and {MARKDOWN_NAME} go (default bench-results)")
    p.add_argument("--timeout", type=float, default=1500.0, metavar="S",
                   help="seconds the whole run may take (default 1500)")


def parser() -> argparse.ArgumentParser:
    """``rendezvous bench-daemon``'s parser on its own (:func:`main`)."""
    p = argparse.ArgumentParser(prog="rendezvous bench-daemon", description=DESCRIPTION, epilog=EPILOG)
    add_arguments(p)
    return p


def options(flags: argparse.Namespace) -> argparse.Namespace:
    """``flags`` (from :func:`add_arguments`) checked, with the defaults of a full
    or ``--quick`` run filled in and sizes in bytes (a copy)."""
    args = argparse.Namespace(**vars(flags))
    base: dict[str, Any] = _QUICK if args.quick else _FULL
    args.sizes = _sizes(args.sizes or base["sizes"], "--sizes")
    args.cross_sizes = _sizes(args.cross_sizes or base["cross_sizes"], "--cross-sizes")
    aio = set(_sizes(args.aio_sizes, "--aio-sizes")) & set(args.sizes)
    args.aio_sizes = aio or {args.sizes[0]}
    try:
        args.budget = parse_size(args.budget) if args.budget else base["budget"]
        args.pool_bytes = parse_size(args.pool_bytes)
    except ValueError as exc:
        raise SystemExit(f"rendezvous bench-daemon: {exc}") from None
    args.least, args.most = base["least"], base["most"]
    for name in ("rounds", "small_ops", "rate_rounds"):
        if getattr(args, name) is None:
            setattr(args, name, base[name])
    for name in ("samples", "rounds", "small_ops", "rate_rounds", "outstanding"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"rendezvous bench-daemon: --{name.replace('_', '-')} must be >= 1")
    env = {}
    for item in args.daemon_env:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise SystemExit(f"rendezvous bench-daemon: --daemon-env {item!r} is not NAME=VALUE")
        env[name] = value
    args.daemon_env = env
    args.scenarios = {w.strip() for w in args.scenarios.split(",") if w.strip()}
    unknown = args.scenarios - {"local", "small", "cross"}
    if unknown or not args.scenarios:
        raise SystemExit(f"rendezvous bench-daemon: --scenarios: unknown {', '.join(sorted(unknown)) or 'none'}; "
                         "known: local, small, cross")
    biggest = max([*args.sizes, *(args.cross_sizes if "cross" in args.scenarios else [])])
    if args.pool_bytes < 3 * biggest:
        raise SystemExit(f"rendezvous bench-daemon: --pool-bytes {format_size(args.pool_bytes)} cannot hold three "
                         f"{format_size(biggest)} segments (a send's, its replacement's, a receiver's)")
    return args


def run(flags: argparse.Namespace) -> int:
    """Run ``rendezvous bench-daemon`` with ``flags`` (from :func:`add_arguments`)."""
    args = options(flags)
    from .report import Progress, need_rich

    need_rich("bench-daemon")
    from .daemon_fleet import Fleet, daemon_env
    from .daemon_scenarios import Bench

    bar = Progress(sys.stderr, "bench-daemon")
    fleet = Fleet(args.timeout, daemon_env(args.pool_bytes, args.daemon_env))
    bench = Bench(args, fleet, bar.update)

    def terminated(signum: int, frame: Any) -> None:
        raise BenchError(f"stopped by signal {signal.Signals(signum).name}")

    old = signal.signal(signal.SIGTERM, terminated)
    try:
        doc = document(args, bench.run(), fleet, bench.samples)
    except (BenchError, KeyboardInterrupt) as exc:
        bar.close()
        print(f"rendezvous bench-daemon: {exc if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 1
    finally:
        bar.close()
        signal.signal(signal.SIGTERM, old)
        fleet.close()
    from .report import daemon_markdown, save

    save(args.out, doc, daemon_markdown(doc), JSON_NAME, MARKDOWN_NAME)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``rendezvous bench-daemon`` from a command line."""
    return run(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
