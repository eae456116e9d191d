"""A local client that attacks its daemon, or is simply broken: the daemon stays
within its bounds and keeps serving the others.

Each attack here once worked against the daemon (the figures in the tests'
notes are what it did then): a frame header announcing gigabytes, lends that
use up the daemon's descriptors, a flood of connections, and a session that
never reads its replies.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import logging
import os
import re
import resource
import socket
import struct
import subprocess
import sys
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

from rendezvous.client.core import LocalOp
from rendezvous.local import frames as localwire
from rendezvous.client import Client as BlockingClient
from rendezvous.client.aio import Client
from rendezvous.daemon.service import PENDING_BYTES
from rendezvous.errors import ResourceExhausted
from rendezvous.daemon.sessions import SESSION_HIGH_WATER, SMALL_FRAME
from rendezvous.local.frames import HEADER, FrameReader, Kind
from rendezvous.v1 import local_pb2 as lpb

from conftest import run, until
from test_daemon import daemons, key, sockdir  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(120)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def session(path: str) -> socket.socket:
    """A raw session on this loop: connected and past HELLO."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    await loop.sock_connect(sock, path)
    hello = lpb.AttachRequest(client_id="0123456789ab", pid=os.getpid()).SerializeToString()
    await loop.sock_sendall(sock, localwire.frame(Kind.HELLO, 1, hello))
    reader = FrameReader(1 << 30)
    while not reader.feed(await loop.sock_recv(sock, 1 << 16)):
        pass
    return sock


async def replies(sock: socket.socket, count: int) -> list[tuple[int, int, bytes]]:
    """The next ``count`` frames from the daemon on a raw session (SEGMENTS and
    their descriptors left out)."""
    return await asyncio.get_running_loop().run_in_executor(None, _read_frames, sock, count)


def _read_frames(sock: socket.socket, count: int) -> list[tuple[int, int, bytes]]:
    """As a client reads: small frames by feed, a large body straight into its buffer."""
    sock.setblocking(True)
    reader = FrameReader(1 << 30)
    got: list[tuple[int, int, bytes]] = []
    try:
        while len(got) < count:
            into = reader.into()
            if into is not None:
                n, anc, _, _ = sock.recvmsg_into([into], socket.CMSG_SPACE(64 * 4))
                frames = reader.filled(n) if n else None
            else:
                data, anc, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(64 * 4))
                frames = reader.feed(data) if data else None
            for fd in localwire.take_fds(anc):
                os.close(fd)
            assert frames is not None, f"the daemon closed the session after {len(got)} of {count} frames"
            got += [(k, op, bytes(b)) for k, op, b in frames if k != Kind.SEGMENTS]
        return got
    finally:
        sock.setblocking(False)


# -- frames that announce more than they send ----------------------------------------------------


def test_a_header_announcing_gigabytes_commits_nothing_and_goes_with_its_session(sockdir):  # noqa: F811
    """Three 13-byte SEND headers announcing 1 GiB each once took a daemon from
    65 MB to 3.1 GB (the whole body allocated and zeroed at once), and kept it
    after the sessions closed (a session and its connection held each other
    until a garbage collection). Now a body takes memory only as its bytes
    arrive, a frame that carries no tensor is bounded by its header alone, and
    a closed session's memory goes at once."""
    async def main():
        async with daemons(sockdir) as (d,):
            loop = asyncio.get_running_loop()
            gc.collect()
            before = rss_mib()
            socks = [await session(d.sessions.path) for _ in range(3)]
            for sock in socks:
                await loop.sock_sendall(sock, HEADER.pack(1 << 30, Kind.SEND, 2) + b"\x0a\x00")
            held = lambda: [s for s in d.sessions.sessions.values() if s.conn.reader.partial]  # noqa: E731
            await until(lambda: len(held()) == 3, what="the daemon to read the three headers")
            assert rss_mib() - before < 48, f"the headers took {rss_mib() - before:.0f} MiB"
            refs = [weakref.ref(s) for s in held()]

            # RECV carries a key, never a tensor: a larger header ends the session at once
            greedy = await session(d.sessions.path)
            await loop.sock_sendall(greedy, HEADER.pack(SMALL_FRAME + 1, Kind.RECV, 3))
            [(kind, op, body)] = await replies(greedy, 1)
            assert kind == Kind.ERROR and "at most" in localwire.unpack_error(body)[1]
            assert await loop.sock_recv(greedy, 16) == b""  # and the session is over
            greedy.close()

            gc.disable()  # what a closed session held must go without the collector
            try:
                for sock in socks:
                    sock.close()
                await until(lambda: not d.sessions.sessions, what="the sessions to end")
                await until(lambda: all(r() is None for r in refs), what="the sessions' memory to go")
            finally:
                gc.enable()
    run(main())


# -- descriptors -----------------------------------------------------------------------------------


class _Daemon:
    """rendezvousd in a process of its own, with the common soft limit of 1,024
    descriptors as its hard limit (so it cannot raise it)."""

    READY = re.compile(r"rendezvousd: (\S+) serving on (\S+) .*; local (\S+);")

    def __init__(self, folder: Path, fds: int = 1024) -> None:
        self.socket = folder / "d.sock"
        argv = [str(Path(sys.executable).parent / "rendezvousd"), "--cluster", json.dumps({"node": ["127.0.0.1:0"]}),
                "--job-name", "node", "--task-index", "0", "--local", f"unix:{self.socket}",
                "--metrics-port", "-1", "--grace", "0"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUS_")}

        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (fds, fds))

        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     preexec_fn=limit, start_new_session=True)
        line = self.proc.stdout.readline()
        assert self.READY.search(line), line + self.proc.stderr.read()

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self) -> str:
        """Stop it; its stderr."""
        self.proc.terminate()
        _, err = self.proc.communicate(timeout=30)
        return err


_FLOOD = """
import socket, sys
path, n = sys.argv[1], int(sys.argv[2])
socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)  # the backlog takes it, whether or not the daemon keeps it
    socks.append(s)
print(len(socks), flush=True)
sys.stdin.read()
"""


def poll(predicate, what: str, show=lambda: None, timeout: float = 30.0) -> None:
    """Until ``predicate()`` holds, checking every 10 ms; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what} ({show()})"
        time.sleep(0.01)


def _lend_all(path: str, count: int, nbytes: int = 64 << 10) -> tuple[socket.socket, int, list[str]]:
    """A raw session asking for ``count`` lends at once and reading the answers:
    (the session, segments granted, error messages)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    hello = lpb.AttachRequest(client_id="0123456789ab", pid=os.getpid()).SerializeToString()
    sock.sendall(localwire.frame(Kind.HELLO, 1, hello) + b"".join(
        localwire.frame(Kind.LEND, 10 + i, struct.pack("<Q", nbytes)) for i in range(count)))
    reader = FrameReader(1 << 30)
    granted, errors, answered = 0, [], 0
    while answered < count + 1:  # the WELCOME too
        data, anc, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(64 * 4))
        for fd in localwire.take_fds(anc):
            os.close(fd)  # the attacker does not even keep them
        assert data, f"the daemon closed the session after {answered} answers"
        for kind, _, body in reader.feed(data):
            if kind == Kind.OK:
                granted += len(localwire.unpack_grants(body))
            elif kind == Kind.ERROR:
                errors.append(localwire.unpack_error(body)[1])
            if kind != Kind.SEGMENTS:
                answered += 1
    return sock, granted, errors


@pytest.mark.slow
def test_lends_and_connections_cannot_take_the_daemons_descriptors(tmp_path):
    """With 1,024 descriptors, 498 lends of 64 KiB once exhausted a daemon (two
    descriptors per segment, the pool bounded only by bytes): lends failed with
    "Errno 24", a normal client could not connect, the accept loop spun and
    logged tens of thousands of lines, and 1,000 descriptors stayed held after
    the attacker left. Now a session holds at most its share of the pool's
    segments (one descriptor each), the pool at most half the descriptors,
    sessions at most a quarter; the rest are refused with a status or a closed
    connection, logged a few times, and the others are served throughout."""
    d = _Daemon(tmp_path)
    try:
        base = d.fds()
        path = f"{d.socket}.session"
        attackers = [_lend_all(path, 300) for _ in range(2)]
        for _, granted, errors in attackers:
            assert 0 < granted < 300 and len(errors) == 300 - granted
            assert all("at most" in e and "segments" in e for e in errors), errors[:3]
        assert d.fds() < 1024 - 128, f"the daemon holds {d.fds()} descriptors"

        # a flood of connections from another process: beyond its share they are closed at once
        flood = subprocess.Popen([sys.executable, "-c", _FLOOD, path, "400"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        opened = int(flood.stdout.readline())
        assert opened == 400
        with BlockingClient(f"unix:{d.socket}", connect_timeout=10) as normal:
            value = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: through shared memory
            normal.send(key(0, 0, "ok"), value, step_id=1)
            np.testing.assert_array_equal(normal.recv(key(0, 0, "ok"), step_id=1, timeout=10), value)
            assert normal.stats()["send_shm"] == 1 and normal.stats()["recv_shm"] == 1
        assert d.fds() < 1024 - 64

        for sock, _, _ in attackers:
            sock.close()
        flood.communicate(timeout=30)  # its connections close with it
        # what the attacker held goes back; at most a few free segments stay open for reuse
        poll(lambda: d.fds() <= base + 64, f"the daemon's descriptors to go back to about {base}", d.fds)
    finally:
        err = d.stop()
    refusals = [line for line in err.splitlines() if "refused a local session" in line]
    assert 1 <= len(refusals) <= 2, err[-3000:]
    assert len(err.splitlines()) < 50, f"{len(err.splitlines())} log lines:\n{err[-3000:]}"


def test_an_accept_loop_out_of_descriptors_backs_off_and_logs_once(sockdir, caplog):  # noqa: F811
    """accept() failing with EMFILE once spun the loop (the socket stays readable)
    and logged each attempt. Now it pauses, logs once, and says when it is
    accepting again and how many attempts it refused."""
    async def main():
        async with daemons(sockdir) as (d,):
            server = d.sessions
            real = server._sock
            fails = {"left": 3, "calls": 0}

            class Exhausted:
                def accept(self):
                    fails["calls"] += 1
                    if fails["left"]:
                        fails["left"] -= 1
                        raise OSError(errno.EMFILE, "Too many open files")
                    return real.accept()

                def __getattr__(self, name):
                    return getattr(real, name)

            server._sock = Exhausted()
            try:
                with caplog.at_level(logging.DEBUG, logger="rendezvous.daemon"):
                    async with Client(d.local_target) as c:  # connects once the daemon accepts again
                        await c.send(key(0, 0, "t"), np.arange(3), step_id=1)
                        assert list(await c.recv(key(0, 0, "t"), step_id=1, timeout=10)) == [0, 1, 2]
            finally:
                server._sock = real
            # three refused, with pauses in between; then one accepted (and one finding none waiting)
            assert fails["left"] == 0 and fails["calls"] <= 5
            messages = [r.getMessage() for r in caplog.records]
            assert sum("cannot accept local sessions" in m for m in messages) == 1, messages
            assert sum("accepting local sessions again, after 3 attempts" in m for m in messages) == 1, messages
    run(main())


# -- a session that reads nothing ---------------------------------------------------------------------


def test_a_session_that_reads_no_replies_stops_being_read(sockdir):  # noqa: F811
    """A session parked 1,000 recvs with 8 KB keys, then sent 50 PENDING frames
    and read nothing: each answer listed every recv (8 MB), and the daemon
    grew to 506 MB. Now an answer is one bounded message that says how much it
    left out, and once the unread replies pass the high-water mark the daemon
    takes no more of the session's frames (they wait, read or not) until the
    client reads; then every frame is answered."""
    async def main():
        async with daemons(sockdir) as (d,):
            loop = asyncio.get_running_loop()
            sock = await session(d.sessions.path)
            long = "k" * 8000
            recvs = b"".join(localwire.frame(Kind.RECV, 100 + i, lpb.LocalRecvRequest(
                step_id=1, rendezvous_key=key(0, 0, f"{long}{i}")).SerializeToString()) for i in range(1000))
            await loop.sock_sendall(sock, recvs)
            await until(lambda: len(d.local.waits) == 1000, what="the parked recvs")
            gc.collect()
            before = rss_mib()
            await loop.sock_sendall(sock, b"".join(localwire.frame(Kind.PENDING, 5000 + i) for i in range(50)))
            (s,) = d.sessions.sessions.values()
            await until(lambda: s.conn.blocked, what="the daemon to stop taking the session's frames")
            for _ in range(20):
                await asyncio.sleep(0)  # loop turns: nothing more is taken
            assert s.conn.backlog < SESSION_HIGH_WATER + 2 * PENDING_BYTES, s.conn.backlog
            assert rss_mib() - before < 64, f"grew {rss_mib() - before:.0f} MiB"
            # the client reads: every PENDING is answered, each bounded and saying what it left out
            got = await replies(sock, 50)
            assert [op for _, op, _ in got] == [5000 + i for i in range(50)]
            for kind, _, body in got:
                reply = lpb.PendingResponse.FromString(body)
                assert kind == Kind.PENDING_REPLY and len(body) <= PENDING_BYTES + (16 << 10)
                assert reply.omitted > 0 and len(reply.entries) + reply.omitted == 1000
            sock.close()
            await until(lambda: not d.local.waits, what="the parked recvs to be cancelled")
    run(main())


def test_a_session_holds_at_most_its_share_of_segments(sockdir):  # noqa: F811
    """Lends beyond a session's share are refused with RESOURCE_EXHAUSTED naming
    it; a recv for a session at its share crosses inside the frame; the share
    comes back as the session sends into its segments."""
    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target) as a, Client(d.local_target) as b:
            share = d.sessions.segment_share
            for _ in range(share):
                await a._link.call(LocalOp(Kind.LEND, struct.pack("<Q", 1 << 16), 10))
            with pytest.raises(ResourceExhausted, match=f"at most {share}"):
                await a._link.call(LocalOp(Kind.LEND, struct.pack("<Q", 1 << 16), 10))
            (sa,) = [s for s in d.sessions.sessions.values() if d.pool.holds(s.id)]
            assert d.pool.holds(sa.id) == share
            # another client is served as ever: a large send and recv through the pool
            value = np.arange(1 << 16, dtype=np.float32)
            await b.send(key(0, 0, "x"), value, step_id=1)
            np.testing.assert_array_equal(await b.recv(key(0, 0, "x"), step_id=1, timeout=10), value)
            assert b.stats()["recv_shm"] == 1
            # the client at its share still gets tensors, inside the frame
            await b.send(key(0, 0, "y"), value, step_id=1)
            np.testing.assert_array_equal(await a.recv(key(0, 0, "y"), step_id=1, timeout=10), value)
            assert a.stats() == {"recv_inline": 1, "local": 1}
            # at its share, a send still goes through one of its lent segments
            small = np.arange(1 << 14, dtype=np.float32)  # 64 KiB: the class it was lent
            await a.send(key(0, 0, "z"), small, step_id=1)
            assert a.stats()["send_shm"] == 1 and d.pool.holds(sa.id) <= share
            np.testing.assert_array_equal(await b.recv(key(0, 0, "z"), step_id=1, timeout=10), small)
    run(main())


# -- a recv cancelled in the frames that asked it -------------------------------------------------------


def test_a_recv_cancelled_in_the_same_write_that_asked_it_is_answered_once(sockdir):  # noqa: F811
    """A client's caller gave up at once: its RECV and the CANCEL for it reached
    the daemon in one read, and the CANCEL cancelled the recv's task before it
    ever ran. The client waits for exactly one frame per operation (its
    cancelled recvs wait for their answer to give back any tensor in it), so
    the daemon still answers: CANCELLED. Before, it wrote nothing, and the
    client kept the operation forever (63 of 10,000 in a race through two
    daemons, whose settling then never came)."""
    async def main():
        async with daemons(sockdir) as (d,):
            loop = asyncio.get_running_loop()
            sock = await session(d.sessions.path)
            asked = b"".join(
                localwire.frame(Kind.RECV, 200 + i, lpb.LocalRecvRequest(
                    step_id=1, rendezvous_key=key(0, 0, f"gone{i}")).SerializeToString())
                + localwire.frame(Kind.CANCEL, 200 + i) for i in range(20))
            await loop.sock_sendall(sock, asked)
            got = await replies(sock, 20)
            assert sorted(op for _, op, _ in got) == [200 + i for i in range(20)]
            for kind, _, body in got:
                assert kind == Kind.ERROR and localwire.unpack_error(body)[0] == 1  # CANCELLED
            await until(lambda: not d.local.waits and not any(s.recvs for s in d.sessions.sessions.values()),
                        what="nothing left waiting")
            sock.close()
    run(main())
