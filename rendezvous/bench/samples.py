"""bench-daemon's tensors: each sample's distinct, stamped before the clock
starts and checked by the receiver after it stops; and the keys they go by."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["fill", "stamp_only", "verify", "key"]


def fill(arr: np.ndarray, stamp: int) -> None:
    """Make ``arr`` (uint8, 1-D) sample ``stamp``'s tensor."""
    arr.fill(stamp % 251 + 1)
    if arr.nbytes >= 16:
        arr[:8].view(np.uint64)[0] = stamp
        arr[-8:].view(np.uint64)[0] = stamp


def stamp_only(arr: np.ndarray, stamp: int) -> None:
    """Stamp ``arr`` (uint8, 1-D) as sample ``stamp``'s tensor in its first and
    last bytes only (a lent array: its pages were written in an earlier round)."""
    if arr.nbytes >= 16:
        arr[:8].view(np.uint64)[0] = stamp
        arr[-8:].view(np.uint64)[0] = stamp
    else:
        arr.fill(stamp % 251 + 1)


def verify(x: Any, size: int, stamp: int, stamps_only: bool = False) -> None:
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or x.nbytes != size:
        raise AssertionError(f"wrong tensor for sample {stamp}: "
                             f"{getattr(x, 'dtype', type(x))} of {getattr(x, 'nbytes', '?')} bytes, "
                             f"expected uint8 of {size}")
    flat = x.reshape(-1)
    fill = stamp % 251 + 1
    if size >= 16:
        head, tail = int(flat[:8].view(np.uint64)[0]), int(flat[-8:].view(np.uint64)[0])
        if head != stamp or tail != stamp:
            raise AssertionError(f"wrong data: sample {stamp} arrived stamped {head} (first bytes) and "
                                 f"{tail} (last bytes)")
        if stamps_only:
            return
        probes = np.random.default_rng(stamp).integers(8, size - 8, 32) if size > 16 else np.array([], int)
        bad = [int(i) for i in probes if flat[i] != fill]
    else:
        bad = [int(i) for i in np.nonzero(flat != fill)[0][:4]]
    if bad:
        raise AssertionError(f"wrong data: sample {stamp} byte {bad[0]} is {int(flat[bad[0]])}, expected {fill}")


def key(name: str, src: int = 0, dst: int = 0) -> str:
    """The key of tensor ``name`` from task ``src`` to task ``dst`` of job ``node``."""
    return (f"/job:node/replica:0/task:{src}/device:CPU:0;0000000000000000;"
            f"/job:node/replica:0/task:{dst}/device:CPU:1;{name};0:0")
