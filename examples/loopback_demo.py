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
    return f"{src}/device:CPU:0;0000000000000001;{dst}/device:CPU:0;{name};0:0"


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
            times = []
            for r in range(REPS):
                t0 = time.perf_counter()
                value = server.recv(_key(w, ps, f"tensor{i}"), step_id=r, timeout=60)
                times.append(time.perf_counter() - t0)
                assert value.nbytes == n and float(value[0]) == i and float(value[-1]) == i
            rows.append((w, n, min(times)))
    return {"rows": rows, "stats": server.stats()}


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB"


def main() -> None:
    print("starting 3 ranks (ps:0, worker:0, worker:1) on loopback ...")
    results = run_local(rank, {"ps": 1, "worker": 2}, timeout=120)
    ps = results["/job:ps/replica:0/task:0"]
    print(f"\nbest of {REPS} recvs per size and worker:")
    print(f"{'from':<28} {'size':>9} {'path':>5} {'time':>10} {'rate':>10}")
    for w, n, dt in ps["rows"]:
        print(f"{w:<28} {_human(n):>9} {'grpc':>5} {dt * 1e3:>8.2f}ms {n / dt / 1e9:>7.2f}GB/s")
    g = ps["stats"]["grpc"]
    print(f"\nps received {g['transfers']} tensors, {_human(g['bytes'])} over gRPC, "
          f"{g['errors']} errors")


if __name__ == "__main__":
    main()
