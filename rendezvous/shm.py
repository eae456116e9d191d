"""Shared memory of the local hop: a daemon's pool of sealed memfd segments.

The daemon (``rendezvousd``) owns every segment. A segment is an anonymous
``memfd`` whose size is sealed (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``)
before any client sees it, so no process can truncate it under a mapping and
make a reader fault (SIGBUS). Segments have no name anywhere: their file
descriptors travel to clients over the daemon's session socket
(``SCM_RIGHTS``), and the memory goes when the last descriptor and mapping
go, so nothing can leak past the processes that use it.

A segment carries one tensor at a time and is reused: both sides keep their
mappings, so a reused segment costs no new pages, zeroing or page faults.
Its life, counted in holders (``Segment.refs``):

* **free** in the pool (no holder);
* **lent** to a client session to write its next send into (the session);
* **in the table**: the daemon's array on it (an owner array whose
  finalizer drops the hold when the last view of it is gone: consumed,
  dropped, or done being served to a peer);
* **held** by a client that received it (the client's array on its mapping;
  the client says ``release`` when its array is gone).

When the last holder goes it is free again. A session that ends (a client
closed or died) drops every hold it had. Segment sizes come in four classes
per doubling (a 70 MiB tensor gets an 80 MiB segment), from 64 KiB; the
pool's total never exceeds its limit (``shm_pool_bytes``): it first closes
free segments (least recently used first) and then refuses.

Payload copies: a client's send, 1 (its array into a lent segment); the
daemon, 0 for a tensor already on a segment (a local send, or a receive from
a peer into a segment), else 1; the receiving client, 0 (its array is a view
on the segment).

This module is the daemon's pool (:class:`Pool`) and both sides' mapping of
a descriptor (:func:`map_segment`, which checks the seals first).
"""

from __future__ import annotations

import collections
import fcntl
import math
import mmap
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import FailedPrecondition, InvalidArgument

__all__ = ["available", "size_class", "map_segment", "create_segment", "Pool", "Segment", "MIN_SEGMENT", "SEALS",
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


def _counted(mm: mmap.mmap) -> mmap.mmap:
    global _live
    with _live_lock:
        _live += 1

    def gone() -> None:
        global _live
        with _live_lock:
            _live -= 1

    weakref.finalize(mm, gone)
    return mm


def live_mappings() -> int:
    """Segment mappings this process holds right now."""
    return _live


def map_segment(fd: int, size: int) -> mmap.mmap:
    """Map a segment's descriptor (read and write, shared) after checking that its
    size is sealed and is ``size``: InvalidArgument otherwise. A mapping of a
    file that someone could shrink would fault when touched."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise InvalidArgument(f"descriptor {fd} is not a sealed memfd ({exc.strerror})") from None
    if seals & SEALS != SEALS:
        raise InvalidArgument(f"segment descriptor {fd} lacks the size seals (seals {seals:#x})")
    actual = os.fstat(fd).st_size
    if actual != size or size <= 0:
        raise InvalidArgument(f"segment descriptor {fd} holds {actual} bytes, {size} announced")
    return _counted(mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE))


class Segment:
    """One pooled segment (daemon side)."""

    __slots__ = ("id", "size", "fd", "mm", "refs", "lent_to", "held_by", "known", "used", "tensor", "__weakref__")

    def __init__(self, ident: int, size: int, fd: int, mm: mmap.mmap) -> None:
        self.id = ident
        self.size = size
        self.fd = fd
        self.mm = mm
        self.refs = 0
        self.lent_to: str | None = None  # the session writing its next send into it
        self.held_by: str | None = None  # the session holding a received array on it
        self.known: set[str] = set()  # sessions that have its descriptor
        self.used = 0.0  # when it last became free (least recently used go first)
        self.tensor = False  # the daemon's owner array on it is alive

    @property
    def free(self) -> bool:
        return self.refs == 0


def _close_segments(segments: dict[int, Segment]) -> None:
    for seg in list(segments.values()):
        try:
            seg.mm.close()
        except BufferError:
            pass  # an array still maps it; the mapping goes with the array
        try:
            os.close(seg.fd)
        except OSError:
            pass
    segments.clear()


class Pool:
    """The daemon's segments (thread-safe: the daemon's owner arrays may be
    dropped on any thread).

    ``limit``: most bytes of segments at once. ``on_retire(segment_id,
    sessions)`` is called (on whatever thread closes it) when a segment that
    sessions have mapped is closed, so they can unmap it too."""

    def __init__(self, limit: int, on_retire: Callable[[int, set[str]], None] | None = None) -> None:
        if not available():
            raise FailedPrecondition("this platform has no sealed memfds (Linux 3.17+)")
        self.limit = int(limit)
        self.on_retire = on_retire
        self._lock = threading.RLock()
        self._segments: dict[int, Segment] = {}
        self._free: dict[int, collections.OrderedDict[int, Segment]] = {}
        self._next = 0
        self.total = 0  # bytes of segments open
        self.created = 0  # segments ever made (reuse keeps this flat)
        self.reused = 0  # times a free segment was taken again
        self._owners: dict[int, int] = {}  # id(owner array) -> segment id
        self._closed = False
        # a pool dropped without close() still lets its descriptors go
        weakref.finalize(self, _close_segments, self._segments)

    # -- taking segments ---------------------------------------------------------

    def _take(self, nbytes: int) -> Segment | None:
        """A free segment for ``nbytes`` (now with one holder), or None at the limit."""
        size = size_class(nbytes)
        free = self._free.get(size)
        if free:
            _, seg = free.popitem(last=True)  # the most recently used: its pages are warm
            self.reused += 1
        else:
            if size > self.limit:
                return None
            if self.total + size > self.limit:
                self._close_free(self.total + size - self.limit)
            if self.total + size > self.limit:
                return None
            fd = create_segment(size)
            try:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                os.close(fd)
                raise
            self._next += 1
            seg = Segment(self._next, size, fd, mm)
            self._segments[seg.id] = seg
            self.total += size
            self.created += 1
        seg.refs = 1
        return seg

    def lend(self, nbytes: int, session: str) -> Segment | None:
        """A segment ``session`` may write a send of ``nbytes`` into, or None (the pool is full)."""
        with self._lock:
            seg = self._take(nbytes)
            if seg is not None:
                seg.lent_to = session
            return seg

    def array(self, shape: Any, dtype: Any) -> np.ndarray | None:
        """An array on a free segment, held by the daemon until its last view is
        gone: a receive buffer, or the copy of a tensor for a client. None if the
        pool is full."""
        dt = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * dt.itemsize
        with self._lock:
            seg = self._take(nbytes)
            if seg is None:
                return None
            owner = self._own(seg, nbytes)
        return owner.view(dt).reshape(shape)

    def _own(self, seg: Segment, nbytes: int) -> np.ndarray:
        owner = np.frombuffer(seg.mm, np.uint8, nbytes)
        seg.tensor = True
        self._owners[id(owner)] = seg.id
        weakref.finalize(owner, self._owner_gone, id(owner), seg.id)
        return owner

    def _owner_gone(self, key: int, seg_id: int) -> None:
        with self._lock:
            self._owners.pop(key, None)
            seg = self._segments.get(seg_id)
            if seg is not None:
                seg.tensor = False
                self._drop(seg)

    def produced(self, seg_id: int, session: str, nbytes: int, dtype: Any, shape: Any) -> np.ndarray:
        """The daemon's array on segment ``seg_id``, which ``session`` was lent and
        has written a send into; the session's hold passes to the array.
        InvalidArgument if the session was not lent that segment or it is too small."""
        return self._to_table(seg_id, session, nbytes, dtype, shape, lent=True)

    def given_back(self, seg_id: int, session: str, nbytes: int, dtype: Any, shape: Any) -> np.ndarray:
        """The daemon's array on segment ``seg_id``, which was handed to ``session``
        (a received tensor whose recv gave up): the session's hold passes to the
        array. InvalidArgument if the session does not hold it or sizes disagree."""
        return self._to_table(seg_id, session, nbytes, dtype, shape, lent=False)

    def _to_table(self, seg_id: int, session: str, nbytes: int, dtype: Any, shape: Any, lent: bool) -> np.ndarray:
        dt = np.dtype(dtype)
        dims = tuple(int(d) for d in shape)
        if math.prod(dims) * dt.itemsize != nbytes:
            raise InvalidArgument(f"{dt} {dims} needs {math.prod(dims) * dt.itemsize} bytes; {nbytes} announced")
        with self._lock:
            seg = self._segments.get(seg_id)
            if seg is None or (seg.lent_to if lent else seg.held_by) != session:
                raise InvalidArgument(
                    f"segment {seg_id} is not lent to this client (a shared-memory send names a segment the "
                    "daemon lent it)" if lent else
                    f"segment {seg_id} is not held by this client (a returned tensor names the segment it was "
                    "handed)")
            if not 0 < nbytes <= seg.size:
                raise InvalidArgument(f"segment {seg_id} holds {seg.size} bytes; {nbytes} announced")
            if lent:
                seg.lent_to = None
            else:
                seg.held_by = None
            owner = self._own(seg, nbytes)  # the array's hold replaces the session's
        return owner.view(dt).reshape(dims)

    def segment_of(self, arr: np.ndarray) -> Segment | None:
        """The segment ``arr`` covers from its first byte, if it is a daemon array on
        one (C-contiguous, starting at offset 0)."""
        base = arr.base
        if base is None or not arr.flags.c_contiguous:
            return None
        with self._lock:
            seg_id = self._owners.get(id(base))
            seg = self._segments.get(seg_id) if seg_id is not None else None
            if seg is None or base.ctypes.data != arr.ctypes.data:
                return None
            return seg

    def hand_to(self, seg: Segment, session: str) -> None:
        """``session`` now holds a received array on ``seg`` (until it releases it)."""
        with self._lock:
            if seg.held_by is not None:
                raise FailedPrecondition(f"segment {seg.id} is already held by a client")
            seg.refs += 1
            seg.held_by = session

    def mark_known(self, seg: Segment, session: str) -> bool:
        """Note that ``session`` has (or is about to get) the descriptor; False if it already had it."""
        with self._lock:
            if session in seg.known:
                return False
            seg.known.add(session)
            return True

    # -- giving back --------------------------------------------------------------

    def release(self, seg_id: int, session: str) -> bool:
        """``session`` is done with segment ``seg_id`` (lent or held); False if it
        had no hold on it (the call changes nothing then)."""
        with self._lock:
            seg = self._segments.get(seg_id)
            if seg is None:
                return False
            if seg.held_by == session:
                seg.held_by = None
            elif seg.lent_to == session:
                seg.lent_to = None
            else:
                return False
            self._drop(seg)
            return True

    def session_gone(self, session: str) -> int:
        """Drop every hold of a session that ended; how many."""
        n = 0
        with self._lock:
            for seg in list(self._segments.values()):
                seg.known.discard(session)
                if seg.held_by == session:
                    seg.held_by = None
                    self._drop(seg)
                    n += 1
                elif seg.lent_to == session:
                    seg.lent_to = None
                    self._drop(seg)
                    n += 1
        return n

    def _drop(self, seg: Segment) -> None:
        seg.refs -= 1
        if seg.refs > 0:
            return
        seg.refs = 0
        seg.used = time.monotonic()
        if self._closed or self.total > self.limit:
            self._close(seg)
        else:
            self._free.setdefault(seg.size, collections.OrderedDict())[seg.id] = seg

    # -- closing ------------------------------------------------------------------

    def _close_free(self, need: int) -> None:
        candidates = sorted((s for free in self._free.values() for s in free.values()), key=lambda s: s.used)
        for seg in candidates:
            if need <= 0:
                break
            self._free[seg.size].pop(seg.id, None)
            self._close(seg)
            need -= seg.size

    def _close(self, seg: Segment) -> None:
        self._segments.pop(seg.id, None)
        free = self._free.get(seg.size)
        if free is not None:
            free.pop(seg.id, None)
            if not free:
                del self._free[seg.size]
        self.total -= seg.size
        try:
            seg.mm.close()
        except BufferError:
            pass  # an array still maps it (cannot happen for a free one); it goes with the array
        os.close(seg.fd)
        if seg.known and self.on_retire is not None:
            self.on_retire(seg.id, set(seg.known))
        seg.known.clear()

    def set_limit(self, limit: int) -> None:
        with self._lock:
            self.limit = int(limit)
            if self.total > self.limit:
                self._close_free(self.total - self.limit)

    def close(self) -> None:
        """Close every free segment now and every other one when its last holder goes."""
        with self._lock:
            self._closed = True
            self._close_free(self.total + 1)

    def stats(self) -> dict[str, int]:
        with self._lock:
            free = sum(s.size for f in self._free.values() for s in f.values())
            return {"segments": len(self._segments), "bytes": self.total, "free_bytes": free,
                    "held": sum(1 for s in self._segments.values() if s.held_by is not None),
                    "lent": sum(1 for s in self._segments.values() if s.lent_to is not None),
                    "in_table": sum(1 for s in self._segments.values() if s.tensor),
                    "created": self.created, "reused": self.reused, "limit": self.limit}

    def get(self, seg_id: int) -> Segment | None:
        with self._lock:
            return self._segments.get(seg_id)
