"""Allocator tuning for the frame buffers of chunked replies."""

from __future__ import annotations

import numpy as np

__all__ = ["prime_allocator"]

# glibc's malloc maps a block above its mmap threshold (128 KiB at start)
# and, when such a block is freed, raises the threshold to its size and the
# heap trim threshold to twice that. Every frame of a chunked reply is two
# chunk-sized blocks at once (our joined message and gRPC's copy of it), so
# after the first frame the trim threshold is exactly what two frames free:
# each frame then shrinks the heap and grows it again, and its pages are
# faulted in and zeroed anew (on a 2-core VM that tripled the time of a
# 1 MiB recv). One block a few chunks large, allocated and freed untouched
# when the first stream opens, sets the thresholds above that. Its only
# lasting effect is that up to twice its size of freed heap is kept for reuse.
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc adapts the threshold only up to this
_primed = 0


def prime_allocator(chunk_bytes: int) -> None:
    """Make the allocator keep chunk-sized frame buffers for reuse (see above).
    Cheap: the block is never touched. Idempotent per size. The thresholds are
    the process's (glibc has one heap policy), so this is a process-wide
    setting by nature: a rank server applies it once when it starts."""
    global _primed
    size = min(8 * chunk_bytes, _MMAP_THRESHOLD_MAX - (64 << 10))
    if size <= _primed:
        return
    _primed = size
    np.empty(size, np.uint8)  # mapped, then unmapped at once: only the thresholds change
