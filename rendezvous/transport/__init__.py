"""The data-plane contract: how a found tensor's bytes reach the consumer.

A recv is always asked for over the control plane (a ``RecvTensorRequest`` on
the peer's gRPC stream). What happens to the tensor's bytes once the producer
has it is up to a *data plane*. Each plane does four things, and nothing
outside the planes knows which one moved a tensor:

* **offer** (consumer): what a request carries so the producer can use this
  plane (``RecvTensorRequest.transport_options``), or ``None``;
* **plan** (producer): given the request and the produced tensor, a
  :class:`Reply` if this plane will carry it, else ``None``;
* **receive** (consumer): given a reply's first frame, an :class:`Arrival`:
  the tensor, an assembly that more frames complete, or an awaitable for bytes
  that come another way;
* **drain** (consumer): a reply nobody waits for any more: make sure its
  bytes cannot be mistaken for a later transfer's.

:class:`Planes` holds a server's planes in order of preference, the inline
plane last (it can carry anything), and picks one per reply: the producer by
asking each in turn, the consumer by the type URL a descriptor names.
Implementations: :class:`rendezvous.transport.inline.InlinePlane` (the bytes
inside the gRPC reply) and :class:`rendezvous.mpi.plane.MpiPlane` (a
descriptor over gRPC, the bytes over MPI).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from rendezvous.codec import fields, wire
from rendezvous.errors import Internal
from rendezvous.paths import Path
from rendezvous.items import Received

__all__ = ["Path", "Reply", "Carry", "Arrival", "Fetched", "DataPlane", "Planes", "descriptor_type"]


@dataclass(slots=True)
class Reply:
    """How one produced tensor answers one request (made by a plane's ``plan``).

    ``stream_frames(call_id)`` yields the ``StreamResponse`` frames (bytes, or
    :class:`rendezvous.codec.wire.Pieces` for a large one, joined by the stream's
    writer); ``unary()``
    is the whole ``RecvTensorResponse``. ``item`` is what goes back to the
    table if the reply is dropped before its first frame is written; a
    *committed* reply (its bytes already on their way) has none and is always
    delivered. ``prepare``, when set, must be awaited first: it returns the
    reply to send (a GPU tensor copied to the host, for instance); such a
    reply's ``host`` is that host copy, which the producer's retry cache
    keeps in place of the device tensor (see ``RetryCache.on_host``).

    ``carry``, when set, is the transfer a descriptor announces: started by
    the stream as it hands the descriptor over (never before: a descriptor
    that never leaves must not leave its bytes waiting in the network for a
    receive nobody will post), or released, with ``item`` put back, if the
    reply is dropped first. A stream-less caller (``unary``) must not use
    such a reply."""

    path: Path
    stream_frames: Callable[[int], Iterator[Any]]
    unary: Callable[[], bytes]
    item: Received | None
    prepare: Callable[[], Awaitable["Reply"]] | None = None
    carry: "Carry | None" = None
    host: Received | None = None

    @property
    def committed(self) -> bool:
        return self.item is None


class Carry(NamedTuple):
    """A transfer a descriptor announces, planned but not started: ``start()``
    once the descriptor is handed to its stream (it may raise: then nothing
    was started, and the reply is answered with that error), or
    ``release()`` if the reply is dropped unsent. Exactly one of them is
    called, once. ``options``: the ``Any`` that announces it (a group
    frame's ``transport_options``)."""

    options: bytes
    start: Callable[[], None]
    release: Callable[[], None]


class Arrival(NamedTuple):
    """What a consumer makes of a reply's first frame: exactly one of ``value``
    (the whole tensor is here), ``assembly`` (later ``chunk`` frames complete
    it: ``add(chunk)`` returns True when whole, then ``result()``) or
    ``pending`` (the bytes come another way; await it for the tensor).
    ``placed``: the tensor already sits where the recv asked for it."""

    path: Path
    value: Any = None
    assembly: Any = None
    pending: Awaitable[Any] | None = None
    placed: bool = False


class Fetched(NamedTuple):
    """A remote recv's result: the item, the path it took, and whether it is
    already on the recv's placement (else the caller still places it)."""

    item: Received
    path: Path
    placed: bool = False


class DataPlane(ABC):
    """One way to move a reply's tensor bytes. See the module docstring."""

    #: the path this plane's transfers are counted under
    path: ClassVar[Path]
    #: type URL of the ``google.protobuf.Any`` its descriptors carry in
    #: ``RecvTensorResponse.transport_options``; "" for a plane whose bytes
    #: travel inside the reply itself
    descriptor_url: ClassVar[str] = ""

    #: whether this plane's offer carries the next plane's inside it (see
    #: :meth:`wrap`, :meth:`inner`): a request carries one ``Any``
    wraps_offers: ClassVar[bool] = False

    def offer(self, placement: Any) -> bytes | None:
        """What a request for a tensor bound for ``placement`` carries for this
        plane (an encoded ``Any``), or None."""
        return None

    def wrap(self, offer: bytes, rest: bytes | None) -> bytes:
        """A wrapping plane's ``offer`` with ``rest`` (the next plane's) inside it."""
        return offer

    def inner(self, options: Any) -> Any | None:
        """The next plane's offer inside a request's ``options`` that this
        (wrapping) plane's offer made, or None when they are not its."""
        return None

    def released(self, export_ids: Any, failed: bool) -> None:
        """A consumer is done with what this plane exported for it (IPC)."""

    @abstractmethod
    def plan(self, request: Any, item: Received) -> Reply | None:
        """A reply carrying ``item`` to the consumer that sent ``request``, or
        None if this plane cannot carry it. A committed reply's transfer is
        posted before this returns; a reply with a ``carry`` is started by
        the stream that hands it over."""

    @abstractmethod
    def receive(self, reply: bytes, head: Any, placement: Any) -> Arrival:
        """Start receiving the reply whose first frame is ``reply`` (``head`` is
        its parsed :class:`rendezvous.codec.parsing.ReplyHead`), bound for ``placement``."""

    def drain(self, reply: bytes, head: Any) -> None:
        """A reply for a recv that no longer waits: take its bytes and drop them.
        Nothing to do where the bytes travel in the reply itself."""

    def plan_group(self, request: Any, arrays: Sequence[Any], layout: Any) -> Carry | None:
        """Carry the payload of a group reply (:mod:`rendezvous.codec.groups`: ``arrays``
        packed by ``layout``) for the consumer that sent ``request``: the
        transfer, planned (started when the group frame is handed over), or
        None (the payload travels inside the frame)."""
        return None

    def receive_group(self, reply: bytes, group: Any) -> "asyncio.Future[Any]":
        """The payload of a group whose ``transport_options`` name this plane:
        an awaitable for a uint8 buffer of ``group.nbytes``, the tensors at
        ``group.offsets``. Its bytes come even if nobody waits any more."""
        raise Internal(f"{type(self).__name__} carries no group payloads")

    def close(self) -> None:
        """Release what the plane holds; called once the server has stopped."""


def descriptor_type(reply: bytes, span: tuple[int, int]) -> str:
    """The type URL of the ``Any`` at ``span`` in ``reply`` (field 1), without
    parsing the rest of it."""
    for num, wt, a, b in wire.iter_fields(reply, *span):
        if num == fields.ANY_TYPE_URL and wt == wire.LEN:
            return bytes(reply[a:b]).decode("utf-8", "replace")
    return ""


class Planes:
    """A server's data planes in order of preference; the last is the inline
    plane, which carries anything."""

    def __init__(self, planes: Sequence[DataPlane]) -> None:
        if not planes or planes[-1].descriptor_url:
            raise ValueError("the last data plane must carry tensors inline")
        self.planes = tuple(planes)
        self.inline = planes[-1]
        self._by_url = {p.descriptor_url: p for p in planes if p.descriptor_url}
        self._wrapping = any(p.wraps_offers for p in planes)

    def register(self, plane: DataPlane) -> None:
        """Add ``plane``, preferred over the ones already here (the inline plane
        stays last, a plane that wraps offers first). A server registers its
        MPI plane once MPI is up."""
        if not plane.descriptor_url:
            raise ValueError("only one plane carries tensors inline")
        # a wrapping plane stays first: it hands on, inside its offer, what it cannot carry
        first = 0 if plane.wraps_offers else sum(1 for p in self.planes if p.wraps_offers)
        self.planes = (*self.planes[:first], plane, *self.planes[first:])
        self._by_url[plane.descriptor_url] = plane
        self._wrapping = self._wrapping or plane.wraps_offers

    def offer(self, placement: Any) -> bytes | None:
        """The request's ``transport_options``: the first plane's offer that is
        not None (a request carries one ``Any``)."""
        if self._wrapping:
            return _first_offer(self.planes, placement)
        for plane in self.planes:
            offered = plane.offer(placement)
            if offered is not None:
                return offered
        return None

    def plan(self, request: Any, item: Received) -> Reply:
        """The reply for ``item``: the first plane that will carry it (the planes
        after a wrapping one see the offer inside its own)."""
        if not item.is_dead:
            for plane in self.planes[:-1]:
                reply = plane.plan(request, item)
                if reply is not None:
                    return reply
                if plane.wraps_offers:
                    request = _unwrapped(plane, request)
        elif self._wrapping:
            request = self._unwrap(request)
        reply = self.inline.plan(request, item)
        assert reply is not None, "the inline plane carries every tensor"
        return reply

    def _unwrap(self, request: Any) -> Any:
        for plane in self.planes:
            if plane.wraps_offers:
                request = _unwrapped(plane, request)
        return request

    def plan_group(self, request: Any, arrays: Sequence[Any], layout: Any) -> tuple[Path, Carry | None]:
        """How a group reply's payload travels: the first plane that carries it
        (its path, and the planned transfer), else inside the frame."""
        if self._wrapping:
            request = self._unwrap(request)
        for plane in self.planes[:-1]:
            carry = plane.plan_group(request, arrays, layout)
            if carry is not None:
                return plane.path, carry
        return self.inline.path, None

    def receive_group(self, reply: bytes, group: Any) -> tuple[Path, "asyncio.Future[Any]"]:
        """The payload of a group announced another way (see DataPlane.receive_group),
        and the path of the plane that moves it."""
        plane = self._by_span(reply, group.transport_options)
        return plane.path, plane.receive_group(reply, group)

    def for_reply(self, reply: bytes, head: Any) -> DataPlane:
        """The plane a reply's first frame belongs to."""
        return self._by_span(reply, head.transport_options)

    def _by_span(self, reply: bytes, span: tuple[int, int] | None) -> DataPlane:
        if span is None:
            return self.inline
        url = descriptor_type(reply, span)
        plane = self._by_url.get(url)
        if plane is None:
            raise Internal(f"reply names a transport this server does not have: {url!r}")
        return plane

    def receive(self, reply: bytes, head: Any, placement: Any) -> Arrival:
        return self.for_reply(reply, head).receive(reply, head, placement)

    #: whether :meth:`answered` listens (a timeline records): else callers skip it
    traced = False

    def answered(self, placements: list[Any], moving: bool) -> None:
        """The recvs bound for ``placements`` were answered by one group reply
        (``moving``: their bytes still come another way). Only a timeline listens."""

    def drain(self, reply: bytes, head: Any) -> None:
        try:
            plane = self.for_reply(reply, head)
        except Internal:
            return  # nothing of ours is in flight for a transport we do not know
        plane.drain(reply, head)

    def released(self, export_ids: Any, failed: bool) -> None:
        for plane in self.planes:
            plane.released(export_ids, failed)

    def close(self) -> None:
        for plane in self.planes:
            plane.close()


def _first_offer(planes: Sequence[DataPlane], placement: Any) -> bytes | None:
    """The first of ``planes``' offers that is not None, a wrapping plane's with
    the rest's inside it."""
    for i, plane in enumerate(planes):
        offered = plane.offer(placement)
        if offered is not None:
            return plane.wrap(offered, _first_offer(planes[i + 1:], placement)) if plane.wraps_offers else offered
    return None


class _Unwrapped:
    """A request as the planes after a wrapping one see it: its
    ``transport_options`` the offer inside the wrapping plane's."""

    __slots__ = ("_request", "transport_options")

    def __init__(self, request: Any, options: Any) -> None:
        self._request = request
        self.transport_options = options

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


def _unwrapped(plane: DataPlane, request: Any) -> Any:
    inner = plane.inner(request.transport_options)
    return request if inner is None else _Unwrapped(request, inner)
