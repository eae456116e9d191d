"""Tensors a rank fetched and could not deliver: :class:`Kept`.

A recv's tensor that arrived after the recv gave up (its deadline, a
cancel), that could not be placed on its device, or that a daemon's local
client never took is still the next tensor of its key and step: fetched is
never lost. The rank server keeps it here, per (step, key) in order, hands
it to the next recv of that key and step before asking anyone, and drops it
with its step. A recv of that key and step already waiting when a tensor is
kept takes it at once (``offer``, the receiver's: see
:meth:`Kept.hand_over`), oldest tensor to the oldest recv; one still on its
way to its producer (waiting for a stream) takes it as it asks
(:meth:`Kept.claim`).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, ItemsView, Iterator, Sequence, ValuesView
from typing import Any

from rendezvous.errors import RendezvousError
from rendezvous.paths import Path
from rendezvous.table import WaitingTable
from rendezvous.items import Received
from rendezvous.transport import Fetched

__all__ = ["Kept", "to_table", "to_stream"]

log = logging.getLogger("rendezvous")


class Kept:
    """Fetched tensors waiting for the next recv of their (step, key), oldest first."""

    def __init__(self) -> None:
        #: (step, key) -> what is held for it, oldest first (others read it, never change it)
        self.held: dict[tuple[int, str], collections.deque[Received]] = {}
        #: when each (step, key) began to hold tensors (time.monotonic())
        self._since: dict[tuple[int, str], float] = {}
        #: ``offer(step_id, key, queue)``: hands the tensors of ``queue`` (kept for
        #: ``key`` in ``step_id``, oldest first) to the recvs of that key and step
        #: already waiting, oldest first, taking from its left what it hands
        #: over (set by the rank's receiver, which knows where recvs wait)
        self.offer: Callable[[int, str, collections.deque[Received]], None] | None = None

    def keep(self, step_id: int, key: str, item: Received, *, front: bool = False,
             why: str | None = "could not place the tensor", offer: bool = True) -> None:
        """Hold ``item`` for the next recv of ``key`` in ``step_id``: behind what is
        held already, or in ``front`` (it was the oldest); a recv of it already
        waiting takes it at once (unless not ``offer``: the caller keeps more
        for the key first, then calls :meth:`hand_over`). Logged with ``why``,
        unless None (the caller's error says it already), when it stays here."""
        queue = self.held.get((step_id, key))
        if queue is None:
            queue = self.held[(step_id, key)] = collections.deque()
            self._since[(step_id, key)] = time.monotonic()
        queue.appendleft(item) if front else queue.append(item)
        if offer:
            self.hand_over(step_id, key)
        if why is not None and self.has(step_id, key):
            log.warning("recv of %r (step %d) %s; kept for the next recv", key, step_id, why)

    def hand_over(self, step_id: int, key: str) -> None:
        """What is held for ``key`` in ``step_id`` goes to the recvs of it already
        waiting, the oldest first, as far as they go (see ``offer``)."""
        queue = self.held.get((step_id, key))
        if queue is None or self.offer is None:
            return
        self.offer(step_id, key, queue)
        if not queue and self.held.get((step_id, key)) is queue:
            self._forget((step_id, key))

    def claim(self, step_id: int, keys: Sequence[str], start: int = 0,
              end: int | None = None) -> list[tuple[int, Fetched]]:
        """The tensors held for ``keys[start:end]`` in ``step_id`` (one each, the
        oldest), taken, with their positions in ``keys``: for recvs about to ask
        a producer (see PeerClient's ``kept``). A tensor kept while such a recv
        waited (for its stream, for its turn) was served once already: asked
        again, the producer would wait for another."""
        held = self.held
        if not held:
            return []
        return [(i, Fetched(self.take(step_id, keys[i]), Path.LOCAL, placed=False))
                for i in range(start, len(keys) if end is None else end) if (step_id, keys[i]) in held]

    def has(self, step_id: int, key: str) -> bool:
        return (step_id, key) in self.held

    def take(self, step_id: int, key: str) -> Received:
        """The oldest held for ``key`` in ``step_id`` (KeyError if none)."""
        queue = self.held[(step_id, key)]
        item = queue.popleft()
        if not queue:
            self._forget((step_id, key))
        return item

    def _forget(self, held: tuple[int, str]) -> None:
        del self.held[held]
        self._since.pop(held, None)

    def drop_step(self, step_id: int) -> None:
        """Forget a step's tensors (it was aborted or cleaned up)."""
        for k in [k for k in self.held if k[0] == step_id]:
            self._forget(k)

    def count(self) -> int:
        """Tensors held, all keys together."""
        return sum(len(q) for q in self.held.values())

    def items(self) -> ItemsView[tuple[int, str], collections.deque[Received]]:
        return self.held.items()

    def rows(self) -> Iterator[tuple[int, str, int, float]]:
        """(step, key, tensors held, seconds since the key began to hold them),
        made as they are taken."""
        now = time.monotonic()
        for held, queue in self.held.items():
            if queue:
                yield held[0], held[1], len(queue), now - self._since.get(held, now)

    def values(self) -> ValuesView[collections.deque[Received]]:
        return self.held.values()

    def __len__(self) -> int:
        return len(self.held)

    def __bool__(self) -> bool:
        return bool(self.held)


def to_table(table: WaitingTable, step_id: int, key: str, queue: collections.deque[Received]) -> None:
    """Kept tensors of a key this rank produces (``queue``, oldest first) to the
    receivers waiting for it in its table (its own recvs, and other tasks'
    served from it), one each, the oldest first; the rest stay in ``queue``."""
    try:
        while queue and table.has_waiter(step_id, key):
            table.requeue(step_id, key, queue.popleft())  # to its oldest waiter
    except RendezvousError:
        queue.clear()  # the step ended meanwhile: its tensors are dropped anyway


def to_stream(stream: Any, step_id: int, key: str, queue: collections.deque[Received]) -> None:
    """Kept tensors of another task's key (``queue``, oldest first) to the recvs
    of it waiting on ``stream`` (the live stream to that task, or None), one
    each, the oldest first, as an orphan's reply is handed over: the recv is
    answered and its own request cancelled (whatever answers that then is
    handed on in turn, or kept). The rest stay in ``queue``."""
    while queue and stream is not None:
        taker = stream._waiting_for(step_id, key)
        if taker is None:
            return
        call_id, pending = taker
        pending.future.set_result(Fetched(queue.popleft(), Path.LOCAL, placed=False))
        stream.cancel(call_id, pending)
