"""Placement, import by protocol, pinned staging and the default path for GPU
tensors, with the host-memory FakeBackend standing in for a GPU."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest

from rendezvous import devices, errors
from rendezvous.devices import CPU, DeviceTensor, Placement, PinnedPool, parse_placement
from rendezvous.testing.fakegpu import FakeBackend, FakeCudaError, FakeDeviceArray
from rendezvous.keys import DeviceName
from rendezvous.v1 import rendezvous_pb2 as pb

from conftest import cluster, run


@pytest.fixture
def fake():
    return FakeBackend()


def gkey(src: int, dst: int, name: str, dst_kind: str = "GPU") -> str:
    return (f"/job:worker/replica:0/task:{src}/device:GPU:0;0000000000000000;"
            f"/job:worker/replica:0/task:{dst}/device:{dst_kind}:0;{name};0:0")


@pytest.mark.parametrize("spec,want", [
    ("cpu", CPU), ("CPU:0", CPU), ("gpu", Placement("GPU", 0)), ("GPU:3", Placement("GPU", 3)),
    ("cuda:1", Placement("GPU", 1)), ("/device:GPU:2", Placement("GPU", 2)), (None, None),
    (Placement("GPU", 5), Placement("GPU", 5)),
])
def test_parse_placement(spec, want):
    assert parse_placement(spec) == want


@pytest.mark.parametrize("bad", ["tpu:0", "gpu:", "gpu:-1", "", "gpu:0:1", 3])
def test_parse_placement_refuses_garbage(bad):
    with pytest.raises(errors.InvalidArgument):
        parse_placement(bad)


def test_placement_follows_the_key_destination():
    assert devices.placement_for_device(DeviceName.parse("/job:w/replica:0/task:0/device:GPU:2")) == \
        Placement("GPU", 2)
    assert devices.placement_for_device(DeviceName.parse("/job:w/replica:0/task:0/gpu:1")) == Placement("GPU", 1)
    assert devices.placement_for_device(DeviceName.parse("/job:w/replica:0/task:0/device:CPU:0")) == CPU


class _DLPackOnly:
    """Exports only DLPack (like a CPU torch tensor), not the buffer protocol."""

    def __init__(self, arr, device=(1, 0)):
        self._arr = arr
        self._device = device

    def __dlpack__(self, **kwargs):
        return self._arr.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._device


class _CudaInterface:
    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}


def test_host_objects_import_as_numpy_by_protocol():
    a = np.arange(6, dtype=np.float32)
    assert devices.Devices().import_tensor(a) is a
    got = devices.Devices().import_tensor(_DLPackOnly(a))
    assert isinstance(got, np.ndarray) and np.array_equal(got, a)
    assert np.shares_memory(got, a)  # DLPack on the CPU: a view, no copy
    got = devices.Devices().import_tensor(memoryview(b"\x01\x02"))
    assert got.dtype == np.uint8 and got.tolist() == [1, 2]


def test_gpu_objects_need_a_backend():
    # cupy is not installed here; both GPU protocols say how to get it
    pytest.importorskip("numpy")
    if "cupy" in sys.modules or _has_cupy():
        pytest.skip("cupy is installed")
    for obj in (_CudaInterface(), _DLPackOnly(np.zeros(2), device=(2, 0))):
        with pytest.raises(errors.FailedPrecondition, match=r"rendezvous\[gpu\]"):
            devices.Devices().import_tensor(obj)
    with pytest.raises(errors.InvalidArgument, match="DLPack device type 8"):
        devices.Devices().import_tensor(_DLPackOnly(np.zeros(2), device=(8, 0)))  # a device nobody handles


def _has_cupy() -> bool:
    import importlib.util

    return importlib.util.find_spec("cupy") is not None


def test_host_only_work_never_imports_cupy():
    code = (
        "import sys, asyncio, numpy as np\n"
        "sys.path.insert(0, 'tests')\n"
        "from conftest import cluster, key\n"
        "async def main():\n"
        "    async with cluster(2) as (a, b):\n"
        "        b.send(key(1, 0, 't'), np.arange(3))\n"
        "        assert (await a.recv(key(1, 0, 't'), timeout=10)).tolist() == [0, 1, 2]\n"
        "asyncio.run(main())\n"
        "assert 'cupy' not in sys.modules, 'cupy imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 * 4096 + 17])
def test_fake_round_trip_through_pinned_chunks(fake, nbytes):
    pool = PinnedPool(fake, 4096, depth=2)
    host = (np.arange(nbytes, dtype=np.uint64) * 7919 % 251).astype(np.uint8)
    dev = fake.from_host(host, 0, pool)
    assert isinstance(dev, FakeDeviceArray) and np.array_equal(dev.get(), host)
    back = fake.to_host(fake.wrap(dev), pool)
    assert np.array_equal(back, host)
    assert pool.allocated <= 2  # depth buffers at most, reused chunk after chunk


def test_pool_reuses_buffers_and_never_blocks(fake):
    pool = PinnedPool(fake, 1024, depth=2, keep=3)
    held = [pool.take() for _ in range(5)]  # more than keep: still handed out
    assert pool.allocated == 5
    for b in held:
        pool.give(b)
    assert pool.free == 3
    again = [pool.take() for _ in range(3)]
    assert pool.allocated == 5 and any(a is h for a in again for h in held)


def test_device_to_host_waits_for_the_producers_stream(fake):
    n = 10_000
    arr = fake.array(np.zeros(n, np.uint8))
    gate = threading.Event()
    fake.stream(0).enqueue(lambda: (gate.wait(30), arr._data.__setitem__(slice(None), 9)))
    dt = fake.wrap(arr)  # the ready event follows the gated "kernel"
    pinned = fake.pinned(n)
    copied = fake.d2h_async(dt, 0, pinned)
    assert not fake.event_done(copied)  # blocked behind the producer's work
    gate.set()
    fake.event_wait(copied)
    assert (pinned == 9).all()


def test_gpu_key_without_a_gpu_falls_back_to_numpy_with_a_warning(caplog):
    if devices.Devices().gpu_backend() is not None:
        pytest.skip("a GPU backend is usable here")

    async def main():
        async with cluster(2) as (a, b):
            b.send(gkey(1, 0, "t"), np.arange(4.0))
            with caplog.at_level(logging.WARNING, logger="rendezvous.devices"):
                got = await a.recv(gkey(1, 0, "t"), timeout=10)
            assert isinstance(got, np.ndarray) and got.tolist() == [0, 1, 2, 3]
            b.send(gkey(1, 0, "u"), np.arange(4.0))
            with pytest.raises(errors.FailedPrecondition, match="needs a GPU"):
                await a.recv(gkey(1, 0, "u"), timeout=10, device="gpu:0")
            # the refused recv consumed nothing
            assert (await a.recv(gkey(1, 0, "u"), timeout=10)).tolist() == [0, 1, 2, 3]
    run(main())
    assert any("no GPU backend" in r.message for r in caplog.records)


def test_gpu_tensors_over_grpc_land_where_the_key_says(fake):
    async def main():
        async with cluster(2, devices=devices.Devices([fake]), chunk_bytes=4096, gpu_staging_chunk_bytes=4096) as (a, b):
            value = np.arange(10_000, dtype=np.float32)
            b.send(gkey(1, 0, "g2g"), fake.array(value))
            b.send(gkey(1, 0, "g2c", "CPU"), fake.array(value * 2))
            b.send(gkey(1, 0, "c2g"), value * 3)
            b.send(gkey(1, 0, "override"), fake.array(value * 4))
            got = await a.recv(gkey(1, 0, "g2g"), timeout=10)
            assert isinstance(got, FakeDeviceArray) and np.array_equal(got.get(), value)
            got = await a.recv(gkey(1, 0, "g2c", "CPU"), timeout=10)
            assert isinstance(got, np.ndarray) and np.array_equal(got, value * 2)
            got = await a.recv(gkey(1, 0, "c2g"), timeout=10)
            assert isinstance(got, FakeDeviceArray) and np.array_equal(got.get(), value * 3)
            got = await a.recv(gkey(1, 0, "override"), timeout=10, device="cpu")
            assert isinstance(got, np.ndarray) and np.array_equal(got, value * 4)
            # producer: three GPU tensors copied to the host to be encoded
            assert b.stats()["gpu"]["to_host"] == 3
            # consumer: g2g and c2g copied onto the device
            assert a.stats()["gpu"]["to_device"] == 2
            assert a.stats()["grpc"]["bytes"] == 4 * value.nbytes
    run(main())


def test_local_gpu_recv_hands_over_the_same_device_array(fake):
    async def main():
        async with cluster(1, devices=devices.Devices([fake])) as (a,):
            arr = fake.array(np.arange(5))
            a.send(gkey(0, 0, "same"), arr)
            assert await a.recv(gkey(0, 0, "same"), timeout=10) is arr
            a.send(gkey(0, 0, "tohost"), arr)
            got = await a.recv(gkey(0, 0, "tohost"), timeout=10, device="cpu")
            assert isinstance(got, np.ndarray) and got.tolist() == [0, 1, 2, 3, 4]
    run(main())


def test_gpu_tensor_over_the_unary_tensorflow_path(fake):
    async def main():
        async with cluster(2, devices=devices.Devices([fake])) as (a, b):
            value = np.arange(300, dtype=np.int16)
            b.send(gkey(1, 0, "unary"), fake.array(value))
            async with grpc.aio.insecure_channel(b.target) as channel:
                call = channel.unary_unary("/tensorflow.WorkerService/RecvTensor")
                raw = await call(pb.RecvTensorRequest(rendezvous_key=gkey(1, 0, "unary")).SerializeToString(),
                                 timeout=10)
            reply = pb.RecvTensorResponse.FromString(raw)
            assert reply.tensor.tensor_content == value.tobytes()
    run(main())


def test_device_tensor_describes_itself(fake):
    dt = fake.wrap(fake.array(np.zeros((3, 4), np.float64), device=0))
    assert isinstance(dt, DeviceTensor) and dt.nbytes == 96 and dt.placement == Placement("GPU", 0)
    assert dt.meta.shape == (3, 4) and "fake" in repr(dt)
    with pytest.raises(FakeCudaError, match="invalid device ordinal 3"):
        fake.empty(dt.meta, 3)  # the fake has two devices: CUDA's own error, which Devices.resolve forestalls


def test_string_tensors_stay_on_the_host(fake):
    strings = np.array([b"a", b"bc"], dtype=object)
    gpus = devices.Devices([fake])
    assert gpus.place(strings, Placement("GPU", 0), True, (4096, 2)) is strings
    assert not gpus.needs_copy(strings, Placement("GPU", 0), True)

    async def main():
        async with cluster(2, devices=devices.Devices([fake])) as (a, b):
            b.send(gkey(1, 0, "s"), strings)
            got = await a.recv(gkey(1, 0, "s"), timeout=10)
            assert got.tolist() == [b"a", b"bc"]
            assert a.stats()["gpu"]["to_device"] == 0
    run(main())


def test_a_failed_local_placement_leaves_the_tensor_in_the_table(fake, monkeypatch):
    async def main():
        async with cluster(1, devices=devices.Devices([fake])) as (a,):
            a.send(gkey(0, 0, "t"), np.arange(3.0))

            def broken(*args):
                raise MemoryError("device is full")
            monkeypatch.setattr(fake, "from_host", broken)
            with pytest.raises(errors.ResourceExhausted, match="device is full"):
                await a.recv(gkey(0, 0, "t"), timeout=10)
            monkeypatch.undo()
            got = await a.recv(gkey(0, 0, "t"), timeout=10)
            assert np.array_equal(got.get(), np.arange(3.0))
    run(main())


def test_a_fetched_tensor_that_cannot_be_placed_waits_for_the_next_recv(fake, monkeypatch):
    async def main():
        async with cluster(2, devices=devices.Devices([fake])) as (a, b):
            b.send(gkey(1, 0, "t"), np.arange(6.0), step_id=3)
            b.send(gkey(1, 0, "t"), np.arange(6.0) + 100, step_id=3)

            def full(*args):
                raise MemoryError("device is full")
            monkeypatch.setattr(fake, "from_host", full)
            with pytest.raises(errors.ResourceExhausted, match="device is full"):
                await a.recv(gkey(1, 0, "t"), step_id=3, timeout=10)
            monkeypatch.undo()
            first = await a.recv(gkey(1, 0, "t"), step_id=3, timeout=10)
            second = await a.recv(gkey(1, 0, "t"), step_id=3, timeout=10)
            assert np.array_equal(first.get(), np.arange(6.0))  # FIFO kept
            assert np.array_equal(second.get(), np.arange(6.0) + 100)
            # a kept tensor goes with its step
            b.send(gkey(1, 0, "u"), np.arange(2.0), step_id=4)
            monkeypatch.setattr(fake, "from_host", full)
            with pytest.raises(errors.ResourceExhausted, match="device is full"):
                await a.recv(gkey(1, 0, "u"), step_id=4, timeout=10)
            monkeypatch.undo()
            a.cleanup(4)
            with pytest.raises(errors.DeadlineExceeded):
                await a.recv(gkey(1, 0, "u"), step_id=4, timeout=0.2)
    run(main())


class _Runtime:
    """cupy.cuda.runtime as far as event queries go: ``eventQuery`` returns the
    raw cudaError_t of ``cudaEventQuery``, as cupy's does."""

    class CUDARuntimeError(RuntimeError):
        def __init__(self, status: int) -> None:
            super().__init__(f"cudaError {status}")
            self.status = status

    def __init__(self) -> None:
        self.status: dict[int, int] = {}

    def eventQuery(self, ptr: int) -> int:
        return self.status[ptr]


class _CupyEvent:
    def __init__(self, runtime: _Runtime, ptr: int) -> None:
        self.runtime = runtime
        self.ptr = ptr

    @property
    def done(self) -> bool:
        return self.runtime.eventQuery(self.ptr) == 0  # cupy.cuda.Event.done


def test_cupy_event_of_a_failed_copy_raises_instead_of_never_being_done():
    from types import SimpleNamespace

    from rendezvous.devices.cupy_backend import CupyBackend

    runtime = _Runtime()
    backend = CupyBackend()
    backend._cp = SimpleNamespace(cuda=SimpleNamespace(runtime=runtime))
    runtime.status = {1: 0, 2: 600, 3: 700}  # done, cudaErrorNotReady, cudaErrorIllegalAddress
    assert backend.event_done(_CupyEvent(runtime, 1)) is True
    assert backend.event_done(_CupyEvent(runtime, 2)) is False
    with pytest.raises(_Runtime.CUDARuntimeError) as failed:
        backend.event_done(_CupyEvent(runtime, 3))  # else a staged send would wait for it for ever
    assert failed.value.status == 700
