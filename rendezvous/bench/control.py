"""Control sockets: JSON objects, one per line, over a Unix socket between a
parent and children that no pipe reaches (the ranks mpiexec starts).

:class:`ControlListener` is the parent's end: it accepts its children's
connections and waits for their messages while watching its
:class:`rendezvous.bench.procs.ProcGroup` (a child that dies, or a deadline that
passes, ends the wait with a :class:`rendezvous.bench.procs.BenchError`).
:class:`Link` is a child's end. ``bench-scale`` drives its ranks through one;
``bench-daemon`` its raw MPI ranks.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

from .procs import BenchError, ProcGroup

__all__ = ["ControlListener", "Link"]


class ControlListener:
    """The parent's end of its children's control connections (a Unix socket at
    ``path``): JSON objects, one per line, waited for while ``group`` is watched."""

    def __init__(self, group: ProcGroup, path: str, backlog: int = 1) -> None:
        self.group = group
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(backlog)
        self.sock.setblocking(False)
        self.conns: list[socket.socket] = []
        #: what error messages call connection i (default "connection i")
        self.names: dict[int, str] = {}
        self._buf: dict[socket.socket, bytearray] = {}

    def accept(self, n: int, what: str, timeout: float | None = None) -> None:
        """Wait until ``n`` children have connected."""
        import selectors

        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.sock, selectors.EVENT_READ)
            while len(self.conns) < n:
                sel.select(min(self.group.left(what, deadline), 0.5))
                self.group.check()
                try:
                    conn, _ = self.sock.accept()
                except BlockingIOError:
                    continue
                conn.setblocking(False)
                self.conns.append(conn)
                self._buf[conn] = bytearray()

    def gather(self, what: str, timeout: float | None = None,
               seen: Callable[[int, dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        """One message from every connection, in connection order; ``seen`` looks
        at each as it arrives (and may raise)."""
        import selectors

        deadline = None if timeout is None else time.monotonic() + timeout
        got: dict[int, dict[str, Any]] = {}
        with selectors.DefaultSelector() as sel:
            for conn in self.conns:
                sel.register(conn, selectors.EVENT_READ)
            while True:
                for i, conn in enumerate(self.conns):
                    buf = self._buf[conn]
                    if i not in got and b"\n" in buf:
                        line, _, rest = bytes(buf).partition(b"\n")
                        self._buf[conn] = bytearray(rest)
                        got[i] = json.loads(line)
                        if seen is not None:
                            seen(i, got[i])
                if len(got) == len(self.conns):
                    return [got[i] for i in range(len(self.conns))]
                for key, _ in sel.select(min(self.group.left(what, deadline), 0.5)):
                    data = key.fileobj.recv(1 << 20)  # type: ignore[union-attr]
                    if not data:
                        i = self.conns.index(key.fileobj)  # type: ignore[arg-type]
                        raise BenchError(f"{self.group.label}{self.names.get(i, f'connection {i}')} closed its "
                                         f"control connection before {what}\n{self.group.tails()}")
                    self._buf[key.fileobj] += data  # type: ignore[index]
                self.group.check()

    def send(self, obj: Any) -> None:
        """``obj`` to every connection."""
        data = json.dumps(obj).encode() + b"\n"
        for conn in self.conns:
            conn.setblocking(True)
            conn.settimeout(max(1.0, self.group.left("sending a control message")))
            conn.sendall(data)
            conn.setblocking(False)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.sock.close()


class Link:
    """A child's end of a :class:`ControlListener`: JSON objects, one per line."""

    def __init__(self, path: str, timeout: float | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.sock.settimeout(None)
        self.reader = self.sock.makefile("rb")  # shares the socket's descriptor

    def send(self, obj: Any) -> None:
        self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def recv(self) -> Any:
        """The next message; None once the parent has closed its end."""
        line = self.reader.readline()
        return json.loads(line) if line.strip() else None
