"""What waits in a rank server, row by row: :func:`walk`.

The rows are :class:`~rendezvous.table.PendingEntry`: each non-empty queue of
the waiting table (``"tensor"``: produced here and not consumed;
``"waiter"``: a recv waiting here for its tensor), then each key whose
fetched tensors the server keeps for the next recv (``"kept"``, see
:mod:`rendezvous.rank.kept`). The walk is lazy: a caller that wants a few
rows (Admin's ``Pending``) does the work of those rows only, whatever the
table holds. Take its rows without awaiting in between (the table and the
kept tensors change on the loop).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from rendezvous.table import PendingEntry, WaitingTable, _Tensors

__all__ = ["walk", "count"]


def _table_rows(table: WaitingTable, now: float) -> Iterator[PendingEntry]:
    for step_id, keys in table._steps.items():
        for key, q in keys.items():
            if type(q) is _Tensors:
                if q:
                    yield PendingEntry(step_id, key, "tensor", len(q), now - q[0][1])
            else:
                live = [t for fut, t in q if not fut.done()]
                if live:
                    yield PendingEntry(step_id, key, "waiter", len(live), now - live[0])


def walk(table: WaitingTable, kept: Any) -> Iterator[PendingEntry]:
    """The table's rows (steps in the order they began, keys in the order their
    queue formed), then the kept tensors' (``kept``: a :class:`~rendezvous.rank.kept.Kept`).
    A kept tensor's age is not recorded: its row says 0."""
    yield from _table_rows(table, time.monotonic())
    for (step_id, key), queue in kept.items():
        if queue:
            yield PendingEntry(step_id, key, "kept", len(queue), 0.0)


def count(table: WaitingTable, kept: Any) -> int:
    """How many rows :func:`walk` gives at most, counted without walking them: the
    table's queues (one may hold only recvs cancelled a moment ago) and the
    kept tensors' keys."""
    return sum(len(keys) for keys in table._steps.values()) + len(kept)
