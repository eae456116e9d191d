"""The producer side: RecvTensor over gRPC, unary and multiplexed stream.

Handlers are registered as generic raw-bytes handlers so the reply's tensor
bytes are written by hand (:mod:`rendezvous.codec.replies`) instead of being copied
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

With a timeline (:mod:`rendezvous.timeline`) every request served is a span
on the producer: from its arrival until its reply was planned, waiting while
its tensor was not produced yet.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, NamedTuple

import grpc
from google.protobuf.message import DecodeError

from rendezvous.errors import (
    RendezvousError,
    ResourceExhausted,
    Unavailable,
    to_status,
)
from rendezvous.keys import OwnKeys, TaskName
from rendezvous.stats import Stats, payload_nbytes
from rendezvous.table import WaitingTable, Waiter
from rendezvous.items import Received
from rendezvous.timeline import Timeline, now
from rendezvous.transport import Path, Planes, Reply
from rendezvous.transport.calls import StreamContext
from rendezvous.v1 import rendezvous_pb2 as pb

from .delivery import put_back
from .grpc_calls import GrpcContext
from .options import SERVICE, TF_SERVICE
from .producer_stream import Asked, ProducerStream
from .retry import RetryCache

__all__ = ["RecvTensorServicer", "Taken"]

log = logging.getLogger("rendezvous.server")
# Checked request keys remembered, at most this many of at most this length:
# a bound in bytes (about 16 MiB with the canonical strings), whatever is sent.
_CACHED_KEYS = 1 << 13
_CACHED_KEY_CHARS = 1024


class Taken(NamedTuple):
    """A tensor taken for a request: the item, and its key in canonical form."""

    item: Received
    key: str


class RecvTensorServicer:
    """Serves tensors from ``table`` to remote consumers, through ``planes``."""

    def __init__(self, table: WaitingTable, task: TaskName | None, *, stats: Stats,
                 planes: Planes, retry: RetryCache, max_waiting: int = 1 << 16,
                 timeline: Timeline | None = None, fusion: tuple[int, int] = (0, 0),
                 incarnation: int = 0) -> None:
        self.table = table
        #: (largest tensor packed into a group reply, most bytes in one group): see fused
        self.fusion_threshold, self.group_bytes = fusion
        self.max_waiting = max_waiting  # recvs held waiting at once, all streams and unary calls
        self.task = task
        self.stats = stats
        self.planes = planes
        self.retry = retry
        #: the server's timeline (its planes end the serve spans begun here), or None
        self.timeline = timeline
        if timeline is not None:
            self.take = self._take_traced  # type: ignore[method-assign]  # off, take is all there is
        self.draining = False
        self._streams: set[ProducerStream] = set()
        self._unary_active = 0
        #: requested keys checked as this task's own (of its ``incarnation``, or 0),
        #: with their canonical forms
        self._own = OwnKeys(task, "key {key!r} is produced by {src}, but this server is {task}",
                            _CACHED_KEYS, _CACHED_KEY_CHARS, incarnation)
        self._canonical = self._own.known  # request key -> canonical key, checked already

    # -- registration -----------------------------------------------------

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        unary: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(self._unary)
        stream: grpc.RpcMethodHandler[bytes, bytes] = grpc.stream_stream_rpc_method_handler(self._stream)
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

    def refused(self, req: Any, error: RendezvousError) -> None:
        """``req`` was refused (no room for it to wait): its consumer counts its
        request_id as settled. A take still waiting for that id (the request
        is a retry, its first call's take not answered yet) is withdrawn, so
        nothing is ever taken, and then held unseen, for an id nobody will
        ask with again."""
        if req.request_id:
            self.retry.withdraw(req.request_id, error)

    def begin_drain(self) -> None:
        """From now on only tensors already produced (or answers already given)
        are served; a recv that would wait gets UNAVAILABLE."""
        self.draining = True

    # -- taking a tensor ----------------------------------------------------

    async def take(self, req: "Asked", owner: object = None) -> Taken:
        """Wait for the tensor ``req`` asks for, for a reply on the stream
        ``owner`` (see :func:`.delivery.put_back`).

        While draining, only tensors already produced (or answers already
        given, by request_id) are served; a recv that would wait gets
        UNAVAILABLE."""
        canonical = self._check_key(req)
        step = req.step_id
        if self.draining:
            if req.request_id and self.retry.has(req.request_id):
                return Taken(await self.retry.run(step, req.request_id, self._never, canonical, owner), canonical)
            item = self.table.try_take(step, canonical)
            if item is None:
                raise Unavailable(f"server {self.task} is draining; not accepting new recvs")
            return Taken(item, canonical)
        if req.request_id:
            item = await self.retry.run(step, req.request_id, lambda: self.table.recv(step, canonical), canonical,
                                        owner)
        else:
            item = await self.table.recv(step, canonical)
        return Taken(item, canonical)

    async def _take_traced(self, req: "Asked", owner: object = None) -> Taken:
        """:meth:`take`, its wait written to the timeline (the reply's planning ends
        the span: :class:`rendezvous.timeline.TracedPlanes`)."""
        timeline = self.timeline
        assert timeline is not None
        start = now()
        try:
            taken = await RecvTensorServicer.take(self, req, owner)
        except BaseException as exc:
            timeline.serve_failed(req, start, exc)
            raise
        timeline.taken(req, taken.key, taken.item, start)
        return taken

    def take_now(self, req: "Asked", owner: object = None) -> Taken | None:
        """The tensor if it is already produced, else None (then use
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
            self.retry.record(req.step_id, rid, item, key, owner)
        if self.timeline is not None:
            self.timeline.taken(req, key, item, None)
        return Taken(item, key)

    def wait(self, req: Any, waiter: Waiter, owner: object) -> str | None:
        """Queue ``waiter`` (the stream ``owner``'s, for ``req``: no task) for the
        tensor ``req`` asks for; its request_id waits in the retry cache as a
        take's would (``waiter`` is its :class:`~rendezvous.rpc.retry.Pending`,
        and answers it: RetryCache.answered/failed). Returns the canonical key,
        or None where only :meth:`take` may wait: a retry (its id known), while
        draining or writing a timeline. Raises the key's error (InvalidKey,
        FailedPrecondition) or the step's."""
        if self.draining or self.timeline is not None:
            return None
        key = self._check_key(req)
        rid = req.request_id
        if rid and self.retry.known(rid):
            return None
        self.table.wait(req.step_id, key, waiter)  # the step's error raised here: nothing registered
        if rid:
            self.retry.wait_for(req.step_id, rid, key, owner, waiter)  # type: ignore[arg-type]
        return key

    def stop_waiting(self, req: Any, key: str, waiter: Waiter) -> bool:
        """The stream's call of a :meth:`wait` is cancelled unanswered. True when
        its waiter is withdrawn; False while a retry of its request_id (on
        another stream) still waits for the tensor: the waiter then stays and
        answers that retry only."""
        if waiter.settled:
            return True
        rid = req.request_id
        if rid and not self.retry.stop_waiting(rid):
            return False
        self.table.withdraw(req.step_id, key, waiter)
        return True

    def take_ready_many(self, step_id: int, raws: Sequence[str],
                        request_ids: Sequence[int], owner: object = None) -> list[Taken | None]:
        """:meth:`take_now` for a batch's keys at once: each key's tensor if it is
        already produced, taken (in key order) and recorded for its request_id.
        None where the key goes through :meth:`take_now` or :meth:`take` on its
        own: nothing produced yet, a retry (an id known, or twice in the
        batch), a malformed key or an ended step (the key's own take says
        so), and every key while the server drains or writes a timeline."""
        n = len(raws)
        if self.draining or self.timeline is not None:
            return [None] * n
        canonical_of = self._canonical.get
        keys: list[str | None] = [canonical_of(raw) for raw in raws]  # as asked before, usually
        if None in keys:
            for i, key in enumerate(keys):
                if key is None:
                    try:
                        keys[i] = self._canonical_key(raws[i])
                    except RendezvousError:
                        pass
        # Retries (a request_id known) and ids twice in the batch go one by one.
        ids = set(request_ids)
        known = self.retry.known_of(ids)
        if known or len(ids) != n:
            seen: set[int] = set()
            for i, rid in enumerate(request_ids):
                if rid:
                    if rid in seen or rid in known:
                        keys[i] = None
                    seen.add(rid)
        try:
            items = self.table.try_take_many(step_id, keys)
        except RendezvousError:
            return [None] * n
        out: list[Taken | None] = [None] * n
        rids: list[int] = []
        answers: list[Received] = []
        answered: list[str] = []
        new = tuple.__new__  # Taken(item, key), without the named tuple's argument handling
        for i, item in enumerate(items):
            if item is not None:
                key = keys[i]
                out[i] = new(Taken, (item, key))
                rid = request_ids[i]
                if rid:
                    rids.append(rid)
                    answers.append(item)
                    answered.append(key)  # type: ignore[arg-type]
        self.retry.record_many(step_id, rids, answers, answered, owner)
        return out

    def _check_key(self, req: "Asked") -> str:
        return self._canonical_key(req.rendezvous_key)

    def _canonical_key(self, raw: str) -> str:
        """The canonical form of a requested key (cached), or InvalidKey, or
        FailedPrecondition for a key another task produces."""
        return self._own.canonical(raw)

    @staticmethod
    async def _never() -> Received:
        raise Unavailable("server is draining")

    def reclaim(self, req: "Asked") -> None:
        """A call was cancelled while waiting: if the table handed its tensor over at
        that moment (to the retry cache's task), put the tensor back."""
        if req.request_id:
            item = self.retry.unclaimed(req.request_id)  # forgotten, and remembered as put back
            if item is not None:
                self.requeue(req.step_id, self._check_key(req), item)

    def gave_up(self, req: pb.RecvTensorRequest, item: Received) -> None:
        """The transfer of ``item``, taken for ``req``, gave up partway (a GPU
        copy failed; its consumer was told and cannot hold the whole tensor):
        the tensor goes back to the table for a later recv, as a reply never
        sent does."""
        try:
            key = self._check_key(req)
        except RendezvousError:
            return  # it was checked when taken; a key refused now names no queue
        put_back(self, req, key, item)

    def requeue(self, step_id: int, key: str, item: Received) -> None:
        try:
            self.table.requeue(step_id, key, item)
        except RendezvousError:
            pass  # the step was aborted meanwhile: its tensors are dropped anyway

    # -- unary --------------------------------------------------------------

    async def _unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            req = pb.RecvTensorRequest.FromString(request)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed RecvTensorRequest: {exc}")
        # A retry whose answer is held is answered, never refused for room (see
        # ProducerStream._ask).
        if not (req.request_id and self.retry.answers_at_once(req.request_id)):
            try:
                self.check_room()
            except RendezvousError as exc:
                self.refused(req, exc)
                self.stats.error(Path.GRPC)
                await context.abort(exc.code, exc.message)
        self._unary_active += 1
        try:
            return await self._unary_call(req, context)
        finally:
            self._unary_active -= 1

    async def _unary_call(self, req: pb.RecvTensorRequest, context: grpc.aio.ServicerContext) -> bytes:
        try:
            try:
                item, key = await self.take(req)
            except asyncio.CancelledError:
                self.reclaim(req)  # the caller's deadline or cancel: nothing is consumed
                raise
            try:
                reply = await self._unary_reply(req, item)
            except BaseException:
                # not made (a GPU copy that failed, say) or the call ended first:
                # nothing was sent, the tensor stays for a later recv
                put_back(self, req, key, item)
                raise
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

    async def _unary_reply(self, req: pb.RecvTensorRequest, item: Received) -> bytes:
        """The RecvTensorResponse for ``item``. A deadline shorter than the wait is
        enforced by gRPC itself. Unary replies are always inline: TensorFlow's
        clients know no descriptors."""
        plan = self.planes.inline.plan(req, item)
        assert plan is not None  # the inline plane carries anything
        if self.timeline is not None:
            self.timeline.served(req, plan.path)
        if plan.prepare is not None:
            plan = await self.prepared(req, plan)
        return plan.unary()

    async def prepared(self, req: Any, plan: Reply) -> Reply:
        """The reply ``plan.prepare()`` makes (a GPU tensor copied to the host);
        its host copy is what the retry cache holds for ``req`` from then on."""
        made = await plan.prepare()  # type: ignore[misc]
        if made.host is not None and plan.item is not None and req.request_id:
            self.retry.on_host(req.request_id, plan.item, made.host)
        return made

    # -- stream -------------------------------------------------------------

    async def _stream(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        await self.serve_stream(requests, GrpcContext(context))

    async def serve_stream(self, requests: AsyncIterator[bytes], context: StreamContext) -> None:
        """Serve one RecvTensorStream: ``requests`` are its StreamRequest messages,
        ``context`` its producer's end (:class:`~rendezvous.transport.calls.StreamContext`):
        a gRPC call's (:class:`~rendezvous.rpc.grpc_calls.GrpcContext`), or the
        MPI request path's (:mod:`rendezvous.mpi.control`), whose replies inside
        the frames travel by MPI and are counted so."""
        conn = ProducerStream(self, context)
        self._streams.add(conn)
        try:
            await conn.run(requests)
        finally:
            self._streams.discard(conn)

    def busy(self) -> bool:
        """Whether any reply is still being written (or a unary call served)."""
        return self._unary_active > 0 or any(c.replies or c.writing or c.waiting or c._late for c in self._streams)

    def close_streams(self) -> None:
        """End every stream once its replies are written (used when draining):
        the handlers return, so the consumers see a clean end of stream after
        the last byte instead of a cancellation that could cut it off."""
        for conn in self._streams:
            conn.closing = True
            conn.wakeup.set()

    def open_streams(self) -> int:
        return len(self._streams)
