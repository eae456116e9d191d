"""rendezvousd: one rendezvous daemon per node.

The daemon is a rank: a :class:`rendezvous.aio.Server` (its waiting table
holds what the node's processes produce; it serves RecvTensor to the other
nodes over gRPC, and over MPI under ``grpc+mpi``). Beside it:

* the local service (:mod:`rendezvous.daemon.service`) on a Unix socket (or
  TCP), through which the node's training processes send and recv;
* the Admin service (``Stats``, ``Pending``) and gRPC health
  (``grpc.health.v1``; NOT_SERVING while draining), both
  :class:`rendezvous.rpc.admin.Admin`: the rank server's own on the remote
  port, the daemon's on the local socket, each answering for the whole node
  (the local clients' recvs and sessions too); and server reflection on
  both, listing what each serves;
* Prometheus metrics on an HTTP port (:mod:`rendezvous.daemon.metrics`);
* a stall watcher: a recv waiting longer than ``stall_warning`` seconds is
  logged once, naming its key and the producing task;
* security for the remote port (:mod:`rendezvous.auth`): TLS or mutual
  TLS, and an optional shared token on every call.

Lifecycle: :meth:`Daemon.start` (collective under MPI), :meth:`Daemon.stop`
drains (health NOT_SERVING, local calls refused, waiters fail with
UNAVAILABLE, produced tensors still served for ``grace`` seconds, the count
never consumed logged), removes the socket file, and returns. :func:`run`
wires that to SIGTERM/SIGINT for the command line; a second signal exits at
once.

Threads: the event loop owns everything above; the metrics HTTP server has
its own thread and reads a snapshot through the loop; the MPI progress
thread is the rank server's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import grpc

from rendezvous import auth
from rendezvous.cluster import parse_address
from rendezvous.config import Config
from rendezvous.errors import FailedPrecondition, Unavailable
from rendezvous.lifecycle import State
from rendezvous.local.address import parse_local_address, session_path
from rendezvous.local.segments import available as shm_available
from rendezvous.paths import AddressKind
from rendezvous.rank.server import Server, add_port
from rendezvous.rpc.admin import ADMIN_SERVICE, Admin
from rendezvous.rpc.options import SERVICE as RANK_SERVICE
from rendezvous.rpc.options import server_options

from .service import SERVICE as LOCAL_SERVICE
from .service import LocalServicer
from .listener import SessionListener
from .pool import Pool
from .sessions import PoolBuffers
from .setup import check_local_tls, claim_socket, descriptor_budget, grpc_security, local_address, need_extra, \
    pool_limit, resolve_identity

__all__ = ["Daemon", "run"]

log = logging.getLogger("rendezvous.daemon")


# -- the daemon ---------------------------------------------------------------------


class Daemon:
    """One node's daemon. Build anywhere; ``await start()`` inside the loop it lives on.
    ``devices``: its GPU backends (default: cupy's, loaded at the first GPU tensor)."""

    def __init__(self, config: Config, *, cluster: Any = None, devices: Any = None) -> None:
        need_extra()
        self.config = config
        found_cluster, job, index, self.index_source = resolve_identity(config) if cluster is None else \
            (cluster, config.job_name, max(config.task_index, 0), "argument")
        from .metrics import DaemonMetrics

        self.metrics = DaemonMetrics()
        setup, self._token = grpc_security(config, on_reject=lambda m: self.metrics.error("UNAUTHENTICATED"))
        setup = dataclasses.replace(setup, services=(self._add_rank_services,))
        self.local_address, _ = local_address(config, job, index)
        self._kind, self._where = parse_local_address(self.local_address)
        check_local_tls(config, self._kind, self._where)
        #: the shared-memory pool of the session socket (Unix local sockets only)
        self.pool: Pool | None = None
        self.shm_threshold = config.shm_threshold if self._kind is AddressKind.UNIX and shm_available() else -1
        buffers = None
        #: the descriptor limit, and how the pool and the sessions share it
        self.descriptors = descriptor_budget()
        if self.shm_threshold >= 0:
            self.pool = Pool(pool_limit(config), max_segments=self.descriptors.segments,
                                 max_free=self.descriptors.free)
            buffers = PoolBuffers(self.pool, self.shm_threshold, config.recv_cache_bytes)
        self.server = Server(found_cluster, job, index, config.protocol, config=config, grpc_setup=setup,
                             buffers=buffers, devices=devices)
        self.server.receiver.stall_warning = 0  # the daemon's own watcher says it, for local and peer recvs
        self.local = LocalServicer(self.server, self.metrics)
        #: Admin and health on the remote (rank) port: the rank server's own,
        #: answering for the whole node
        self.rank_admin: Admin = self.server.admin
        self.rank_admin.provide(pending=self.local.pending, extra_stats=self.node_stats)
        #: Admin and health on the local socket
        self.local_admin = Admin(self.server, pending=self.local.pending, extra_stats=self.node_stats,
                                 health_names=(RANK_SERVICE, LOCAL_SERVICE, ADMIN_SERVICE))
        self.sessions: SessionListener | None = None
        self._local_grpc: grpc.aio.Server | None = None
        self._socket_ino: int | None = None
        self.local_target = ""
        self.metrics_url = ""
        self._stall_task: asyncio.Task | None = None
        self._keeper: asyncio.Task | None = None
        self._stalled_table: set[tuple[int, str]] = set()
        self._state = State.NEW
        self._stopped: asyncio.Event | None = None

    @property
    def task(self):
        return self.server.task

    @property
    def target(self) -> str:
        """The remote (rank) address, ``host:port``."""
        return self.server.target

    # -- start ------------------------------------------------------------------

    def _add_rank_services(self, server: grpc.aio.Server) -> None:
        """The rank port's reflection."""
        self._add_reflection(server, [RANK_SERVICE, *self.rank_admin.service_names])

    @staticmethod
    def _add_reflection(server: grpc.aio.Server, served: list[str]) -> None:
        """Server reflection listing ``served`` (the services on that port) and itself."""
        from grpc_health.v1 import health_pb2  # noqa: F401  (registers the descriptors reflection serves)
        from grpc_reflection.v1alpha import reflection

        from rendezvous.v1 import admin_pb2, local_pb2, rendezvous_pb2  # noqa: F401  (the same)

        reflection.enable_server_reflection([*served, reflection.SERVICE_NAME], server)

    async def start(self) -> None:
        """Start the rank server (collective under grpc+mpi), the local service, metrics."""
        if self._state is not State.NEW:
            raise FailedPrecondition(f"daemon is {self._state}; start() is allowed once")
        self._state = State.STARTING
        self._stopped = asyncio.Event()
        await self.server.start()
        try:
            await self._start_local()
            if self.config.metrics_port >= 0:
                self._start_metrics()
        except BaseException:
            await self._close_local()
            self.metrics.close()
            await self.server.stop(0)
            raise
        await self._set_health(True)
        self._stall_task = asyncio.create_task(self._watch_stalls(), name="rendezvousd-stalls")
        self._state = State.SERVING
        self._keeper = asyncio.create_task(self._keep(), name="rendezvousd-keeper")
        log.info("rendezvousd %s serving on %s; local clients at %s", self.task, self.target, self.local_target)

    async def _keep(self) -> None:
        """Lives while the daemon serves: a loop that ends with the daemon never
        stopped stops it (its ports close, its socket files go)."""
        assert self._stopped is not None
        try:
            await self._stopped.wait()
        except asyncio.CancelledError:
            if not self._state.ending:
                log.warning("rendezvousd %s: its event loop is ending and it was never stopped; stopping it",
                            self.task)
                # gRPC's own tasks end with the loop too: the local port is closed
                # first (the rank server's keeper closes its own), then the rest.
                if self._local_grpc is not None:
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._local_grpc.stop(0)
                with contextlib.suppress(asyncio.CancelledError):
                    await self.stop(0)
            raise

    async def _start_local(self) -> None:
        limit = self.config.max_tensor_bytes + (1 << 20)  # an inline send carries its tensor
        interceptors = None
        if self._kind is AddressKind.TCP and self._token:
            interceptors = [auth.TokenInterceptor(self._token,
                                                  on_reject=lambda m: self.metrics.error("UNAUTHENTICATED"))]
        server = grpc.aio.server(interceptors=interceptors, options=server_options(limit))
        server.add_generic_rpc_handlers(self.local.handlers())
        self.local_admin.add_to(server)
        self._add_reflection(server, [LOCAL_SERVICE, *self.local_admin.service_names])
        if self._kind is AddressKind.UNIX:
            path = self._where
            claim_socket(path)
            add_port(server, f"unix:{path}")
            os.chmod(path, 0o600)
            self._socket_ino = os.stat(path).st_ino
            self.local_target = f"unix:{path}"
            if self.pool is not None:
                self.sessions = SessionListener(self.local, self.pool, session_path(path), self.shm_threshold,
                                              max_sessions=self.descriptors.sessions)
                self.sessions.start()
                self.local.session_socket = self.sessions.path
        else:
            host, _ = parse_address(self._where)
            port = add_port(server, self._where)
            self.local_target = f"{host}:{port}"
        await server.start()
        self._local_grpc = server

    def _start_metrics(self) -> None:
        host = self.config.metrics_host or parse_address(self.target)[0]
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        self.metrics.bind(asyncio.get_running_loop(), self.snapshot)
        try:
            port = self.metrics.serve(host, self.config.metrics_port)
        except OSError as exc:
            raise Unavailable(f"cannot serve metrics on {host}:{self.config.metrics_port}: {exc}") from None
        shown = f"[{host}]" if ":" in host else host
        self.metrics_url = f"http://{shown}:{port}/metrics"

    def describe(self) -> str:
        """The ready line: who this daemon is and where it listens."""
        parts = [f"rendezvousd: {self.task} serving on {self.target} (protocol {self.server.protocol}"
                 f"{', TLS' if self.config.tls_cert else ''}{', mutual TLS' if self.config.tls_client_auth else ''}"
                 f"{', token' if self._token else ''})", f"local {self.local_target}"]
        if self.metrics_url:
            parts.append(f"metrics {self.metrics_url}")
        parts.append(f"pid {os.getpid()}")
        if self.sessions is not None:
            parts.append(f"sessions unix:{self.sessions.path}")
        return "; ".join(parts)

    # -- operations -------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Scrape-time values (on the loop thread)."""
        table = self.server.table.stats()
        entries = self.server.pending()
        return {
            "stats": self.server.stats(),
            "tensors": table["tensors"],
            "waiters": table["waiters"],
            "keys": table["keys"],
            "oldest": max((e.oldest_age_s for e in entries), default=0.0),
            **self.node_stats(),
        }

    def node_stats(self) -> dict[str, Any]:
        """What the daemon adds to its rank server's counters: local clients' recvs
        waiting and the oldest's age, sessions, the pool, whether it drains."""
        now = time.monotonic()
        waits = list(self.local.waits.values())
        return {
            "local_waits": len(waits),
            "local_oldest": max((now - w.started for w in waits), default=0.0),
            "sessions": len(self.local.attached) + (len(self.sessions.sessions) if self.sessions else 0),
            "pool": self.pool.stats() if self.pool is not None else {},
            "draining": self._state.ending,
        }

    async def _set_health(self, serving: bool) -> None:
        """Health on both ports: SERVING overall and for the rank, local and admin
        services; NOT_SERVING for good once draining."""
        await self.rank_admin.set_serving(serving)
        await self.local_admin.set_serving(serving)
        if serving:
            await self.rank_admin.set_status(LOCAL_SERVICE, True)

    async def _watch_stalls(self) -> None:
        limit = self.config.stall_warning
        if limit <= 0:
            return
        every = min(max(limit / 4, 0.05), 5.0)
        while True:
            await asyncio.sleep(every)
            self.check_stalls(limit)

    def check_stalls(self, limit: float) -> int:
        """Log each recv waiting longer than ``limit`` seconds once; how many were new."""
        n = 0
        mine = {(w.step_id, w.key) for w in self.local.waits.values()}  # reported as local recvs below
        for key, step, producer, age in self.local.stalled(limit):
            n += 1
            log.warning("recv of %s (step %d) has waited %.1fs for its producer %s", key, step, age, producer,
                        extra={"key": key, "step_id": step, "producer": producer, "waited_s": round(age, 3)})
        me = str(self.task)
        seen = set()
        for e in self.server.pending():
            if e.kind != "waiter":
                continue
            ident = (e.step_id, str(e.key))
            if ident in mine:
                continue
            seen.add(ident)
            if e.oldest_age_s >= limit and ident not in self._stalled_table:
                self._stalled_table.add(ident)
                n += 1
                log.warning("a peer's recv of %s (step %d) has waited %.1fs for its producer %s (this node)",
                            e.key, e.step_id, e.oldest_age_s, me,
                            extra={"key": str(e.key), "step_id": e.step_id, "producer": me,
                                   "waited_s": round(e.oldest_age_s, 3)})
        self._stalled_table &= seen
        return n

    # -- stop ----------------------------------------------------------------------------

    async def stop(self, grace: float | None = None) -> None:
        """Drain and stop (see the module docstring). Idempotent."""
        if self._state.ending:
            if self._stopped is not None:
                await self._stopped.wait()
            return
        if self._state is State.NEW:
            self._state = State.STOPPED
            return
        self._state = State.STOPPING
        grace = self.config.grace if grace is None else grace
        log.info("rendezvousd %s draining (grace %gs)", self.task, grace)
        await self._set_health(False)
        self.local.begin_drain()
        if self._stall_task is not None:
            self._stall_task.cancel()
        await self.server.stop(grace)  # waiters fail UNAVAILABLE; logs tensors never consumed
        await self._close_local()
        self.metrics.close()
        self._state = State.STOPPED
        log.info("rendezvousd %s stopped", self.task)
        if self._stopped is not None:
            self._stopped.set()

    async def _close_local(self) -> None:
        self.local.close()
        if self.sessions is not None:
            self.sessions.close()
        if self.pool is not None:
            self.pool.close()
        if self._local_grpc is not None:
            server, self._local_grpc = self._local_grpc, None
            await server.stop(1.0)
        self.remove_socket()

    def remove_socket(self) -> None:
        """Remove our socket files (only if they are still the ones we bound)."""
        if self.sessions is not None:
            self.sessions.remove_file()
        if self._kind is not AddressKind.UNIX or self._socket_ino is None:
            return
        try:
            if os.stat(self._where).st_ino == self._socket_ino:
                os.unlink(self._where)
        except FileNotFoundError:
            pass
        self._socket_ino = None

    async def wait_for_termination(self) -> None:
        if self._stopped is None:
            raise FailedPrecondition("daemon was never started")
        await self._stopped.wait()


# -- the command line ---------------------------------------------------------------------


def run(config: Config, out: Any = None, command: Sequence[str] = ()) -> int:
    """Run a daemon until SIGTERM/SIGINT; 0 after a clean drain. A second signal exits at once.

    With a ``command`` (``rendezvousd ... -- COMMAND``), the daemon runs it once
    serving and lives as long as it does, exiting with its status
    (:mod:`rendezvous.daemon.child`)."""
    from rendezvous.lifecycle import run_until_signalled

    if command:
        from .child import WithChild

        async def start_with_child() -> WithChild:
            daemon = Daemon(config)
            await daemon.start()
            return await WithChild(daemon, command).start()

        def exit_now(run: WithChild) -> None:
            run.kill()
            run.daemon.remove_socket()

        return run_until_signalled(start_with_child, prog="rendezvousd", announce=lambda r: r.describe(),
                                   stop=lambda r: r.stop(), uvloop=config.uvloop, out=out, before_exit=exit_now)

    async def start() -> Daemon:
        daemon = Daemon(config)
        await daemon.start()
        return daemon

    return run_until_signalled(start, prog="rendezvousd", announce=lambda d: d.describe(),
                               stop=lambda d: d.stop(), uvloop=config.uvloop, out=out,
                               before_exit=lambda d: d.remove_socket())
