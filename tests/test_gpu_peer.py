"""GPU-to-GPU placement on the fake GPU: a tensor on one GPU placed onto another
of the same process is copied device to device when the pair has peer access
(one copy on the destination's peer copy stream, after the source's ready event
and the destination's allocation), and through pinned host memory otherwise.

As in test_gpu_fake_hazards.py, nothing sleeps: a producer or a reader is held
at a ``threading.Event`` gate, and a test waits for a state of the fake.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
from conftest import cluster, run
from test_gpu_fake_hazards import gkey, in_thread

from rendezvous import errors
from rendezvous.devices import Devices, Placement
from rendezvous.testing.fakegpu import FakeBackend, FakeCudaError
from rendezvous.codec.tensors import TensorMeta

pytestmark = pytest.mark.timeout(60)

N = 10_000
GPU1 = Placement("GPU", 1)
STAGING = (4096, 2)  # pinned chunk bytes, depth: several chunks per tensor when it bounces


@pytest.fixture
def fake():
    return FakeBackend()


def on(fake, values, device):
    """A DeviceTensor of ``values`` on ``device``, ready."""
    return fake.wrap(fake.array(values, device=device))


def no_host_copies(fake) -> bool:
    return fake.copies["d2h"] == 0 and fake.copies["h2d"] == 0


def test_a_peer_capable_pair_copies_device_to_device(fake):
    values = np.arange(N, dtype=np.float32)
    src = on(fake, values, 0)
    got = Devices([fake]).place(src, GPU1, True, STAGING)
    assert got.device == 1 and np.array_equal(got.get(), values)
    assert no_host_copies(fake), f"the tensor went through the host: {fake.copies}"
    assert fake.peer_copies == 1 and fake.host_bounces == 0
    assert not fake.violations


def test_a_pair_without_peer_access_bounces_through_the_host():
    fake = FakeBackend(peer={(1, 0)})  # GPU:1 -> GPU:0 only
    gpus = Devices([fake])
    values = np.arange(N, dtype=np.int32)
    got = gpus.place(on(fake, values, 0), GPU1, True, STAGING)
    assert got.device == 1 and np.array_equal(got.get(), values)
    assert fake.host_bounces == 1 and fake.peer_copies == 0
    assert fake.copies["d2h"] == fake.copies["h2d"] == 10  # 40,000 bytes in 4 KiB chunks, each way
    back = gpus.place(on(fake, values * 3, 1), Placement("GPU", 0), True, STAGING)
    assert back.device == 0 and np.array_equal(back.get(), values * 3)
    assert fake.peer_copies == 1 and fake.host_bounces == 1  # the other direction may go directly
    assert not fake.violations


def test_the_peer_copy_waits_for_a_producer_on_a_side_stream_of_the_source(fake):
    side = fake.new_stream(0)
    gate = threading.Event()
    with fake.using(side):  # the producer's current stream while it writes and sends
        arr = fake.empty(TensorMeta(np.uint8, (N,)), 0)
        fake.launch(lambda a: a.fill(7), arr, gate=gate)
        src = fake.wrap(arr)  # ready once the gated kernel has run
    th, got = in_thread(fake, Devices([fake]).place, src, GPU1, True, STAGING)
    try:
        fake.wait_until(lambda: got or fake.host_waiting > 0, what="the placement to return or wait")
        fake.settle()
        early = bool(got) or fake.peer_copies > 0
    finally:
        gate.set()
        th.join(10)
    assert not early, "the tensor was copied to GPU:1 before its producer's kernel wrote it"
    assert not isinstance(got[0], BaseException), got[0]
    assert got[0].device == 1 and (got[0].get() == 7).all()
    assert no_host_copies(fake) and fake.peer_copies == 1
    assert not fake.violations


def test_the_peer_copy_waits_for_the_destinations_allocating_stream(fake):
    # A kernel queued on GPU:1's default stream still reads a block that was freed
    # meanwhile; the pool hands that block to the next allocation on that stream,
    # the destination of the peer copy. The copy must wait for that kernel.
    victim = fake.array(np.full(N, 1, np.uint8), device=1)
    address = victim.address
    seen: list[np.ndarray] = []
    gate = threading.Event()
    read = fake.launch(lambda v: seen.append(v.copy()), victim, gate=gate)
    del victim
    gc.collect()
    src = on(fake, np.full(N, 2, np.uint8), 0)
    th, got = in_thread(fake, Devices([fake]).place, src, GPU1, True, STAGING)
    peer = fake.copy_stream(1, "peer")
    try:
        fake.wait_until(lambda: got or fake.host_waiting > 0, what="the placement to return or wait")
        fake.settle()
    finally:
        gate.set()
        th.join(10)
    fake.event_wait(read)
    assert not isinstance(got[0], BaseException), got[0]
    assert got[0].address == address, "the destination did not get the freed block (the test proves nothing)"
    assert (seen[0] == 1).all(), "the peer copy overwrote a block a queued kernel on GPU:1 still reads"
    assert (got[0].get() == 2).all()
    assert no_host_copies(fake) and fake.peer_copies == 1 and peer.pending == 0
    assert not fake.violations


def test_a_failed_peer_copy_is_a_clear_error_and_leaks_nothing(fake):
    gpus = Devices([fake])
    src = on(fake, np.arange(N, dtype=np.int16), 0)
    fake.peer_faults.append(FakeCudaError("cudaErrorIllegalAddress: an illegal memory access was encountered"))
    with pytest.raises(FakeCudaError, match="cudaErrorIllegalAddress") as failed:
        gpus.place(src, GPU1, True, STAGING)
    assert any("GPU:0 -> GPU:1" in note for note in getattr(failed.value, "__notes__", [])), \
        "the error does not say which copy failed"
    del failed
    gc.collect()
    assert fake.device_bytes(1) == 0, "the destination of the failed copy is still allocated"
    assert not fake.violations, fake.violations
    assert gpus.held == 0
    got = gpus.place(src, GPU1, True, STAGING)  # the source is intact: the next try works
    assert np.array_equal(got.get(), np.arange(N, dtype=np.int16))
    assert fake.peer_copies == 1 and no_host_copies(fake)


def test_a_wait_that_fails_while_the_peer_copy_runs_holds_both_tensors(fake, monkeypatch):
    gpus = Devices([fake])
    busy = threading.Event()
    fake.copy_stream(1, "peer").hold(busy)  # the copy engine is busy: the peer copy stays queued

    src = on(fake, np.full(N, 5, np.uint8), 0)

    def broken(event):
        raise FakeCudaError("cudaErrorLaunchTimeout")
    monkeypatch.setattr(fake, "event_wait", broken)
    with pytest.raises(FakeCudaError, match="cudaErrorLaunchTimeout"):
        gpus.place(src, GPU1, True, STAGING)
    monkeypatch.undo()
    del src
    gc.collect()
    assert not fake.violations, fake.violations
    assert gpus.held == 1  # the source and the destination, until the copy is done
    # the next tensors on the same streams would get the blocks at once if they had been freed
    fresh0 = fake.empty(TensorMeta(np.uint8, (N,)), 0)
    fresh1 = fake.empty(TensorMeta(np.uint8, (N,)), 1)
    fake.raw(fresh0)[:] = 0x11
    fake.raw(fresh1)[:] = 0x22
    busy.set()
    fake.settle()
    assert not fake.violations, fake.violations
    assert (fresh1.get() == 0x22).all(), "the peer copy wrote into a block handed out again"
    assert fake.peer_copies == 1 and no_host_copies(fake)
    gpus.reap()
    assert gpus.held == 0


def test_a_local_recv_onto_another_gpu_goes_peer_to_peer_and_a_failure_keeps_the_tensor(fake):
    async def main():
        async with cluster(2, devices=Devices([fake]), gpu_staging_chunk_bytes=4096) as (a, _):
            value = np.arange(3000, dtype=np.float32)
            a.send(gkey(0, 0, "move", "GPU:1"), fake.array(value, device=0))
            got = await a.recv(gkey(0, 0, "move", "GPU:1"), timeout=10)
            assert got.device == 1 and np.array_equal(got.get(), value)
            assert fake.peer_copies == 1 and no_host_copies(fake)

            a.send(gkey(0, 0, "again", "GPU:1"), fake.array(value * 2, device=0))
            fake.peer_faults.append(FakeCudaError("cudaErrorECCUncorrectable"))
            with pytest.raises(errors.ResourceExhausted, match=r"GPU:1.*cudaErrorECCUncorrectable.*kept"):
                await a.recv(gkey(0, 0, "again", "GPU:1"), timeout=10)
            got = await a.recv(gkey(0, 0, "again", "GPU:1"), timeout=10)  # kept: the next recv has it
            assert got.device == 1 and np.array_equal(got.get(), value * 2)
            assert fake.peer_copies == 2 and no_host_copies(fake)
    run(main())
    gc.collect()
    assert not fake.violations, fake.violations


def test_the_fake_refuses_a_peer_copy_between_devices_without_access():
    fake = FakeBackend(peer=set())
    assert not fake.can_access_peer(0, 1) and not fake.can_access_peer(0, 0)
    src = on(fake, np.ones(16, np.uint8), 0)
    dst = fake.empty(TensorMeta(np.uint8, (16,)), 1)
    with pytest.raises(FakeCudaError, match="peer access"):
        fake.peer_async(src, dst, 1)
    assert fake.violations and "peer access" in fake.violations[0]
    assert FakeBackend().can_access_peer(0, 1) and FakeBackend().can_access_peer(1, 0)
