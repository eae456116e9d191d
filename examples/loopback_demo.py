"""Three ranks on loopback hand tensors to each other over gRPC.

Run with `make demo-loopback` (or `python examples/loopback_demo.py`). Each rank is its
own OS process; rank addresses are chosen by the OS. Workers send tensors of
growing size to the ps task, which fetches them with RecvTensor and reports
what moved, how, and how fast.
"""

from __future__ import annotations

import time

import numpy as np

from rendezvous.rank.launch import run_local

SIZES = [1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
REPS = 3  # the first transfer of a pair also sets up the connection: report the best


def _key(src: str, dst: str, name: str) -> str:
    return f"{src}/device:CPU:0;0000000000000000;{dst}/device:CPU:0;{name};0:0"


def rank(server):
    me = str(server.task)
    ps = "/job:ps/replica:0/task:0"
    workers = [f"/job:worker/replica:0/task:{i}" for i in range(2)]
    if me != ps:
        for i, n in enumerate(SIZES):
            for r in range(REPS):
                server.send(_key(me, ps, f"tensor{i}"), np.full(n // 4, i, np.float32), step_id=r)
        return None
    rows = []
    for i, n in enumerate(SIZES):
        for w in workers:
            best, path = None, None
            for r in range(REPS):
                before = server.stats()
                t0 = time.perf_counter()
                value = server.recv(_key(w, ps, f"tensor{i}"), step_id=r, timeout=60)
                took = time.perf_counter() - t0
                after = server.stats()
                assert value.nbytes == n and float(value[0]) == i and float(value[-1]) == i
                if best is None or took < best:
                    # the path this recv's tensor came by: the one whose count it raised
                    best = took
                    path = next((p for p, c in after.items()
                                 if "transfers" in c and c["transfers"] > before[p]["transfers"]), "?")
            rows.append((w, n, path, best))
    return {"rows": rows, "stats": server.stats()}


def _human(n: float) -> str:
    """A size in binary units: ``1 KiB``, ``64 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB"


def _figure(value: float) -> str:
    """Three significant digits: ``5.84``, ``20.5``, ``175``."""
    return f"{value:.{2 if value < 9.995 else 1 if value < 99.95 else 0}f}"


def _duration(seconds: float) -> str:
    """A time in the unit that keeps it below 1000: ``724 µs``, ``3.20 ms``, ``1.20 s``."""
    for unit, scale in (("µs", 1e6), ("ms", 1e3)):
        if seconds * scale < 999.5:
            return f"{_figure(seconds * scale)} {unit}"
    return f"{_figure(seconds)} s"


def _rate(nbytes: int, seconds: float) -> str:
    """Bytes per second in the decimal unit that keeps the figure below 1000:
    ``175 kB/s``, ``52.4 MB/s``, ``1.21 GB/s``."""
    value = nbytes / seconds
    for unit in ("B/s", "kB/s", "MB/s"):
        if value < 999.5:
            return f"{_figure(value)} {unit}"
        value /= 1000
    return f"{_figure(value)} GB/s"


def main() -> None:
    print("starting 3 ranks (ps:0, worker:0, worker:1) on loopback ...")
    results = run_local(rank, {"ps": 1, "worker": 2}, timeout=120)
    ps = results["/job:ps/replica:0/task:0"]
    print(f"\nfastest of {REPS} recvs per size and worker (the first also opens the connection):")
    print(f"{'from':<28} {'size':>7} {'path':>5} {'recv time':>10} {'rate':>11}")
    for w, n, path, dt in ps["rows"]:
        print(f"{w:<28} {_human(n):>7} {path:>5} {_duration(dt):>10} {_rate(n, dt):>11}")
    moved = [f"{c['transfers']} tensors, {_human(c['bytes'])} over {path}, {c['errors']} errors"
             for path, c in ps["stats"].items() if c.get("transfers") or c.get("errors")]
    print(f"\nps received {'; '.join(moved) or 'nothing'}")
    print("rates are decimal: 1 MB/s = 10^6 bytes/s; small tensors are bound by the round trip, not bandwidth")


if __name__ == "__main__":
    main()
