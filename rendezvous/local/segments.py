"""Shared-memory segments of the local hop, as both sides see them.

A segment is an anonymous ``memfd`` whose size is sealed (``F_SEAL_SHRINK |
F_SEAL_GROW | F_SEAL_SEAL``) before any client sees it, so no process can
truncate it under a mapping and make a reader fault (SIGBUS). Segments have
no name anywhere: their descriptors travel over the daemon's session socket
(``SCM_RIGHTS``), and the memory goes when the last descriptor and mapping
go, so nothing can leak past the processes that use it. Sizes come in four
classes per doubling (a 70 MiB tensor gets an 80 MiB segment), from 64 KiB.

Here: making a segment (:func:`create_segment`), its size class, and
mapping a descriptor (:func:`map_segment`, which checks the seals first,
into a :class:`Mapping` that holds no descriptor). The daemon's pool of
segments is :mod:`rendezvous.daemon.pool`.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import socket
import threading
import weakref
from typing import Any

from rendezvous.errors import InvalidArgument

__all__ = ["available", "size_class", "map_segment", "create_segment", "Mapping", "MIN_SEGMENT", "SEALS",
           "live_mappings"]

#: smallest segment: the default shared-memory threshold
MIN_SEGMENT = 64 << 10
#: seals every segment carries before it leaves the daemon
SEALS = getattr(fcntl, "F_SEAL_SHRINK", 2) | getattr(fcntl, "F_SEAL_GROW", 4) | getattr(fcntl, "F_SEAL_SEAL", 1)
_PAGE = mmap.PAGESIZE
_live = 0
_live_lock = threading.Lock()


def available() -> bool:
    """Whether this platform has sealed memfds and descriptor passing (Linux)."""
    return (hasattr(os, "memfd_create") and hasattr(os, "MFD_ALLOW_SEALING") and hasattr(fcntl, "F_ADD_SEALS")
            and hasattr(socket, "send_fds") and hasattr(socket, "AF_UNIX"))


def size_class(nbytes: int) -> int:
    """The segment size for a tensor of ``nbytes``: four classes per doubling,
    whole pages, at least :data:`MIN_SEGMENT`."""
    n = max(int(nbytes), MIN_SEGMENT)
    top = 1 << (n - 1).bit_length()  # the power of two at or above n
    step = max(top // 8, _PAGE)  # classes top/2 + k * top/8, k = 1..4
    return min(top, -(-n // step) * step)


def create_segment(size: int) -> int:
    """A new sealed memfd of ``size`` bytes (its descriptor)."""
    fd = os.memfd_create("rendezvous-segment", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value


def _unmap(addr: int, size: int) -> None:
    global _live
    _libc.munmap(addr, size)
    with _live_lock:
        _live -= 1


class Mapping:
    """A shared read-write mapping of a segment that holds no descriptor of its
    own (Python's ``mmap`` keeps a duplicate of its file's descriptor: two per
    segment where one will do). ``buffer`` is what arrays are made on
    (``np.frombuffer(m.buffer, ...)``); the memory is unmapped once the mapping
    is closed and the last array on it is gone, never under a live array."""

    __slots__ = ("buffer", "size")

    def __init__(self, fd: int, size: int) -> None:
        global _live
        addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot map a segment of {size} bytes: {os.strerror(err)}")
        self.size = size
        self.buffer: Any = (ctypes.c_char * size).from_address(addr)
        with _live_lock:
            _live += 1
        weakref.finalize(self.buffer, _unmap, addr, size)

    def __len__(self) -> int:
        return self.size

    def view(self) -> memoryview:
        """The bytes, as a memoryview (``close`` waits for it to go too)."""
        if self.buffer is None:
            raise ValueError("the mapping is closed")
        return memoryview(self.buffer).cast("B")

    def __getitem__(self, index: Any) -> Any:
        return self.view()[index]

    def __setitem__(self, index: Any, data: Any) -> None:
        self.view()[index] = data

    @property
    def closed(self) -> bool:
        return self.buffer is None

    def close(self) -> None:
        """Let the mapping go: now, or when the last array on it goes. Idempotent."""
        self.buffer = None


def live_mappings() -> int:
    """Segment mappings this process holds right now."""
    return _live


def map_segment(fd: int, size: int) -> Mapping:
    """Map a segment's descriptor (read and write, shared) after checking that its
    size is sealed and is ``size``: InvalidArgument otherwise. A mapping of a
    file that someone could shrink would fault when touched. The mapping keeps
    no descriptor: the caller may close ``fd`` at once."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise InvalidArgument(f"descriptor {fd} is not a sealed memfd ({exc.strerror})") from None
    if seals & SEALS != SEALS:
        raise InvalidArgument(f"segment descriptor {fd} lacks the size seals (seals {seals:#x})")
    actual = os.fstat(fd).st_size
    if actual != size or size <= 0:
        raise InvalidArgument(f"segment descriptor {fd} holds {actual} bytes, {size} announced")
    return Mapping(fd, size)
