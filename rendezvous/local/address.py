"""Where a node's daemon and its local clients meet.

Both sides agree here on the default socket (``$RENDEZVOUS_LOCAL_ADDRESS``,
else ``unix:$XDG_RUNTIME_DIR/rendezvous/rendezvousd.sock``, else
``unix:/run/rendezvous/rendezvousd.sock``), on how an address is spelled
(``unix:PATH`` or ``HOST:PORT``), and on the session socket's path beside
the gRPC socket.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

from rendezvous.cluster import parse_address
from rendezvous.errors import InvalidArgument
from rendezvous.paths import AddressKind

from .segments import available as shm_available

__all__ = ["SOCKET_NAME", "LocalAddress", "default_address", "default_daemon_address", "parse_local_address",
           "channel_target", "session_path", "session_socket"]

SOCKET_NAME = "rendezvousd.sock"
_MAX_UNIX_PATH = 107  # sockaddr_un.sun_path, less the terminating NUL


class LocalAddress(NamedTuple):
    """A parsed local address: a Unix socket's path, or ``host:port``."""

    kind: AddressKind
    where: str


def default_address(env: Any = None) -> str:
    """``$RENDEZVOUS_LOCAL_ADDRESS``, else the daemon's default Unix socket."""
    env = os.environ if env is None else env
    given = env.get("RENDEZVOUS_LOCAL_ADDRESS")
    if given:
        return given
    base = env.get("XDG_RUNTIME_DIR")
    folder = Path(base) / "rendezvous" if base else Path("/run/rendezvous")
    return f"unix:{folder / SOCKET_NAME}"


def default_daemon_address(env: Any = None) -> str:
    """Where a daemon listens when its config names no address: the default Unix
    socket (``RENDEZVOUS_LOCAL_ADDRESS`` is the daemon's config, read there)."""
    env = os.environ if env is None else env
    return default_address({k: v for k, v in env.items() if k != "RENDEZVOUS_LOCAL_ADDRESS"})


def parse_local_address(address: str) -> LocalAddress:
    """(UNIX, path) or (TCP, "host:port"); InvalidArgument if neither."""
    if address.startswith("unix:"):
        path = address[5:]
        if path.startswith("//"):  # unix:///abs/path, gRPC's other spelling
            path = path[2:]
        if not path:
            raise InvalidArgument(f"local address {address!r} has no path")
        if len(os.fsencode(path)) > _MAX_UNIX_PATH:
            raise InvalidArgument(f"socket path {path!r} is longer than {_MAX_UNIX_PATH} bytes")
        return LocalAddress(AddressKind.UNIX, path)
    if ":" not in address:
        raise InvalidArgument(f"local address {address!r} is neither unix:PATH nor HOST:PORT")
    parse_address(address)
    return LocalAddress(AddressKind.TCP, address)


def channel_target(address: str) -> tuple[str, bool]:
    """(gRPC target, whether shared memory can work: the same machine)."""
    if address.startswith("unix:"):
        return address, True
    if ":" not in address:
        raise InvalidArgument(f"local address {address!r} is neither unix:PATH nor HOST:PORT")
    host = address.rsplit(":", 1)[0].strip("[]")
    return address, host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")


def session_path(local_socket: str) -> str:
    """The session socket's path beside the gRPC local socket's."""
    return local_socket + ".session"


def session_socket(address: str) -> str | None:
    """The daemon's session socket beside a ``unix:`` local address, if it exists."""
    if not address.startswith("unix:") or not shm_available():
        return None
    path = address[5:]
    if path.startswith("//"):
        path = path[2:]
    path = session_path(path)
    return path if os.path.exists(path) else None
