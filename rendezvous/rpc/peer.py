"""RecvFromRemoteAsync: the consumer's client for one remote task.

Each remote task gets one channel and one long-lived ``RecvTensorStream``,
created lazily inside the running event loop. Every recv is a call on that
stream with its own ``call_id``; replies come back interleaved and are matched
by id. This is how thousands of recvs can be outstanding at once: they are
messages on one HTTP/2 stream, not thousands of gRPC calls.

Deadlines are per recv. A recv that times out or is cancelled sends a cancel
for its call and fails, but nothing it asked for is lost: if the producer had
not started the reply, the tensor stays in the producer's table (the producer
answers the cancel with CANCELLED); if the reply was already on its way, the
call is kept as an *orphan* whose reply is still received, then handed to
the oldest recv of the same key and step still waiting on this stream, or
else to ``on_unclaimed`` (the rank server keeps it for the next recv). Each recv carries a random non-zero
``request_id``; when the stream breaks (the peer restarted its listener, a
connection reset) pending recvs are re-sent on a new stream with the same
id, and the producer answers them from its retry cache instead of consuming
another tensor.

A peer that goes silent (a pulled cable, a dead host) is noticed by the
keepalive; a channel that was up and is not gets one reconnect window (the
keepalive bound) before its recvs fail with UNAVAILABLE. A recv that ended
unanswered on a stream that broke leaves its request_id behind for the next
recv of the same key and step (the producer may have written the tensor
into the dead connection: its retry cache answers the id again), and a recv
whose bytes were already moving outside the stream (MPI) fails with the
stream and its tensor is kept when it lands.

What a request offers and how a reply's bytes are received is the server's
data planes' business (:class:`rendezvous.transport.Planes`): the stream
reader hands each reply's first frame to the plane it names and feeds later
chunks to the assembly the plane returned.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import secrets
from collections.abc import Callable
from typing import Any

import grpc

from rendezvous import frames
from rendezvous.cluster import parse_address
from rendezvous.config import Config
from rendezvous.errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    PeerUnavailable,
    RendezvousError,
    ResourceExhausted,
    from_status,
)
from rendezvous.keys import TaskName
from rendezvous.table import Received
from rendezvous.tensors import decode_meta
from rendezvous.transport import Fetched, Path, Planes

from .options import STREAM_METHOD, peer_channel_options

__all__ = ["PeerClient"]

log = logging.getLogger("rendezvous.client")

#: recvs per peer whose request_id is kept after they ended unanswered on a broken stream
_UNSETTLED = 4096
#: queued requests packed into one stream message up to about this size (a
#: request with the longest key, 16,384 characters, still fits once more): below
#: the 64 KiB that every producer's max_request_bytes allows
_BATCH_REQUEST_BYTES = 32 << 10


class _Broken(Exception):
    """The stream carrying a call broke; the call may be re-sent."""

    def __init__(self, error: RendezvousError) -> None:
        super().__init__(error.message)
        self.error = error


class _Pending:
    __slots__ = ("future", "assembly", "path", "key", "step_id", "placement", "orphan", "request_id",
                 "settled")

    def __init__(self, future: asyncio.Future, key: str, step_id: int, placement: Any = None,
                 request_id: int = 0) -> None:
        self.future = future  # resolves to a Fetched
        self.request_id = request_id
        self.assembly: Any = None  # a reply being assembled from chunk frames
        self.path = Path.GRPC
        self.key = key
        self.step_id = step_id
        self.placement = placement  # where the tensor should land
        self.orphan = False  # its recv gave up; the reply, if one comes, is still taken
        #: the producer's answer is in: a tensor (delivered to this recv, handed to
        #: another, or kept by the server) or an error. Nothing is left to settle;
        #: in particular its request_id must never be asked again (that would be
        #: answered from the producer's retry cache with the same tensor).
        self.settled = False


class _Stream:
    """One RecvTensorStream call and its reader and writer tasks."""

    def __init__(self, client: "PeerClient", call: Any, inline_path: Path = Path.GRPC) -> None:
        self.inline_path = inline_path  # how frames travel: the path of a tensor inside them
        self.client = client
        self.call = call
        self.pending: dict[int, _Pending] = {}
        #: calls whose bytes are on their way another way (an MPI transfer posted)
        self.moving: dict[int, _Pending] = {}
        self.outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.alive = True
        self.reader = asyncio.create_task(self._read())
        self.writer = asyncio.create_task(self._write())

    def submit(self, call_id: int, pending: _Pending, request: bytes) -> None:
        self.pending[call_id] = pending
        self.outbox.put_nowait(request)

    def cancel(self, call_id: int, p: _Pending) -> bool:
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
            p.orphan = True
            return True
        if self.pending.get(call_id) is not p:
            return False  # the stream broke and dropped it, unanswered
        if not self.alive:
            del self.pending[call_id]
            return False
        p.orphan = True
        self.outbox.put_nowait(frames.cancel_request(call_id))
        return True

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
                queued = [first]
                size = len(first)
                while not outbox.empty() and size < _BATCH_REQUEST_BYTES:
                    queued.append(outbox.get_nowait())
                    size += len(queued[-1]) + 4
                await self.call.write(frames.batch_requests(queued))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the reader sees the status; just stop
            log.debug("stream writer to %s stopped: %r", self.client.task, exc)

    async def _read(self) -> None:
        error: RendezvousError = PeerUnavailable(f"stream to {self.client.describe()} closed")
        try:
            while True:
                buf = await self.call.read()
                if buf is grpc.aio.EOF:
                    break
                self._dispatch(buf)
        except grpc.aio.AioRpcError as exc:
            error = _status_error(exc, self.client)
        except asyncio.CancelledError:
            error = PeerUnavailable(f"stream to {self.client.describe()} was closed locally")
        except RendezvousError as exc:  # a frame we cannot parse: the peer is broken
            error = Internal(f"malformed reply from {self.client.describe()}: {exc.message}")
            self.call.cancel()
        finally:
            self.alive = False
            self.writer.cancel()
            broken = _Broken(error)
            for p in self.moving.values():
                # Its bytes travel outside this stream (MPI) and are received
                # whenever they come, then kept for the next recv: the recv fails
                # now, within the keepalive bound, and is not re-sent.
                p.orphan = True
                if not p.future.done():
                    p.future.set_exception(PeerUnavailable(
                        f"{error.message}; the tensor for {p.key!r} was on its way outside the stream "
                        "and is kept for the next recv of its key when it lands"))
            for p in self.pending.values():
                if p.orphan:  # its cancel may never have reached the producer
                    self.client.unsettled(p.step_id, p.key, p.request_id)
                if not p.future.done():
                    p.future.set_exception(broken)
            self.pending.clear()

    def _dispatch(self, buf: bytes) -> None:
        for frame in frames.iter_stream_frames(buf):
            self._dispatch_frame(buf, frame)

    def _dispatch_frame(self, buf: bytes, frame: frames.StreamFrame) -> None:
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
            p.settled = True
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
                    task = asyncio.ensure_future(arrival.pending)
                    task.add_done_callback(lambda t, c=frame.call_id, p=p, a=arrival:
                                           self._settle(c, p, t, a.path, a.placed))
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
            p.settled = True
            if not p.future.done():
                p.future.set_exception(ResourceExhausted(
                    f"out of memory for the tensor {self.client.describe()} announced for {p.key!r}"))
        except RendezvousError as exc:
            self.pending.pop(frame.call_id, None)
            p.settled = True
            if isinstance(exc, InvalidArgument):  # the reply, not the request, is wrong
                exc = Internal(f"malformed reply from {self.client.describe()}: {exc.message}")
            if not p.future.done():
                p.future.set_exception(exc)

    def _finish(self, call_id: int, p: _Pending, fetched: Fetched) -> None:
        self.pending.pop(call_id, None)
        self._deliver(p, fetched)

    def _deliver(self, p: _Pending, fetched: Fetched) -> None:
        p.settled = True
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
        for call_id, other in (stream.pending.items() if stream is not None else ()):
            if (not other.orphan and other.key == p.key and other.step_id == p.step_id
                    and not other.future.done()):
                other.future.set_result(kept)
                stream.cancel(call_id, other)  # type: ignore[union-attr]
                return
        self.client.unclaimed(p.step_id, p.key, kept)

    def _settle(self, call_id: int, p: _Pending, task: asyncio.Future, path: Path, placed: bool) -> None:
        """A reply whose bytes came another way (a plane's pending transfer) is done."""
        if self.moving.get(call_id) is p:
            del self.moving[call_id]
        p.settled = True
        if task.cancelled():
            if not p.future.done():
                p.future.cancel()
        elif task.exception() is not None:
            if not p.orphan and not p.future.done():
                p.future.set_exception(task.exception())
        else:
            self._deliver(p, Fetched(Received(task.result(), False), path, placed))

    def close(self) -> None:
        self.alive = False
        self.call.cancel()


def _check_announced(buf: bytes, span: tuple[int, int], client: "PeerClient") -> tuple[Any, int, int]:
    """Refuse a reply announcing more bytes than ``max_tensor_bytes``, before
    anything is allocated for it (a chunk buffer, an MPI receive). Returns
    what ``decode_meta`` said, so the reply is not parsed again."""
    decoded = decode_meta(buf, *span)
    meta = decoded[0]
    limit = client.config.max_tensor_bytes
    size = math.prod(meta.shape) * meta.dtype.itemsize  # strings: their object array
    if size > limit:
        raise ResourceExhausted(f"{client.describe()} announced a tensor of {size} bytes "
                                f"(dtype {meta.dtype}, shape {meta.shape}); the limit is {limit} (max_tensor_bytes)")
    return decoded


def _status_error(exc: grpc.aio.AioRpcError, client: "PeerClient") -> RendezvousError:
    """The error a stream's final status means for the recvs still on it. Our
    servicer ends a stream with OK or INVALID_ARGUMENT (per-call errors travel
    as error frames), so INTERNAL there is gRPC's own report of a transport torn
    down under it (a peer killed mid-reply: "Internal error from Core"): the
    peer is gone, as with UNAVAILABLE, and the recvs may be re-sent."""
    code = exc.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL):
        return PeerUnavailable(f"lost {client.describe()}: {exc.details()}")
    return from_status(code, exc.details() or "")


class PeerClient:
    """Recvs from one remote task. Create and use inside one running loop."""

    def __init__(self, task: TaskName, address: str, config: Config, *, planes: Planes,
                 credentials: grpc.ChannelCredentials | None = None,
                 metadata: tuple[tuple[str, str], ...] = (),
                 on_unclaimed: Callable[[int, str, Fetched], None] | None = None,
                 open_call: Callable[[], Any] | None = None) -> None:
        self.task = task
        self.address = address
        self.config = config
        self.planes = planes
        #: where a reply nobody waits for any more goes (the rank server keeps it)
        self._on_unclaimed = on_unclaimed
        #: opens the stream another way than gRPC (the MPI request path): a call
        #: with the stream-stream call's write, read and cancel
        self._open_call = open_call
        self._credentials = credentials
        self._metadata = metadata or None  # sent on every stream (the daemon's token)
        self._channel: grpc.aio.Channel | None = None
        self._stream: _Stream | None = None
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)
        # Unique per recv (a retry reuses its own); a random start keeps clients apart
        # in the producer's retry cache without a random draw per recv.
        self._request_ids = itertools.count(secrets.randbits(62) + 1)
        self._connected_once = False
        self._closed = False
        #: (step_id, key) -> request_id of recvs that ended without the producer's
        #: answer while their stream broke (see unsettled)
        self._unsettled: collections.OrderedDict[tuple[int, str], int] = collections.OrderedDict()

    def describe(self) -> str:
        return f"task {self.task} at {self.address}"

    def _channel_options(self) -> list[tuple[str, Any]]:
        return peer_channel_options(self.config.keepalive_time, self.config.keepalive_timeout)

    def live_stream(self) -> _Stream | None:
        stream = self._stream
        return stream if stream is not None and stream.alive else None

    def unsettled(self, step_id: int, key: str, request_id: int) -> None:
        """A recv of ``key`` ended without the producer's answer, and the stream it
        was asked on broke (a pulled cable, a peer that went silent): the producer
        may have taken the tensor for it and written it into the dead connection.
        The next recv of the same key and step asks again with the same
        request_id, so the producer answers it from its retry cache (or, if it
        put the tensor back, from its table): the tensor is neither lost nor
        taken twice. Remembered for the last ``_UNSETTLED`` such recvs."""
        self._unsettled[(step_id, key)] = request_id
        self._unsettled.move_to_end((step_id, key))
        while len(self._unsettled) > _UNSETTLED:
            self._unsettled.popitem(last=False)

    def unclaimed(self, step_id: int, key: str, fetched: Fetched) -> None:
        """A tensor that arrived for a recv that had given up."""
        if self._on_unclaimed is not None:
            self._on_unclaimed(step_id, key, fetched)
        else:
            log.warning("recv of %r (step %d) from %s gave up before its tensor arrived; dropped "
                        "(no server to keep it)", key, step_id, self.describe())

    async def recv(self, key: str, step_id: int, timeout: float | None = None,
                   placement: Any = None) -> Fetched:
        """Fetch ``key`` of ``step_id`` from the peer.

        ``placement`` (where the recv wants the tensor) goes to the planes: with
        the request's offer, and with the reply; ``Fetched.placed`` says whether
        the tensor already landed there."""
        loop = asyncio.get_running_loop()
        options = self.planes.offer(placement)
        deadline = None if timeout is None else loop.time() + timeout
        key_bytes = key.encode()
        # A recv of this key that ended unanswered on a broken stream asked with
        # this id: ask again with it (see unsettled).
        request_id = self._unsettled.pop((step_id, key), None) or next(self._request_ids)
        attempts = 0
        asked = False  # sent, and not answered by the producer (a tensor or its error)
        orphaned = False  # given up with its cancel on a live stream: the stream settles it
        try:
            async with asyncio.timeout_at(deadline):
                while True:
                    stream = await self._get_stream(deadline)
                    call_id = next(self._ids)
                    pending = _Pending(loop.create_future(), key, step_id, placement, request_id)
                    stream.submit(call_id, pending, frames.recv_request(
                        call_id, step_id, key_bytes, request_id, options))
                    asked = True
                    try:
                        return await pending.future
                    except _Broken as broken:
                        attempts += 1
                        if attempts > self.config.reconnect_attempts or not isinstance(broken.error, PeerUnavailable):
                            raise broken.error from None
                        log.info("re-sending recv of %s to %s (attempt %d)", key, self.describe(), attempts)
                        await asyncio.sleep(min(1.0, 0.05 * 2 ** attempts))  # a restarting peer gets a moment
                    except BaseException:
                        fut = pending.future
                        if fut.done() and not fut.cancelled() and not isinstance(fut.exception(), _Broken):
                            asked = False  # the producer answered
                            if fut.exception() is None:
                                # The tensor arrived in the same turn as the deadline (or the
                                # cancel): this recv gives up, but the tensor is kept.
                                self.unclaimed(step_id, key, fut.result())
                        else:
                            orphaned = stream.cancel(call_id, pending)
                        raise
        except BaseException as exc:
            if asked and not orphaned:
                self.unsettled(step_id, key, request_id)
            if isinstance(exc, TimeoutError):
                raise DeadlineExceeded(
                    f"recv of {key!r} (step {step_id}) from {self.describe()} timed out after {timeout:g}s") from None
            raise

    async def _get_stream(self, deadline: float | None) -> _Stream:
        stream = self._stream
        if stream is not None and stream.alive:
            return stream
        async with self._lock:
            if self._stream is not None and self._stream.alive:
                return self._stream
            if self._closed:
                raise PeerUnavailable(f"client for {self.describe()} is closed")
            if self._open_call is not None:
                call = self._open_call()
                self._stream = _Stream(self, call, Path.MPI)
                watch = getattr(call, "watch", None)
                if watch is not None:  # the call polls while recvs await replies
                    watch(self._stream.pending)
                return self._stream
            if self._channel is None:
                if self._credentials is not None:
                    self._channel = grpc.aio.secure_channel(self.address, self._credentials,
                                                            options=self._channel_options())
                else:
                    self._channel = grpc.aio.insecure_channel(self.address, options=self._channel_options())
            first = not self._connected_once
            if first:
                loop = asyncio.get_running_loop()
                limit = self.config.connect_timeout
                if deadline is not None:
                    limit = min(limit, max(0.0, deadline - loop.time()))
                try:
                    await asyncio.wait_for(self._channel.channel_ready(), limit)
                except TimeoutError:
                    if deadline is not None and loop.time() >= deadline:
                        raise  # the recv's own deadline: DeadlineExceeded upstream
                    raise PeerUnavailable(
                        f"could not connect to {self.describe()} within {limit:g}s") from None
                self._connected_once = True
            else:
                await self._reconnect(deadline)
            call = self._channel.stream_stream(STREAM_METHOD, request_serializer=None,
                                               response_deserializer=None)(
                                               metadata=self._metadata, wait_for_ready=first)
            self._stream = _Stream(self, call)
            return self._stream

    async def _reconnect(self, deadline: float | None) -> None:
        """The connection was up once: make sure it is up now. A lost one gets
        the reconnect window (the keepalive bound), and a probe tells a gone
        peer from a silent one: a refused connection (the peer's process is
        gone, its host up) fails at once, one into a partition (nobody answers,
        or no route yet) when the window ends, and one that is answered (a cable plugged in
        again, a peer restarted) waits for gRPC's channel to reconnect and
        serves the recv. PeerUnavailable when it fails."""
        channel = self._channel
        assert channel is not None
        if channel.get_state(try_to_connect=True) is grpc.ChannelConnectivity.READY:
            return
        loop = asyncio.get_running_loop()
        window = self.config.reconnect_window
        limit = window if deadline is None else min(window, max(0.0, deadline - loop.time()))
        try:
            async with asyncio.timeout(limit):
                # gRPC reports a failed channel as failed until it is ready again,
                # whatever its attempts meet: ask the network directly.
                host, port = parse_address(self.address)
                pause = 0.05
                while True:
                    try:
                        _, writer = await asyncio.open_connection(host.strip("[]"), port)
                        break
                    except ConnectionRefusedError as exc:
                        raise PeerUnavailable(f"lost {self.describe()}: {exc.strerror or exc}") from None
                    except OSError:
                        # No route, no neighbour yet (a link just back, ARP still
                        # failing): silent for now; ask again within the window.
                        await asyncio.sleep(pause)
                        pause = min(0.5, pause * 2)
                writer.close()
                await channel.channel_ready()
        except TimeoutError:
            if deadline is not None and loop.time() >= deadline:
                raise  # the recv's own deadline: DeadlineExceeded upstream
            raise PeerUnavailable(f"lost {self.describe()}: no connection within {limit:g}s "
                                  "(the reconnect window: keepalive_time + keepalive_timeout)") from None

    async def close(self) -> None:
        """Fail pending recvs with UNAVAILABLE and close the channel. Idempotent."""
        self._closed = True
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
            await asyncio.gather(stream.reader, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
