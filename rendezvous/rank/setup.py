"""How a rank's gRPC server and its channels are set up: :class:`GrpcSetup`
(what ``rendezvousd`` adds: TLS, a token, its services) and :func:`add_port`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from rendezvous.errors import Unavailable

__all__ = ["GrpcSetup", "add_port"]


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
