"""Waiting for processes that are not our children to exit, on the exit itself.

``os.pidfd_open`` gives a descriptor that becomes readable when its process
exits (Linux 5.3+), whoever its parent is: the wait is a ``select`` on those
descriptors with a deadline, never a sleep between looks.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Iterable


def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait until every process in ``pids`` has exited, at most ``timeout``
    seconds; the pids still running then (empty: all gone)."""
    fds: dict[int, int] = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            pass  # gone already
    deadline = time.monotonic() + timeout
    try:
        while fds:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select(list(fds), [], [], left)
            for fd in ready:
                os.close(fd)
                del fds[fd]
        return sorted(fds.values())
    finally:
        for fd in fds:
            os.close(fd)
