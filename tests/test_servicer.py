"""The producer side (rendezvous/rpc/servicer.py), driven through a real grpc.aio
server on an OS-chosen loopback port by a raw-bytes client: requests are
written with rendezvous.codec, replies parsed frame by frame."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from google.protobuf import any_pb2

from rendezvous import errors
from rendezvous.codec import groups, wire
from rendezvous.codec.assembly import Assembly
from rendezvous.codec.parsing import StreamFrame, decode_inline, iter_stream_frames, parse_stream_frame
from rendezvous.codec.replies import descriptor_response, with_call_id
from rendezvous.codec.requests import batch_requests, cancel_request, recv_many_request, recv_request
from rendezvous.buffers import RecvBuffers
from rendezvous.devices import Devices
from rendezvous.errors import FailedPrecondition, InvalidArgument, Unavailable
from rendezvous.testing.fakegpu import FakeBackend
from rendezvous.keys import TaskName
from rendezvous.rpc.retry import RetryCache
from rendezvous.rpc.servicer import RecvTensorServicer
from rendezvous.stats import Stats
from rendezvous.table import WaitingTable
from rendezvous.items import Received
from rendezvous.codec.tensors import TensorMeta
from rendezvous.transport import Carry, DataPlane, Path, Planes, Reply
from rendezvous.transport.calls import ContextBase
from rendezvous.transport.inline import InlinePlane
from rendezvous.v1 import rendezvous_pb2 as pb

from conftest import key, run, until

pytestmark = pytest.mark.timeout(60)

STREAM = "/rendezvous.v1.Rendezvous/RecvTensorStream"
UNARY = "/rendezvous.v1.Rendezvous/RecvTensor"
TF_UNARY = "/tensorflow.WorkerService/RecvTensor"
DEAD = "dead"
ME = TaskName("worker", 0, 0)
#: seconds within which a stream must end after a protocol error (a working
#: server ends it in milliseconds, a loaded 2-core machine in well under this; the wait
#: only costs time when it is broken)
PROMPT = 5.0


def K(name: str) -> str:
    """A key this server (task 0) produces."""
    return key(0, 1, name)


class CommittedPlane(DataPlane):
    """A descriptor plane that takes every live tensor, as an MPI plane does: each
    reply announces a transfer of its own (numbered in its descriptor) that the
    stream starts as it hands the descriptor over (``started``), or releases
    if it drops the reply first (``released``). With ``groups``, a group's
    payload travels that way too."""

    path = Path.MPI
    descriptor_url = "type.googleapis.com/test.Committed"

    def __init__(self, groups: bool = False) -> None:
        self.planned: list[Received] = []
        self.started: list[int] = []
        self.released: list[int] = []
        self.groups = groups

    def _carry(self) -> Carry:
        number = len(self.planned) - 1  # the plan this transfer belongs to
        options = any_pb2.Any(type_url=self.descriptor_url, value=bytes([8, number])).SerializeToString()
        return Carry(options, lambda: self.started.append(number), lambda: self.released.append(number))

    def plan(self, request, item):
        self.planned.append(item)
        carry = self._carry()
        response = descriptor_response(TensorMeta(item.value.dtype, item.value.shape), carry.options)
        return Reply(Path.MPI, lambda call_id: iter((with_call_id(call_id, response),)),
                     lambda: response, item, carry=carry)

    def plan_group(self, request, arrays, layout):
        if not self.groups:
            return None
        self.planned.append(Received(list(arrays), False))
        return self._carry()

    def receive(self, reply, head, placement):
        raise AssertionError("the producer never receives")


@dataclass
class Harness:
    table: WaitingTable
    stats: Stats
    servicer: RecvTensorServicer
    channel: grpc.aio.Channel
    streams: list["RawStream"]

    def stream(self) -> "RawStream":
        s = RawStream(self.channel)
        self.streams.append(s)
        return s

    def unary(self, path: str = UNARY):
        return self.channel.unary_unary(path)


@contextlib.asynccontextmanager
async def serving(*, chunk_bytes: int = 1 << 20, descriptor: bool = False, groups: bool = False,
                  devices: Devices | None = None, fusion: tuple[int, int] = (4096, 1 << 20)) -> AsyncIterator[Harness]:
    table, stats = WaitingTable(), Stats()
    inline = InlinePlane(chunk_bytes=chunk_bytes, buffers=RecvBuffers(), devices=devices or Devices([]),
                         staging=(4096, 2), stats=stats)
    planes = Planes([CommittedPlane(groups), inline] if descriptor else [inline])
    servicer = RecvTensorServicer(table, ME, stats=stats, planes=planes, retry=RetryCache(30, 1 << 30),
                                  fusion=fusion)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(servicer.handlers())
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                        options=[("grpc.max_receive_message_length", -1)])
    h = Harness(table, stats, servicer, channel, [])
    try:
        yield h
    finally:
        for s in h.streams:
            await s.close()
        await channel.close()
        await server.stop(0)


class RawStream:
    """One RecvTensorStream call, raw bytes both ways. Keeps every message's
    frames (``messages``) and each call's outcome (``done``): an array, DEAD, a
    RendezvousError, or ("descriptor", head) for a descriptor reply."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = channel.stream_stream(STREAM)()
        self.messages: list[list[StreamFrame]] = []
        self.done: dict[int, object] = {}
        self.order: list[int] = []  # call ids in the order their replies completed
        self.groups: list[list[int]] = []  # the call ids of each group reply, in order
        self.options: dict[int, bytes] = {}  # each descriptor's transport_options, by call id
        self._assembling: dict[int, Assembly] = {}
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self._finishing: asyncio.Future | None = None

    async def send(self, *requests: bytes) -> None:
        await self.call.write(requests[0] if len(requests) == 1 else batch_requests(list(requests)))

    def _complete(self, call_id: int, outcome: object) -> None:
        assert call_id not in self.done, f"call {call_id} answered twice"
        self.done[call_id] = outcome
        self.order.append(call_id)

    async def read(self) -> list[StreamFrame] | None:
        """One message (its frames), or None at the end of the stream (``code`` set)."""
        try:
            buf = await self.call.read()
        except grpc.aio.AioRpcError as exc:
            self.code, self.details = exc.code(), exc.details() or ""
            return None
        if buf is grpc.aio.EOF:
            self.code, self.details = await self.call.code(), await self.call.details()
            return None
        got = list(iter_stream_frames(buf))
        self.messages.append(got)
        for frame in got:
            cid = frame.call_id
            if frame.group is not None:
                group = groups.parse_group(buf, *frame.group)
                self.groups.append(group.call_ids)
                if group.payload is None:
                    a, b = group.transport_options
                    for c in group.call_ids:
                        self._complete(c, ("group descriptor", group))
                        self.options[c] = bytes(buf[a:b])
                else:
                    for c, v in zip(group.call_ids, groups.views(group, buf, group.payload[0])):
                        self._complete(c, v)
            elif frame.error is not None:
                self._complete(cid, frame.error)
            elif frame.head is not None:
                head = frame.head
                if head.is_dead:
                    self._complete(cid, DEAD)
                elif head.transport_options is not None:
                    self._complete(cid, ("descriptor", head))
                    a, b = head.transport_options
                    self.options[cid] = bytes(buf[a:b])
                else:
                    value = decode_inline(buf, head.tensor)
                    if isinstance(value, Assembly):
                        self._assembling[cid] = value
                    else:
                        self._complete(cid, value)
            else:
                a, b = frame.chunk
                assembly = self._assembling[cid]
                if assembly.add(memoryview(buf)[a:b]):
                    del self._assembling[cid]
                    self._complete(cid, assembly.result())
        return got

    async def result(self, call_id: int) -> object:
        while call_id not in self.done:
            if await self.read() is None:
                raise AssertionError(f"stream ended ({self.code}: {self.details}) before call {call_id} "
                                     f"was answered")
        return self.done[call_id]

    async def value(self, call_id: int) -> np.ndarray:
        got = await self.result(call_id)
        assert isinstance(got, np.ndarray), f"call {call_id}: {got!r}"
        return got

    async def finish(self) -> grpc.StatusCode:
        """Read to the end of the stream; its status code."""
        while self.code is None:
            await self.read()
        return self.code

    async def finish_within(self, timeout: float) -> grpc.StatusCode | None:
        """The stream's status if it ends within ``timeout`` seconds, else None.
        The read goes on (cancelling a read would cancel the call); call again
        to keep waiting."""
        if self._finishing is None:
            self._finishing = asyncio.ensure_future(self.finish())
        done, _ = await asyncio.wait({self._finishing}, timeout=timeout)
        return self._finishing.result() if done else None

    async def close(self) -> None:
        if self._finishing is not None and not self._finishing.done():
            self._finishing.cancel()
            await asyncio.gather(self._finishing, return_exceptions=True)
        self.call.cancel()


def recv(call_id: int, k: str, step: int = 1, request_id: int = 0) -> bytes:
    return recv_request(call_id, step, k.encode(), request_id)


def recv_many(call_id: int, keys: list[str], step: int = 1, request_ids: list[int] | None = None) -> bytes:
    return recv_many_request(call_id, step, [k.encode() for k in keys],
                                    request_ids if request_ids is not None else [0] * len(keys))


def _waiters(table: WaitingTable) -> dict[str, int]:
    return {p.key: p.count for p in table.pending() if p.kind == "waiter"}


def _tensors(table: WaitingTable) -> dict[str, int]:
    return {p.key: p.count for p in table.pending() if p.kind == "tensor"}


# --- serving ---------------------------------------------------------------------

def test_tensor_produced_before_and_after_the_request():
    async def main():
        async with serving() as h:
            s = h.stream()
            before = np.arange(10, dtype=np.float32)
            h.table.send(1, K("before"), before)
            await s.send(recv(1, K("before")))
            np.testing.assert_array_equal(await s.value(1), before)

            await s.send(recv(2, K("after"), step=3))
            await until(lambda: _waiters(h.table) == {K("after"): 1}, what="the recv to wait")
            after = np.full((2, 2), 7, np.int64)
            h.table.send(3, K("after"), after)
            got = await s.value(2)
            assert got.dtype == np.int64 and got.tolist() == after.tolist()
            assert len(h.table) == 0
            assert h.stats.snapshot()["grpc"]["served"] == 2
            assert h.stats.snapshot()["grpc"]["served_bytes"] == before.nbytes + after.nbytes
    run(main(), 20)


def test_fifo_per_key_for_queued_tensors_and_for_waiters():
    async def main():
        async with serving() as h:
            s = h.stream()
            for i in range(3):
                h.table.send(1, K("q"), np.array([i]))
            await s.send(recv(1, K("q")), recv(2, K("q")), recv(3, K("q")))
            assert [int((await s.value(c))[0]) for c in (1, 2, 3)] == [0, 1, 2]
            # waiters first, tensors later: the oldest waiter gets the oldest tensor
            for c in (10, 11, 12):
                await s.send(recv(c, K("w")))
                await until(lambda c=c: _waiters(h.table).get(K("w")) == c - 9, what=f"call {c} to wait")
            for i in range(3):
                h.table.send(1, K("w"), np.array([100 + i]))
            assert [int((await s.value(c))[0]) for c in (10, 11, 12)] == [100, 101, 102]
    run(main(), 20)


def test_dead_tensor_is_answered_dead():
    async def main():
        async with serving() as h:
            s = h.stream()
            h.table.send(1, K("d"), None, is_dead=True)
            await s.send(recv(4, K("d")))
            assert await s.result(4) == DEAD
    run(main(), 20)


def test_cancel_before_the_tensor_exists_consumes_nothing():
    async def main():
        async with serving() as h:
            s = h.stream()
            await s.send(recv(1, K("c")))
            await until(lambda: _waiters(h.table) == {K("c"): 1}, what="the recv to wait")
            await s.send(cancel_request(1))
            await until(lambda: not _waiters(h.table), what="the waiter to be withdrawn")
            value = np.arange(5)
            h.table.send(1, K("c"), value)
            assert _tensors(h.table) == {K("c"): 1}  # still in the table
            # nothing to write once the cancel's CANCELLED answer is out
            await until(lambda: not h.servicer.busy(), what="the cancel's answer to be written")
            await s.send(recv(2, K("c")))
            np.testing.assert_array_equal(await s.value(2), value)
            # the cancelled call got no tensor: its cancel is answered with CANCELLED
            assert isinstance(s.done[1], errors.Cancelled)
            assert h.stats.snapshot()["grpc"]["served"] == 1
    run(main(), 20)


def test_cancel_of_a_reply_not_started_puts_the_tensor_back():
    async def main():
        async with serving() as h:
            s = h.stream()
            h.table.send(1, K("a"), np.array([1.0]))
            h.table.send(1, K("b"), np.array([2.0]))
            # one message: the reply for call 1 is planned, then cancelled before the
            # writer ever runs; call 2 is answered
            await s.send(recv(1, K("a"), request_id=41), cancel_request(1), recv(2, K("b")))
            assert (await s.value(2))[0] == 2.0
            # call 1 gets no tensor, only CANCELLED (nothing was sent)
            assert [f.call_id for m in s.messages for f in m if f.error is None] == [2]
            assert isinstance(s.done[1], errors.Cancelled)
            assert _tensors(h.table) == {K("a"): 1}
            # put back as if never asked: the same request_id takes it afresh
            await s.send(recv(3, K("a"), request_id=41))
            assert (await s.value(3))[0] == 1.0
            assert len(h.table) == 0
    run(main(), 20)


def test_a_descriptors_transfer_starts_as_it_is_handed_over_and_a_cancel_before_puts_it_back():
    """A descriptor's transfer (an MPI send) starts only when the stream hands the
    descriptor over: a cancel that comes first puts the tensor back and
    releases the transfer, so no send waits for a receive nobody will post.
    Once handed over, the reply is committed: a cancel then is not answered
    (the consumer receives the bytes and keeps them)."""
    async def main():
        async with serving(descriptor=True) as h:
            s = h.stream()
            plane = h.servicer.planes.planes[0]
            value = np.ones((4, 8), np.float32)
            h.table.send(1, K("m"), value)
            # one message: planned, then cancelled before the writer ever runs
            await s.send(recv(1, K("m"), request_id=31), cancel_request(1))
            assert isinstance(await s.result(1), errors.Cancelled)
            assert plane.started == [] and plane.released == [0]
            assert _tensors(h.table) == {K("m"): 1}  # back, as if never asked
            await s.send(recv(2, K("m"), request_id=31))
            kind, head = await s.result(2)
            assert kind == "descriptor" and head.tensor is not None
            assert len(plane.planned) == 2 and plane.planned[1].value is value and plane.started == [1]
            await s.send(cancel_request(2))  # handed over: committed, the cancel changes nothing
            assert len(h.table) == 0
            assert h.stats.snapshot()["mpi"]["served"] == 2
            # dead tensors still go inline
            h.table.send(1, K("dead"), None, is_dead=True)
            await s.send(recv(3, K("dead")))
            assert await s.result(3) == DEAD and len(plane.planned) == 2
    run(main(), 20)


def test_a_descriptor_never_handed_over_goes_back_when_its_stream_ends():
    """The stream ends while a descriptor waits behind a write that never
    returns: its tensor goes back to the table and its transfer is released,
    never started."""
    async def main():
        table, stats = WaitingTable(), Stats()
        inline = InlinePlane(chunk_bytes=1 << 20, buffers=RecvBuffers(), devices=Devices([]),
                             staging=(4096, 2), stats=stats)
        plane = CommittedPlane()
        servicer = RecvTensorServicer(table, ME, stats=stats, planes=Planes([plane, inline]),
                                      retry=RetryCache(30, 1 << 30))
        context = _HeldContext()  # the first write never returns
        incoming: asyncio.Queue[bytes] = asyncio.Queue()

        async def requests():
            while True:
                yield await incoming.get()

        table.send(1, K("first"), np.zeros(4))
        table.send(1, K("second"), np.ones(4))
        handler = asyncio.ensure_future(servicer.serve_stream(requests(), context))
        incoming.put_nowait(recv(1, K("first"), request_id=5))
        await asyncio.wait_for(context.holding.wait(), 10)
        incoming.put_nowait(recv(2, K("second"), request_id=6))
        await until(lambda: len(plane.planned) == 2, what="the second descriptor to be planned")
        handler.cancel()
        await asyncio.gather(handler, return_exceptions=True)
        assert plane.started == [0] and plane.released == [1]
        assert _tensors(table) == {K("second"): 1}
        servicer.retry.close()
    run(main(), 20)


async def _handed_over(h: Harness, request_id: int) -> tuple[CommittedPlane, "RawStream"]:
    """A tensor produced under ``K("d")`` and its descriptor handed over on a
    first stream for ``request_id``: the plane and that stream."""
    plane = h.servicer.planes.planes[0]
    h.table.send(1, K("d"), np.arange(6, dtype=np.float32))
    first = h.stream()
    await first.send(recv(1, K("d"), request_id=request_id))
    assert (await first.result(1))[0] == "descriptor"
    return plane, first


def test_a_retry_of_a_handed_over_descriptor_gets_that_descriptor_again():
    """A descriptor handed over into a connection that died: its consumer asks
    again with the request_id on a new stream, and gets the same descriptor
    (its transfer, started once, waits for that receive), not a second
    transfer of the tensor, again if that one is lost too."""
    async def main():
        async with serving(descriptor=True) as h:
            plane, first = await _handed_over(h, 21)
            retry = h.stream()
            await retry.send(recv(4, K("d"), request_id=21))
            assert (await retry.result(4))[0] == "descriptor"
            assert plane.started == [0] and len(plane.planned) == 1  # no second transfer
            assert retry.options[4] == first.options[1]
            third = h.stream()
            await third.send(recv(9, K("d"), request_id=21))
            assert (await third.result(9))[0] == "descriptor"
            assert third.options[9] == first.options[1] and plane.started == [0]
            assert len(h.table) == 0
    run(main(), 20)


def test_a_retry_of_one_call_of_a_handed_over_group_gets_the_group_for_it_alone():
    """A group whose payload travels as one transfer, handed over into a dead
    connection: the first retry of one of its calls gets the same group
    frame, answering only that call (the others' positions answer no call),
    so the consumer receives the transfer; a retry of another of its calls is
    answered afresh, with a transfer of its own. Each tensor is taken once."""
    async def main():
        async with serving(descriptor=True, groups=True) as h:
            plane = h.servicer.planes.planes[0]
            for i in range(3):
                h.table.send(1, K(f"g{i}"), np.full(4, i, np.float32))
            first = h.stream()
            await first.send(recv_many(1, [K("g0"), K("g1"), K("g2")], request_ids=[11, 12, 13]))
            await first.result(1)
            assert first.groups == [[1, 2, 3]] and plane.started == [0]
            retry = h.stream()
            await retry.send(recv(7, K("g1"), request_id=12))
            kind, group = await retry.result(7)
            assert kind == "group descriptor" and retry.options[7] == first.options[2]
            assert retry.groups == [[groups.NO_CALL, 7, groups.NO_CALL + 2]]
            assert plane.started == [0] and len(plane.planned) == 1  # the same transfer
            await retry.send(recv(8, K("g0"), request_id=11))
            kind, _ = await retry.result(8)
            assert kind == "descriptor" and plane.started == [0, 1]  # a transfer of its own
            assert len(h.table) == 0
    run(main(), 20)


def test_a_retry_cancelled_as_it_arrives_puts_the_answer_held_for_its_id_back():
    """A reply lost in a dead connection, its request_id asked again on a new
    stream and cancelled in the same message (the consumer's recv took
    another copy of the key meanwhile): the cancel is answered CANCELLED,
    nothing sent, so the consumer counts the id as settled. The answer held
    for the id must go back to the table then (it stayed in the retry cache,
    where no recv would ever ask for it again: the tensor was lost)."""
    async def main():
        async with serving() as h:
            h.table.send(1, K("lost"), np.array([7.0]))
            first = h.stream()
            await first.send(recv(1, K("lost"), request_id=31))
            await until(lambda: h.servicer.retry.has(31), what="the first reply to take the tensor")
            again = h.stream()
            await again.send(recv(2, K("lost"), request_id=31), cancel_request(2))
            assert isinstance(await again.result(2), errors.Cancelled)
            assert _tensors(h.table) == {K("lost"): 1}, "the answer held for the cancelled retry was lost"
            assert not h.servicer.retry.has(31)
            await again.send(recv(3, K("lost"), request_id=32))
            assert (await again.value(3))[0] == 7.0
            first.call.cancel()  # its reply was handed over whole: nothing more goes back
            await until(lambda: h.servicer.open_streams() == 1, what="the first stream to end")
            assert len(h.table) == 0
    run(main(), 20)


def test_a_retry_cancelled_as_it_arrives_still_gets_its_handed_over_descriptor():
    """As above with a descriptor handed over: its transfer was started and
    waits for this consumer's receive, so the cancelled retry is answered
    with that descriptor (the consumer keeps what arrives for a call it gave
    up), never CANCELLED: that would leave the transfer unmatched and the
    tensor lost."""
    async def main():
        async with serving(descriptor=True) as h:
            plane, first = await _handed_over(h, 51)
            again = h.stream()
            await again.send(recv(2, K("d"), request_id=51), cancel_request(2))
            assert (await again.result(2))[0] == "descriptor"
            assert again.options[2] == first.options[1] and plane.started == [0]
            assert len(h.table) == 0
    run(main(), 20)


def test_request_id_retry_gets_the_same_answer_and_consumes_one_tensor():
    async def main():
        async with serving() as h:
            h.table.send(1, K("r"), np.array([10]))
            h.table.send(1, K("r"), np.array([11]))
            s = h.stream()
            await s.send(recv(1, K("r"), request_id=77))
            first = await s.value(1)
            await s.send(recv(2, K("r"), request_id=77))  # a retry on the same stream
            again = await s.value(2)
            other = h.stream()  # and on a new stream, as after a broken one
            await other.send(recv(1, K("r"), request_id=77))
            third = await other.value(1)
            assert first[0] == again[0] == third[0] == 10
            assert _tensors(h.table) == {K("r"): 1}
            # a retry of a recv still waiting joins it: one tensor for both
            await s.send(recv(3, K("w"), request_id=88))
            await until(lambda: _waiters(h.table) == {K("w"): 1}, what="the recv to wait")
            await other.send(recv(2, K("w"), request_id=88))
            await until(lambda: len(h.servicer.retry) >= 2 and all(
                c.waiting for c in h.servicer._streams), what="the retry to arrive")
            h.table.send(1, K("w"), np.array([5]))
            h.table.send(1, K("w"), np.array([6]))
            assert (await s.value(3))[0] == 5 and (await other.value(2))[0] == 5
            assert _tensors(h.table) == {K("r"): 1, K("w"): 1}
    run(main(), 20)


def test_bad_key_fails_that_call_only():
    async def main():
        async with serving() as h:
            s = h.stream()
            h.table.send(1, K("good"), np.array([3]))
            await s.send(recv(1, "not a key"), recv(2, K("good")))
            err = await s.result(1)
            assert isinstance(err, InvalidArgument) and "not a key" in err.message
            assert (await s.value(2))[0] == 3
            # the stream goes on
            h.table.send(1, K("later"), np.array([4]))
            await s.send(recv(3, K("later")))
            assert (await s.value(3))[0] == 4
            assert h.stats.snapshot()["grpc"]["errors"] == 1
    run(main(), 20)


def test_key_of_another_task_is_failed_precondition():
    async def main():
        async with serving() as h:
            s = h.stream()
            theirs = key(1, 0, "x")  # produced by task 1
            await s.send(recv(1, theirs))
            err = await s.result(1)
            assert isinstance(err, FailedPrecondition) and str(ME) in err.message
            assert not _waiters(h.table)
            # over unary too
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.unary()(pb.RecvTensorRequest(step_id=1, rendezvous_key=theirs).SerializeToString())
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    run(main(), 20)


def test_draining_serves_produced_tensors_and_refuses_waits():
    async def main():
        async with serving() as h:
            s = h.stream()
            h.table.send(1, K("answered"), np.array([1]))
            await s.send(recv(1, K("answered"), request_id=5))
            assert (await s.value(1))[0] == 1
            h.table.send(1, K("ready"), np.array([2]))
            h.servicer.begin_drain()
            await s.send(recv(2, K("ready")), recv(3, K("never")), recv(4, K("answered"), request_id=5))
            assert (await s.value(2))[0] == 2
            err = await s.result(3)
            assert isinstance(err, Unavailable) and "draining" in err.message
            assert (await s.value(4))[0] == 1  # an answer already given is given again
            assert not _waiters(h.table) and len(h.table) == 0
            # unary alike
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.unary()(pb.RecvTensorRequest(step_id=1, rendezvous_key=K("never")).SerializeToString())
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    run(main(), 20)


# --- protocol errors --------------------------------------------------------------

@pytest.mark.parametrize("message", [b"\xff\xff\xff", recv_request(1, 1, b"k", 0)[:-3],
                                     pb.StreamRequest(call_id=3).SerializeToString()],
                         ids=["garbage", "truncated", "neither-recv-nor-cancel"])
def test_malformed_message_ends_the_stream_and_the_server_serves_on(message):
    async def main():
        async with serving() as h:
            s = h.stream()
            await s.send(message)
            assert await s.finish() == grpc.StatusCode.INVALID_ARGUMENT
            h.table.send(1, K("x"), np.array([9]))
            fresh = h.stream()
            await fresh.send(recv(1, K("x")))
            assert (await fresh.value(1))[0] == 9
            await until(lambda: h.servicer.open_streams() == 1, what="the broken stream to be gone")
    run(main(), 20)


def test_duplicate_call_id_while_its_reply_is_queued_is_invalid_argument():
    async def main():
        async with serving() as h:
            s = h.stream()
            h.table.send(1, K("x"), np.array([1]))
            h.table.send(1, K("x"), np.array([2]))
            await s.send(recv(7, K("x")), recv(7, K("x")))
            assert await s.finish() == grpc.StatusCode.INVALID_ARGUMENT
            assert "call_id 7" in s.details
            # the duplicate took nothing, and the first call's reply, not yet
            # written when the stream failed, went back too: nothing was delivered
            assert _tensors(h.table) == {K("x"): 2}
    run(main(), 20)


@pytest.mark.parametrize("bad", ["duplicate", "malformed"])
def test_protocol_error_ends_the_stream_promptly_while_a_call_waits(bad):
    """After a protocol error the writer once waited for every call still waiting, consuming their tensors into a stream being aborted."""
    async def main():
        async with serving() as h:
            s = h.stream()
            await s.send(recv(1, K("w")))
            await until(lambda: _waiters(h.table) == {K("w"): 1}, what="the recv to wait")
            await s.send(recv(1, K("w")) if bad == "duplicate" else b"\xff\xff\xff")
            code = await s.finish_within(PROMPT)
            # a stream that ended cancels its waiting recvs: a later tensor stays
            h.table.send(1, K("w"), np.array([1]))
            if code is None:
                await s.finish_within(PROMPT)  # (the broken server answers now; let it end)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert _tensors(h.table) == {K("w"): 1}
    run(main(), 20)


def test_call_id_reused_after_cancel_is_served():
    """A cancelled call's task once removed, as it unwound, the task of a new call that reused its id."""
    async def main():
        async with serving() as h:
            s = h.stream()
            await s.send(recv(1, K("a")))
            await until(lambda: _waiters(h.table) == {K("a"): 1}, what="the first recv to wait")
            await s.send(cancel_request(1), recv(1, K("b")))
            await until(lambda: _waiters(h.table) == {K("b"): 1}, what="the cancel and the new recv")
            assert h.servicer.busy(), "the new recv on call 1 is no longer tracked by its stream"
            await s.call.done_writing()
            h.table.send(1, K("b"), np.array([8]))
            assert (await s.value(1))[0] == 8
            assert await s.finish() == grpc.StatusCode.OK
    run(main(), 20)


def test_cancel_racing_the_tensor_without_request_id_puts_it_back():
    # The cancel is handled in the same loop turn as the tensor's arrival (before
    # the waiting recv resumes): nothing was sent, so the tensor must stay.
    async def main():
        async with serving() as h:
            s = h.stream()
            await s.send(recv(1, K("r")))
            await until(lambda: _waiters(h.table) == {K("r"): 1}, what="the recv to wait")
            (conn,) = h.servicer._streams
            h.table.send(1, K("r"), np.array([3]))
            conn._cancel(1)  # what reading a Cancel message does
            await until(lambda: not conn.waiting, what="the cancelled call to unwind")
            await until(lambda: len(h.table) == 1, what="the tensor to be put back")
            assert _tensors(h.table) == {K("r"): 1}
    run(main(), 20)


def test_cancel_racing_the_tensor_with_request_id_puts_it_back():
    """A cancel handled after the table handed the tensor to the retry cache's task,
    before the call resumed, once left the tensor only in the retry cache."""
    async def main():
        async with serving() as h:
            s = h.stream()
            await s.send(recv(1, K("r"), request_id=1234))
            await until(lambda: _waiters(h.table) == {K("r"): 1}, what="the recv to wait")
            (conn,) = h.servicer._streams
            h.table.send(1, K("r"), np.array([3]))
            conn._cancel(1)  # what reading a Cancel message does
            await until(lambda: not conn.waiting and not conn.replies, what="the cancelled call to unwind")
            await until(lambda: len(h.table) == 1, what="the tensor to be put back")
            assert _tensors(h.table) == {K("r"): 1}
            assert not h.servicer.retry.has(1234)  # a later request with that id takes anew
    run(main(), 20)


# --- unary ------------------------------------------------------------------------

@pytest.mark.parametrize("path", [UNARY, TF_UNARY])
def test_unary_and_tensorflow_alias_return_a_recv_tensor_response(path):
    async def main():
        async with serving() as h:
            value = np.arange(12, dtype=np.float32).reshape(3, 4)
            h.table.send(2, K("u"), value)
            raw = await h.unary(path)(pb.RecvTensorRequest(step_id=2, rendezvous_key=K("u")).SerializeToString())
            msg = pb.RecvTensorResponse.FromString(raw)
            assert not msg.is_dead and msg.send_start_micros > 0
            assert [d.size for d in msg.tensor.tensor_shape.dim] == [3, 4]
            assert msg.tensor.tensor_content == value.tobytes()
            # one that waits
            call = asyncio.ensure_future(h.unary(path)(
                pb.RecvTensorRequest(step_id=2, rendezvous_key=K("later")).SerializeToString()))
            await until(lambda: _waiters(h.table) == {K("later"): 1}, what="the unary recv to wait")
            h.table.send(2, K("later"), None, is_dead=True)
            assert pb.RecvTensorResponse.FromString(await call).is_dead
            assert h.stats.snapshot()["grpc"]["served"] == 2
    run(main(), 20)


def test_unary_is_inline_even_with_a_descriptor_plane_and_reports_errors():
    async def main():
        async with serving(descriptor=True) as h:
            value = np.ones(300, np.int16)
            h.table.send(1, K("u"), value)
            raw = await h.unary()(pb.RecvTensorRequest(step_id=1, rendezvous_key=K("u")).SerializeToString())
            assert pb.RecvTensorResponse.FromString(raw).tensor.tensor_content == value.tobytes()
            assert h.servicer.planes.planes[0].planned == []
            for request, code in [(b"\xff\xff", grpc.StatusCode.INVALID_ARGUMENT),
                                  (pb.RecvTensorRequest(rendezvous_key="bad").SerializeToString(),
                                   grpc.StatusCode.INVALID_ARGUMENT)]:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await h.unary()(request)
                assert info.value.code() == code
    run(main(), 20)


# --- the writer -------------------------------------------------------------------

def test_small_replies_ready_together_are_batched():
    async def main():
        async with serving() as h:
            s = h.stream()
            for i in range(3):
                h.table.send(1, K(f"s{i}"), np.array([i, i], np.int32))
            await s.send(*(recv(10 + i, K(f"s{i}")) for i in range(3)))
            got = await s.read()
            assert [f.call_id for f in got] == [10, 11, 12]  # one message, three frames
            assert [s.done[10 + i].tolist() for i in range(3)] == [[0, 0], [1, 1], [2, 2]]
    run(main(), 20)


def test_large_chunked_reply_does_not_block_a_small_one():
    async def main():
        chunk = 128 << 10  # larger than a "small" frame: each chunk goes alone
        async with serving(chunk_bytes=chunk) as h:
            s = h.stream()
            big = np.random.default_rng(1).integers(0, 255, 8 * chunk, dtype=np.uint8)
            small = np.array([42], np.int64)
            h.table.send(1, K("big"), big)
            h.table.send(1, K("small"), small)
            await s.send(recv(1, K("big")), recv(2, K("small")))
            np.testing.assert_array_equal(await s.value(1), big)
            assert (await s.value(2))[0] == 42
            calls = [[f.call_id for f in m] for m in s.messages]
            assert len(calls) == 9 and all(len(m) == 1 for m in calls)
            # round robin: the small reply goes right after the big one's first chunk
            assert calls[1] == [2], calls
            assert s.order == [2, 1]
    run(main(), 20)


def test_gpu_tensor_is_copied_to_the_host_and_served():
    async def main():
        fake = FakeBackend()
        async with serving(chunk_bytes=256, devices=Devices([fake])) as h:
            s = h.stream()
            host = np.arange(200, dtype=np.float32)
            h.table.send(1, K("g"), fake.wrap(fake.array(host)))
            await s.send(recv(1, K("g")))
            np.testing.assert_array_equal(await s.value(1), host)
            assert h.stats.gpu_snapshot()["to_host"] == 1
            assert h.stats.snapshot()["grpc"]["served_bytes"] == host.nbytes
    run(main(), 20)


def test_a_gpu_tensor_answered_is_held_for_retries_on_the_host_not_the_device():
    # The retry cache keeps each answer for its window, so a retried request_id
    # gets it again. A GPU tensor's answer held device memory all that time
    # (on a real GPU, 1,000 transfers of 256 KiB kept 250 MiB); now the host
    # copy its reply was made from is kept instead. Answers taken at once, one
    # that waited for its tensor, a batch's, and a unary call's.
    async def main():
        fake = FakeBackend()
        async with serving(chunk_bytes=256, devices=Devices([fake])) as h:
            def produce(name: str, value: int) -> None:
                h.table.send(1, K(name), fake.wrap(fake.array(np.full(100, value, np.float32))))

            s = h.stream()
            produce("now", 1)
            await s.send(recv(1, K("now"), request_id=21))
            await s.send(recv(2, K("later"), request_id=22))
            await until(lambda: _waiters(h.table) == {K("later"): 1}, what="the recv to wait")
            produce("later", 2)
            produce("b0", 3)
            produce("b1", 4)
            await s.send(recv_many(3, [K("b0"), K("b1")], request_ids=[23, 24]))
            produce("unary", 5)
            unary = await h.unary()(pb.RecvTensorRequest(step_id=1, rendezvous_key=K("unary"),
                                                         request_id=25).SerializeToString())
            got = [(await s.value(i))[0] for i in (1, 2, 3, 4)]
            tensor = pb.RecvTensorResponse.FromString(unary).tensor
            assert got == [1, 2, 3, 4] and tensor.tensor_content == np.full(100, 5, np.float32).tobytes()
            assert h.servicer.retry.held() == 5
            assert fake.device_bytes(0) == 0, "answers held for retries keep device memory"
            # a retry of each id, on a new stream, gets the same tensor again
            again = h.stream()
            for call_id, (name, rid) in enumerate([("now", 21), ("later", 22), ("b0", 23), ("b1", 24),
                                                   ("unary", 25)], 1):
                await again.send(recv(call_id, K(name), request_id=rid))
            assert [(await again.value(i))[0] for i in range(1, 6)] == [1, 2, 3, 4, 5]
            assert _tensors(h.table) == {}
    run(main(), 20)


def test_a_reply_cut_off_while_a_retry_of_its_id_carries_the_tensor_is_not_put_back():
    """A recv answered on a stream that died (the reply cut off mid-way) and
    re-sent with the same request_id on a new stream: the retry is answered from
    the retry cache with the same tensor, so the cut-off reply must not put it
    back in the table as well (the next recv of the key would get it a second
    time)."""
    async def main():
        async with serving(chunk_bytes=256 << 10) as h:
            value = np.arange(8 << 20, dtype=np.float32)  # 128 frames: more than flow control lets through
            h.table.send(1, K("twice"), value)
            first = h.stream()
            await first.send(recv(1, K("twice"), request_id=88))
            started = await first.read()
            assert started and started[0].head is not None  # the reply is under way, not finished
            retry = h.stream()
            await retry.send(recv(1, K("twice"), request_id=88))
            np.testing.assert_array_equal(await retry.value(1), value)
            first.call.cancel()  # the first stream's reply is cut off now
            await until(lambda: h.servicer.open_streams() == 1, what="the first stream to end")
            assert len(h.table) == 0, "the cut-off reply was put back while its retry carried the tensor"
    run(main(), 20)


class _HeldContext(ContextBase):
    """A stream's context whose writes are held until the test lets them go:
    what the handler has handed over is in ``written``."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.release = asyncio.Event()
        self.holding = asyncio.Event()

    async def write(self, message: bytes) -> None:
        self.written.append(message)
        self.holding.set()
        await self.release.wait()

    async def abort(self, error) -> None:
        raise AssertionError(f"aborted: {error!r}")


def test_a_reply_whose_last_frame_was_handed_over_is_not_put_back_when_the_stream_ends():
    """A consumer received its reply and closed its stream before the producer
    saw the write of that reply complete: the producer's handler is cancelled
    mid-write. The reply was handed to the transport whole, so its tensor is
    not put back in the table (it was: a ghost the next recv took a second
    time); a retry of its request_id, had the connection died with the
    reply, is answered from the retry cache."""
    async def main():
        table, stats = WaitingTable(), Stats()
        inline = InlinePlane(chunk_bytes=1 << 20, buffers=RecvBuffers(), devices=Devices([]),
                             staging=(4096, 2), stats=stats)
        servicer = RecvTensorServicer(table, ME, stats=stats, planes=Planes([inline]), retry=RetryCache(30, 1 << 30))
        table.send(1, K("done"), np.arange(4), False)
        context = _HeldContext()
        requests: asyncio.Queue = asyncio.Queue()
        requests.put_nowait(recv(1, K("done"), request_id=41))

        async def incoming():
            while True:
                yield await requests.get()

        handler = asyncio.ensure_future(servicer.serve_stream(incoming(), context))
        await asyncio.wait_for(context.holding.wait(), 10)  # the whole reply is being written
        handler.cancel()  # the consumer has gone: gRPC cancels the handler
        with pytest.raises(asyncio.CancelledError):
            await handler
        assert len(table) == 0, "the reply handed over whole went back to the table"
        # the same id asked again (its connection died with the reply): the same tensor, once
        again = _HeldContext()
        again.release.set()
        retry: asyncio.Queue = asyncio.Queue()
        retry.put_nowait(recv(1, K("done"), request_id=41))

        async def retried():
            yield await retry.get()

        await asyncio.wait_for(servicer.serve_stream(retried(), again), 10)
        [(call_id, value)] = [(f.call_id, decode_inline(m, f.head.tensor)) for m in again.written
                              for f in iter_stream_frames(m) if f.head is not None]
        assert call_id == 1 and value.tolist() == [0, 1, 2, 3]
        assert len(table) == 0
    run(main(), 20)


def test_a_reply_cut_off_by_the_streams_end_goes_back_to_the_table():
    """The consumer's stream broke (it died, or its connection did) after the
    first frames of a chunked reply: the tensor was lost. Now it goes back to the
    table, and its request_id is forgotten, so the recv re-sent on a new stream
    takes it exactly once."""
    async def main():
        async with serving(chunk_bytes=256 << 10) as h:
            # 128 frames: more than gRPC's flow-control window lets through unread
            value = np.arange(8 << 20, dtype=np.float32)
            h.table.send(1, K("cut"), value)
            s = h.stream()
            await s.send(recv(1, K("cut"), request_id=77))
            first = await s.read()
            assert first and first[0].head is not None  # the reply has started
            s.call.cancel()  # the consumer goes away mid-reply
            await until(lambda: len(h.table) == 1, what="the cut-off tensor to go back")
            assert _tensors(h.table) == {K("cut"): 1}
            again = h.stream()  # the consumer's re-sent recv, same request_id
            await again.send(recv(1, K("cut"), request_id=77))
            np.testing.assert_array_equal(await again.value(1), value)
            assert len(h.table) == 0
    run(main(), 20)


# --- batched requests (RecvMany) and group replies ----------------------------------

def test_a_batched_request_answers_the_small_ready_tensors_in_one_group():
    async def main():
        async with serving() as h:
            small = [np.arange(i + 1, dtype=np.float32) * i for i in range(3)]
            big = np.ones(2048, np.float32)  # 8 KiB: above the 4 KiB fusion threshold
            for i, v in enumerate(small):
                h.table.send(1, K(f"s{i}"), v)
            h.table.send(1, K("big"), big)
            h.table.send(1, K("dead"), None, is_dead=True)
            h.table.send(1, K("str"), np.array([b"ab", b"c"], dtype=object))
            s = h.stream()
            keys = [K("s0"), K("big"), K("s1"), K("later"), K("dead"), "not a key", K("str"), K("s2")]
            await s.send(recv_many(10, keys))
            for i in (0, 2, 7):
                np.testing.assert_array_equal(await s.value(10 + i), small[(0, 2, 7).index(i)])
            np.testing.assert_array_equal(await s.value(11), big)
            assert await s.result(14) == DEAD
            assert isinstance(await s.result(15), InvalidArgument)
            assert (await s.result(16)).tolist() == [b"ab", b"c"]
            assert s.groups == [[10, 12, 17]]  # the small ones, in key order, in one reply
            assert 13 not in s.done and _waiters(h.table) == {K("later"): 1}
            h.table.send(1, K("later"), np.array([5.0]))
            assert (await s.value(13)).tolist() == [5.0]
            assert len(h.table) == 0
            assert s.groups == [[10, 12, 17], [13]]  # produced later: a group of its own
            counts = h.stats.snapshot()["grpc"]
            assert counts["served_fused"] == 4 and counts["served"] == 7
    run(main(), 20)


def test_group_replies_are_split_at_the_group_size_and_fusion_can_be_turned_off():
    values = [np.full(1000, i, np.float32) for i in range(10)]  # 4,000 bytes each

    async def ten(fusion: tuple[int, int]) -> tuple[RawStream, Stats]:
        """The ten values produced, then asked for in one RecvMany; each checked."""
        async with serving(fusion=fusion) as h:
            for i, v in enumerate(values):
                h.table.send(1, K(f"t{i}"), v)
            s = h.stream()
            await s.send(recv_many(1, [K(f"t{i}") for i in range(10)]))
            for i, v in enumerate(values):
                np.testing.assert_array_equal(await s.value(1 + i), v)
            return s, h.stats

    async def main():
        s, _ = await ten((4096, 16 << 10))
        assert [len(g) for g in s.groups] == [4, 4, 2]  # at most 16 KiB of payload each
        s, stats = await ten((0, 1 << 20))
        assert s.groups == [] and stats.snapshot()["grpc"]["served_fused"] == 0
    run(main(), 20)


def test_a_cancel_of_a_call_a_group_answers_is_not_acknowledged_the_group_carries_it():
    async def main():
        async with serving() as h:
            h.table.send(1, K("a"), np.array([1.0]))
            h.table.send(1, K("b"), np.array([2.0]))
            s = h.stream()
            # one message: the group is planned, then call 2's cancel comes before any write
            await s.send(recv_many(1, [K("a"), K("b")]), cancel_request(2))
            assert (await s.value(2)).tolist() == [2.0]
            assert (await s.value(1)).tolist() == [1.0]
            assert s.groups == [[1, 2]] and len(h.table) == 0
    run(main(), 20)


def test_retries_of_a_batched_request_get_the_same_answers_and_consume_once():
    async def main():
        async with serving() as h:
            h.table.send(1, K("a"), np.array([1.0]))
            h.table.send(1, K("a"), np.array([2.0]))
            s = h.stream()
            await s.send(recv_many(1, [K("a")], request_ids=[71]))
            assert (await s.value(1)).tolist() == [1.0]
            again = h.stream()  # the stream broke: asked again with the same id
            await again.send(recv_many(5, [K("a"), K("a")], request_ids=[71, 72]))
            assert (await again.value(5)).tolist() == [1.0]
            assert (await again.value(6)).tolist() == [2.0]
            assert len(h.table) == 0
    run(main(), 20)


@pytest.mark.parametrize("bad", ["ids", "in use"])
def test_a_malformed_batched_request_ends_the_stream_with_invalid_argument(bad):
    async def main():
        async with serving() as h:
            s = h.stream()
            if bad == "ids":
                await s.send(recv_many_request(1, 1, [K("a").encode(), K("b").encode()], [3]))
            else:
                await s.send(recv(2, K("w")), recv_many(1, [K("x"), K("y")]))  # 2 is waiting already
            assert await s.finish_within(PROMPT) == grpc.StatusCode.INVALID_ARGUMENT
            assert "request_ids" in s.details or "already in use" in s.details
            # the server serves on
            h.table.send(1, K("ok"), np.array([1]))
            t = h.stream()
            await t.send(recv_many(1, [K("ok")]))
            assert (await t.value(1)).tolist() == [1]
    run(main(), 20)


def test_a_group_never_written_goes_back_to_the_table_when_the_stream_ends():
    """The consumer's stream ends while a group reply waits behind a write that
    never returns: every tensor of the group goes back, and the reply that was
    being handed over does not (its consumer may have it)."""
    async def main():
        table, stats = WaitingTable(), Stats()
        inline = InlinePlane(chunk_bytes=1 << 20, buffers=RecvBuffers(), devices=Devices([]),
                             staging=(4096, 2), stats=stats)
        servicer = RecvTensorServicer(table, ME, stats=stats, planes=Planes([inline]),
                                      retry=RetryCache(30, 1 << 30), fusion=(4096, 1 << 20))
        written: list[bytes] = []

        class Stuck(ContextBase):
            async def write(self, message: bytes) -> None:
                written.append(message)
                await asyncio.Event().wait()  # the consumer stopped reading

            async def abort(self, error):
                raise AssertionError(f"aborted: {error!r}")

        incoming: asyncio.Queue[bytes] = asyncio.Queue()

        async def requests():
            while True:
                yield await incoming.get()

        table.send(1, K("first"), np.array([0.0]))
        for i in range(3):
            table.send(1, K(f"g{i}"), np.array([float(i)]))
        serving_ = asyncio.ensure_future(servicer.serve_stream(requests(), Stuck()))
        incoming.put_nowait(recv(1, K("first"), request_id=5))
        await until(lambda: len(written) == 1, what="the first reply's write")
        incoming.put_nowait(recv_many(2, [K("g0"), K("g1"), K("g2")], request_ids=[6, 7, 8]))
        await until(lambda: len(table) == 0, what="the group's tensors to be taken")
        serving_.cancel()
        await asyncio.gather(serving_, return_exceptions=True)
        assert _tensors(table) == {K("g0"): 1, K("g1"): 1, K("g2"): 1}
    run(main(), 20)


def test_a_batchs_keys_produced_together_while_they_waited_answer_in_one_group():
    async def main():
        async with serving() as h:
            s = h.stream()
            keys = [K(f"w{i}") for i in range(4)]
            await s.send(recv_many(1, keys + [K("big")]))
            await until(lambda: len(_waiters(h.table)) == 5, what="the batch to wait")
            for i, k in enumerate(keys):  # produced in one turn of the loop, as send_many does
                h.table.send(1, k, np.full(3, i, np.int16))
            h.table.send(1, K("big"), np.ones(4096, np.float32))
            for i in range(4):
                assert (await s.value(1 + i)).tolist() == [i] * 3
            assert (await s.value(5)).shape == (4096,)
            assert s.groups == [[1, 2, 3, 4]]  # the big one on its own
            assert len(h.table) == 0
    run(main(), 20)


def _stream_harness(table: WaitingTable):
    """A servicer on ``table`` serving one stream whose requests a test puts in a
    queue and whose writes it records (each with the tensors then in the table)."""
    stats = Stats()
    inline = InlinePlane(chunk_bytes=1 << 20, buffers=RecvBuffers(), devices=Devices([]),
                         staging=(4096, 2), stats=stats)
    servicer = RecvTensorServicer(table, ME, stats=stats, planes=Planes([inline]),
                                  retry=RetryCache(30, 1 << 30), fusion=(4096, 1 << 20))
    incoming: asyncio.Queue[bytes] = asyncio.Queue()

    async def requests():
        while True:
            yield await incoming.get()
    return servicer, incoming, requests


def test_a_batchs_large_replies_are_written_while_the_rest_is_planned():
    """The writer gets a turn within a long batch: the first large tensors' replies
    leave (their consumer can post its receives) before the last ones are made.
    The batch's tensors were all taken at once, before any reply."""
    async def main():
        table = WaitingTable()
        servicer, incoming, requests = _stream_harness(table)
        written: list[tuple[bytes, int, int]] = []

        def served() -> int:
            return sum(c["served"] for c in servicer.stats.snapshot().values())

        class Recording(ContextBase):
            async def write(self, message: bytes) -> None:
                written.append((message, len(table), served()))

            async def abort(self, error):
                raise AssertionError(f"aborted: {error!r}")

        keys = [K(f"big{i}") for i in range(16)] + [K(f"s{i}") for i in range(8)]
        for k in keys:
            table.send(1, k, np.ones(2048 if "big" in k else 4, np.float32))  # 8 KiB: above the fusion threshold
        serving_ = asyncio.ensure_future(servicer.serve_stream(requests(), Recording()))
        incoming.put_nowait(recv_many(1, keys))
        await until(lambda: len(table) == 0 and written and written[-1][2] == len(keys),
                    what="the batch to be answered")
        assert written[0][1] == 0, "the batch's tensors were not all taken before its first reply"
        assert written[0][2] < 16, "every reply was made before the first was written"
        serving_.cancel()
        await asyncio.gather(serving_, return_exceptions=True)
    run(main(), 20)


def test_small_tensors_taken_when_the_stream_ends_mid_batch_go_back(monkeypatch):
    """The stream ends while the reader lets the writer run in the middle of a
    batch: the tensors already taken and not answered (the small ones whose
    group is not made yet, the keys not reached) go back to the table, in
    their order; the replies handed to the stream are kept for their
    request_ids (asked again, they are answered the same)."""
    from rendezvous.rpc import producer_stream

    async def main():
        table = WaitingTable()
        servicer, incoming, requests = _stream_harness(table)
        held, release = asyncio.Event(), asyncio.Event()

        async def gated_turn() -> None:
            held.set()
            await release.wait()
        monkeypatch.setattr(producer_stream, "_writer_turn", gated_turn)

        class Stuck(ContextBase):
            async def write(self, message: bytes) -> None:
                await asyncio.Event().wait()  # the consumer reads nothing

            async def abort(self, error):
                raise AssertionError(f"aborted: {error!r}")

        keys = [K("s"), K("s")] + [K(f"big{i}") for i in range(6)] + [K("later")]
        table.send(1, K("s"), np.array([1.0], np.float32))
        table.send(1, K("s"), np.array([2.0], np.float32))
        for i in range(6):
            table.send(1, K(f"big{i}"), np.ones(2048, np.float32))
        table.send(1, K("later"), np.array([3.0], np.float32))
        serving_ = asyncio.ensure_future(servicer.serve_stream(requests(), Stuck()))
        incoming.put_nowait(recv_many(1, keys, request_ids=list(range(10, 19))))
        await held.wait()  # all taken; eight keys reached: two small ones in the group, six replies queued
        assert _tensors(table) == {}
        serving_.cancel()
        await asyncio.gather(serving_, return_exceptions=True)
        assert _tensors(table) == {K("s"): 2, K("later"): 1}
        release.set()
        written: list[bytes] = []

        class Recording(ContextBase):
            async def write(self, message: bytes) -> None:
                written.append(message)

            async def abort(self, error):
                raise AssertionError(f"aborted: {error!r}")

        again: asyncio.Queue[bytes] = asyncio.Queue()

        async def requests_again():
            while True:
                yield await again.get()
        serving_ = asyncio.ensure_future(servicer.serve_stream(requests_again(), Recording()))
        # the consumer asks again with the same request_ids: the same answers, nothing taken twice
        again.put_nowait(recv_many(1, keys, request_ids=list(range(10, 19))))
        await until(lambda: len(table) == 0 and written, what="the batch asked again to be answered")
        values: dict[int, object] = {}
        for m in written:
            for f in iter_stream_frames(m):
                if f.group is not None:
                    g = groups.parse_group(m, *f.group)
                    values.update(zip(g.call_ids, (v.tolist() for v in groups.views(g, m, g.payload[0]))))
                elif f.head is not None:
                    values[f.call_id] = "large"
        # the small ones in their order, "later", and the six large ones: each answered once
        assert values == {1: [1.0], 2: [2.0], 9: [3.0], **{c: "large" for c in range(3, 9)}}
        serving_.cancel()
        await asyncio.gather(serving_, return_exceptions=True)
    run(main(), 20)


def _fusing_servicer() -> tuple[WaitingTable, RecvTensorServicer]:
    """A table and its servicer answering over the inline plane, packing tensors
    up to 64 KiB in group replies of up to 1 MiB."""
    table, stats = WaitingTable(), Stats()
    inline = InlinePlane(chunk_bytes=1 << 20, buffers=RecvBuffers(), devices=Devices([]),
                         staging=(4096, 2), stats=stats)
    return table, RecvTensorServicer(table, ME, stats=stats, planes=Planes([inline]),
                                     retry=RetryCache(30, 1 << 30), fusion=(64 << 10, 1 << 20))


class _Collecting(ContextBase):
    """A stream's context that keeps every message written; ``gathers`` as the
    MPI request path's context declares it (it joins a message's pieces itself)."""

    def __init__(self, gathers: bool) -> None:
        if gathers:
            self.gathers = True
        self.written: list = []

    async def write(self, message) -> None:
        self.written.append(message)

    async def abort(self, error) -> None:
        raise AssertionError(f"aborted: {error!r}")


@pytest.mark.parametrize("gathers", [False, True], ids=["grpc-context", "gathering-context"])
def test_large_frames_reach_a_gathering_context_in_pieces_and_any_other_as_bytes(gathers):
    """A reply of 256 KiB and a group of small tensors with 96 KiB of payload:
    a context that joins pieces itself (the MPI request path, which puts its
    envelope in front) gets them as ``wire.Pieces``, with the tensors' own
    memory inside; a gRPC context always gets bytes. Either way the frames
    carry the tensors whole."""
    async def main():
        table, servicer = _fusing_servicer()
        big = np.arange(64 << 10, dtype=np.float32)
        smalls = [np.full(8 << 10, i, np.float32) for i in range(3)]
        table.send(1, K("big"), big)
        for i, v in enumerate(smalls):
            table.send(1, K(f"s{i}"), v)
        context = _Collecting(gathers)

        async def incoming():
            yield recv(1, K("big"))
            yield recv_many(2, [K(f"s{i}") for i in range(3)])

        await asyncio.wait_for(servicer.serve_stream(incoming(), context), 10)
        assert len(table) == 0 and len(context.written) == 2
        kinds = {type(m) for m in context.written}
        assert kinds == ({wire.Pieces} if gathers else {bytes})
        if gathers:
            shared = [p for m in context.written for p in m.parts if isinstance(p, memoryview)]
            assert any(np.shares_memory(np.frombuffer(p, np.uint8), big) for p in shared)
        single, group = [m if type(m) is bytes else m.join() for m in context.written]
        head = parse_stream_frame(single).head
        np.testing.assert_array_equal(decode_inline(single, head.tensor), big)
        parsed = groups.parse_group(group, *parse_stream_frame(group).group)
        assert parsed.call_ids == [2, 3, 4]
        for want, have in zip(smalls, groups.views(parsed, group, parsed.payload[0])):
            np.testing.assert_array_equal(have, want)
    run(main(), 20)


class _NonWaiting(_Collecting):
    """The MPI request path's context: it also takes a message without waiting
    (kept apart in ``at_once``), and ends a stream with a status it keeps."""

    def __init__(self, requests) -> None:
        super().__init__(gathers=True)
        self.at_once: list = []
        self.aborted: Exception | None = None
        self.deliver_to = requests.deliver_to  # requests offered as they arrive, as the MPI path's context

    def has_room(self) -> bool:
        return True

    def write_nowait(self, message) -> None:
        self.at_once.append(message)

    async def abort(self, error) -> None:
        self.aborted = error


def _answers(messages: list) -> list[tuple[int, list]]:
    """(call_id, value) of each reply frame in ``messages``."""
    out = []
    for m in messages:
        buf = m if type(m) is bytes else m.join()
        for frame in iter_stream_frames(buf):
            out.append((frame.call_id, decode_inline(buf, frame.head.tensor).tolist()))
    return out


def test_a_lone_request_is_answered_as_it_arrives_and_a_batch_is_left_to_the_reader():
    """On the MPI request path a request offered as it arrives is handled right
    there, and its reply handed to MPI in the same call, with no turn of the
    reader or the writer; what the reader must take (a batch, a request for a
    tensor not produced yet once its reply is made, a malformed message) still
    goes its way, in order."""
    from rendezvous.mpi.control import _Requests

    async def main():
        table, servicer = _fusing_servicer()
        requests = _Requests()
        context = _NonWaiting(requests)
        serving = asyncio.ensure_future(servicer.serve_stream(requests, context))
        await until(lambda: requests._take is not None, what="the stream handler reading")
        table.send(1, K("a"), np.array([1.0]))
        table.send(1, K("e"), np.array([5.0]))
        # two requests arrive in one turn (as MpiRequests hands a turn's arrivals
        # over): each is taken as it arrives, and their replies leave together
        assert requests.offer(recv(1, K("a"))) and requests.offer(recv(5, K("e")))
        assert not context.at_once and not context.written
        requests.taken()
        assert len(context.at_once) == 1  # in this very call, one message
        assert sorted(_answers(context.at_once)) == [(1, [1.0]), (5, [5.0])]
        assert requests.offer(recv(2, K("b")))  # not produced yet: it waits
        requests.taken()
        assert len(context.at_once) == 1 and not requests.queue.qsize()
        table.send(1, K("b"), np.array([2.0]))  # answered by the writer
        await until(lambda: _answers(context.written) == [(2, [2.0])], what="the late reply")
        table.send(1, K("c"), np.array([3.0]))
        table.send(1, K("d"), np.array([4.0]))
        assert not requests.offer(recv_many(3, [K("c"), K("d")]))  # a batch: the reader's
        assert requests.queue.qsize() == 1 and len(context.at_once) == 1
        await until(lambda: len(table) == 0, what="the batch taken")
        assert not requests.offer(b"\xff\xff garbage")  # the reader ends the stream with INVALID_ARGUMENT
        await asyncio.wait_for(serving, 10)
        assert isinstance(context.aborted, InvalidArgument), context.aborted
    run(main(), 20)


# --- batch keys waiting without a task ----------------------------------------------

def test_a_waiting_batch_key_takes_no_task_and_is_answered_inside_the_send():
    """A batch's keys not produced yet wait in the table with no task, future or
    coroutine of their own; the send that produces one answers its call within
    its own call, and the small tensors produced in one turn go out as one
    group reply."""
    async def main():
        async with serving() as h:
            s = h.stream()
            keys = [K(f"n{i}") for i in range(50)]
            tasks = len(asyncio.all_tasks())
            await s.send(recv_many(1, keys, request_ids=list(range(500, 550))))
            await until(lambda: len(_waiters(h.table)) == 50, what="the batch to wait")
            assert len(asyncio.all_tasks()) <= tasks + 8  # the call's own few (gRPC, reader, writer), not 50
            (conn,) = h.servicer._streams
            assert len(conn.waiting) == 50 and h.servicer.waiting_calls() == 50
            for i, k in enumerate(keys):  # one turn, as send_many does
                h.table.send(1, k, np.full(2, i, np.int32))
                assert len(conn.waiting) == 49 - i  # answered inside the send
            assert len(conn._late) == 50 and h.servicer.retry.held() == 50
            for i in range(50):
                assert (await s.value(1 + i)).tolist() == [i, i]
            assert s.groups == [list(range(1, 51))]
            assert len(h.table) == 0
    run(main(), 20)


def test_a_retry_of_a_waiting_batch_key_joins_it_and_one_tensor_answers_both():
    """The consumer's stream broke while its batch waited and it asks again with
    the same request_id on a new stream: the retry joins the waiting key (one
    tensor is taken, both calls get it). If the first call is cancelled, the
    waiter stays for the retry; once nobody waits, a cancel consumes nothing."""
    async def main():
        async with serving() as h:
            first, again = h.stream(), h.stream()
            await first.send(recv_many(1, [K("j"), K("k")], request_ids=[901, 902]))
            await until(lambda: len(_waiters(h.table)) == 2, what="the batch to wait")
            await again.send(recv(7, K("j"), request_id=901), recv(8, K("k"), request_id=902))
            await until(lambda: h.servicer.waiting_calls() == 4, what="the retries to join")
            assert len(_waiters(h.table)) == 2  # joined, not queued again
            conns = h.servicer._streams
            old = next(c for c in conns if 1 in c.waiting)
            old._cancel(2)  # the first call of "k" gives up; its retry still waits
            h.table.send(1, K("j"), np.array([5]))
            h.table.send(1, K("k"), np.array([6]))
            assert (await first.value(1)).tolist() == [5]
            assert (await again.value(7)).tolist() == [5]
            assert (await again.value(8)).tolist() == [6]
            assert isinstance(await first.result(2), errors.Cancelled)
            assert len(h.table) == 0
            # nobody else waiting: a cancel withdraws the key and nothing is consumed
            await first.send(recv_many(20, [K("m")], request_ids=[903]))
            await until(lambda: _waiters(h.table) == {K("m"): 1}, what="the key to wait")
            old._cancel(20)
            assert isinstance(await first.result(20), errors.Cancelled)
            assert _waiters(h.table) == {} and not h.servicer.retry.known(903)
            h.table.send(1, K("m"), np.array([7]))
            assert _tensors(h.table) == {K("m"): 1}
    run(main(), 20)


def test_a_waiting_batch_key_whose_step_ends_is_answered_with_the_steps_error():
    async def main():
        async with serving() as h:
            s = h.stream()
            await s.send(recv_many(1, [K("x"), K("y")], step=3, request_ids=[41, 42]))
            await until(lambda: len(_waiters(h.table)) == 2, what="the batch to wait")
            h.table.abort(3, errors.Aborted("stop now"))
            for call_id in (1, 2):
                got = await s.result(call_id)
                assert isinstance(got, errors.Aborted) and "stop now" in got.message
            assert h.servicer.waiting_calls() == 0
            # a retry of the id gets the same error, and consumes nothing
            again = h.stream()
            await again.send(recv(9, K("x"), step=3, request_id=41))
            assert isinstance(await again.result(9), errors.Aborted)
    run(main(), 20)


def test_a_waiting_batch_key_goes_away_with_its_stream():
    """A stream that ends withdraws its waiting keys: a tensor produced later stays
    in the table for the next recv."""
    async def main():
        async with serving() as h:
            s = h.stream()
            await s.send(recv_many(1, [K("gone")], request_ids=[77]))
            await until(lambda: _waiters(h.table) == {K("gone"): 1}, what="the key to wait")
            await s.close()
            await until(lambda: not h.servicer._streams and not _waiters(h.table), what="the stream to end")
            h.table.send(1, K("gone"), np.array([1]))
            assert _tensors(h.table) == {K("gone"): 1} and not h.servicer.retry.known(77)
    run(main(), 20)
