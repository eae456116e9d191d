"""The session socket's listener: :class:`SessionListener`.

Beside its gRPC local socket, a daemon listens on a second Unix socket (the
first's path plus ``.session``, mode 0600 like it). Each connection is one
client's session (:mod:`rendezvous.daemon.sessions`). The listener bounds
how many there are (a quarter of the daemon's descriptors, 16 per process:
more are closed at once, logged once and then every thousandth), backs off
when ``accept`` runs out of descriptors, and tells sessions which segments
the pool retired.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import itertools
import logging
import os
import socket
import time

from rendezvous.local.frames import Kind, frame, pack_ids

from .ipc import DaemonIpc
from .pool import Pool
from .service import LocalServicer
from .sessions import SHARE, UCRED, FRAME_SLACK, Session

__all__ = ["SessionListener", "MAX_SESSIONS_PER_PROCESS"]

log = logging.getLogger("rendezvous.daemon")
#: accept() errors that mean "not now" (descriptors or kernel memory), not "not this one"
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
#: sessions one process may have open at once (a client has one; a process with a
#: blocking and an asyncio client, two): a process cannot take every session
MAX_SESSIONS_PER_PROCESS = 16


class SessionListener:
    """Accepts session connections on ``path`` for ``servicer`` (on the running loop)."""

    def __init__(self, servicer: LocalServicer, pool: Pool, path: str, threshold: int,
                 max_sessions: int = 1 << 12) -> None:
        self.servicer = servicer
        self.max_sessions = max_sessions
        self.pool = pool
        self.path = path
        self.threshold = threshold
        self.frame_limit = servicer.config.max_tensor_bytes + FRAME_SLACK
        #: segments one session may hold at once (lent and received), and recvs it may have in flight
        self.segment_share = max(4, pool.max_segments // SHARE)
        self.recv_share = max(64, servicer.config.max_waiting_calls // SHARE)
        self.sessions: dict[str, Session] = {}
        self.ipc = DaemonIpc(servicer.server)  # CUDA IPC with the sessions' clients
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None
        self._ino: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # accepting while out of descriptors: back off, log once (see _accept)
        self._refused = 0
        self._over = 0  # sessions refused for being over max_sessions, or their process's share
        self._per_pid: collections.Counter[int] = collections.Counter()
        #: protocol mistakes of all sessions (see Session._misuse)
        self.misused = 0
        self._refused_since = 0.0
        self._pause = 0.0
        self._resume: asyncio.TimerHandle | None = None
        pool.on_retire = self._retired

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            os.unlink(self.path)  # the daemon claimed the gRPC socket beside it: this one is stale
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old = os.umask(0o177)
            try:
                sock.bind(self.path)
            finally:
                os.umask(old)
            os.chmod(self.path, 0o600)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._ino = os.stat(self.path).st_ino
        self._loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        assert self._sock is not None
        for _ in range(64):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    self._back_off(exc)
                    return
                # the connection went before it was accepted (ECONNABORTED, EPROTO): the next one
                log.debug("a local session was lost before it was accepted: %s", exc)
                continue
            if self._refused:
                log.warning("accepting local sessions again, after %d attempts refused over %.1f s "
                            "(out of descriptors)", self._refused, time.monotonic() - self._refused_since)
                self._refused, self._pause = 0, 0.0
            try:
                pid, uid, _ = UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, UCRED.size))
            except OSError as exc:
                conn.close()
                log.debug("a local session went before it started: %s", exc)
                continue
            why = self._too_many(pid)
            if why:
                # its descriptor is needed more by the sessions already open: the
                # client sees the end of its connection at once, not a wait
                conn.close()
                self._over += 1
                if self._over == 1 or self._over % 1000 == 0:
                    log.warning("refused a local session of pid %d: %s (%d refused so far)", pid, why, self._over)
                continue
            sid = f"session-{next(self._ids)}"
            try:
                self.sessions[sid] = Session(self, sid, conn, pid, uid)
            except OSError as exc:
                conn.close()
                log.warning("cannot start a local session: %s", exc)
                continue
            self._per_pid[pid] += 1

    def _too_many(self, pid: int) -> str:
        """Why a new session of ``pid`` is refused, or ''."""
        if len(self.sessions) >= self.max_sessions:
            return f"{len(self.sessions)} sessions are open, the most this daemon's descriptor limit allows"
        if self._per_pid[pid] >= MAX_SESSIONS_PER_PROCESS:
            return f"that process already has {MAX_SESSIONS_PER_PROCESS} sessions open"
        return ""

    def ended(self, session: "Session") -> None:
        """A session ended: forget it."""
        if self.sessions.pop(session.id, None) is not None:
            left = self._per_pid[session.pid] - 1
            if left > 0:
                self._per_pid[session.pid] = left
            else:
                self._per_pid.pop(session.pid, None)

    def _back_off(self, exc: OSError) -> None:
        """Out of descriptors (or kernel memory): the listening socket stays readable,
        so accepting again at once would spin. Stop watching it for a while
        (doubling, up to a second); connections wait in its backlog meanwhile.
        Logged once when it starts, and once with a count when it ends."""
        if not self._refused:
            self._refused_since = time.monotonic()
            log.warning("cannot accept local sessions: %s; pausing accepts until descriptors are free", exc)
        self._refused += 1
        self._pause = min(1.0, max(0.01, self._pause * 2))
        assert self._loop is not None and self._sock is not None
        self._loop.remove_reader(self._sock.fileno())
        self._resume = self._loop.call_later(self._pause, self._listen_again)

    def _listen_again(self) -> None:
        self._resume = None
        if self._sock is not None and self._loop is not None:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    def _retired(self, seg_id: int, sessions: set[str]) -> None:
        """The pool closed a segment these sessions have mapped (any thread)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        body = frame(Kind.RETIRE, 0, pack_ids([seg_id]))

        def tell() -> None:
            for sid in sessions:
                session = self.sessions.get(sid)
                if session is not None:
                    session.conn.write(body)

        try:
            loop.call_soon_threadsafe(tell)
        except RuntimeError:
            pass  # the loop is closing: the sessions end with it

    def remove_file(self) -> None:
        """Remove the socket file if it is still the one bound here."""
        if self._ino is None:
            return
        try:
            if os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._ino = None

    def close(self) -> None:
        """Stop accepting, end every session, remove the socket file (if still ours)."""
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if self._sock is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        self.remove_file()
        for session in list(self.sessions.values()):
            session.conn.close(None)
        self.ipc.close()
