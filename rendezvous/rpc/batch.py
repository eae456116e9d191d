"""A batch of keys from one peer, asked at once on its stream: what
:meth:`rendezvous.rpc.peer.PeerClient.recv_batch` runs.

Each key is a call of its own (:class:`_Call`: its :class:`PendingCall` and its
outcome in one object) and the batch waits on one future (:class:`_Batch`).
All or none: on the first failure, or the caller's cancel, every other call
gives up by a recv's rules, and every tensor that arrived is kept for the
next recv of its key. Calls whose stream broke under a peer that went away
are asked again together, on a new stream, with their own request_ids (the
producer answers each from its retry cache if it had taken the tensor): a
batch of any size keeps every id it asked with, whatever happens to it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rendezvous.codec.requests import many_keys_field, recv_many_request
from rendezvous.errors import PeerUnavailable, RendezvousError, Unavailable
from rendezvous.transport import Fetched, Path

from .consumer_stream import Broken, ConsumerStream, PendingCall
from .delivery import ANSWERED, ASKED

if TYPE_CHECKING:
    from .peer import PeerClient

__all__ = ["BatchFailed", "fetch_batch"]

log = logging.getLogger("rendezvous.client")


class BatchFailed(Exception):
    """A batch from one peer failed: ``failures`` (position -> error) and how
    many of its tensors had arrived (kept for the next recv of their keys)."""

    def __init__(self, failures: dict[int, BaseException], arrived: int) -> None:
        super().__init__(f"{len(failures)} failed")
        self.failures = failures
        self.arrived = arrived


class _Batch:
    """What a batch waits on: one future for the whole batch, resolved when
    every call is answered or one failed (a call whose stream broke waits for
    the others: they may all be asked again)."""

    __slots__ = ("left", "failed", "broken", "cancelled", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int) -> None:
        self.left = n
        self.failed = False
        self.broken = False
        self.cancelled = False  # a call was cancelled (its bytes could not land)
        self.waiter = loop.create_future()

    def settled(self, exc: BaseException | None) -> None:
        left = self.left = self.left - 1
        if exc is None:  # the common case, once per key: no more than this
            if left <= 0 and not self.waiter.done():
                self.waiter.set_result(None)
            return
        if isinstance(exc, Broken):
            self.broken = True
        else:
            self.failed = True
        if not self.waiter.done() and (left <= 0 or (self.failed and not self.broken)):
            self.waiter.set_result(None)


_PENDING, _DONE, _CANCELLED = 0, 1, 2


class _Call(PendingCall):
    """A batch's call: its :class:`PendingCall` and its outcome in one object, with
    the part of ``asyncio.Future``'s interface the stream and the batch use
    (no callbacks, no loop round trip): its ``future`` is itself. A batch of
    thousands of keys resolves thousands of these and one future, and makes
    one object per key that lives until its answer is in, not two (fewer
    objects for the garbage collector to walk while the step is on)."""

    __slots__ = ("_state", "_result", "_exc", "_batch")

    def __init__(self, batch: _Batch, key: str, step_id: int, placement: Any, request_id: int) -> None:
        # PendingCall.__init__(self, None, ...), inlined: once per key of a batch
        self.request_id = request_id
        self.assembly = None
        self.path = Path.GRPC
        self.key = key
        self.step_id = step_id
        self.placement = placement
        self.delivery = ASKED
        self._state = _PENDING
        self._result: Any = None
        self._exc: BaseException | None = None
        self._batch = batch

    @property
    def future(self) -> "_Call":  # type: ignore[override]
        return self

    def done(self) -> bool:
        return self._state != _PENDING

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def set_result(self, result: Any) -> None:
        if self._state != _PENDING:
            raise asyncio.InvalidStateError("the call is already answered")
        self._state, self._result = _DONE, result
        batch = self._batch  # _Batch.settled(None), inlined: once per key
        left = batch.left = batch.left - 1
        if left <= 0 and not batch.waiter.done():
            batch.waiter.set_result(None)

    def set_exception(self, exc: BaseException) -> None:
        if self._state != _PENDING:
            raise asyncio.InvalidStateError("the call is already answered")
        self._state, self._exc = _DONE, exc
        self._batch.settled(exc)

    def cancel(self) -> bool:
        if self._state != _PENDING:
            return False
        self._state = _CANCELLED
        self._batch.cancelled = True
        self._batch.settled(None)
        return True

    def exception(self) -> BaseException | None:
        if self._state == _CANCELLED:
            raise asyncio.CancelledError()
        if self._state == _PENDING:
            raise asyncio.InvalidStateError("the call is not answered yet")
        return self._exc

    def result(self) -> Any:
        exc = self.exception()
        if exc is not None:
            raise exc
        return self._result


def _failure(call: _Call) -> BaseException | None:
    """What a settled call of a batch failed with, or None if it was answered
    with its tensor or may be asked again (its stream broke because the peer
    went away; a stream ended by a malformed reply is the peer's failure, as
    it is for a single recv). A call the stream cancelled (its transfer was
    cancelled before it landed: the MPI engine stopped) is a failure too."""
    if call._state == _CANCELLED:
        return Unavailable(f"the transfer of {call.key!r} (step {call.step_id}) was cancelled before it "
                           "landed (its MPI engine stopped)")
    exc = call._exc
    if isinstance(exc, Broken):
        return None if isinstance(exc.error, PeerUnavailable) else exc.error
    return exc


def _submit(client: "PeerClient", stream: ConsumerStream, first: int, part: list[_Call], step_id: int,
            encoded: bytes, options: bytes | None) -> None:
    """Ask ``part`` as the calls ``first`` .. on ``stream`` in one RecvMany; if
    the stream has broken meanwhile, its calls fail as broken (asked again)."""
    if stream.alive:
        stream.submit_many(first, part, recv_many_request(
            first, step_id, encoded, [p.request_id for p in part], options))
        return
    broken = Broken(PeerUnavailable(f"stream to {client.describe()} closed"))
    for p in part:
        p.set_exception(broken)


async def fetch_batch(client: "PeerClient", keys: Sequence[str], step_id: int, placement: Any,
                      arrived: set[int]) -> list[Fetched]:
    """:meth:`PeerClient.recv_batch` (see there)."""
    loop = asyncio.get_running_loop()
    options = client.planes.offer(placement)
    stream = await client._get_stream(None)
    n = len(keys)
    first = client._take_ids(n)
    batch = _Batch(loop, n)
    calls: list[_Call] = []
    try:
        await _ask(client, stream, first, keys, step_id, placement, options, batch, calls)
        # one future for the batch: all answered, or one failed (a stream that
        # broke fails its other calls too: then they all settle first)
        await batch.waiter
    except BaseException:
        _give_up(client, stream, first, calls, range(n), arrived)
        raise
    if not batch.failed and not batch.broken and not batch.cancelled:
        return [c._result for c in calls]
    return await _settle(client, keys, step_id, placement, options, stream, first, calls, arrived)


async def _ask(client: "PeerClient", stream: ConsumerStream, first: int, keys: Sequence[str], step_id: int,
               placement: Any, options: bytes | None, batch: _Batch, calls: list[_Call],
               ids: Sequence[int] | None = None) -> None:
    """A call per key of ``keys`` (the calls ``first`` .., appended to
    ``calls``), asked on ``stream`` part by part, a RecvMany each, with
    ``ids`` for request_ids (else new ones, or the one left in doubt for the
    key). A key the server keeps a tensor for by the time its part leaves
    (it landed while the batch waited for its stream or its turn) is answered
    from there, not asked: the producer served it once already."""
    n = len(keys)
    in_doubt = client.in_doubt
    keeper = client.kept
    rid = client._take_request_ids(n) if ids is None else 0
    for a, b, encoded in client._key_parts(keys):
        if ids is None:
            part = [_Call(batch, keys[i], step_id, placement,
                          (in_doubt.take(step_id, keys[i]) if in_doubt else None) or rid + i)
                    for i in range(a, b)]
        else:
            part = [_Call(batch, keys[i], step_id, placement, ids[i]) for i in range(a, b)]
        calls += part
        kept = keeper.claim(step_id, keys, a, b) if keeper is not None and keeper.held else None
        if kept:
            _ask_the_rest(client, stream, first, keys, a, part, kept, rid if ids is None else None, step_id, options)
        else:
            _submit(client, stream, first + a, part, step_id, encoded, options)
        if a == 0 and b < n and not stream.outbox.empty():
            # The first request leaves now (the writer's turn), and the
            # producer starts on it while the rest are made (a call that
            # takes it at once, MPI, has it already).
            await asyncio.sleep(0)


def _ask_the_rest(client: "PeerClient", stream: ConsumerStream, first: int, keys: Sequence[str], a: int,
                  part: list[_Call], kept: list[tuple[int, Fetched]], rid: int | None, step_id: int,
                  options: bytes | None) -> None:
    """``part`` (the calls of ``keys[a:]``) with the tensors of ``kept``
    answered from them; the rest asked, each run of neighbours in a RecvMany
    of its own (their call ids stay ``first`` + position). An id left in doubt
    (one not from ``rid``, the new ids' start; any id when None) and not used
    stays in doubt."""
    taken = set()
    for i, fetched in kept:
        call = part[i - a]
        if rid is None or call.request_id != rid + i:
            client.in_doubt.add(step_id, call.key, call.request_id)
        call.to(ANSWERED)
        call.set_result(fetched)
        taken.add(i)
    i, end = a, a + len(part)
    while i < end:
        if i in taken:
            i += 1
            continue
        j = i
        while j < end and j not in taken:
            j += 1
        _submit(client, stream, first + i, part[i - a:j - a], step_id,
                many_keys_field([k.encode() for k in keys[i:j]]), options)
        i = j


async def _settle(client: "PeerClient", keys: Sequence[str], step_id: int, placement: Any,
                  options: bytes | None, stream: ConsumerStream, first: int, calls: list[_Call],
                  arrived: set[int]) -> list[Fetched]:
    """A batch whose calls did not all simply answer: a failure fails it (what
    arrived is kept), and the calls whose stream broke under a peer that went
    away are asked again together, on a new stream, with their request_ids
    (``reconnect_attempts`` times, as a recv is), until all are answered."""
    loop = asyncio.get_running_loop()
    n = len(keys)
    out: list[Any] = [None] * n  # the tensors of earlier rounds, by position
    positions: Sequence[int] = range(n)  # the position of each call of this round
    attempts = 0
    while True:
        failures = {}
        for j, call in enumerate(calls):
            if call._state != _PENDING:
                failed = _failure(call)
                if failed is not None:
                    failures[positions[j]] = failed
        if failures:
            _give_up(client, stream, first, calls, positions, arrived)
            _keep(client, keys, step_id, out, arrived)
            raise BatchFailed(failures, len(arrived))
        # every call is settled: answered, or broken under a peer that went away
        again: list[int] = []
        error: RendezvousError | None = None
        for j, call in enumerate(calls):
            exc = call._exc
            if exc is None:
                out[positions[j]] = call._result
            else:
                again.append(j)
                error = exc.error  # type: ignore[attr-defined]
        if not again:
            return out
        ids = [calls[j].request_id for j in again]
        positions = [positions[j] for j in again]
        attempts += 1
        try:
            if attempts > client.config.reconnect_attempts:
                assert error is not None
                raise error
            log.info("re-sending %d recvs of a batch to %s (attempt %d)", len(ids), client.describe(), attempts)
            await asyncio.sleep(min(1.0, 0.05 * 2 ** attempts))  # a restarting peer gets a moment
            stream = await client._get_stream(None)
        except BaseException as exc:
            # nobody knows whether the producer took these tensors: the next
            # recvs of their keys ask with these ids
            for i, request_id in zip(positions, ids):
                client.in_doubt.add(step_id, keys[i], request_id)
            _keep(client, keys, step_id, out, arrived)
            if isinstance(exc, RendezvousError):
                raise BatchFailed({i: exc for i in positions}, len(arrived)) from None
            raise
        asked = [keys[i] for i in positions]
        first = client._take_ids(len(asked))
        batch = _Batch(loop, len(asked))
        calls = []
        try:
            await _ask(client, stream, first, asked, step_id, placement, options, batch, calls, ids)
            await batch.waiter
        except BaseException:
            _give_up(client, stream, first, calls, positions, arrived)
            _keep(client, keys, step_id, out, arrived)
            raise


def _keep(client: "PeerClient", keys: Sequence[str], step_id: int, out: list[Any], arrived: set[int]) -> None:
    """The tensors of earlier rounds (``out``) go to the server, kept for the
    next recv of their keys; their positions to ``arrived``."""
    for i, fetched in enumerate(out):
        if fetched is not None:
            client.unclaimed(step_id, keys[i], fetched)
            arrived.add(i)
            out[i] = None


def _give_up(client: "PeerClient", stream: ConsumerStream, first: int, calls: list[_Call],
             positions: Sequence[int], arrived: set[int]) -> None:
    """Every call of a batch's round gives up as a recv that gave up would: an
    answer already in is kept by the server (its position goes to
    ``arrived``), one on its way is kept when it lands (the call stays as an
    orphan), and one the stream broke under (a peer that went away, or a
    malformed reply) leaves its request_id to be asked again by the next recv
    of its key. A call answered with an error, or cancelled by its stream,
    is settled."""
    for j, call in enumerate(calls):
        state = call._state
        if state == _CANCELLED:
            continue
        if state == _DONE:
            exc = call._exc
            if exc is None:
                client.unclaimed(call.step_id, call.key, call._result)
                arrived.add(positions[j])
                continue
            if not isinstance(exc, Broken):
                continue  # the producer's answer (or the reply's own failure): settled
        if not stream.cancel(first + j, call):
            client.in_doubt.add(call.step_id, call.key, call.request_id)
        call.cancel()  # as a recv's own: whatever answers it now is handed on, never to this call
