"""GPU tensors between processes of one node by CUDA IPC (rendezvous/ipc.py),
on the fake GPU's IPC model (rendezvous/testing/fakegpu_ipc.py) across real
processes: this test's process is one rank, tests/ipc_agent.py the other.

Each ordering rule has a test that fails when the rule is broken: the copy
waits for the producer's event; the producer holds the memory until the
consumer's release, which comes only once the copy is done; a consumer that
dies releases; a copy that cannot be made puts the tensor back; opened handles
are cached per allocation. Where IPC cannot apply, the tensor goes another way
and the fallback is counted."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf import any_pb2

import rendezvous
from rendezvous.codec.parsing import ReplyHead
from rendezvous.devices import CPU, DeviceTensor, Devices, Placement
from rendezvous.errors import DeadlineExceeded, Internal, Unavailable
from rendezvous.items import Received
from rendezvous.stats import Stats
from rendezvous.testing.fakegpu import FakeCudaError
from rendezvous.testing.fakegpu_ipc import FakeIpcBackend
from rendezvous.transport import DataPlane, Planes
from rendezvous.transport.inline import InlinePlane
from rendezvous.ipc import IpcPlane
from rendezvous.v1 import rendezvous_pb2 as pb

from conftest import run, until
from mpi_scenarios import wait_for

pytestmark = pytest.mark.timeout(120)

AGENT = str(Path(__file__).resolve().parent / "ipc_agent.py")
NODE = "node-a"


def gkey(src: int, dst: int, name: str) -> str:
    return (f"/job:worker/replica:0/task:{src}/device:GPU:0;0000000000000000;"
            f"/job:worker/replica:0/task:{dst}/device:GPU:0;{name};0:0")


def values(n: int, seed: int) -> np.ndarray:
    return seed + np.arange(n, dtype=np.float32)


class Agent:
    """A rank in a process of its own (tests/ipc_agent.py), driven by commands."""

    def __init__(self, node: str, index: int) -> None:
        self.p = subprocess.Popen([sys.executable, AGENT, node, str(index)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        self.results: dict[int, dict] = {}
        self.cond = threading.Condition()
        self.next_id = 1
        threading.Thread(target=self._read, daemon=True).start()
        first = self.result(0)
        self.target, self.pid = first["target"], first["pid"]

    def _read(self) -> None:
        for line in self.p.stdout:  # type: ignore[union-attr]
            msg = json.loads(line)
            with self.cond:
                self.results[msg["id"]] = msg
                self.cond.notify_all()

    def call(self, **cmd: Any) -> int:
        with self.cond:
            cmd["id"] = n = self.next_id
            self.next_id += 1
        self.p.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
        self.p.stdin.flush()  # type: ignore[union-attr]
        return n

    def result(self, n: int, timeout: float = 60) -> dict:
        with self.cond:
            if not self.cond.wait_for(lambda: n in self.results or self.p.poll() is not None, timeout):
                raise AssertionError(f"no answer to {n} within {timeout}s")
            if n not in self.results:
                raise AssertionError(f"the agent exited ({self.p.returncode}) without answering {n}")
            return self.results.pop(n)

    def do(self, **cmd: Any) -> dict:
        got = self.result(self.call(**cmd))
        assert got["ok"], got
        return got

    def state(self) -> dict:
        return self.do(op="state")

    def until(self, predicate, what: str) -> dict:
        seen: list[dict] = []
        wait_for(lambda: predicate(seen.append(self.state()) or seen[-1]), what, 30)
        return seen[-1]

    def close(self) -> None:
        if self.p.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                self.call(op="exit")
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


@pytest.fixture
def producer() -> Iterator[Agent]:
    """Task 1 in a process of its own, on node NODE's fake GPUs."""
    agent = Agent(NODE, 1)
    yield agent
    agent.close()


@contextlib.contextmanager
def rank(node: str, index: int, others: dict[int, str],
         **settings: Any) -> Iterator[tuple[rendezvous.Server, FakeIpcBackend]]:
    """Task ``index`` in this process on ``node``'s fake GPUs, knowing the tasks ``others``."""
    fake = FakeIpcBackend(node)
    server = rendezvous.Server({"worker": ["127.0.0.1:0", "127.0.0.1:0"]}, "worker", index, devices=Devices([fake]),
                               **settings)
    with server:
        targets = {**others, index: server.target}
        server.update_cluster({"worker": [targets[0], targets[1]]})
        yield server, fake


def ipc_plane(server: rendezvous.Server) -> IpcPlane:
    (plane,) = [p for p in server.aio.planes.planes if isinstance(p, IpcPlane)]
    return plane


def released(producer: Agent, what: str) -> dict:
    """The producer's state once it holds no export and no device memory (its
    stream lets go of a reply's tensor once the write returns, which may come
    after the consumer's release)."""
    return producer.until(lambda s: s["exports"] == 0 and s["device_bytes"] == 0, what)


def nothing_more(server: rendezvous.Server, k: str) -> None:
    """Exactly once: the key answers no second time."""
    with pytest.raises(DeadlineExceeded):
        server.recv(k, timeout=0.3, device="gpu:0")


def test_a_gpu_tensor_from_another_process_of_the_node_comes_device_to_device_by_ipc(producer):
    with rank(NODE, 0, {1: producer.target}) as (c, fake):
        k = gkey(1, 0, "w")
        producer.do(op="send", key=k, n=4096, seed=5)
        got = c.recv(k, timeout=30, device="gpu:0")
        np.testing.assert_array_equal(got.get(), values(4096, 5))
        stats = c.stats()
        assert stats["ipc"]["transfers"] == 1 and stats["ipc"]["bytes"] == 4096 * 4
        assert stats["gpu"]["ipc_recvs"] == 1 and stats["gpu"]["ipc_opens"] == 1
        assert stats["grpc"]["transfers"] == 0 and stats["gpu"]["to_device"] == 0  # no host bounce
        st = released(producer, "the producer to see the release and free the memory")
        assert st["gpu"]["ipc_sends"] == 1 and st["gpu"]["to_host"] == 0 and st["ipc"]["served"] == 1
        assert not st["violations"]
        nothing_more(c, k)
        del got
        gc.collect()
        assert fake.device_bytes(0) == 0 and not fake.violations


def test_a_thousand_transfers_open_each_allocation_once_and_leave_no_device_memory(producer):
    with rank(NODE, 0, {1: producer.target}) as (c, fake):
        for r in range(100):
            producer.do(op="send", key=gkey(1, 0, f"k{r}-{{i}}"), n=256, seed=r, count=10)
            for i in range(10):
                got = c.recv(gkey(1, 0, f"k{r}-{i}"), timeout=30, device="gpu:0")
                np.testing.assert_array_equal(got.get(), values(256, r + i))
                del got
        gc.collect()
        stats = c.stats()
        assert stats["ipc"]["transfers"] == 1000 and stats["gpu"]["ipc_recvs"] == 1000
        # the producer's allocator hands the same blocks out again: each opened once, kept open
        assert stats["gpu"]["ipc_opens"] == fake.opened <= 10 and fake.closed == 0
        st = released(producer, "every export released, the memory free")
        assert st["gpu"]["ipc_sends"] == 1000 and not st["violations"]
        assert fake.device_bytes(0) == 0 and not fake.violations


def test_the_copy_waits_for_the_producers_event_not_for_the_host(producer):
    """The producer's kernel writing the tensor is held: the consumer's copy
    stream waits on the exported event, and copies what the kernel wrote."""
    with rank(NODE, 0, {1: producer.target}) as (c, fake), concurrent.futures.ThreadPoolExecutor(1) as pool:
        k = gkey(1, 0, "late")
        producer.do(op="send", key=k, n=1024, seed=9, gated=True)
        recv = pool.submit(c.recv, k, timeout=30, device="gpu:0")
        try:
            fake.wait_until(lambda: any(type(s.blocked_on).__name__ == "_RemoteEvent" for s in fake._streams),
                            what="the copy waiting for the producer's event", timeout=30)
            assert not recv.done()
        finally:
            producer.do(op="open")
        np.testing.assert_array_equal(recv.result(30).get(), values(1024, 9))


def test_the_producer_holds_the_memory_until_the_copy_is_done_and_released(producer):
    """Only the producer's server holds the tensor once it is sent; the
    consumer's copy is held (past the retry window, whose answer then goes):
    the export (and its memory) stays until the copy has run, and the release
    comes after it."""
    with rank(NODE, 0, {1: producer.target}) as (c, fake), concurrent.futures.ThreadPoolExecutor(1) as pool:
        k = gkey(1, 0, "held")
        producer.do(op="send", key=k, n=2048, seed=3)
        gate = threading.Event()
        stream = fake.copy_stream(0, "peer")
        stream.hold(gate)
        try:
            recv = pool.submit(c.recv, k, timeout=30, device="gpu:0")
            fake.wait_until(lambda: stream.pending >= 4, what="the copy queued behind the held stream", timeout=30)
            producer.do(op="let_go")  # a copy held past the retry window: only the export holds the tensor
            st = producer.state()
            assert st["exports"] == 1 and st["device_bytes"] == 2048 * 4, st
        finally:
            gate.set()  # (a failed check must not leave the recv waiting)
        np.testing.assert_array_equal(recv.result(30).get(), values(2048, 3))
        st = released(producer, "the release after the copy, the memory free")
        assert not st["violations"] and not fake.violations


@pytest.mark.parametrize("batch", [False, True], ids=["recv", "recv_many"])
def test_a_recv_that_times_out_while_its_copy_waits_keeps_the_tensor_for_the_next_recv(producer, batch):
    """The deadline races the copy: the recv gives up while its copy waits for
    the producer's event; the copy still lands (and is released), the tensor is
    kept, the next recv of the key gets it on its GPU, and nothing answers a
    third time."""
    def recv(k: str, timeout: float) -> Any:
        return c.recv_many([k], timeout=timeout, device="gpu:0")[0] if batch else \
            c.recv(k, timeout=timeout, device="gpu:0")

    with rank(NODE, 0, {1: producer.target}) as (c, fake), concurrent.futures.ThreadPoolExecutor(1) as pool:
        k, warm = gkey(1, 0, "raced"), gkey(1, 0, "warm")
        producer.do(op="send", key=warm, n=4, seed=0)
        recv(warm, 30)  # connected: the deadline below is spent on the copy alone
        producer.do(op="send", key=k, n=512, seed=6, gated=True)
        try:
            first = pool.submit(recv, k, 3.0)
            fake.wait_until(lambda: any(type(s.blocked_on).__name__ == "_RemoteEvent" for s in fake._streams),
                            what="the copy waiting for the producer's event", timeout=30)
            with pytest.raises(DeadlineExceeded):
                first.result(30)
        finally:
            producer.do(op="open")
        producer.until(lambda s: s["exports"] == 0, "the copy done and released")
        wait_for(lambda: c.aio.kept, "the late tensor kept")
        got = recv(k, 30)
        assert type(got).__name__ == "FakeDeviceArray" and got.device == 0
        np.testing.assert_array_equal(got.get(), values(512, 6))
        nothing_more(c, k)
        assert c.stats()["gpu"]["ipc_recvs"] == 2 and not fake.violations  # each copied once, delivered once
        assert not c.aio.kept and not [e for e in c.pending() if e.key == k]


def test_a_consumer_that_dies_releases_what_it_was_lent(tmp_path):
    """This process produces; the consumer's copy is held, and the consumer is
    killed: its exports are dropped once it has exited, and the memory is free
    once the retry cache lets the answer go (after its window: 1 s here)."""
    consumer = Agent(NODE, 1)
    try:
        with rank(NODE, 0, {1: consumer.target}, retry_window=1.0) as (p, fake):
            consumer.do(op="cluster", targets=[p.target, consumer.target])
            k = gkey(0, 1, "lent")
            p.send(k, fake.array(values(512, 1)))
            consumer.call(op="recv", key=k, hold=True)
            plane = ipc_plane(p)
            wait_for(lambda: plane.exports, "the export to the consumer")
            wait_for(lambda: consumer.state()["peer_queued"] >= 4, "the consumer's copy queued, held")
            os.kill(consumer.pid, signal.SIGKILL)
            consumer.p.wait(20)
            wait_for(lambda: not plane.exports, "the dead consumer's exports dropped")
            gc.collect()
            wait_for(lambda: fake.device_bytes(0) == 0, "the memory freed")
            assert p.stats()["gpu"]["ipc_sends"] == 1
    finally:
        consumer.close()


def test_a_copy_that_cannot_be_made_puts_the_tensor_back_for_the_next_recv(producer, monkeypatch):
    """The first copy fails (its buffer cannot be allocated): the recv fails, the
    tensor goes back, and the next recv copies it by IPC."""
    def out_of_memory(*args: Any) -> Any:
        raise FakeCudaError("cudaErrorMemoryAllocation")

    with rank(NODE, 0, {1: producer.target}) as (c, fake):
        k = gkey(1, 0, "back")
        producer.do(op="send", key=k, n=64, seed=2)
        monkeypatch.setattr(fake, "allocate", out_of_memory)
        with pytest.raises(Unavailable, match="went back to its producer"):
            c.recv(k, timeout=30, device="gpu:0")
        monkeypatch.undo()
        np.testing.assert_array_equal(c.recv(k, timeout=30, device="gpu:0").get(), values(64, 2))
        nothing_more(c, k)
        assert c.stats()["ipc"]["transfers"] == 1
        st = producer.until(lambda s: s["exports"] == 0, "both exports settled")
        assert st["gpu"]["ipc_sends"] == 2 and not st["violations"]


def test_a_handle_that_cannot_be_opened_puts_the_tensor_back_and_ipc_is_not_offered_again(producer):
    with rank(NODE, 0, {1: producer.target}) as (c, fake):
        k, later = gkey(1, 0, "back"), gkey(1, 0, "later")
        fake.open_faults.append(FakeCudaError("cudaErrorMapBufferObjectFailed"))
        producer.do(op="send", key=k, n=64, seed=2)
        with pytest.raises(Unavailable, match="went back to its producer"):
            c.recv(k, timeout=30, device="gpu:0")
        np.testing.assert_array_equal(c.recv(k, timeout=30, device="gpu:0").get(), values(64, 2))
        producer.do(op="send", key=later, n=64, seed=8)
        np.testing.assert_array_equal(c.recv(later, timeout=30, device="gpu:0").get(), values(64, 8))
        nothing_more(c, k)
        assert c.stats()["ipc"]["transfers"] == 0 and fake.opened == 0
        st = producer.until(lambda s: s["exports"] == 0, "the failed export settled")
        assert st["gpu"]["ipc_sends"] == 1 and not st["violations"]


def test_gpus_of_another_node_take_another_path_and_the_fallback_is_counted(producer):
    with rank("node-b", 0, {1: producer.target}) as (c, fake):
        k = gkey(1, 0, "far")
        producer.do(op="send", key=k, n=128, seed=4)
        np.testing.assert_array_equal(c.recv(k, timeout=30, device="gpu:0").get(), values(128, 4))
        assert c.stats()["ipc"]["transfers"] == 0 and c.stats()["gpu"]["ipc_opens"] == 0
        st = producer.state()
        assert st["gpu"]["ipc_fallbacks"] == 1 and st["gpu"]["ipc_sends"] == 0 and st["exported"] == 0


# -- the plane on its own --------------------------------------------------------------


class _Recording(DataPlane):
    """A plane after IPC (MPI's place): records the offer its requests carry."""

    descriptor_url = "type.googleapis.com/test.Recording"
    path = rendezvous.paths.Path.MPI

    def __init__(self) -> None:
        self.seen: list[str] = []

    def offer(self, placement: Any) -> bytes:
        return any_pb2.Any(type_url="type.googleapis.com/test.Endpoint", value=b"me").SerializeToString()

    def plan(self, request: Any, item: Received) -> None:
        self.seen.append(request.transport_options.type_url)
        return None

    def receive(self, reply: bytes, head: Any, placement: Any) -> Any:
        raise AssertionError("not used")


def _planes(node: str = NODE) -> tuple[Planes, IpcPlane, _Recording]:
    fake = FakeIpcBackend(node)
    devices = Devices([fake])
    stats = Stats()
    inline = InlinePlane(chunk_bytes=1 << 20, buffers=rendezvous.buffers.RecvBuffers(), devices=devices,
                         staging=(4096, 2), stats=stats)
    recording = _Recording()
    planes = Planes([recording, inline])
    ipc = IpcPlane("/job:worker/replica:0/task:1", devices, stats)
    planes.register(ipc)
    return planes, ipc, recording


def _request(options: bytes | None) -> pb.RecvTensorRequest:
    req = pb.RecvTensorRequest(step_id=0, rendezvous_key=gkey(1, 0, "x"), request_id=7)
    if options:
        req.transport_options.ParseFromString(options)
    return req


def test_the_ipc_offer_carries_the_next_planes_offer_and_the_next_planes_see_it():
    planes, ipc, recording = _planes()
    gpu = planes.offer(Placement("GPU", 0))
    outer = any_pb2.Any.FromString(gpu)
    endpoint = pb.IpcEndpoint()
    assert outer.Unpack(endpoint) and endpoint.next.type_url == "type.googleapis.com/test.Endpoint"
    assert endpoint.pid == os.getpid() and endpoint.devices == [b"node-a/GPU-0", b"node-a/GPU-1"]
    # a host recv offers no IPC: the next plane's offer alone
    assert any_pb2.Any.FromString(planes.offer(CPU)).type_url == "type.googleapis.com/test.Endpoint"
    # a host tensor asked with the IPC offer: the planes after IPC see their own offer
    planes.plan(_request(gpu), Received(np.arange(4), False))
    assert recording.seen == ["type.googleapis.com/test.Endpoint"]
    # a plane registered later (MPI's, once MPI is up) goes after IPC's, whose offer wraps it
    later = _Recording()
    planes.register(later)
    assert planes.planes[:2] == (ipc, later)


def test_a_consumer_in_the_same_process_is_not_sent_a_handle_it_cannot_open():
    planes, ipc, recording = _planes()
    fake = ipc.devices.backends[0]
    tensor = fake.wrap(fake.array(np.arange(8, dtype=np.float32)))
    reply = planes.plan(_request(planes.offer(Placement("GPU", 0))), Received(tensor, False))
    assert reply.path != "ipc" and ipc.stats.gpu_snapshot()["ipc_fallbacks"] == 1 and fake.exported == 0
    assert isinstance(tensor, DeviceTensor)


def test_a_descriptor_that_lies_about_its_size_is_internal_and_a_stray_release_frees_nothing():
    planes, ipc, _ = _planes()
    transfer = pb.IpcTransfer(memory=b"m", offset=0, event=b"e", export_id=1, producer="/job:worker/replica:0/task:1",
                              nbytes=999)
    options = any_pb2.Any()
    options.Pack(transfer)
    raw = options.SerializeToString()
    meta = rendezvous.codec.tensors.encode_meta(rendezvous.codec.tensors.TensorMeta(np.dtype(np.float32), (4,)))
    buf = meta + raw
    head = ReplyHead(tensor=(0, len(meta)), transport_options=(len(meta), len(buf)))
    with pytest.raises(Internal, match="announces 999 bytes"):
        ipc.receive(buf, head, Placement("GPU", 0))
    ipc.exports[5] = "held"  # type: ignore[assignment]
    ipc.released([6, 7], failed=True)  # not ours: ignored, nothing put back
    assert list(ipc.exports) == [5]


class _HeldCopies(FakeIpcBackend):
    """The fake with IPC opened in this very process (a stand-in for the other
    one) and each copy a no-op queued on the peer stream, which a test holds."""

    def ipc_open(self, memory: bytes, device: int) -> Any:
        return memory

    def ipc_copy(self, opened: Any, offset: int, event: bytes, dst: Any, device: int, after: Any) -> Any:
        return self._launch(self.copy_stream(device, "peer"), lambda: None, [dst._block])


def _descriptor(export_id: int) -> tuple[bytes, ReplyHead]:
    transfer = pb.IpcTransfer(memory=b"m", offset=0, event=b"e", export_id=export_id,
                              producer="/job:worker/replica:0/task:1", nbytes=16)
    options = any_pb2.Any()
    options.Pack(transfer)
    meta = rendezvous.codec.tensors.encode_meta(rendezvous.codec.tensors.TensorMeta(np.dtype(np.float32), (4,)))
    buf = meta + options.SerializeToString()
    return buf, ReplyHead(tensor=(0, len(meta)), transport_options=(len(meta), len(buf)))


@pytest.mark.parametrize("cancelled", [False, True])
def test_the_release_waits_for_the_copy_even_when_the_receive_is_cancelled(cancelled):
    """The copy is held on its stream: nothing is released until it has run;
    then a completed receive releases as done, a cancelled one (its server
    stopping) as failed, so the producer puts the tensor back."""
    async def main():
        fake = _HeldCopies(NODE)
        plane = IpcPlane("/job:worker/replica:0/task:0", Devices([fake]), Stats())
        released: list = []
        plane.release = lambda *a: released.append(a)
        gate = threading.Event()
        fake.copy_stream(0, "peer").hold(gate)
        task = asyncio.ensure_future(plane.receive(*_descriptor(9), Placement("GPU", 0)).pending)
        try:
            await until(lambda: fake.copy_stream(0, "peer").pending >= 2, what="the copy queued")
            if cancelled:
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert released == []  # the copy has not run: nothing is released
        finally:
            gate.set()  # (a failed check must not leave the copy's waiter blocked)
        await until(lambda: released, what="the release")
        assert released == [("/job:worker/replica:0/task:1", [9], cancelled)]
        if not cancelled:
            assert (await task).shape == (4,)
    run(main(), 30)


def test_the_plane_joins_only_once_a_gpu_is_used_and_host_work_never_asks_the_backend():
    """A host-only program never touches its GPU library (cupy is not imported):
    the IPC plane joins at the first GPU tensor sent (or recv bound for a GPU)."""
    class Watched(FakeIpcBackend):
        asked = 0

        def available(self) -> bool:
            Watched.asked += 1
            return super().available()

    fake = Watched(NODE)
    with rendezvous.Server({"worker": ["127.0.0.1:0"]}, "worker", 0, devices=Devices([fake])) as s:
        k = "/job:worker/replica:0/task:0/cpu:0;0000000000000000;/job:worker/replica:0/task:0/cpu:0;h;0:0"
        s.send(k, np.arange(3))
        assert s.recv(k, timeout=10).tolist() == [0, 1, 2]
        assert Watched.asked == 0 and not [p for p in s.aio.planes.planes if isinstance(p, IpcPlane)]
        s.send(gkey(0, 0, "g"), fake.array(np.arange(4, dtype=np.float32)))
        assert ipc_plane(s).usable and Watched.asked > 0
        assert s.recv(gkey(0, 0, "g"), timeout=10).get().tolist() == [0, 1, 2, 3]
