"""The asyncio API: ``rendezvous.aio.Server`` (as ``grpc.aio`` is gRPC's).

The same rank server as the blocking :class:`rendezvous.Server`, for code
that runs on an event loop: construct it anywhere, ``await start()`` on the
loop it will live on, and ``await`` its recvs. It lives in
:mod:`rendezvous.rank.server`.
"""

from __future__ import annotations

from .rank.server import PROTOCOLS, Fetched, GrpcSetup, Server, add_port

__all__ = ["Server", "PROTOCOLS", "GrpcSetup", "add_port", "Fetched"]
