"""Two ranks hand each other GPU tensors over grpc+mpi.

    mpiexec -n 2 python -m mpi4py examples/gpu_exchange.py          # needs cupy and a GPU
    mpiexec -n 2 python -m mpi4py examples/gpu_exchange.py --fake   # anywhere: a stand-in GPU

Each rank produces a tensor on its GPU, receives the other rank's onto its
own GPU (the key's destination device says where it lands), then receives a
second one onto the host with ``device="cpu"``. With an MPI that is not
CUDA-aware (the PyPI wheels) the bytes are staged through pinned host memory,
chunk by chunk; the start-up line and ``stats()["gpu"]`` say which way they went.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import rendezvous
from rendezvous.devices import Devices
from rendezvous.rank.launch import launcher_rank


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fake", action="store_true", help="host memory standing in for the GPU (no CUDA needed)")
    p.add_argument("--mib", type=int, default=64, help="tensor size in MiB (default 64)")
    args = p.parse_args()
    found = launcher_rank()
    if found is None or found[1] != 2:
        p.error("run under mpiexec -n 2")
    rank = found[0]
    if args.fake:
        from rendezvous.testing.fakegpu import FakeBackend

        gpu = FakeBackend()
        gpus = Devices([gpu])  # this server's GPU is the fake
        to_gpu, to_host = gpu.array, (lambda a: a.get())
    else:
        try:
            import cupy
        except ImportError:
            p.error("cupy is not installed (pip install 'rendezvous[gpu]'), or pass --fake")
        to_gpu, to_host = cupy.asarray, (lambda a: a.get())
        gpus = Devices()  # cupy's

    def key(src: int, dst: int, name: str, dst_type: str = "GPU") -> str:
        return (f"/job:worker/replica:0/task:{src}/device:GPU:0;0000000000000000;"
                f"/job:worker/replica:0/task:{dst}/device:{dst_type}:0;{name};0:0")

    n = args.mib << 20
    server = rendezvous.Server({"worker": ["127.0.0.1:0"] * 2}, "worker", rank, protocol="grpc+mpi",
                               devices=gpus)
    server.start()
    other = 1 - rank
    mine = np.full(n // 4, rank + 1, dtype=np.float32)
    server.send(key(rank, other, "weights"), to_gpu(mine), step_id=1)
    server.send(key(rank, other, "weights"), to_gpu(mine * 10), step_id=2)
    got = server.recv(key(other, rank, "weights"), step_id=1, timeout=120)  # lands on our GPU
    on_host = server.recv(key(other, rank, "weights"), step_id=2, timeout=120, device="cpu")
    assert float(to_host(got)[0]) == other + 1 and float(on_host[-1]) == (other + 1) * 10
    # one write per line: the launcher merges the ranks' output, and a line
    # printed in two writes could be cut by the other rank's
    sys.stdout.write(f"rank {rank}: got a {type(got).__name__} of {args.mib} MiB onto the GPU and a "
                     f"{type(on_host).__name__} onto the host; gpu stats {server.stats()['gpu']}\n")
    sys.stdout.flush()
    # both ranks have what they came for before either stops serving
    server.send(key(rank, other, "done"), np.ones(1), step_id=3)
    server.recv(key(other, rank, "done"), step_id=3, timeout=120)
    server.stop(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
