"""The one typed configuration object.

Every knob is a :class:`Config` field with a default, a type, and the
environment variable that sets it. Sources apply in a fixed order:
explicit overrides (flags, keyword arguments) > environment > defaults.
Unknown names are rejected with the name in the message. The environment is
read when a server is built, never at import.

``MPI_DISABLED`` and ``MPI_OPTIMAL_PATH`` keep TensorFlow's reading: the
first character ``1`` means on, anything else off.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import InvalidArgument

__all__ = ["Config", "ENV_VARS", "env_flag"]


def env_flag(value: str) -> bool:
    """TensorFlow's toggle reading: on when the first character is '1'."""
    return value[:1] == "1"


def _knob(default: Any, env: str, doc: str, *, parse: Any = None) -> Any:
    return field(default=default, metadata={"env": env, "doc": doc, "parse": parse})


@dataclass(frozen=True)
class Config:
    """Effective settings of one rank server. Build with :meth:`load`."""

    chunk_bytes: int = _knob(
        1 << 20, "RENDEZVOUS_CHUNK_BYTES",
        "Largest piece of tensor bytes in one gRPC stream frame; bigger tensors are chunked and interleaved.")
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
    max_request_bytes: int = _knob(
        4 << 20, "RENDEZVOUS_MAX_REQUEST_BYTES",
        "Largest request message a server accepts (requests carry keys, never tensors).")
    uvloop: bool = _knob(
        True, "RENDEZVOUS_UVLOOP",
        "Run the blocking Server's event loop on uvloop when it is installed.", parse=env_flag)
    mpi_disabled: bool = _knob(
        False, "MPI_DISABLED",
        "`1`: protocol grpc+mpi never initializes MPI nor imports mpi4py; everything goes over gRPC.",
        parse=env_flag)
    mpi_optimal_path: bool = _knob(
        True, "MPI_OPTIMAL_PATH",
        "`1`: tensors at or above the threshold send a descriptor over gRPC and their bytes over MPI. "
        "`0`: the encoded tensor travels in the gRPC reply. On when unset.", parse=env_flag)
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
        1000, "RENDEZVOUS_MPI_POLL_MAX_US",
        "Longest pause of that backoff. With nothing in flight the thread sleeps until work arrives.")

    @classmethod
    def load(cls, overrides: Mapping[str, Any] | None = None,
             env: Mapping[str, str] | None = None) -> "Config":
        """Defaults, then the environment, then ``overrides`` (by field name)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        sources = dict.fromkeys(_FIELDS, "default")
        for f in _FIELDS.values():
            raw = env.get(f.metadata["env"])
            if raw is not None and raw != "":
                values[f.name] = _convert(f, raw, f.metadata["env"])
                sources[f.name] = f"env {f.metadata['env']}"
        for name, value in (overrides or {}).items():
            f = _FIELDS.get(name)
            if f is None:
                raise InvalidArgument(f"unknown config key {name!r}; known: {', '.join(sorted(_FIELDS))}")
            values[name] = _convert(f, value, name) if isinstance(value, str) else value
            sources[name] = "argument"
        cfg = cls(**values, sources=sources)
        cfg.validate()
        return cfg

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
        if self.chunk_bytes < 1024:
            raise InvalidArgument(f"chunk_bytes must be at least 1024, got {self.chunk_bytes}")
        for name in ("connect_timeout", "retry_window"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must not be negative")

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELDS}


def _convert(f: dataclasses.Field, raw: Any, source: str) -> Any:
    parse = f.metadata.get("parse")
    try:
        if parse is not None:
            return parse(str(raw))
        kind = type(f.default)
        if kind is bool:
            return env_flag(str(raw))
        return kind(raw)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{source}: cannot read {raw!r} as {type(f.default).__name__}") from None


_FIELDS = {f.name: f for f in fields(Config) if "env" in f.metadata}
#: environment variable -> (field name, default, description); the README's table.
ENV_VARS = {f.metadata["env"]: (f.name, f.default, f.metadata["doc"]) for f in _FIELDS.values()}
