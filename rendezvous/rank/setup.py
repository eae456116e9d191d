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
        raise Unavailable(f"cannot listen on {address}: {why_not_bindable(address) or exc}") from None
    if not port:
        raise Unavailable(f"cannot listen on {address}: {why_not_bindable(address) or 'the bind failed'}")
    return port


def why_not_bindable(address: str) -> str:
    """Why ``address`` cannot be bound, as the OS says it ("Address already in
    use", "Cannot assign requested address", ...), found by binding a plain
    socket there; empty if that bind works (gRPC failed for its own reason)."""
    import errno
    import os
    import socket

    from rendezvous.cluster import parse_address

    if address.startswith("unix:"):
        path = address[5:]
        folder = os.path.dirname(path) or "."
        if not os.path.isdir(folder):
            return f"the folder {folder} does not exist"
        if not os.access(folder, os.W_OK | os.X_OK):
            return f"no permission to create a socket in {folder}"
        return f"{path} exists and is not a socket this process may replace" if os.path.exists(path) else ""
    try:
        host, port = parse_address(address)
        host = host.strip("[]")
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, ValueError) as exc:
        return f"cannot resolve it ({exc})"
    for family, kind, proto, _, where in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(where)
            except OSError as exc:
                reason = exc.strerror or str(exc)
                if exc.errno == errno.EADDRINUSE:
                    return f"{reason}: another process listens on port {port} (choose another, or port 0)"
                if exc.errno == errno.EADDRNOTAVAIL:
                    return f"{reason}: {host} is not an address of this machine"
                return reason
    return ""
