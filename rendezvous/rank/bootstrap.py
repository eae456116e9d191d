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
ranks. A join repeated (a retry after a broken connection) gets the same
answer; a join that contradicts an earlier one, or names another job, world
size or a rank outside the world, is refused with INVALID_ARGUMENT or
ALREADY_EXISTS, and the server goes on.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from rendezvous.cluster import parse_address
from rendezvous.errors import AlreadyExists, InvalidArgument, RendezvousError, Unavailable, from_status

__all__ = ["Bootstrap", "JOIN_METHOD", "SERVICE", "BOOTSTRAP_VARIABLES"]

SERVICE = "rendezvous.v1.Bootstrap"
JOIN_METHOD = f"/{SERVICE}/Join"
#: what torchrun (and torch.distributed's env:// init) sets for every process
BOOTSTRAP_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
#: rank 0's port for rendezvous alone, where MASTER_PORT is torch's
PORT_OVERRIDE = "RENDEZVOUS_MASTER_PORT"
_MAX_JOIN_BYTES = 64 << 10


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
            return probe.getsockname()[0]
    raise Unavailable(f"no route to MASTER_ADDR {master_addr!r}: {last}")


class JoinTable:
    """Rank 0's side: the joins so far, answered all at once when complete."""

    def __init__(self, boot: Bootstrap, job_name: str) -> None:
        self.boot = boot
        self.job_name = job_name
        self.addresses: dict[int, str] = {}
        self.complete = asyncio.Event()

    def set_own(self, address: str) -> None:
        self.addresses[0] = address
        self._check()

    def _check(self) -> None:
        if len(self.addresses) == self.boot.world_size:
            self.complete.set()

    def missing(self) -> list[int]:
        return [r for r in range(self.boot.world_size) if r not in self.addresses]

    def join(self, body: Mapping[str, Any]) -> None:
        """Record one join; raises InvalidArgument/AlreadyExists for a bad one."""
        job, rank, world, address = (body.get(k) for k in ("job", "rank", "world_size", "address"))
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
        known = self.addresses.get(rank)
        if known is not None and known != address:
            raise AlreadyExists(f"rank {rank} joined already at {known}; now {address} claims it (two processes "
                                "with the same RANK?)")
        self.addresses[rank] = address
        self._check()

    def answer(self) -> bytes:
        return json.dumps({"addresses": [self.addresses[r] for r in range(self.boot.world_size)]}).encode()

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
                self.join(body)
            except RendezvousError as exc:
                await context.abort(exc.code, str(exc))
            await self.complete.wait()
            return self.answer()

        handler = grpc.unary_unary_rpc_method_handler(join, request_deserializer=None, response_serializer=None)
        return grpc.method_handlers_generic_handler(SERVICE, {"Join": handler})


async def join(boot: Bootstrap, job_name: str, address: str, timeout: float, *,
               credentials: grpc.ChannelCredentials | None = None,
               metadata: tuple[tuple[str, str], ...] = ()) -> list[str]:
    """A rank > 0's side: tell rank 0 ``address`` and get every rank's, waiting
    up to ``timeout`` seconds for rank 0 to come up and the others to join."""
    target = boot.master
    channel = (grpc.aio.secure_channel(target, credentials) if credentials is not None
               else grpc.aio.insecure_channel(target))
    body = json.dumps({"job": job_name, "rank": boot.rank, "world_size": boot.world_size,
                       "address": address}).encode()
    try:
        call = channel.unary_unary(JOIN_METHOD, request_serializer=None, response_deserializer=None)
        reply = await call(body, timeout=timeout, wait_for_ready=True, metadata=metadata)
    except grpc.aio.AioRpcError as exc:
        if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            raise Unavailable(f"rank {boot.rank} could not join the job at rank 0 ({target}, MASTER_ADDR:"
                              f"MASTER_PORT) within {timeout:g}s: rank 0 never answered, or some rank never "
                              "joined") from None
        raise from_status(exc.code(), f"rank 0 at {target} refused the join: {exc.details()}") from None
    finally:
        await channel.close()
    addresses = json.loads(reply)["addresses"]
    if len(addresses) != boot.world_size:
        raise Unavailable(f"rank 0 at {target} answered {len(addresses)} addresses for WORLD_SIZE "
                          f"{boot.world_size}")
    return addresses


def exchange_through_store(boot: Bootstrap, job_name: str, address: str, timeout: float) -> list[str]:
    """Every rank's address through the TCPStore torchrun's agent hosts at
    ``MASTER_ADDR:MASTER_PORT`` (blocking: run it off the event loop)."""
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
        store.set(names[boot.rank], address)
        store.wait(names, timedelta(seconds=timeout))
        return [store.get(n).decode() for n in names]
    except RuntimeError as exc:  # torch's store errors (DistStoreError and its kin) are RuntimeErrors
        missing = ""
        try:
            missing = ", ".join(str(r) for r, n in enumerate(names) if not store.check([n]))
        except Exception:  # noqa: BLE001 - the store itself is gone; say what we know
            pass
        raise Unavailable(f"rank {boot.rank} could not exchange addresses through torchrun's store at "
                          f"{boot.master} within {timeout:g}s" + (f"; rank(s) {missing} never joined" if missing
                                                                  else "") + f": {exc}") from None
