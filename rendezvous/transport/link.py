"""How a rank reaches the other ranks of its job besides gRPC: :class:`RankLink`.

A rank server holds exactly one link, chosen once when it is built
(:func:`rendezvous.rank.links.choose`): :class:`GrpcOnly` when every byte
goes over gRPC, or the MPI half of the rank (``rendezvous.mpi.rank.MpiRank``)
under ``protocol="grpc+mpi"``. The server starts, describes, counts and
stops it without knowing which it is: a link may add a data plane (the
optimal path), a way to open request streams to some tasks (requests over
MPI), and the addresses of the ranks it found at start.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from rendezvous.keys import TaskName

from . import DataPlane

__all__ = ["RankParts", "RankLink", "GrpcOnly"]

T = TypeVar("T")


@dataclass(frozen=True)
class RankParts:
    """What a rank server hands its link at start: the producer's servicer, the
    counters, the receive buffers, the GPU backends, and the callbacks of
    transfers that end (``delivered(request_id)``: a reply's bytes were
    received; ``aborted(request, item)``: a send gave up and its tensor goes
    back); ``loop_polls``: see ``aio.Server.poll_on_loop``."""

    servicer: Any
    stats: Any
    buffers: Any
    devices: Any
    delivered: Callable[[int], None]
    aborted: Callable[[Any, Any], None]
    loop_polls: bool | str


class RankLink(Protocol):
    """A rank's way to the other ranks of its job beyond its gRPC server."""

    @property
    def ranks(self) -> Mapping[TaskName, int]:
        """The rank of every task the link reaches (empty until started, and for gRPC only)."""
    @property
    def plane(self) -> DataPlane | None:
        """The data plane the link adds (registered by the server once started), or None."""
    @property
    def attends(self) -> bool:
        """Whether :meth:`attending` may do anything (False: a caller's wait is
        left as it is, with no call of the link's)."""

    async def start(self, task: TaskName, address: str, incarnation: int,
                    parts: RankParts) -> dict[TaskName, tuple[str, int]]:
        """Start (with MPI, a collective that every rank reaches); the address and
        incarnation of each task the link found (none for gRPC only)."""

    def open_call(self, task: TaskName) -> Callable[[], Any] | None:
        """How a peer client opens its request stream to ``task`` through the
        link, or None: over gRPC."""

    def describe(self) -> str:
        """The link's part of the server's start-up line ("" for none)."""

    def stats(self) -> dict[str, int]:
        """``in_flight`` (transfers posted and not complete) and ``cuda_aware``."""

    def attending(self, waited: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
        """``waited``, awaited while a caller in another thread blocks on it (the
        link may poll its transfers on the loop meanwhile)."""

    def rest(self) -> None:
        """Go to the idle pace at once: no traffic is expected for a while (the
        bench does this between a contender's batches)."""

    async def close_requests(self) -> None:
        """End the request streams the link serves (the server is draining)."""

    async def stop(self, grace: float) -> None:
        """Let transfers in flight finish for up to ``grace`` seconds, then stop."""


class GrpcOnly:
    """The link of a rank whose every byte goes over gRPC: it adds nothing.
    ``note`` is its part of the start-up line (why there is no other)."""

    plane: DataPlane | None = None
    attends = False  # nothing to poll: a caller's wait stays as it is

    def __init__(self, note: str = "") -> None:
        self.note = note
        self.ranks: Mapping[TaskName, int] = {}

    async def start(self, task: TaskName, address: str, incarnation: int,
                    parts: RankParts) -> dict[TaskName, tuple[str, int]]:
        return {}

    def open_call(self, task: TaskName) -> Callable[[], Any] | None:
        return None

    def describe(self) -> str:
        return self.note

    def stats(self) -> dict[str, int]:
        return {"in_flight": 0, "cuda_aware": 0}

    def attending(self, waited: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
        return waited

    def rest(self) -> None:
        return None

    async def close_requests(self) -> None:
        return None

    async def stop(self, grace: float) -> None:
        return None
