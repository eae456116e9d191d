"""GPU tensors on a real GPU with cupy (skipped where there is none).

Run on a GPU machine with `pip install -e '.[dev,mpi,gpu]'` then
`pytest tests/test_gpu_cupy.py`."""

from __future__ import annotations

import numpy as np
import pytest

from rendezvous import devices

cupy = pytest.importorskip("cupy")
try:
    _gpus = cupy.cuda.runtime.getDeviceCount()
except Exception:  # a driver-less machine with cupy installed
    _gpus = 0
pytestmark = pytest.mark.skipif(_gpus == 0, reason="no CUDA device")

from conftest import cluster, run  # noqa: E402
from test_mpi import HERE, launch  # noqa: E402


def gkey(src, dst, name, kind="GPU"):
    return (f"/job:worker/replica:0/task:{src}/device:GPU:0;0000000000001234;"
            f"/job:worker/replica:0/task:{dst}/device:{kind}:0;{name};0:0")


def test_cupy_round_trip_over_grpc():
    async def main():
        async with cluster(2, gpu_staging_chunk_bytes=1 << 20) as (a, b):
            value = cupy.arange(3 << 20, dtype=cupy.float32)
            b.send(gkey(1, 0, "g"), value)
            b.send(gkey(1, 0, "h", "CPU"), value)
            got = await a.recv(gkey(1, 0, "g"), timeout=60)
            assert isinstance(got, cupy.ndarray) and bool((got == value).all())
            host = await a.recv(gkey(1, 0, "h", "CPU"), timeout=60)
            assert isinstance(host, np.ndarray) and np.array_equal(host, value.get())
    run(main())


def test_non_contiguous_and_dlpack_inputs():
    base = cupy.arange(64, dtype=cupy.int32).reshape(8, 8)
    dt = devices.Devices().import_tensor(base[:, ::2])  # made contiguous on the current stream
    assert dt.shape == (8, 4) and dt.array.flags.c_contiguous
    torch = pytest.importorskip("torch")
    t = torch.arange(10, device="cuda")
    dt = devices.Devices().import_tensor(t)
    assert dt.shape == (10,) and bool((dt.array == cupy.arange(10)).all())


def test_no_device_memory_leak_over_many_transfers():
    async def main():
        async with cluster(2) as (a, b):
            pool = cupy.get_default_memory_pool()
            for i in range(1000):
                b.send(gkey(1, 0, f"k{i}"), cupy.full(1 << 16, i, dtype=cupy.int32))
                got = await a.recv(gkey(1, 0, f"k{i}"), timeout=60)
                assert int(got[0]) == i
                del got
                if i == 10:
                    used = pool.used_bytes()
            assert pool.used_bytes() <= used + (1 << 20)
    run(main(), timeout=300)


@pytest.mark.timeout(300)
def test_cupy_over_mpi_staged():
    _, results, out = launch(2, "transfers", "cupy", env={"MPI_OPTIMAL_PATH": "1"}, timeout=280,
                             script=str(HERE / "gpu_scenarios.py"))
    for r in results:
        gpu = r["stats"]["gpu"]
        assert gpu["staged_recvs"] + gpu["direct_recvs"] >= 9, gpu
