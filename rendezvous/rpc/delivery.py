"""A consumer's call, as the states its delivery goes through, and the one
table of the moves between them. An event the table does not allow raises
:class:`IllegalMove`: a call answered twice, or given up after its answer,
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
from typing import Any

from rendezvous.paths import Path

__all__ = ["Pending", "ASKED", "MOVING", "ORPHAN", "ORPHAN_MOVING", "SETTLED", "IN_DOUBT", "STATES",
           "GAVE_UP", "MOVED", "ANSWERED", "BROKE", "EVENTS", "MOVES", "IllegalMove", "after"]

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
    """An event that the state of a call does not allow."""


def after(state: int, event: int, what: object = "a call") -> int:
    """The state after ``event`` in ``state``; :class:`IllegalMove` if the table has none."""
    nxt = _NEXT[state][event]
    if nxt < 0:
        raise IllegalMove(f"{what}: {EVENTS[event]} is not allowed in state {STATES[state]}")
    return nxt


class Pending:
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
