"""Rank 0's side of a bootstrap: :class:`JoinTable`, the other ranks' joins.

Rank 0 serves ``/rendezvous.v1.Bootstrap/Join`` on its own port, behind the
same token and TLS as every other call there (a caller without the token is
refused with UNAUTHENTICATED before its message is read). A join says one
rank's address, and is taken only when:

* its job, world size and rank agree with rank 0's, and its address is a
  ``host:port`` with a bound port (INVALID_ARGUMENT otherwise);
* the address is on the caller's own host: its host is the caller's IP
  address, or a name that resolves to it (PERMISSION_DENIED otherwise), so
  nobody can point the job at a host it does not call from;
* no other rank, rank 0 included, has that address (ALREADY_EXISTS);
* the rank has not joined from another address. The first join of a rank
  is kept; a second one from another address, before the job formed, fails
  the whole formation: every waiting join and rank 0's ``start()`` end with
  ALREADY_EXISTS naming both addresses (rank 0 cannot tell which process is
  the rank, and a job formed with the wrong one would hand it the rank's
  tensors);
* the job has not formed yet: from then on Join is retired, and refused
  with FAILED_PRECONDITION, except that a rank repeating its own join (same
  address, from the same host: a retry after a broken connection) gets the
  same answer.

What a flood of joins can hold is bounded: an address for each of the
``world_size - 1`` ranks, at most :data:`MAX_WAITING_PER_RANK` joins of one
rank waiting at once, and :data:`MAX_RESOLVING` names being resolved
(RESOURCE_EXHAUSTED beyond). A refused join holds nothing.
"""

from __future__ import annotations

import asyncio
import copy
import ipaddress
import json
import socket
import urllib.parse
from collections.abc import Mapping
from typing import Any

import grpc

from rendezvous.cluster import parse_address
from rendezvous.errors import (AlreadyExists, FailedPrecondition, InvalidArgument, RendezvousError,
                               ResourceExhausted, Unavailable)

__all__ = ["JoinTable", "caller_address", "MAX_WAITING_PER_RANK", "SERVICE", "JOIN_METHOD"]

SERVICE = "rendezvous.v1.Bootstrap"
JOIN_METHOD = f"/{SERVICE}/Join"
_MAX_JOIN_BYTES = 64 << 10
#: joins of one rank that may wait at once for the job to form (a retry
#: while the broken call's end is not noticed yet needs a second)
MAX_WAITING_PER_RANK = 4
#: seconds a name in a join (or MASTER_ADDR) may take to resolve
_RESOLVE_S = 5.0
#: joins naming a host by name that may be resolving at once
MAX_RESOLVING = 16

IP = ipaddress.IPv4Address | ipaddress.IPv6Address


class NotTheCaller(RendezvousError):
    """A join naming an address on another host than the caller's."""

    code = grpc.StatusCode.PERMISSION_DENIED


def _plain(ip: IP) -> IP:
    """``ip``, an IPv4-mapped IPv6 address as the IPv4 address it maps."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _literal(host: str) -> IP | None:
    """``host`` as an IP address if it is one (``[v6]`` brackets and a zone
    allowed), else None."""
    text = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return _plain(ipaddress.ip_address(text.split("%", 1)[0]))
    except ValueError:
        return None


def caller_address(peer: str) -> IP | None:
    """The caller's IP address from gRPC's ``context.peer()``
    (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, also percent-encoded);
    None for anything else (a Unix socket)."""
    peer = urllib.parse.unquote(peer)
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6") or ":" not in rest:
        return None
    return _literal(rest.rsplit(":", 1)[0])


async def resolve(host: str) -> set[IP]:
    """Every IP address ``host`` names (itself if it is one); InvalidArgument if
    it cannot be resolved within a few seconds."""
    ip = _literal(host)
    if ip is not None:
        return {ip}
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(loop.getaddrinfo(host, None, type=socket.SOCK_STREAM), _RESOLVE_S)
    except (OSError, TimeoutError) as exc:
        raise InvalidArgument(f"cannot resolve {host!r}: {str(exc) or 'it took too long'}") from None
    found = {_literal(str(info[4][0])) for info in infos}
    return {a for a in found if a is not None}


class JoinTable:
    """Rank 0's side: the joins so far, answered all at once when the job forms."""

    def __init__(self, boot: Any, job_name: str) -> None:
        self.boot = boot
        self.job_name = job_name
        #: rank -> the address it joined with (rank 0's own from set_own)
        self.addresses: dict[int, str] = {}
        #: rank -> the incarnation of its server (0: none said)
        self.incarnations: dict[int, int] = {}
        #: (IP, port) -> the rank there, to refuse one address for two ranks
        self._where: dict[tuple[IP, int], int] = {}
        self._waiting: dict[int, int] = {}
        self._own: set[tuple[IP, int]] | None = None
        self._resolving = 0
        #: set once the job formed, or failed (then ``error`` says why)
        self.done = asyncio.Event()
        self.error: RendezvousError | None = None

    def set_own(self, address: str, incarnation: int = 0) -> None:
        self.addresses[0] = address
        self.incarnations[0] = incarnation
        self._check()

    def _check(self) -> None:
        if len(self.addresses) == self.boot.world_size and not self.done.is_set():
            self.done.set()

    def fail(self, error: RendezvousError) -> None:
        """End the formation: every join waiting, and every later one, gets ``error``."""
        if not self.done.is_set():
            self.error = error
            self.done.set()

    def missing(self) -> list[int]:
        return [r for r in range(self.boot.world_size) if r not in self.addresses]

    def answer(self) -> bytes:
        ranks = range(self.boot.world_size)
        return json.dumps({"addresses": [self.addresses[r] for r in ranks],
                           "incarnations": [self.incarnations.get(r, 0) for r in ranks]}).encode()

    # -- one join ------------------------------------------------------------

    def _fields(self, body: Mapping[str, Any]) -> tuple[int, str, str, int]:
        """(rank, address, host, port) of a join; InvalidArgument for a bad one."""
        job, rank, world, address = (body.get(k) for k in ("job", "rank", "world_size", "address"))
        incarnation = body.get("incarnation", 0)
        if type(incarnation) is not int or not 0 <= incarnation < 1 << 64:
            raise InvalidArgument(f"join with incarnation {incarnation!r}: not a number in [0, 2**64)")
        if job != self.job_name:
            raise InvalidArgument(f"join for job {job!r}; this bootstrap is job {self.job_name!r}")
        if world != self.boot.world_size:
            raise InvalidArgument(f"join with WORLD_SIZE {world!r}; rank 0 has {self.boot.world_size}")
        if type(rank) is not int or not 1 <= rank < self.boot.world_size:
            raise InvalidArgument(f"join from rank {rank!r}: not in [1, {self.boot.world_size})")
        if not isinstance(address, str):
            raise InvalidArgument("join without an address")
        try:
            host, port = parse_address(address)
        except RendezvousError as exc:
            raise InvalidArgument(f"join from rank {rank} with a bad address: {exc}") from None
        if port == 0:
            raise InvalidArgument(f"join from rank {rank} with port 0: join after binding")
        return rank, address, host, port

    async def _place(self, rank: int, address: str, host: str, port: int, peer: str) -> tuple[IP, int]:
        """Where the claimed address is, as (IP, port): the caller's own IP, which
        the claimed host must be or name; NotTheCaller otherwise."""
        caller = caller_address(peer)
        if caller is None:
            raise NotTheCaller(f"join from rank {rank} over {peer!r}: a join must come over TCP from the host "
                               "it names")
        if _literal(host) is None and self._resolving >= MAX_RESOLVING:
            raise ResourceExhausted(f"join from rank {rank}: {self._resolving} joins naming their host by name are "
                                    "being resolved already")
        self._resolving += 1
        try:
            ips = await resolve(host)
        finally:
            self._resolving -= 1
        if any(ip.is_unspecified for ip in ips):
            raise InvalidArgument(f"join from rank {rank} with {address}: a wildcard is no address other ranks "
                                  "can reach")
        if caller not in ips:
            raise NotTheCaller(f"join from rank {rank} claims {address}, but comes from {caller}: a rank joins "
                               "with an address of the host it calls from")
        return caller, port

    async def _own_places(self) -> set[tuple[IP, int]]:
        if self._own is None:
            try:
                ips = await resolve(self.boot.master_addr)
            except InvalidArgument:
                ips = set()
            self._own = {(ip, self.boot.master_port) for ip in ips}
        return self._own

    def _record(self, rank: int, address: str, place: tuple[IP, int], incarnation: int = 0) -> None:
        """Take a checked join before the job formed (a repeat changes nothing)."""
        holder = self._where.get(place)
        if holder is not None and holder != rank:
            raise AlreadyExists(f"join from rank {rank} with {address}: rank {holder} joined there already "
                                "(one address, two ranks)")
        known = self.addresses.get(rank)
        if known is not None and known != address:
            error = AlreadyExists(f"rank {rank} joined at {known}, and now {address} claims it: two processes "
                                  "with the same RANK, or a join that is not the rank's; the job does not form")
            self.fail(error)
            raise error
        self.addresses[rank] = address
        self.incarnations[rank] = incarnation
        self._where[place] = rank
        self._check()

    async def join(self, body: Mapping[str, Any], peer: str) -> bytes:
        """Take one join from ``peer`` (gRPC's ``context.peer()``) and, once the job
        formed, answer every rank's address; raises the refusal otherwise."""
        rank, address, host, port = self._fields(body)
        place = await self._place(rank, address, host, port, peer)
        if place in await self._own_places():
            raise AlreadyExists(f"join from rank {rank} with {address}: that is rank 0's own address")
        if self.done.is_set():
            if self.error is not None:
                raise copy.copy(self.error)
            if self.addresses.get(rank) == address and self._where.get(place) == rank:
                return self.answer()  # a retry of the rank's own join
            raise FailedPrecondition(f"join from rank {rank} with {address}: the job formed already (rank {rank} "
                                     f"is at {self.addresses[rank]}); joins are taken only before")
        waiting = self._waiting.get(rank, 0)
        if waiting >= MAX_WAITING_PER_RANK:
            raise ResourceExhausted(f"rank {rank} has {waiting} joins waiting already")
        self._record(rank, address, place, body.get("incarnation", 0))
        self._waiting[rank] = waiting + 1
        try:
            await self.done.wait()
        finally:
            left = self._waiting[rank] - 1
            if left:
                self._waiting[rank] = left
            else:
                del self._waiting[rank]
        if self.error is not None:
            raise copy.copy(self.error)
        return self.answer()

    def handlers(self) -> grpc.GenericRpcHandler:
        async def join(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            if len(request) > _MAX_JOIN_BYTES:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "join message too large")
            try:
                body = json.loads(request)
                if not isinstance(body, dict):
                    raise ValueError("not an object")
            except (ValueError, UnicodeDecodeError) as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"join is not a JSON object: {exc}")
            try:
                return await self.join(body, context.peer())
            except RendezvousError as exc:
                await context.abort(exc.code, str(exc))
            raise AssertionError("unreachable")  # context.abort raises

        handler: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(
            join, request_deserializer=None, response_serializer=None)
        return grpc.method_handlers_generic_handler(SERVICE, {"Join": handler})


def never_joined(table: JoinTable, limit: float, target: str) -> Unavailable:
    """The error of a formation that ran out of time."""
    return Unavailable(f"rank(s) {', '.join(map(str, table.missing()))} of {table.boot.world_size} never joined "
                       f"at {target} within {limit:g}s (connect_timeout)")
