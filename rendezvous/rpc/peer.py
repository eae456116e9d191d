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
into the dead connection: its retry cache answers the id again). A recv
whose bytes were already moving outside the stream (MPI) is not asked
again: it waits for them for the reconnect window, then fails, and its
tensor is kept when it lands. A recv that waits to ask (for a stream to
come back) takes what was kept for its key meanwhile (``kept``) instead of
asking: the producer would wait for a second tensor.

What a request offers and how a reply's bytes are received is the server's
data planes' business (:class:`rendezvous.transport.Planes`): the stream
reader hands each reply's first frame to the plane it names and feeds later
chunks to the assembly the plane returned.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import grpc

from rendezvous.codec.requests import many_keys_field
from rendezvous.cluster import parse_address
from rendezvous.config import Config
from rendezvous.deadlines import Deadlines
from rendezvous.errors import DeadlineExceeded, PeerUnavailable
from rendezvous.keys import TaskName
from rendezvous.transport import Fetched, Path, Planes

from .batch import BatchFailed, fetch_batch
from .consumer_stream import MANY_REQUEST_BYTES, Broken, ConsumerStream, PendingCall
from .delivery import InDoubt
from .grpc_calls import GrpcCall
from .options import STREAM_METHOD, peer_channel_options

__all__ = ["PeerClient", "BatchFailed", "Keeper"]

log = logging.getLogger("rendezvous.client")

#: recvs per peer whose request_id is kept after they ended unanswered on a broken stream
_UNSETTLED = 4096
#: key lists per peer whose encoded RecvMany parts are remembered (see PeerClient._key_parts)
_KEY_PARTS = 32


class Keeper(Protocol):
    """What a rank server keeps for the next recv of a key (:class:`rendezvous.rank.kept.Kept`)."""

    @property
    def held(self) -> Mapping[tuple[int, str], Any]:
        """(step, key) -> what is held for it (read, never changed, here; the
        same mapping for the keeper's life)."""

    def claim(self, step_id: int, keys: Sequence[str], start: int = 0,
              end: int | None = None) -> list[tuple[int, Fetched]]:
        """What is held for ``keys[start:end]``, taken, with the positions."""


class PeerClient:
    """Recvs from one remote task. Create and use inside one running loop."""

    def __init__(self, task: TaskName, address: str, config: Config, *, planes: Planes,
                 credentials: grpc.ChannelCredentials | None = None,
                 metadata: tuple[tuple[str, str], ...] = (),
                 on_unclaimed: Callable[[int, str, Fetched], None] | None = None,
                 kept: Keeper | None = None,
                 open_call: Callable[[], Any] | None = None, deadlines: Deadlines | None = None) -> None:
        self.task = task
        self.address = address
        self.config = config
        self.planes = planes
        #: where a reply nobody waits for any more goes (the rank server keeps it)
        self._on_unclaimed = on_unclaimed
        #: what the server keeps for the next recv of a key (see Keeper): a recv
        #: about to ask takes from it instead
        self.kept = kept
        self._held = kept.held if kept is not None else None
        #: opens the stream another way than gRPC (the MPI request path): a call
        #: with the stream-stream call's write, read and cancel
        self._open_call = open_call
        #: the recvs' deadlines on one loop timer (the server's, shared by its clients)
        self._deadlines = deadlines if deadlines is not None else Deadlines()
        self._credentials = credentials
        self._metadata = metadata or None  # sent on every stream (the daemon's token)
        self._channel: grpc.aio.Channel | None = None
        self._stream: ConsumerStream | None = None
        self._lock = asyncio.Lock()
        self._next_id = 1  # call ids: a batch takes a contiguous range (see _take_ids)
        # Unique per recv (a retry reuses its own); a random start keeps clients apart
        # in the producer's retry cache without a random draw per recv.
        self._next_request_id = secrets.randbits(62) + 1
        self._connected_once = False
        self._closed = False
        #: request_ids of recvs that ended without the producer's answer while
        #: their stream broke: the next recv of their key asks with them
        self.in_doubt = InDoubt(_UNSETTLED)
        #: id(key tuple) -> (the tuple, its parts encoded), see _key_parts
        self._parts: collections.OrderedDict[int, tuple[Any, list[tuple[int, int, bytes]]]] = \
            collections.OrderedDict()

    def describe(self) -> str:
        return f"task {self.task} at {self.address}"

    @property
    def path(self) -> Path:
        """How this client's requests (and replies inside them) travel: over MPI
        between ranks of one job with requests over MPI, else over gRPC."""
        return Path.MPI if self._open_call is not None else Path.GRPC

    def _channel_options(self) -> list[tuple[str, Any]]:
        return peer_channel_options(self.config.keepalive_time, self.config.keepalive_timeout)

    def live_stream(self) -> ConsumerStream | None:
        stream = self._stream
        return stream if stream is not None and stream.alive else None

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
        # this id: ask again with it (see InDoubt).
        unsettled = self.in_doubt.take(step_id, key) if self.in_doubt else None
        request_id = unsettled or self._take_request_ids(1)
        attempts = 0
        # sent (now, or by the recv whose id this is), and not answered by the
        # producer (a tensor or its error): an id still in doubt stays so even
        # if this recv gives up before it could ask
        asked = unsettled is not None
        orphaned = False  # given up with its cancel on a live stream: the stream settles it
        try:
            async with self._deadlines.timeout_at(deadline):
                while True:
                    stream = self._stream
                    if stream is None or not stream.alive:  # (a live one needs no coroutine)
                        stream = await self._get_stream(deadline)
                    if self._held and (kept := self._claimed(step_id, key, request_id, asked)):
                        return kept
                    call_id = self._take_ids(1)
                    pending = PendingCall(loop.create_future(), key, step_id, placement, request_id)
                    stream.submit(call_id, pending, step_id, key_bytes, request_id, options)
                    asked = True
                    try:
                        return await pending.future
                    except Broken as broken:
                        attempts += 1
                        if attempts > self.config.reconnect_attempts or not isinstance(broken.error, PeerUnavailable):
                            raise broken.error from None
                        log.info("re-sending recv of %s to %s (attempt %d)", key, self.describe(), attempts)
                        await asyncio.sleep(min(1.0, 0.05 * 2 ** attempts))  # a restarting peer gets a moment
                    except BaseException:
                        fut = pending.future
                        if fut.done() and not fut.cancelled() and not isinstance(fut.exception(), Broken):
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
                self.in_doubt.add(step_id, key, request_id)
            if isinstance(exc, TimeoutError):
                raise self._timed_out(key, step_id, timeout) from None
            raise

    def _claimed(self, step_id: int, key: str, request_id: int, asked: bool) -> Fetched | None:
        """The tensor the server keeps for ``key`` (it landed while this recv
        waited to ask: for a stream, for its turn), taken, or None. An id left
        in doubt (``asked``) and not used stays in doubt."""
        kept = self.kept.claim(step_id, (key,), 0, 1) if self.kept is not None else None
        if not kept:
            return None
        if asked:
            self.in_doubt.add(step_id, key, request_id)
        return kept[0][1]

    def _timed_out(self, key: str, step_id: int, timeout: float | None) -> DeadlineExceeded:
        why = "" if self._connected_once or self._open_call is not None else (
            f": it was never reached (no server answered at {self.address} yet; "
            f"is it started, and is that its address?)")
        return DeadlineExceeded(
            f"recv of {key!r} (step {step_id}) from {self.describe()} timed out after {timeout:g}s{why}")

    async def recv_batch(self, keys: Sequence[str], step_id: int, placement: Any = None,
                         arrived: set[int] | None = None) -> list[Fetched]:
        """Fetch ``keys`` of ``step_id`` from the peer, all asked at once on one
        stream: one future for the batch (each call's outcome is a
        :class:`~rendezvous.rpc.batch._Call`), and no task or deadline of its
        own (the caller's cancel is the deadline). All or none: on the first
        error (raised as :class:`BatchFailed`) or a cancel, every other call
        gives up by :meth:`recv`'s rules (an answer already in is kept by the
        server, one on its way is kept when it lands, one lost in a broken
        stream leaves its request_id to be asked again). Calls whose stream
        broke under a peer that went away are asked again together, as one
        batch on a new stream, with their request_ids. ``arrived`` collects the
        positions whose tensors had arrived when the batch gave up (kept by the
        server)."""
        arrived = set() if arrived is None else arrived
        if not keys:
            return []
        return await fetch_batch(self, keys, step_id, placement, arrived)

    def _key_parts(self, keys: Sequence[str]) -> list[tuple[int, int, bytes]]:
        """``keys`` in parts of up to MANY_REQUEST_BYTES (a RecvMany every
        producer accepts: max_request_bytes is at least 64 KiB), each
        ``(start, end, the keys encoded)``. Remembered for the last few key
        tuples by identity (a rank server asks the same tuple, the routing it
        remembers, every step): a step re-encodes nothing."""
        cached = self._parts.get(id(keys))
        if cached is not None and cached[0] is keys:
            self._parts.move_to_end(id(keys))
            return cached[1]
        parts: list[tuple[int, int, bytes]] = []
        start = 0
        size = 0
        n = len(keys)
        encoded = [key.encode() for key in keys]
        for i, key in enumerate(encoded):
            size += len(key) + 12
            if size >= MANY_REQUEST_BYTES or i == n - 1:
                parts.append((start, i + 1, many_keys_field(encoded[start:i + 1])))
                start, size = i + 1, 0
        if type(keys) is tuple:  # kept only for what cannot change under its id
            self._parts[id(keys)] = (keys, parts)
            if len(self._parts) > _KEY_PARTS:
                self._parts.popitem(last=False)
        return parts

    def _take_ids(self, n: int) -> int:
        """The first of ``n`` new consecutive call ids."""
        first = self._next_id
        self._next_id += n
        return first

    def _take_request_ids(self, n: int) -> int:
        """The first of ``n`` new consecutive request ids."""
        first = self._next_request_id
        self._next_request_id += n
        return first

    async def _get_stream(self, deadline: float | None) -> ConsumerStream:
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
                self._stream = ConsumerStream(self, call)
                if call.watch is not None:  # the call polls while recvs await replies
                    call.watch(self._stream.pending)
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
                left = float("inf") if deadline is None else deadline - loop.time()
                own = left < limit  # the recv's own deadline bounds the wait when it comes first
                limit = max(0.0, min(limit, left))
                try:
                    await asyncio.wait_for(self._channel.channel_ready(), limit)
                except TimeoutError:
                    if own:  # (its timer may fire a hair before the deadline: still the recv's own)
                        raise  # DeadlineExceeded upstream
                    raise PeerUnavailable(
                        f"could not connect to {self.describe()} within {limit:g}s") from None
                self._connected_once = True
            else:
                await self._reconnect(deadline)
            call = self._channel.stream_stream(STREAM_METHOD, request_serializer=None,
                                               response_deserializer=None)(
                                               metadata=self._metadata, wait_for_ready=first)
            self._stream = ConsumerStream(self, GrpcCall(call))
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
