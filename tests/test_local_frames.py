"""Frames of the session socket (rendezvous/localwire.py): the frame reader, the
packed records, descriptor passing and :class:`Connection` on an asyncio loop
over socketpairs (no network)."""

from __future__ import annotations

import array
import asyncio
import fcntl
import os
import random
import socket
import struct

import pytest

from conftest import run, until
from rendezvous.local import frames as localwire
from rendezvous.errors import InvalidArgument
from rendezvous.local.connection import Connection
from rendezvous.local.frames import HEADER, FrameError, FrameReader, Kind, frame

pytestmark = pytest.mark.timeout(30)

BIG = 256 << 10  # a body at least this big is read into a buffer of its own


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def high_fd(fd: int) -> int:
    """A duplicate of ``fd`` numbered far above anything the kernel hands out next,
    so that "this number is closed" cannot be confused with "it was reused"."""
    dup = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 700)
    assert dup >= 700
    return dup


def split(frames) -> list[tuple[int, int, bytes]]:
    return [(k, op, bytes(body)) for k, op, body in frames]


def sample_frames(n: int = 50, seed: int = 1) -> list[tuple[int, int, bytes]]:
    rnd = random.Random(seed)
    kinds = list(Kind)
    out = []
    for i in range(n):
        size = rnd.choice([0, 0, 1, 7, 13, 100, 4096, rnd.randrange(20000)])
        out.append((int(rnd.choice(kinds)), rnd.randrange(1 << 64), rnd.randbytes(size)))
    out.append((int(Kind.OK), (1 << 64) - 1, b""))
    out.append((0xFF, 0, b"last"))
    return out


def stream_of(frames) -> bytes:
    return b"".join(frame(k, op, body) for k, op, body in frames)


# -- frames and the reader --------------------------------------------------------------

def test_frame_layout():
    f = frame(Kind.SEND, 0x0102030405060708, b"abc")
    assert len(HEADER.pack(0, 0, 0)) == HEADER.size == 13
    assert f == struct.pack("<IBQ", 3, 2, 0x0102030405060708) + b"abc"
    assert frame(Kind.PENDING, 5) == struct.pack("<IBQ", 0, 5, 5)
    assert frame(Kind.RECV, 1, bytearray(b"xy")) == frame(Kind.RECV, 1, memoryview(b"xy")) == frame(3, 1, b"xy")


def test_many_frames_in_one_feed():
    frames = sample_frames(200)
    r = FrameReader(1 << 20)
    got = r.feed(stream_of(frames))
    assert split(got) == frames
    assert not r.partial
    assert r.into() is None
    assert r.feed(b"") == []


def test_frames_fed_one_byte_at_a_time():
    frames = sample_frames(12, seed=2)
    frames = [(k, op, body[:300]) for k, op, body in frames]  # keep the byte loop short
    data = stream_of(frames)
    ends = set()
    pos = 0
    for _, _, body in frames:
        pos += HEADER.size + len(body)
        ends.add(pos)
    r = FrameReader(1 << 20)
    got = []
    for i in range(len(data)):
        out = r.feed(data[i:i + 1])
        got.extend(out)
        # a frame comes out exactly when its last byte goes in, and only then
        assert bool(out) == (i + 1 in ends), i
        assert r.partial == (i + 1 not in ends), i
    assert split(got) == frames  # the early bodies are still intact after later feeds


def test_frames_split_at_every_boundary():
    frames = [(1, 10, b"first"), (0x80, 11, b""), (2, 12, bytes(range(256)) * 3), (0x83, 13, b"z")]
    data = stream_of(frames)
    for cut in range(len(data) + 1):
        r = FrameReader(1 << 16)
        got = r.feed(data[:cut]) + r.feed(data[cut:])
        assert split(got) == frames, cut
        assert not r.partial
    # and in three pieces
    for cut in range(0, len(data), 7):
        for cut2 in range(cut, len(data) + 1, 11):
            r = FrameReader(1 << 16)
            got = r.feed(data[:cut]) + r.feed(data[cut:cut2]) + r.feed(data[cut2:])
            assert split(got) == frames, (cut, cut2)


def _read_like_a_connection(r: FrameReader, data: bytes, chunk: int) -> list[tuple[int, int, bytes]]:
    """Feed ``data`` the way Connection does: ``into``/``filled`` while a big body is open."""
    got = []
    pos = 0
    while pos < len(data):
        into = r.into()
        if into is not None:
            n = min(len(into), chunk, len(data) - pos)
            into[:n] = data[pos:pos + n]
            pos += n
            got.extend(split(r.filled(n)))
        else:
            got.extend(split(r.feed(data[pos:pos + chunk])))
            pos += chunk
    return got


@pytest.mark.parametrize("chunk", [1000, 4096, 65536, 300_001])
def test_big_body_through_into(chunk):
    rnd = random.Random(chunk)
    big = rnd.randbytes(BIG + 12345)
    exact = rnd.randbytes(BIG)
    frames = [(1, 1, b"before"), (Kind.RECV_REPLY, 2, big), (0x80, 3, b""), (Kind.SEND, 4, exact), (2, 5, b"after")]
    data = stream_of(frames)
    r = FrameReader(1 << 20)
    got = _read_like_a_connection(r, data, chunk)
    assert got == [(int(k), op, body) for k, op, body in frames]
    assert not r.partial and r.into() is None


def test_big_body_buffer_of_its_own():
    body = bytes(range(1, 256)) * 2056 + b"\x01"  # over 512 KiB; no zero byte, the last one neither
    data = frame(Kind.RECV_REPLY, 77, body)
    r = FrameReader(1 << 20)
    assert r.feed(data[:5]) == []  # not even a header yet
    assert r.partial and r.into() is None
    assert r.feed(data[5:1000]) == []
    assert r.partial
    into = r.into()
    assert into is not None and len(into) == len(body) - (1000 - HEADER.size)
    assert r.filled(0) == []
    into[:100] = data[1000:1100]
    assert r.filled(100) == []
    into = r.into()
    assert len(into) == len(data) - 1100
    into[:len(into) - 1] = data[1100:-1]
    assert r.filled(len(into) - 1) == []  # one byte short: not yet
    assert r.partial
    into = r.into()
    assert len(into) == 1
    into[:] = data[-1:]
    [(kind, op, got)] = r.filled(1)
    assert (kind, op) == (Kind.RECV_REPLY, 77) and bytes(got) == body
    assert not r.partial and r.into() is None
    # the reader goes on with ordinary frames
    assert split(r.feed(frame(1, 2, b"x"))) == [(1, 2, b"x")]


def test_big_body_whole_in_one_feed():
    body = os.urandom(BIG + 1)
    r = FrameReader(1 << 20)
    assert split(r.feed(frame(3, 9, body) + frame(4, 10, b"k"))) == [(3, 9, body), (4, 10, b"k")]
    assert r.into() is None and not r.partial


def test_small_frame_below_big_is_not_split_off():
    body = os.urandom(BIG - 1)
    data = frame(3, 9, body)
    r = FrameReader(1 << 20)
    assert r.feed(data[:1000]) == []
    assert r.into() is None  # below the big size: it waits in the reader's rest
    assert split(r.feed(data[1000:])) == [(3, 9, body)]


def test_limit():
    r = FrameReader(100)
    assert split(r.feed(frame(1, 1, b"x" * 100))) == [(1, 1, b"x" * 100)]
    with pytest.raises(FrameError):
        r.feed(HEADER.pack(101, 1, 2))  # a header alone is enough to refuse
    assert issubclass(FrameError, InvalidArgument)
    r = FrameReader(100)
    with pytest.raises(FrameError):
        r.feed(frame(1, 1, b"ok") + HEADER.pack(1 << 31, 1, 2))
    r = FrameReader(1 << 20)
    with pytest.raises(FrameError):
        r.feed(HEADER.pack(0xFFFFFFFF, 1, 2) + b"abc")
    # split header
    r = FrameReader(10)
    hdr = HEADER.pack(11, 1, 2)
    assert r.feed(hdr[:7]) == []
    with pytest.raises(FrameError):
        r.feed(hdr[7:])


def test_partial():
    r = FrameReader(1 << 20)
    assert not r.partial
    f = frame(1, 2, b"hello")
    r.feed(f[:1])
    assert r.partial
    r.feed(f[1:HEADER.size])
    assert r.partial
    r.feed(f[HEADER.size:-1])
    assert r.partial
    assert split(r.feed(f[-1:])) == [(1, 2, b"hello")]
    assert not r.partial
    r.feed(frame(1, 3, b"") + f[:3])
    assert r.partial
    big = frame(1, 4, bytes(BIG))
    r = FrameReader(1 << 20)
    r.feed(big[:HEADER.size])
    assert r.partial


# -- packed records -----------------------------------------------------------------------

def test_ids_round_trip():
    for ids in ([], [0], [1, 2, 3], [(1 << 64) - 1, 0, 12345678901234]):
        body = localwire.pack_ids(ids)
        assert len(body) == 8 * len(ids)
        assert localwire.unpack_ids(body) == ids
        assert localwire.unpack_ids(memoryview(body)) == ids
    assert localwire.pack_ids(iter([5])) == struct.pack("<Q", 5)


@pytest.mark.parametrize("n", [1, 7, 9, 15, 17])
def test_ids_bad_length(n):
    with pytest.raises(FrameError):
        localwire.unpack_ids(bytes(n))


def test_grants_round_trip():
    for grants in ([], [(1, 65536)], [(7, 1 << 40), ((1 << 64) - 1, (1 << 64) - 1), (0, 0)]):
        body = localwire.pack_grants(grants)
        assert len(body) == 16 * len(grants)
        assert localwire.unpack_grants(body) == grants
        assert localwire.unpack_grants(memoryview(body)) == grants
    assert localwire.pack_grants([(1, 2)]) == struct.pack("<QQ", 1, 2)


@pytest.mark.parametrize("n", [1, 8, 15, 17, 24, 31])
def test_grants_bad_length(n):
    with pytest.raises(FrameError):
        localwire.unpack_grants(bytes(n))


def test_error_round_trip():
    for code, message in ((3, "bad key"), (0, ""), (14, "pool full: ünïcødé ✓"), (0xFFFF, "x" * 5000)):
        body = localwire.pack_error(code, message)
        assert body[:2] == struct.pack("<H", code)
        assert localwire.unpack_error(body) == (code, message)
        assert localwire.unpack_error(memoryview(body)) == (code, message)
    code, message = localwire.unpack_error(struct.pack("<H", 5) + b"\xff\xfebad")
    assert code == 5 and message.endswith("bad") and "\ufffd" in message


def test_error_too_short():
    for body in (b"", b"\x05"):
        code, message = localwire.unpack_error(body)
        assert code == 2 and message


# -- descriptors ----------------------------------------------------------------------------

def test_take_fds_real_scm_rights():
    a, b = socket.socketpair()
    r, w = os.pipe()
    try:
        socket.send_fds(a, [b"x"], [r, w])
        msg, anc, flags, _ = b.recvmsg(16, socket.CMSG_SPACE(localwire.MAX_FDS * 4))
        assert msg == b"x"
        fds = localwire.take_fds(anc)
        try:
            assert len(fds) == 2 and not set(fds) & {r, w}
            assert os.fstat(fds[0]).st_ino == os.fstat(r).st_ino
            assert os.fstat(fds[1]).st_ino == os.fstat(w).st_ino
            os.write(fds[1], b"through")  # the received write end reaches the original read end
            assert os.read(r, 100) == b"through"
        finally:
            for fd in fds:
                os.close(fd)
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()


def test_take_fds_records():
    two = array.array("i", [11, 12]).tobytes()
    one = array.array("i", [13]).tobytes()
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, two),
           (socket.IPPROTO_TCP, socket.SCM_RIGHTS, one),  # another level: not descriptors
           (socket.SOL_SOCKET, socket.SCM_RIGHTS + 1, one),  # another kind
           (socket.SOL_SOCKET, socket.SCM_RIGHTS, one + b"\x01\x02")]  # a truncated tail
    assert localwire.take_fds(anc) == [11, 12, 13]
    assert localwire.take_fds([]) == []


# -- Connection -----------------------------------------------------------------------------

class Side:
    """What one Connection reported."""

    def __init__(self) -> None:
        self.frames: list[tuple[int, int, bytes]] = []
        self.calls: list[tuple[list[tuple[int, int, bytes]], list[int]]] = []
        self.fds: list[int] = []
        self.closes: list[BaseException | None] = []

    def on_frames(self, frames, fds) -> None:
        got = split(frames)
        self.calls.append((got, list(fds)))
        self.frames.extend(got)
        self.fds.extend(fds)

    def on_close(self, error) -> None:
        self.closes.append(error)

    def connect(self, sock, **kw) -> Connection:
        kw.setdefault("limit", 4 << 20)
        return Connection(sock, on_frames=self.on_frames, on_close=self.on_close, **kw)


class CountingSocket(socket.socket):
    """A socket that counts its ``sendmsg`` calls."""

    sends: list[int]

    def sendmsg(self, buffers, *args):
        n = super().sendmsg(buffers, *args)
        type(self).sends.append(n)
        return n


def counting(sock: socket.socket) -> socket.socket:
    return CountingSocket(sock.family, sock.type, fileno=sock.detach())


@pytest.mark.parametrize("fds", [False, True])
def test_connection_frames_in_order(fds):
    frames = sample_frames(300, seed=3)
    frames += [(1, 1000, os.urandom(BIG + 7)), (2, 1001, b"tail"), (3, 1002, os.urandom(3 * BIG))]

    async def main():
        a, b = socket.socketpair()
        sa, sb = Side(), Side()
        ca = sa.connect(a)
        cb = sb.connect(b, fds=fds)
        for i, (k, op, body) in enumerate(frames):
            ca.write(frame(k, op, body))
            if i % 17 == 0:
                await asyncio.sleep(0)  # some writes in later loop turns
        cb.write(frame(Kind.OK, 9, b"back"))
        await until(lambda: len(sb.frames) == len(frames), what="every frame")
        await until(lambda: sa.frames, what="the reply")
        assert sb.frames == [(int(k), op, body) for k, op, body in frames]
        assert sa.frames == [(Kind.OK, 9, b"back")]
        assert sb.fds == [] and sa.fds == []
        assert ca.backlog == 0 and cb.backlog == 0
        assert sa.closes == [] == sb.closes
        ca.close()
        assert ca.closed and sa.closes == [None]
        ca.close()  # once
        assert sa.closes == [None]
        await until(lambda: sb.closes, what="the peer's close")
        assert sb.closes == [None]  # at a frame boundary: a clean end
        assert cb.closed and b.fileno() == -1 and a.fileno() == -1

    run(main(), 20)


def test_connection_passes_descriptors():
    async def main():
        a, b = socket.socketpair()
        daemon, client = Side(), Side()
        cd = daemon.connect(a)  # the daemon never accepts descriptors
        cc = client.connect(b, fds=True)
        r, w = os.pipe()
        mfd = os.memfd_create("localwire-test", os.MFD_CLOEXEC)
        os.ftruncate(mfd, 4096)
        want = [os.fstat(fd).st_ino for fd in (w, mfd, r)]
        sent = [high_fd(w), high_fd(mfd), high_fd(r)]
        cd.write(frame(Kind.OK, 1, b"no descriptors"))
        cd.write(frame(Kind.SEGMENTS, 0, localwire.pack_grants([(1, 4096), (2, 4096)])), sent[:2])
        cd.write(frame(Kind.OK, 2, b"between"))
        cd.write(frame(Kind.SEGMENTS, 0, localwire.pack_grants([(3, 1)])), sent[2:])
        cd.write(frame(Kind.OK, 3, b"after"))
        await until(lambda: len(client.frames) == 5, what="the frames")
        assert cd.backlog == 0
        # the sender's copies are closed once sent (the numbers are far above any reused one)
        for fd in sent:
            assert not is_open(fd), fd
        assert [f[:2] for f in client.frames] == [(Kind.OK, 1), (Kind.SEGMENTS, 0), (Kind.OK, 2),
                                                  (Kind.SEGMENTS, 0), (Kind.OK, 3)]
        got = client.fds
        assert len(got) == 3
        assert [os.fstat(fd).st_ino for fd in got] == want
        # each frame's descriptors came no later than the frame itself
        seen_fds = 0
        segments = 0
        need = [2, 3]
        for frames, fds in client.calls:
            seen_fds += len(fds)
            for k, _, _ in frames:
                if k == Kind.SEGMENTS:
                    assert seen_fds >= need[segments]
                    segments += 1
        # the received write end works
        os.write(got[0], b"via scm_rights")
        assert os.read(r, 100) == b"via scm_rights"
        for fd in got + [r, w, mfd]:
            os.close(fd)
        cd.close()
        cc.close()

    run(main(), 20)


def test_connection_without_fds_drops_descriptors():
    """A side that does not accept descriptors (the daemon) keeps none it is sent."""
    async def main():
        a, b = socket.socketpair()
        sa, sb = Side(), Side()
        ca = sa.connect(a, fds=True)
        cb = sb.connect(b)
        r, w = os.pipe()
        os.set_blocking(r, False)
        ca.write(frame(Kind.SEGMENTS, 0, b""), [w])  # the connection owns w now
        await until(lambda: sb.frames, what="the frame")
        assert sb.fds == [] and sb.calls == [([(Kind.SEGMENTS, 0, b"")], [])]
        assert not is_open(w)
        # no write end of the pipe is left anywhere: the reader sees the end
        assert os.read(r, 1) == b""
        os.close(r)
        ca.close()
        cb.close()

    run(main(), 20)


def test_connection_closes_unsent_descriptors():
    async def main():
        a, b = socket.socketpair()
        sa, sb = Side(), Side()
        ca = sa.connect(a)
        cb = sb.connect(b, fds=True)
        r, w = os.pipe()
        queued = high_fd(w)
        ca.write(frame(Kind.SEGMENTS, 0, b""), [queued])
        ca.close()  # before the end of the loop turn: never sent
        assert not is_open(queued)
        late = high_fd(w)
        ca.write(frame(Kind.SEGMENTS, 0, b""), [late])  # on a closed connection
        assert not is_open(late)
        await until(lambda: sb.closes, what="the peer's close")
        assert sb.frames == [] and sb.fds == []
        assert sb.closes == [None]
        for fd in (r, w):
            os.close(fd)

    run(main(), 20)


def test_connection_coalesces_writes():
    CountingSocket.sends = []

    async def main():
        a, b = socket.socketpair()
        sa, sb = Side(), Side()
        ca = sa.connect(counting(a))
        sb.connect(b)
        frames = [(Kind.OK, i, i.to_bytes(4, "little")) for i in range(200)]  # within one turn's hand-over
        for k, op, body in frames:
            ca.write(frame(k, op, body))
        assert ca.backlog == sum(HEADER.size + 4 for _ in frames)
        assert CountingSocket.sends == []  # nothing goes out before the end of the turn
        await until(lambda: len(sb.frames) == len(frames), what="every frame")
        assert sb.frames == frames
        assert len(CountingSocket.sends) == 1  # one write for the whole turn
        assert len(sb.calls) == 1  # and one read on the other side
        # a second turn of many more writes: still a few large writes, not one each
        CountingSocket.sends.clear()
        more = [(Kind.OK, i, b"m") for i in range(1200)]
        for k, op, body in more:
            ca.write(frame(k, op, body))
        await until(lambda: len(sb.frames) == len(frames) + len(more), what="the second batch")
        assert sb.frames[len(frames):] == more
        assert 1 <= len(CountingSocket.sends) <= 3
        ca.close()

    run(main(), 20)


def test_connection_descriptors_start_their_own_write():
    CountingSocket.sends = []

    async def main():
        a, b = socket.socketpair()
        sa, sb = Side(), Side()
        ca = sa.connect(counting(a))
        sb.connect(b, fds=True)
        r, w = os.pipe()
        ca.write(frame(1, 1, b"a"))
        ca.write(frame(1, 2, b"b"))
        ca.write(frame(Kind.SEGMENTS, 3, b""), [os.dup(w)])
        ca.write(frame(1, 4, b"c"))
        ca.write(frame(Kind.SEGMENTS, 5, b""), [os.dup(w)])
        await until(lambda: len(sb.frames) == 5, what="every frame")
        assert [op for _, op, _ in sb.frames] == [1, 2, 3, 4, 5]
        assert len(sb.fds) == 2
        assert len(CountingSocket.sends) == 3  # [a b] [SEGMENTS c] [SEGMENTS]
        for fd in sb.fds + [r, w]:
            os.close(fd)
        ca.close()

    run(main(), 20)


@pytest.mark.parametrize("fds", [False, True])
@pytest.mark.parametrize("cut", ["header", "body", "big body"])
def test_connection_peer_closes_mid_frame(fds, cut):
    async def main():
        a, b = socket.socketpair()
        side = Side()
        conn = side.connect(a, fds=fds)
        whole = frame(1, 1, b"complete")
        if cut == "header":
            half = frame(2, 2, b"body")[:7]
        elif cut == "body":
            half = frame(2, 2, b"a body of some length")[:20]
        else:
            half = frame(2, 2, bytes(BIG * 2))[:BIG // 2]
        b.setblocking(False)
        await asyncio.get_running_loop().sock_sendall(b, whole + half)
        b.close()
        await until(lambda: side.closes, what="the close")
        assert side.frames == [(1, 1, b"complete")]
        [err] = side.closes
        assert isinstance(err, ConnectionError)
        assert conn.closed and a.fileno() == -1

    run(main(), 20)


def test_connection_frame_over_limit():
    async def main():
        a, b = socket.socketpair()
        side = Side()
        conn = side.connect(a, limit=1000)
        b.sendall(frame(1, 1, bytes(1000)))
        await until(lambda: side.frames, what="the frame at the limit")
        b.sendall(HEADER.pack(1001, 1, 2))
        await until(lambda: side.closes, what="the close")
        [err] = side.closes
        assert isinstance(err, FrameError)
        assert conn.closed and a.fileno() == -1
        assert side.frames == [(1, 1, bytes(1000))]
        b.setblocking(False)
        assert b.recv(10) == b""  # the peer sees the end
        b.close()

    run(main(), 20)


def test_connection_stops_reading_above_high_water():
    high = 64 << 10
    chunk = frame(Kind.RECV_REPLY, 0, bytes(range(256)) * 256)  # 64 KiB and a header
    count = 64  # 4 MiB: far more than a socketpair buffers

    async def main():
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        b.setblocking(False)
        side = Side()
        conn = side.connect(a, high_water=high)
        total = 0
        for i in range(count):
            conn.write(chunk)
            total += len(chunk)
        assert conn.backlog == total
        # the peer sends a frame but reads nothing: the writer is stuck above its high water
        b.sendall(frame(Kind.PENDING, 42, b"are you there"))
        for _ in range(50):
            await asyncio.sleep(0)  # loop turns, not time: the frame is already in the socket
        assert high < conn.backlog < total
        assert side.frames == []  # not read while the backlog is above the high water
        assert not conn.closed
        # the peer drains: everything arrives and reading resumes
        received = bytearray()
        while len(received) < total:
            received += await loop.sock_recv(b, 1 << 20)
        await until(lambda: conn.backlog == 0, what="the backlog to drain")
        await until(lambda: side.frames, what="the peer's frame")
        assert side.frames == [(Kind.PENDING, 42, b"are you there")]
        r = FrameReader(1 << 20)
        got = r.feed(bytes(received))
        assert len(got) == count and all(bytes(body) == chunk[HEADER.size:] for _, _, body in got)
        # and it goes on reading
        b.sendall(frame(Kind.PENDING, 43, b""))
        await until(lambda: len(side.frames) == 2, what="a later frame")
        conn.close()
        b.close()

    run(main(), 20)


def test_connection_keeps_reading_below_high_water():
    async def main():
        a, b = socket.socketpair()
        side = Side()
        conn = side.connect(a, high_water=1 << 20)
        conn.write(frame(1, 1, bytes(1000)))  # the peer does not read it: it is well below
        b.sendall(frame(1, 2, b"x"))
        await until(lambda: side.frames, what="the frame")
        assert side.frames == [(1, 2, b"x")]
        conn.close()
        b.close()

    run(main(), 20)


def test_connection_writer_blocked_then_peer_gone():
    async def main():
        a, b = socket.socketpair()
        side = Side()
        conn = side.connect(a, high_water=64 << 10)  # not reading: only the writer can see the end
        for _ in range(64):
            conn.write(frame(1, 0, bytes(64 << 10)))
        await until(lambda: 0 < conn.backlog < 64 * ((64 << 10) + HEADER.size), what="a partial send")
        b.close()
        await until(lambda: side.closes, what="the close")
        [err] = side.closes
        assert isinstance(err, OSError)  # a broken pipe (or a reset)
        assert conn.closed and a.fileno() == -1

    run(main(), 20)


def test_an_empty_write_is_dropped_and_its_descriptors_closed():
    """An empty write once made the flush loop forever (sendmsg sent 0 bytes and
    nothing left the queue): the loop hung."""
    async def main():
        a, b = socket.socketpair()
        side = Side()
        conn = side.connect(a)
        r, w = os.pipe()
        try:
            conn.write(frame(1, 1, b"x"))
            conn.write(b"", [os.dup(w)])
            conn.write(frame(1, 2, b"y"))
            await asyncio.sleep(0)  # one loop turn: the flush runs and returns
            b.setblocking(False)
            assert b.recv(100) == frame(1, 1, b"x") + frame(1, 2, b"y")
            os.close(w)
            w = -1
            assert os.read(r, 1) == b""  # every write end is closed: the dup went with the empty write
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
            conn.close()
            b.close()

    run(main(), 20)


def test_descriptors_that_came_with_a_broken_frame_are_closed():
    """Descriptors read together with a header over the limit were once left open."""
    async def main():
        a, b = socket.socketpair()
        side = Side()
        side.connect(a, limit=100, fds=True)
        r, w = os.pipe()
        try:
            socket.send_fds(b, [HEADER.pack(1000, 1, 0)], [w])
            os.close(w)
            await until(lambda: side.closes, what="the close")
            assert isinstance(side.closes[0], FrameError)
            assert os.read(r, 1) == b""  # no copy of the write end is left open here
        finally:
            os.close(r)
            b.close()

    run(main(), 20)
