"""The rank server on an asyncio loop (public name: ``rendezvous.aio.Server``).

One per rank. It holds this rank's waiting table, serves RecvTensor to the
other ranks, and recvs from them. Everything here runs on one event loop;
the blocking :class:`rendezvous.Server` drives an instance of this class
from its own loop thread.

The server is where its parts are made and joined, each owned by it and
handed to the others at construction:

* the waiting table (:mod:`rendezvous.table`) and the producer's servicer
  (:mod:`rendezvous.rpc.servicer`) with its retry cache;
* the data planes (:mod:`rendezvous.transport`): inline, plus MPI's under
  ``grpc+mpi``;
* its link to the other ranks of its job besides gRPC
  (:mod:`rendezvous.transport.link`), chosen once in :mod:`rendezvous.rank.links`:
  the rank's MPI half under ``grpc+mpi``, else nothing; this module names no MPI;
* the peer clients (:mod:`rendezvous.rank.peers`) and the tensors fetched
  and not yet delivered (:mod:`rendezvous.rank.kept`);
* the receive-buffer cache, the GPU backends and their pinned pools, the
  counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from rendezvous import auth, interop, ipc
from rendezvous.codec import allocator, dtypes, tensors
from rendezvous.buffers import RecvBuffers
from rendezvous.cluster import ClusterLike, ClusterSpec, parse_address
from rendezvous.config import Config, Protocol
from rendezvous.deadlines import Deadlines
from rendezvous.devices import Devices, Placement
from rendezvous.errors import Aborted, FailedPrecondition, InvalidKey, RendezvousError, Unavailable
from rendezvous.keys import DeviceName, Key, OwnKeys, TaskName, as_key, new_incarnation
from rendezvous.lifecycle import State
from rendezvous.paths import Path
from rendezvous.rpc.admin import Admin
from rendezvous.rpc.options import server_options
from rendezvous.rpc.peer import PeerClient
from rendezvous.rpc.retry import RetryCache
from rendezvous.rpc.servicer import RecvTensorServicer
from rendezvous.stats import Stats
from rendezvous.table import WaitingTable, send_items
from rendezvous.items import PendingEntry, Received
from rendezvous.timeline import Timeline, TracedPlanes, TracedTable
from rendezvous.transport import Fetched, Planes
from rendezvous.transport.inline import InlinePlane
from rendezvous.transport.link import RankLink, RankParts

from . import links
from . import pending as pending_rows
from .bootstrap import Bootstrap, exchange_addresses
from .joins import JoinTable
from .kept import Kept
from .peers import Peers
from .receiver import Receiver
from .setup import GrpcSetup, add_port, grpc_security

T = TypeVar("T")

__all__ = ["Server", "PROTOCOLS", "GrpcSetup", "add_port", "Fetched"]

log = logging.getLogger("rendezvous")
#: keys sent remembered with their canonical form (see Server.prepare_send):
#: about 24 MiB at worst
_SENT_KEYS = 1 << 15
PROTOCOLS = tuple(p.value for p in Protocol)


class Server:
    """A rank server. Construct anywhere; ``await start()`` inside the loop it will live on.

    ``cluster`` is TensorFlow's cluster shape (dict, :class:`ClusterSpec`, or a
    JSON file path); this server is task ``task_index`` of job ``job_name`` and
    binds to that task's address (port 0: the OS picks; see :attr:`target`).
    """

    def __init__(self, cluster: ClusterLike, job_name: str, task_index: int,
                 protocol: str = "grpc", *, config: Config | None = None,
                 grpc_setup: GrpcSetup | None = None, stats: Stats | None = None,
                 devices: Devices | None = None, buffers: RecvBuffers | None = None,
                 bootstrap: Bootstrap | None = None, **overrides: Any) -> None:
        self.protocol = Protocol.parse(protocol)
        #: how the other ranks' addresses are learnt at start when they bound port 0
        #: (see from_env); None: the cluster as given (and MPI's exchange under grpc+mpi)
        self.bootstrap = bootstrap
        self.cluster = ClusterSpec.from_any(cluster)
        self.task = TaskName(job_name, 0, int(task_index))
        self.bind_address = self.cluster.address(self.task)  # UnknownTask if absent
        #: keys sent before, checked as this task's own: a training loop sends
        #: the same keys every step
        self._sent_keys = OwnKeys(self.task, "key {key!r} is produced by {src}; this server is {task} and can "
                                  "only send its own", _SENT_KEYS)
        cfg = self.config = config.replace(**overrides) if config is not None else Config.load(overrides)
        #: this server's incarnation: the setting, else the one the cluster
        #: publishes for this task, else a random one (new at every start of
        #: the process); a key naming another (not 0) is refused with ABORTED
        self.incarnation: int = cfg.incarnation or self.cluster.incarnation(self.task) or new_incarnation()
        self.cluster = self.cluster.with_address(self.task, self.bind_address, self.incarnation)
        self._sent_keys.incarnation = self.incarnation
        #: Whether this loop polls MPI itself while traffic is expected (the fastest
        #: for a program that is all asyncio): ``True``: every transfer, with gRPC
        #: requests or MPI ones; ``"remote"``: only those with ranks MPI reaches over
        #: the network (a transfer across hosts moves only as fast as it is polled:
        #: BENCHMARKS.md, "Notes for tuning"); ``"attended"``: those, and with MPI
        #: requests every transfer while a caller waits on the loop (:meth:`attending`);
        #: ``False``: never. The blocking Server says ``"attended"``: its loop thread,
        #: spinning, would keep the GIL from the caller's threads while they compute;
        #: a caller blocked on a recv needs no GIL, and its reply is taken at the loop's pace.
        self.poll_on_loop: bool | str = True
        #: this rank's timeline (rendezvous.timeline; the ``timeline`` setting), or None: off
        self.timeline = (Timeline.for_task(cfg.timeline, self.cluster, self.task, max_bytes=cfg.timeline_max_bytes)
                         if cfg.timeline else None)
        self.table = WaitingTable() if self.timeline is None else TracedTable(self.timeline)
        self._stats = stats if stats is not None else Stats()
        #: GPU backends and their pinned pools (cupy by default, imported only when used)
        self.devices = devices if devices is not None else Devices()
        #: large receive buffers, reused once dropped (see rendezvous.buffers)
        self.buffers = buffers if buffers is not None else RecvBuffers(cfg.recv_cache_bytes)
        self._staging = (cfg.gpu_staging_chunk_bytes, cfg.gpu_staging_depth)
        # TLS and the token, applied to every service on this server's port and
        # to every channel it opens (a setup given must apply what cfg sets)
        if grpc_setup is None:
            grpc_setup, self._token = grpc_security(cfg)
        else:
            grpc_setup.check(cfg)
            self._token = auth.load_token(cfg)
        self._setup = grpc_setup
        self._retry = RetryCache(cfg.retry_window, cfg.retry_cache_bytes)
        #: the data planes, most preferred first: MPI's joins at start under grpc+mpi
        inline = InlinePlane(chunk_bytes=cfg.chunk_bytes, buffers=self.buffers, devices=self.devices,
                             staging=self._staging, stats=self._stats)
        self.planes = Planes([inline]) if self.timeline is None else TracedPlanes([inline], self.timeline)
        self.servicer = RecvTensorServicer(self.table, self.task, stats=self._stats, planes=self.planes,
                                           retry=self._retry, max_waiting=cfg.max_waiting_calls,
                                           timeline=self.timeline,
                                           fusion=(min(cfg.fusion_threshold, cfg.chunk_bytes), cfg.chunk_bytes),
                                           incarnation=self.incarnation)
        #: the Admin service (Stats, Pending) and gRPC health, on this server's port
        self.admin = Admin(self)
        #: how this rank reaches the other ranks of its job besides gRPC (see rendezvous.transport.link)
        self.link: RankLink = links.choose(cfg, self.protocol)
        self._grpc: grpc.aio.Server | None = None
        self._target: str | None = None
        self.peers = Peers(self._make_peer)
        ipc.join(self.planes, cfg, str(self.task), self.devices, self._stats, release=self.peers.release,
                 gave_back=self.servicer.gave_up, delivered=self._retry.delivered)  # GPU tensors on this node
        #: tensors fetched and not delivered, for the next recv of their key and step
        self.kept = Kept()
        #: the deadlines and stall warnings of this server's recvs, on one loop timer
        self._deadlines = Deadlines()
        #: routes and fetches every recv (the blocking Server calls it directly)
        self.receiver = Receiver(self.task, self.table, self.peers, self.kept, self.devices, self._stats,
                                 self._staging, self.timeline, self._deadlines)
        self.receiver.stall_warning = cfg.stall_warning  # (a daemon, which watches its recvs, sets 0)
        self.receiver.on_stall = self._stalled
        self._stopped: asyncio.Event | None = None
        self._keeper: asyncio.Task | None = None
        self._state = State.NEW

    @classmethod
    def from_env(cls, job_name: str = "worker", protocol: str = "grpc", *,
                 env: Mapping[str, str] | None = None, **kwargs: Any) -> "Server":
        """A server for a job launched the way ``torchrun`` launches one:
        ``MASTER_ADDR``/``MASTER_PORT`` (rank 0's address), ``RANK`` and
        ``WORLD_SIZE`` from the environment. This rank is task ``RANK`` of
        ``job_name``; rank 0 binds the known address, every other rank an
        OS-chosen port, and ``start()`` returns once every rank has joined
        (bounded by ``connect_timeout``). See :mod:`rendezvous.rank.bootstrap`."""
        boot = Bootstrap.from_env(env)
        return cls(boot.cluster(job_name), job_name, boot.rank, protocol, bootstrap=boot, **kwargs)

    # -- lifecycle ----------------------------------------------------------

    @property
    def target(self) -> str:
        """``host:port`` this server listens on (the real port once started)."""
        return self._target or self.bind_address

    @property
    def mpi_ranks(self) -> dict[TaskName, int]:
        """The MPI rank of every task in this rank's MPI job (empty without MPI)."""
        return dict(self.link.ranks)

    async def start(self) -> None:
        """Bind and start serving. Raises Unavailable if the address cannot be bound."""
        if self._state is not State.NEW:
            raise FailedPrecondition(f"server is {self._state}; start() is allowed once")
        self._state = State.STARTING
        host, _ = parse_address(self.bind_address)
        self._stopped = asyncio.Event()
        setup = self._setup
        # Chunked replies allocate chunk-sized frames: keep them reusable (a
        # process-wide allocator setting, applied by the server that needs it).
        allocator.prime_allocator(self.config.chunk_bytes)
        server = grpc.aio.server(interceptors=setup.interceptors or None,
                                 options=server_options(self.config.max_request_bytes, self.config.keepalive_time,
                                                        self.config.keepalive_timeout))
        server.add_generic_rpc_handlers(self.servicer.handlers())
        self.admin.add_to(server)
        joins = None
        if self.bootstrap is not None and self.bootstrap.hosts_joins:
            joins = JoinTable(self.bootstrap, self.task.job)
            server.add_generic_rpc_handlers((joins.handlers(),))
        for add_service in setup.services:
            add_service(server)
        try:
            port = add_port(server, self.bind_address, setup.server_credentials)
        except BaseException:
            self._state = State.NEW  # nothing started: start() may be tried again
            raise
        try:
            await server.start()
            self._grpc = server
            self._target = f"{host}:{port}"
            self.cluster = self.cluster.with_address(self.task, self._target)
            if self.bootstrap is not None:
                await self._join(joins)
            await self._start_link()
        except BaseException:
            # A start that failed (or was cancelled) leaves nothing listening;
            # the joins refused meanwhile get a moment to say why.
            await server.stop(0.5 if joins is not None else 0)
            self._state = State.NEW
            raise
        self._state = State.SERVING
        self._keeper = asyncio.create_task(self._keep(), name=f"rendezvous-server-{self.task}")
        await self.admin.set_serving(True)
        log.info("task %s serving on %s (protocol %s)", self.task, self._target, self.protocol)
        if self.protocol is Protocol.GRPC_MPI:
            sys.stderr.write(self.describe() + "\n")  # one write: ranks' lines must not interleave
            sys.stderr.flush()

    async def _keep(self) -> None:
        """Lives while the server serves: a loop that ends (``asyncio.run``
        cancels what is left) with the server never stopped stops it, so no
        gRPC server is left listening on a closed loop."""
        assert self._stopped is not None and self._grpc is not None
        try:
            await self._stopped.wait()
        except asyncio.CancelledError:
            if not self._state.ending:
                log.warning("task %s: its event loop is ending and the server was never stopped; stopping it",
                            self.task)
                # gRPC's own tasks end with the loop too: its port is closed
                # first (the shutdown begins before the first await), then the rest.
                with contextlib.suppress(asyncio.CancelledError):
                    await self._grpc.stop(0)
                with contextlib.suppress(asyncio.CancelledError):
                    await self.stop(0)
            raise

    async def _join(self, joins: JoinTable | None) -> None:
        """Learn every rank's address (:mod:`rendezvous.rank.bootstrap`)."""
        boot = self.bootstrap
        assert boot is not None
        found = await exchange_addresses(boot, self.task.job, self._target or self.bind_address, joins,
                                         self.config.connect_timeout, self._setup, self._token, self.incarnation)
        self.cluster = ClusterSpec.from_any({self.task.job: [{"address": a, "incarnation": i} for a, i in found]})
        log.info("task %s: the job's %d ranks joined through %s", self.task, boot.world_size, boot.master)

    async def _start_link(self) -> None:
        """The link starts (with MPI, a collective: every rank of the job reaches
        it), its plane joins the planes, and the addresses it found the cluster."""
        parts = RankParts(servicer=self.servicer, stats=self._stats, buffers=self.buffers, devices=self.devices,
                          delivered=self._retry.delivered, aborted=self.servicer.gave_up,
                          loop_polls=self.poll_on_loop)
        addresses = await self.link.start(self.task, self.target, self.incarnation, parts)
        if self.link.plane is not None:
            self.planes.register(self.link.plane)
        self.cluster = links.joined(self.cluster, self.task, self.link, addresses)

    def describe(self) -> str:
        """One line: who this rank is and how it moves tensors (printed at start-up)."""
        line = f"rendezvous: {self.task} on {self.target}, protocol {self.protocol}"
        more = self.link.describe()
        return f"{line}; {more}" if more else line

    async def stop(self, grace: float | None = None) -> None:
        """Drain and stop. Idempotent.

        New recvs are refused (UNAVAILABLE) and this rank's own waiting recvs
        fail with UNAVAILABLE; tensors this rank produced are still served, for
        up to ``grace`` seconds (default: the ``grace`` setting, 10 s), until
        every one has been consumed and every reply in flight has finished.
        Whatever is left then is dropped and logged with its keys.
        ``stop(0)`` drops at once."""
        if self._state.ending:
            if self._stopped is not None:
                await self._stopped.wait()
            return
        grace = self.config.grace if grace is None else max(0.0, float(grace))
        self._state = State.STOPPING
        await self.admin.set_serving(False)
        # Drain: no new waits; waiters fail; tensors already produced are still
        # served to requests arriving within the grace period.
        self.servicer.begin_drain()
        drained = Unavailable(f"server {self.task} is shutting down")
        self.table.fail_waiters(drained)
        await self.peers.close()
        if self._grpc is not None:
            # The peers' streams stay open for good, so gRPC's own grace would
            # always run out: wait only while something is left to deliver.
            loop = asyncio.get_running_loop()
            end = loop.time() + grace
            produced = self.table.stats()["tensors"]
            if produced and grace > 0:
                log.info("task %s stopping: waiting up to %gs for %d produced tensor(s) to be consumed "
                         "(the grace; stop(grace=0) drops them)", self.task, grace, produced)
            said = loop.time() + 1.0  # a wait that lasts is said where a plain script sees it
            while loop.time() < end and (self.servicer.busy() or self.table.stats()["tensors"]):
                if loop.time() >= said:
                    said = end
                    left = self.table.stats()["tensors"]
                    if left:
                        log.warning("task %s stopping: %d produced tensor(s) not consumed yet; serving them for "
                                    "up to %.3gs more (the grace; stop(grace=0) drops them)", self.task, left,
                                    end - loop.time())
                await asyncio.sleep(0.005)
            # End the streams after their last reply; gRPC then waits (briefly)
            # for those handlers to send their status before it cancels the rest.
            self.servicer.close_streams()
            await self._grpc.stop(max(0.2, min(1.0, end - loop.time())))
        await self.link.close_requests()  # the link's streams end (their replies were written above)
        dropped = [e for e in self.table.pending() if e.kind == "tensor"]
        self.table.close(drained)
        if dropped:
            count = sum(e.count for e in dropped)
            shown = ", ".join(f"{e.key} (step {e.step_id})" for e in dropped[:3])
            log.warning("task %s stopped with %d produced tensor(s) never consumed, dropped after a grace of %gs: "
                        "%s%s", self.task, count, grace, shown, ", ..." if len(dropped) > 3 else "")
        await self.link.stop(grace or 5.0)
        self.planes.close()
        self._retry.close()
        if self.timeline is not None:
            self.timeline.close()  # the closing bracket: the file is plain JSON from here
        self._state = State.STOPPED
        if self._stopped is not None:
            self._stopped.set()

    async def wait_for_termination(self) -> None:
        """Wait until the server has stopped (``join`` is the same)."""
        if self._stopped is None:
            raise FailedPrecondition("server was never started")
        await self._stopped.wait()

    join = wait_for_termination

    async def __aenter__(self) -> "Server":
        await self.start()
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        # A block that ended normally delivers what it produced (the default
        # grace); one that raised stops at once.
        await self.stop(None if exc_type is None else 0)

    def update_cluster(self, cluster: ClusterLike) -> None:
        """Replace peer addresses (e.g. after every rank bound port 0).

        Peers already connected keep their channel."""
        spec = ClusterSpec.from_any(cluster)
        # incarnations known of tasks the new spec leaves at their address stay known
        kept = {t: i for t, i in self.cluster.incarnations.items()
                if t in spec and t in self.cluster and spec.address(t) == self.cluster.address(t)}
        spec = ClusterSpec(spec.jobs, {**kept, **spec.incarnations})
        self.cluster = spec.with_address(self.task, self.target, self.incarnation)

    def incarnation_of(self, task: TaskName | str) -> int:
        """The incarnation of ``task``'s server as this server knows it (published
        by the cluster, MPI's exchange or the bootstrap; this server's own), to
        make keys with (``make_key(..., incarnation=server.incarnation_of(task))``);
        0 if unknown: a key of incarnation 0 is taken by any incarnation."""
        if isinstance(task, str):
            name = task
            try:
                task = TaskName.parse(name)
            except InvalidKey:  # a device name: its task's
                device = DeviceName.parse(name)
                if device.task_name is None:
                    raise InvalidKey(f"{name!r} names no task") from None
                task = device.task_name
        return self.cluster.incarnation(task)

    # -- data ---------------------------------------------------------------

    def prepare_send(self, key: Key | str, tensor: Any, is_dead: bool = False) -> tuple[str, Any]:
        """Validate a send and return (canonical key, array); callable from any thread."""
        canonical = self._sent_keys.canonical(key)
        if is_dead:
            return canonical, None
        # GPU tensors stay on their device (a DeviceTensor with a ready event on
        # the caller's current stream: call this on the producer's thread).
        value = self.devices.import_tensor(tensor)
        # refused here, where the producer hears of it, not at the consumer
        if type(value) is np.ndarray:
            tensors.check_sendable(value)
        else:
            dtypes.dtype_to_proto(value.dtype)
        return canonical, value

    def send(self, key: Key | str, tensor: Any, step_id: int = 0, is_dead: bool = False) -> None:
        """Produce ``tensor`` under ``key`` for step ``step_id`` (on the loop thread).

        The array is not copied: do not modify it until it has been received.
        Raises InvalidKey, or the step's error if it was aborted."""
        canonical, arr = self.prepare_send(key, tensor, is_dead)
        self.table.send(step_id, canonical, arr, is_dead)

    async def recv(self, key: Key | str, step_id: int = 0, timeout: float | None = None,
                   device: str | Placement | None = None, framework: str | None = None) -> Any:
        """The tensor sent under ``key`` in ``step_id`` (None if it is dead).

        It lands where the key's ``dst_device`` says (``GPU:N``: a cupy array on
        device N; otherwise numpy), or on ``device`` ("cpu", "gpu:N") if given;
        ``framework="torch"`` hands it over as a ``torch.Tensor`` sharing that
        memory (see :mod:`rendezvous.interop`). Local keys are served from this
        rank's table with no copy when the tensor is already where it should
        be; remote keys by RecvTensor to the producing task. Raises
        DeadlineExceeded after ``timeout`` seconds, Aborted if the step is
        aborted, UnknownTask for a task outside the cluster, PeerUnavailable if
        the producer is gone."""
        if framework is None:  # as received (two coroutines less per recv)
            return (await self.receiver.fetching(key, step_id, timeout, device)).item.value
        return (await self.recv_item(key, step_id, timeout, device, framework)).value

    async def recv_item(self, key: Key | str, step_id: int = 0, timeout: float | None = None,
                        device: str | Placement | None = None, framework: str | None = None) -> Received:
        """:meth:`recv` as ``Received(value, is_dead)``."""
        if framework is None:
            return (await self.receiver.fetching(key, step_id, timeout, device)).item
        interop.check_framework(framework)  # before anything is taken
        item = (await self.receiver.fetching(key, step_id, timeout, device)).item
        return interop.hand_over([item], framework, lambda items: self.give_back(step_id, [key], items))[0]

    def give_back(self, step_id: int, keys: Sequence[Key | str], items: list[Received],
                  why: str | None = None) -> None:
        """Keep ``items``, received for ``keys`` and not delivered, for the next
        recv of each key, in their order (see :meth:`keep`): all kept first, then
        handed to recvs of their keys already waiting, the oldest tensor first."""
        self.receiver.give_back(step_id, [as_key(k).format() for k in keys], items, why)

    def prepare_many(self, items: Iterable[tuple[Any, ...]] | Mapping[Key | str, Any]) -> list[tuple[str, Any, bool]]:
        """:meth:`prepare_send` for ``send_many``'s items (:func:`rendezvous.table.send_items`):
        every one checked, nothing sent; callable from any thread."""
        return [(*self.prepare_send(key, tensor, dead), dead) for key, tensor, dead in send_items(items)]

    def send_prepared(self, prepared: list[tuple[str, Any, bool]], step_id: int) -> None:
        """Produce what :meth:`prepare_many` checked (on the loop thread)."""
        for canonical, arr, dead in prepared:
            self.table.send(step_id, canonical, arr, dead)

    def send_many(self, items: Iterable[tuple[Any, ...]] | Mapping[Key | str, Any], step_id: int = 0) -> None:
        """Produce many tensors in ``step_id`` at once: ``(key, tensor)`` or
        ``(key, tensor, is_dead)`` tuples, or a mapping of key to tensor. Every
        one is checked before any is sent: a bad key or an unsendable array
        raises and sends nothing."""
        self.send_prepared(self.prepare_many(items), step_id)

    async def recv_many(self, keys: Sequence[Key | str], step_id: int = 0, timeout: float | None = None,
                        device: str | Placement | None = None, framework: str | None = None) -> list[Any]:
        """The tensors of ``keys`` in ``step_id``, in key order (None for a dead
        one): local and remote keys mixed, from any number of producers, under
        one deadline. Each key keeps :meth:`recv`'s meaning (FIFO per key). All
        of them or none: if any key fails, or the deadline passes, nothing is
        consumed (what had arrived is kept for the next recv of its key) and the
        error, of the first failure's status, names every key that failed
        (``error.failures``: key -> error)."""
        if framework is None or framework == "numpy":  # as received: one pass over the batch
            return [f[0][0] for f in await self.receiver.fetch_many(keys, step_id, timeout, device)]
        return [item.value for item in await self.recv_many_items(keys, step_id, timeout, device, framework)]

    async def recv_many_items(self, keys: Sequence[Key | str], step_id: int = 0, timeout: float | None = None,
                              device: str | Placement | None = None,
                              framework: str | None = None) -> list[Received]:
        """:meth:`recv_many` as ``Received(value, is_dead)`` items."""
        interop.check_framework(framework)  # before anything is taken
        items = [f.item for f in await self.receiver.fetch_many(keys, step_id, timeout, device)]
        return interop.hand_over(items, framework, lambda back: self.give_back(step_id, keys, back))

    async def fetch(self, key: Key | str, step_id: int = 0, timeout: float | None = None,
                    device: str | Placement | None = None) -> Fetched:
        """:meth:`recv_item` with the path the tensor took (``Fetched``): what a
        daemon reports for its local clients' recvs."""
        return await self.receiver.fetching(key, step_id, timeout, device)

    @property
    def _state(self) -> State:
        """Where the server's life stands (kept by its receiver, which serves recvs
        from peers only while SERVING)."""
        return self.receiver.state

    @_state.setter
    def _state(self, state: State) -> None:
        self.receiver.state = state

    async def fetch_many(self, keys: Sequence[Key | str], step_id: int = 0, timeout: float | None = None,
                         device: str | Placement | None = None) -> list[Fetched]:
        """:meth:`recv_many_items` with the path each tensor took: what a daemon
        serves a local client's batch with."""
        return await self.receiver.fetch_many(keys, step_id, timeout, device)

    def _stalled(self, key: Key | str, step_id: int, waited: float, timeout: float | None) -> None:
        k = as_key(key)
        src = k.src_task
        if src is None or src == self.task:
            whom = "this rank's own send of it"
        else:
            try:
                whom = f"its producer {src} at {self.cluster.address(src)}"
            except RendezvousError:
                whom = f"its producer {src}"
        log.warning("recv of %s (step %d) has waited %gs for %s, and waits on (%s; RENDEZVOUS_STALL_WARNING "
                    "sets when this is said)", k.format(), step_id, waited, whom,
                    "no timeout" if timeout is None else f"timeout {timeout:g}s")

    def keep(self, step_id: int, key: str, item: Received, why: str | None) -> None:
        """Hold ``item``, fetched by a recv but never delivered (a daemon's local
        client went away), for the next recv of ``key`` in ``step_id``, in front:
        it was the oldest. Dropped if the step is over."""
        self.receiver.keep(step_id, key, item, why)

    def abort(self, step_id: int, message: str = "aborted") -> None:
        """Fail every waiter and every later send/recv of ``step_id`` with ABORTED."""
        error = Aborted(message)
        self.table.abort(step_id, error)
        self.peers.end_step(step_id, error)
        self.kept.drop_step(step_id)

    def cleanup(self, step_id: int) -> None:
        """Abort the step's waiters and forget the step (its ids may be reused)."""
        self.table.cleanup(step_id)
        self._retry.drop_step(step_id)
        self.peers.end_step(step_id, Aborted(f"step {step_id} cleaned up"))
        self.kept.drop_step(step_id)

    def stats(self) -> dict[str, dict[str, int]]:
        """Counters per path: {"local"|"grpc"|"mpi": {transfers, bytes, errors, fallbacks, served,
        served_bytes, served_fused}}; "mpi" also has "in_flight" (MPI operations posted and not complete)."""
        snap = self._stats.snapshot()
        link = self.link.stats()
        snap[Path.MPI]["in_flight"] = link["in_flight"]
        snap["gpu"] = {**self._stats.gpu_snapshot(), "cuda_aware": link["cuda_aware"]}
        return snap

    def pending(self, limit: int | None = None) -> list[PendingEntry]:
        """What waits here: every non-empty queue of the waiting table (kind
        ``"tensor"`` or ``"waiter"``: what it holds, how many, the oldest's age),
        then the tensors fetched and kept for the next recv of their key
        (``"kept"``); the first ``limit`` of those rows only, when given."""
        rows = pending_rows.walk(self.table, self.kept)
        return list(rows if limit is None else itertools.islice(rows, limit))

    def pending_count(self) -> int:
        """How many rows :meth:`pending` may have, counted without building them."""
        return pending_rows.count(self.table, self.kept)

    def _make_peer(self, task: TaskName) -> PeerClient:
        return PeerClient(task, self.cluster.address(task), self.config, planes=self.planes,
                          credentials=self._setup.channel_credentials, metadata=self._setup.metadata,
                          on_unclaimed=self.receiver.unclaimed, kept=self.kept,
                          open_call=self.link.open_call(task),
                          deadlines=self._deadlines)
