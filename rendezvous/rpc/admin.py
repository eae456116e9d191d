"""Administration of a running rank server: the ``rendezvous.v1.Admin`` service
(``Stats``, ``Pending``) and the standard ``grpc.health.v1.Health`` service.

Every rank server carries one :class:`Admin` on its port, and a daemon one
more on its local socket: ``rendezvous stats``, ``rendezvous pending`` and
``rendezvous health`` (and ``grpc_health_probe``, Kubernetes' gRPC probe)
ask them. Health is gRPC's own servicer (``grpcio-health-checking``): the
overall status ``""`` and each name in :attr:`Admin.health_names` are SERVING
once the server says so (:meth:`Admin.set_serving`), and NOT_SERVING for good
from the moment it drains.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rendezvous.errors import InvalidArgument, RendezvousError, to_status
from rendezvous.keys import parse_key
from rendezvous.v1 import admin_pb2 as apb
from rendezvous.v1 import local_pb2 as lpb

from .options import SERVICE as RANK_SERVICE

__all__ = ["Admin", "ADMIN_SERVICE", "HEALTH_SERVICE", "PENDING_BYTES", "PENDING_ROWS", "pending_entries",
           "bounded_pending", "PendingSource"]

ADMIN_SERVICE = apb.DESCRIPTOR.services_by_name["Admin"].full_name  # rendezvous.v1.Admin
HEALTH_SERVICE = "grpc.health.v1.Health"
#: a Pending answer lists at most this many bytes of entries, and says how many it left out
PENDING_BYTES = 1 << 20
#: a Pending answer is made from at most this many rows, however many wait:
#: its cost does not grow with the table
PENDING_ROWS = 1000
#: what answers Pending: ``source(limit)`` -> (at most ``limit`` entries, how
#: many rows there are in all, counted without building them)
PendingSource = Callable[[int], "tuple[list[lpb.PendingEntry], int]"]

log = logging.getLogger("rendezvous.server")


def pending_entries(server: Any, limit: int | None = None) -> list[lpb.PendingEntry]:
    """A rank server's pending rows (its waiting table, then its kept tensors;
    the first ``limit`` only, when given) as PendingEntry messages, each with
    the task that produces its key."""
    me = str(server.task)
    producers: dict[str, str] = {}  # a key's producer follows from its source device, its first field
    out = []
    for e in server.pending(limit):
        key = str(e.key)
        source = key.split(";", 1)[0]
        producer = producers.get(source)
        if producer is None:
            try:
                producer = str(parse_key(key).src_task or me)
            except RendezvousError:
                producer = me
            producers[source] = producer
        out.append(lpb.PendingEntry(step_id=e.step_id, rendezvous_key=key, kind=e.kind, count=e.count,
                                    oldest_age_seconds=e.oldest_age_s, producer=producer))
    return out


def rank_pending(server: Any) -> PendingSource:
    """A rank server's rows as a :data:`PendingSource`."""
    return lambda limit: (pending_entries(server, limit), server.pending_count())


def _age(entry: lpb.PendingEntry) -> float:
    return entry.oldest_age_seconds


def bounded_pending(entries: Iterable[lpb.PendingEntry], max_bytes: int = PENDING_BYTES, *,
                    total: int | None = None, rows: int = PENDING_ROWS) -> lpb.PendingResponse:
    """One answer of at most about ``max_bytes`` and ``rows`` entries, the oldest
    first, and how many were left out (of ``total``, when ``entries`` are not all
    the rows there are). From a list the oldest ``rows`` are chosen; from any
    other iterable only its first ``rows`` are read."""
    if isinstance(entries, list):
        total = max(total or 0, len(entries))
        chosen = heapq.nlargest(rows, entries, key=_age)
    else:
        chosen = sorted(itertools.islice(entries, rows), key=_age, reverse=True)
        total = max(total or 0, len(chosen))
    reply = lpb.PendingResponse()
    size = 0
    for entry in chosen:
        size += entry.ByteSize() + 4
        if size > max_bytes:
            break
        reply.entries.append(entry)
    reply.omitted = total - len(reply.entries)
    return reply


class Admin:
    """The Admin and Health services of one rank server (``rendezvous.aio.Server``:
    its ``task``, ``protocol``, ``stats()``, ``pending()`` and ``table``).

    ``pending``: what a Pending call lists (a :data:`PendingSource`; default:
    the server's waiting table and kept tensors); ``extra_stats``: what a Stats
    call adds under ``daemon`` (default: nothing). A daemon sets both
    (:meth:`provide`) to answer for the node. ``health_names``: the services
    health reports besides ``""``. Every service here but health is behind the
    port's token, when it has one (:mod:`rendezvous.auth`)."""

    def __init__(self, server: Any, *, pending: PendingSource | None = None,
                 extra_stats: Callable[[], dict[str, Any]] | None = None,
                 health_names: tuple[str, ...] = (RANK_SERVICE, ADMIN_SERVICE)) -> None:
        self.server = server
        self._pending = pending
        self._extra_stats = extra_stats
        self.health_names = list(health_names)
        #: gRPC's health servicer (grpc.health.v1.Health)
        self.health = health.aio.HealthServicer()

    def provide(self, *, pending: PendingSource | None = None,
                extra_stats: Callable[[], dict[str, Any]] | None = None) -> None:
        """Answer Pending from ``pending()`` and add ``extra_stats()`` to Stats."""
        if pending is not None:
            self._pending = pending
        if extra_stats is not None:
            self._extra_stats = extra_stats

    # -- registration -------------------------------------------------------

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        """The Admin service, as generic handlers (health is added by :meth:`add_to`)."""
        return [grpc.method_handlers_generic_handler(ADMIN_SERVICE, {
            "Stats": grpc.unary_unary_rpc_method_handler(self._unary(apb.StatsRequest, self.stats)),
            "Pending": grpc.unary_unary_rpc_method_handler(self._unary(lpb.PendingRequest, self.pending)),
        })]

    def add_to(self, grpc_server: grpc.aio.Server) -> None:
        """Register Admin and Health on ``grpc_server`` (before it starts)."""
        grpc_server.add_generic_rpc_handlers(self.handlers())
        health_pb2_grpc.add_HealthServicer_to_server(self.health, grpc_server)

    @property
    def service_names(self) -> list[str]:
        """The services :meth:`add_to` registers (what reflection may list)."""
        return [ADMIN_SERVICE, HEALTH_SERVICE]

    async def set_serving(self, serving: bool) -> None:
        """SERVING for ``""`` and every name in :attr:`health_names`; or, once
        the server drains, NOT_SERVING for all of them, for good."""
        if not serving:
            await self.health.enter_graceful_shutdown()
            return
        for name in ("", *self.health_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def set_status(self, name: str, serving: bool) -> None:
        """One name's status (ignored once the server drains); the name joins
        :attr:`health_names`."""
        if name and name not in self.health_names:
            self.health_names.append(name)
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(name, status)

    # -- answers -------------------------------------------------------------

    def stats(self) -> apb.StatsResponse:
        """What Stats answers now."""
        server = self.server
        reply = apb.StatsResponse(task=str(server.task), protocol=str(server.protocol))
        reply.paths.update(server.stats())
        reply.table.update(server.table.stats())
        if self._extra_stats is not None:
            reply.daemon.update(self._extra_stats())
        return reply

    def pending(self, max_bytes: int = PENDING_BYTES, rows: int = PENDING_ROWS) -> lpb.PendingResponse:
        """What Pending answers now: at most about ``max_bytes`` of entries, made
        from at most ``rows`` rows (the first the source gives: the table's
        oldest steps and keys first), the oldest of them first, and how many
        rows were left out."""
        source = self._pending if self._pending is not None else rank_pending(self.server)
        entries, total = source(rows)
        return bounded_pending(iter(entries), max_bytes, total=total, rows=rows)

    def _unary(self, request_type: Any, answer: Callable[[], Any]) -> Callable[..., Awaitable[bytes]]:
        """A handler that checks its request is a ``request_type`` and answers
        ``answer()``; a malformed request is INVALID_ARGUMENT."""
        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                request_type.FromString(request)
                return answer().SerializeToString()
            except DecodeError as exc:
                await context.abort(*to_status(InvalidArgument(f"malformed {request_type.__name__}: {exc}")))
            except Exception as exc:
                await context.abort(*self._error(exc))

        return handle

    @staticmethod
    def _error(exc: BaseException) -> tuple[grpc.StatusCode, str]:
        if not isinstance(exc, RendezvousError):
            log.error("admin call failed", exc_info=exc)
        return to_status(exc)
