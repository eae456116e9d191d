"""Requests over MPI: the RecvTensor stream between two ranks of one MPI job,
carried by MPI messages instead of a gRPC call (``RENDEZVOUS_MPI_REQUESTS=1``).

TensorFlow's MPI path asked for tensors with MPI messages, and an MPI thread
picked the requests up; this is that, with the semantics of the gRPC stream
unchanged. Each direction carries exactly the bytes the gRPC stream would:
``StreamRequest`` messages from the consumer, ``StreamResponse`` frames from
the producer. So the producer serves them with the same stream handler
(:class:`rendezvous.rpc.servicer.RecvTensorServicer`), and the consumer reads
them with the same stream reader (:class:`rendezvous.rpc.peer.PeerClient`):
call ids, cancels and their answers, orphans, batching, retries by
request_id, draining. The tensor's bytes take whatever plane the reply names:
inline inside the frames (small tensors: header and bytes in one message), or
a descriptor and a direct transfer on the optimal path.

Messages travel on a communicator of their own (``MpiWorld.control``), so
they can never match a data transfer's receive. An envelope of 16 bytes comes
first: the stream's id (8 bytes, little-endian; the consumer numbers its
streams), a kind: ``DATA`` (the stream's bytes) or ``END`` (the consumer
closed the stream; from the producer, followed by a ``Status``: the stream's
end, with its code), and 7 bytes of padding (the body starts aligned in its
buffer, so the tensors its frames carry are read in place). The engine's
listeners take every message as it arrives (matched probes), on the MPI
thread, and hand them to the loop in one batch per turn.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import struct
from collections.abc import AsyncIterator, Callable, Sized
from typing import Any, NoReturn

import numpy as np

from rendezvous.buffers import RecvBuffers
from rendezvous.errors import Cancelled, Internal, RendezvousError, from_status
from rendezvous.paths import Path
from rendezvous.transport.calls import EOF, CallEnded
from rendezvous.codec.wire import Pieces
from rendezvous.v1 import rendezvous_pb2 as pb

from .engine import ProgressEngine

__all__ = ["MpiRequests", "MpiCall", "call_ended", "REQUEST_TAG", "REPLY_TAG"]

log = logging.getLogger("rendezvous.mpi")

REQUEST_TAG = 1  # consumer -> producer, on the control communicator
REPLY_TAG = 2    # producer -> consumer
_DATA = 1
_END = 2
#: the envelope, padded to 16 bytes: a message's body starts aligned in its
#: buffer, so the tensors read in place from its frames are aligned too
_HEAD = struct.Struct("<QB7x")
_MAX_MESSAGE = 1 << 30  # a control message is one MPI message: frames are chunk-sized, far below
# Bytes one stream may have handed to MPI and not yet sent: a write returns at
# once below this (MPI keeps the messages of a pair in order), and waits for
# the oldest to go above it, so a large inline reply is not copied into frames
# all at once.
_IN_FLIGHT_BYTES = 32 << 20


class _Outflow:
    """Messages of one stream handed to MPI and not yet sent."""

    __slots__ = ("pending", "nbytes")

    def __init__(self) -> None:
        self.pending: collections.deque[tuple[asyncio.Future, int]] = collections.deque()
        self.nbytes = 0

    async def add(self, done: asyncio.Future, n: int) -> None:
        self.put(done, n)
        while self.pending and (self.pending[0][0].done() or self.nbytes > _IN_FLIGHT_BYTES):
            first, size = self.pending.popleft()
            self.nbytes -= size
            await first  # raises the send's error, if any

    def put(self, done: asyncio.Future, n: int) -> None:
        self.pending.append((done, n))
        self.nbytes += n

    def room(self, n: int) -> bool:
        """Whether a message of ``n`` bytes may be handed over without waiting:
        the sends done are let go (a failed one stays, for :meth:`add` to raise)
        and what remains in flight leaves room for it."""
        pending = self.pending
        while pending and pending[0][0].done() and not pending[0][0].cancelled() \
                and pending[0][0].exception() is None:
            self.nbytes -= pending.popleft()[1]
        return not (pending and pending[0][0].done()) and self.nbytes + n <= _IN_FLIGHT_BYTES


def status_value(error: RendezvousError) -> int:
    """The status number that carries ``error`` in an MPI stream's end (gRPC's numbering)."""
    return int(error.code.value[0])


def _closed(why: str) -> CallEnded:
    return CallEnded(Cancelled(why))


class MpiCall:
    """The consumer's end of one stream to one rank (a
    :class:`~rendezvous.transport.calls.RequestCall`): its messages, and a reply
    inside them, travel by MPI."""

    inline_path = Path.MPI

    def __init__(self, requests: "MpiRequests", rank: int, stream_id: int) -> None:
        self._requests = requests
        self.rank = rank
        self.stream_id = stream_id
        self._inbox: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        self._done = False
        self._out = _Outflow()
        self.awaited: Sized = ()  # the recvs awaiting replies on this stream (see watch)
        #: the reader's dispatch of a message as it arrives (see deliver_to)
        self._dispatch: Callable[[Any], bool] | None = None

    def watch(self, awaited: Sized) -> None:
        """``awaited``: the reader's recvs awaiting replies; while it is not empty
        the engine polls for them without pausing."""
        self.awaited = awaited

    def deliver_to(self, dispatch: Callable[[Any], bool]) -> None:
        """``dispatch`` takes each message of the stream as it arrives (on the
        loop, in the engine's hand-over) while none waits in the reader's inbox
        before it: a reply reaches its recv without a turn of the reader task.
        It returns False to leave the message to the reader."""
        self._dispatch = dispatch

    async def write(self, message: bytes) -> None:
        """Hand ``message`` to MPI; returns at once unless too much is still unsent."""
        if self._done:
            raise _closed("stream closed")
        await self._out.add(self._requests.submit(self.rank, REQUEST_TAG, self.stream_id, _DATA, message),
                            len(message))

    def write_nowait(self, message: bytes) -> bool:
        """:meth:`write` when it would return at once: True once handed to MPI;
        False (nothing done) when the writer must write it, waiting or failing."""
        if self._done or not self._out.room(len(message)):
            return False
        self._out.put(self._requests.submit(self.rank, REQUEST_TAG, self.stream_id, _DATA, message), len(message))
        return True

    async def read(self) -> Any:
        """The next message, or ``EOF`` once the producer ended the stream
        cleanly; raises :class:`CallEnded` with its status otherwise."""
        item = await self._inbox.get()
        if item is None:
            return EOF
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        """Close the stream: the producer ends its side (replies never started go
        back to its table) and readers see the end."""
        if self._done:
            return
        self._done = True
        self._requests.forget(self)
        self._requests.post(self.rank, REQUEST_TAG, self.stream_id, _END, b"")
        self._inbox.put_nowait(_closed("stream closed locally"))

    # from MpiRequests
    def _deliver(self, kind: int, body: Any) -> None:
        if kind == _DATA:
            dispatch = self._dispatch
            if dispatch is not None and self._inbox.empty():
                try:
                    if dispatch(body):
                        return
                except Exception as exc:  # the reader raises it, as if it had read it
                    self._inbox.put_nowait(exc)
                    return
            self._inbox.put_nowait(body)
            return
        self._done = True
        status = pb.Status.FromString(body) if body else pb.Status()
        if status.code == 0:
            self._inbox.put_nowait(None)
        else:
            self._inbox.put_nowait(CallEnded(from_status(status.code, status.message)))


class _ProducerContext:
    """The producer's end of one stream (a
    :class:`~rendezvous.transport.calls.StreamContext`): frames written as MPI
    messages, and requests handed to the handler as they arrive (``deliver_to``,
    see :meth:`_Requests.deliver_to`)."""

    inline_path = Path.MPI
    #: frames may come in pieces: :meth:`MpiRequests.submit` joins them behind its head
    gathers = True

    def __init__(self, requests: "MpiRequests", rank: int, stream_id: int, incoming: "_Requests") -> None:
        self._requests = requests
        self.rank = rank
        self.stream_id = stream_id
        self.ended = False
        self._out = _Outflow()
        self.deliver_to = incoming.deliver_to

    async def write(self, message: bytes | Pieces) -> None:
        """Hand a frame to MPI; returns at once unless too much is still unsent."""
        await self._out.add(self._requests.submit(self.rank, REPLY_TAG, self.stream_id, _DATA, message),
                            len(message))

    def has_room(self) -> bool:
        """Whether :meth:`write` would return at once now (no failed send to
        raise, and less than the bound in flight)."""
        return self._out.room(0)

    def write_nowait(self, message: bytes | Pieces) -> None:
        """Hand a frame to MPI without waiting (after :meth:`has_room`)."""
        self._out.put(self._requests.submit(self.rank, REPLY_TAG, self.stream_id, _DATA, message), len(message))

    async def abort(self, error: RendezvousError) -> NoReturn:
        self.end(error)
        raise _Aborted()

    def end(self, error: RendezvousError | None = None) -> None:
        """End the stream: cleanly, or with ``error``'s status."""
        if self.ended:
            return
        self.ended = True
        body = b"" if error is None else \
            pb.Status(code=status_value(error), message=error.message).SerializeToString()
        self._requests.post(self.rank, REPLY_TAG, self.stream_id, _END, body)


class _Aborted(Exception):
    """Ends a stream handler after its abort was sent (as gRPC's abort does)."""


class _Requests:
    """The consumer's messages of one stream, as the async iterator the stream
    handler reads."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        #: the stream handler's take of a message as it arrives, and what it does
        #: once a turn's arrivals are taken (see deliver_to)
        self._take: Callable[[Any], bool] | None = None
        self._taken: Callable[[], None] | None = None

    def deliver_to(self, take: Callable[[Any], bool], taken: Callable[[], None]) -> None:
        """``take`` is offered each message as it arrives (on the loop, in the
        engine's hand-over) while none is queued before it; False queues it.
        ``taken`` is called once the turn's arrivals are offered, if ``take``
        took one (the handler writes the replies they made ready, together)."""
        self._take, self._taken = take, taken

    def offer(self, message: Any) -> bool:
        """Hand ``message`` to the handler's take, or queue it; True if taken."""
        take = self._take
        if take is not None and self.queue.empty():
            try:
                if take(message):
                    return True
            except Exception:  # a bug of ours: the reader handles the message instead
                log.exception("handling an MPI request message as it arrived failed")
        self.queue.put_nowait(message)
        return False

    def taken(self) -> None:
        """The turn's arrivals are offered (see deliver_to)."""
        if self._taken is not None:
            try:
                self._taken()
            except Exception:  # a bug of ours: the stream's writer writes them instead
                log.exception("writing replies to MPI requests as they were made failed")

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[bytes]:
        while True:
            item = await self.queue.get()
            if item is None:
                return
            yield item


class MpiRequests:
    """Both ends of the MPI request path of one rank: its calls to other ranks,
    and the streams other ranks opened to it, served by ``servicer``."""

    def __init__(self, engine: ProgressEngine, comm: Any, rank: int, servicer: Any,
                 buffers: RecvBuffers | None = None) -> None:
        self.engine = engine
        self.comm = comm  # the control communicator
        self.rank = rank
        self.servicer = servicer
        #: where a large reply message is received (its tensors are views on it):
        #: buffers reused once those arrays are dropped, so a step's replies do not
        #: fault in fresh pages (see rendezvous.buffers); None: a new bytearray each
        self.buffers = buffers
        self._calls: dict[tuple[int, int], MpiCall] = {}
        self._serving: dict[tuple[int, int], tuple[_Requests, _ProducerContext, asyncio.Task]] = {}
        self._next_stream = 1
        self._closed = False

    def start(self) -> None:
        """Listen for both directions (call inside the server's loop)."""
        self.engine.listen(self.comm, REQUEST_TAG, self._requests_arrived)
        self.engine.listen(self.comm, REPLY_TAG, self._replies_arrived, self._reply_buffer)
        self.engine.expect_while(self._awaiting)

    def _reply_buffer(self, nbytes: int) -> Any:
        """A buffer for a reply message of ``nbytes`` (MPI thread or loop)."""
        buffers = self.buffers
        if buffers is None or nbytes < buffers.min_bytes:
            return bytearray(nbytes)
        return buffers.empty(nbytes, np.uint8)

    def _awaiting(self) -> bool:
        """Whether a recv of this rank awaits a reply over MPI (MPI thread)."""
        return any(call.awaited for call in tuple(self._calls.values()))

    # -- sending -----------------------------------------------------------------

    def submit(self, rank: int, tag: int, stream_id: int, kind: int, body: bytes | Pieces) -> asyncio.Future:
        """One envelope to ``rank``, handed to MPI; the future is done once sent.
        Envelopes to one rank leave in the order submitted (MPI does not let
        messages of one pair, tag and communicator overtake each other). A
        body in pieces is joined once, behind the head."""
        head = _HEAD.pack(stream_id, kind)
        message = body.join(head) if isinstance(body, Pieces) else head + body
        return self.engine.isend(message, rank, tag, _MAX_MESSAGE, comm=self.comm)

    def post(self, rank: int, tag: int, stream_id: int, kind: int, body: bytes) -> None:
        """:meth:`submit`, nobody waiting for it (an end or a close)."""
        if self._closed:
            return
        done = self.submit(rank, tag, stream_id, kind, body)
        done.add_done_callback(lambda f: f.cancelled() or f.exception())

    # -- the consumer's side --------------------------------------------------------

    def open_call(self, rank: int) -> MpiCall:
        """A new stream to ``rank``."""
        call = MpiCall(self, rank, self._next_stream)
        self._next_stream += 1
        self._calls[(rank, call.stream_id)] = call
        return call

    def forget(self, call: MpiCall) -> None:
        self._calls.pop((call.rank, call.stream_id), None)

    def _replies_arrived(self, taken: list[tuple[int, Any]]) -> None:
        for source, message in taken:
            if len(message) < _HEAD.size:
                log.warning("a malformed control message from rank %d was dropped", source)
                continue
            stream_id, kind = _HEAD.unpack_from(message)
            call = self._calls.get((source, stream_id))
            if call is None:
                continue  # a stream closed here: its late frames go nowhere
            if kind == _END:
                self._calls.pop((source, stream_id), None)
            call._deliver(kind, memoryview(message)[_HEAD.size:])

    # -- the producer's side ----------------------------------------------------------

    def _requests_arrived(self, taken: list[tuple[int, Any]]) -> None:
        handled: list[_Requests] = []  # the streams that took a message as it arrived
        for source, message in taken:
            if len(message) < _HEAD.size:
                log.warning("a malformed control message from rank %d was dropped", source)
                continue
            stream_id, kind = _HEAD.unpack_from(message)
            where = (source, stream_id)
            serving = self._serving.get(where)
            if kind == _END:
                if serving is not None:
                    # The consumer closed the stream (it never half-closes): its handler ends
                    # as a cancelled gRPC call's does, so the recvs still waiting are withdrawn
                    # and what they would have taken stays in the table.
                    serving[0].queue.put_nowait(None)
                    serving[2].cancel()
                continue
            if serving is None:
                if self._closed:
                    continue
                serving = self._serve(source, stream_id)
            if serving[0].offer(memoryview(message)[_HEAD.size:]) and serving[0] not in handled:
                handled.append(serving[0])
        for requests in handled:
            requests.taken()

    def _serve(self, source: int, stream_id: int) -> tuple[_Requests, _ProducerContext, asyncio.Task]:
        requests = _Requests()
        context = _ProducerContext(self, source, stream_id, requests)
        task = asyncio.ensure_future(self._run(requests, context))
        serving = self._serving[(source, stream_id)] = (requests, context, task)
        return serving

    async def _run(self, requests: _Requests, context: _ProducerContext) -> None:
        try:
            # replies inside this stream's frames travelled by MPI: counted so
            await self.servicer.serve_stream(requests, context)
        except _Aborted:
            pass
        except Exception as exc:  # a bug of ours: the stream ends with INTERNAL, the rank goes on
            log.exception("MPI request stream from rank %d failed", context.rank)
            context.end(Internal(f"{type(exc).__name__}: {exc}"))
        finally:
            context.end()  # a clean end (EOF) unless it ended otherwise
            self._serving.pop((context.rank, context.stream_id), None)

    async def close(self) -> None:
        """Stop taking streams; end the calls of this rank."""
        for call in list(self._calls.values()):
            call.cancel()  # tells the producers: their sides end
        self._closed = True
        tasks = [t for _, _, t in self._serving.values()]
        for requests, _, _ in self._serving.values():
            requests.queue.put_nowait(None)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
