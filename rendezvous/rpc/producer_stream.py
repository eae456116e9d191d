"""The producer's end of one RecvTensor stream: :class:`ProducerStream`.

A consumer's recvs arrive as calls on one long-lived stream (gRPC, or its
MPI stand-in); this is the handler of one such stream. A reader takes
requests and cancels; each recv is answered at once when its tensor is
there, else by a task that waits for it; one writer takes one frame at a
time from each reply in turn (round robin), so a chunked 512 MiB tensor and
a 1 KiB one share the stream fairly, and small frames ready together go as
one message. Every cancel is answered: what was not sent goes back to the
table, what was already on its way is written to its end.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from google.protobuf.message import DecodeError

from rendezvous.codec import groups, wire
from rendezvous.codec.replies import batch_responses, error_frame
from rendezvous.errors import Cancelled, InvalidArgument, RendezvousError, Unavailable
from rendezvous.paths import Path
from rendezvous.stats import payload_nbytes
from rendezvous.table import Waiter
from rendezvous.items import Received
from rendezvous.transport import Carry, Reply
from rendezvous.transport.calls import StreamContext
from rendezvous.v1 import rendezvous_pb2 as pb

from .delivery import COMMIT, START, OutgoingReply, put_back
from .retry import Handed

if TYPE_CHECKING:
    from .servicer import RecvTensorServicer

__all__ = ["ProducerStream", "KeyRequest"]

log = logging.getLogger("rendezvous.server")


def _now_micros() -> int:
    return time.time_ns() // 1000


class KeyRequest:
    """One key of a batched request (``RecvMany``), read like a
    ``RecvTensorRequest`` by everything that serves it (the table's take, the
    retry cache, the planes, the timeline), without a protobuf object per key."""

    __slots__ = ("step_id", "rendezvous_key", "request_id", "transport_options")
    dma_ok = False

    def __init__(self, step_id: int, rendezvous_key: str, request_id: int, transport_options: Any) -> None:
        self.step_id = step_id
        self.rendezvous_key = rendezvous_key
        self.request_id = request_id
        self.transport_options = transport_options


#: a request as the stream handler serves it: a whole one, or one key of a batch
Asked = pb.RecvTensorRequest | KeyRequest


# Frames up to this size are packed together into one message (a `batch`);
# larger ones (tensor chunks) go alone, never copied again.
_SMALL_FRAME = 64 << 10
_BATCH_BYTES = 1 << 20


#: keys of a batch taken between two turns of the writer (when replies wait to be written)
_YIELD_EVERY = 8


def _nothing() -> None:
    pass


async def _writer_turn() -> None:
    """Let the writer (and the rest of the loop) run once."""
    await asyncio.sleep(0)


class ProducerStream:
    """One RecvTensorStream: a reader of requests, a task per waiting call, one writer.

    The writer takes one frame at a time from each reply in turn (round
    robin), so a chunked 512 MiB tensor and a 1 KiB one share the stream
    fairly: no head-of-line blocking. Small frames ready at the same time are
    packed into one gRPC message.
    """

    def __init__(self, servicer: RecvTensorServicer, context: StreamContext) -> None:
        self.inline_path = context.inline_path  # how frames travel: counts replies carried inside them
        self.s = servicer
        self.context = context
        #: the context joins a message's pieces itself (with its own envelope in
        #: front: MPI); else a large frame's pieces are joined here (gRPC wants bytes)
        self.gathers = context.gathers
        #: calls waiting for their tensors: a task each (a lone recv's
        #: :meth:`_serve`, a reply's preparation), or a batch key's
        #: :class:`_Waiting` (no task: the send that produces it answers it)
        self.waiting: dict[int, asyncio.Task | _Waiting] = {}
        #: waiting calls that ask again with a request_id the retry cache knows
        #: (see _cancel_retry)
        self.retried: dict[int, Any] = {}
        self.replies: dict[int, OutgoingReply] = {}
        self.flushing: dict[int, OutgoingReply] = {}  # replies whose last frame is being written
        self.ready: collections.deque[int] = collections.deque()
        self.wakeup = asyncio.Event()
        self.reader_done = False
        self.closing = False  # set while draining: end once nothing is left to write
        self.failed = False  # the consumer broke the protocol: end now, with INVALID_ARGUMENT
        self.writing = False  # a message is being handed to gRPC
        #: keys of group replies in ``replies``: negative, never a consumer's call_id
        self._group_ids = -1
        #: batches' keys produced while they waited, grouped at the end of the turn
        self._late: list[tuple[int, Any, Received, str]] = []
        self._handling = False  # the reader is handling a message (it may be awaiting)
        #: the context's non-waiting write (MPI), for replies made as a request
        #: arrives (see _arrived)
        self._write_now = context.write_nowait

    async def run(self, requests: AsyncIterator[bytes]) -> None:
        deliver_to = self.context.deliver_to
        if deliver_to is not None:  # requests handled as they arrive (MPI), see _arrived
            deliver_to(self._arrived, self._write_ready)
        reader = asyncio.create_task(self._read(requests))
        try:
            await self._write()
            if not self.closing:
                await reader  # re-raises a malformed-request error as the stream's status
        except _BadStream as exc:
            await self.context.abort(InvalidArgument(str(exc)))
        finally:
            reader.cancel()
            for task in self.waiting.values():
                if type(task) is _Waiting:
                    task.stop()
                else:
                    task.cancel()
            self.retried.clear()
            # Replies whose last frame was not handed over (never started, or cut
            # off by the stream's end) go back to the table, and their request ids
            # are forgotten, so a re-sent request takes the tensor once: nothing
            # produced is lost or delivered twice. A reply whose last frame was
            # being written when the stream ended (flushing) was handed over whole:
            # its consumer may well have it (and have closed the stream for that
            # very reason), so it is not put back (that made a ghost the next recv
            # took again); if the connection died with it, the consumer asks again
            # with its request_id and the retry cache answers. A descriptor never
            # handed over releases its transfer (never started) and goes back
            # too; one handed over is committed (its transfer waits for the
            # consumer's receive), and a retry of its id gets it again (Handed).
            for reply in self.replies.values():
                reply.give_back(self.s, self)
            self.replies.clear()
            for _, req, item, key in self._late:  # taken, their group not made yet
                put_back(self.s, req, key, item, self)
            self._late.clear()
            self.flushing.clear()

    async def _read(self, requests: AsyncIterator[bytes]) -> None:
        try:
            async for raw in requests:
                self._handling = True
                try:
                    msg = pb.StreamRequest.FromString(raw)
                except DecodeError as exc:
                    raise _BadStream(f"malformed StreamRequest: {exc}") from None
                if msg.batch:
                    if msg.WhichOneof("kind") is not None:
                        await self._handle(msg)
                    for one in msg.batch:
                        await self._handle(one)
                else:
                    await self._handle(msg)
                self._handling = False
        except _BadStream:
            self.failed = True  # the writer stops at once: the stream ends with the error
            raise
        finally:
            self.reader_done = True
            self.wakeup.set()

    def _arrived(self, raw: Any) -> bool:
        """A request message handed over as it arrives (by the MPI request path, when
        none is queued before it): a lone recv or cancel is handled here, with no turn
        of the reader; the replies made ready are written once the turn's arrivals are
        taken (:meth:`_write_ready`). False leaves the message to the reader: one it is
        still handling, a batch, one that does not parse or breaks the stream."""
        if self._handling or self.reader_done or self.failed or self.closing:
            return False
        try:
            msg = pb.StreamRequest.FromString(raw)
        except DecodeError:
            return False
        kind = msg.WhichOneof("kind")
        if msg.batch or (kind != "recv" and kind != "cancel"):
            return False
        if kind == "recv":
            try:
                self._ask(msg.call_id, msg.recv)
            except _BadStream:  # raised before anything was taken
                return False
        else:
            self._cancel(msg.call_id)
        return True

    def _write_ready(self) -> None:
        """What the writer would write next (the small frames ready, packed in
        one message), handed to the context at once: when it takes messages
        without waiting (MPI), the writer is not mid-write and the context has
        room (else the writer, woken, writes it)."""
        write_now = self._write_now
        if write_now is None or self.writing or not self.ready or not self.context.has_room():
            return
        message = self._next_message()
        if message is None:
            return
        write_now(message)
        self.flushing.clear()  # handed over whole, as when the writer's write returns

    async def _handle(self, msg: pb.StreamRequest) -> None:
        kind = msg.WhichOneof("kind")
        call_id = msg.call_id
        if kind == "recv":
            self._ask(call_id, msg.recv)
        elif kind == "cancel":
            self._cancel(call_id)
        elif kind == "recv_many":
            await self._handle_many(call_id, msg.recv_many)
        elif kind == "release":
            self.s.planes.released(msg.release.export_ids, msg.release.failed)
        else:
            raise _BadStream(f"StreamRequest {call_id} has neither recv, recv_many, cancel nor release")

    async def _handle_many(self, first: int, many: pb.RecvMany) -> None:
        """A batched request: each key is the call ``first + i`` with a single
        recv's rules; the small tensors found ready go back together in group
        replies, anything else on its own (or when it is produced).

        The tensors already produced are taken at once, in key order (one pass
        over the table and the retry cache for the batch). Then, every few
        keys while their replies are made, the writer gets a turn when replies
        are ready (the reader reads nothing meanwhile, so requests keep their
        order): a large tensor's descriptor leaves while the rest of the batch
        is planned, and its consumer posts the receive sooner (MPI moves a
        large message only once its receive is posted). What was taken but
        not yet answered goes back, in order, if the stream ends meanwhile."""
        keys: list[str] = list(many.rendezvous_keys)
        rids: list[int] = list(many.request_ids)
        n = len(keys)
        if len(rids) != n:
            raise _BadStream(f"RecvMany {first} has {len(rids)} request_ids for {n} keys")
        if first + n > 1 << 64:
            raise _BadStream(f"RecvMany {first} runs past the largest call_id")
        self._claim(first, n)
        step = many.step_id
        opts = many.transport_options
        # The keys whose tensors are here are taken at once, in key order; the
        # rest go one by one (they wait, or their error is answered).
        s = self.s
        taken = s.take_ready_many(step, keys, rids, self)
        group: list[tuple[int, Any, Received, str]] = []
        # what _packs checks, hoisted: this loop runs once per key of the batch
        threshold = s.fusion_threshold
        timeline = s.timeline
        fusable = groups.fusable
        ready = self.ready
        try:
            for i in range(n):
                req = KeyRequest(step, keys[i], rids[i], opts)
                got = taken[i]
                if got is None:
                    self._ask(first + i, req, group)
                else:
                    taken[i] = None  # answered from here on (or put back with the group)
                    item, key = got
                    if threshold and not item[1] and fusable(item[0], threshold):
                        if timeline is not None:
                            timeline.served(req, self.inline_path)
                        group.append((first + i, req, item, key))
                    else:
                        self._reply(first + i, req, item, key)
                if i % _YIELD_EVERY == _YIELD_EVERY - 1 and ready:
                    await _writer_turn()
        except BaseException:
            # taken, their replies not made: back, the last taken first
            rest = [(0, KeyRequest(step, keys[j], rids[j], opts), got.item, got.key)
                    for j, got in enumerate(taken) if got is not None]
            for _, req, item, key in reversed(group + rest):
                put_back(self.s, req, key, item, self)
            raise
        if group:
            self._reply_groups(group, many)

    def _claim(self, first: int, n: int) -> None:
        """The calls ``first`` .. ``first + n - 1`` of a batch are new: an id in
        use is a broken stream (a cancelled call's id may be used again: the
        answer to its cancel is moot then)."""
        replies = self.replies
        waiting = self.waiting
        for call_id in range(first, first + n):
            queued = replies.get(call_id)
            if queued is not None and queued.ack and not queued.started:
                del replies[call_id]
                queued = None
            if queued is not None or call_id in waiting:
                raise _BadStream(f"call_id {call_id} is already in use on this stream")

    def _ask(self, call_id: int, req: Asked,
             group: list[tuple[int, Any, Received, str]] | None = None) -> None:
        """One recv: answered now if its tensor is here (into ``group`` when it
        may travel packed), else by a task that waits for it."""
        queued = self.replies.get(call_id)
        if queued is not None and queued.ack and not queued.started:
            # the consumer reuses the id of a call it cancelled: it is done with
            # that call, so the answer to its cancel is moot
            del self.replies[call_id]
        if call_id in self.waiting or call_id in self.replies:
            raise _BadStream(f"call_id {call_id} is already in use on this stream")
        try:
            taken = self.s.take_now(req, self)
        except Exception as exc:
            self._reply_error(call_id, req, exc)
            return
        if taken is None:
            # A retry whose answer is held is answered at once, never refused for
            # room: the refusal would settle its id at the consumer, and the
            # answer held for it would never be delivered.
            if not (req.request_id and self.s.retry.answers_at_once(req.request_id)):
                try:
                    self.s.check_room()
                except RendezvousError as exc:
                    self.s.refused(req, exc)
                    self._reply_error(call_id, req, exc)
                    return
            if type(req) is KeyRequest:  # a batch's key: it waits in the table, no task
                waiting = _Waiting(self, call_id, req)
                try:
                    key = self.s.wait(req, waiting, self)
                except RendezvousError as exc:  # its key's or its step's error, as a take raises it
                    self._reply_error(call_id, req, exc)
                    return
                if key is not None:
                    waiting.key = key
                    self.waiting[call_id] = waiting
                    return
            self.waiting[call_id] = asyncio.create_task(self._serve(call_id, req))
            if req.request_id and self.s.retry.known(req.request_id):
                self.retried[call_id] = req
        elif group is not None and self._packs(req, taken.item):
            group.append((call_id, req, taken.item, taken.key))
        else:  # produced already: answered without a task
            self._reply(call_id, req, *taken)

    def _packs(self, req: Any, item: Received) -> bool:
        """Whether ``item`` answers ``req`` inside a group reply: a batch's key
        and a small host tensor. Then its reply is planned (the timeline's
        serve span ends here)."""
        s = self.s
        if type(req) is not KeyRequest or not s.fusion_threshold or item.is_dead \
                or not groups.fusable(item.value, s.fusion_threshold):
            return False
        if s.timeline is not None:
            s.timeline.served(req, self.inline_path)
        return True

    def _reply_groups(self, members: list[tuple[int, Any, Received, str]], request: Any) -> None:
        """Answer ``members`` (ready together) with group replies of at most
        ``group_bytes`` of payload each."""
        limit = self.s.group_bytes
        start = 0
        size = 0
        for i, (_, _, item, _) in enumerate(members):
            n = item.value.nbytes + groups.ALIGN
            if i > start and size + n > limit:
                self._reply_group(members[start:i], request)
                start, size = i, 0
            size += n
        self._reply_group(members[start:], request)

    def _reply_group(self, members: list[tuple[int, Any, Received, str]], request: Any) -> None:
        """One group reply answering ``members``, which it keeps (a fresh list)."""
        arrays = [m[2][0] for m in members]
        call_ids = [m[0] for m in members]
        carry = None
        try:
            lay = groups.layout(arrays)
            path, carry = self.s.planes.plan_group(request, arrays, lay)
            options = carry.options if carry is not None else None
            # the payload inside (no options): a large one is joined by the writer, one copy
            frame = wire.frame(groups.group_parts(call_ids, None if options else arrays, lay, _now_micros(), options),
                               0 if options else lay.nbytes)
        except Exception as exc:  # answered one by one instead
            if carry is not None:
                carry.release()
            log.debug("group reply of %d tensors failed (%r); answering them one by one", len(members), exc)
            for call_id, req, item, key in members:
                self._reply(call_id, req, item, key)
            return
        self.s.stats.served(self._path(path), lay.nbytes, len(members), fused=True)
        group_id = self._group_ids
        self._group_ids -= 1
        remake = None
        if carry is not None:
            def remake(ids: list[int], lay: groups.Layout = lay, options: bytes = carry.options) -> Iterator[Any]:
                return iter((wire.frame(groups.group_parts(ids, None, lay, _now_micros(), options), 0),))
        self._ready(group_id, OutgoingReply(iter((frame,)), None, "", None,  # type: ignore[arg-type]
                                        members=members, carry=carry, remake=remake))

    def _cancel(self, call_id: int) -> None:
        """The consumer gave up on ``call_id``. What was not sent goes back to the
        table and the cancel is answered with CANCELLED; a reply already on its
        way (started, or committed: a descriptor whose transfer is posted) is
        written to its end, and the consumer keeps what it receives."""
        task = self.waiting.pop(call_id, None)
        if task is not None:
            if type(task) is _Waiting:
                task.stop()  # withdrawn from the table (or left to a retry of its id)
            else:
                task.cancel()  # its tensor, if handed over meanwhile, goes back (see _serve)
            if self.retried:
                req = self.retried.pop(call_id, None)
                if req is not None and self._cancel_retry(call_id, req):
                    return
            self._ack_cancel(call_id)
            return
        # A call answered by a group reply is not found here: the group is written
        # whole, and the consumer keeps what it brings (its call is an orphan).
        reply = self.replies.get(call_id)
        if reply is None or reply.committed or reply.started:
            return
        del self.replies[call_id]
        reply.give_back(self.s, self)
        self._ack_cancel(call_id)

    def _cancel_retry(self, call_id: int, req: Any) -> bool:
        """A call asking again with a known request_id is cancelled, possibly
        before its task ever ran (its cancel came in the same message). The
        answer held for the id was handed to a stream that broke: the consumer
        never got it. A descriptor handed over is answered anyway (its transfer
        waits for this consumer's receive; the consumer keeps what a call it
        gave up brings), True. Else the answer goes back to the table (the
        consumer is told nothing was sent and counts the id as settled: held
        here, the tensor would be lost), False."""
        handed = self.s.retry.take_resend(req.request_id)
        if handed is not None:
            self._resend(call_id, req, self.s._check_key(req), handed)
            return True
        self.s.reclaim(req)
        return False

    def _ack_cancel(self, call_id: int) -> None:
        frame = error_frame(call_id, Cancelled(f"call {call_id} cancelled by the consumer; nothing sent"))
        self._ready(call_id, OutgoingReply(iter((frame,)), None, "", None, ack=True))  # type: ignore[arg-type]

    def _done_waiting(self, call_id: int) -> None:
        # Only this call's own task: a cancelled call's task may unwind after a
        # new call reused its id.
        if self.waiting.get(call_id) is asyncio.current_task():
            del self.waiting[call_id]
            if self.retried:
                self.retried.pop(call_id, None)

    def _answered(self, call_id: int, req: Any, item: Received, key: str) -> None:
        """A batch key's tensor, produced: called inside the send that produced it
        (see _Waiting). Replied to as a ready tensor is; the small ones produced
        within one turn of the loop go out together, in group replies, at its
        end (one MPI message on the optimal path)."""
        del self.waiting[call_id]
        if self._packs(req, item):
            if not self._late:
                asyncio.get_running_loop().call_soon(self._reply_late)
            self._late.append((call_id, req, item, key))
            return
        self._reply(call_id, req, item, key, in_send=True)

    def _wait_failed(self, call_id: int, req: Any, error: RendezvousError) -> None:
        """A batch key's step ended while it waited: its error is the answer."""
        del self.waiting[call_id]
        self._reply_error(call_id, req, error)

    async def _serve(self, call_id: int, req: Asked) -> None:
        try:
            item, key = await self.s.take(req, self)
        except asyncio.CancelledError:
            self.s.reclaim(req)  # a tensor handed over just as the call was cancelled goes back
            raise
        except Exception as exc:
            self._reply_error(call_id, req, exc)
            return
        finally:
            self._done_waiting(call_id)
        if req.request_id:
            handed = self.s.retry.take_resend(req.request_id)
            if handed is not None:  # a retry of a descriptor lost with its connection
                self._resend(call_id, req, key, handed)
                return
        if self._packs(req, item):
            # A batch's key produced while it waited: the tensors produced
            # together (a send_many, a step's gradients) answer in one group
            # at the end of this turn of the loop.
            if not self._late:
                asyncio.get_running_loop().call_soon(self._reply_late)
            self._late.append((call_id, req, item, key))
            return
        self._reply(call_id, req, item, key)

    def _reply_late(self) -> None:
        """Group replies for the batches' keys produced in the last turn, one
        group per offer (the calls of one RecvMany share theirs)."""
        late, self._late = self._late, []
        by_offer: dict[tuple[str, bytes], list[tuple[int, Any, Received, str]]] = {}
        for member in late:
            opts = member[1].transport_options
            by_offer.setdefault((opts.type_url, opts.value), []).append(member)
        for members in by_offer.values():
            self._reply_groups(members, members[0][1])

    def _reply(self, call_id: int, req: Asked, item: Received, key: str,
               in_send: bool = False) -> None:
        plan = None
        try:
            plan = self.s.planes.plan(req, item)
            if plan.prepare is not None:
                self.waiting[call_id] = asyncio.create_task(self._prepared_reply(call_id, req, key, plan))
                return
            outgoing = self._outgoing(call_id, req, key, plan)
        except Exception as exc:
            if plan is not None and plan.carry is not None:
                plan.carry.release()  # its transfer never starts
            self._not_made(call_id, req, key, item, exc, in_send)
            return
        self.s.stats.served(self._path(plan.path), payload_nbytes(item.value))
        self._ready(call_id, outgoing)

    def _not_made(self, call_id: int, req: Any, key: str, item: Received, exc: BaseException,
                  in_send: bool = False) -> None:
        """The reply for ``item`` could not be made (its planning failed, a GPU
        tensor's copy to the host for one): nothing was sent, so the tensor
        goes back to the table (unless a retry of its request_id on another
        stream carries it), and the call is answered with the error. Inside
        the send that produced the tensor (``in_send``) it goes back once that
        send has returned: put back there, it would go on at once to the key's
        next waiter, whose reply may fail in turn, all within the one call."""
        if in_send:
            asyncio.get_running_loop().call_soon(put_back, self.s, req, key, item, self)
        else:
            put_back(self.s, req, key, item, self)
        self._reply_error(call_id, req, exc)

    async def _prepared_reply(self, call_id: int, req: Asked, key: str, plan: Reply) -> None:
        """A reply that needs work off the loop first (a GPU tensor copied to the host)."""
        item = plan.item
        try:
            plan = await self.s.prepared(req, plan)
            outgoing = self._outgoing(call_id, req, key, plan)
        except asyncio.CancelledError:
            if item is not None:
                put_back(self.s, req, key, item, self)  # nothing was sent: the tensor stays for a later recv
            raise
        except Exception as exc:
            if item is not None:
                self._not_made(call_id, req, key, item, exc)
            else:
                self._reply_error(call_id, req, exc)
            return
        finally:
            self._done_waiting(call_id)
        self.s.stats.served(self._path(plan.path), payload_nbytes(item.value if item is not None else None))
        self._ready(call_id, outgoing)

    def _path(self, path: Path) -> Path:
        return self.inline_path if path is Path.GRPC else path

    @staticmethod
    def _outgoing(call_id: int, req: Asked, key: str, plan: Reply) -> OutgoingReply:
        carry = plan.carry
        if carry is None:
            return OutgoingReply(plan.stream_frames(call_id), req, key, plan.item, plan.committed)
        make = plan.stream_frames
        return OutgoingReply(make(call_id), req, key, plan.item, plan.committed, carry=carry,
                         remake=lambda ids: make(ids[0]))

    def _hand_over(self, reply: OutgoingReply) -> None:
        """A descriptor leaves and its transfer is posted: a retry of its request
        ids (the connection died under it) is answered with it again."""
        handed = reply.resent
        if handed is None:
            if reply.remake is None:
                return
            if reply.members is not None:
                rids = [req.request_id for _, req, _, _ in reply.members]
            elif reply.req is not None and reply.req.request_id:
                rids = [reply.req.request_id]
            else:
                return
            handed = Handed(reply.remake, rids)
        self.s.retry.hand_over(handed)

    def _resend(self, call_id: int, req: Any, key: str, handed: Handed) -> None:
        """Answer a retry with the descriptor handed over for its request id: its
        consumer never got it, and its transfer waits for that receive. A group
        answers only this call now (the others' positions answer no call:
        their retries are answered afresh)."""
        rid = req.request_id
        at = handed.rids.index(rid)
        ids = [groups.NO_CALL + i for i in range(len(handed.rids))]
        ids[at] = call_id
        again = Handed(handed.make, [rid if i == at else 0 for i in range(len(handed.rids))])
        retry = self.s.retry
        self._ready(call_id, OutgoingReply(handed.make(ids), req, key, None, committed=True,
                                       carry=Carry(b"", _nothing, lambda: retry.restore(rid, again)),
                                       resent=again))

    def _carry_failed(self, call_id: int, reply: OutgoingReply, exc: Exception) -> None:
        """A descriptor's transfer could not start (the MPI engine is stopping):
        its tensors go back to the table, and its calls are answered with the
        error instead."""
        log.warning("a reply's transfer could not start: %s", exc)
        error = exc if isinstance(exc, RendezvousError) else Unavailable(f"transfer could not start: {exc}")
        calls = reply.members
        if not calls:
            assert reply.item is not None  # a descriptor's reply holds its tensor until it is written
            calls = [(call_id, reply.req, reply.item, reply.key)]
        for member_id, req, item, key in calls:
            put_back(self.s, req, key, item, self)
            self._reply_error(member_id, req, error)

    def _reply_error(self, call_id: int, req: Asked, exc: BaseException) -> None:
        if not isinstance(exc, RendezvousError):
            log.error("RecvTensorStream call %d failed", call_id, exc_info=exc)
        self.s.stats.error(self.inline_path)
        self._ready(call_id, OutgoingReply(iter([error_frame(call_id, exc)]), req, "", None))

    def _ready(self, call_id: int, reply: OutgoingReply) -> None:
        self.replies[call_id] = reply
        self.ready.append(call_id)
        self.wakeup.set()

    def _next_message(self) -> bytes | wire.Pieces | None:
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
            if not reply.started and reply.carry is not None:
                # its descriptor leaves now: its transfer starts (never earlier, so a
                # reply dropped unsent leaves no transfer that nothing will receive)
                try:
                    reply.carry.start()
                except Exception as exc:
                    del self.replies[call_id]
                    self._carry_failed(call_id, reply, exc)
                    continue
                reply.to(COMMIT)
                self._hand_over(reply)
            reply.to(START)
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
        return batch[0] if len(batch) == 1 else batch_responses(batch)

    async def _write(self) -> None:
        while not self.failed:
            message = self._next_message()
            if message is not None:
                self.writing = True
                if not isinstance(message, bytes) and not self.gathers:
                    message = message.join()
                try:
                    await self.context.write(message)
                finally:
                    self.writing = False
                self.flushing.clear()
                continue
            if (self.reader_done or self.closing) and not self.waiting and not self.replies and not self._late:
                return
            self.wakeup.clear()
            await self.wakeup.wait()


class _Waiting(Waiter):
    """A batch key waiting for its tensor in the table, in
    ``ProducerStream.waiting`` where a lone recv has its task: answered from
    inside the send that produces it, with no task, future or turn of the
    loop of its own, and one object for the table's queue, the stream and
    the retry cache (its :class:`~rendezvous.rpc.retry.Pending`): a process
    holding thousands of them collects its garbage less often. ``stop``: the
    consumer gave up, or the stream ended; a retry of its request_id that
    joined on another stream keeps it waiting, for that retry alone."""

    __slots__ = ("stream", "servicer", "call_id", "req", "key", "joined")

    def __init__(self, stream: ProducerStream, call_id: int, req: Any) -> None:
        super().__init__()
        self.stream: ProducerStream | None = stream
        self.servicer = stream.s
        self.call_id = call_id
        self.req = req
        self.key = ""
        self.joined: asyncio.Future | None = None  # a retry's, made when one joins

    # -- the table's calls (inside a send, or an abort, cleanup, drain or close) --

    def set_result(self, item: Received) -> None:
        self.settled = True
        stream = self.stream
        rid = self.req.request_id
        if rid:
            self.servicer.retry.answered(rid, item, stream, handed=stream is not None)
        if stream is None:
            return
        # Inside the producer's send: nothing raised here may reach it (the
        # tensor was delivered: the call gets an error instead).
        try:
            stream._answered(self.call_id, self.req, item, self.key)
        except Exception as exc:  # pragma: no cover - a defect; logged with its traceback
            log.error("answering call %d failed", self.call_id, exc_info=exc)
            stream._not_made(self.call_id, self.req, self.key, item, exc, in_send=True)

    def set_exception(self, error: BaseException) -> None:
        self.settled = True
        stream = self.stream
        rid = self.req.request_id
        if rid:
            self.servicer.retry.failed(rid, error, handed=stream is not None)
        if stream is not None:
            stream._wait_failed(self.call_id, self.req, error)  # type: ignore[arg-type]

    # -- the stream's -------------------------------------------------------------

    def stop(self) -> None:
        if not self.settled and not self.servicer.stop_waiting(self.req, self.key, self):
            self.stream = None  # a retry still waits: answered for it alone

    # -- the retry cache's (Pending) ------------------------------------------------

    def cancel(self) -> bool:
        """Nobody wants the tensor any more: the take is withdrawn."""
        withdrawn = self.servicer.table.withdraw(self.req.step_id, self.key, self)
        if self.joined is not None:
            self.joined.cancel()
        return withdrawn

    def future(self) -> asyncio.Future:
        if self.joined is None:
            self.joined = asyncio.get_running_loop().create_future()
        return self.joined

    def settle(self, item: Received | None, error: BaseException | None) -> None:
        joined = self.joined
        if joined is not None and not joined.done():
            if error is not None:
                joined.set_exception(error)
            else:
                joined.set_result(item)

    def fail(self, error: BaseException) -> None:
        """A retry of its request_id was refused (see RetryCache.withdraw): the
        take is withdrawn, and its call (if its stream still waits for it)
        and any retry that joined it are answered with ``error``."""
        self.servicer.table.withdraw(self.req.step_id, self.key, self)
        self.settle(None, error)
        stream = self.stream
        self.stream = None
        if stream is not None and stream.waiting.get(self.call_id) is self:
            stream._wait_failed(self.call_id, self.req, error)  # type: ignore[arg-type]


class _BadStream(Exception):
    pass
