"""A chunked reply's tensor, put together from its first frame and its chunks:
the consumer's one copy of the payload, into a buffer allocated when the first
frame announces dtype and shape."""

from __future__ import annotations

import numpy as np

from ..buffers import RecvBuffers
from ..errors import InvalidArgument
from .tensors import TensorMeta

__all__ = ["Assembly"]


class Assembly:
    """Reassembles one reply's tensor from a first frame and its chunks."""

    __slots__ = ("meta", "dest", "filled")

    def __init__(self, meta: TensorMeta, first: memoryview, buffers: RecvBuffers | None = None) -> None:
        self.meta = meta
        # from the receive cache: a large one is reused once dropped
        try:
            self.dest = buffers.empty(meta.nbytes, np.uint8) if buffers is not None \
                else np.empty(meta.nbytes, np.uint8)
        except MemoryError:
            from ..errors import ResourceExhausted

            raise ResourceExhausted(f"cannot allocate the {meta.nbytes} bytes a reply announces") from None
        self.filled = 0
        self.add(first)

    def add(self, part: memoryview) -> bool:
        """Copy the next part in (the consumer's one copy); True when complete."""
        n = len(part)
        if self.filled + n > self.meta.nbytes:
            raise InvalidArgument(
                f"reply carries more than the {self.meta.nbytes} bytes its dtype and shape announce")
        self.dest[self.filled:self.filled + n] = np.frombuffer(part, dtype=np.uint8)
        self.filled += n
        return self.filled == self.meta.nbytes

    def result(self) -> np.ndarray:
        return self.dest.view(self.meta.dtype).reshape(self.meta.shape)
