"""What waits in a rank server, row by row: :func:`walk`.

The rows are :class:`~rendezvous.items.PendingEntry`: each non-empty queue of
the waiting table (``"tensor"``: produced here and not consumed;
``"waiter"``: a recv waiting here for its tensor), then each key whose
fetched tensors the server keeps for the next recv (``"kept"``, see
:mod:`rendezvous.rank.kept`). The walk is lazy: a caller that wants a few
rows (Admin's ``Pending``) does the work of those rows only, whatever the
table holds. Take its rows without awaiting in between (the table and the
kept tensors change on the loop).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rendezvous.table import WaitingTable
from rendezvous.items import PendingEntry

__all__ = ["walk", "count"]


def walk(table: WaitingTable, kept: Any) -> Iterator[PendingEntry]:
    """The table's rows (steps in the order they began, keys in the order their
    queue formed), then the kept tensors' (``kept``: a :class:`~rendezvous.rank.kept.Kept`),
    each aged from when its key began to hold them."""
    yield from table.iter_pending()
    for step_id, key, n, age in kept.rows():
        yield PendingEntry(step_id, key, "kept", n, age)


def count(table: WaitingTable, kept: Any) -> int:
    """How many rows :func:`walk` gives at most, counted without walking them: the
    table's queues (one may hold only recvs cancelled a moment ago) and the
    kept tensors' keys."""
    return table.queue_count() + len(kept)
