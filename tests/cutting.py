"""A TCP relay that can cut its connections: a connection that dies under a
stream, as a pulled cable or a crashed switch would kill it, with both ends
alive and asking again.

``Relay(target)`` listens on an OS-chosen loopback port and forwards every
connection to ``target``; :meth:`Relay.cut` resets every connection open now
(both sides see the connection die mid-stream, with whatever was in flight
lost), and new connections are relayed again at once. ``cuts`` counts the
resets that found a connection open, ``connections`` those relayed.
"""

from __future__ import annotations

import asyncio
import socket


class Relay:
    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._server: asyncio.AbstractServer | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()
        self.cuts = 0
        self.connections = 0

    async def start(self) -> str:
        """Start listening; the relay's address."""
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"127.0.0.1:{port}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            _reset(writer)
            return
        self.connections += 1
        self._open.update((writer, up_writer))
        pumps = [asyncio.ensure_future(_pump(reader, up_writer)), asyncio.ensure_future(_pump(up_reader, writer))]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
                self._tasks.discard(pump)
            for w in (writer, up_writer):
                self._open.discard(w)
                _reset(w)

    def cut(self) -> int:
        """Reset every connection open now; how many there were (``cuts``
        counts the calls that found one open)."""
        open_now = list(self._open)
        for w in open_now:
            _reset(w)
        self._open.difference_update(open_now)
        if open_now:
            self.cuts += 1
        return len(open_now) // 2

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.cut()
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            await self._server.wait_closed()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        data = await reader.read(1 << 16)
        if not data:
            return
        writer.write(data)
        await writer.drain()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (SO_LINGER 0), not a clean FIN: the peer sees the connection die."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        except OSError:
            pass
    writer.transport.abort()
