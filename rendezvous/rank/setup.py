"""How a rank's gRPC server and its channels are set up: :class:`GrpcSetup`
(TLS, the token, extra services), built from a :class:`Config` by
:func:`grpc_security` for every server the package starts, and
:func:`add_port`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from rendezvous import auth
from rendezvous.config import Config
from rendezvous.errors import InvalidArgument, Unavailable

__all__ = ["GrpcSetup", "grpc_security", "add_port"]


@dataclass(frozen=True)
class GrpcSetup:
    """How a rank's gRPC server and its channels to peers are secured and extended:
    TLS credentials for both sides, metadata every call to a peer carries (the
    token), server interceptors (the token check, which covers every service
    on the port but health), and callables that add services (reflection)
    before the server starts. :meth:`from_config` is what a rank server uses
    when it is given none."""

    server_credentials: grpc.ServerCredentials | None = None
    channel_credentials: grpc.ChannelCredentials | None = None
    metadata: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # holds the token
    interceptors: tuple[Any, ...] = ()
    services: tuple[Callable[[grpc.aio.Server], None], ...] = ()

    @classmethod
    def from_config(cls, config: Config, on_reject: Callable[[str], None] | None = None) -> "GrpcSetup":
        """The setup ``config``'s TLS and token settings ask for (see
        :func:`grpc_security`)."""
        return grpc_security(config, on_reject)[0]

    def check(self, config: Config) -> None:
        """InvalidArgument unless this setup applies the token and TLS that
        ``config`` sets: a security setting is never silently left out."""
        token = auth.load_token(config)
        if token and not (set(auth.token_metadata(token)) <= set(self.metadata) and self.interceptors):
            raise InvalidArgument("a token is set (token / token_file, RENDEZVOUS_TOKEN / RENDEZVOUS_TOKEN_FILE) "
                                  "but the grpc_setup given neither checks it nor sends it: build it with "
                                  "GrpcSetup.from_config(config), or pass none")
        if config.tls_cert and (self.server_credentials is None or self.channel_credentials is None):
            raise InvalidArgument("TLS is set (tls_cert / tls_key, RENDEZVOUS_TLS_CERT / RENDEZVOUS_TLS_KEY) but "
                                  "the grpc_setup given has no TLS credentials: build it with "
                                  "GrpcSetup.from_config(config), or pass none")


def grpc_security(config: Config, on_reject: Callable[[str], None] | None = None) -> tuple[GrpcSetup, str]:
    """A rank's :class:`GrpcSetup` from its TLS and token settings, and the token
    (empty: none). With a token, every call to the server but gRPC health must
    carry it (``on_reject(method)`` is called for each one refused) and every
    call to a peer carries it; with TLS the server serves TLS and channels to
    peers (and to rank 0 for a bootstrap's join) use it. Files that cannot be
    read are an InvalidArgument naming the setting."""
    token = auth.load_token(config)
    interceptors = (auth.TokenInterceptor(token, on_reject=on_reject),) if token else ()
    return GrpcSetup(server_credentials=auth.server_credentials(config),
                     channel_credentials=auth.channel_credentials(config),
                     metadata=auth.token_metadata(token), interceptors=interceptors), token


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
