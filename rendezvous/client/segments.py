"""A local client's side of its daemon's shared-memory pool: :class:`Segments`.

The segments a session has mapped (kept mapped for reuse until the daemon
retires them), the ones lent to it for its next sends (its stock), the arrays
it lent out on them (``Client.empty``: filled in place, handed over by a send
with no copy), and the received arrays it has let go of (told to the daemon as
RELEASE) or sent on. Shared by the blocking and the asyncio client.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from rendezvous.errors import InvalidArgument
from rendezvous.local.frames import FrameError, Kind, frame, pack_ids, unpack_grants, unpack_ids
from rendezvous.local.segments import Mapping, map_segment, size_class
from rendezvous.codec.tensors import TensorMeta

__all__ = ["Segments"]


class Segments:
    """A session client's side of the pool: the segments it has mapped (kept
    mapped for reuse, until the daemon retires them) and the ones lent to it for
    its next sends (its stock). Thread-safe."""

    def __init__(self, on_release: Callable[[], None]) -> None:
        self._maps: dict[int, Mapping] = {}
        self._stock: dict[int, list[int]] = {}  # size -> lent segment ids
        self._sizes: dict[int, int] = {}
        self._fds: collections.deque[int] = collections.deque()
        self._released: list[int] = []
        self._notes: list[bytes] = []
        #: id(the array owning a lent segment's bytes) -> (segment, the array lent out)
        self._loans: dict[int, tuple[int, weakref.ref[np.ndarray]]] = {}
        #: id(the array owning a received segment's bytes) -> (segment, its release)
        self._views: dict[int, tuple[int, weakref.finalize[..., Any]]] = {}
        # re-entrant: a finalizer (a received array going) may run inside any of these methods
        self._lock = threading.RLock()
        self._on_release = on_release  # a release is waiting to be told
        self.closed = False

    def got_fds(self, fds: list[int]) -> None:
        self._fds.extend(fds)

    def introduce(self, body: bytes | memoryview) -> None:
        """A SEGMENTS frame: map each granted segment with the next descriptor."""
        grants = unpack_grants(body)
        for seg_id, size in grants:
            if not self._fds:
                raise FrameError("a SEGMENTS frame came without its descriptors")
            fd = self._fds.popleft()
            try:
                mm = map_segment(fd, size)
            finally:
                os.close(fd)
            with self._lock:
                old = self._maps.pop(seg_id, None)
                self._maps[seg_id] = mm
                self._sizes[seg_id] = size
            if old is not None:
                old.close()

    def retire(self, body: bytes | memoryview) -> None:
        for seg_id in unpack_ids(body):
            with self._lock:
                mm = self._maps.pop(seg_id, None)
                size = self._sizes.pop(seg_id, 0)
                stock = self._stock.get(size)
                if stock and seg_id in stock:
                    stock.remove(seg_id)
            if mm is not None:
                mm.close()

    def lent(self, body: bytes | memoryview) -> None:
        """An OK frame's grants: segments lent for sends."""
        for seg_id, size in unpack_grants(body):
            with self._lock:
                if seg_id in self._maps:
                    self._stock.setdefault(size, []).append(seg_id)

    def take(self, nbytes: int) -> int | None:
        """A lent segment for ``nbytes`` (of its size class), or None."""
        with self._lock:
            stock = self._stock.get(size_class(nbytes))
            return stock.pop() if stock else None

    def restock(self, seg_id: int) -> None:
        """Segment ``seg_id``, taken for a send whose copy into it failed, back in the stock."""
        with self._lock:
            if seg_id in self._maps and not self.closed:
                self._stock.setdefault(self._sizes[seg_id], []).append(seg_id)

    def lend_array(self, seg_id: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An array on lent segment ``seg_id`` for the caller to fill: a send of it
        hands the segment over with no copy (:meth:`hand_over`). Dropped unsent,
        the segment goes back to the stock."""
        with self._lock:
            mm = self._maps[seg_id]
            size = self._sizes[seg_id]
        owner = np.frombuffer(mm.buffer, np.uint8, math.prod(shape) * dtype.itemsize)
        lent = owner.view(dtype).reshape(shape)
        key = id(owner)
        with self._lock:
            self._loans[key] = (seg_id, weakref.ref(lent))
        weakref.finalize(owner, self._loan_dropped, key, seg_id, size)
        return lent

    def _loan_dropped(self, key: int, seg_id: int, size: int) -> None:
        with self._lock:
            if self._loans.pop(key, None) is not None and not self.closed and seg_id in self._maps:
                self._stock.setdefault(size, []).append(seg_id)

    def on_pool(self, arr: np.ndarray) -> bool:
        """Whether ``arr`` lies on a segment lent out by :meth:`lend_array` or
        received: a send of it goes by :meth:`hand_over`, never packed inline."""
        key = id(arr.base)
        return key in self._loans or key in self._views

    def hand_over(self, arr: np.ndarray) -> int | None:
        """The segment under ``arr`` if a send may hand it over as it is: ``arr``
        covers a lent array's segment (or a received one's) from its first byte,
        C-contiguous. The segment is then no longer this client's (no release
        is told for it), and ``arr`` and the array lent become read-only: the
        bytes are the tensor's now. None: the send copies."""
        base = arr.base  # (an array on a segment has its owner array as base)
        if base is None or not self.on_pool(arr) or not arr.nbytes or not arr.flags.c_contiguous \
                or base.ctypes.data != arr.ctypes.data:
            return None
        key = id(base)
        with self._lock:
            loan = self._loans.pop(key, None)
            view = self._views.pop(key, None) if loan is None else None
        if loan is not None:
            seg_id, ref = loan
            lent = ref()
        elif view is not None:
            seg_id, release = view
            release.detach()  # sent on: the daemon's now, never released by this client
            lent = None
        else:
            return None
        for a in (arr, base, lent):
            if a is not None:
                a.flags.writeable = False
        return seg_id

    def write(self, seg_id: int, arr: np.ndarray) -> None:
        """Copy ``arr``'s bytes into segment ``seg_id`` (the send's one copy)."""
        np.copyto(self.target(seg_id, arr.nbytes), np.ascontiguousarray(arr).reshape(-1).view(np.uint8))

    def target(self, seg_id: int, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of segment ``seg_id``, lent to this client for a send, to write."""
        with self._lock:
            mm = self._maps[seg_id]
        return np.frombuffer(mm.buffer, np.uint8, nbytes)

    def view(self, seg_id: int, nbytes: int, meta: TensorMeta) -> np.ndarray:
        """The received tensor on segment ``seg_id``; released when it (and every
        view of it) is gone."""
        with self._lock:
            mm = self._maps.get(seg_id)
            size = self._sizes.get(seg_id, 0)
        if mm is None:
            raise InvalidArgument(f"the daemon named segment {seg_id}, which this client does not map")
        if meta.nbytes != nbytes or not 0 < nbytes <= size:
            raise InvalidArgument(f"segment {seg_id} of {size} bytes cannot hold {meta.dtype} {meta.shape} "
                                  f"({nbytes} bytes announced)")
        owner = np.frombuffer(mm.buffer, np.uint8, nbytes)
        key = id(owner)
        release = weakref.finalize(owner, self._released_one, seg_id, key)
        with self._lock:
            self._views[key] = (seg_id, release)
        return owner.view(meta.dtype).reshape(meta.shape)

    def _released_one(self, seg_id: int, key: int) -> None:
        with self._lock:
            self._views.pop(key, None)
            if self.closed:
                return
            self._released.append(seg_id)
        self._on_release()

    def note(self, data: bytes) -> None:
        """A frame with no answer (an IPC release) to go with the next RELEASE."""
        with self._lock:
            if self.closed:
                return
            self._notes.append(data)
        self._on_release()

    def drain_released(self) -> bytes:
        """A RELEASE frame for every segment let go since the last call (or b""),
        after the frames :meth:`note` was given."""
        if not self._released and not self._notes:  # (every write asks: most find nothing)
            return b""
        with self._lock:
            ids, self._released = self._released, []
            notes, self._notes = self._notes, []
        return b"".join(notes) + (frame(Kind.RELEASE, 0, pack_ids(ids)) if ids else b"")

    def close(self) -> None:
        with self._lock:
            self.closed = True
            maps, self._maps = self._maps, {}
            self._stock.clear()
            fds = list(self._fds)
            self._fds.clear()
        for fd in fds:
            os.close(fd)
        for mm in maps.values():
            mm.close()  # unmapped now, or with the last array on it
