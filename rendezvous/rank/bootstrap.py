"""Jobs without MPI, from one known address: every rank but the first binds port 0.

A launcher such as ``torchrun`` tells each process four things:
``MASTER_ADDR`` and ``MASTER_PORT`` (where rank 0 can be reached), ``RANK``
and ``WORLD_SIZE``. That is enough for a whole cluster: rank 0 serves at the
known address; every other rank binds an OS-chosen port on the address its
host uses to reach rank 0, and then *joins*: one unary call
(``/rendezvous.v1.Bootstrap/Join``, a small JSON body) to rank 0's server,
saying its rank and address. Rank 0 answers every join once all
``WORLD_SIZE - 1`` ranks have joined, with the address of each, and from
then on every rank's cluster is complete. Under ``grpc+mpi`` inside
``mpiexec``, MPI's own exchange (``rendezvous.mpi.world``) does the same and
this is not needed.

Under ``torchrun`` itself (``TORCHELASTIC_USE_AGENT_STORE=True``) torch's
agent already listens at ``MASTER_ADDR:MASTER_PORT``, hosting a TCPStore
for the job: then every rank, rank 0 too, binds port 0, and the addresses
go through that store (torch is installed wherever torchrun runs; it is
imported only then). A program that calls ``torch.distributed``'s
``init_process_group`` itself outside torchrun has torch's rank 0 listening
at ``MASTER_PORT`` too: give rendezvous another port with
``RENDEZVOUS_MASTER_PORT``.

Rank 0's collection is bounded by ``connect_timeout``: a rank that never
joins fails every rank's ``start()`` with UNAVAILABLE naming the missing
ranks. Join is served behind the same token and TLS as every call to rank
0's port, and the joiner sends the token and uses TLS as a peer does; what
rank 0 takes (an address on the caller's own host, never one another rank
has, the first claim of each rank, and nothing once the job formed) is
:mod:`rendezvous.rank.joins`.

Through torchrun's store the addresses are exchanged as torch has them: the
store has no authentication. With a token set, each rank signs its entry
with it and checks every other rank's signature, so a process without the
token cannot point the job at itself there either.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import hmac
import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from rendezvous.cluster import parse_address
from rendezvous.errors import InvalidArgument, Unauthenticated, Unavailable, from_status

from .joins import JOIN_METHOD, SERVICE, JoinTable, never_joined

__all__ = ["Bootstrap", "JoinTable", "JOIN_METHOD", "SERVICE", "BOOTSTRAP_VARIABLES"]

#: what torchrun (and torch.distributed's env:// init) sets for every process
BOOTSTRAP_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
#: rank 0's port for rendezvous alone, where MASTER_PORT is torch's
PORT_OVERRIDE = "RENDEZVOUS_MASTER_PORT"


@dataclass(frozen=True)
class Bootstrap:
    """Who this process is in a job bootstrapped from rank 0's address."""

    master_addr: str
    master_port: int
    rank: int
    world_size: int
    #: torchrun's agent hosts a TCPStore at the master address: exchange through it
    agent_store: bool = False
    #: what tells one run (and one restart of it) from another in that store
    run_id: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Bootstrap":
        """From ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` as torchrun
        sets them; InvalidArgument naming what is missing or wrong."""
        env = os.environ if env is None else env
        missing = [v for v in BOOTSTRAP_VARIABLES if not env.get(v, "").strip()]
        if missing:
            raise InvalidArgument(
                f"a job bootstrapped from rank 0's address needs {', '.join(BOOTSTRAP_VARIABLES)} "
                f"(as torchrun sets them); missing: {', '.join(missing)}")
        agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        port_name = PORT_OVERRIDE if env.get(PORT_OVERRIDE, "").strip() and not agent_store else "MASTER_PORT"
        numbers = {}
        for name in (port_name, "RANK", "WORLD_SIZE"):
            try:
                numbers[name] = int(env[name])
            except ValueError:
                raise InvalidArgument(f"{name} must be an integer, got {env[name]!r}") from None
        run_id = f"{env.get('TORCHELASTIC_RUN_ID', '')}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        return cls(env["MASTER_ADDR"].strip(), numbers[port_name], numbers["RANK"], numbers["WORLD_SIZE"],
                   agent_store, run_id if agent_store else "")

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise InvalidArgument(f"WORLD_SIZE must be at least 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise InvalidArgument(f"RANK must be in [0, {self.world_size}), got {self.rank}")
        if not 0 < self.master_port < 65536:
            raise InvalidArgument(f"MASTER_PORT must be a port in [1, 65535], got {self.master_port}")
        if not self.master_addr:
            raise InvalidArgument("MASTER_ADDR is empty")

    @property
    def master(self) -> str:
        """Rank 0's address, ``host:port`` (IPv6 in brackets)."""
        host = self.master_addr
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self.master_port}"

    def cluster(self, job_name: str) -> dict[str, list[str]]:
        """The cluster as known before the exchange: rank 0 at the known address,
        every other rank at port 0 of this host's address towards rank 0."""
        serves = self.rank == 0 and not self.agent_store  # rank 0 hosts the joins
        own = self.master if serves else _address(local_host_towards(self.master_addr), 0)
        return {job_name: [own if i == self.rank else
                           (self.master if i == 0 and not self.agent_store else _address("0.0.0.0", 0))
                           for i in range(self.world_size)]}

    @property
    def hosts_joins(self) -> bool:
        """Whether this rank collects the others' joins (rank 0, without torchrun's store)."""
        return self.rank == 0 and not self.agent_store


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def local_host_towards(master_addr: str) -> str:
    """The address of this host on the route to ``master_addr``: what rank 0 (and
    the others, on the same network) can reach this rank at. Found by asking the
    kernel for a route (a UDP socket's connect sends nothing)."""
    return route_towards(master_addr)[0]


def route_towards(master_addr: str) -> tuple[str, str]:
    """(this host's address on the route to ``master_addr``, the address of
    ``master_addr`` that route reaches): the first of its addresses with a route."""
    try:
        infos = socket.getaddrinfo(master_addr, 9, type=socket.SOCK_DGRAM)
    except OSError as exc:
        raise Unavailable(f"cannot resolve MASTER_ADDR {master_addr!r}: {exc.strerror or exc}") from None
    last: OSError | None = None
    for family, kind, proto, _, where in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.connect(where)
            except OSError as exc:
                last = exc
                continue
            return probe.getsockname()[0], str(where[0])
    raise Unavailable(f"no route to MASTER_ADDR {master_addr!r}: {last}")


def _join_target(boot: Bootstrap, address: str) -> tuple[str, list[tuple[str, str]]]:
    """Where a join goes, and its channel options: rank 0's address that the
    route from ``address``'s host reaches, so that rank 0 sees the join come
    from the host it names (a name with several addresses could otherwise be
    reached over another one); TLS still checks rank 0's certificate against
    MASTER_ADDR."""
    host = parse_address(address)[0].strip("[]")
    try:
        local, remote = route_towards(boot.master_addr)
    except Unavailable:
        return boot.master, []
    if local != host or remote == boot.master_addr:
        return boot.master, []
    return _address(remote, boot.master_port), [("grpc.ssl_target_name_override", boot.master_addr)]


async def exchange_addresses(boot: Bootstrap, job_name: str, own: str, joins: JoinTable | None, limit: float,
                             setup: Any, token: str, incarnation: int = 0) -> list[tuple[str, int]]:
    """Every rank's address and incarnation, for the rank at ``own`` (of
    ``incarnation``): rank 0 collects the joins
    (``joins``, served on its port), the others join it (over ``setup``'s TLS,
    with its token), or all exchange through torchrun's store; each bounded by
    ``limit`` seconds."""
    if joins is not None:  # rank 0: wait for the others' joins
        joins.set_own(own, incarnation)
        try:
            await asyncio.wait_for(joins.done.wait(), limit)
        except TimeoutError:
            joins.fail(never_joined(joins, limit, own))
        if joins.error is not None:
            raise copy.copy(joins.error)
        return [(joins.addresses[r], joins.incarnations.get(r, 0)) for r in range(boot.world_size)]
    if boot.agent_store:  # torchrun's agent hosts a store at the master address
        return await asyncio.to_thread(exchange_through_store, boot, job_name, own, limit, token, incarnation)
    return await join(boot, job_name, own, limit, credentials=setup.channel_credentials, metadata=setup.metadata,
                      incarnation=incarnation)


async def join(boot: Bootstrap, job_name: str, address: str, timeout: float, *,
               credentials: grpc.ChannelCredentials | None = None,
               metadata: tuple[tuple[str, str], ...] = (), incarnation: int = 0) -> list[tuple[str, int]]:
    """A rank > 0's side: tell rank 0 ``address`` (and ``incarnation``) and get
    every rank's, waiting up to ``timeout`` seconds for rank 0 to come up and
    the others to join."""
    target, options = _join_target(boot, address)
    channel = (grpc.aio.secure_channel(target, credentials, options=options) if credentials is not None
               else grpc.aio.insecure_channel(target))
    body = json.dumps({"job": job_name, "rank": boot.rank, "world_size": boot.world_size,
                       "address": address, "incarnation": incarnation}).encode()
    try:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(JOIN_METHOD)
        reply = await call(body, timeout=timeout, wait_for_ready=True, metadata=metadata)
    except grpc.aio.AioRpcError as exc:
        if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            raise Unavailable(f"rank {boot.rank} could not join the job at rank 0 ({target}, MASTER_ADDR:"
                              f"MASTER_PORT) within {timeout:g}s: rank 0 never answered, or some rank never "
                              "joined") from None
        raise from_status(exc.code(), f"rank 0 at {target} refused the join: {exc.details()}") from None
    finally:
        await channel.close()
    answer = json.loads(reply)
    addresses = answer["addresses"]
    incarnations = answer.get("incarnations") or [0] * len(addresses)
    if len(addresses) != boot.world_size or len(incarnations) != boot.world_size:
        raise Unavailable(f"rank 0 at {target} answered {len(addresses)} addresses for WORLD_SIZE "
                          f"{boot.world_size}")
    return list(zip(addresses, incarnations))


def exchange_through_store(boot: Bootstrap, job_name: str, address: str, timeout: float,
                           token: str = "", incarnation: int = 0) -> list[tuple[str, int]]:
    """Every rank's address and incarnation through the TCPStore torchrun's agent hosts at
    ``MASTER_ADDR:MASTER_PORT`` (blocking: run it off the event loop). With a
    ``token`` each entry carries its signature (:func:`sign_entry`) and every
    rank's is checked: UNAUTHENTICATED for one not signed with the token."""
    from datetime import timedelta

    try:
        from torch.distributed import TCPStore
    except ImportError as exc:
        raise Unavailable(f"TORCHELASTIC_USE_AGENT_STORE=True (torchrun) but torch.distributed cannot be "
                          f"imported: {exc}") from None
    prefix = f"rendezvous/{boot.run_id}/{job_name}/"
    names = [f"{prefix}{r}" for r in range(boot.world_size)]
    try:
        store = TCPStore(boot.master_addr, boot.master_port, is_master=False, timeout=timedelta(seconds=timeout))
        store.set(names[boot.rank], sign_entry(token, names[boot.rank], f"{address}#{incarnation:x}"))
        store.wait(names, timedelta(seconds=timeout))
        entries = [store.get(n).decode("utf-8", "replace") for n in names]
    except RuntimeError as exc:  # torch's store errors (DistStoreError and its kin) are RuntimeErrors
        missing = ""
        try:
            missing = ", ".join(str(r) for r, n in enumerate(names) if not store.check([n]))
        except Exception:  # noqa: BLE001 - the store itself is gone; say what we know
            pass
        raise Unavailable(f"rank {boot.rank} could not exchange addresses through torchrun's store at "
                          f"{boot.master} within {timeout:g}s" + (f"; rank(s) {missing} never joined" if missing
                                                                  else "") + f": {exc}") from None
    return [_with_incarnation(read_entry(token, n, e, r), r) for r, (n, e) in enumerate(zip(names, entries))]


def _with_incarnation(entry: str, rank: int) -> tuple[str, int]:
    """``address#incarnation`` (hex; a bare address: 0) as (address, incarnation)."""
    address, _, hex_incarnation = entry.partition("#")
    try:
        return address, int(hex_incarnation or "0", 16)
    except ValueError:
        raise InvalidArgument(f"rank {rank}'s entry in torchrun's store has a bad incarnation: {entry!r}") from None


def sign_entry(token: str, name: str, address: str) -> str:
    """A store entry: ``address``, and with a token its HMAC-SHA256 over the entry's
    name (run, job and rank) and the address, after a space."""
    if not token:
        return address
    mac = hmac.new(token.encode(), f"{name}\n{address}".encode(), hashlib.sha256).hexdigest()
    return f"{address} {mac}"


def read_entry(token: str, name: str, entry: str, rank: int) -> str:
    """The address of a store entry, its signature checked against ``token``."""
    address, _, mac = entry.partition(" ")
    if not token:
        if mac:
            raise InvalidArgument(f"rank {rank}'s entry in torchrun's store is signed with a token, and this rank "
                                  "has none: set the same RENDEZVOUS_TOKEN (or RENDEZVOUS_TOKEN_FILE) on every rank")
        return address
    if not hmac.compare_digest(sign_entry(token, name, address), entry):
        raise Unauthenticated(f"rank {rank}'s entry in torchrun's store ({address!r}) is not signed with this "
                              "job's token: a rank with another token, or a process that is not one of the job's")
    return address
