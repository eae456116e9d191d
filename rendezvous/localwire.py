"""Frames of the session socket: the local hop's fast path.

A local client on the daemon's machine talks to it over one Unix stream
socket for its whole life (its session): every operation is a frame, many
may be in flight, and replies come back tagged with their operation's id.
One connection per client instead of a gRPC call per operation: a round trip
costs one write and one read on each side, and a burst of operations goes
out in one write. Segment descriptors of the shared-memory pool
(:mod:`rendezvous.shm`) ride on the same socket as ``SCM_RIGHTS`` data.

A frame is a 13-byte header (body length u32, kind u8, operation id u64,
little-endian) and its body. Bodies are the ``rendezvous.v1`` local messages
(``SendRequest``, ``LocalRecvRequest``, ...) or the small packed records
below. Descriptors are attached to the write that carries the ``SEGMENTS``
frame announcing them; the reader keeps every descriptor it gets in arrival
order and the ``SEGMENTS`` frame takes them from there (a stream socket
delivers a write's descriptors with its first byte, never after it).

:class:`Connection` drives one socket on an asyncio loop (the daemon's
sessions and the asyncio client); the blocking client reads and writes its
socket itself.
"""

from __future__ import annotations

import array
import asyncio
import collections
import enum
import mmap
import os
import socket
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .errors import InvalidArgument

__all__ = ["Kind", "HEADER", "frame", "FrameReader", "FrameError", "FrameTooLarge", "Connection", "pack_ids", "unpack_ids",
           "pack_grants", "unpack_grants", "pack_error", "unpack_error", "MAX_FDS", "take_fds"]

HEADER = struct.Struct("<IBQ")
_ID = struct.Struct("<Q")
_GRANT = struct.Struct("<QQ")
_CODE = struct.Struct("<H")
#: frames whose body is at least this big are read straight into their own buffer
_BIG = 256 << 10
_READ = 256 << 10
#: descriptors one SEGMENTS frame carries at most
MAX_FDS = 64


class Kind(enum.IntEnum):
    # client -> daemon
    HELLO = 1  # AttachRequest; answered WELCOME
    SEND = 2  # SendRequest; answered OK (its body: a replacement segment granted, if any)
    RECV = 3  # LocalRecvRequest; answered RECV_REPLY
    ABORT = 4  # AbortRequest; answered OK
    PENDING = 5  # empty; answered PENDING_REPLY
    RELEASE = 6  # packed segment ids the client no longer holds; no answer
    CANCEL = 7  # the RECV whose id is this frame's id gives up; no answer of its own
    LEND = 8  # packed u64 byte count; answered OK with the segment granted
    RETURN = 9  # SendRequest of a reply the client could not deliver (its recv was cancelled); answered OK
    # daemon -> client
    OK = 0x80
    ERROR = 0x81  # packed status code and message; with operation id 0: the session ends, and why
    RECV_REPLY = 0x82  # LocalRecvResponse
    SEGMENTS = 0x83  # packed (id, size) grants; their descriptors ride with this write
    RETIRE = 0x84  # packed segment ids the daemon closed: unmap them
    WELCOME = 0x85  # AttachResponse
    PENDING_REPLY = 0x86  # PendingResponse


class FrameError(InvalidArgument):
    """A peer broke the framing: the connection cannot go on."""


class FrameTooLarge(FrameError):
    """A frame announced more bytes than its kind may carry."""


def frame(kind: int, op: int, body: bytes | bytearray | memoryview = b"") -> bytes:
    return HEADER.pack(len(body), kind, op) + bytes(body)


def pack_ids(ids: Iterable[int]) -> bytes:
    return b"".join(_ID.pack(i) for i in ids)


def unpack_ids(body: bytes | memoryview) -> list[int]:
    if len(body) % 8:
        raise FrameError("a list of segment ids is not a whole number of 8-byte ids")
    return [v for (v,) in _ID.iter_unpack(body)]


def pack_grants(grants: Iterable[tuple[int, int]]) -> bytes:
    return b"".join(_GRANT.pack(i, n) for i, n in grants)


def unpack_grants(body: bytes | memoryview) -> list[tuple[int, int]]:
    if len(body) % 16:
        raise FrameError("a list of segment grants is not a whole number of 16-byte records")
    return list(_GRANT.iter_unpack(body))


def pack_error(code: int, message: str) -> bytes:
    return _CODE.pack(code) + message.encode("utf-8", "replace")


def unpack_error(body: bytes | memoryview) -> tuple[int, str]:
    if len(body) < 2:
        return 2, "malformed error frame"  # UNKNOWN
    (code,) = _CODE.unpack_from(body)
    return code, bytes(body[2:]).decode("utf-8", "replace")


class FrameReader:
    """Splits a byte stream into frames (kind, op id, body view).

    ``limit``: the largest body a frame may announce; ``limits``: smaller (or
    larger) ones by kind (a daemon takes large bodies only where an operation
    carries a tensor). A header announcing more is a FrameError at once,
    before anything is allocated for it.

    A large body is read straight into a buffer of its own (:meth:`into` says
    where the next read goes, :meth:`filled` takes it). That buffer is an
    anonymous mapping: address space is reserved for the whole body, but
    memory is committed only as bytes arrive (no zeroing, no copy), so a
    header announcing gigabytes and then nothing costs nothing. A body larger
    than the machine can reserve is a FrameError."""

    def __init__(self, limit: int, limits: Mapping[int, int] | None = None) -> None:
        self.limit = limit
        self.limits = dict(limits or {})
        self._rest = b""
        self._big: mmap.mmap | None = None
        self._big_head = (0, 0)
        self._filled = 0

    def limit_of(self, kind: int) -> int:
        return self.limits.get(kind, self.limit)

    def into(self) -> memoryview | None:
        if self._big is None:
            return None
        return memoryview(self._big)[self._filled:]

    def filled(self, n: int) -> list[tuple[int, int, memoryview]]:
        assert self._big is not None
        self._filled += n
        if self._filled < len(self._big):
            return []
        big, self._big = self._big, None
        return [(self._big_head[0], self._big_head[1], memoryview(big))]

    def feed(self, data: bytes) -> list[tuple[int, int, memoryview]]:
        buf = self._rest + data if self._rest else data
        view = memoryview(buf)
        out = []
        pos, end = 0, len(buf)
        hsize = HEADER.size
        while end - pos >= hsize:
            length, kind, op = HEADER.unpack_from(buf, pos)
            cap = self.limits.get(kind, self.limit)
            if length > cap:
                raise FrameTooLarge(f"a frame of kind {kind} announces {length} bytes; this socket carries at most "
                                 f"{cap} in one")
            stop = pos + hsize + length
            if stop > end:
                if length >= _BIG:
                    have = end - pos - hsize
                    self._big = _body_buffer(length)
                    self._big[:have] = view[pos + hsize:end]
                    self._filled = have
                    self._big_head = (kind, op)
                    pos = end
                break
            out.append((kind, op, view[pos + hsize:stop]))
            pos = stop
        self._rest = bytes(view[pos:]) if pos < end else b""
        return out

    @property
    def partial(self) -> bool:
        """Whether a frame has begun and not ended."""
        return bool(self._rest) or self._big is not None

    def discard(self) -> None:
        """Drop a frame begun and not ended (the connection is gone)."""
        self._rest = b""
        self._big = None


def _body_buffer(length: int) -> mmap.mmap:
    """Room for a large frame body, committed page by page as it is written."""
    try:
        return mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE)
    except (OSError, OverflowError, ValueError) as exc:
        raise FrameTooLarge(f"a frame announces {length} bytes, more than this machine can hold: {exc}") from None


def take_fds(ancdata: Sequence[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors of ``recvmsg`` ancillary data."""
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[:len(data) - len(data) % arr.itemsize])
            fds.extend(arr)
    return fds


def _close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


#: frames handed to the owner in one loop turn, at most; the rest wait for the next
_TURN_FRAMES = 256


def _ignore(*_: Any) -> None:
    pass


class Connection:
    """One stream socket on an asyncio loop: frames in (``on_frames(frames, fds)``,
    called with frames in arrival order and the descriptors that came with
    them), frames out (:meth:`write`, coalesced per loop turn, descriptors
    attached), ``on_close(error or None)`` once when the socket ends.

    What a peer can make this side hold is bounded:

    * a frame's body by ``limit`` (``limits`` by kind; see :class:`FrameReader`);
    * replies it does not read: above ``high_water`` bytes, or ``max_fds``
      descriptors, waiting to go out, no more frames are taken from it (those
      already read wait, unhandled) and its socket is not read, until half of
      that has gone out;
    * the work one burst starts: at most a few hundred frames are handed over
      per loop turn, ``group`` at a time with the backlog checked in between,
      and nothing more is read while frames wait.

    Closing drops everything held for the peer at once (buffers, queued
    frames, the owner's callbacks): nothing waits for the garbage collector."""

    def __init__(self, sock: socket.socket, *, limit: int,
                 on_frames: Callable[[list[tuple[int, int, memoryview]], list[int]], None],
                 on_close: Callable[[BaseException | None], None], fds: bool = False,
                 high_water: int = 64 << 20, max_fds: int = 64, limits: Mapping[int, int] | None = None,
                 group: int = _TURN_FRAMES, farewell: Callable[[FrameError], bytes] | None = None) -> None:
        self.sock = sock
        sock.setblocking(False)
        self.loop = asyncio.get_running_loop()
        self.reader = FrameReader(limit, limits)
        self._on_frames = on_frames
        self._on_close = on_close
        self._fds = fds  # whether to accept descriptors (the client does; the daemon never)
        self._inbox: collections.deque[tuple[int, int, memoryview]] = collections.deque()
        self._inbox_fds: list[int] = []
        self._dispatching = False  # a dispatch is scheduled for the next turn
        self._out: collections.deque[tuple[Any, tuple[int, ...]]] = collections.deque()
        self._out_bytes = 0
        self._out_fds = 0
        self._high = high_water
        self._max_fds = max_fds
        self._group = max(1, group)
        self._farewell = farewell  # the last frame to a peer that broke the framing: why
        self._room = asyncio.Event()  # set while the peer reads its replies (not blocked)
        self._room.set()
        self._error: BaseException | None = None  # what ends a connection closing after its flush
        self._flushing = False
        self._writing = False
        self._reading = False
        self._closing = False
        self.closed = False
        self._fd = sock.fileno()
        self._read_on()

    # -- reading ------------------------------------------------------------------

    def _read_on(self) -> None:
        if not self._reading and not self.closed:
            self._reading = True
            self.loop.add_reader(self._fd, self._readable)

    def _read_off(self) -> None:
        if self._reading:
            self._reading = False
            self.loop.remove_reader(self._fd)

    @property
    def blocked(self) -> bool:
        """Whether the peer is not reading what was written to it (see the class)."""
        return self._out_bytes > self._high or self._out_fds > self._max_fds

    def _readable(self) -> None:
        fds: list[int] = []
        try:
            for _ in range(16):  # a bounded burst, then let the loop run others
                into = self.reader.into()
                fds = []
                if into is not None:
                    if self._fds:
                        n, anc, _, _ = self.sock.recvmsg_into([into], socket.CMSG_SPACE(MAX_FDS * 4))
                        fds = take_fds(anc)
                    else:
                        n = self.sock.recv_into(into)
                    if n == 0:
                        self.close(ConnectionError("the peer closed the socket in the middle of a frame"))
                        return
                    frames = self.reader.filled(n)
                else:
                    if self._fds:
                        data, anc, _, _ = self.sock.recvmsg(_READ, socket.CMSG_SPACE(MAX_FDS * 4))
                        fds = take_fds(anc)
                    else:
                        data = self.sock.recv(_READ)
                    if not data:
                        if self.reader.partial:
                            self.close(ConnectionError("the peer closed the socket in the middle of a frame"))
                        else:
                            self._dispatch()  # what came before the end is handled first
                            self.close(None)
                        return
                    frames = self.reader.feed(data)
                self._inbox.extend(frames)
                self._inbox_fds += fds
                fds = []
                if self._inbox or self._inbox_fds:
                    break  # hand these over before reading more
        except (BlockingIOError, InterruptedError):
            pass
        except (FrameError, OSError) as exc:
            _close_fds(fds)  # they came with the read that broke the framing
            self._dispatch()  # the frames before the broken one are whole: they count
            if isinstance(exc, FrameError) and self._farewell is not None and not self.closed:
                self._error = exc
                self.write(self._farewell(exc))  # the peer learns why, then the end
                self.close_after_flush()
            else:
                self.close(exc)
            return
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand waiting frames to the owner: a bounded number per turn, none while
        the peer is not reading its replies. Reading goes on once none wait."""
        self._dispatching = False
        budget = _TURN_FRAMES
        while (self._inbox or self._inbox_fds) and not self.closed and not self.blocked and not self._closing:
            if budget <= 0:
                self._dispatching = True
                self.loop.call_soon(self._dispatch)
                break
            group = [self._inbox.popleft() for _ in range(min(self._group, budget, len(self._inbox)))]
            fds, self._inbox_fds = self._inbox_fds, []
            budget -= len(group)
            self._on_frames(group, fds)
        if self.closed or self._closing:
            return
        if self._inbox or self._inbox_fds or self.blocked:
            self._read_off()
        else:
            self._read_on()

    # -- writing ------------------------------------------------------------------

    def write(self, data: bytes, fds: Sequence[int] = ()) -> None:
        """Queue ``data`` (whole frames) to go out at the end of this loop turn, with
        ``fds`` attached to its first byte. The connection owns ``fds`` from here:
        it closes them once sent (or when it closes)."""
        if self.closed or not data:  # descriptors ride on a byte: none without data
            _close_fds(fds)
            return
        self._out.append((data, tuple(fds)))
        self._out_bytes += len(data)
        self._out_fds += len(fds)
        if not self._flushing and not self._writing:
            self._flushing = True
            self.loop.call_soon(self._flush)
        if self.blocked:
            self._room.clear()
            self._read_off()

    async def room(self) -> None:
        """Return once the peer is reading its replies (at once, unless it is
        blocked: see the class). Replies made elsewhere than in ``on_frames``
        (a recv that waited for its tensor) wait here, so what a peer that reads
        nothing can make this side hold stays bounded."""
        while self.blocked and not self.closed:
            await self._room.wait()

    def _flush(self) -> None:
        self._flushing = False
        if self.closed:
            return
        try:
            while self._out:
                bufs: list[Any] = []
                fds: tuple[int, ...] = ()
                for data, attached in self._out:
                    if attached:
                        if bufs:
                            break  # descriptors start a write of their own
                        fds = attached
                    bufs.append(data)
                    if len(bufs) >= 512:
                        break
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
                sent = self.sock.sendmsg(bufs, anc)
                self._sent(sent)
        except (BlockingIOError, InterruptedError):
            if not self._writing:
                self._writing = True
                self.loop.add_writer(self._fd, self._writable)
            self._resume_if_drained()
            return
        except OSError as exc:
            self.close(exc)
            return
        if self._writing:
            self._writing = False
            self.loop.remove_writer(self._fd)
        if self._closing:
            self.close(self._error)
            return
        self._resume_if_drained()

    def _resume_if_drained(self) -> None:
        """Take frames again once the peer has read half of what it was blocked on."""
        if self.closed or self._out_bytes > self._high // 2 or self._out_fds > self._max_fds // 2:
            return
        self._room.set()
        if not self._closing and not self._dispatching and not self._reading:
            self._dispatch()

    def _sent(self, n: int) -> None:
        self._out_bytes -= n
        while n > 0:
            data, fds = self._out[0]
            _close_fds(fds)  # the peer has its own copies now
            self._out_fds -= len(fds)
            if n >= len(data):
                self._out.popleft()
                n -= len(data)
            else:
                self._out[0] = (memoryview(data)[n:], ())  # its descriptors went with its first byte
                n = 0

    def _writable(self) -> None:
        self._flush()

    @property
    def ending(self) -> bool:
        """Closed, or closing once its output is out."""
        return self.closed or self._closing

    @property
    def backlog(self) -> int:
        """Bytes waiting to go out."""
        return self._out_bytes

    @property
    def queued_fds(self) -> int:
        """Descriptors waiting to go out."""
        return self._out_fds

    # -- closing --------------------------------------------------------------------

    def close_after_flush(self) -> None:
        """Read no more, and close once what was written has gone out (an ERROR
        frame that says why the connection ends reaches the peer)."""
        if self.closed or self._closing:
            return
        self._closing = True
        self._read_off()
        if not self._flushing and not self._writing:
            self._flushing = True
            self.loop.call_soon(self._flush)

    def close(self, error: BaseException | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        on_close = self._on_close
        try:
            self._read_off()
            if self._writing:
                self.loop.remove_writer(self._fd)
        finally:
            for _, fds in self._out:
                _close_fds(fds)
            _close_fds(self._inbox_fds)
            self._out.clear()
            self._inbox.clear()
            self._inbox_fds = []
            self._out_bytes = self._out_fds = 0
            self.reader.discard()
            self._room.set()  # whoever waits for room sees the end
            self.sock.close()
            # the owner and this connection refer to each other: let go at once
            self._on_frames = self._on_close = _ignore
            self._farewell = None
            on_close(error)
