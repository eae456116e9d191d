"""recv(framework="torch"): torch tensors that share the received memory
(rendezvous/interop.py). The torch tests run where torch imports (it is not a
dependency); the refusals run everywhere. A refused recv consumes nothing."""

from __future__ import annotations

import asyncio
import importlib.util
import sys

import numpy as np
import pytest

import rendezvous
from rendezvous import aio, interop
from rendezvous.errors import FailedPrecondition, InvalidArgument

from conftest import cluster, key, run

pytestmark = pytest.mark.timeout(60)
HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed (not a dependency)")


def test_an_unknown_framework_is_refused_before_anything_is_taken():
    async def main():
        async with cluster(2) as (a, b):
            b.send(key(1, 0, "t"), np.arange(3))
            with pytest.raises(InvalidArgument, match="framework must be one of"):
                await a.recv(key(1, 0, "t"), framework="jax", timeout=5)
            assert (await a.recv(key(1, 0, "t"), timeout=5)).tolist() == [0, 1, 2]
    run(main())


def test_without_torch_asking_for_torch_says_so_and_takes_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError

    async def main():
        async with cluster(2) as (a, b):
            b.send(key(1, 0, "t"), np.arange(3))
            with pytest.raises(FailedPrecondition, match="needs torch"):
                await a.recv(key(1, 0, "t"), framework="torch", timeout=5)
            assert (await a.recv(key(1, 0, "t"), timeout=5)).tolist() == [0, 1, 2]
    run(main())


@needs_torch
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.uint8, np.bool_, np.complex64, np.float16])
def test_remote_recv_as_torch_shares_the_received_buffer(dtype):
    import torch

    async def main():
        async with cluster(2) as (a, b):
            value = (np.arange(4096) % 7).astype(dtype)
            b.send(key(1, 0, "g"), value)
            got = await a.recv(key(1, 0, "g"), framework="torch", timeout=10)
            assert isinstance(got, torch.Tensor) and got.device.type == "cpu"
            assert got.numpy().tolist() == value.tolist()
            # the tensor is a view of the array the recv produced: no copy
            got.view(torch.uint8)[0] ^= 1  # writable, and writes land in its own memory
    run(main())


@needs_torch
def test_local_recv_as_torch_is_the_sent_array_itself():
    import torch

    async def main():
        async with cluster(1) as (a,):
            value = np.arange(10, dtype=np.float32)
            a.send(key(0, 0, "self"), value)
            got = await a.recv(key(0, 0, "self"), framework="torch", timeout=5)
            value[0] = 42.0
            assert isinstance(got, torch.Tensor) and float(got[0]) == 42.0  # shared, zero copy
    run(main())


@needs_torch
def test_a_string_tensor_is_refused_as_torch_and_kept():
    async def main():
        async with cluster(2) as (a, b):
            strings = np.array([b"a", b"bc"], dtype=object)
            b.send(key(1, 0, "s"), strings)
            with pytest.raises(InvalidArgument, match="no torch form"):
                await a.recv(key(1, 0, "s"), framework="torch", timeout=10)
            assert (await a.recv(key(1, 0, "s"), timeout=10)).tolist() == [b"a", b"bc"]
    run(main())


@needs_torch
def test_blocking_server_and_a_torch_tensor_sent_and_received():
    import torch

    with rendezvous.Server({"worker": ["127.0.0.1:0"]}, "worker", 0) as s:
        s.send(key(0, 0, "t"), torch.arange(6, dtype=torch.float32).reshape(2, 3))
        got = s.recv(key(0, 0, "t"), framework="torch", timeout=5)
        assert isinstance(got, torch.Tensor) and got.shape == (2, 3) and got.sum().item() == 15.0
        s.send(key(0, 0, "dead"), None, is_dead=True)
        assert s.recv(key(0, 0, "dead"), framework="torch", timeout=5) is None
        s.send(key(0, 0, "str"), np.array([b"x"]))
        with pytest.raises(InvalidArgument):
            s.recv(key(0, 0, "str"), framework="torch", timeout=5)
        assert s.recv(key(0, 0, "str"), timeout=5).tolist() == [b"x"]


@needs_torch
def test_a_tensor_that_needs_grad_is_refused_at_send_with_the_fix_named():
    import torch

    async def main():
        async with cluster(1) as (a,):
            with pytest.raises(Exception, match="detach"):
                a.send(key(0, 0, "w"), torch.ones(3, requires_grad=True))
    run(main())


@needs_torch
def test_bfloat16_travels_as_torch_bfloat16():
    pytest.importorskip("ml_dtypes")
    import ml_dtypes
    import torch

    value = np.arange(8, dtype=np.float32).astype(ml_dtypes.bfloat16)
    got = interop.convert(value, "torch")
    assert got.dtype == torch.bfloat16 and got.float().tolist() == list(range(8))


def test_the_fake_gpu_array_goes_through_dlpack_when_torch_is_asked(monkeypatch):
    """A device array (anything that is not numpy) goes through torch.from_dlpack."""
    seen = []

    class FakeTorch:
        @staticmethod
        def from_dlpack(value):
            seen.append(value)
            return ("torch-tensor", value)

    monkeypatch.setitem(sys.modules, "torch", FakeTorch)
    device_array = object()
    assert interop.convert(device_array, "torch") == ("torch-tensor", device_array)
    assert seen == [device_array]
    assert interop.convert(None, "torch") is None
    assert aio.Server  # the module under test is imported with the server


MIXED = [np.arange(5, dtype=np.float64) + 0.5, np.arange(3, dtype=np.int32) - 1, np.array([1 + 2j, 3 - 4j]),
         np.arange(7, dtype=np.int8), np.arange(4, dtype=np.float16), np.arange(6, dtype=np.int64).reshape(2, 3),
         np.array([0.25], np.float32)]


def _aligned(value: np.ndarray) -> bool:
    return value.ctypes.data % value.dtype.alignment == 0


def test_remote_recvs_over_grpc_are_aligned_to_their_dtypes():
    """A tensor's bytes once lay wherever its frame's header ended (float64
    views at address % 8 == 6): a recv alone, recvs of one turn, and batches
    of mixed dtypes of every size (group replies whose headers differ in
    length) all hand out arrays aligned to their dtypes, with their values."""
    async def main():
        async with cluster(2) as (a, b):
            for step in range(1, 10):
                name = "x" * step  # keys, and so headers, of another length each step
                keys = [key(1, 0, f"{name}{i}") for i in range(step)]
                for k, v in zip(keys, MIXED * 2):
                    b.send(k, v, step_id=step)
                got = await a.recv_many(keys, step_id=step, timeout=10)
                for k, v in zip(keys, MIXED * 2):
                    b.send(k, v, step_id=100 + step)
                got += [await a.recv(k, step_id=100 + step, timeout=10) for k in keys]
                for k, v in zip(keys, MIXED * 2):
                    b.send(k, v, step_id=200 + step)
                got += await asyncio.gather(*(a.recv(k, step_id=200 + step, timeout=10) for k in keys))
                for want, have in zip((MIXED * 2)[:step] * 3, got):
                    assert have.dtype == want.dtype and _aligned(have), (step, have.dtype, have.ctypes.data % 8)
                    np.testing.assert_array_equal(have, want)
    run(main())


@needs_torch
def test_remote_recvs_as_torch_are_aligned_and_hold_their_values():
    import torch

    async def main():
        async with cluster(2) as (a, b):
            for step in range(1, 6):
                keys = [key(1, 0, f"{'t' * step}{i}") for i in range(len(MIXED))]
                for k, v in zip(keys, MIXED):
                    b.send(k, v, step_id=step)
                got = await a.recv_many(keys, step_id=step, timeout=10, framework="torch")
                b.send(keys[0], MIXED[0], step_id=100 + step)
                got.append(await a.recv(keys[0], step_id=100 + step, timeout=10, framework="torch"))
                for want, have in zip([*MIXED, MIXED[0]], got):
                    assert isinstance(have, torch.Tensor) and have.data_ptr() % want.dtype.alignment == 0
                    assert have.numpy().tolist() == want.tolist()
    run(main())


@needs_torch
@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.complex128, np.float16])
def test_an_array_misaligned_for_its_dtype_is_copied_for_torch(dtype):
    """A writable array whose memory is not aligned to its dtype (as a frame
    read in place could once be) is copied before torch takes it: torch
    reads misaligned data wrongly, or not at all."""
    import torch

    want = (np.arange(5) + 1).astype(dtype)
    raw = bytearray(want.nbytes + 3)
    value = np.frombuffer(raw, dtype, 5, 3)
    value[:] = want
    assert value.flags.writeable and not value.flags.aligned
    got = interop.convert(value, "torch")
    assert isinstance(got, torch.Tensor) and got.data_ptr() % np.dtype(dtype).alignment == 0
    assert got.numpy().tolist() == want.tolist()
