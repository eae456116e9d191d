"""What a daemon needs before it starts: who it is, its logging, its limits,
its socket and its local address, and the effective configuration shown by
``--print-config``. Its gRPC port is secured as every rank server's is
(:func:`rendezvous.rank.setup.grpc_security`). ``rendezvous serve`` uses the
identity and logging parts for a plain rank server too."""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from rendezvous.config import Config
from rendezvous.errors import FailedPrecondition, InvalidArgument, Unavailable
from rendezvous.local.address import default_daemon_address
from rendezvous.paths import AddressKind
from rendezvous.rank.setup import grpc_security  # noqa: F401  (a daemon's gRPC port: the rank servers' setup)

__all__ = ["need_extra", "Identity", "resolve_identity", "local_address", "grpc_security", "check_local_tls",
           "json_formatter", "setup_logging", "render_config", "pool_limit", "Descriptors", "descriptor_budget",
           "claim_socket"]

log = logging.getLogger("rendezvous.daemon")


def need_extra() -> None:
    """FailedPrecondition naming the daemon extra if a module of it is missing."""
    try:
        import grpc_reflection.v1alpha.reflection  # noqa: F401
        import prometheus_client  # noqa: F401
        import pythonjsonlogger  # noqa: F401
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
        from rendezvous.rank.launch import RANK_VARIABLES, launcher_rank

        found = launcher_rank()
        if found is not None:
            index = found[0]
            var = next(v for v in RANK_VARIABLES if os.environ.get(v, "").isdigit())
            source = f"launcher {var}"
        else:
            index, source = 0, "default (no launcher)"
    return Identity(cluster, config.job_name, index, source)


def local_address(config: Config, job_name: str = "", task_index: int | None = None) -> tuple[str, str]:
    """Where a daemon's local clients connect, and where that came from: the
    ``local_address`` setting, else the default socket (under
    ``$XDG_RUNTIME_DIR``, else ``/run/rendezvous``). ``{job_name}`` and
    ``{task_index}`` are replaced when given."""
    if config.local_address:
        address, source = config.local_address, config.sources.get("local_address", "default")
    else:
        address = default_daemon_address()
        source = ("default, under $XDG_RUNTIME_DIR" if os.environ.get("XDG_RUNTIME_DIR")
                  else "default; XDG_RUNTIME_DIR is unset")
    given = address
    if job_name:
        address = address.replace("{job_name}", job_name)
    if task_index is not None and task_index >= 0:
        address = address.replace("{task_index}", str(task_index))
    return address, source if address == given else f"{source}: {given}"


def check_local_tls(config: Config, kind: AddressKind, where: str) -> None:
    """InvalidArgument for TLS set with a TCP local address off loopback: the
    local service has no TLS (its clients speak plain gRPC), so TLS would not
    apply there."""
    if kind is not AddressKind.TCP or not config.tls_cert:
        return
    host = where.rsplit(":", 1)[0].strip("[]")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise InvalidArgument(f"TLS is set, and the local address {where} is TCP off loopback: the local service "
                              "has no TLS. Use a Unix socket (the default) or a loopback address such as "
                              "127.0.0.1:7070")


# -- logging ----------------------------------------------------------------------


def json_formatter() -> logging.Formatter:
    """python-json-logger's formatter, writing one JSON object per line: ``time``
    (UTC, ISO 8601 with milliseconds and ``Z``), ``level``, ``logger``,
    ``message``, every field passed with ``extra=`` (key, step_id, producer,
    ...) and, for an exception, ``exception``."""
    try:
        from pythonjsonlogger.json import JsonFormatter
    except ImportError:
        try:
            from pythonjsonlogger.jsonlogger import JsonFormatter  # python-json-logger 3.0
        except ImportError:
            raise FailedPrecondition("--log-format json needs python-json-logger: pip install "
                                     "'rendezvous[daemon]'") from None
    formatter = JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s",
                              rename_fields={"asctime": "time", "levelname": "level", "name": "logger",
                                             "exc_info": "exception"})
    formatter.converter = time.gmtime
    formatter.default_time_format = "%Y-%m-%dT%H:%M:%S"
    formatter.default_msec_format = "%s.%03dZ"
    return formatter


def setup_logging(config: Config, level: int | None = None) -> None:
    """Root logging to stderr, text or JSON as the config says."""
    handler = logging.StreamHandler(sys.stderr)
    if config.log_format == "json":
        handler.setFormatter(json_formatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level if level is not None else getattr(logging, config.log_level.upper()))
    if root.level > logging.DEBUG:
        logging.getLogger("rendezvous.client").setLevel(max(root.level, logging.WARNING))


def render_config(config: Config, identity: Identity | None = None, prog: str = "rendezvousd") -> str:
    """The effective config as TOML, each value with where it came from (secrets
    masked; the local address as the daemon resolves it)."""
    lines = [f"# {prog}: effective configuration (value  # source)"]
    for name, value, source, secret in config.explain():
        if name == "task_index" and identity is not None:
            value, source = identity.task_index, identity.index_source
        elif name == "local_address":
            value, source = local_address(config, *((identity.job_name, identity.task_index) if identity else ()))
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


def claim_socket(path: str) -> None:
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
