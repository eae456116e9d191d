"""The producer side: RecvTensor over gRPC, unary and multiplexed stream.

Handlers are registered as generic raw-bytes handlers so the reply's tensor
bytes are written by hand (:mod:`rendezvous.frames`) instead of being copied
through protobuf. Three methods are served:

* ``/rendezvous.v1.Rendezvous/RecvTensor``: one recv per call (unary);
* ``/tensorflow.WorkerService/RecvTensor``: the same handler, for stubs built
  from TensorFlow's own ``worker.proto``;
* ``/rendezvous.v1.Rendezvous/RecvTensorStream``: the multiplexed stream our
  peer clients use (many recvs, chunked and interleaved replies).

Every failure is answered with a status (``rendezvous.errors`` maps it); a bad
request never takes the server down. How a reply carries its tensor is the
server's data planes' choice (:class:`rendezvous.transport.Planes`); the
servicer only writes the frames a plan gives it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from rendezvous import frames
from rendezvous.errors import (
    Cancelled,
    FailedPrecondition,
    RendezvousError,
    ResourceExhausted,
    Unavailable,
    to_status,
)
from rendezvous.keys import TaskName, parse_key
from rendezvous.stats import Stats, payload_nbytes
from rendezvous.table import Received, WaitingTable
from rendezvous.transport import Path, Planes, Reply
from rendezvous.v1 import rendezvous_pb2 as pb

from .options import SERVICE, TF_SERVICE
from .retry import RetryCache

__all__ = ["RecvTensorServicer"]

log = logging.getLogger("rendezvous.server")
# Checked request keys remembered, at most this many of at most this length:
# a bound in bytes (about 16 MiB with the canonical strings), whatever is sent.
_CACHED_KEYS = 1 << 13
_CACHED_KEY_CHARS = 1024


class RecvTensorServicer:
    """Serves tensors from ``table`` to remote consumers, through ``planes``."""

    def __init__(self, table: WaitingTable, task: TaskName | None, *, stats: Stats,
                 planes: Planes, retry: RetryCache, max_waiting: int = 1 << 16) -> None:
        self.table = table
        self.max_waiting = max_waiting  # recvs held waiting at once, all streams and unary calls
        self.task = task
        self.stats = stats
        self.planes = planes
        self.retry = retry
        self.draining = False
        self._streams: set[_StreamConn] = set()
        self._unary_active = 0
        self._canonical: dict[str, str] = {}  # request key -> canonical key, checked already

    # -- registration -----------------------------------------------------

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        unary = grpc.unary_unary_rpc_method_handler(self._unary)
        stream = grpc.stream_stream_rpc_method_handler(self._stream)
        return [
            grpc.method_handlers_generic_handler(SERVICE, {"RecvTensor": unary, "RecvTensorStream": stream}),
            grpc.method_handlers_generic_handler(TF_SERVICE, {"RecvTensor": unary}),
        ]

    def waiting_calls(self) -> int:
        """Recvs held waiting for their tensors (or a reply's preparation) now."""
        return self._unary_active + sum(len(c.waiting) for c in self._streams)

    def check_room(self) -> None:
        """RESOURCE_EXHAUSTED if no more recvs may wait: what peers can make this
        server hold is bounded (``max_waiting_calls``)."""
        if self.waiting_calls() >= self.max_waiting:
            raise ResourceExhausted(f"server {self.task} already holds {self.max_waiting} waiting recvs "
                                    "(max_waiting_calls); try again later")

    def begin_drain(self) -> None:
        """From now on only tensors already produced (or answers already given)
        are served; a recv that would wait gets UNAVAILABLE."""
        self.draining = True

    # -- taking a tensor ----------------------------------------------------

    async def take(self, req: pb.RecvTensorRequest) -> tuple[Received, str]:
        """Wait for the tensor ``req`` asks for; (item, canonical key).

        While draining, only tensors already produced (or answers already
        given, by request_id) are served; a recv that would wait gets
        UNAVAILABLE."""
        canonical = self._check_key(req)
        step = req.step_id
        if self.draining:
            if req.request_id and self.retry.has(req.request_id):
                return await self.retry.run(step, req.request_id, self._never, canonical), canonical
            item = self.table.try_take(step, canonical)
            if item is None:
                raise Unavailable(f"server {self.task} is draining; not accepting new recvs")
            return item, canonical
        if req.request_id:
            item = await self.retry.run(step, req.request_id, lambda: self.table.recv(step, canonical), canonical)
        else:
            item = await self.table.recv(step, canonical)
        return item, canonical

    def take_now(self, req: pb.RecvTensorRequest) -> tuple[Received, str] | None:
        """(item, key) if the tensor is already produced, else None (then use
        :meth:`take`). Retries of a known request_id always go through take."""
        if self.draining:
            return None
        key = self._check_key(req)
        rid = req.request_id
        if rid and self.retry.known(rid):
            return None
        item = self.table.try_take(req.step_id, key)
        if item is None:
            return None
        if rid:
            self.retry.record(req.step_id, rid, item, key)
        return item, key

    def _check_key(self, req: pb.RecvTensorRequest) -> str:
        raw = req.rendezvous_key
        canonical = self._canonical.get(raw)
        if canonical is not None:
            return canonical
        key = parse_key(raw)
        src = key.src_task
        if src is not None and self.task is not None and src != self.task:
            raise FailedPrecondition(
                f"key {raw!r} is produced by {src}, but this server is {self.task}")
        canonical = key.format()
        if len(raw) <= _CACHED_KEY_CHARS:
            if len(self._canonical) >= _CACHED_KEYS:
                self._canonical.clear()  # bounded: keys of old steps are not asked for again
            self._canonical[raw] = canonical
        return canonical

    @staticmethod
    async def _never() -> Received:
        raise Unavailable("server is draining")

    def reclaim(self, req: pb.RecvTensorRequest) -> None:
        """A call was cancelled while waiting: if the table handed its tensor over at
        that moment (to the retry cache's task), put the tensor back."""
        if req.request_id:
            item = self.retry.unclaimed(req.request_id)
            if item is not None:
                self.put_back(req, self._check_key(req), item)

    def put_back(self, req: pb.RecvTensorRequest, key: str, item: Received) -> None:
        """Return an item whose reply was not sent to its end (the consumer
        cancelled, or the stream broke) to the table, unless a retry of the same
        request_id on another stream was given it too: that reply carries it."""
        if req.request_id and not self.retry.cut_off(req.request_id):
            return
        try:
            self.table.requeue(req.step_id, key, item)
        except RendezvousError:
            pass  # the step was aborted meanwhile: its tensors are dropped anyway

    # -- unary --------------------------------------------------------------

    async def _unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            self.check_room()
        except RendezvousError as exc:
            self.stats.error(Path.GRPC)
            await context.abort(exc.code, exc.message)
        self._unary_active += 1
        try:
            return await self._unary_call(request, context)
        finally:
            self._unary_active -= 1

    async def _unary_call(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            req = pb.RecvTensorRequest.FromString(request)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed RecvTensorRequest: {exc}")
        try:
            try:
                item, _ = await self.take(req)
            except asyncio.CancelledError:
                self.reclaim(req)  # the caller's deadline or cancel: nothing is consumed
                raise
            # A dead-line shorter than the wait is enforced by gRPC itself. Unary
            # replies are always inline: TensorFlow's clients know no descriptors.
            plan = self.planes.inline.plan(req, item)
            if plan.prepare is not None:
                plan = await plan.prepare()
            reply = plan.unary()
        except RendezvousError as exc:
            self.stats.error(Path.GRPC)
            await context.abort(exc.code, exc.message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug of ours: report it, keep serving
            log.exception("RecvTensor failed")
            self.stats.error(Path.GRPC)
            code, message = to_status(exc)
            await context.abort(code, message)
        self.stats.served(Path.GRPC, payload_nbytes(item.value))
        return reply

    # -- stream -------------------------------------------------------------

    async def _stream(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        await self.serve_stream(requests, context)

    async def serve_stream(self, requests: AsyncIterator[bytes], context: Any,
                           inline_path: Path = Path.GRPC) -> None:
        """Serve one RecvTensorStream: ``requests`` are its StreamRequest messages,
        ``context`` writes frames (``write``) and ends it with a status (``abort``).
        A gRPC call gives both; the MPI request path gives its own
        (:mod:`rendezvous.mpi.control`), with ``inline_path`` MPI: a reply inside
        the frames then travelled by MPI, and is counted so."""
        conn = _StreamConn(self, context, inline_path)
        self._streams.add(conn)
        try:
            await conn.run(requests)
        finally:
            self._streams.discard(conn)

    def busy(self) -> bool:
        """Whether any reply is still being written (or a unary call served)."""
        return self._unary_active > 0 or any(c.replies or c.writing or c.waiting for c in self._streams)

    def close_streams(self) -> None:
        """End every stream once its replies are written (used when draining):
        the handlers return, so the consumers see a clean end of stream after
        the last byte instead of a cancellation that could cut it off."""
        for conn in self._streams:
            conn.closing = True
            conn.wakeup.set()

    def open_streams(self) -> int:
        return len(self._streams)



class _Outgoing:
    """A reply being written: its next frame is made one step ahead, so the
    writer knows when a reply ends without an extra turn. ``item`` goes back to
    the table if the call is cancelled before the first frame is written; a
    ``committed`` reply (its bytes already on their way) is written anyway."""

    __slots__ = ("frames", "next_frame", "req", "key", "item", "started", "committed", "ack")

    def __init__(self, frames_: Iterator[bytes], req: pb.RecvTensorRequest, key: str,
                 item: Received | None, committed: bool = False, ack: bool = False) -> None:
        self.frames = frames_
        self.next_frame: bytes | None = next(frames_, None)
        self.req = req
        self.key = key
        self.item = item
        self.started = False
        self.committed = committed
        self.ack = ack  # only the CANCELLED answer to a cancel


# Frames up to this size are packed together into one message (a `batch`);
# larger ones (tensor chunks) go alone, never copied again.
_SMALL_FRAME = 64 << 10
_BATCH_BYTES = 1 << 20


class _StreamConn:
    """One RecvTensorStream: a reader of requests, a task per waiting call, one writer.

    The writer takes one frame at a time from each reply in turn (round
    robin), so a chunked 512 MiB tensor and a 1 KiB one share the stream
    fairly: no head-of-line blocking. Small frames ready at the same time are
    packed into one gRPC message.
    """

    def __init__(self, servicer: RecvTensorServicer, context: Any, inline_path: Path = Path.GRPC) -> None:
        self.inline_path = inline_path  # how frames travel: counts replies carried inside them
        self.s = servicer
        self.context = context
        self.waiting: dict[int, asyncio.Task] = {}
        self.replies: dict[int, _Outgoing] = {}
        self.flushing: dict[int, _Outgoing] = {}  # replies whose last frame is being written
        self.ready: collections.deque[int] = collections.deque()
        self.wakeup = asyncio.Event()
        self.reader_done = False
        self.closing = False  # set while draining: end once nothing is left to write
        self.failed = False  # the consumer broke the protocol: end now, with INVALID_ARGUMENT
        self.writing = False  # a message is being handed to gRPC

    async def run(self, requests: AsyncIterator[bytes]) -> None:
        reader = asyncio.create_task(self._read(requests))
        try:
            await self._write()
            if not self.closing:
                await reader  # re-raises a malformed-request error as the stream's status
        except _BadStream as exc:
            await self.context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        finally:
            reader.cancel()
            for task in self.waiting.values():
                task.cancel()
            # Replies whose last frame was not written (never started, or cut off
            # by the stream's end) go back to the table, and their request ids are
            # forgotten, so a re-sent request takes the tensor once: nothing
            # produced is lost or delivered twice. Committed replies' bytes travel
            # another way and were delivered by their one frame.
            for reply in (*self.replies.values(), *self.flushing.values()):
                if reply.item is not None and not reply.committed:
                    self.s.put_back(reply.req, reply.key, reply.item)
            self.replies.clear()
            self.flushing.clear()

    async def _read(self, requests: AsyncIterator[bytes]) -> None:
        try:
            async for raw in requests:
                try:
                    msg = pb.StreamRequest.FromString(raw)
                except DecodeError as exc:
                    raise _BadStream(f"malformed StreamRequest: {exc}") from None
                if msg.batch:
                    if msg.WhichOneof("kind") is not None:
                        self._handle(msg)
                    for one in msg.batch:
                        self._handle(one)
                else:
                    self._handle(msg)
        except _BadStream:
            self.failed = True  # the writer stops at once: the stream ends with the error
            raise
        finally:
            self.reader_done = True
            self.wakeup.set()

    def _handle(self, msg: pb.StreamRequest) -> None:
        kind = msg.WhichOneof("kind")
        call_id = msg.call_id
        if kind == "recv":
            queued = self.replies.get(call_id)
            if queued is not None and queued.ack and not queued.started:
                # the consumer reuses the id of a call it cancelled: it is done with
                # that call, so the answer to its cancel is moot
                del self.replies[call_id]
            if call_id in self.waiting or call_id in self.replies:
                raise _BadStream(f"call_id {call_id} is already in use on this stream")
            req = msg.recv
            try:
                taken = self.s.take_now(req)
            except Exception as exc:
                self._reply_error(call_id, req, exc)
                return
            if taken is not None:  # produced already: answer without a task
                self._reply(call_id, req, *taken)
                return
            try:
                self.s.check_room()
            except RendezvousError as exc:
                self._reply_error(call_id, req, exc)
                return
            self.waiting[call_id] = asyncio.create_task(self._serve(call_id, req))
        elif kind == "cancel":
            self._cancel(call_id)
        else:
            raise _BadStream(f"StreamRequest {call_id} has neither recv nor cancel")

    def _cancel(self, call_id: int) -> None:
        """The consumer gave up on ``call_id``. What was not sent goes back to the
        table and the cancel is answered with CANCELLED; a reply already on its
        way (started, or committed: a descriptor whose transfer is posted) is
        written to its end, and the consumer keeps what it receives."""
        task = self.waiting.pop(call_id, None)
        if task is not None:
            task.cancel()  # its tensor, if handed over meanwhile, goes back (see _serve)
            self._ack_cancel(call_id)
            return
        reply = self.replies.get(call_id)
        if reply is None or reply.committed or reply.started:
            return
        del self.replies[call_id]
        if reply.item is not None:
            self.s.put_back(reply.req, reply.key, reply.item)
        self._ack_cancel(call_id)

    def _ack_cancel(self, call_id: int) -> None:
        frame = frames.error_frame(call_id, Cancelled(f"call {call_id} cancelled by the consumer; nothing sent"))
        self._ready(call_id, _Outgoing(iter((frame,)), None, "", None, ack=True))  # type: ignore[arg-type]

    def _done_waiting(self, call_id: int) -> None:
        # Only this call's own task: a cancelled call's task may unwind after a
        # new call reused its id.
        if self.waiting.get(call_id) is asyncio.current_task():
            del self.waiting[call_id]

    async def _serve(self, call_id: int, req: pb.RecvTensorRequest) -> None:
        try:
            item, key = await self.s.take(req)
        except asyncio.CancelledError:
            self.s.reclaim(req)  # a tensor handed over just as the call was cancelled goes back
            raise
        except Exception as exc:
            self._reply_error(call_id, req, exc)
            return
        finally:
            self._done_waiting(call_id)
        self._reply(call_id, req, item, key)

    def _reply(self, call_id: int, req: pb.RecvTensorRequest, item: Received, key: str) -> None:
        try:
            plan = self.s.planes.plan(req, item)
            if plan.prepare is not None:
                self.waiting[call_id] = asyncio.create_task(self._prepared_reply(call_id, req, key, plan))
                return
            outgoing = self._outgoing(call_id, req, key, plan)
        except Exception as exc:
            self._reply_error(call_id, req, exc)
            return
        self.s.stats.served(self._path(plan.path), payload_nbytes(item.value))
        self._ready(call_id, outgoing)

    async def _prepared_reply(self, call_id: int, req: pb.RecvTensorRequest, key: str, plan: Reply) -> None:
        """A reply that needs work off the loop first (a GPU tensor copied to the host)."""
        item = plan.item
        try:
            plan = await plan.prepare()  # type: ignore[misc]
            outgoing = self._outgoing(call_id, req, key, plan)
        except asyncio.CancelledError:
            if item is not None:
                self.s.put_back(req, key, item)  # nothing was sent: the tensor stays for a later recv
            raise
        except Exception as exc:
            self._reply_error(call_id, req, exc)
            return
        finally:
            self._done_waiting(call_id)
        self.s.stats.served(self._path(plan.path), payload_nbytes(item.value if item is not None else None))
        self._ready(call_id, outgoing)

    def _path(self, path: Path) -> Path:
        return self.inline_path if path is Path.GRPC else path

    @staticmethod
    def _outgoing(call_id: int, req: pb.RecvTensorRequest, key: str, plan: Reply) -> _Outgoing:
        return _Outgoing(plan.stream_frames(call_id), req, key, plan.item, plan.committed)

    def _reply_error(self, call_id: int, req: pb.RecvTensorRequest, exc: BaseException) -> None:
        if not isinstance(exc, RendezvousError):
            log.error("RecvTensorStream call %d failed", call_id, exc_info=exc)
        self.s.stats.error(self.inline_path)
        self._ready(call_id, _Outgoing(iter([frames.error_frame(call_id, exc)]), req, "", None))

    def _ready(self, call_id: int, reply: _Outgoing) -> None:
        self.replies[call_id] = reply
        self.ready.append(call_id)
        self.wakeup.set()

    def _next_message(self) -> bytes | None:
        """The next message to write: one large frame, or small frames packed."""
        batch: list[bytes] = []
        size = 0
        while self.ready and size < _BATCH_BYTES:
            call_id = self.ready[0]
            reply = self.replies.get(call_id)
            if reply is None:  # cancelled
                self.ready.popleft()
                continue
            frame = reply.next_frame
            assert frame is not None
            if batch and len(frame) > _SMALL_FRAME:
                break  # goes alone, next time
            self.ready.popleft()
            reply.started = True
            reply.next_frame = next(reply.frames, None)
            if reply.next_frame is None:
                del self.replies[call_id]
                self.flushing[call_id] = reply  # done once the write of this message returns
            else:
                self.ready.append(call_id)
            batch.append(frame)
            size += len(frame)
            if len(frame) > _SMALL_FRAME:
                break
        if not batch:
            return None
        return batch[0] if len(batch) == 1 else frames.batch_responses(batch)

    async def _write(self) -> None:
        while not self.failed:
            message = self._next_message()
            if message is not None:
                self.writing = True
                try:
                    await self.context.write(message)
                finally:
                    self.writing = False
                self.flushing.clear()
                continue
            if (self.reader_done or self.closing) and not self.waiting and not self.replies:
                return
            self.wakeup.clear()
            await self.wakeup.wait()


class _BadStream(Exception):
    pass
