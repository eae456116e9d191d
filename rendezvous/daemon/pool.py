"""The daemon's pool of shared-memory segments for its local clients.

The daemon (``rendezvousd``) owns every segment (:mod:`rendezvous.local.segments`)
and reuses them: both sides keep their mappings, so a reused segment costs
no new pages, zeroing or page faults. A segment carries one tensor at a time.
Its life, counted in holders (``Segment.refs``):

* **free** in the pool (no holder);
* **lent** to a client session to write its next send into (the session);
* **in the table**: the daemon's array on it (an owner array whose
  finalizer drops the hold when the last view of it is gone: consumed,
  dropped, or done being served to a peer);
* **held** by a client that received it (the client's array on its mapping;
  the client says ``release`` when its array is gone).

When the last holder goes it is free again. A session that ends (a client
closed or died) drops every hold it had. The pool's total never exceeds
its byte limit (``shm_pool_bytes``) nor its count of segments (one
descriptor each): it first closes free segments (least recently used
first) and then refuses.

Payload copies: a client's send, 1 (its array into a lent segment); the
daemon, 0 for a tensor already on a segment (a local send, or a receive from
a peer into a segment), else 1; the receiving client, 0 (its array is a view
on the segment).

One class of about 300 lines: every segment's state changes under the
pool's one lock, and its holds, limits and free lists are one invariant.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from rendezvous.errors import FailedPrecondition, InvalidArgument
from rendezvous.local.segments import Mapping, available, create_segment, size_class

__all__ = ["Pool", "Segment"]


class Segment:
    """One pooled segment (daemon side)."""

    __slots__ = ("id", "size", "fd", "mm", "refs", "lent_to", "held_by", "known", "used", "tensor", "__weakref__")

    def __init__(self, ident: int, size: int, fd: int, mm: Mapping) -> None:
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
        seg.mm.close()  # unmapped now, or with the last array on it
        try:
            os.close(seg.fd)
        except OSError:
            pass
    segments.clear()


class Pool:
    """The daemon's segments (thread-safe: the daemon's owner arrays may be
    dropped on any thread).

    Bounds: ``limit`` bytes of segments at once; ``max_segments`` segments at
    once (each holds one descriptor of the daemon's); at most ``max_free`` of
    them kept free for reuse (the least recently used beyond that are closed,
    so what a burst of lends opened goes back once it is over). Segments
    held by one session (lent to it, or received by it) are counted:
    :meth:`holds`. ``on_retire(segment_id, sessions)`` is called (on whatever
    thread closes it) when a segment that sessions have mapped is closed, so
    they can unmap it too."""

    def __init__(self, limit: int, on_retire: Callable[[int, set[str]], None] | None = None, *,
                 max_segments: int = 1 << 16, max_free: int = 64) -> None:
        if not available():
            raise FailedPrecondition("this platform has no sealed memfds (Linux 3.17+)")
        self.limit = int(limit)
        self.max_segments = max(1, int(max_segments))
        self.max_free = max(0, int(max_free))
        self._holds: collections.Counter[str] = collections.Counter()  # session -> segments lent or held
        self.on_retire = on_retire
        self._lock = threading.RLock()
        self._segments: dict[int, Segment] = {}
        self._free: dict[int, collections.OrderedDict[int, Segment]] = {}
        self._n_free = 0
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
            self._n_free -= 1
            if not free:
                del self._free[size]
            self.reused += 1
        else:
            if size > self.limit:
                return None
            if self.total + size > self.limit:
                self._close_free(self.total + size - self.limit)
            if len(self._segments) >= self.max_segments:
                self._close_free(1, count=True)  # a free one of another size makes room
            if self.total + size > self.limit or len(self._segments) >= self.max_segments:
                return None
            fd = create_segment(size)
            try:
                mm = Mapping(fd, size)  # the segment's one descriptor is fd
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
                self._holds[session] += 1
            return seg

    def holds(self, session: str) -> int:
        """Segments ``session`` holds now: lent to it and not sent, or received by
        it and not released."""
        with self._lock:
            return self._holds.get(session, 0)

    def _unhold(self, session: str) -> None:
        left = self._holds[session] - 1
        if left > 0:
            self._holds[session] = left
        else:
            self._holds.pop(session, None)

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
        owner = np.frombuffer(seg.mm.buffer, np.uint8, nbytes)
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

    def sent_on(self, seg_id: int, session: str, nbytes: int, dtype: Any, shape: Any) -> np.ndarray:
        """A pooled send's array: :meth:`produced` for a segment lent to ``session``
        (written by it, or lent out as an array and filled), :meth:`given_back`
        for one it holds (a tensor it received, sent on as it is)."""
        with self._lock:
            seg = self._segments.get(seg_id)
            held = seg is not None and seg.lent_to != session and seg.held_by == session
        return self._to_table(seg_id, session, nbytes, dtype, shape, lent=not held)

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
            self._unhold(session)
            owner = self._own(seg, nbytes)  # the array's hold replaces the session's
        return owner.view(dt).reshape(dims)

    def segment_of(self, arr: np.ndarray, whole: bool = False) -> Segment | None:
        """The segment ``arr`` covers from its first byte, if it is a daemon array on
        one (C-contiguous, starting at offset 0); with ``whole``, only if ``arr`` is
        all the daemon's array there holds (a tensor sent on its segment, not the
        first of a group's)."""
        base = arr.base
        if base is None or not arr.flags.c_contiguous:
            return None
        with self._lock:
            seg_id = self._owners.get(id(base))
            seg = self._segments.get(seg_id) if seg_id is not None else None
            if seg is None or base.ctypes.data != arr.ctypes.data or (whole and base.nbytes != arr.nbytes):
                return None
            return seg

    def hand_to(self, seg: Segment, session: str) -> None:
        """``session`` now holds a received array on ``seg`` (until it releases it)."""
        with self._lock:
            if seg.held_by is not None:
                raise FailedPrecondition(f"segment {seg.id} is already held by a client")
            seg.refs += 1
            seg.held_by = session
            self._holds[session] += 1

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
            self._unhold(session)
            self._drop(seg)
            return True

    def session_gone(self, session: str) -> int:
        """Drop every hold of a session that ended; how many."""
        n = 0
        with self._lock:
            self._holds.pop(session, None)
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
            return
        self._free.setdefault(seg.size, collections.OrderedDict())[seg.id] = seg
        self._n_free += 1
        if self._n_free > self.max_free:
            self._close_free(self._n_free - self.max_free, count=True)

    # -- closing ------------------------------------------------------------------

    def _close_free(self, need: int, count: bool = False) -> None:
        """Close free segments, least recently used first: ``need`` bytes of them,
        or ``need`` of them with ``count``."""
        candidates = sorted((s for free in self._free.values() for s in free.values()), key=lambda s: s.used)
        for seg in candidates:
            if need <= 0:
                break
            self._close(seg)
            need -= 1 if count else seg.size

    def _close(self, seg: Segment) -> None:
        self._segments.pop(seg.id, None)
        free = self._free.get(seg.size)
        if free is not None:
            if free.pop(seg.id, None) is not None:
                self._n_free -= 1
            if not free:
                del self._free[seg.size]
        self.total -= seg.size
        seg.mm.close()  # unmapped now (a free segment has no array), or with its last array
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
                    "created": self.created, "reused": self.reused, "limit": self.limit,
                    "free": self._n_free, "max_segments": self.max_segments}

    def get(self, seg_id: int) -> Segment | None:
        with self._lock:
            return self._segments.get(seg_id)
