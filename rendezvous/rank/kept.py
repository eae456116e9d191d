"""Tensors a rank fetched and could not deliver: :class:`Kept`.

A recv's tensor that arrived after the recv gave up (its deadline, a
cancel), that could not be placed on its device, or that a daemon's local
client never took is still the next tensor of its key and step: fetched is
never lost. The rank server keeps it here, per (step, key) in order, hands
it to the next recv of that key and step before asking anyone, and drops it
with its step.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import ItemsView, ValuesView

from rendezvous.table import Received

__all__ = ["Kept"]

log = logging.getLogger("rendezvous")


class Kept:
    """Fetched tensors waiting for the next recv of their (step, key), oldest first."""

    def __init__(self) -> None:
        self._items: dict[tuple[int, str], collections.deque[Received]] = {}

    def keep(self, step_id: int, key: str, item: Received, *, front: bool = False,
             why: str | None = "could not place the tensor") -> None:
        """Hold ``item`` for the next recv of ``key`` in ``step_id``: behind what is
        held already, or in ``front`` (it was the oldest). Logged with ``why``,
        unless None (the caller's error says it already)."""
        queue = self._items.setdefault((step_id, key), collections.deque())
        queue.appendleft(item) if front else queue.append(item)
        if why is not None:
            log.warning("recv of %r (step %d) %s; kept for the next recv", key, step_id, why)

    def has(self, step_id: int, key: str) -> bool:
        return (step_id, key) in self._items

    def take(self, step_id: int, key: str) -> Received:
        """The oldest held for ``key`` in ``step_id`` (KeyError if none)."""
        queue = self._items[(step_id, key)]
        item = queue.popleft()
        if not queue:
            del self._items[(step_id, key)]
        return item

    def drop_step(self, step_id: int) -> None:
        """Forget a step's tensors (it was aborted or cleaned up)."""
        for k in [k for k in self._items if k[0] == step_id]:
            del self._items[k]

    def count(self) -> int:
        """Tensors held, all keys together."""
        return sum(len(q) for q in self._items.values())

    def items(self) -> ItemsView[tuple[int, str], collections.deque[Received]]:
        return self._items.items()

    def values(self) -> ValuesView[collections.deque[Received]]:
        return self._items.values()

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)
