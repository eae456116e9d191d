"""``rendezvous bench``: launch the two-rank job, show progress, write the results.

Run outside MPI, the command starts ``mpiexec -n 2 python -m mpi4py -m
rendezvous bench ...`` (the launcher next to this Python, or
``RENDEZVOUS_MPIEXEC``), draws a progress bar from rank 0's progress lines,
and once the job is done prints the table and writes the plot. Run under
``mpiexec -n 2`` directly, rank 0 does all of that itself.

``python -m mpi4py`` makes an uncaught exception on either rank call
``MPI_Abort``, so a failing rank ends the job instead of leaving the other
waiting; ``--timeout`` bounds the whole run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run"]

_CHILD_ENV = "RENDEZVOUS_BENCH_CHILD"
_PROGRESS = "@bench-progress "
JSON_NAME = "bench.json"
PLOT_NAME = "bench.png"
MARKDOWN_NAME = "bench.md"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="fewer samples and a 5 s idle test: under 2 minutes on 2 cores")
    p.add_argument("--sizes", default="1K,64K,1M,16M,128M,512M", metavar="LIST",
                   help="tensor sizes, comma-separated, binary units (default 1K,64K,1M,16M,128M,512M)")
    p.add_argument("--contenders", default="all", metavar="LIST",
                   help="any of mpi,mpi_alloc,grpc,default,optimal,default_mr,optimal_mr,gloo,memcpy,gpu_staged,gpu_serial,d2h "
                        "(default all; gloo only if torch is installed, the gpu ones only with --gpu)")
    p.add_argument("--samples", type=int, metavar="N",
                   help="timed transfers per contender and size (default: enough to move 2 GiB, "
                        "256 MiB with --quick, within [8, 1000] or [3, 200])")
    p.add_argument("--rounds", type=int, metavar="N", help="interleaved rounds per size (default 10, quick 4)")
    p.add_argument("--outstanding", type=int, default=1000, metavar="N",
                   help="recvs outstanding at once in the rate test (default 1000)")
    p.add_argument("--rate-rounds", type=int, metavar="N", help="rounds of the rate test (default 7, quick 3)")
    p.add_argument("--idle-seconds", type=float, metavar="S", help="length of the idle CPU test (default 10, quick 5)")
    p.add_argument("--no-rss", action="store_true", help="skip the peak RSS test")
    p.add_argument("--gpu", choices=("auto", "off", "fake", "cupy"), default="auto",
                   help="GPU contenders (gpu_staged, gpu_serial, d2h): cupy on a CUDA device; fake: host "
                        "memory standing in for the GPU (measures the staging pipeline only); auto "
                        "(default): cupy when a CUDA device is usable, else off")
    p.add_argument("--out", default="bench-results", metavar="DIR",
                   help=f"where {JSON_NAME} and {PLOT_NAME} go (default bench-results)")
    p.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                   help="end the job if it runs longer than this (default 1800)")


def _gpu_kind(choice: str) -> str:
    if choice != "auto":
        return choice
    from rendezvous.devices import CupyBackend

    return "cupy" if CupyBackend().available() else "off"


def _options(args: argparse.Namespace) -> Any:
    from .stats import parse_size
    from .worker import CONTENDERS, Options

    sizes = tuple(sorted({parse_size(s) for s in args.sizes.split(",") if s.strip()}))
    if not sizes:
        raise SystemExit("rendezvous bench: --sizes names no size")
    names = CONTENDERS if args.contenders == "all" else tuple(s.strip() for s in args.contenders.split(","))
    unknown = [n for n in names if n not in CONTENDERS]
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
    return Options.quick_mode(**changes) if args.quick else Options(**changes)


def _argv(args: argparse.Namespace) -> list[str]:
    """The flags that reproduce ``args`` (handed to the ranks)."""
    out = ["--sizes", args.sizes, "--contenders", args.contenders, "--outstanding", str(args.outstanding),
           "--out", str(args.out), "--timeout", str(args.timeout)]
    for flag, value in (("--samples", args.samples), ("--rounds", args.rounds),
                        ("--rate-rounds", args.rate_rounds), ("--idle-seconds", args.idle_seconds)):
        if value is not None:
            out += [flag, str(value)]
    if args.quick:
        out.append("--quick")
    if args.no_rss:
        out.append("--no-rss")
    out += ["--gpu", args.gpu]
    return out


def _record(args: argparse.Namespace) -> dict[str, Any]:
    return {"sizes": args.sizes, "contenders": args.contenders, "samples": args.samples, "rounds": args.rounds,
            "outstanding": args.outstanding, "rate_rounds": args.rate_rounds, "idle_seconds": args.idle_seconds,
            "rss": not args.no_rss, "gpu": args.gpu}


def run(args: argparse.Namespace) -> int:
    from rendezvous.launch import launcher_rank

    opts = _options(args)  # fail on bad flags before launching anything
    where = launcher_rank()
    if where is None:
        return _launch(args)
    return _rank(args, opts, child=os.environ.get(_CHILD_ENV) == "1")


# -- a rank -------------------------------------------------------------------------

def _rank(args: argparse.Namespace, opts: Any, child: bool) -> int:
    from rendezvous.config import Config
    from rendezvous.lifecycle import new_event_loop

    from . import report
    from .worker import run_rank

    if child:
        def progress(done: int, total: int, label: str) -> None:
            sys.stdout.write(_PROGRESS + json.dumps([done, total, label]) + "\n")
            sys.stdout.flush()
    else:
        bar = Progress(sys.stderr)
        progress = bar.update

    loop = new_event_loop(Config.load().uvloop)
    try:
        # Exceptions are not caught here: under `python -m mpi4py` they abort the job.
        raw = loop.run_until_complete(run_rank(opts, progress))
    finally:
        loop.close()
    if raw is None:
        return 0
    raw.update(outstanding=opts.outstanding, rate_bytes=opts.rate_bytes)
    doc = report.build(raw, quick=opts.quick, args=_record(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(doc, out / JSON_NAME)
    if not child:
        bar.close()
        _show(doc, out)
    return 0


def _show(doc: dict[str, Any], out: Path) -> None:
    from . import report

    print(report.render(doc))
    (out / MARKDOWN_NAME).write_text(report.markdown(doc))
    print(f"\nresults: {out / JSON_NAME} (tables in Markdown: {out / MARKDOWN_NAME})")
    if report.write_plot(doc, out / PLOT_NAME):
        print(f"plot:    {out / PLOT_NAME}")
    else:
        print("plot:    not drawn: matplotlib is not installed (pip install 'rendezvous[bench]')")


# -- the launcher -----------------------------------------------------------------

def _mpiexec() -> list[str] | None:
    custom = os.environ.get("RENDEZVOUS_MPIEXEC")
    if custom:
        return shlex.split(custom)
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    return [found] if found else None


def _launch(args: argparse.Namespace) -> int:
    from . import report

    launcher = _mpiexec()
    if launcher is None:
        print("rendezvous bench: no mpiexec found (pip install 'rendezvous[mpi]', or set RENDEZVOUS_MPIEXEC)",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = out / JSON_NAME
    if result.exists():
        result.unlink()  # never show a previous run's results as this one's
    cmd = [*launcher, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "rendezvous", "bench", *_argv(args)]
    env = {**os.environ, _CHILD_ENV: "1"}
    bar = Progress(sys.stderr)
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True, env=env,
                                start_new_session=True)
        deadline = time.monotonic() + args.timeout
        timed_out = False
        try:
            import selectors

            sel = selectors.DefaultSelector()
            sel.register(proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                if not sel.select(min(left, 1.0)):
                    continue
                line = proc.stdout.readline()
                if not line:
                    break
                if line.startswith(_PROGRESS):
                    bar.update(*json.loads(line[len(_PROGRESS):]))
                else:
                    bar.clear()
                    sys.stdout.write(line)
            sel.close()
        finally:
            if timed_out:
                os.killpg(proc.pid, signal.SIGKILL)
            try:
                code = proc.wait(timeout=max(5.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
                timed_out = True
            bar.close()
        if timed_out or code != 0 or not result.exists():
            errors.seek(0)
            tail = errors.read()[-6000:]
            why = f"ran past --timeout {args.timeout:g}s" if timed_out else f"exited with status {code}"
            print(f"rendezvous bench: the benchmark job {why}\n{tail}", file=sys.stderr)
            return 1
    _show(report.load(result), out)
    return 0


class Progress:
    """A one-line progress bar on a terminal; occasional plain lines otherwise."""

    def __init__(self, stream: Any, width: int = 28) -> None:
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.width = width
        self.start = time.monotonic()
        self.shown = False
        self.last_tenth = -1

    def update(self, done: int, total: int, label: str) -> None:
        total = max(total, 1)
        frac = min(1.0, done / total)
        elapsed = time.monotonic() - self.start
        if self.tty:
            filled = int(frac * self.width)
            bar = "#" * filled + "." * (self.width - filled)
            text = f"\r[{bar}] {frac:4.0%} {elapsed:5.0f}s  {label}"
            self.stream.write(text[:120].ljust(100))
            self.shown = True
        else:
            tenth = int(frac * 10)
            if tenth == self.last_tenth:
                return
            self.last_tenth = tenth
            self.stream.write(f"bench: {frac:4.0%} after {elapsed:.0f}s ({label})\n")
        self.stream.flush()

    def clear(self) -> None:
        if self.tty and self.shown:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()

    def close(self) -> None:
        if self.tty and self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = False
