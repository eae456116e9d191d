"""The ordering hazards of GPU tensors (a producer still writing, a block the
allocator hands back, a copy still running), each set up on the fake GPU so
that a wrong ordering gives wrong data (or a recorded violation) every time,
not now and then: a producer kernel held at a gate, a freed block the pool
hands back at once, copies that run later on stream threads, pinned buffers
freed and handed out again.

Nothing here sleeps: a test waits for a state of the fake (``settle``: every
stream idle or blocked; ``wait_until``: a condition woken by every change).
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
from conftest import cluster, run
from test_staging import Comm, FakeMPI, run_until

from rendezvous import devices, errors
from rendezvous.devices import Devices, PinnedPool, Placement
from rendezvous.testing.fakegpu import FakeBackend, FakeCudaError
from rendezvous.mpi.staging import DirectRecv, StagedRecv, StagedSend
from rendezvous.codec.tensors import TensorMeta

pytestmark = pytest.mark.timeout(60)

N = 10_000


@pytest.fixture
def fake():
    return FakeBackend()


def in_thread(fake: FakeBackend, fn, *args):
    """Run ``fn(*args)`` on a thread of its own (a producer's or consumer's thread);
    the list gets its result (or exception), and the fake is woken when it ends."""
    out: list = []

    def body():
        try:
            out.append(fn(*args))
        except BaseException as exc:  # handed to the test
            out.append(exc)
        finally:
            fake.changed()
    th = threading.Thread(target=body, daemon=True)
    th.start()
    return th, out


def gated_producer(fake, **exports):
    """A foreign (torch-like) tensor whose kernel, on its own side stream, writes 7s
    once the returned gate is set."""
    gate = threading.Event()
    tensor, mem = fake.foreign(np.zeros(N, np.uint8), **exports)
    fake.launch(lambda m: m.fill(7), mem, stream=tensor._stream, gate=gate)
    return tensor, gate


def copy_out(fake, dt):
    pinned = fake.pinned(dt.nbytes)
    return pinned, fake.d2h_async(dt, 0, pinned)


# -- 1. intake honours the producer's stream -----------------------------------------


def test_a_torch_like_tensor_is_taken_through_dlpack_with_the_consumers_stream(fake):
    # exports DLPack and CUDA array interface v2 (no stream), like torch
    tensor, gate = gated_producer(fake, cai_version=2)
    dt = Devices([fake]).import_tensor(tensor)  # the producer's thread does not block
    pinned, copied = copy_out(fake, dt)
    fake.settle()
    assert not fake.event_done(copied), "the copy ran before the producer's kernel wrote the tensor"
    gate.set()
    fake.event_wait(copied)
    assert (pinned == 7).all()
    assert tensor.exports == ["dlpack(stream=1)"]  # asked with the consumer's (default) stream


def test_cuda_array_interface_v3_stream_is_waited_on_by_the_gpu_not_the_host(fake):
    tensor, gate = gated_producer(fake, cai_version=3, dlpack=False)
    th, got = in_thread(fake, Devices([fake]).import_tensor, tensor)
    fake.wait_until(lambda: got or fake.host_waiting > 0, what="the import to return or block")
    blocked = not got
    gate.set()
    th.join(10)
    assert not blocked, "the import blocked the producer's thread until its kernel finished"
    pinned, copied = copy_out(fake, got[0])
    fake.event_wait(copied)
    assert (pinned == 7).all()


def test_cuda_array_interface_v2_alone_synchronizes_before_use(fake):
    # no DLPack and no stream (an older exporter): the only safe order is a device synchronize
    tensor, gate = gated_producer(fake, cai_version=2, dlpack=False)
    th, got = in_thread(fake, Devices([fake]).import_tensor, tensor)
    fake.wait_until(lambda: got or fake.host_waiting > 0, what="the import to return or block")
    returned_early = bool(got)
    read = ""
    if returned_early:  # what a copy would send now: the bytes from before the kernel
        pinned, copied = copy_out(fake, got[0])
        fake.settle()
        read = f"; a copy made now reads {pinned[:4].tolist()}" if fake.event_done(copied) else ""
    gate.set()
    th.join(10)
    assert not returned_early, "imported before the producer's kernel finished" + read
    assert fake.synchronizes == 1
    pinned, copied = copy_out(fake, got[0])
    fake.event_wait(copied)
    assert (pinned == 7).all()


def test_a_dlpack_exporter_without_a_stream_argument_is_synchronized(fake):
    tensor, gate = gated_producer(fake, cai_version=None, stream_arg=False)
    th, got = in_thread(fake, Devices([fake]).import_tensor, tensor)
    fake.wait_until(lambda: got or fake.host_waiting > 0, what="the import to return or block")
    assert not got
    gate.set()
    th.join(10)
    pinned, copied = copy_out(fake, got[0])
    fake.event_wait(copied)
    assert (pinned == 7).all()


def test_a_tensor_that_requires_grad_is_detached_not_a_raw_runtime_error(fake):
    tensor, gate = gated_producer(fake, cai_version=2, requires_grad=True)
    with pytest.raises(RuntimeError):
        getattr(tensor, "__cuda_array_interface__")  # noqa: B009 - what torch does
    gate.set()
    dt = Devices([fake]).import_tensor(tensor)
    pinned, copied = copy_out(fake, dt)
    fake.event_wait(copied)
    assert (pinned == 7).all()
    assert tensor.requires_grad  # the caller's tensor is left as it was

    class NoDetach:
        requires_grad = True
        __cuda_array_interface__ = {"shape": (1,), "typestr": "|u1", "data": (0, False), "version": 2}
    with pytest.raises(errors.InvalidArgument, match="detach"):
        Devices([fake]).import_tensor(NoDetach())


def test_send_of_a_requires_grad_tensor_over_a_cluster(fake):
    async def main():
        async with cluster(2, devices=Devices([fake])) as (a, b):
            tensor, mem = fake.foreign(np.arange(64, dtype=np.float32), requires_grad=True)
            fake.launch(lambda m: m.__setitem__(..., np.arange(64, dtype=np.float32)), mem,
                        stream=tensor._stream)
            b.send(gkey(1, 0, "grad"), tensor)
            got = await a.recv(gkey(1, 0, "grad"), timeout=10)
            assert np.array_equal(got.get(), np.arange(64, dtype=np.float32))
    run(main())


# -- 2. allocation and copies ordered ------------------------------------------------


def reused_block_under_a_pending_reader(fake, nbytes):
    """An array on the default stream, a kernel (held at a gate) that will read it,
    and the array freed meanwhile: legal on a GPU (the pool reuses the block on the
    same stream, after that kernel), and the next allocation gets the block."""
    victim = fake.array(np.full(nbytes, 1, np.uint8))
    seen: list[np.ndarray] = []
    gate = threading.Event()
    fake.launch(lambda v: seen.append(v.copy()), victim, gate=gate)
    del victim
    gc.collect()
    return gate, seen


def test_a_copy_into_a_new_destination_waits_for_the_allocating_stream(fake):
    pool = PinnedPool(fake, 4096, depth=2)
    gate, seen = reused_block_under_a_pending_reader(fake, N)
    th, got = in_thread(fake, fake.from_host, np.full(N, 2, np.uint8), 0, pool)
    copy = fake.copy_stream(0, "h2d")
    fake.wait_until(lambda: fake.copies["h2d"] > 0 or copy.blocked_on is not None, what="a copy to start")
    gate.set()
    th.join(10)
    assert (seen[0] == 1).all(), "the host-to-device copy overwrote a block a queued kernel still reads"
    assert (got[0].get() == 2).all()
    assert not fake.violations


def test_a_staged_receive_copies_only_after_the_allocation(fake):
    pool = PinnedPool(fake, 4096, depth=2)
    gate, seen = reused_block_under_a_pending_reader(fake, 8192)
    dst, allocated = fake.allocate(TensorMeta(np.uint8, (8192,)), 0)
    comm = Comm(incoming=[b"\x02" * 4096, b"\x02" * 4096])
    pipe = StagedRecv(comm, FakeMPI, fake, dst, 0, 8192, 0, 7, 4096, pool, allocated)
    pipe.step()
    comm.deliver()
    comm.deliver()
    run_until(pipe, lambda: len(pipe._copying) == 2)  # both copies queued
    fake.settle()
    gate.set()
    run_until(pipe, lambda: pipe.done)
    assert (seen[0] == 1).all(), "the staged copy overwrote a block a queued kernel still reads"
    assert pipe.error is None and (dst.get() == 2).all()


def test_a_direct_receive_posts_only_after_the_allocation(fake):
    gate, seen = reused_block_under_a_pending_reader(fake, 4096)
    dst, allocated = fake.allocate(TensorMeta(np.uint8, (4096,)), 0)
    comm = Comm(incoming=[b"\x03" * 4096])
    pipe = DirectRecv(comm, FakeMPI, fake, dst, 4096, 0, 7, 4096, allocated)
    for _ in range(3):
        pipe.step()
    fake.settle()
    assert not comm.recvs, "MPI was given device memory a queued kernel still reads"
    gate.set()
    run_until(pipe, lambda: len(comm.recvs) == 1)
    comm.deliver()
    run_until(pipe, lambda: pipe.done)
    assert (seen[0] == 1).all() and (dst.get() == 3).all()


# -- 2b. cancelled and failed transfers keep buffers until their copies are done ------------


def gated_device_tensor(fake, n):
    arr = fake.array(np.zeros(n, np.uint8))
    gate = threading.Event()
    fake.launch(lambda a: a.fill(9), arr, gate=gate)
    return fake.wrap(arr), gate


def reuse_freed_pinned(fake, nbytes, count):
    """Pinned buffers as the next transfer would get them, marked."""
    bufs = [fake.pinned(nbytes) for _ in range(count)]
    for b in bufs:
        b[:] = 0xAB
    return bufs


def test_a_cancelled_staged_send_holds_its_pinned_buffers_until_the_copies_end(fake):
    src, gate = gated_device_tensor(fake, 4 * 1024)
    pool = PinnedPool(fake, 1024, depth=3)
    pipe = StagedSend(Comm(), FakeMPI, src, 1, 7, 1024, pool)
    pipe.step()
    assert len(pipe._copying) == 3  # three copies queued behind the producer's kernel
    pipe.cancel()
    assert pipe.done and isinstance(pipe.error, errors.Unavailable)
    del pipe
    assert_reused_buffers_untouched(fake, pool, gate, "a cancelled copy wrote into a buffer handed out again")
    pool.reap()
    assert pool.pending == 0


def assert_reused_buffers_untouched(fake, pool, gate, why: str) -> None:
    """Take every pinned buffer that could be handed out again (freed ones and
    the pool's), fill them, let the held-back copies run, and check none of
    them wrote into one."""
    gc.collect()
    others = reuse_freed_pinned(fake, 1024, 3) + [pool.take() for _ in range(3)]
    for b in others:
        b[:] = 0xAB
    gate.set()
    fake.settle()
    assert not fake.violations, fake.violations
    assert all((b == 0xAB).all() for b in others), why


def test_a_failed_copy_to_the_host_holds_the_chunks_in_flight(fake, monkeypatch):
    src, gate = gated_device_tensor(fake, 4 * 1024)
    pool = PinnedPool(fake, 1024, depth=3)

    def broken(event):
        raise FakeCudaError("cudaErrorIllegalAddress")
    monkeypatch.setattr(fake, "event_wait", broken)
    with pytest.raises(FakeCudaError):
        fake.to_host(src, pool)
    monkeypatch.undo()
    assert_reused_buffers_untouched(fake, pool, gate, "a failed transfer's copy wrote into a reused buffer")


def test_a_cancelled_staged_receive_keeps_its_destination_until_the_copies_end(fake):
    busy = threading.Event()
    fake.copy_stream(0, "h2d").hold(busy)  # the copy engine is busy: the copies stay queued
    pool = PinnedPool(fake, 1024, depth=2)

    def receive_then_cancel():  # its destination is nobody's once this returns
        dst, allocated = fake.allocate(TensorMeta(np.uint8, (2048,)), 0)
        comm = Comm(incoming=[b"\x05" * 1024, b"\x05" * 1024])
        pipe = StagedRecv(comm, FakeMPI, fake, dst, 0, 2048, 0, 7, 1024, pool, allocated)
        pipe.step()
        comm.deliver()
        comm.deliver()
        run_until(pipe, lambda: len(pipe._copying) == 2)
        pipe.cancel()
    receive_then_cancel()
    gc.collect()
    after = fake.empty(TensorMeta(np.uint8, (2048,)), 0)  # the next tensor on the same stream
    fake.raw(after)[:] = 0x11
    busy.set()
    fake.settle()
    assert not fake.violations, fake.violations
    assert (after.get() == 0x11).all(), "a cancelled receive's copy wrote into the next tensor"


# -- 3. two copy streams, a bounded pinned pool, devices that exist ----------------------------


def test_a_receive_does_not_queue_behind_a_send_waiting_for_its_producer(fake):
    side = fake.new_stream(0)
    gate = threading.Event()
    with fake.using(side):
        arr = fake.empty(TensorMeta(np.uint8, (N,)), 0)
        fake.launch(lambda a: a.fill(4), arr, gate=gate)
        src = fake.wrap(arr)  # ready after the gated kernel on the side stream
    pinned, sent = copy_out(fake, src)
    th, got = in_thread(fake, fake.from_host, np.full(N, 6, np.uint8), 0, PinnedPool(fake, 4096, depth=2))
    try:
        fake.wait_until(lambda: bool(got), timeout=10, what="the receive to finish while the send waits")
    finally:
        gate.set()
        th.join(10)
    assert (got[0].get() == 6).all()
    fake.event_wait(sent)
    assert (pinned == 4).all()


def test_the_pinned_pools_of_a_server_keep_a_bounded_amount_idle(fake):
    gpus = Devices([fake])
    chunk = 4 << 20
    pools = [gpus.pool(fake, chunk, 4), gpus.pool(fake, chunk, 2)]
    held = [(p, p.take()) for p in pools for _ in range(20)]  # a burst of transfers
    assert fake.pinned_live_bytes == 40 * chunk
    for p, b in held:
        p.give(b)
    del held, b
    gc.collect()
    assert fake.pinned_live_bytes <= devices.PINNED_KEEP_BYTES, "idle pinned memory is never given back"
    assert sum(p.free for p in pools) * chunk == fake.pinned_live_bytes
    again = pools[0].take()  # still reused
    assert pools[0].allocated == 20 and again is not None


def gkey(src: int, dst: int, name: str, dst_dev: str = "GPU:0") -> str:
    return (f"/job:worker/replica:0/task:{src}/device:GPU:0;0000000000000000;"
            f"/job:worker/replica:0/task:{dst}/device:{dst_dev};{name};0:0")


def test_a_gpu_that_does_not_exist_is_a_clear_error_and_consumes_nothing(fake):
    async def main():
        async with cluster(2, devices=Devices([fake])) as (a, b):
            b.send(gkey(1, 0, "t", "GPU:3"), np.arange(5.0))
            with pytest.raises(errors.FailedPrecondition, match=r"GPU:3.*does not exist.*2 GPUs"):
                await a.recv(gkey(1, 0, "t", "GPU:3"), timeout=10)
            with pytest.raises(errors.FailedPrecondition, match=r"GPU:7.*does not exist.*2 GPUs"):
                await a.recv(gkey(1, 0, "t", "GPU:3"), timeout=10, device="gpu:7")
            got = await a.recv(gkey(1, 0, "t", "GPU:3"), timeout=10, device="gpu:1")
            assert got.device == 1 and got.get().tolist() == [0, 1, 2, 3, 4]
    run(main())


def test_tensors_move_between_the_two_devices(fake):
    async def main():
        async with cluster(2, devices=Devices([fake]), gpu_staging_chunk_bytes=4096) as (a, b):
            value = np.arange(3000, dtype=np.float32)
            b.send(gkey(1, 0, "on1", "GPU:1"), fake.array(value, device=1))
            got = await a.recv(gkey(1, 0, "on1", "GPU:1"), timeout=10)
            assert got.device == 1 and np.array_equal(got.get(), value)
            a.send(gkey(0, 0, "local", "GPU:0"), fake.array(value * 2, device=1))
            got = await a.recv(gkey(0, 0, "local", "GPU:0"), timeout=10)
            assert got.device == 0 and np.array_equal(got.get(), value * 2)
    run(main())
    assert not fake.violations


# -- the fake itself ---------------------------------------------------------------------------


def test_the_fake_refuses_pageable_memory_in_an_asynchronous_copy(fake):
    src = fake.wrap(fake.array(np.ones(16, np.uint8)))
    with pytest.raises(FakeCudaError, match="not pinned"):
        fake.d2h_async(src, 0, np.empty(16, np.uint8))
    dst = fake.empty(TensorMeta(np.uint8, (16,)), 0)
    with pytest.raises(FakeCudaError, match="not pinned"):
        fake.h2d_async(np.ones(16, np.uint8), dst, 0, 0)
    assert len(fake.violations) == 2


def test_the_fake_pool_reuses_a_block_on_its_own_stream_only(fake):
    a = fake.empty(TensorMeta(np.uint8, (64,)), 0)
    address = a.address
    del a
    gc.collect()
    with fake.using(fake.new_stream(0)):
        other = fake.empty(TensorMeta(np.uint8, (64,)), 0)
    assert other.address != address  # another stream: another block
    again = fake.empty(TensorMeta(np.uint8, (64,)), 0)
    assert again.address == address  # same stream: the freed block, at once


def test_the_fake_records_a_block_freed_under_a_pending_copy(fake):
    busy = threading.Event()
    fake.copy_stream(0, "h2d").hold(busy)
    dst = fake.empty(TensorMeta(np.uint8, (64,)), 0)
    pinned = fake.pinned(64)
    fake.h2d_async(pinned, dst, 0, 0)
    del dst
    gc.collect()
    assert fake.violations and "freed while" in fake.violations[0]
    busy.set()
    fake.settle()


def test_resolve_names_the_device_count(fake):
    gpus = Devices([fake])
    assert gpus.resolve(Placement("GPU", 1), True) == (Placement("GPU", 1), fake)
    with pytest.raises(errors.FailedPrecondition, match="this host has 2 GPUs"):
        gpus.resolve(Placement("GPU", 2), False)
    assert devices.Devices([FakeBackend(devices=1)]).resolve(Placement("GPU", 0), True)[0] == Placement("GPU", 0)
