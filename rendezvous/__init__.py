"""rendezvous: hand tensors between the ranks of a training job by rendezvous key.

``rendezvous.Server`` is the blocking rank server for plain scripts;
``rendezvous.aio.Server`` is the same server for asyncio code. Keys follow
TensorFlow's format (:mod:`rendezvous.keys`), errors carry gRPC status codes
(:mod:`rendezvous.errors`).
"""

from __future__ import annotations

from .cluster import ClusterSpec
from .config import Config
from .errors import (
    Aborted,
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    InvalidKey,
    NotFound,
    PeerUnavailable,
    RendezvousError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    UnknownTask,
    UnsupportedDType,
)
from .keys import Key, TaskName, make_key, parse_key
from .rank.blocking import Server
from .items import Received

__version__ = "0.1.0"

__all__ = [
    "Server",
    "ClusterSpec",
    "Config",
    "Key",
    "TaskName",
    "Received",
    "make_key",
    "parse_key",
    "RendezvousError",
    "InvalidArgument",
    "InvalidKey",
    "UnsupportedDType",
    "Aborted",
    "AlreadyExists",
    "DeadlineExceeded",
    "Unavailable",
    "PeerUnavailable",
    "NotFound",
    "UnknownTask",
    "FailedPrecondition",
    "ResourceExhausted",
    "Unauthenticated",
    "Internal",
]
