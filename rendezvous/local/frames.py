"""Frames of the session socket: the local hop's fast path.

A local client on the daemon's machine talks to it over one Unix stream
socket for its whole life (its session): every operation is a frame, many
may be in flight, and replies come back tagged with their operation's id.
One connection per client instead of a gRPC call per operation: a round trip
costs one write and one read on each side, and a burst of operations goes
out in one write. Segment descriptors of the shared-memory pool ride on the
same socket as ``SCM_RIGHTS`` data.

A frame is a 13-byte header (body length u32, kind u8, operation id u64,
little-endian) and its body. Bodies are the ``rendezvous.v1`` local messages
(:mod:`rendezvous.local.messages`) or the small packed records below.
Descriptors are attached to the write that carries the ``SEGMENTS`` frame
announcing them; the reader keeps every descriptor it gets in arrival order
and the ``SEGMENTS`` frame takes them from there (a stream socket delivers a
write's descriptors with its first byte, never after it).

:class:`rendezvous.local.connection.Connection` drives one socket on an
asyncio loop (the daemon's sessions and the asyncio client); the blocking
client reads and writes its socket itself, with the same :class:`FrameReader`.
"""

from __future__ import annotations

import array
import enum
import mmap
import os
import socket
import struct
from collections.abc import Iterable, Mapping, Sequence

from rendezvous.errors import InvalidArgument

__all__ = ["Kind", "HEADER", "frame", "FrameReader", "FrameError", "FrameTooLarge", "pack_ids", "unpack_ids",
           "pack_grants", "unpack_grants", "pack_error", "unpack_error", "MAX_FDS", "take_fds", "close_fds",
           "READ_BYTES", "SMALL_BODY", "SEND_MANY_TENSORS", "SEND_MANY_BODY"]

HEADER = struct.Struct("<IBQ")
_ID = struct.Struct("<Q")
_GRANT = struct.Struct("<QQ")
_CODE = struct.Struct("<H")
#: frames whose body is at least this big are read straight into their own buffer
_BIG = 256 << 10
#: bytes asked of the socket per read
READ_BYTES = 256 << 10
#: descriptors one SEGMENTS frame carries at most
MAX_FDS = 64
#: the largest body a client may send in a frame that carries no tensor bytes
#: (every kind but SEND, RETURN and SEND_MANY; a RECV_MANY's keys included)
SMALL_BODY = 1 << 20
#: the tensor bytes, keys and their records a client packs into one SEND_MANY at most
SEND_MANY_TENSORS = 4 << 20
#: the largest SEND_MANY body (one run's last tensor may pass SEND_MANY_TENSORS by itself)
SEND_MANY_BODY = SEND_MANY_TENSORS + (1 << 20)


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
    RECV_MANY = 10  # LocalRecvManyRequest; answered RECV_MANY_REPLY (CANCEL gives it up as a RECV)
    SEND_MANY = 11  # LocalSendManyRequest; answered OK
    SEND_IPC = 12  # SendRequest with an IpcTransfer; answered OK once the daemon's copy is done
    IPC_RELEASE = 13  # IpcRelease: exports of RECV_REPLYs the client is done with; no answer
    # daemon -> client
    OK = 0x80
    ERROR = 0x81  # packed status code and message; with operation id 0: the session ends, and why
    RECV_REPLY = 0x82  # LocalRecvResponse
    SEGMENTS = 0x83  # packed (id, size) grants; their descriptors ride with this write
    RETIRE = 0x84  # packed segment ids the daemon closed: unmap them
    WELCOME = 0x85  # AttachResponse
    PENDING_REPLY = 0x86  # PendingResponse
    RECV_MANY_REPLY = 0x87  # LocalRecvManyResponse


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


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
