"""What the package hands back, shared by every layer: :class:`Received` (a
recv's item) and :class:`PendingEntry` (a row of what waits somewhere)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

__all__ = ["Received", "PendingEntry"]


class Received(NamedTuple):
    """What a receiver gets: the value (None when dead) and the dead flag."""

    value: Any
    is_dead: bool


class PendingEntry(NamedTuple("PendingEntry", [("step_id", int), ("key", Hashable), ("kind", str),
                                                ("count", int), ("oldest_age_s", float)])):
    """One non-empty queue of the table (:meth:`WaitingTable.pending`): ``kind`` "tensor" (produced,
    waiting for a consumer) or "waiter"; ``oldest_age_s`` since the oldest was queued. (A field
    named ``count`` needs this form: a class body's would hide ``tuple.count``.)"""

    __slots__ = ()
