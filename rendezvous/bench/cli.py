"""``rendezvous bench``: launch the two-rank job, show progress, write the results.

Run outside MPI, the command starts ``mpiexec -n 2 python -m mpi4py -m
rendezvous bench ...`` (the launcher next to this Python, or
``RENDEZVOUS_MPIEXEC``), draws a progress bar from rank 0's progress lines,
and once the job is done prints the tables (rich, :func:`.report.show`) and
writes the plot. Run under ``mpiexec -n 2`` directly, rank 0 does all of
that itself.

``python -m mpi4py`` makes an uncaught exception on either rank call
``MPI_Abort``, so a failing rank ends the job instead of leaving the other
waiting; ``--timeout`` bounds the whole run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run"]

_CHILD_ENV = "RENDEZVOUS_BENCH_CHILD"
#: the matrix's sizes: 1 KiB to 256 MiB, and a few of them for --quick (the guard's)
FULL_SIZES = "1K,64K,1M,16M,64M,256M"
QUICK_SIZES = "1K,1M,16M,64M"
_PROGRESS = "@bench-progress "
JSON_NAME = "bench.json"
PLOT_NAME = "bench.png"
MARKDOWN_NAME = "bench.md"


def _contender_names() -> tuple[str, ...]:
    from .worker import CONTENDERS

    return CONTENDERS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help=f"every cell of the matrix at {QUICK_SIZES}, fewer samples and a 5 s idle test: "
                        "well under 2 minutes on 2 cores")
    p.add_argument("--sizes", default=None, metavar="LIST",
                   help=f"tensor sizes, comma-separated, binary units (default {FULL_SIZES}; with --quick "
                        f"{QUICK_SIZES})")
    p.add_argument("--contenders", default="all", metavar="LIST",
                   help="any of " + ",".join(_contender_names()) + " "
                        "(default all; gloo only if torch is installed, the gpu ones only with --gpu)")
    p.add_argument("--gpu-staging", default="", metavar="LIST",
                   help="also gpu_staged with these staging chunk sizes and depths, CHUNK:DEPTH comma-separated "
                        "(4M:4,16M:2): contenders gpu_staged_4M_x4, ... (with --gpu)")
    p.add_argument("--samples", type=int, metavar="N",
                   help="timed transfers per contender and size (default: enough to move 2 GiB, "
                        "256 MiB with --quick, within [8, 1000] or [3, 200])")
    p.add_argument("--rounds", type=int, metavar="N", help="interleaved rounds per size (default 10, quick 4)")
    p.add_argument("--outstanding", type=int, default=1000, metavar="N",
                   help="recvs outstanding at once in the rate test (default 1000)")
    p.add_argument("--rate-rounds", type=int, metavar="N", help="rounds of the rate test (default 7, quick 3)")
    p.add_argument("--idle-seconds", type=float, metavar="S", help="length of the idle CPU test (default 10, quick 5)")
    p.add_argument("--quiet-seconds", metavar="LIST",
                   help="with requests over MPI: how long both ranks stay quiet before the wake-up test's recvs, "
                        "comma-separated seconds (default 0.5,2; empty: no wake-up test)")
    p.add_argument("--no-rss", action="store_true", help="skip the peak RSS test")
    p.add_argument("--gpu", choices=("auto", "off", "fake", "cupy"), default="auto",
                   help="GPU contenders (gpu_staged, gpu_serial, d2h): cupy on a CUDA device; fake: host "
                        "memory standing in for the GPU (measures the staging pipeline only); auto "
                        "(default): cupy when a CUDA device is usable, else off")
    p.add_argument("--guard", metavar="FLOORS",
                   help="the regression guard: the quick matrix at the sizes of the floors file FLOORS (e.g. "
                        "rendezvous/bench/floors.json), every cell it names against its raw transport, no RSS, "
                        "wake-up or idle test; prints the matrix, exits 1 if a cell is below its floor")
    p.add_argument("--out", default="bench-results", metavar="DIR",
                   help=f"where {JSON_NAME} and {PLOT_NAME} go (default bench-results)")
    p.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                   help="end the job if it runs longer than this (default 1800)")


def _gpu_kind(choice: str) -> str:
    if choice != "auto":
        return choice
    from rendezvous.devices.cupy_backend import CupyBackend

    return "cupy" if CupyBackend().available() else "off"


def _floors(args: argparse.Namespace) -> Any:
    """The guard's floors (None without --guard); SystemExit naming a bad file."""
    if not args.guard:
        return None
    from .matrix import load_floors

    from .worker import hosts

    try:
        floors = load_floors(args.guard)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"rendezvous bench: --guard {args.guard}: {exc}") from None
    # raw MPI against a memcpy says whether a node has a single-copy path: across
    # two hosts MPI runs at the network's speed, and that is not judged
    return floors._replace(raw={}) if hosts() else floors


def _options(args: argparse.Namespace) -> Any:
    from .gpu import staging_name, staging_setting
    from .stats import parse_size
    from .worker import CONTENDERS, Options

    floors = _floors(args)
    if floors is not None:
        from .matrix import CELLS, sizes_of

        rate = floors.rate
        names = ("mpi", "grpc", *(name for name, _ in CELLS if name in floors.cells or name in rate),
                 *(("memcpy",) if floors.raw else ()))
        guard: dict[str, Any] = dict(sizes=tuple(sizes_of(floors)), contenders=names, rss=False, quiet_seconds=(),
                                     idle_seconds=0.0, rate_rounds=3 if rate else 0, outstanding=args.outstanding,
                                     gpu="off")
        if args.samples is not None:
            guard.update(least=args.samples, most=args.samples)
        if args.rounds is not None:
            guard["rounds"] = args.rounds
        return Options.quick_mode(**guard)

    listed = args.sizes if args.sizes is not None else (QUICK_SIZES if args.quick else FULL_SIZES)
    sizes = tuple(sorted({parse_size(s) for s in listed.split(",") if s.strip()}))
    if not sizes:
        raise SystemExit("rendezvous bench: --sizes names no size")
    names = CONTENDERS if args.contenders == "all" else tuple(s.strip() for s in args.contenders.split(","))
    try:
        names += tuple(staging_name(spec) for spec in args.gpu_staging.split(",") if spec.strip())
        unknown = [n for n in names if n not in CONTENDERS and staging_setting(n) is None]
    except ValueError as exc:
        raise SystemExit(f"rendezvous bench: {exc}") from None
    if unknown:
        raise SystemExit(f"rendezvous bench: unknown contender(s) {', '.join(unknown)}; "
                         f"known: {', '.join(CONTENDERS)}")
    changes: dict[str, Any] = {"sizes": sizes, "contenders": names, "outstanding": args.outstanding,
                               "rss": not args.no_rss, "gpu": _gpu_kind(args.gpu)}
    if args.samples is not None:
        changes.update(least=args.samples, most=args.samples)
    for name in ("rounds", "rate_rounds", "idle_seconds"):
        value = getattr(args, name)
        if value is not None:
            changes[name] = value
    if args.quiet_seconds is not None:
        try:
            changes["quiet_seconds"] = tuple(float(x) for x in args.quiet_seconds.split(",") if x.strip())
        except ValueError:
            raise SystemExit(f"rendezvous bench: --quiet-seconds takes seconds, comma-separated, "
                             f"not {args.quiet_seconds!r}") from None
        if any(q < 0 for q in changes["quiet_seconds"]):
            raise SystemExit("rendezvous bench: --quiet-seconds cannot be negative")
    return Options.quick_mode(**changes) if args.quick else Options(**changes)


def _argv(args: argparse.Namespace) -> list[str]:
    """The flags that reproduce ``args`` (handed to the ranks)."""
    out = ["--contenders", args.contenders, "--gpu-staging", args.gpu_staging, "--outstanding", str(args.outstanding),
           "--out", str(args.out), "--timeout", str(args.timeout)]
    if args.sizes is not None:
        out += ["--sizes", args.sizes]
    for flag, value in (("--samples", args.samples), ("--rounds", args.rounds),
                        ("--rate-rounds", args.rate_rounds), ("--idle-seconds", args.idle_seconds),
                        ("--quiet-seconds", args.quiet_seconds)):
        if value is not None:
            out += [flag, str(value)]
    if args.quick:
        out.append("--quick")
    if args.guard:
        out += ["--guard", args.guard]
    if args.no_rss:
        out.append("--no-rss")
    out += ["--gpu", args.gpu]
    return out


def _record(args: argparse.Namespace) -> dict[str, Any]:
    return {"sizes": args.sizes, "contenders": args.contenders, "gpu_staging": args.gpu_staging, "samples": args.samples, "rounds": args.rounds,
            "outstanding": args.outstanding, "rate_rounds": args.rate_rounds, "idle_seconds": args.idle_seconds,
            "quiet_seconds": args.quiet_seconds, "rss": not args.no_rss, "gpu": args.gpu, "guard": args.guard}


def run(args: argparse.Namespace) -> int:
    from rendezvous.rank.launch import launcher_rank

    opts = _options(args)  # fail on bad flags before launching anything
    child = os.environ.get(_CHILD_ENV) == "1"
    if not child:
        from .report import need_rich

        need_rich("bench")  # it draws the progress and the tables: refuse now, not after the run
    where = launcher_rank()
    if where is None:
        return _launch(args)
    return _rank(args, opts, child=child)


# -- a rank -------------------------------------------------------------------------

def _rank(args: argparse.Namespace, opts: Any, child: bool) -> int:
    from rendezvous.config import Config
    from rendezvous.lifecycle import new_event_loop

    from . import report, results
    from .procs import emit
    from .worker import run_rank

    bar = None
    if child:
        def progress(done: int, total: int, label: str) -> None:
            emit(_PROGRESS, [done, total, label])
    else:
        bar = report.Progress(sys.stderr)
        progress = bar.update

    loop = new_event_loop(Config.load().uvloop)
    try:
        # Exceptions are not caught here: under `python -m mpi4py` they abort the job.
        raw = loop.run_until_complete(run_rank(opts, progress))
    finally:
        loop.close()
        if bar is not None:
            bar.close()
    if raw is None:
        return 0
    raw.update(outstanding=opts.outstanding, rate_bytes=opts.rate_bytes)
    doc = results.build(raw, quick=opts.quick, args=_record(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(doc, out / JSON_NAME)
    if not child:
        return _show(doc, out, _floors(args))
    return 0


def _show(doc: dict[str, Any], out: Path, floors: Any = None) -> int:
    """Print the results; with ``floors`` (the guard) judge the matrix: 1 if a
    cell is below its floor."""
    from . import report

    con = report.console(sys.stdout)
    if floors is not None:
        return report.show_guard(doc, floors, con)
    report.show(doc, con)
    (out / MARKDOWN_NAME).write_text(report.markdown(doc))
    con.print(f"\nresults: {out / JSON_NAME} (tables in Markdown: {out / MARKDOWN_NAME})", soft_wrap=True)
    if report.write_plot(doc, out / PLOT_NAME):
        con.print(f"plot:    {out / PLOT_NAME}", soft_wrap=True)
    else:
        con.print("plot:    not drawn: matplotlib is not installed (pip install 'rendezvous[bench]')")
    return 0


# -- the launcher -----------------------------------------------------------------

def _launch(args: argparse.Namespace) -> int:
    from . import procs, report

    launcher = procs.mpiexec()
    if launcher is None:
        print(f"rendezvous bench: {procs.NO_MPIEXEC}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = out / JSON_NAME
    if result.exists():
        result.unlink()  # never show a previous run's results as this one's
    from .worker import hosts

    where = hosts()
    # across hosts (RENDEZVOUS_BENCH_HOSTS=A,B): one rank on each, rank 0 on A
    placement = ["-hosts", ",".join(where), "-ppn", "1"] if where else []
    cmd = [*launcher, *placement, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "rendezvous", "bench",
           *_argv(args)]
    bar = report.Progress(sys.stderr)

    def line(text: str) -> None:
        done = procs.parse(text, _PROGRESS)
        if done is not None:
            bar.update(*done)
        else:
            bar.write(text)

    try:
        job = procs.run("the benchmark job", cmd, args.timeout, env={**os.environ, _CHILD_ENV: "1"}, on_line=line)
    finally:
        bar.close()
    if job.timed_out or job.code != 0 or not result.exists():
        why = f"ran past --timeout {args.timeout:g}s" if job.timed_out else f"exited with status {job.code}"
        print(f"rendezvous bench: the benchmark job {why}\n{job.stderr[-6000:]}", file=sys.stderr)
        return 1
    return _show(report.load(result), out, _floors(args))
