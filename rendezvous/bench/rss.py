"""Resident memory of this process, and its high-water mark since a reset.

Linux keeps the peak (``VmHWM`` in ``/proc/self/status``) and lets a process
reset it to the current RSS by writing ``5`` to ``/proc/self/clear_refs``, so
the peak of one transfer can be read without sampling. Elsewhere the RSS test
is skipped (``supported()`` is False).
"""

from __future__ import annotations

import re

__all__ = ["supported", "current", "peak", "reset_peak", "release_free_memory"]

_STATUS = "/proc/self/status"
_CLEAR = "/proc/self/clear_refs"


def _field(name: str) -> int:
    with open(_STATUS) as f:
        text = f.read()
    m = re.search(rf"^{name}:\s+(\d+) kB", text, re.MULTILINE)
    if m is None:
        raise OSError(f"{_STATUS} has no {name}")
    return int(m.group(1)) * 1024


def supported() -> bool:
    try:
        _field("VmHWM")
        with open(_CLEAR, "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def current() -> int:
    """Resident set size now, in bytes."""
    return _field("VmRSS")


def peak() -> int:
    """Highest resident set size since the last :func:`reset_peak` (or start), in bytes."""
    return _field("VmHWM")


def release_free_memory() -> None:
    """Hand memory that malloc keeps for reuse back to the system (glibc's
    ``malloc_trim``), so a baseline is not inflated by earlier transfers."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak() -> int:
    """Reset the high-water mark to the current RSS; returns that RSS in bytes."""
    with open(_CLEAR, "w") as f:
        f.write("5")
    return current()
