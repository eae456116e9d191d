"""GPU tensors on a real GPU with cupy (skipped where there is none).

Run on a GPU machine with `pip install -e '.[dev,mpi,gpu]'` then
`pytest tests/test_gpu_cupy.py`."""

from __future__ import annotations

import numpy as np
import pytest

from rendezvous import devices
from rendezvous.errors import FailedPrecondition

cupy = pytest.importorskip("cupy")
try:
    _gpus = cupy.cuda.runtime.getDeviceCount()
except Exception:  # a driver-less machine with cupy installed
    _gpus = 0
pytestmark = pytest.mark.skipif(_gpus == 0, reason="no CUDA device")

from conftest import cluster, run  # noqa: E402
from test_mpi import HERE, launch  # noqa: E402


def gkey(src, dst, name, kind="GPU"):
    return (f"/job:worker/replica:0/task:{src}/device:GPU:0;0000000000000000;"
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
    _, results, out = launch(2, "transfers", "cupy", env={"MPI_OPTIMAL_PATH": "1", "RENDEZVOUS_CUDA_IPC": "0"},
                             timeout=280,
                             script=str(HERE / "gpu_scenarios.py"))
    for r in results:
        gpu = r["stats"]["gpu"]
        assert gpu["staged_recvs"] + gpu["direct_recvs"] >= 9, gpu


# -- the ordering hazards on real hardware (tests/test_gpu_fake_hazards.py has them on the fake) --

from gpu_kernels import copy_late, fill_late  # noqa: E402

N = 16 << 20


def test_a_producer_still_writing_on_a_side_stream_is_waited_for_over_grpc_and_locally():
    async def main():
        async with cluster(2, gpu_staging_chunk_bytes=1 << 20) as (a, b):
            side = cupy.cuda.Stream(non_blocking=True)
            with side:  # the producer's current stream while it writes and sends
                x = cupy.empty(N, dtype=cupy.uint8)
                fill_late(x, 77)
                b.send(gkey(1, 0, "late"), x)
                y = cupy.empty(N, dtype=cupy.uint8)
                fill_late(y, 78)
                a.send(gkey(0, 0, "late-local"), y)
            got = await a.recv(gkey(1, 0, "late"), timeout=60)
            assert bool((got == 77).all()), "the bytes were read before the producer's kernel finished"
            got = await a.recv(gkey(0, 0, "late-local"), timeout=60)
            assert bool((got == 78).all())
    run(main())


def test_a_torch_tensor_on_a_side_stream_and_one_that_requires_grad():
    torch = pytest.importorskip("torch")

    async def main():
        async with cluster(2, gpu_staging_chunk_bytes=1 << 20) as (a, b):
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                t = torch.empty(N, dtype=torch.uint8, device="cuda")
                fill_late(t, 91, stream=cupy.cuda.ExternalStream(side.cuda_stream))
                b.send(gkey(1, 0, "torch"), t)  # torch's current stream is the side stream
            got = await a.recv(gkey(1, 0, "torch"), timeout=60)
            assert bool((got == 91).all()), "a torch tensor was read before its side stream finished"
            w = torch.ones(1024, device="cuda", requires_grad=True)
            b.send(gkey(1, 0, "grad"), w)  # detached, not a RuntimeError
            got = await a.recv(gkey(1, 0, "grad"), timeout=60)
            assert bool((got == 1).all())
    run(main())


def test_a_received_tensor_never_lands_in_a_block_a_queued_kernel_still_reads():
    async def main():
        async with cluster(2, gpu_staging_chunk_bytes=1 << 20) as (a, b):
            b.send(gkey(1, 0, "race"), cupy.full(N, 2, dtype=cupy.uint8))
            victim = cupy.full(N, 1, dtype=cupy.uint8)
            seen = cupy.zeros(N, dtype=cupy.uint8)
            cupy.cuda.Device().synchronize()
            copy_late(victim, seen)  # still reading victim when the receive allocates
            del victim  # its block is free for the next allocation on this stream
            got = await a.recv(gkey(1, 0, "race"), timeout=60)
            cupy.cuda.Device().synchronize()
            assert bool((seen == 1).all()), "the received bytes overwrote a block a queued kernel still read"
            assert bool((got == 2).all())
    run(main())


def test_a_gpu_that_does_not_exist_is_named():
    async def main():
        async with cluster(2) as (a, b):
            b.send(gkey(1, 0, "nowhere"), cupy.arange(4))
            with pytest.raises(FailedPrecondition, match="does not exist"):
                await a.recv(gkey(1, 0, "nowhere"), timeout=60, device=f"gpu:{_gpus}")
    run(main())


@pytest.mark.timeout(300)
def test_late_producers_over_staged_mpi():
    _, results, _ = launch(2, "late", "cupy", env={"MPI_OPTIMAL_PATH": "1", "RENDEZVOUS_CUDA_AWARE": "0",
                                                   "RENDEZVOUS_CUDA_IPC": "0"},
                           timeout=280, script=str(HERE / "gpu_scenarios.py"))
    for r in results:
        assert r["checked"] == 1 + r["torch"], r  # cupy, and torch where it imports


# -- GPU-to-GPU placement: directly with peer access, through the host without ----------------

two_gpus = pytest.mark.skipif(_gpus < 2, reason="needs 2 CUDA devices")


@two_gpus
def test_a_tensor_moves_from_gpu0_to_gpu1_after_its_producer():
    gpus = devices.Devices()
    backend = gpus.gpu_backend()
    with cupy.cuda.Device(0):
        side = cupy.cuda.Stream(non_blocking=True)
        with side:  # the producer's current stream: still writing when the tensor is placed
            x = cupy.empty(N, dtype=cupy.uint8)
            fill_late(x, 55)
            dt = gpus.import_tensor(x)
    got = gpus.place(dt, devices.Placement("GPU", 1), True, (1 << 20, 4))
    peer = backend.can_access_peer(0, 1)
    assert isinstance(got, cupy.ndarray) and got.device.id == 1
    assert bool((got.get() == 55).all()), f"GPU:0 -> GPU:1 ({'peer' if peer else 'host bounce'}) read early"
    back = gpus.place(backend.wrap(got), devices.Placement("GPU", 0), True, (1 << 20, 4))
    assert back.device.id == 0 and bool((back.get() == 55).all())


@two_gpus
def test_a_local_recv_onto_the_other_gpu():
    key = ("/job:worker/replica:0/task:0/device:GPU:0;0000000000000000;"
           "/job:worker/replica:0/task:0/device:GPU:1;moved;0:0")

    async def main():
        async with cluster(2) as (a, _):
            with cupy.cuda.Device(0):
                value = cupy.arange(1 << 20, dtype=cupy.float32)
                a.send(key, value)
                expected = value.get()
            got = await a.recv(key, timeout=60)
            assert isinstance(got, cupy.ndarray) and got.device.id == 1
            assert np.array_equal(got.get(), expected)
    run(main())


def test_a_tensor_from_another_process_of_the_node_comes_by_cuda_ipc_and_nothing_is_left():
    """CUDA IPC between two processes on GPU 0: 1,000 tensors, each checked,
    each allocation opened once, every export released, no device memory left
    in the producer (tests/test_ipc.py checks the ordering rules on the fake GPU)."""
    import rendezvous
    from test_ipc import Agent

    producer = Agent("cupy", 1)
    try:
        server = rendezvous.Server({"worker": ["127.0.0.1:0", producer.target]}, "worker", 0)
        with server:
            server.update_cluster({"worker": [server.target, producer.target]})
            base = producer.state()["device_bytes"]
            for r in range(100):
                producer.do(op="send", key=gkey(1, 0, f"k{r}-{{i}}"), n=1 << 16, seed=r, count=10)
                for i in range(10):
                    got = server.recv(gkey(1, 0, f"k{r}-{i}"), timeout=60, device="gpu:0")
                    assert isinstance(got, cupy.ndarray) and float(got[0]) == r + i and float(got[-1]) == r + i + 65535
                    del got
            stats = server.stats()
            assert stats["ipc"]["transfers"] == 1000 and stats["grpc"]["transfers"] == 0, stats
            assert stats["gpu"]["ipc_opens"] <= 10
            st = producer.until(lambda s: s["exports"] == 0 and s["device_bytes"] <= base,
                                "every export released, the memory back in the pool")
            assert st["gpu"]["ipc_sends"] == 1000
    finally:
        producer.close()
