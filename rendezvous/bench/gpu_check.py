"""``make gpu-check``: the checks only a real GPU can make, in one command.

1. ``tests/test_gpu_cupy.py``: round trips over gRPC, locally and over staged
   MPI (two ranks under mpiexec), a producer kernel held ~200 ms on a side
   stream (cupy, and torch when it imports) with contents asserted, the
   allocation race (a received tensor must not land in a block a queued
   kernel still reads), a GPU that does not exist;
2. the staged bandwidth against its bounds: ``rendezvous bench --gpu cupy``
   with raw MPI, staged GPU->GPU (and with one chunk in flight) and the
   device->host copy, from 16 MiB, and the bench's target
   ``staged >= 0.8 x min(D2H, raw MPI)``; beside it the staging chunk sizes
   and depths of ``--staging`` (``rendezvous bench --gpu-staging``), each
   judged the same way, to choose the default by measurement;
3. node-local GPU->GPU by CUDA IPC against a device-to-device copy in one
   process (:mod:`rendezvous.bench.gpu_ipc`), target ``>= 0.8`` from 16 MiB,
   between two rank servers and (``--daemon``) between two local clients of
   a daemon.

Where cupy cannot be imported or sees no CUDA device it says so and exits 0
(nothing to check here: the fake-GPU tests in the ordinary suite ran
instead). Exit status: 0 all passed or skipped, 1 a check failed.

    python -m rendezvous.bench.gpu_check [--sizes 16M,64M,256M] [--out DIR] [--no-bench]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[2]
#: the staged path's settings measured beside the default (4 MiB x 4): chunk size and depth, measured
STAGING = "1M:4,2M:8,8M:2,8M:4,16M:2,16M:4"


def _gpu_here() -> tuple[bool, str]:
    """(usable, what): whether cupy imports and sees a CUDA device."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install
        return False, f"cupy not importable ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, f"no CUDA device ({type(exc).__name__}: {exc})"
    if count < 1:
        return False, "no CUDA device"
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    return True, f"{count} x {name}, cupy {cupy.__version__}"


def _step(title: str, cmd: list[str], timeout: float) -> bool:
    print(f"\n== {title}\n$ {' '.join(cmd)}", flush=True)
    try:
        done = subprocess.run(cmd, cwd=ROOT, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        print(f"-- {title}: timed out after {timeout:.0f}s")
        return False
    print(f"-- {title}: {'passed' if done.returncode == 0 else f'FAILED (exit {done.returncode})'}")
    return done.returncode == 0


def _bandwidth(out: Path) -> tuple[bool, list[str]]:
    """The staged GPU targets of the bench's results, as report lines."""
    doc = json.loads((out / "bench.json").read_text())
    lines, ok = [], True
    for t in doc.get("targets", []):
        if not t["id"].startswith("gpu_staged_"):
            continue
        measured = "not measured" if t["measured"] is None else f"{t['measured']:.2f}"
        verdict = {True: "ok", False: "MISSED", None: "n/a"}[t["ok"]]
        if t["id"].removeprefix("gpu_staged_").isdigit():  # the default settings; the sweep informs
            ok = ok and t["ok"] is not False
        lines.append(f"  {t['what']}: {measured} (target {t['op']} {t['limit']}) {verdict} {t['note']}".rstrip())
    for row in doc.get("transfers", []):
        if (row["contender"] in ("gpu_serial", "d2h", "mpi") or row["contender"].startswith("gpu_staged")) \
                and row["size"] >= 16 << 20:
            lines.append(f"  {row['contender']:>10} {row['size'] >> 20:>5} MiB: {row['gbps']:.2f} GB/s")
    return ok, lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16M,64M,256M", help="bench sizes (16 MiB and up count for the target)")
    p.add_argument("--out", default=None, help="where the bench writes its results (default: a temporary folder)")
    p.add_argument("--no-bench", action="store_true", help="only the content checks")
    p.add_argument("--staging", default=STAGING,
                   help=f"staging chunk sizes and depths measured beside the default (default {STAGING})")
    args = p.parse_args(argv)

    usable, what = _gpu_here()
    if not usable:
        print(f"gpu-check: no GPU / {what}: skipped (the fake-GPU tests of `make test` cover the logic)")
        return 0
    print(f"gpu-check on {what}")
    results: list[tuple[str, bool]] = []
    results.append(("content checks (tests/test_gpu_cupy.py)",
                    _step("content checks", [sys.executable, "-m", "pytest", "-v", "-p", "no:randomly",
                                             "tests/test_gpu_cupy.py"], timeout=1800)))
    report: list[str] = []
    if not args.no_bench:
        out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu-check-"))
        ran = _step("staged bandwidth", [sys.executable, "-m", "rendezvous", "bench", "--gpu", "cupy", "--quick",
                                         "--no-rss", "--contenders", "mpi,gpu_staged,gpu_serial,d2h",
                                         "--gpu-staging", args.staging,
                                         "--sizes", args.sizes, "--out", str(out)], timeout=1800)
        if ran:
            ok, report = _bandwidth(out)
            results.append(("staged GPU->GPU >= 0.8 x min(D2H, raw MPI)", ok))
        else:
            results.append(("staged bandwidth bench", False))
        results.append(("CUDA IPC GPU->GPU >= 0.8 x a device-to-device copy",
                        _step("IPC bandwidth", [sys.executable, "-m", "rendezvous.bench.gpu_ipc", "--sizes", args.sizes,
                                                "--json", str(out / "ipc.json")], timeout=900)))
        results.append(("CUDA IPC through a daemon's local clients >= 0.8 x a device-to-device copy",
                        _step("local IPC bandwidth", [sys.executable, "-m", "rendezvous.bench.gpu_ipc", "--daemon",
                                                      "--sizes", args.sizes, "--json", str(out / "ipc_local.json")],
                              timeout=900)))
    print("\n== gpu-check report")
    for name, ok in results:
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    for line in report:
        print(line)
    return 0 if all(ok for _, ok in results) else 1


if __name__ == "__main__":
    sys.exit(main())
