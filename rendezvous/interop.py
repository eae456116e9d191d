"""Received tensors handed over in another framework's type, without a copy.

``recv(..., framework="torch")`` gives a ``torch.Tensor`` that shares the
received buffer: a numpy array through ``torch.from_numpy`` (CPU), a cupy
array through DLPack (its GPU, its stream order kept by the producer's ready
event). torch has no read-only tensors, so the one copy made is of a tensor
received read-only: a small one read straight out of its reply message
(below one frame, ``chunk_bytes``), or one its sender made read-only; and of
one whose memory is not aligned to its dtype (torch would read it wrongly).
torch is imported only when asked for. Strings (``DT_STRING``, object
arrays of bytes) have no torch form and are refused before the tensor is
taken, so a refused recv consumes nothing.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from collections.abc import Callable

from .errors import FailedPrecondition, InvalidArgument
from .items import Received

__all__ = ["FRAMEWORKS", "check_framework", "convert", "hand_over"]

#: what ``recv(framework=...)`` accepts: None (numpy on the host, cupy on a GPU)
#: or "numpy" (the same), or "torch"
FRAMEWORKS = (None, "numpy", "torch")


def check_framework(framework: str | None) -> None:
    """Refuse an unknown framework, or torch where it cannot be imported, before
    anything is received."""
    if framework not in FRAMEWORKS:
        raise InvalidArgument(f"framework must be one of {', '.join(repr(f) for f in FRAMEWORKS)}, "
                              f"got {framework!r}")
    if framework == "torch":
        _torch()


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise FailedPrecondition(f"recv(framework='torch') needs torch, which cannot be imported: {exc}") from None
    return torch


def convertible(value: Any, framework: str | None) -> None:
    """Raise InvalidArgument if ``value`` has no form in ``framework``."""
    if framework == "torch" and isinstance(value, np.ndarray) and value.dtype.kind in "OSU":
        raise InvalidArgument("a string tensor (DT_STRING) has no torch form; recv it without framework='torch'")


def convert(value: Any, framework: str | None) -> Any:
    """``value`` (numpy, cupy or None for a dead tensor) as ``framework`` asks,
    sharing its memory."""
    if framework in (None, "numpy") or value is None:
        return value
    torch = _torch()
    if type(value) is np.ndarray:
        if not value.flags.writeable or not value.flags.aligned:
            # torch has no read-only tensors: it would warn, and a write through
            # the tensor would change memory the sender's table may share. Nor
            # does it read data misaligned for its dtype correctly.
            value = value.copy()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(value) if value.dtype != _bfloat16() else _from_bf16(torch, value)
    return torch.from_dlpack(value)  # a GPU array (cupy): DLPack, on its device


def _bfloat16() -> Any:
    try:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    except ImportError:
        return None


def _from_bf16(torch: Any, value: np.ndarray) -> Any:
    """numpy has no native bfloat16 torch knows: share the bits as int16 and view them."""
    return torch.from_numpy(value.view(np.int16)).view(torch.bfloat16)


def hand_over(items: list[Received], framework: str | None,
              give_back: Callable[[list[Received]], None]) -> list[Received]:
    """Received ``items`` in ``framework``'s form, sharing their memory. If one
    has no such form, all of them go to ``give_back`` (for the next recv of
    their keys) before the error is raised: nothing is lost."""
    if framework in (None, "numpy"):
        return items
    try:
        for item in items:
            convertible(item.value, framework)
    except BaseException:
        give_back(items)
        raise
    return [Received(convert(item.value, framework), item.is_dead) for item in items]

