"""What the four public classes share, as Protocols a type checker holds them to.

Each class is one of three shapes, made of two halves: the recvs, which wait
for their tensors (:class:`Receiving`, or :class:`AsyncReceiving` awaited),
and the rest, which does not (:class:`Control`, or :class:`AsyncControl`):

* ``rendezvous.Server`` and ``rendezvous.client.Client`` block in every call:
  :class:`Rendezvous`.
* ``rendezvous.aio.Server`` holds the waiting table on its own loop: a send,
  an abort or a look at what is pending is done within the call, on the
  loop's thread, and only its recvs are awaited: :class:`LoopRendezvous`.
* ``rendezvous.client.aio.Client`` asks its daemon for everything but its own
  counters, so it awaits all of that: :class:`AsyncRendezvous`.

Code written for either asyncio class takes :class:`AsyncReceiving`; code for
any of the four takes the half it uses. Each protocol lists the parameters
every class has; a class may take more (a server's recv also takes ``device``
and ``framework``). A recv's value is the tensor as it arrives: a numpy array
from a client; from a server numpy, or a cupy array or torch tensor when asked
for one; None when it is dead.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .keys import Key
from .items import Received

__all__ = ["SendItems", "Counts", "PendingRow", "Control", "AsyncControl", "Receiving", "AsyncReceiving",
           "Rendezvous", "AsyncRendezvous", "LoopRendezvous"]

#: ``send_many``'s items: ``(key, tensor)`` or ``(key, tensor, is_dead)`` tuples, or a mapping of key to tensor
SendItems = Iterable[tuple[Any, ...]] | Mapping[Key | str, Any]
#: ``stats()``: a server's counters per path (``{"grpc": {"transfers": 3, ...}, ...}``), a client's flat
#: (``{"recv_shm": 2, "local": 2, ...}``)
Counts = Mapping[str, "int | Mapping[str, int]"]


class PendingRow(Protocol):
    """One row of ``pending()``: a server's :class:`rendezvous.items.PendingEntry`,
    a client's :class:`rendezvous.client.LocalPending`."""

    @property
    def step_id(self) -> int: ...
    @property
    def key(self) -> Hashable: ...  # the canonical key string
    @property
    def kind(self) -> str: ...  # "tensor" (produced, not consumed), "waiter", and each class's own kinds
    @property
    def count(self) -> int: ...
    @property
    def oldest_age_s(self) -> float: ...


class Control(Protocol):
    """Producing, aborting and looking, each done when the call returns."""

    def send(self, key: Key | str, tensor: Any, step_id: int = 0, is_dead: bool = False) -> None:
        """Produce ``tensor`` under ``key`` for ``step_id``: handed to the oldest
        waiting recv or queued. InvalidKey for a malformed key; Aborted if the
        step was aborted."""
    def send_many(self, items: SendItems, step_id: int = 0) -> None:
        """Produce many tensors; every one is checked before any is sent."""
    def abort(self, step_id: int, message: str = "aborted") -> None:
        """Fail the step's waiting recvs, and its later sends and recvs, with Aborted."""
    def pending(self) -> Sequence[PendingRow]:
        """What waits: tensors produced and not consumed, recvs waiting, oldest first."""
    def stats(self) -> Counts:
        """Counters of what moved, and how."""


class AsyncControl(Protocol):
    """:class:`Control`, awaited (the asyncio client asks its daemon); ``stats``
    counts on the client itself and is not."""

    async def send(self, key: Key | str, tensor: Any, step_id: int = 0, is_dead: bool = False) -> None: ...
    async def send_many(self, items: SendItems, step_id: int = 0) -> None: ...
    async def abort(self, step_id: int, message: str = "aborted") -> None: ...
    async def pending(self) -> Sequence[PendingRow]: ...
    def stats(self) -> Counts: ...


class Receiving(Protocol):
    """Recvs that block until their tensors are here."""

    def recv(self, key: Key | str, step_id: int = 0, timeout: float | None = None) -> Any:
        """The tensor sent under ``key`` in ``step_id`` (None if dead), the oldest
        first. DeadlineExceeded after ``timeout`` seconds, with nothing taken;
        Aborted if the step is aborted; InvalidKey for a malformed key."""
    def recv_item(self, key: Key | str, step_id: int = 0, timeout: float | None = None) -> Received:
        """:meth:`recv` as ``Received(value, is_dead)``."""
    def recv_many(self, keys: Sequence[Key | str], step_id: int = 0, timeout: float | None = None) -> list[Any]:
        """The tensors of ``keys``, in key order, under one deadline: all of them,
        or an error and none taken."""
    def recv_many_items(self, keys: Sequence[Key | str], step_id: int = 0,
                        timeout: float | None = None) -> list[Received]:
        """:meth:`recv_many` as ``Received(value, is_dead)`` items."""


class AsyncReceiving(Protocol):
    """:class:`Receiving`, awaited: what both asyncio classes share."""

    async def recv(self, key: Key | str, step_id: int = 0, timeout: float | None = None) -> Any: ...
    async def recv_item(self, key: Key | str, step_id: int = 0, timeout: float | None = None) -> Received: ...
    async def recv_many(self, keys: Sequence[Key | str], step_id: int = 0,
                        timeout: float | None = None) -> list[Any]: ...
    async def recv_many_items(self, keys: Sequence[Key | str], step_id: int = 0,
                              timeout: float | None = None) -> list[Received]: ...
    def stats(self) -> Counts: ...


class Rendezvous(Control, Receiving, Protocol):
    """Every call blocks: ``rendezvous.Server``, ``rendezvous.client.Client``."""


class AsyncRendezvous(AsyncControl, AsyncReceiving, Protocol):
    """Every call but ``stats`` awaited: ``rendezvous.client.aio.Client``."""


class LoopRendezvous(Control, AsyncReceiving, Protocol):
    """Recvs awaited, the rest done on the loop's thread within the call:
    ``rendezvous.aio.Server``."""


if TYPE_CHECKING:  # each class against its protocol, for the type checker only (nothing is imported)
    from .client.aio import Client as _AsyncClient
    from .client.blocking import Client as _Client
    from .rank.blocking import Server as _Server
    from .rank.server import Server as _AsyncServer

    _blocking: tuple[type[Rendezvous], type[Rendezvous]] = (_Server, _Client)
    _on_loop: type[LoopRendezvous] = _AsyncServer
    _awaited: type[AsyncRendezvous] = _AsyncClient
    _asyncio: tuple[type[AsyncReceiving], type[AsyncReceiving]] = (_AsyncServer, _AsyncClient)
