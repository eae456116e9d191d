"""A rank server's peers: :class:`Peers`, one :class:`~rendezvous.rpc.peer.PeerClient` per producer.

A client is made the first time a recv names a task as its producer (and
its channel opened on that recv's loop), over gRPC or, between ranks of one
MPI job with requests over MPI, over MPI (``open_call``). Every remote recv
waiting is known by its step, so aborting or cleaning up a step ends them
with the step's error rather than a bare cancellation.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from rendezvous.codec.requests import release_request
from rendezvous.errors import RendezvousError
from rendezvous.keys import TaskName
from rendezvous.rpc.peer import PeerClient
from rendezvous.transport import Fetched

__all__ = ["Peers"]


T = TypeVar("T")

log = logging.getLogger("rendezvous")


class _StepEnded:
    """The cancel message of a remote recv whose step was aborted or cleaned up
    (not a cancel by its caller): the recv raises ``error`` instead."""

    __slots__ = ("error",)

    def __init__(self, error: RendezvousError) -> None:
        self.error = error


class Peers:
    """The peer clients of one rank server, and its remote recvs by step."""

    def __init__(self, make: Callable[[TaskName], PeerClient]) -> None:
        self._make = make
        self._clients: dict[TaskName, PeerClient] = {}
        self._waiting: dict[int, set[asyncio.Task]] = {}

    def get(self, task: TaskName) -> PeerClient:
        client = self._clients.get(task)
        if client is None:
            client = self._clients[task] = self._make(task)
        return client

    def release(self, producer: str, export_ids: list[int], failed: bool) -> None:
        """Tell ``producer`` this rank is done with its CUDA IPC exports (see
        rendezvous.ipc), on the live stream to it; with none, the producer drops
        them once this process is gone."""
        client = self._clients.get(TaskName.parse(producer))  # (asked it before, or nothing to release)
        stream = client.live_stream() if client is not None else None
        if stream is not None:
            stream.send(release_request(export_ids, failed))
        else:
            log.info("no stream to %s to release its CUDA IPC exports %s on", producer, export_ids)

    def values(self) -> list[PeerClient]:
        return list(self._clients.values())

    def __getitem__(self, task: TaskName) -> PeerClient:
        return self._clients[task]

    def __iter__(self) -> Any:
        return iter(self._clients)

    def __len__(self) -> int:
        return len(self._clients)

    def recv(self, task: TaskName, key: str, step_id: int, timeout: float | None,
             placement: Any) -> Awaitable[Fetched]:
        """``key`` of ``step_id`` from ``task``'s server, to await at once (no
        coroutine of its own). An abort or cleanup of the step meanwhile raises
        the step's error."""
        return self._for_step(step_id, self.get(task).recv(key, step_id, timeout, placement))

    async def recv_batch(self, task: TaskName, keys: Sequence[str], step_id: int, placement: Any,
                         arrived: set[int] | None = None) -> list[Fetched]:
        """``keys`` of ``step_id`` from ``task``'s server, asked at once
        (:meth:`PeerClient.recv_batch`); an abort or cleanup of the step meanwhile
        raises the step's error."""
        return await self._for_step(step_id, self.get(task).recv_batch(keys, step_id, placement, arrived))

    async def _for_step(self, step_id: int, fetching: Awaitable[T]) -> T:
        """Await ``fetching`` as a wait of ``step_id``: :meth:`end_step` ends it."""
        current = asyncio.current_task()
        waits = self._waiting.setdefault(step_id, set())
        waits.add(current)  # type: ignore[arg-type]
        try:
            return await fetching
        except asyncio.CancelledError as exc:
            if exc.args and isinstance(exc.args[0], _StepEnded):
                current.uncancel()  # type: ignore[union-attr]
                raise copy.copy(exc.args[0].error) from None
            raise
        finally:
            waits.discard(current)
            if not waits:
                self._waiting.pop(step_id, None)

    def end_step(self, step_id: int, error: RendezvousError) -> None:
        """Every remote recv of ``step_id`` still waiting raises ``error``."""
        for task in list(self._waiting.get(step_id, ())):
            task.cancel(_StepEnded(error))

    async def close(self) -> None:
        """Close every client (their recvs fail with UNAVAILABLE)."""
        for client in list(self._clients.values()):
            await client.close()
        self._clients.clear()
