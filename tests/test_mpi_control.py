"""Requests over MPI (rendezvous/mpi/control.py) on their own: two ranks'
``MpiRequests`` joined by a scripted engine that carries each envelope from
one to the other (no MPI), and a scripted stream handler on the producer."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from rendezvous.mpi import control
from rendezvous.mpi.control import REPLY_TAG, REQUEST_TAG, MpiRequests
from rendezvous.errors import Cancelled, InvalidArgument
from rendezvous.paths import Path
from rendezvous.transport.calls import EOF, CallEnded

from conftest import run, until

pytestmark = pytest.mark.timeout(30)


class Wire:
    """Two ranks' engines: what one rank isends on a tag reaches the other
    rank's listener for that tag, in order, one loop turn later."""

    def __init__(self) -> None:
        self.engines = {0: Engine(self, 0), 1: Engine(self, 1)}
        self.sent: list[tuple[int, int, int, bytes]] = []  # (from, to, tag, message)
        self.hold = False  # keep sends unfinished (what MPI does while a peer does not receive)
        self.unfinished: list[asyncio.Future] = []

    def carry(self, source: int, dest: int, tag: int, message: bytes) -> asyncio.Future:
        self.sent.append((source, dest, tag, bytes(message)))
        loop = asyncio.get_running_loop()
        deliver, alloc = self.engines[dest].listeners[tag]
        buf = alloc(len(message))  # received into what the listener asked for, as the engine does
        memoryview(buf).cast("B")[:] = message
        loop.call_soon(deliver, [(source, buf)])
        done = loop.create_future()
        if self.hold:
            self.unfinished.append(done)
        else:
            done.set_result(None)
        return done


class Engine:
    """What MpiRequests uses of the progress engine."""

    def __init__(self, wire: Wire, rank: int) -> None:
        self.wire = wire
        self.rank = rank
        self.listeners: dict[int, object] = {}
        self.expecting: list = []

    def listen(self, comm, tag, deliver, alloc=bytearray) -> None:
        self.listeners[tag] = (deliver, alloc)

    def expect_while(self, waiting) -> None:
        self.expecting.append(waiting)

    def isend(self, buf, dest, tag, chunk, comm=None) -> asyncio.Future:
        return self.wire.carry(self.rank, dest, tag, buf)


class Handler:
    """A scripted producer: the streams it is given, each with its requests and context."""

    def __init__(self) -> None:
        self.streams: asyncio.Queue = asyncio.Queue()

    async def serve_stream(self, requests, context) -> None:
        stream = Stream(requests, context, context.inline_path)
        self.streams.put_nowait(stream)
        await stream.finished


class Stream:
    def __init__(self, requests, context, inline_path: Path) -> None:
        self.context = context
        self.inline_path = inline_path
        self.received: asyncio.Queue = asyncio.Queue()
        self.ended = asyncio.Event()  # the consumer's requests ended
        self.finished = asyncio.get_running_loop().create_future()
        asyncio.ensure_future(self._read(requests))

    async def _read(self, requests) -> None:
        async for message in requests:
            self.received.put_nowait(message)
        self.ended.set()


def pair(buffers=None) -> tuple[Wire, MpiRequests, MpiRequests, Handler]:
    """Rank 0 the consumer (its replies received into ``buffers``), rank 1 the
    producer (each could be both)."""
    wire = Wire()
    handler = Handler()
    consumer = MpiRequests(wire.engines[0], comm=None, rank=0, servicer=Handler(), buffers=buffers)
    producer = MpiRequests(wire.engines[1], comm=None, rank=1, servicer=handler)
    consumer.start()
    producer.start()
    return wire, consumer, producer, handler


async def opened(consumer: MpiRequests, handler: Handler, first: bytes = b"r"):
    """A stream from the consumer to rank 1, opened by writing ``first``: its
    call, and the producer's side of it (given to the handler)."""
    call = consumer.open_call(1)
    await call.write(first)
    return call, await asyncio.wait_for(handler.streams.get(), 5)


def test_a_stream_carries_requests_and_replies_and_ends_with_its_status():
    async def main():
        wire, consumer, producer, handler = pair()
        call, stream = await opened(consumer, handler, b"request one")
        # replies inside these frames travel by MPI: the handler is told so (stats count them there)
        assert stream.inline_path is Path.MPI
        assert await asyncio.wait_for(stream.received.get(), 5) == b"request one"
        await stream.context.write(b"reply one")
        await stream.context.write(b"reply two")
        assert await asyncio.wait_for(call.read(), 5) == b"reply one"
        assert await asyncio.wait_for(call.read(), 5) == b"reply two"
        stream.finished.set_result(None)  # the handler returns: a clean end
        assert await asyncio.wait_for(call.read(), 5) is EOF
        assert all(tag in (REQUEST_TAG, REPLY_TAG) for _, _, tag, _ in wire.sent)
        assert not producer._serving and not consumer._calls
    run(main())


def test_large_replies_land_in_reused_buffers_and_small_ones_in_their_own():
    """A reply message of at least the cache's smallest size is received into a
    buffer of the rank's RecvBuffers: what the consumer reads is a view on it,
    the buffer stays in use while anything refers to it, and once that is
    dropped the next large reply reuses it (no fresh pages per step). A small
    one gets a bytearray of its own. The requests' listener keeps bytearrays."""
    from rendezvous.buffers import RecvBuffers

    async def main():
        buffers = RecvBuffers(min_bytes=4096)
        _, consumer, _, handler = pair(buffers)
        call, stream = await opened(consumer, handler, b"go")
        assert bytes(await asyncio.wait_for(stream.received.get(), 5)) == b"go"
        first = bytes(range(256)) * 64  # 16 KiB
        await stream.context.write(first)
        got = await asyncio.wait_for(call.read(), 5)
        assert bytes(got) == first and isinstance(got.obj, np.ndarray) and buffers.reused == 0
        await stream.context.write(b"\x07" * 16384)
        held = await asyncio.wait_for(call.read(), 5)
        assert bytes(held) == b"\x07" * 16384 and buffers.reused == 0  # the first is still referred to
        del got
        await stream.context.write(b"\x09" * 16384)
        again = await asyncio.wait_for(call.read(), 5)
        assert bytes(again) == b"\x09" * 16384 and buffers.reused == 1  # the first one's buffer
        assert bytes(held) == b"\x07" * 16384  # one still held is never written
        await stream.context.write(b"small")
        small = await asyncio.wait_for(call.read(), 5)
        assert bytes(small) == b"small" and type(small.obj) is bytearray
        stream.finished.set_result(None)
        assert await asyncio.wait_for(call.read(), 5) is EOF
    run(main())


def test_an_abort_ends_the_consumers_reads_with_its_code():
    async def main():
        _, consumer, _, handler = pair()
        call, stream = await opened(consumer, handler, b"bad")
        with pytest.raises(control._Aborted):
            await stream.context.abort(InvalidArgument("call_id 3 is already in use"))
        with pytest.raises(CallEnded) as info:
            await asyncio.wait_for(call.read(), 5)
        assert isinstance(info.value.error, InvalidArgument)
        assert "already in use" in info.value.error.message
        with pytest.raises(CallEnded):  # a call that ended takes no more writes
            await call.write(b"more")
    run(main())


def test_a_consumer_that_closes_its_stream_ends_the_producers_requests():
    async def main():
        wire, consumer, producer, handler = pair()
        call, stream = await opened(consumer, handler)
        call.cancel()
        call.cancel()  # twice is fine
        with pytest.raises(CallEnded) as info:
            await asyncio.wait_for(call.read(), 5)
        assert isinstance(info.value.error, Cancelled)
        await asyncio.wait_for(stream.ended.wait(), 5)  # its requests iterator ended
        # and its handler is cancelled, as a gRPC call's is when its consumer cancels
        # (the recvs it had waiting are withdrawn: what they would take stays in the table)
        await until(lambda: stream.finished.cancelled(), what="the producer's handler to be cancelled")
        # frames the producer still writes for a closed stream go nowhere
        await stream.context.write(b"late")
        await until(lambda: not producer._serving, what="the producer's side to end")
        assert not consumer._calls
    run(main())


def test_streams_to_one_rank_are_kept_apart():
    async def main():
        _, consumer, producer, handler = pair()
        a, b = consumer.open_call(1), consumer.open_call(1)
        assert a.stream_id != b.stream_id
        await a.write(b"to a")
        await b.write(b"to b")
        first = await asyncio.wait_for(handler.streams.get(), 5)
        second = await asyncio.wait_for(handler.streams.get(), 5)
        assert await first.received.get() == b"to a" and await second.received.get() == b"to b"
        await second.context.write(b"for b")
        await first.context.write(b"for a")
        assert await asyncio.wait_for(a.read(), 5) == b"for a"
        assert await asyncio.wait_for(b.read(), 5) == b"for b"
        for s in (first, second):
            s.finished.set_result(None)
        await until(lambda: not producer._serving, what="both streams to end")
    run(main())


def test_malformed_messages_are_dropped_and_the_rank_goes_on(caplog):
    async def main():
        wire, consumer, producer, handler = pair()
        with caplog.at_level(logging.WARNING, logger="rendezvous.mpi"):
            producer._requests_arrived([(0, b"short")])
            consumer._replies_arrived([(1, b"\x01")])
            consumer._replies_arrived([(1, control._HEAD.pack(999, control._DATA) + b"for nobody")])
        assert sum("malformed control message" in r.getMessage() for r in caplog.records) == 2
        call, stream = await opened(consumer, handler, b"still works")
        assert await stream.received.get() == b"still works"
        stream.finished.set_result(None)
    run(main())


def test_writes_return_at_once_until_too_much_is_unsent():
    """A stream hands its messages to MPI and goes on; only above 32 MiB unsent does
    a write wait for the oldest send to finish."""
    async def main():
        wire, consumer, _, handler = pair()
        call = consumer.open_call(1)
        wire.hold = True
        await asyncio.wait_for(call.write(b"x" * (8 << 20)), 1)  # below the bound: at once
        await asyncio.wait_for(call.write(b"y" * (8 << 20)), 1)
        blocked = asyncio.ensure_future(call.write(b"z" * (20 << 20)))  # 36 MiB unsent: waits
        for _ in range(10):
            await asyncio.sleep(0)
        assert not blocked.done()
        wire.unfinished[0].set_result(None)  # the oldest send finished
        await asyncio.wait_for(blocked, 5)
    run(main())


def test_close_ends_every_call_and_every_stream_served():
    async def main():
        _, consumer, producer, handler = pair()
        call, stream = await opened(consumer, handler)
        closing = asyncio.ensure_future(producer.close())
        await asyncio.wait_for(stream.ended.wait(), 5)  # the producer ends the requests it serves
        stream.finished.set_result(None)
        await asyncio.wait_for(closing, 5)
        await consumer.close()
        with pytest.raises(CallEnded):
            await asyncio.wait_for(call.read(), 5)
        # a closed rank takes no new streams
        producer._requests_arrived([(0, control._HEAD.pack(77, control._DATA) + b"new")])
        assert not producer._serving
    run(main())


# -- messages handled as they arrive (no turn of a reader task) -----------------------------------


def test_replies_go_to_the_readers_dispatch_as_they_arrive_unless_one_is_queued():
    async def main():
        wire, consumer, _, handler = pair()
        call = consumer.open_call(1)
        taken: list[bytes] = []
        refuse = {b"refused"}

        def dispatch(body) -> bool:
            if bytes(body) in refuse:
                return False  # left to the reader
            if bytes(body) == b"broken":
                raise ValueError("a frame that breaks the stream")
            taken.append(bytes(body))
            return True

        call.deliver_to(dispatch)
        await call.write(b"r")
        stream = await asyncio.wait_for(handler.streams.get(), 5)
        await stream.context.write(b"one")
        await until(lambda: taken == [b"one"], what="the reply dispatched")
        await stream.context.write(b"refused")
        await stream.context.write(b"two")  # one is queued before it: queued too, in order
        assert await asyncio.wait_for(call.read(), 5) == b"refused"
        assert await asyncio.wait_for(call.read(), 5) == b"two"
        assert taken == [b"one"]
        await stream.context.write(b"broken")  # the reader raises what the dispatch raised
        with pytest.raises(ValueError, match="breaks the stream"):
            await asyncio.wait_for(call.read(), 5)
        stream.finished.set_result(None)
        assert await asyncio.wait_for(call.read(), 5) is EOF  # an end is always read
    run(main())


def test_requests_go_to_the_handlers_take_as_they_arrive_unless_one_is_queued(caplog):
    async def main():
        _, consumer, producer, handler = pair()
        call, stream = await opened(consumer, handler, b"first")
        assert await asyncio.wait_for(stream.received.get(), 5) == b"first"
        (requests, _, _), = producer._serving.values()
        taken: list[bytes] = []

        def take(message) -> bool:
            if bytes(message) == b"bug":
                raise RuntimeError("a bug of the handler")
            if bytes(message) == b"later":
                return False
            taken.append(bytes(message))
            return True

        turns: list[int] = []
        requests.deliver_to(take, lambda: turns.append(len(taken)))
        await call.write(b"now")
        await until(lambda: taken == [b"now"], what="the request taken")
        assert turns == [1]  # told once the turn's arrivals were offered
        with caplog.at_level(logging.ERROR, logger="rendezvous.mpi"):
            await call.write(b"bug")  # the reader gets it instead, and the rank goes on
            assert await asyncio.wait_for(stream.received.get(), 5) == b"bug"
        assert "as it arrived failed" in caplog.text
        await call.write(b"later")
        assert await asyncio.wait_for(stream.received.get(), 5) == b"later"
        assert taken == [b"now"] and turns == [1]  # nothing taken since: not told again
        stream.finished.set_result(None)
    run(main())


def test_non_waiting_writes_hand_over_at_once_and_refuse_what_must_wait():
    async def main():
        wire, consumer, _, handler = pair()
        call = consumer.open_call(1)
        assert call.write_nowait(b"r")
        stream = await asyncio.wait_for(handler.streams.get(), 5)
        assert await asyncio.wait_for(stream.received.get(), 5) == b"r"
        context = stream.context
        assert context.has_room()
        context.write_nowait(b"reply")
        assert await asyncio.wait_for(call.read(), 5) == b"reply"
        wire.hold = True
        assert call.write_nowait(b"x" * (30 << 20))  # below the bound
        assert not call.write_nowait(b"y" * (4 << 20))  # above it: the writer waits instead
        context.write_nowait(b"z" * (33 << 20))
        assert not context.has_room()
        wire.unfinished[0].set_exception(RuntimeError("the send failed"))
        wire.unfinished[1].set_result(None)
        assert not call.write_nowait(b"w")  # a failed send is for the writer's write to raise
        with pytest.raises(RuntimeError, match="the send failed"):
            await call.write(b"w")
        assert context.has_room()  # its own sends finished
        stream.finished.set_result(None)
    run(main())
