"""rendezvousd: one rendezvous daemon per node.

The daemon is a rank: a :class:`rendezvous.aio.Server` (its waiting table
holds what the node's processes produce; it serves RecvTensor to the other
nodes over gRPC, and over MPI under ``grpc+mpi``). Beside it:

* the local service (:mod:`rendezvous.daemon.service`) on a Unix socket (or
  TCP), through which the node's training processes send and recv;
* gRPC health (``grpc.health.v1``; NOT_SERVING while draining) and server
  reflection, on both the remote port and the local socket;
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
import json
import logging
import os
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from rendezvous import aio, auth, shm
from rendezvous.cluster import parse_address
from rendezvous.config import Config
from rendezvous.errors import FailedPrecondition, InvalidArgument, Unavailable
from rendezvous.lifecycle import State
from rendezvous.rpc.options import SERVICE as RANK_SERVICE
from rendezvous.rpc.options import server_options

from .service import SERVICE as LOCAL_SERVICE
from .service import LocalServicer
from .sessions import PoolBuffers, SessionServer, session_path

__all__ = ["Daemon", "Identity", "run", "resolve_identity", "default_local_address", "parse_local_address",
           "JsonFormatter", "setup_logging", "render_config"]

log = logging.getLogger("rendezvous.daemon")
_MAX_UNIX_PATH = 107  # sockaddr_un.sun_path, less the terminating NUL


def _need_extra() -> None:
    try:
        import grpc_health.v1.health  # noqa: F401
        import grpc_reflection.v1alpha.reflection  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError as exc:
        raise FailedPrecondition(f"rendezvousd needs the daemon extra ({exc.name} is missing): "
                                 "pip install 'rendezvous[daemon]'") from None


# -- identity and addresses -----------------------------------------------------


class Identity(NamedTuple):
    """Who a daemon is: its cluster, job and task index, and where the index came from."""

    cluster: Any
    job_name: str
    task_index: int
    index_source: str


def resolve_identity(config: Config) -> Identity:
    """The daemon's :class:`Identity` from its config (and the launcher's rank)."""
    if not config.cluster or not config.job_name:
        raise InvalidArgument("a daemon needs cluster and job_name (--cluster/--job-name, RENDEZVOUS_CLUSTER/"
                              "RENDEZVOUS_JOB_NAME, or the config file)")
    text = config.cluster
    cluster: Any = json.loads(text) if text.lstrip().startswith("{") else text
    index = config.task_index
    source = config.sources.get("task_index", "default")
    if index < 0:
        from rendezvous.launch import RANK_VARIABLES, launcher_rank

        found = launcher_rank()
        if found is not None:
            index = found[0]
            var = next(v for v in RANK_VARIABLES if os.environ.get(v, "").isdigit())
            source = f"launcher {var}"
        else:
            index, source = 0, "default (no launcher)"
    return Identity(cluster, config.job_name, index, source)


def default_local_address(env: Any = None) -> str:
    """``unix:$XDG_RUNTIME_DIR/rendezvous/rendezvousd.sock``, else under /run/rendezvous
    (where :class:`rendezvous.client.Client` looks by default)."""
    from rendezvous.client.local import default_address

    env = os.environ if env is None else env
    return default_address({k: v for k, v in env.items() if k != "RENDEZVOUS_LOCAL_ADDRESS"})


def parse_local_address(address: str) -> tuple[str, str]:
    """("unix", path) or ("tcp", "host:port"); InvalidArgument if neither."""
    if address.startswith("unix:"):
        path = address[5:]
        if path.startswith("//"):  # unix:///abs/path, gRPC's other spelling
            path = path[2:]
        if not path:
            raise InvalidArgument(f"local address {address!r} has no path")
        if len(os.fsencode(path)) > _MAX_UNIX_PATH:
            raise InvalidArgument(f"socket path {path!r} is longer than {_MAX_UNIX_PATH} bytes")
        return "unix", path
    parse_address(address)
    return "tcp", address


# -- logging ----------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and any fields
    passed with ``extra=`` (key, step_id, producer, ...)."""

    _STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in self._STANDARD and not k.startswith("_"):
                out[k] = v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(config: Config, level: int | None = None) -> None:
    """Root logging to stderr, text or JSON as the config says."""
    handler = logging.StreamHandler(sys.stderr)
    if config.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level if level is not None else getattr(logging, config.log_level.upper()))
    if root.level > logging.DEBUG:
        logging.getLogger("rendezvous.client").setLevel(max(root.level, logging.WARNING))


def render_config(config: Config, identity: Identity | None = None) -> str:
    """The effective config as TOML, each value with where it came from (secrets masked)."""
    lines = ["# rendezvousd: effective configuration (value  # source)"]
    for name, value, source, secret in config.explain():
        if name == "task_index" and identity is not None:
            value, source = identity.task_index, identity.index_source
        if value is None:
            lines.append(f"# {name} is unset  ({source})")
            continue
        if secret and value:
            text = '"***"'
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = json.dumps(value)
        else:
            text = repr(value)
        lines.append(f"{name} = {text}  # {source}")
    return "\n".join(lines) + "\n"


def pool_limit(config: Config) -> int:
    """``shm_pool_bytes``, or half the machine's memory when it is 0."""
    if config.shm_pool_bytes > 0:
        return config.shm_pool_bytes
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError):
        return 8 << 30


#: descriptors kept out of the pool's reach: listening sockets, peers' connections,
#: gRPC's and MPI's own, log files
_RESERVED_FDS = 256


class Descriptors(NamedTuple):
    """How a daemon shares its descriptors: the process's limit, the pool's
    segments (one descriptor each), free segments kept for reuse, and local
    sessions (one each)."""

    limit: int
    segments: int
    free: int
    sessions: int


def descriptor_budget() -> Descriptors:
    """Raise this process's descriptor limit to its hard limit (the usual soft
    limit of 1,024 is a default for select()-era programs; servers raise it),
    then split it: half of what is not reserved for segments, a quarter for
    sessions. Without this a client's lends could take every descriptor."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.debug("cannot raise the descriptor limit from %d to %d: %s", soft, target, exc)
    room = max(64, soft - _RESERVED_FDS)
    segments = min(1 << 16, max(16, room // 2))
    return Descriptors(soft, segments, max(8, min(256, segments // 8)), max(16, room // 4))


# -- the daemon ---------------------------------------------------------------------


class Daemon:
    """One node's daemon. Build anywhere; ``await start()`` inside the loop it lives on."""

    def __init__(self, config: Config, *, cluster: Any = None) -> None:
        _need_extra()
        self.config = config
        found_cluster, job, index, self.index_source = resolve_identity(config) if cluster is None else \
            (cluster, config.job_name, max(config.task_index, 0), "argument")
        token = auth.load_token(config)
        from .metrics import DaemonMetrics

        self.metrics = DaemonMetrics()
        self._health: list[Any] = []
        interceptors = (auth.TokenInterceptor(token, on_reject=lambda m: self.metrics.error("UNAUTHENTICATED")),) \
            if token else ()
        self._token = token
        setup = aio.GrpcSetup(server_credentials=auth.server_credentials(config),
                              channel_credentials=auth.channel_credentials(config),
                              metadata=auth.token_metadata(token), interceptors=interceptors,
                              services=(self._add_ops_services,))
        raw = config.local_address or default_local_address()
        self.local_address = raw.replace("{job_name}", job).replace("{task_index}", str(index))
        self._kind, self._where = parse_local_address(self.local_address)
        #: the shared-memory pool of the session socket (Unix local sockets only)
        self.pool: shm.Pool | None = None
        self.shm_threshold = config.shm_threshold if self._kind == "unix" and shm.available() else -1
        buffers = None
        #: the descriptor limit, and how the pool and the sessions share it
        self.descriptors = descriptor_budget()
        if self.shm_threshold >= 0:
            self.pool = shm.Pool(pool_limit(config), max_segments=self.descriptors.segments,
                                 max_free=self.descriptors.free)
            buffers = PoolBuffers(self.pool, self.shm_threshold, config.recv_cache_bytes)
        self.server = aio.Server(found_cluster, job, index, config.protocol, config=config, grpc_setup=setup,
                                 buffers=buffers)
        self.local = LocalServicer(self.server, self.metrics)
        self.sessions: SessionServer | None = None
        self._local_grpc: grpc.aio.Server | None = None
        self._socket_ino: int | None = None
        self.local_target = ""
        self.metrics_url = ""
        self._stall_task: asyncio.Task | None = None
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

    def _add_ops_services(self, server: grpc.aio.Server) -> None:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection

        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        self._health.append(servicer)
        names = [RANK_SERVICE, LOCAL_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, server)

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
        log.info("rendezvousd %s serving on %s; local clients at %s", self.task, self.target, self.local_target)

    async def _start_local(self) -> None:
        from rendezvous.v1 import local_pb2  # noqa: F401  (registers the service for reflection)

        limit = self.config.max_tensor_bytes + (1 << 20)  # an inline send carries its tensor
        interceptors = None
        if self._kind == "tcp" and self._token:
            interceptors = [auth.TokenInterceptor(self._token,
                                                  on_reject=lambda m: self.metrics.error("UNAUTHENTICATED"))]
        server = grpc.aio.server(interceptors=interceptors, options=server_options(limit))
        server.add_generic_rpc_handlers(self.local.handlers())
        self._add_ops_services(server)
        if self._kind == "unix":
            path = self._where
            self._claim_socket(path)
            aio.add_port(server, f"unix:{path}")
            os.chmod(path, 0o600)
            self._socket_ino = os.stat(path).st_ino
            self.local_target = f"unix:{path}"
            if self.pool is not None:
                self.sessions = SessionServer(self.local, self.pool, session_path(path), self.shm_threshold,
                                              max_sessions=self.descriptors.sessions)
                self.sessions.start()
                self.local.session_socket = self.sessions.path
        else:
            host, _ = parse_address(self._where)
            port = aio.add_port(server, self._where)
            self.local_target = f"{host}:{port}"
        await server.start()
        self._local_grpc = server

    def _claim_socket(self, path: str) -> None:
        """Make the socket's folder (0700 when we create it); refuse a socket another
        daemon still listens on; remove a stale one."""
        folder = Path(path).parent
        if not folder.exists():
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise InvalidArgument(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a previous daemon's leftover
            log.info("removed stale socket %s", path)
            return
        finally:
            probe.close()
        raise Unavailable(f"another daemon is listening on {path}")

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
        now = time.monotonic()
        waits = list(self.local.waits.values())
        return {
            "stats": self.server.stats(),
            "tensors": table["tensors"],
            "waiters": table["waiters"],
            "keys": table["keys"],
            "oldest": max((e.oldest_age_s for e in entries), default=0.0),
            "local_waits": len(waits),
            "local_oldest": max((now - w.started for w in waits), default=0.0),
            "sessions": len(self.local.sessions) + (len(self.sessions.sessions) if self.sessions else 0),
            "pool": self.pool.stats() if self.pool is not None else {},
            "draining": self._state.ending,
        }

    async def _set_health(self, serving: bool) -> None:
        from grpc_health.v1 import health_pb2

        for servicer in self._health:
            if serving:
                status = health_pb2.HealthCheckResponse.SERVING
                for name in ("", RANK_SERVICE, LOCAL_SERVICE):
                    await servicer.set(name, status)
            else:
                await servicer.enter_graceful_shutdown()

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
        if self._kind != "unix" or self._socket_ino is None:
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


def run(config: Config, out: Any = None) -> int:
    """Run a daemon until SIGTERM/SIGINT; 0 after a clean drain. A second signal exits at once."""
    from rendezvous.lifecycle import run_until_signalled

    async def start() -> Daemon:
        daemon = Daemon(config)
        await daemon.start()
        return daemon

    return run_until_signalled(start, prog="rendezvousd", announce=lambda d: d.describe(),
                               stop=lambda d: d.stop(), uvloop=config.uvloop, out=out,
                               before_exit=lambda d: d.remove_socket())
