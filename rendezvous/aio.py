"""The asyncio rank server: ``rendezvous.aio.Server``.

One per rank. It holds this rank's waiting table, serves RecvTensor to the
other ranks, and recvs from them through one :class:`~rendezvous.rpc.peer.PeerClient`
per remote task. Everything here runs on one event loop; the blocking
:class:`rendezvous.Server` drives an instance of this class from its own loop
thread.

The server owns its state and hands it to its parts at construction: the
receive-buffer cache, the GPU backends and their pinned pools, the counters,
and the data planes (inline, plus MPI's under ``grpc+mpi``) through which
the servicer answers and the peer clients receive.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import copy
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from . import frames
from .buffers import RecvBuffers
from .cluster import ClusterLike, ClusterSpec, parse_address
from .config import Config, Protocol
from .devices import Devices, DeviceTensor, Placement, parse_placement, placement_for_device
from .errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    NotPlaced,
    RendezvousError,
    ResourceExhausted,
    Unavailable,
)
from .keys import Key, TaskName, as_key
from .lifecycle import State
from .rpc.options import server_options
from .rpc.peer import PeerClient
from .rpc.retry import RetryCache
from .rpc.servicer import RecvTensorServicer
from .stats import Stats, payload_nbytes
from .table import Received, WaitingTable
from .transport import Fetched, Path, Planes
from .transport.inline import InlinePlane

__all__ = ["Server", "PROTOCOLS", "GrpcSetup", "add_port", "Fetched"]

log = logging.getLogger("rendezvous")
PROTOCOLS = tuple(p.value for p in Protocol)
class _StepEnded:
    """The cancel message of a remote recv whose step was aborted or cleaned up
    (not a cancel by its caller): the recv raises ``error`` instead."""

    __slots__ = ("error",)

    def __init__(self, error: RendezvousError) -> None:
        self.error = error


@dataclass(frozen=True)
class GrpcSetup:
    """How a rank's gRPC server and its channels to peers are secured and extended
    (``rendezvousd`` fills this in): TLS credentials for both sides, metadata
    every peer call carries (a token), server interceptors (the token check),
    and callables that add services (health, reflection) before the server starts."""

    server_credentials: grpc.ServerCredentials | None = None
    channel_credentials: grpc.ChannelCredentials | None = None
    metadata: tuple[tuple[str, str], ...] = ()
    interceptors: tuple[Any, ...] = ()
    services: tuple[Callable[[grpc.aio.Server], None], ...] = ()


def add_port(server: grpc.aio.Server, address: str,
             credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind ``address`` (``host:port`` or ``unix:path``) on ``server``, with TLS when
    ``credentials`` are given; the port bound. Unavailable if it cannot be bound."""
    try:
        port = (server.add_secure_port(address, credentials) if credentials is not None
                else server.add_insecure_port(address))
    except RuntimeError as exc:
        raise Unavailable(f"cannot listen on {address}: {exc}") from None
    if not port:
        raise Unavailable(f"cannot listen on {address}")
    return port


class Server:
    """A rank server. Construct anywhere; ``await start()`` inside the loop it will live on.

    ``cluster`` is TensorFlow's cluster shape (dict, :class:`ClusterSpec`, or a
    JSON file path); this server is task ``task_index`` of job ``job_name`` and
    binds to that task's address (port 0: the OS picks; see :attr:`target`).
    """

    def __init__(self, cluster: ClusterLike, job_name: str, task_index: int,
                 protocol: str = "grpc", *, config: Config | None = None,
                 grpc_setup: GrpcSetup | None = None, stats: Stats | None = None,
                 devices: Devices | None = None, buffers: RecvBuffers | None = None, **overrides: Any) -> None:
        self.protocol = Protocol.parse(protocol)
        self.cluster = ClusterSpec.from_any(cluster)
        self.task = TaskName(job_name, 0, int(task_index))
        self.bind_address = self.cluster.address(self.task)  # UnknownTask if absent
        cfg = self.config = config.replace(**overrides) if config is not None else Config.load(overrides)
        #: With requests over MPI, whether this loop polls MPI itself while traffic
        #: is expected (the fastest for a program that is all asyncio). The
        #: blocking Server turns it off: its loop thread, spinning, would keep the
        #: GIL from the caller's threads; its MPI thread polls instead.
        self.poll_on_loop = True
        self.table = WaitingTable()
        self._stats = stats if stats is not None else Stats()
        #: GPU backends and their pinned pools (cupy by default, imported only when used)
        self.devices = devices if devices is not None else Devices()
        #: large receive buffers, reused once dropped (see rendezvous.buffers)
        self.buffers = buffers if buffers is not None else RecvBuffers(cfg.recv_cache_bytes)
        self._staging = (cfg.gpu_staging_chunk_bytes, cfg.gpu_staging_depth)
        self._setup = grpc_setup or GrpcSetup()
        self._retry = RetryCache(cfg.retry_window, cfg.retry_cache_bytes)
        #: the data planes, most preferred first: MPI's joins at start under grpc+mpi
        self.planes = Planes([InlinePlane(chunk_bytes=cfg.chunk_bytes, buffers=self.buffers,
                                          devices=self.devices, staging=self._staging, stats=self._stats)])
        self.servicer = RecvTensorServicer(self.table, self.task, stats=self._stats, planes=self.planes,
                                           retry=self._retry, max_waiting=cfg.max_waiting_calls)
        self._world = None  # rendezvous.mpi.world.MpiWorld when MPI is in use
        self._plane = None  # rendezvous.mpi.plane.MpiPlane once started
        self._requests = None  # rendezvous.mpi.control.MpiRequests with mpi_requests on
        self._engine = None
        if self.protocol is Protocol.GRPC_MPI and not cfg.mpi_disabled:
            from .mpi.world import MpiWorld  # imports mpi4py: never with MPI_DISABLED=1

            self._world = MpiWorld.join()
        self._grpc: grpc.aio.Server | None = None
        self._target: str | None = None
        self._peers: dict[TaskName, PeerClient] = {}
        self.mpi_ranks: dict[TaskName, int] = {}  # tasks in this MPI job, once started
        self._remote: dict[int, set[asyncio.Task]] = {}
        # fetched tensors whose placement failed, for the next recv of (step, key)
        self._undelivered: dict[tuple[int, str], collections.deque[Received]] = {}
        self._stopped: asyncio.Event | None = None
        self._state = State.NEW

    # -- lifecycle ----------------------------------------------------------

    @property
    def target(self) -> str:
        """``host:port`` this server listens on (the real port once started)."""
        return self._target or self.bind_address

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
        frames.prime_allocator(self.config.chunk_bytes)
        server = grpc.aio.server(interceptors=setup.interceptors or None,
                                 options=server_options(self.config.max_request_bytes, self.config.keepalive_time,
                                                        self.config.keepalive_timeout))
        server.add_generic_rpc_handlers(self.servicer.handlers())
        for add_service in setup.services:
            add_service(server)
        try:
            port = add_port(server, self.bind_address, setup.server_credentials)
        except BaseException:
            self._state = State.NEW  # nothing started: start() may be tried again
            raise
        await server.start()
        self._grpc = server
        self._target = f"{host}:{port}"
        self.cluster = self.cluster.with_address(self.task, self._target)
        if self._world is not None:
            try:
                await self._start_mpi()
            except BaseException:
                if self._engine is not None:
                    engine, self._engine = self._engine, None
                    engine.stop(0)
                    atexit.unregister(engine.stop)
                await server.stop(0)
                self._state = State.NEW
                raise
        self._state = State.SERVING
        log.info("task %s serving on %s (protocol %s)", self.task, self._target, self.protocol)
        if self.protocol is Protocol.GRPC_MPI:
            sys.stderr.write(self.describe() + "\n")  # one write: ranks' lines must not interleave
            sys.stderr.flush()

    async def _start_mpi(self) -> None:
        from .mpi.engine import ProgressEngine
        from .mpi.plane import MpiPlane

        world = self._world
        engine = ProgressEngine(poll_min_us=self.config.mpi_poll_min_us,
                                poll_max_us=self.config.mpi_poll_max_us)
        # With requests over MPI the loop polls while traffic is expected (small
        # transfers at MPI latency); with gRPC requests the MPI thread does,
        # leaving the loop to gRPC (see the engine's notes and poll_on_loop).
        engine.start(loop_polls=self.config.mpi_requests and self.poll_on_loop)
        self._engine = engine
        # mpi4py finalizes MPI at exit; atexit runs last-registered first, so
        # this stops the engine before that even if stop() is never called.
        atexit.register(engine.stop, 5.0)
        # The allgather is collective: every rank of the job reaches it in start().
        ranks = await engine.call(lambda: world.exchange(self.task, self._target))
        engine.attach(world.comm)
        self.mpi_ranks = {task: where.rank for task, where in ranks.items()}
        for task, where in ranks.items():
            if task in self.cluster:
                self.cluster = self.cluster.with_address(task, where.address)
            else:
                log.warning("MPI rank %d runs %s, which is not in the cluster", where.rank, task)
        outside = [str(t) for t in self.cluster.tasks() if t not in ranks]
        if outside:
            log.info("tasks outside this MPI job, served over gRPC: %s", ", ".join(outside))
        self._plane = MpiPlane(world, engine, self.config, self._stats, buffers=self.buffers,
                               devices=self.devices)
        self._plane.delivered = self._retry.delivered
        self.planes.register(self._plane)
        if self.config.mpi_requests:
            from .mpi.control import MpiRequests

            self._requests = MpiRequests(engine, world.control, world.rank, self.servicer)
            self._requests.start()

    def describe(self) -> str:
        """One line: who this rank is and how it moves tensors (printed at start-up)."""
        cfg = self.config
        line = f"rendezvous: {self.task} on {self.target}, protocol {self.protocol}"
        if self.protocol is not Protocol.GRPC_MPI:
            return line
        if cfg.mpi_disabled:
            return line + "; MPI_DISABLED=1: MPI off, all transfers over gRPC"
        world = self._world
        src = cfg.sources.get("mpi_optimal_path", "default")
        setting = f"MPI_OPTIMAL_PATH={int(cfg.mpi_optimal_path)} ({'unset, default' if src == 'default' else src})"
        line += (f"; MPI rank {world.rank}/{world.size} ({world.library}), thread level {world.thread_level}; "
                 f"{setting}, threshold {cfg.mpi_threshold} B; requests over "
                 f"{'MPI (RENDEZVOUS_MPI_REQUESTS=1)' if cfg.mpi_requests else 'gRPC'}")
        plane = self._plane
        if plane is not None:
            how = "GPU buffers to MPI directly" if plane.cuda_aware else \
                f"GPU tensors staged through pinned host memory in {cfg.gpu_staging_chunk_bytes >> 10} KiB chunks"
            line += f"; CUDA-aware MPI: {'yes' if plane.cuda_aware else 'no'} ({plane.cuda_aware_source}): {how}"
        return line

    async def stop(self, grace: float | None = None) -> None:
        """Drain: refuse new recvs (UNAVAILABLE), fail waiters, let replies in flight
        finish for ``grace`` seconds, then cancel the rest. Idempotent."""
        if self._state.ending:
            if self._stopped is not None:
                await self._stopped.wait()
            return
        self._state = State.STOPPING
        # Drain: no new waits; waiters fail; tensors already produced are still
        # served to requests arriving within the grace period.
        self.servicer.begin_drain()
        drained = Unavailable(f"server {self.task} is shutting down")
        self.table.fail_waiters(drained)
        for peer in list(self._peers.values()):
            await peer.close()
        self._peers.clear()
        if self._grpc is not None:
            # The peers' streams stay open for good, so gRPC's own grace would
            # always run out: wait only while something is left to deliver.
            loop = asyncio.get_running_loop()
            end = loop.time() + (grace or 0.0)
            while loop.time() < end and (self.servicer.busy() or self.table.stats()["tensors"]):
                await asyncio.sleep(0.005)
            # End the streams after their last reply; gRPC then waits (briefly)
            # for those handlers to send their status before it cancels the rest.
            self.servicer.close_streams()
            await self._grpc.stop(max(0.2, min(1.0, end - loop.time())))
        if self._requests is not None:
            await self._requests.close()  # the MPI streams end (their replies were written above)
        unconsumed = self.table.stats().get("tensors", 0)
        self.table.close(drained)
        if unconsumed:
            log.warning("task %s stopped with %d produced tensors never consumed", self.task, unconsumed)
        if self._engine is not None:
            # Sends in flight finish (their consumers are posting receives); the
            # engine must stop before MPI is finalized at exit.
            engine, self._engine = self._engine, None
            await asyncio.get_running_loop().run_in_executor(None, engine.stop, grace or 5.0)
            atexit.unregister(engine.stop)
        self.planes.close()
        self._retry.close()
        self._state = State.STOPPED
        if self._stopped is not None:
            self._stopped.set()

    async def wait_for_termination(self) -> None:
        if self._stopped is None:
            raise FailedPrecondition("server was never started")
        await self._stopped.wait()

    join = wait_for_termination

    async def __aenter__(self) -> "Server":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop(0)

    def update_cluster(self, cluster: ClusterLike) -> None:
        """Replace peer addresses (e.g. after every rank bound port 0).

        Peers already connected keep their channel."""
        spec = ClusterSpec.from_any(cluster)
        self.cluster = spec.with_address(self.task, self.target)

    # -- data ---------------------------------------------------------------

    def prepare_send(self, key: Key | str, tensor: Any, is_dead: bool = False) -> tuple[str, Any]:
        """Validate a send and return (canonical key, array); callable from any thread."""
        k = as_key(key)
        src = k.src_task
        if src is not None and src != self.task:
            raise FailedPrecondition(
                f"key {k.format()!r} is produced by {src}; this server is {self.task} and can only send its own")
        # GPU tensors stay on their device (a DeviceTensor with a ready event on
        # the caller's current stream: call this on the producer's thread).
        return k.format(), (None if is_dead else self.devices.import_tensor(tensor))

    def send(self, key: Key | str, tensor: Any, step_id: int = 0, is_dead: bool = False) -> None:
        """Produce ``tensor`` under ``key`` for step ``step_id`` (on the loop thread).

        The array is not copied: do not modify it until it has been received.
        Raises InvalidKey, or the step's error if it was aborted."""
        canonical, arr = self.prepare_send(key, tensor, is_dead)
        self.table.send(step_id, canonical, arr, is_dead)

    async def recv(self, key: Key | str, step_id: int = 0, timeout: float | None = None,
                   device: str | Placement | None = None) -> Any:
        """The tensor sent under ``key`` in ``step_id`` (None if it is dead).

        It lands where the key's ``dst_device`` says (``GPU:N``: a cupy array on
        device N; otherwise numpy), or on ``device`` ("cpu", "gpu:N") if given.
        Local keys are served from this rank's table with no copy when the
        tensor is already where it should be; remote keys by RecvTensor to the
        producing task. Raises DeadlineExceeded after ``timeout`` seconds,
        Aborted if the step is aborted, UnknownTask for a task outside the
        cluster, PeerUnavailable if the producer is gone."""
        return (await self.recv_item(key, step_id, timeout, device)).value

    async def recv_item(self, key: Key | str, step_id: int = 0,
                        timeout: float | None = None, device: str | Placement | None = None) -> Received:
        """:meth:`recv` as ``Received(value, is_dead)``."""
        return (await self.fetch(key, step_id, timeout, device)).item

    async def fetch(self, key: Key | str, step_id: int = 0, timeout: float | None = None,
                    device: str | Placement | None = None) -> Fetched:
        """:meth:`recv_item` with the path the tensor took (``Fetched``): what a
        daemon reports for its local clients' recvs."""
        k = as_key(key)
        canonical = k.format()
        explicit = parse_placement(device)
        target, _ = self.devices.resolve(explicit or placement_for_device(k.dst), explicit is not None)
        err = self.table.aborted(step_id)
        if err is not None:
            raise err
        if (step_id, canonical) in self._undelivered:
            return await self._recv_kept(step_id, canonical, target)
        src = k.src_task
        if src is None or src == self.task:
            return await self._recv_local(step_id, canonical, timeout, target)
        return await self._recv_remote(src, step_id, canonical, timeout, target)

    async def _recv_kept(self, step_id: int, key: str, target: Placement) -> Fetched:
        """A tensor fetched before whose placement failed: it goes first."""
        kept = self._undelivered[(step_id, key)]
        item = kept.popleft()
        if not kept:
            del self._undelivered[(step_id, key)]
        try:
            return Fetched(Received(await self._place(item.value, target), item.is_dead), Path.LOCAL, True)
        except BaseException:
            self._keep(step_id, key, item, front=True)
            raise

    async def _recv_local(self, step_id: int, key: str, timeout: float | None, target: Placement) -> Fetched:
        """From this rank's own table: the object that was sent, unless it must move device."""
        try:
            async with asyncio.timeout(timeout):
                item = await self.table.recv(step_id, key)
        except TimeoutError:
            raise DeadlineExceeded(f"recv of {key!r} (step {step_id}) timed out after {timeout:g}s") from None
        try:
            placed = await self._place(item.value, target)
        except BaseException:
            self._requeue(step_id, key, item)  # not delivered: it stays for a later recv
            raise
        self._stats.received(Path.LOCAL, payload_nbytes(item.value))
        return Fetched(Received(placed, item.is_dead), Path.LOCAL, True)

    async def _recv_remote(self, src: TaskName, step_id: int, key: str, timeout: float | None,
                           target: Placement) -> Fetched:
        """From the producing task, through its peer client (an abort of the step
        cancels the wait and raises the step's error)."""
        peer = self._peer(src)
        task = asyncio.current_task()
        waits = self._remote.setdefault(step_id, set())
        waits.add(task)  # type: ignore[arg-type]
        try:
            fetched = await peer.recv(key, step_id, timeout, target)
        except asyncio.CancelledError as exc:
            if exc.args and isinstance(exc.args[0], _StepEnded):
                task.uncancel()  # type: ignore[union-attr]
                raise copy.copy(exc.args[0].error) from None
            raise
        except NotPlaced as exc:  # moved, but the device could not take it
            self._stats.error(Path.GRPC)
            self._keep(step_id, key, Received(exc.value, False))
            raise
        except RendezvousError:
            self._stats.error(Path.GRPC)
            raise
        finally:
            waits.discard(task)  # type: ignore[arg-type]
            if not waits:
                self._remote.pop(step_id, None)
        item = fetched.item
        self._stats.received(fetched.path, payload_nbytes(item.value))
        if not fetched.placed:
            try:
                item = Received(await self._place(item.value, target), item.is_dead)
            except BaseException:
                self._keep(step_id, key, item)
                raise
        return Fetched(item, fetched.path, True)

    def _keep(self, step_id: int, key: str, item: Received, front: bool = False,
              why: str = "could not place the tensor") -> None:
        """Hold a fetched tensor that could not be delivered (its placement failed,
        or its recv gave up while it was on its way) for the next recv of the same
        key and step: fetched is never lost."""
        queue = self._undelivered.setdefault((step_id, key), collections.deque())
        queue.appendleft(item) if front else queue.append(item)
        log.warning("recv of %r (step %d) %s; kept for the next recv", key, step_id, why)

    def keep(self, step_id: int, key: str, item: Received, why: str) -> None:
        """Hold ``item``, fetched by a recv but never delivered (a daemon's local
        client went away), for the next recv of ``key`` in ``step_id``, in front:
        it was the oldest. Dropped if the step is over."""
        if self._state.ending or self.table.aborted(step_id) is not None:
            return
        self._keep(step_id, key, item, front=True, why=why)

    def _unclaimed(self, step_id: int, key: str, fetched: Fetched) -> None:
        """A tensor that arrived after its recv gave up (deadline, cancel)."""
        if self._state.ending or self.table.aborted(step_id) is not None:
            return  # the step (or the server) is over: its tensors are dropped anyway
        self._keep(step_id, key, fetched.item, why="timed out or was cancelled while it was on its way")

    def _requeue(self, step_id: int, key: str, item: Received) -> None:
        try:
            self.table.requeue(step_id, key, item)
        except RendezvousError:
            pass  # the step ended meanwhile: its tensors are dropped anyway

    async def _place(self, value: Any, target: Placement) -> Any:
        """``value`` on ``target`` (already resolved); copies run off the loop."""
        if value is None:
            return None
        if not isinstance(value, DeviceTensor) and not self.devices.needs_copy(value, target, True):
            return value  # host data staying on the host (strings too): the object as it is
        try:
            placed = await asyncio.get_running_loop().run_in_executor(
                None, self.devices.place, value, target, True, self._staging)
        except RendezvousError:
            raise
        except Exception as exc:  # out of device memory, a CUDA error: the caller keeps the tensor
            raise ResourceExhausted(f"cannot put the tensor on {target}: {type(exc).__name__}: {exc}; "
                                    "it is kept for the next recv of this key") from exc
        if isinstance(value, DeviceTensor) and not target.is_gpu:
            self._stats.gpu("to_host")
        elif not isinstance(value, DeviceTensor) or value.device != target.index:
            self._stats.gpu("to_device")
        return placed

    def abort(self, step_id: int, message: str = "aborted") -> None:
        """Fail every waiter and every later send/recv of ``step_id`` with ABORTED."""
        error = Aborted(message)
        self.table.abort(step_id, error)
        self._cancel_remote(step_id, error)
        self._drop_kept(step_id)

    def cleanup(self, step_id: int) -> None:
        """Abort the step's waiters and forget the step (its ids may be reused)."""
        self.table.cleanup(step_id)
        self._retry.drop_step(step_id)
        self._cancel_remote(step_id, Aborted(f"step {step_id} cleaned up"))
        self._drop_kept(step_id)

    def _drop_kept(self, step_id: int) -> None:
        for k in [k for k in self._undelivered if k[0] == step_id]:
            del self._undelivered[k]

    def _cancel_remote(self, step_id: int, error: RendezvousError) -> None:
        for task in list(self._remote.get(step_id, ())):
            task.cancel(_StepEnded(error))

    def stats(self) -> dict[str, dict[str, int]]:
        """Counters per path: {"local"|"grpc"|"mpi": {transfers, bytes, errors, fallbacks, served,
        served_bytes}}; "mpi" also has "in_flight" (MPI operations posted and not complete)."""
        snap = self._stats.snapshot()
        snap["mpi"]["in_flight"] = self._engine.in_flight if self._engine is not None else 0
        snap["gpu"] = {**self._stats.gpu_snapshot(),
                       "cuda_aware": int(bool(self._plane is not None and self._plane.cuda_aware))}
        return snap

    def pending(self) -> list[Any]:
        return self.table.pending()

    def _peer(self, task: TaskName) -> PeerClient:
        peer = self._peers.get(task)
        if peer is None:
            if self._state is not State.SERVING:
                raise Unavailable(f"server {self.task} is {self._state}")
            rank = self.mpi_ranks.get(task)
            requests = self._requests
            open_call = None if requests is None or rank is None else (lambda r=rank: requests.open_call(r))
            peer = PeerClient(task, self.cluster.address(task), self.config, planes=self.planes,
                              credentials=self._setup.channel_credentials, metadata=self._setup.metadata,
                              on_unclaimed=self._unclaimed, open_call=open_call)
            self._peers[task] = peer
        return peer

