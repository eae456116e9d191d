"""The consumer's end of one RecvTensor stream: :class:`ConsumerStream`.

A :class:`~rendezvous.rpc.peer.PeerClient` keeps one stream per peer (a
gRPC stream-stream call, or its MPI stand-in) and every recv is a call on
it. The stream's writer sends requests and cancels (queued ones packed into
one message); its reader matches reply frames to calls by ``call_id``,
hands each reply's first frame to the data plane it names, feeds later
chunks to the assembly that plane returned, and settles each call exactly
once: its recv gets the tensor (or the error), or, if the recv gave up, the
tensor goes to the oldest recv of the same key and step waiting on the
stream, or to the rank server to keep.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any


from rendezvous.codec import groups, parsing, tensors
from rendezvous.codec.requests import batch_requests, cancel_request, recv_many_request, recv_request
from rendezvous.errors import Cancelled, Internal, InvalidArgument, PeerUnavailable, RendezvousError, \
    ResourceExhausted, Unavailable
from rendezvous.paths import Path
from rendezvous.items import Received
from rendezvous.transport import Fetched
from rendezvous.transport.calls import EOF, CallEnded, RequestCall

from .delivery import ANSWERED, BROKE, GAVE_UP, MOVED, PendingCall, cut_off

if TYPE_CHECKING:
    from .peer import PeerClient

__all__ = ["ConsumerStream", "Broken", "Pending", "MANY_REQUEST_BYTES"]

log = logging.getLogger("rendezvous.client")
#: queued requests packed into one stream message up to about this size (a
#: request with the longest key, 16,384 characters, still fits once more): below
#: the 64 KiB that every producer's max_request_bytes allows
_BATCH_REQUEST_BYTES = 32 << 10
#: keys asked in one RecvMany up to about this many bytes: with its other
#: fields, well within one stream message of _BATCH_REQUEST_BYTES
MANY_REQUEST_BYTES = 24 << 10


_new_tuple = tuple.__new__


def _run_request(run: list[tuple[int, int, bytes, int, bytes | None]]) -> bytes:
    """The request for a run of consecutive recvs: a RecvMany, or a plain
    request for a run of one."""
    call_id, step_id, key, request_id, options = run[0]
    if len(run) == 1:
        return recv_request(call_id, step_id, key, request_id, options)
    return recv_many_request(call_id, step_id, [c[2] for c in run], [c[3] for c in run], options)


def _packs(messages: list[bytes]) -> Iterator[list[bytes]]:
    """``messages`` in order, in runs that fit one stream message of about
    ``_BATCH_REQUEST_BYTES``."""
    pack: list[bytes] = []
    size = 0
    for message in messages:
        if pack and size + len(message) > _BATCH_REQUEST_BYTES:
            yield pack
            pack, size = [], 0
        pack.append(message)
        size += len(message) + 4
    if pack:
        yield pack


def _landed(value: Any, path: Path) -> Fetched:
    """``Fetched(Received(value, False), path)``, built without the named tuples'
    argument handling: once per tensor of a group reply."""
    return _new_tuple(Fetched, (_new_tuple(Received, (value, False)), path, False))


class Broken(Exception):
    """The stream carrying a call broke; the call may be re-sent."""

    def __init__(self, error: RendezvousError) -> None:
        super().__init__(error.message)
        self.error = error


class ConsumerStream:
    """One RecvTensorStream call and its reader and writer tasks."""

    def __init__(self, client: "PeerClient", call: RequestCall) -> None:
        self.inline_path = call.inline_path  # how frames travel: the path of a tensor inside them
        self.client = client
        self.call = call
        self.pending: dict[int, PendingCall] = {}
        #: calls whose bytes are on their way another way (an MPI transfer posted)
        self.moving: dict[int, PendingCall] = {}
        self.outbox: asyncio.Queue[bytes] = asyncio.Queue()
        #: recvs (and cancels, as their frames) asked in this turn of the loop,
        #: not sent yet (see submit and _flush)
        self._coalescing: list[tuple[int, int, bytes, int, bytes | None] | bytes] = []
        #: the waiting calls by (step_id, key), oldest first, for an orphan's
        #: tensor to find its taker (see _waiting_for); None until one needs it,
        #: and again once a call is added
        self._by_key: dict[tuple[int, str], collections.deque[int]] | None = None
        self.alive = True
        #: the error a lie found outside the reader (a group's fusion buffer that
        #: cannot be read as it says) ended the stream with: see _fail
        self._failed: RendezvousError | None = None
        #: the call's non-waiting write (MPI): a request with nothing queued
        #: before it is handed over at once, not on the writer's next turn
        self._write_now = call.write_nowait
        self.reader = asyncio.create_task(self._read())
        self.writer = asyncio.create_task(self._write())
        deliver_to = call.deliver_to
        if deliver_to is not None:  # replies dispatched as they arrive (MPI), see _arrived
            deliver_to(self._arrived)

    def submit(self, call_id: int, pending: PendingCall, step_id: int, key: bytes, request_id: int,
               options: bytes | None) -> None:
        """One recv's request. The recvs submitted in one turn of the loop (an
        ``asyncio.gather`` of recvs, a daemon's batch of local recvs) leave
        together at its end, as RecvMany requests of consecutive calls: the
        producer answers the small tensors among them with group replies."""
        self.pending[call_id] = pending
        self._by_key = None
        if not self._coalescing:
            asyncio.get_running_loop().call_soon(self._flush)
        self._coalescing.append((call_id, step_id, key, request_id, options))

    def submit_many(self, first: int, pendings: Sequence[PendingCall], request: bytes) -> None:
        """The calls ``first`` .. ``first + len(pendings) - 1`` of one RecvMany."""
        self._flush()  # requests leave in the order they were made
        self.pending.update(zip(range(first, first + len(pendings)), pendings))
        self._by_key = None
        self._send(request)

    def _send(self, message: bytes) -> None:
        """Queue ``message`` for the writer, or hand it to a call that takes messages without
        waiting (MPI) when none is queued before it: in order, one loop turn sooner."""
        if self._write_now is not None and self.outbox.empty() and self._write_now(message):
            return
        self.outbox.put_nowait(message)

    def _flush(self) -> None:
        """Send what was asked since the last flush (the end of the turn it was
        asked in): runs of consecutive recvs of one step (and one offer) as one
        RecvMany each, up to ``MANY_REQUEST_BYTES`` of keys, a run of one as a
        plain request, and the cancels in between, in order; all of it in as
        few stream messages as ``_BATCH_REQUEST_BYTES`` allows (one MPI message
        each on the MPI request path: a burst of timed-out recvs and their
        cancels is a few messages, not one each)."""
        queued, self._coalescing = self._coalescing, []
        if not queued:
            return
        messages: list[bytes] = []
        run: list[tuple[int, int, bytes, int, bytes | None]] = []
        size = 0
        for item in queued:
            if isinstance(item, bytes):  # a cancel or a release: after the requests before it
                if run:
                    messages.append(_run_request(run))
                    run = []
                messages.append(item)
                continue
            if run:
                last = run[-1]
                if item[0] == last[0] + 1 and item[1] == last[1] and item[4] == last[4] and size < MANY_REQUEST_BYTES:
                    run.append(item)
                    size += len(item[2]) + 12
                    continue
                messages.append(_run_request(run))
            run = [item]
            size = len(item[2])
        if run:
            messages.append(_run_request(run))
        # Handed to the call at once, packed, when it takes messages without waiting
        # (MPI) and nothing is queued before them; the rest is queued one by one for
        # the writer, which packs what it finds (never a packed message in another).
        sent = 0
        if self._write_now is not None and self.outbox.empty():
            for pack in _packs(messages):
                if not self._write_now(pack[0] if len(pack) == 1 else batch_requests(pack)):
                    break
                sent += len(pack)
        for message in messages[sent:]:
            self.outbox.put_nowait(message)

    def cancel(self, call_id: int, p: PendingCall) -> bool:
        """The recv of ``call_id`` (``p``) gave up. True when this stream settles
        the call: its answer is already in (the tensor went to another recv or to
        the server), its bytes are on their way (kept when they land), or the
        call stays as an orphan until the producer answers the cancel: with
        CANCELLED (nothing was sent), or with the reply it had already started,
        which is received and kept, never dropped. False when the stream broke
        before the producer answered: nobody knows whether it took the tensor."""
        if p.settled:
            return True
        if self.moving.get(call_id) is p:  # its bytes are on their way: they are kept when they land
            p.to(GAVE_UP)
            return True
        if self.pending.get(call_id) is not p:
            return False  # the stream broke and dropped it, unanswered
        if not self.alive:
            del self.pending[call_id]
            p.to(BROKE)
            return False
        p.to(GAVE_UP)
        self.send(cancel_request(call_id))  # after its request: a cancel never overtakes it
        return True

    def send(self, message: bytes) -> None:
        """A cancel or an IPC release, at the end of the turn, after what was asked before."""
        if not self._coalescing:
            asyncio.get_running_loop().call_soon(self._flush)
        self._coalescing.append(message)

    async def _write(self) -> None:
        outbox = self.outbox
        try:
            while True:
                first = await outbox.get()
                if outbox.empty():
                    await self.call.write(first)
                    continue
                # Everything queued while the last write was in flight goes as one
                # message, up to a size every producer accepts (max_request_bytes >= 64 KiB).
                queued, size = [first], len(first)
                while not outbox.empty() and size < _BATCH_REQUEST_BYTES:
                    queued.append(outbox.get_nowait())
                    size += len(queued[-1]) + 4
                await self.call.write(batch_requests(queued))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the reader sees the status; just stop
            log.debug("stream writer to %s stopped: %r", self.client.task, exc)

    async def _read(self) -> None:
        error: RendezvousError = PeerUnavailable(f"stream to {self.client.describe()} closed")
        closed_here = False  # (cancelled here: closed locally)
        try:
            while True:
                buf = await self.call.read()
                if buf is EOF:
                    break
                self._dispatch(buf)
        except CallEnded as ended:
            error = _status_error(ended.error, self.client)
        except asyncio.CancelledError:
            error = PeerUnavailable(f"stream to {self.client.describe()} was closed locally")
            closed_here = True
        except Exception as exc:  # a frame we cannot parse or that lies: the peer is broken
            why = exc.message if isinstance(exc, RendezvousError) else f"{type(exc).__name__}: {exc}"
            error = Internal(f"malformed reply from {self.client.describe()}: {why}")
            self.call.cancel()  # the producer ends its side: replies not written go back
        finally:
            if self._failed is not None:  # ended by _fail: its calls fail with its error
                error, closed_here = self._failed, False
            self.alive = False
            self.writer.cancel()
            broken = Broken(error)
            if self.moving:
                # Their bytes travel outside this stream (MPI) and are received
                # whenever they come; they are never asked again (a second
                # transfer would bring them twice). A producer that stops cleanly
                # ends its stream once its sends are done, so they land moments
                # later: the recvs wait for them for the reconnect window (within
                # their own deadlines), then fail, and what lands after that is
                # kept for the next recv of its key.
                cut = list(self.moving.items())
                if closed_here:
                    cut_off(self.moving, cut, error)
                else:
                    window = self.client.config.reconnect_window
                    asyncio.get_running_loop().call_later(window, cut_off, self.moving, cut, error, window)
            for p in self.pending.values():
                if p.orphan:  # its cancel may never have reached the producer
                    self.client.in_doubt.add(p.step_id, p.key, p.request_id)
                p.to(BROKE)
                if not p.future.done():
                    p.future.set_exception(broken)
            self.pending.clear()

    def _fail(self, error: RendezvousError) -> None:
        """End the stream from outside its reader (a lie found in a callback):
        the producer's side is cancelled (replies not written go back to its
        table) and every call still on the stream fails with ``error``, as the
        reader fails them for a malformed frame."""
        if self._failed is None and self.alive:
            self._failed = error
            self.alive = False  # nothing more is asked or read on it
            self.call.cancel()
            self.reader.cancel()

    def _arrived(self, buf: Any) -> bool:
        """A message of the stream, handed over as it arrives (by the MPI call,
        when none is queued before it): dispatched here, with no turn of the
        reader in between. False if the stream has ended (the call keeps it, as
        it keeps a message nobody reads); an error raised here ends the stream
        as the reader would (the call hands the reader the error to raise)."""
        if not self.alive:
            return False
        self._dispatch(buf)
        return True

    def _dispatch(self, buf: bytes) -> None:
        for frame in parsing.iter_stream_frames(buf):
            self._dispatch_frame(buf, frame)

    def _dispatch_group(self, buf: bytes, span: tuple[int, int]) -> None:
        """A group reply: many calls answered at once, their tensors views on one
        buffer (the frame's bytes, or a fusion buffer that comes by MPI). A
        malformed group breaks the stream with INTERNAL (InvalidArgument from
        the parse: which calls it answers cannot be known), before anything
        is allocated or posted."""
        group = groups.parse_group(buf, *span, self.client.config.max_tensor_bytes)
        pending = self.pending
        planes = self.client.planes
        if group.payload is not None:
            values = groups.views(group, buf, group.payload[0])
            path = self.inline_path
            if planes.traced:
                planes.answered([p.placement for p in map(pending.get, group.call_ids)
                                 if p is not None and not p.orphan], False)
            pop = pending.pop
            new = _new_tuple
            for call_id, value in zip(group.call_ids, values):
                p = pop(call_id, None)
                if p is None:
                    continue
                future = p.future
                # _landed(value, path), inlined: once per tensor
                fetched = new(Fetched, (new(Received, (value, False)), path, False))
                if not p.orphan and not future.done():  # _deliver's common case, inlined
                    p.to(ANSWERED)
                    future.set_result(fetched)
                else:
                    self._deliver(p, fetched)
            return
        path, landing = planes.receive_group(buf, group)  # posted even if nobody waits: its bytes are on the way
        moving: list[tuple[int, int, PendingCall]] = []
        on_the_way = self.moving
        for i, call_id in enumerate(group.call_ids):
            p = pending.pop(call_id, None)
            if p is not None:
                on_the_way[call_id] = p
                p.to(MOVED)
                p.path = path
                moving.append((i, call_id, p))
        if planes.traced:
            planes.answered([p.placement for _, _, p in moving if not p.orphan], True)
        landing.add_done_callback(lambda f: self._settle_group(group, moving, f, path))

    def _settle_group(self, group: groups.Group, moving: list[tuple[int, int, PendingCall]],
                      landed: asyncio.Future, path: Path) -> None:
        """A group's fusion buffer is here (or failed): each call takes its view."""
        on_the_way = self.moving
        if landed.cancelled() or landed.exception() is not None:
            for _, call_id, p in moving:
                if on_the_way.get(call_id) is p:
                    del on_the_way[call_id]
                p.to(ANSWERED)
                if landed.cancelled():
                    if not p.future.done():
                        p.future.cancel()
                elif not p.orphan and not p.future.done():
                    p.future.set_exception(landed.exception())  # type: ignore[arg-type]
            return
        try:
            values = groups.views(group, landed.result())
        except Exception as exc:  # the buffer is not what the group said: the peer lies
            error = Internal(f"malformed reply from {self.client.describe()}: its fusion buffer does not hold "
                             f"the group it announced ({type(exc).__name__}: {exc})")
            for _, call_id, p in moving:
                if on_the_way.get(call_id) is p:
                    del on_the_way[call_id]
                p.to(ANSWERED)
                if not p.orphan and not p.future.done():
                    p.future.set_exception(error)
            self._fail(error)
            return
        for i, call_id, p in moving:
            if on_the_way.get(call_id) is p:
                del on_the_way[call_id]
            future = p.future
            if not p.orphan and not future.done():
                p.to(ANSWERED)
                future.set_result(_landed(values[i], path))
            else:
                self._deliver(p, _landed(values[i], path))

    def _dispatch_frame(self, buf: bytes, frame: parsing.StreamFrame) -> None:
        if frame.group is not None:
            self._dispatch_group(buf, frame.group)
            return
        p = self.pending.get(frame.call_id)
        planes = self.client.planes
        if p is None:
            # Cancelled or timed out: drop the rest of its reply. A plane whose
            # bytes are already on their way takes them (drain).
            if frame.head is not None and not frame.head.is_dead:
                planes.drain(buf, frame.head)
            return
        if frame.error is not None:  # the producer's answer: an error (or CANCELLED for an orphan)
            self.pending.pop(frame.call_id, None)
            p.to(ANSWERED)
            if not p.future.done():
                p.future.set_exception(frame.error)
            return
        try:
            if frame.head is not None:
                head = frame.head
                if head.tensor is not None:
                    head.decoded = _check_announced(buf, head.tensor, self.client)
                if head.is_dead:
                    self._finish(frame.call_id, p, Fetched(Received(None, True), self.inline_path))
                    return
                # an orphan's bytes land on the host: whoever takes it places it
                arrival = planes.receive(buf, head, None if p.orphan else p.placement)
                p.path = self.inline_path if arrival.path is Path.GRPC else arrival.path
                if arrival.pending is not None:
                    self.pending.pop(frame.call_id, None)
                    self.moving[frame.call_id] = p
                    p.to(MOVED)
                    task = asyncio.ensure_future(arrival.pending)
                    task.add_done_callback(functools.partial(self._settle, frame.call_id, p,
                                                             path=arrival.path, placed=arrival.placed))
                elif arrival.assembly is not None:
                    p.assembly = arrival.assembly
                else:
                    self._finish(frame.call_id, p, Fetched(Received(arrival.value, False), p.path,
                                                           arrival.placed))
            elif frame.chunk is not None:
                if p.assembly is None:
                    raise Internal("chunk arrived before its reply's header")
                a, b = frame.chunk
                if p.assembly.add(memoryview(buf)[a:b]):
                    self._finish(frame.call_id, p, Fetched(Received(p.assembly.result(), False), p.path))
        except MemoryError:
            # under max_tensor_bytes but more than this process can hold: that recv
            # fails; the stream and every other recv on it go on
            self.pending.pop(frame.call_id, None)
            p.to(ANSWERED)
            if not p.future.done():
                p.future.set_exception(ResourceExhausted(
                    f"out of memory for the tensor {self.client.describe()} announced for {p.key!r}"))
        except RendezvousError as exc:
            self.pending.pop(frame.call_id, None)
            p.to(ANSWERED)
            if isinstance(exc, InvalidArgument):  # the reply, not the request, is wrong
                exc = Internal(f"malformed reply from {self.client.describe()}: {exc.message}")
            if not p.future.done():
                p.future.set_exception(exc)

    def _finish(self, call_id: int, p: PendingCall, fetched: Fetched) -> None:
        self.pending.pop(call_id, None)
        self._deliver(p, fetched)

    def _deliver(self, p: PendingCall, fetched: Fetched) -> None:
        p.to(ANSWERED)
        if not p.orphan and not p.future.done():
            p.future.set_result(fetched)
            return
        # Its recv gave up, but the tensor was produced and is here: the oldest
        # recv of the same key and step still waiting on this stream takes it
        # (its own request is cancelled, and whatever answers that becomes an
        # orphan in turn), else the server keeps it for the next recv.
        # (After a break that is the client's new stream: the recv asked again.)
        kept = Fetched(fetched.item, fetched.path, placed=False)
        stream = self if self.alive else self.client.live_stream()
        taker = stream._waiting_for(p.step_id, p.key) if stream is not None else None
        if taker is not None:
            call_id, other = taker
            other.future.set_result(kept)
            stream.cancel(call_id, other)  # type: ignore[union-attr]
            return
        self.client.unclaimed(p.step_id, p.key, kept)

    def _waiting_for(self, step_id: int, key: str) -> tuple[int, PendingCall] | None:
        """The oldest call of ``key`` in ``step_id`` still waiting on this
        stream, taken out of the index (it is about to be answered), or None.
        The index is made from ``pending`` when first asked, and again once a
        call was added; calls answered or given up since are skipped as they
        come up. A timed-out batch whose thousands of replies come in as
        orphans, its keys asked again meanwhile, finds each taker at once,
        not by a pass over every waiting call."""
        index = self._by_key
        if index is None:
            index = self._by_key = {}
            for call_id, p in self.pending.items():
                if not p.orphan and not p.future.done():
                    queue = index.get((p.step_id, p.key))
                    if queue is None:
                        queue = index[(p.step_id, p.key)] = collections.deque()
                    queue.append(call_id)
        queue = index.get((step_id, key))
        pending = self.pending
        while queue:
            call_id = queue.popleft()
            waiting = pending.get(call_id)
            if waiting is not None and not waiting.orphan and not waiting.future.done():
                return call_id, waiting
        return None

    def _settle(self, call_id: int, p: PendingCall, task: asyncio.Future, path: Path, placed: bool) -> None:
        """A reply whose bytes came another way (a plane's pending transfer) is done."""
        if self.moving.get(call_id) is p:
            del self.moving[call_id]
        failed = None if task.cancelled() else task.exception()
        if task.cancelled():
            p.to(ANSWERED)
            if not p.future.done():
                p.future.cancel()
        elif failed is not None:
            p.to(ANSWERED)
            if not p.orphan and not p.future.done():
                p.future.set_exception(failed)
        else:
            self._deliver(p, Fetched(Received(task.result(), False), path, placed))

    def close(self) -> None:
        self.alive = False
        self.call.cancel()
        if self.moving:  # closed here: no recv waits for bytes that have not landed
            cut_off(self.moving, list(self.moving.items()),
                    PeerUnavailable(f"stream to {self.client.describe()} was closed locally"))


def _check_announced(buf: bytes, span: tuple[int, int], client: "PeerClient") -> tuple[Any, int, int]:
    """Refuse a reply announcing more bytes than ``max_tensor_bytes``, before
    anything is allocated for it (a chunk buffer, an MPI receive). Returns
    what ``decode_meta`` said, so the reply is not parsed again."""
    decoded = tensors.decode_meta(buf, *span)
    meta = decoded[0]
    limit = client.config.max_tensor_bytes
    size = math.prod(meta.shape) * meta.dtype.itemsize  # strings: their object array
    if size > limit:
        raise ResourceExhausted(f"{client.describe()} announced a tensor of {size} bytes "
                                f"(dtype {meta.dtype}, shape {meta.shape}); the limit is {limit} (max_tensor_bytes)")
    return decoded


def _status_error(exc: RendezvousError, client: "PeerClient") -> RendezvousError:
    """The error a stream's final status means for the recvs still on it. Our
    servicer ends a stream with OK or INVALID_ARGUMENT (per-call errors travel
    as error frames), so INTERNAL there is gRPC's own report of a transport torn
    down under it (a peer killed mid-reply: "Internal error from Core"): the
    peer is gone, as with UNAVAILABLE, and the recvs may be re-sent."""
    if isinstance(exc, (Unavailable, Cancelled, Internal)):
        return PeerUnavailable(f"lost {client.describe()}: {exc.message}")
    return exc
