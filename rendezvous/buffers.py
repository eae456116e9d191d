"""Receive buffers, reused once the arrays in them are dropped.

A fresh receive buffer costs a page fault and a zeroed page for every 4 KiB
of it when the bytes land. glibc's malloc gives a tensor of 32 MiB or more
fresh pages every time (``mmap``), and in a server it often does for smaller
ones too: memory freed by one thread's arrays is trimmed back to the kernel,
or sits in another thread's arena. Measured on ResNet-50's 161 tensors
received step after step: 8,264 page faults per step (33 MiB) with only 32
MiB and up reused, 4 with 256 KiB and up, and the step 47-50 ms against
31-38 ms. A consumer that receives the same shapes step after step (a
training job) would pay that at every recv. This cache keeps those buffers
instead: a recv of ``n`` bytes (at least ``min_bytes``, 256 KiB) takes a
cached buffer of exactly ``n`` bytes that no array refers to any more, or
allocates one. Smaller tensors travel packed (group replies, fusion
buffers) and are views on those.

The arrays handed out are ordinary numpy arrays whose ``base`` is the cached
buffer; a buffer counts as in use while any array, view or buffer export
refers to it (its reference count says so), so nothing the caller still
holds is ever written. At most ``limit`` bytes of buffers are tracked; beyond
that, receives get plain ``numpy.empty`` arrays, so the memory kept after the
arrays are dropped never exceeds ``limit`` (``recv_cache_bytes``; 0 turns the
cache off). Each rank server owns one (``aio.Server.buffers``) and hands it to
whatever receives for it (the inline plane's assemblies, the MPI plane's
receives); it is used from any thread.
"""

from __future__ import annotations

import math
import sys
import threading
from typing import Any

import numpy as np

__all__ = ["RecvBuffers", "MIN_BYTES", "size_class"]

#: smaller buffers are not kept (smaller tensors mostly travel packed, and are views on those)
MIN_BYTES = 256 << 10


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to one of eight sizes per power of two (at most
    12.5 % more): tensors of nearly the same size reuse one another's buffers."""
    step = 1 << max(0, nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


class RecvBuffers:
    def __init__(self, limit: int = 1 << 30, min_bytes: int = MIN_BYTES) -> None:
        self.limit = limit
        self.min_bytes = min_bytes
        self._lock = threading.Lock()
        self._slabs: dict[int, list[np.ndarray]] = {}
        self._tracked = 0
        self.reused = 0  # allocations avoided (for tests and the benchmark's notes)

    def empty(self, shape: Any, dtype: Any) -> np.ndarray:
        """An uninitialized C-contiguous array, like ``numpy.empty(shape, dtype)``."""
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape) if isinstance(shape, (tuple, list)) else (int(shape),)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.min_bytes or nbytes > self.limit or dtype.hasobject or nbytes == 0:
            return np.empty(shape, dtype)
        size = size_class(nbytes)  # sizes that differ a little share buffers
        with self._lock:
            slabs = self._slabs.setdefault(size, [])
            for i in range(len(slabs)):
                # references: the list's, and getrefcount's argument; any more is an array in use
                if sys.getrefcount(slabs[i]) <= _FREE_REFS:
                    slab = slabs.pop(i)
                    slabs.append(slab)  # most recently used last
                    self.reused += 1
                    return slab[:nbytes].view(dtype).reshape(shape)
            if self._tracked + size > self.limit:
                self._evict(self._tracked + size - self.limit)
            if self._tracked + size > self.limit:
                return np.empty(shape, dtype)  # the cache is full of buffers in use
            slab = np.empty(size, np.uint8)
            slabs.append(slab)
            self._tracked += size
            return slabs[-1][:nbytes].view(dtype).reshape(shape)

    def _evict(self, need: int) -> None:
        """Forget free buffers (oldest first) until ``need`` bytes are released."""
        for nbytes, slabs in list(self._slabs.items()):
            i = 0
            while i < len(slabs) and need > 0:
                if sys.getrefcount(slabs[i]) <= _FREE_REFS:
                    del slabs[i]
                    self._tracked -= nbytes
                    need -= nbytes
                else:
                    i += 1
            if not slabs:
                del self._slabs[nbytes]
            if need <= 0:
                return

    def set_limit(self, limit: int) -> None:
        with self._lock:
            self.limit = max(0, int(limit))
            if self._tracked > self.limit:
                self._evict(self._tracked - self.limit)

    def clear(self) -> None:
        """Forget every buffer (arrays still in use keep theirs alive)."""
        with self._lock:
            self._slabs.clear()
            self._tracked = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            free = sum(n for n, slabs in self._slabs.items() for s in slabs if sys.getrefcount(s) <= _FREE_REFS + 1)
            return {"tracked_bytes": self._tracked, "free_bytes": free, "reused": self.reused}


def _free_refs() -> int:
    probe: list[np.ndarray] = [np.empty(1, np.uint8)]
    return sys.getrefcount(probe[0])


_FREE_REFS = _free_refs()
