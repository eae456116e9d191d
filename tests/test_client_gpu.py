"""GPU tensors through a daemon's local clients, on the fake GPU.

A local client's send of a GPU tensor copies it to the host once (after the
work that wrote it), into a lent segment or inside the frame; a recv puts the
tensor where the key's dst_device (or ``device=``) says. A tensor the client
cannot put on its GPU is given back to the daemon (kept for the next recv of
its key) and the recv fails RESOURCE_EXHAUSTED: nothing fetched is lost."""

from __future__ import annotations

import asyncio
import gc
import threading

import numpy as np
import pytest

from rendezvous.client import Client as BlockingClient
from rendezvous.client.aio import Client
from rendezvous.devices import Devices
from rendezvous.errors import DeadlineExceeded, FailedPrecondition, ResourceExhausted
from rendezvous.testing.fakegpu import FakeBackend, FakeDeviceArray

from conftest import run, until
from test_daemon import daemons
from test_lent_buffers import no_leaked_segments, sockdir  # noqa: F401 (fixtures: a short socket dir; no segment left)

pytestmark = pytest.mark.timeout(60)
BIG = 3 << 20  # float32s: 12 MiB, through a segment, in three staging chunks
SMALL = 16  # inside the frame


def gkey(name: str, dst: str = "GPU:1") -> str:
    return (f"/job:node/replica:0/task:0/device:GPU:0;0000000000000000;"
            f"/job:node/replica:0/task:0/device:{dst};{name};0:0")


def _nothing_left(d) -> None:
    """Nothing waits in the daemon: no tensor, waiter or kept one."""
    assert d.server.pending() == [], d.server.pending()


@pytest.mark.parametrize("shm", [True, False], ids=["session", "grpc"])
def test_gpu_tensors_cross_the_local_hop_and_land_where_their_keys_say(sockdir, shm):
    fake = FakeBackend()

    async def main():
        async with daemons(sockdir) as (d,), \
                Client(d.local_target, shm_ok=shm, devices=Devices([fake])) as a, \
                Client(d.local_target, shm_ok=shm, devices=Devices([fake])) as b:
            big = np.arange(BIG, dtype=np.float32)
            await a.send(gkey("big"), fake.array(big, 0), step_id=1)
            await a.send_many([(gkey("small"), fake.array(np.arange(SMALL), 0)), (gkey("host"), np.ones(3)),
                               (gkey("cpu", "CPU:0"), fake.array(np.full(4, 7.0), 1))], step_id=1)
            sent = a.stats()
            assert sent["send_from_gpu"] == 3
            assert sent.get("send_shm", 0) == (1 if shm else 0)

            got = await b.recv(gkey("big"), step_id=1, timeout=10)
            assert isinstance(got, FakeDeviceArray) and got.device == 1  # the key's GPU:1
            np.testing.assert_array_equal(fake.raw(got), big)
            small, host, cpu = await b.recv_many([gkey("small"), gkey("host"), gkey("cpu", "CPU:0")],
                                                 step_id=1, timeout=10)
            assert isinstance(small, FakeDeviceArray) and small.device == 1
            np.testing.assert_array_equal(fake.raw(small), np.arange(SMALL))
            assert isinstance(host, FakeDeviceArray)  # a host tensor bound for a GPU goes there
            np.testing.assert_array_equal(fake.raw(host), np.ones(3))
            assert type(cpu) is np.ndarray  # a key bound for a CPU: numpy, wherever it was made
            np.testing.assert_array_equal(cpu, np.full(4, 7.0))
            assert b.stats()["recv_to_gpu"] == 3

            # device= overrides the key: "cpu" gives numpy, "gpu:0" the other GPU
            await a.send_many([(gkey("c"), fake.array(np.arange(5), 0)), (gkey("g"), np.arange(6))], step_id=2)
            c = await b.recv(gkey("c"), step_id=2, timeout=10, device="cpu")
            assert type(c) is np.ndarray
            np.testing.assert_array_equal(c, np.arange(5))
            g, = await b.recv_many([gkey("g")], step_id=2, timeout=10, device="gpu:0")
            assert isinstance(g, FakeDeviceArray) and g.device == 0
            np.testing.assert_array_equal(fake.raw(g), np.arange(6))
            del got, small, host, g
            _nothing_left(d)
    run(main())
    fake.settle()
    gc.collect()
    assert fake.violations == []
    assert fake.device_bytes(0) == fake.device_bytes(1) == 0


def test_a_send_reads_a_gpu_tensor_only_after_the_work_that_writes_it(sockdir):
    """The tensor is written by a kernel on a side stream held by a gate: the
    send's copy waits for it, so the receiver sees the kernel's values."""
    fake = FakeBackend()
    gate = threading.Event()

    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target, devices=Devices([fake])) as a, \
                Client(d.local_target) as b:
            side = fake.new_stream(0)
            tensor, memory = fake.foreign(np.zeros(BIG, np.float32), 0, stream=side)
            fake.launch(lambda m: m.__setitem__(..., 5.0), memory, stream=side, gate=gate)
            send = asyncio.ensure_future(a.send(gkey("w", "CPU:0"), tensor, step_id=1))
            await until(lambda: fake.host_waiting > 0, what="the send's copy waiting on the device")
            with pytest.raises(DeadlineExceeded):  # nothing is produced before the kernel ran
                await b.recv(gkey("w", "CPU:0"), step_id=1, timeout=0.2)
            assert not send.done()
            gate.set()
            await send
            got = await b.recv(gkey("w", "CPU:0"), step_id=1, timeout=10)
            assert type(got) is np.ndarray and (got == 5.0).all()
            del got
            _nothing_left(d)
    try:
        run(main())
    finally:
        gate.set()
    fake.settle()
    assert fake.violations == []


def test_a_gpu_this_host_lacks_is_refused_before_anything_is_taken(sockdir):
    fake = FakeBackend(devices=2)

    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target, devices=Devices([fake])) as b:
            await b.send(gkey("x"), np.arange(4.0), step_id=1)
            with pytest.raises(FailedPrecondition, match="does not exist: this host has 2 GPUs"):
                await b.recv(gkey("x", "GPU:5"), step_id=1, timeout=10)
            with pytest.raises(FailedPrecondition, match="the device asked for is GPU:7"):
                await b.recv_many([gkey("x")], step_id=1, timeout=10, device="gpu:7")
            got = await b.recv(gkey("x"), step_id=1, timeout=10)  # still there
            np.testing.assert_array_equal(fake.raw(got), np.arange(4.0))
            del got
            _nothing_left(d)
    run(main())


def test_a_key_naming_a_gpu_gives_numpy_where_no_gpu_is_usable(sockdir, caplog):
    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target, devices=Devices([FakeBackend(devices=0)])) as b:
            await b.send(gkey("x"), np.arange(4.0), step_id=1)
            got = await b.recv(gkey("x"), step_id=1, timeout=10)
            assert type(got) is np.ndarray
            np.testing.assert_array_equal(got, np.arange(4.0))
            with pytest.raises(FailedPrecondition, match="needs a GPU"):
                await b.recv(gkey("x"), step_id=1, timeout=10, device="gpu:0")
    with caplog.at_level("WARNING"):
        run(main())
    assert sum("no GPU backend is usable" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("shm", [True, False], ids=["session", "grpc"])
def test_a_tensor_the_gpu_cannot_take_is_kept_for_the_next_recv(sockdir, shm):
    """An H2D copy fails (out of memory, say): the recv fails RESOURCE_EXHAUSTED
    and every tensor of its answer goes back to the daemon: the next recv gets
    each once, and nothing is left anywhere."""
    fake = FakeBackend()

    def b_client(d):
        return BlockingClient(d.local_target, shm_ok=shm, devices=Devices([fake]))

    async def main():
        async with daemons(sockdir) as (d,):
            loop = asyncio.get_running_loop()
            big, small = np.arange(BIG, dtype=np.float32), np.arange(SMALL)

            def work() -> None:
                with b_client(d) as c:
                    c.send_many([(gkey("big"), big), (gkey("small"), small)], step_id=1)
                    fake.copy_faults["h2d"] = [MemoryError("out of device memory")]
                    with pytest.raises(ResourceExhausted, match="kept for the next recv"):
                        c.recv_many([gkey("small"), gkey("big")], step_id=1, timeout=10)
                    fake.copy_faults["h2d"] = [None, MemoryError("out of device memory")]
                    with pytest.raises(ResourceExhausted, match="out of device memory"):
                        c.recv(gkey("big"), step_id=1, timeout=10)
                    got_big = c.recv(gkey("big"), step_id=1, timeout=10)
                    got_small = c.recv(gkey("small"), step_id=1, timeout=10)
                    np.testing.assert_array_equal(fake.raw(got_big), big)
                    np.testing.assert_array_equal(fake.raw(got_small), small)
                    for k in ("big", "small"):  # each once
                        with pytest.raises(DeadlineExceeded):
                            c.recv(gkey(k), step_id=1, timeout=0.2)
            await loop.run_in_executor(None, work)
            _nothing_left(d)
            await until(lambda: d.pool.stats()["held"] == 0 and d.pool.stats()["in_table"] == 0,
                        what="every segment back in the pool")
    run(main())
    fake.settle()
    assert fake.violations == []


def test_a_failed_copy_off_the_gpu_fails_the_send_and_keeps_its_segment(sockdir):
    fake = FakeBackend()

    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target, devices=Devices([fake])) as a:
            x = fake.array(np.arange(BIG, dtype=np.float32), 0)
            segments = a._link.segments
            before = sum(len(ids) for ids in segments._stock.values())
            fake.copy_faults["d2h"] = [None, RuntimeError("cudaErrorIllegalAddress")]  # the second chunk
            with pytest.raises(RuntimeError, match="IllegalAddress"):
                await a.send(gkey("w"), x, step_id=1)
            assert sum(len(ids) for ids in segments._stock.values()) == max(before, 1)  # back in stock
            _nothing_left(d)
            await a.send(gkey("w"), x, step_id=1)
            got = await a.recv(gkey("w"), step_id=1, timeout=10, device="cpu")
            np.testing.assert_array_equal(got, np.arange(BIG, dtype=np.float32))
            del got
            _nothing_left(d)
    run(main())
    fake.settle()
    assert fake.violations == []


def test_host_only_clients_never_probe_a_gpu(sockdir):
    """numpy alone makes no GPU backend; other host objects are typed by their
    attributes; only a key naming a GPU makes the backend look for one."""
    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target) as a:
            await a.send_many([(gkey("a"), np.arange(3)), (gkey("b", "CPU:0"), np.arange(2))], step_id=1)
            await a.send(gkey("c", "CPU:0"), np.arange(BIG, dtype=np.float32), step_id=1)
            await a.recv_many([gkey("c", "CPU:0"), gkey("b", "CPU:0")], step_id=1, timeout=10)
            assert a._core.gpu._devices is None
            await a.send(gkey("l", "CPU:0"), [1, 2], step_id=1)
            backend, = a._core.gpu._devices.backends  # cupy's, never asked for a device
            assert backend._available is None and backend._count is None
            np.testing.assert_array_equal(await a.recv(gkey("l", "CPU:0"), step_id=1, timeout=10), [1, 2])
            assert backend._available is None
            await a.recv(gkey("a"), step_id=1, timeout=10)  # a key naming a GPU: one is looked for
            assert backend._available is not None
    run(main())


def test_the_asyncio_client_gives_back_what_its_gpu_cannot_take(sockdir):
    fake = FakeBackend()

    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target, devices=Devices([fake])) as c:
            await c.send(gkey("x"), np.arange(BIG, dtype=np.float32), step_id=1)
            fake.copy_faults["h2d"] = [None, MemoryError("out of device memory")]
            with pytest.raises(ResourceExhausted, match="kept for the next recv"):
                await c.recv(gkey("x"), step_id=1, timeout=10)
            got = await c.recv(gkey("x"), step_id=1, timeout=10)
            np.testing.assert_array_equal(fake.raw(got), np.arange(BIG, dtype=np.float32))
            with pytest.raises(DeadlineExceeded):
                await c.recv(gkey("x"), step_id=1, timeout=0.2)
            del got
            _nothing_left(d)
    run(main())
    fake.settle()
    assert fake.violations == []
