"""Run under `mpiexec -n 2 python tests/mpi_release.py held` by test_mpi_plane.py.

Rank 1 produces a 2 MiB tensor and a 64 KiB one; rank 0 receives both on the
MPI optimal path (their bytes by MPI, buffer to buffer). The large send is
received once it completes (MPI's rendezvous protocol: the bytes are in
rank 0's buffer), so no retry of its request can come and the producer's
retry cache lets its answer go at once; the small one's answer stays for
its retry window (its send may complete while its bytes wait in the
consumer's MPI buffers). Rank 1 reports what its retry cache holds once the
large send has completed. A failing rank aborts the job.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import numpy as np

from rendezvous import aio
from rendezvous.mpi.plane import DELIVERED_BYTES
from rendezvous.rank.launch import launcher_rank


import mpi_abort  # noqa: E402,F401  (a failing rank aborts the job)


def key(src: int, dst: int, name: str) -> str:
    return (f"/job:worker/replica:0/task:{src}/device:CPU:0;0000000000000000;"
            f"/job:worker/replica:0/task:{dst}/device:CPU:0;{name};0:0")


LARGE = np.arange(2 * DELIVERED_BYTES // 8, dtype=np.float64)
SMALL = np.arange((64 << 10) // 4, dtype=np.float32)


async def until(predicate, what: str, timeout: float = 20.0) -> None:
    """Wait for ``predicate()`` on each turn of the loop; fail (and so abort the job) after ``timeout``."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.001)


def held() -> None:
    rank, _ = launcher_rank() or (0, 1)

    async def main() -> None:
        # answers held far longer than this run: only the release lets one go
        server = aio.Server({"worker": ["127.0.0.1:0"] * 2}, "worker", rank, protocol="grpc+mpi",
                            retry_window=600.0)
        await server.start()
        assert server.config.mpi_optimal_path and not server.config.mpi_disabled
        if rank == 1:
            server.send(key(1, 0, "large"), LARGE, step_id=1)
            server.send(key(1, 0, "small"), SMALL, step_id=1)
            await server.recv(key(0, 1, "done"), step_id=1, timeout=60)
            retry = server._retry
            # the large send completes, and its answer leaves the retry cache with it
            await until(lambda: server.stats()["mpi"]["in_flight"] == 0, "the MPI sends to complete")
            await until(lambda: retry.held() <= 1, f"the large answer to leave the retry cache "
                        f"(held: {retry.held()} answers, {retry.held_bytes()} bytes)")
            stats = server.stats()["mpi"]
            print("RESULT " + json.dumps({"rank": rank, "held": retry.held(), "held_bytes": retry.held_bytes(),
                                          "served": stats["served"], "served_bytes": stats["served_bytes"]}),
                  flush=True)
        else:
            got = await server.recv(key(1, 0, "large"), step_id=1, timeout=60)
            assert np.array_equal(got, LARGE)
            got = await server.recv(key(1, 0, "small"), step_id=1, timeout=60)
            assert np.array_equal(got, SMALL)
            stats = server.stats()["mpi"]
            print("RESULT " + json.dumps({"rank": rank, "transfers": stats["transfers"]}), flush=True)
            server.send(key(0, 1, "done"), np.zeros(1), step_id=1)
        await server.stop(10)

    asyncio.run(main())


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
