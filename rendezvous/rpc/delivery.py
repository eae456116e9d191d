"""Delivery, exactly once: a consumer's call and a producer's reply, each as
the states it goes through and the one table of the moves between them, and
what happens at delivery's edges: the ids left in doubt by a broken stream
(:class:`InDoubt`), transfers cut off with their stream (:func:`cut_off`) and
tensors put back when their reply was not written (:func:`put_back`).

An event the table does not allow raises :class:`IllegalMove`: a call answered twice, or given up after its answer,
is a bug that would lose or duplicate a tensor, never a case to handle.

====================  =====================================================
``ASKED``             its request is out; its recv waits on the stream
``MOVING``            the answer's bytes are on their way outside the stream
                      (an MPI transfer was posted for them)
``ORPHAN``            its recv gave up with the request out: an answer that
                      comes is still taken, and kept for another recv
``ORPHAN_MOVING``     an orphan whose bytes are on their way: kept when they land
``SETTLED``           the producer's answer is in (a tensor, delivered or kept,
                      or an error): its request_id is never asked again
``IN_DOUBT``          the stream broke before the producer answered: nobody
                      knows whether the tensor was taken, so the request_id
                      is asked again by the next recv of the key (the
                      producer answers it from its retry cache)
====================  =====================================================

Events: ``GAVE_UP`` (the recv's deadline or cancel, or its bytes cut off with
the stream), ``MOVED`` (a descriptor's transfer posted), ``ANSWERED`` (the
answer is in, or the transfer landed or failed), ``BROKE`` (the stream ended
with the call unanswered).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from rendezvous.errors import PeerUnavailable, RendezvousError
from rendezvous.items import Received
from rendezvous.paths import Path

if TYPE_CHECKING:
    from rendezvous.transport import Carry

    from .producer_stream import Asked
    from .retry import Handed
    from .servicer import RecvTensorServicer

__all__ = ["PendingCall", "OutgoingReply", "READY", "COMMITTED", "STARTED", "COMMITTED_STARTED", "GIVEN_BACK", "REPLY_STATES",
           "COMMIT", "START", "GIVE_BACK", "REPLY_EVENTS", "REPLY_MOVES", "reply_after", "ASKED", "MOVING", "ORPHAN", "ORPHAN_MOVING", "SETTLED", "IN_DOUBT", "STATES",
           "GAVE_UP", "MOVED", "ANSWERED", "BROKE", "EVENTS", "MOVES", "IllegalMove", "after",
           "InDoubt", "cut_off", "put_back"]

# states (small ints: a call's state is read on every reply)
ASKED, MOVING, ORPHAN, ORPHAN_MOVING, SETTLED, IN_DOUBT = range(6)
STATES = ("ASKED", "MOVING", "ORPHAN", "ORPHAN_MOVING", "SETTLED", "IN_DOUBT")

# events
GAVE_UP, MOVED, ANSWERED, BROKE = range(4)
EVENTS = ("GAVE_UP", "MOVED", "ANSWERED", "BROKE")

#: (state, event) -> the state after it; anything else is illegal
MOVES: dict[tuple[int, int], int] = {
    (ASKED, GAVE_UP): ORPHAN,
    (ASKED, MOVED): MOVING,
    (ASKED, ANSWERED): SETTLED,
    (ASKED, BROKE): IN_DOUBT,
    (ORPHAN, GAVE_UP): ORPHAN,  # given up twice (a cancel, then its stream cut off): still an orphan
    (ORPHAN, MOVED): ORPHAN_MOVING,
    (ORPHAN, ANSWERED): SETTLED,
    (ORPHAN, BROKE): IN_DOUBT,  # its cancel may never have reached the producer
    (MOVING, GAVE_UP): ORPHAN_MOVING,
    (MOVING, ANSWERED): SETTLED,
    (ORPHAN_MOVING, GAVE_UP): ORPHAN_MOVING,
    (ORPHAN_MOVING, ANSWERED): SETTLED,
}

#: the table as a list per state, indexed by event (-1: illegal), for the hot path
_NEXT = [[MOVES.get((state, event), -1) for event in range(len(EVENTS))] for state in range(len(STATES))]


class IllegalMove(AssertionError):
    """An event that the state of a call or a reply does not allow."""


def after(state: int, event: int, what: object = "a call") -> int:
    """The state after ``event`` in ``state``; :class:`IllegalMove` if the table has none."""
    nxt = _NEXT[state][event]
    if nxt < 0:
        raise IllegalMove(f"{what}: {EVENTS[event]} is not allowed in state {STATES[state]}")
    return nxt


# -- a producer's reply -----------------------------------------------------------------
#
# ``READY``: made and waiting for the writer; its tensors go back if the call is
# cancelled or the stream ends. ``COMMITTED``: its bytes are on their way
# (a descriptor's transfer started, or a re-send), so it is written whatever the
# consumer says. ``STARTED`` / ``COMMITTED_STARTED``: its first frame was handed
# to the writer (written to its end; a stream that ends first gives an
# uncommitted one back). ``GIVEN_BACK``: its tensors went back to the table (or,
# committed, only its transfer was released): never twice.

READY, COMMITTED, STARTED, COMMITTED_STARTED, GIVEN_BACK = range(5)
REPLY_STATES = ("READY", "COMMITTED", "STARTED", "COMMITTED_STARTED", "GIVEN_BACK")
COMMIT, START, GIVE_BACK = range(3)
REPLY_EVENTS = ("COMMIT", "START", "GIVE_BACK")

#: (state, event) -> the state after it, for a reply; anything else is illegal
REPLY_MOVES: dict[tuple[int, int], int] = {
    (READY, COMMIT): COMMITTED,
    (READY, START): STARTED,
    (READY, GIVE_BACK): GIVEN_BACK,
    (COMMITTED, COMMIT): COMMITTED,  # a re-sent descriptor's transfer starts: it was committed already
    (COMMITTED, START): COMMITTED_STARTED,
    (COMMITTED, GIVE_BACK): GIVEN_BACK,
    (STARTED, START): STARTED,  # each later frame
    (STARTED, GIVE_BACK): GIVEN_BACK,  # cut off by the stream's end before its last frame
    (COMMITTED_STARTED, START): COMMITTED_STARTED,
    (COMMITTED_STARTED, GIVE_BACK): GIVEN_BACK,
}
_REPLY_NEXT = [[REPLY_MOVES.get((state, event), -1) for event in range(len(REPLY_EVENTS))]
               for state in range(len(REPLY_STATES))]


def reply_after(state: int, event: int, what: object = "a reply") -> int:
    """A reply's state after ``event``; :class:`IllegalMove` if the table has none."""
    nxt = _REPLY_NEXT[state][event]
    if nxt < 0:
        raise IllegalMove(f"{what}: {REPLY_EVENTS[event]} is not allowed in state {REPLY_STATES[state]}")
    return nxt


class PendingCall:
    """One call on a stream: its recv's future (a Fetched), the key and step it
    asks, its request_id, and where its delivery stands."""

    __slots__ = ("future", "assembly", "path", "key", "step_id", "placement", "request_id", "delivery")

    def __init__(self, future: asyncio.Future | None, key: str, step_id: int, placement: Any = None,
                 request_id: int = 0) -> None:
        if future is not None:  # None: a subclass is its own future (a batch's call)
            self.future = future  # resolves to a Fetched
        self.request_id = request_id
        self.assembly: Any = None  # a reply being assembled from chunk frames
        self.path = Path.GRPC
        self.key = key
        self.step_id = step_id
        self.placement = placement  # where the tensor should land
        #: where its delivery stands (rendezvous.rpc.delivery): moved only by :meth:`to`
        self.delivery = ASKED

    @property
    def orphan(self) -> bool:
        """Its recv gave up; the reply, if one comes, is still taken."""
        return self.delivery == ORPHAN or self.delivery == ORPHAN_MOVING

    @property
    def settled(self) -> bool:
        """The producer's answer is in: a tensor (delivered to this recv, handed to
        another, or kept by the server) or an error. Nothing is left to settle; in
        particular its request_id must never be asked again (that would be
        answered from the producer's retry cache with the same tensor)."""
        return self.delivery == SETTLED

    def to(self, event: int) -> None:
        """Move on with ``event`` (delivery.MOVES); IllegalMove if not allowed."""
        self.delivery = after(self.delivery, event, self)

    def __repr__(self) -> str:
        return f"<the call for {self.key!r} of step {self.step_id}, {STATES[self.delivery]}>"


class OutgoingReply:
    """A reply being written: its next frame is made one step ahead, so the
    writer knows when a reply ends without an extra turn. ``item`` goes back to
    the table if the call is cancelled before the first frame is written; a
    ``committed`` reply (its bytes already on their way) is written anyway.
    A descriptor's transfer (``carry``) starts as its frame is handed over,
    and commits the reply; a reply dropped before that releases it."""

    __slots__ = ("frames", "next_frame", "req", "key", "item", "state", "ack", "members",
                 "carry", "remake", "resent")

    def __init__(self, frames_: Iterator[bytes], req: "Asked", key: str,
                 item: Received | None, committed: bool = False, ack: bool = False,
                 members: list[tuple[int, Any, Received, str]] | None = None, carry: Carry | None = None,
                 remake: Callable[[list[int]], Iterator[Any]] | None = None, resent: Handed | None = None) -> None:
        self.frames = frames_
        self.next_frame: bytes | None = next(frames_, None)
        self.req = req
        self.key = key
        self.item = item
        #: where it stands (rendezvous.rpc.delivery's reply states), moved only by :meth:`to`
        self.state = COMMITTED if committed else READY
        self.ack = ack  # only the CANCELLED answer to a cancel
        #: a group reply's (call_id, request, item, key) of each call it answers
        self.members = members
        self.carry = carry
        #: a descriptor reply's frames made again for other call ids (one per
        #: member), to answer a retry with the same transfer (see Handed)
        self.remake = remake
        #: what a reply re-sending a handed-over descriptor re-sends
        self.resent = resent

    @property
    def started(self) -> bool:
        return self.state == STARTED or self.state == COMMITTED_STARTED

    @property
    def committed(self) -> bool:
        return self.state == COMMITTED or self.state == COMMITTED_STARTED

    def to(self, event: int) -> None:
        self.state = reply_after(self.state, event, self)

    def __repr__(self) -> str:
        return f"<the reply for {self.key!r}, {REPLY_STATES[self.state]}>"

    def give_back(self, servicer: "RecvTensorServicer", stream: object) -> None:
        """Its tensors go back to the table: it was never written to its end
        (a descriptor's transfer never started). Once: a second time raises."""
        committed, started = self.committed, self.started
        self.to(GIVE_BACK)
        if committed:
            if self.carry is not None and not started:
                self.carry.release()  # a re-sent descriptor never handed over: the next retry gets it
            return
        if self.carry is not None and not started:
            self.carry.release()
        if self.item is not None:
            put_back(servicer, self.req, self.key, self.item, stream)
        for _, req, item, key in self.members or ():
            put_back(servicer, req, key, item, stream)


# -- what delivery does at its edges -------------------------------------------

class InDoubt:
    """The request_ids of calls left ``IN_DOUBT``: a recv ended without the
    producer's answer and the stream it was asked on broke (a pulled cable, a
    peer gone silent), so the producer may have taken the tensor for it and
    written it into the dead connection. The next recv of the same key and step
    asks again with the same request_id, and the producer answers it from its
    retry cache (or, if it put the tensor back, from its table): the tensor is
    neither lost nor taken twice. Several recvs of one key can be in doubt at
    once (a recv that gave up, then the one that asked again, both cut off):
    each id is kept, and the next recvs ask with them oldest first, the order
    the producer took their tensors in. At most ``limit`` ids are kept, the
    oldest keys forgotten first."""

    __slots__ = ("_ids", "_count", "limit")

    def __init__(self, limit: int = 4096) -> None:
        self._ids: collections.OrderedDict[tuple[int, str], collections.deque[int]] = collections.OrderedDict()
        self._count = 0
        self.limit = limit

    def __bool__(self) -> bool:
        return bool(self._ids)

    def __len__(self) -> int:
        return self._count

    def ids(self, step_id: int, key: str) -> list[int]:
        """The ids in doubt for ``key`` of ``step_id``, oldest first."""
        return list(self._ids.get((step_id, key), ()))

    def add(self, step_id: int, key: str, request_id: int) -> None:
        ids = self._ids.get((step_id, key))
        if ids is None:
            ids = self._ids[(step_id, key)] = collections.deque()
        elif request_id in ids:
            return
        else:
            self._ids.move_to_end((step_id, key))
        ids.append(request_id)
        self._count += 1
        while self._count > self.limit:
            self.take(*next(iter(self._ids)))

    def take(self, step_id: int, key: str) -> int | None:
        """The oldest id in doubt for ``key`` of ``step_id`` (the next recv of it
        asks with that id), or None."""
        ids = self._ids.get((step_id, key))
        if ids is None:
            return None
        request_id = ids.popleft()
        self._count -= 1
        if not ids:
            del self._ids[(step_id, key)]
        return request_id


def cut_off(moving: dict[int, PendingCall], cut: list[tuple[int, PendingCall]], error: RendezvousError,
            waited: float | None = None) -> None:
    """The recvs of ``cut``, whose bytes were on their way outside the stream
    when it ended (and have not landed after ``waited`` seconds), stop waiting;
    what lands later is kept for the next recv of its key. A call no longer in
    ``moving`` landed (or failed) meanwhile and is left alone."""
    late = "" if waited is None else f" and did not land within {waited:g}s of its end"
    for call_id, p in cut:
        if moving.get(call_id) is not p:
            continue
        p.to(GAVE_UP)
        if not p.future.done():
            p.future.set_exception(PeerUnavailable(
                f"{error.message}; the tensor for {p.key!r} was on its way outside the stream{late}; it is "
                "kept for the next recv of its key when it lands"))


def put_back(servicer: "RecvTensorServicer", req: "Asked", key: str, item: Received, owner: object = None) -> None:
    """An item whose reply (on the stream ``owner``) was not sent to its end (the
    consumer cancelled, the stream broke, the reply could not be made) goes back
    to the front of its queue, unless a retry of the same request_id on another
    stream was given it since: that reply carries it (see RetryCache.cut_off)."""
    if req.request_id and not servicer.retry.cut_off(req.request_id, owner):
        return
    servicer.requeue(req.step_id, key, item)
