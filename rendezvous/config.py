"""The one typed configuration object.

Every knob is a :class:`Config` field with a default, a type, and the
environment variable that sets it. Sources apply in a fixed order:
explicit overrides (flags, keyword arguments) > environment > defaults.
Unknown names are rejected with the name in the message. The environment is
read when a server is built, never at import.

Switches (``MPI_DISABLED``, ``MPI_OPTIMAL_PATH`` and every boolean field) read
``1``/``true``/``yes``/``on`` as on and ``0``/``false``/``no``/``off`` as off, in
any case; TensorFlow's reading stays (a value starting with ``1`` is on). Any
other value is refused at start-up, naming the variable, so that a switch never
silently means the opposite of what was written.

An empty environment variable is unset: the setting keeps its default (or the
config file's value). A variable of blanks only (spaces, tabs, newlines) is
refused, naming it, whatever the setting: it is neither unset nor a value.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from .errors import InvalidArgument

__all__ = ["Config", "ENV_VARS", "env_flag", "Protocol"]


class Protocol(StrEnum):
    """How a rank moves tensors: gRPC only, or gRPC with MPI's data plane
    (TensorFlow's ``protocol="grpc+mpi"``)."""

    GRPC = "grpc"
    GRPC_MPI = "grpc+mpi"

    @classmethod
    def parse(cls, value: "str | Protocol") -> "Protocol":
        try:
            return cls(value)
        except ValueError:
            raise InvalidArgument(
                f"protocol must be {' or '.join(p.value for p in cls)}, got {value!r}") from None


_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"0", "false", "no", "off"})


def env_flag(value: str) -> bool:
    """A switch's value: ``1/true/yes/on`` on, ``0/false/no/off`` off (any case,
    surrounding blanks ignored). TensorFlow read its MPI toggles as "on when the
    first character is 1", so ``10`` or ``1 # MPI on`` stay on. Anything else
    raises ValueError: a switch read wrongly is worse than one refused."""
    word = value.strip().lower()
    if word in _ON or word[:1] == "1":
        return True
    if word in _OFF:
        return False
    blank = " (it is blank: leave it unset for the default)" if not word else ""
    raise ValueError(f"{value!r} is not a switch value{blank}: use 1, true, yes or on, or 0, false, no or off")


def _knob(default: Any, env: str, doc: str, *, parse: Any = None, secret: bool = False) -> Any:
    return field(default=default, metadata={"env": env, "doc": doc, "parse": parse, "secret": secret})


@dataclass(frozen=True)
class Config:
    """Effective settings of one rank server. Build with :meth:`load`."""

    chunk_bytes: int = _knob(
        1 << 20, "RENDEZVOUS_CHUNK_BYTES",
        "Largest piece of tensor bytes in one gRPC stream frame; bigger tensors are chunked and interleaved.")
    fusion_threshold: int = _knob(
        256 << 10, "RENDEZVOUS_FUSION_THRESHOLD",
        "Largest tensor (bytes) packed with others into one reply when a batched recv (`recv_many`, or recvs "
        "issued together) finds them ready together: one frame, or on the MPI optimal path one MPI message, for "
        "up to `chunk_bytes` of them. `0` sends every tensor on its own. Read by the producer.")
    connect_timeout: float = _knob(
        60.0, "RENDEZVOUS_CONNECT_TIMEOUT",
        "Seconds a first recv waits for a peer's server to come up before failing with UNAVAILABLE.")
    reconnect_attempts: int = _knob(
        3, "RENDEZVOUS_RECONNECT_ATTEMPTS",
        "Times a recv is re-sent (same request_id, so nothing is consumed twice) after its stream to a peer breaks.")
    retry_window: float = _knob(
        30.0, "RENDEZVOUS_RETRY_WINDOW",
        "Seconds a producer keeps an answered request (by request_id) so a retry gets the same answer.")
    retry_cache_bytes: int = _knob(
        1 << 30, "RENDEZVOUS_RETRY_CACHE_BYTES",
        "Bytes of answered tensors kept for retries; the oldest are released first beyond this.")
    recv_cache_bytes: int = _knob(
        1 << 30, "RENDEZVOUS_RECV_CACHE_BYTES",
        "Bytes of receive buffers (256 KiB and up) a process keeps to reuse once the arrays received "
        "into them are dropped (a fresh one is page-faulted and zeroed at every recv); 0: never reuse.")
    max_request_bytes: int = _knob(
        256 << 10, "RENDEZVOUS_MAX_REQUEST_BYTES",
        "Largest request message a server accepts (requests carry keys, never tensors: a key is at most "
        "16,384 characters, and a consumer packs its queued requests into messages of at most 64 KiB); "
        "at least 64 KiB.")
    uvloop: bool = _knob(
        True, "RENDEZVOUS_UVLOOP",
        "Run the blocking Server's event loop on uvloop when it is installed.", parse=env_flag)
    keepalive_time: float = _knob(
        20.0, "RENDEZVOUS_KEEPALIVE_TIME",
        "Seconds between HTTP/2 pings on an idle connection to a peer, so that a peer that went silent (hung, "
        "its host or link gone) is noticed even by recvs without a deadline; 0: never ping.")
    keepalive_timeout: float = _knob(
        10.0, "RENDEZVOUS_KEEPALIVE_TIMEOUT",
        "Seconds a ping may go unanswered before the connection counts as dead: its recvs are re-sent, "
        "then fail with UNAVAILABLE.")
    max_waiting_calls: int = _knob(
        1 << 16, "RENDEZVOUS_MAX_WAITING_CALLS",
        "Most recvs a server holds waiting for their tensors at once, from all peers (and, in rendezvousd, "
        "as many again from its local clients); beyond that a recv fails with RESOURCE_EXHAUSTED.")
    max_tensor_bytes: int = _knob(
        64 << 30, "RENDEZVOUS_MAX_TENSOR_BYTES",
        "Largest tensor a peer's reply (or a local client) may announce; bigger ones fail with "
        "RESOURCE_EXHAUSTED before anything is allocated.")
    timeline: str = _knob(
        "", "RENDEZVOUS_TIMELINE",
        "File to write a timeline to: every send and recv (its wait, its transfer, path, bytes, peer) as "
        "Chrome trace events, which Perfetto (ui.perfetto.dev) and chrome://tracing open. `{task_index}` and "
        "`{job_name}` are replaced, so that each rank writes its own file (a template that names one file for "
        "several tasks of the cluster is refused). Empty: off.")
    timeline_max_bytes: int = _knob(
        1 << 30, "RENDEZVOUS_TIMELINE_MAX_BYTES",
        "Largest a timeline file grows: the event that would pass it ends the file instead with a last event, "
        "`timeline cut`, and the closing bracket; later events are not written. At least 65536.")
    # -- the per-node daemon (rendezvousd; `rendezvous serve` reads the first five too)
    cluster: str = _knob(
        "", "RENDEZVOUS_CLUSTER", "Cluster spec: a JSON file, or inline JSON.")
    job_name: str = _knob("", "RENDEZVOUS_JOB_NAME", "This task's job.")
    task_index: int = _knob(
        -1, "RENDEZVOUS_TASK_INDEX", "This task's index; -1: the launcher's rank (mpiexec, srun), else 0.")
    protocol: str = _knob("grpc", "RENDEZVOUS_PROTOCOL", "`grpc`, or `grpc+mpi` (MPI data plane between the ranks).")
    grace: float = _knob(
        10.0, "RENDEZVOUS_GRACE",
        "Seconds `stop()` (and a daemon's drain) keeps serving what this rank produced, until every produced "
        "tensor is consumed and every reply in flight has finished; what is left then is dropped and logged. "
        "`stop(grace=0)` drops at once.")
    local_address: str = _knob(
        "", "RENDEZVOUS_LOCAL_ADDRESS",
        "Where local clients reach the daemon: `unix:PATH` or `HOST:PORT`; `{job_name}` and `{task_index}` "
        "are replaced. Empty: `unix:$XDG_RUNTIME_DIR/rendezvous/rendezvousd.sock`, else under `/run/rendezvous`.")
    shm_threshold: int = _knob(
        64 << 10, "RENDEZVOUS_SHM_THRESHOLD",
        "Smallest tensor (bytes) that moves between a local client and its daemon through shared memory; "
        "-1: never.")
    shm_pool_bytes: int = _knob(
        0, "RENDEZVOUS_SHM_POOL_BYTES",
        "Most bytes of shared-memory segments a daemon keeps for its local clients' tensors (sent, received, "
        "and received from peers for them); beyond it tensors cross the local hop inside frames. 0: half the "
        "machine's memory.")
    metrics_port: int = _knob(
        -1, "RENDEZVOUS_METRICS_PORT", "Port of the Prometheus `/metrics` endpoint; 0: the OS picks; -1: off.")
    metrics_host: str = _knob(
        "", "RENDEZVOUS_METRICS_HOST", "Address the metrics endpoint binds; empty: the host of this task's "
        "cluster address.")
    stall_warning: float = _knob(
        60.0, "RENDEZVOUS_STALL_WARNING",
        "Seconds a recv may wait before a warning names its key and its producer (a rank server's recvs, and a "
        "daemon's); 0: never.")
    log_format: str = _knob("text", "RENDEZVOUS_LOG_FORMAT", "`text`, or `json` (one object per line).")
    log_level: str = _knob("INFO", "RENDEZVOUS_LOG_LEVEL", "Daemon log level: DEBUG, INFO, WARNING, ERROR.")
    tls_cert: str = _knob(
        "", "RENDEZVOUS_TLS_CERT", "PEM certificate chain of this task: served to peers, and presented to "
        "them as the client certificate under mutual TLS. Set with `tls_key` to turn TLS on.")
    tls_key: str = _knob("", "RENDEZVOUS_TLS_KEY", "PEM private key of `tls_cert`.")
    tls_ca: str = _knob(
        "", "RENDEZVOUS_TLS_CA", "PEM CA bundle that peers' certificates must chain to; empty: the system roots.")
    tls_client_auth: bool = _knob(
        False, "RENDEZVOUS_TLS_CLIENT_AUTH",
        "On (`1`, `true`, `yes`, `on`): mutual TLS: peers must present a certificate signed by `tls_ca`.", parse=env_flag)
    token: str = _knob(
        "", "RENDEZVOUS_TOKEN", "Shared secret every RPC must carry (`authorization: Bearer ...`); peers "
        "send it too. Empty: no token.", secret=True)
    token_file: str = _knob(
        "", "RENDEZVOUS_TOKEN_FILE", "File holding the token (read at start-up; wins over `token`).")
    incarnation: int = _knob(
        0, "RENDEZVOUS_INCARNATION",
        "This server's incarnation (below 2**64; decimal or 0x hex), published with its address; a key naming "
        "another incarnation of this task is refused with ABORTED. 0: a random one at every start, so that a "
        "restarted producer is told apart from the one its consumers knew.", parse=lambda raw: int(raw, 0))
    mpi_disabled: bool = _knob(
        False, "MPI_DISABLED",
        "`1`: protocol grpc+mpi never initializes MPI nor imports mpi4py; everything goes over gRPC.",
        parse=env_flag)
    mpi_optimal_path: bool = _knob(
        True, "MPI_OPTIMAL_PATH",
        "`1`: tensors at or above the threshold send a descriptor over gRPC and their bytes over MPI. "
        "`0`: the encoded tensor travels in the gRPC reply. On when unset.", parse=env_flag)
    mpi_requests: bool = _knob(
        False, "RENDEZVOUS_MPI_REQUESTS",
        "`1`: a rank asks another rank of its MPI job for a tensor with MPI messages, and the answer comes "
        "back over MPI too (TensorFlow's MPI path); gRPC still serves tasks outside the job, local "
        "clients and administration. Set it alike on every rank. Off when unset.", parse=env_flag)
    mpi_threshold: int = _knob(
        1024, "RENDEZVOUS_MPI_THRESHOLD",
        "Smallest tensor (bytes) that takes the MPI optimal path; smaller ones go inline over gRPC.")
    mpi_chunk_bytes: int = _knob(
        1 << 30, "RENDEZVOUS_MPI_CHUNK_BYTES",
        "Largest single MPI message; bigger tensors are sent as several messages on one tag.")
    mpi_poll_min_us: int = _knob(
        10, "RENDEZVOUS_MPI_POLL_MIN_US",
        "First pause (microseconds) of the MPI progress thread's backoff while transfers are in flight.")
    mpi_poll_max_us: int = _knob(
        50, "RENDEZVOUS_MPI_POLL_MAX_US",
        "Longest pause of that backoff. Across hosts MPI moves a large message over the network only while it "
        "is polled, so long pauses stretch every transfer. With nothing in flight the thread calls MPI only now "
        "and then, at least once a second (a peer's send may wait on this rank's MPI to say its bytes arrived).")
    cuda_aware: bool | None = _knob(
        None, "RENDEZVOUS_CUDA_AWARE",
        "`1`: hand GPU buffers to MPI directly; `0`: stage them through pinned host memory. "
        "Unset or `auto`: probe the MPI library at start-up (the PyPI MPI wheels are not CUDA-aware).",
        parse=lambda raw: None if raw == "" or raw.strip().lower() == "auto" else env_flag(raw))
    cuda_ipc: bool = _knob(
        True, "RENDEZVOUS_CUDA_IPC",
        "GPU tensors between processes of one node (rank servers; a daemon and its local clients) go by CUDA "
        "IPC (device to device) where the GPU backend can; `0`: never (they take the staged or default path, "
        "or the host).", parse=env_flag)
    gpu_staging_chunk_bytes: int = _knob(
        4 << 20, "RENDEZVOUS_GPU_STAGING_CHUNK_BYTES",
        "Size of the pinned host buffers GPU tensors are staged through, and so of each staged MPI message.")
    gpu_staging_depth: int = _knob(
        4, "RENDEZVOUS_GPU_STAGING_DEPTH",
        "Chunks one staged GPU transfer keeps in flight (copies overlapping MPI messages).")

    @classmethod
    def load(cls, overrides: Mapping[str, Any] | None = None,
             env: Mapping[str, str] | None = None,
             file: "str | os.PathLike[str] | None" = None) -> "Config":
        """Defaults, then the TOML ``file`` (keys are field names), then the
        environment, then ``overrides`` (by field name)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        sources = dict.fromkeys(_FIELDS, "default")
        if file is not None:
            for name, value in _read_toml(file).items():
                values[name] = value
                sources[name] = f"file {os.fspath(file)}"
        for f in _FIELDS.values():
            raw = env.get(f.metadata["env"])
            if raw is not None and raw != "":
                if raw.isspace():
                    raise InvalidArgument(f"{f.metadata['env']}: {raw!r} is blank: leave it unset (or empty) for "
                                          f"the default, or give it a value")
                values[f.name] = _convert(f, raw, f.metadata["env"])
                sources[f.name] = f"env {f.metadata['env']}"
        for name, value in (overrides or {}).items():
            known = _FIELDS.get(name)
            if known is None:
                raise InvalidArgument(f"unknown config key {name!r}; known: {', '.join(sorted(_FIELDS))}")
            values[name] = _convert(known, value, name) if isinstance(value, str) else value
            sources[name] = "argument"
        cfg = cls(**values, sources=sources)
        cfg.validate()
        return cfg

    @property
    def reconnect_window(self) -> float:
        """Seconds a recv waits for a lost connection to a peer to come back:
        the keepalive bound (``keepalive_time + keepalive_timeout``), or
        ``connect_timeout`` with keepalive off."""
        if self.keepalive_time > 0:
            return self.keepalive_time + self.keepalive_timeout
        return self.connect_timeout

    def replace(self, **changes: Any) -> "Config":
        for name in changes:
            if name not in _FIELDS:
                raise InvalidArgument(f"unknown config key {name!r}")
        sources = {**self.sources, **dict.fromkeys(changes, "argument")}
        cfg = dataclasses.replace(self, **changes, sources=sources)
        cfg.validate()
        return cfg

    #: where each value came from: "default", "env VAR", or "argument"
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def validate(self) -> None:
        if not 1 <= self.mpi_chunk_bytes <= 1 << 30:
            raise InvalidArgument(f"mpi_chunk_bytes must be in [1, 2**30], got {self.mpi_chunk_bytes}")
        if not 0 <= self.mpi_poll_min_us <= self.mpi_poll_max_us:
            raise InvalidArgument("need 0 <= mpi_poll_min_us <= mpi_poll_max_us")
        if self.gpu_staging_chunk_bytes < 4096 or self.gpu_staging_depth < 1:
            raise InvalidArgument("need gpu_staging_chunk_bytes >= 4096 and gpu_staging_depth >= 1")
        if self.fusion_threshold < 0:
            raise InvalidArgument(f"fusion_threshold must be >= 0, got {self.fusion_threshold}")
        if self.chunk_bytes < 1024:
            raise InvalidArgument(f"chunk_bytes must be at least 1024, got {self.chunk_bytes}")
        if self.max_request_bytes < 64 << 10:
            raise InvalidArgument(f"max_request_bytes must be at least 65536 (one request with the longest key, "
                                  f"or a consumer's packed requests), got {self.max_request_bytes}")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidArgument(f"{f.name} must be a finite number of seconds, got {value}")
        for name in ("connect_timeout", "retry_window", "keepalive_time", "keepalive_timeout"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must not be negative")
        self._validate_daemon()

    def _validate_daemon(self) -> None:
        Protocol.parse(self.protocol)
        if self.task_index < -1:
            raise InvalidArgument(f"task_index must be >= 0 (or -1: the launcher's rank), got {self.task_index}")
        if not -1 <= self.metrics_port <= 65535:
            raise InvalidArgument(f"metrics_port must be in [-1, 65535], got {self.metrics_port}")
        if self.log_format not in ("text", "json"):
            raise InvalidArgument(f"log_format must be text or json, got {self.log_format!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise InvalidArgument(f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgument("tls_cert and tls_key go together: set both or neither")
        if self.tls_client_auth and not (self.tls_cert and self.tls_ca):
            raise InvalidArgument("tls_client_auth needs tls_cert, tls_key and tls_ca")
        if self.timeline_max_bytes < 64 << 10:
            raise InvalidArgument(f"timeline_max_bytes must be at least 65536, got {self.timeline_max_bytes}")
        if self.timeline.isspace():
            raise InvalidArgument(f"timeline must name a file (empty: off), got {self.timeline!r}")
        if not 0 <= self.incarnation < 1 << 64:
            raise InvalidArgument(f"incarnation must be in [0, 2**64), got {self.incarnation}")
        if self.max_tensor_bytes < 1:
            raise InvalidArgument(f"max_tensor_bytes must be positive, got {self.max_tensor_bytes}")
        for name in ("grace", "stall_warning"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must not be negative")

    def uses_mpi(self, protocol: "str | Protocol") -> bool:
        """Whether a rank with this protocol moves tensors with MPI: ``grpc+mpi``
        without ``MPI_DISABLED``."""
        return Protocol.parse(protocol) is Protocol.GRPC_MPI and not self.mpi_disabled

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELDS}

    def explain(self) -> list[tuple[str, Any, str, bool]]:
        """Every setting as (name, value, source, secret), in declaration order."""
        return [(name, getattr(self, name), self.sources.get(name, "default"), bool(f.metadata.get("secret")))
                for name, f in _FIELDS.items()]


def _read_toml(path: "str | os.PathLike[str]") -> dict[str, Any]:
    """A TOML config file's values by field name; unknown keys and wrong types are
    refused with the file and key named."""
    import tomllib

    where = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise InvalidArgument(f"cannot read config file {where!r}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"config file {where!r} is not TOML (UTF-8): {exc}") from None
    out: dict[str, Any] = {}
    for name, value in data.items():
        f = _FIELDS.get(name)
        if f is None:
            raise InvalidArgument(f"{where}: unknown config key {name!r}; known: {', '.join(sorted(_FIELDS))}")
        out[name] = _from_toml(f, value, f"{where}: {name}")
    return out


def _from_toml(f: dataclasses.Field[Any], value: Any, where: str) -> Any:
    """A TOML value for field ``f``: native TOML types as they are, strings read
    as the environment would read them."""
    if isinstance(value, str):
        return _convert(f, value, where) if f.metadata.get("parse") or type(f.default) is not str else value
    wanted = str(f.type)
    if isinstance(value, bool):
        if "bool" in wanted:
            return value
    elif isinstance(value, int):
        if wanted.startswith(("int", "float")):
            if not wanted.startswith("float"):
                return value
            try:
                return float(value)
            except OverflowError:
                raise InvalidArgument(f"{where}: {value} is too large for a number of seconds") from None
    elif isinstance(value, float):
        if wanted.startswith("float"):
            return value
    raise InvalidArgument(f"{where}: expected {wanted}, got {type(value).__name__} {value!r}")


def _convert(f: dataclasses.Field[Any], raw: Any, source: str) -> Any:
    parse = f.metadata.get("parse")
    try:
        if parse is not None:
            return parse(str(raw))
        kind: type[Any] = type(f.default)  # every field read from outside has a default
        if kind is bool:
            return env_flag(str(raw))
        return kind(raw)
    except (TypeError, ValueError) as exc:
        if parse is not None or type(f.default) is bool:  # a switch: env_flag says why
            raise InvalidArgument(f"{source}: {exc}") from None
        raise InvalidArgument(f"{source}: cannot read {raw!r} as {type(f.default).__name__}") from None


_FIELDS = {f.name: f for f in fields(Config) if "env" in f.metadata}
#: environment variable -> (field name, default, description); the tables of docs/configuration.md.
ENV_VARS = {f.metadata["env"]: (f.name, f.default, f.metadata["doc"]) for f in _FIELDS.values()}
