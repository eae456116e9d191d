"""What both ends of a CUDA IPC transfer share, whoever they are (two rank
servers, a local client and its daemon): the node a process is on
(:func:`node_id`), and the allocations of other processes opened here
(:class:`OpenedHandles`)."""

from __future__ import annotations

import collections
from typing import Any

from .backend import DeviceBackend

__all__ = ["node_id", "OpenedHandles", "OPENED"]

#: opened allocations kept per process (the least recently used is closed past this)
OPENED = 256


def node_id() -> bytes:
    """This node: its kernel's boot id (processes of one node share it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read().strip()
    except OSError:
        return b""


class OpenedHandles:
    """Memory handles of other processes opened here, one per (backend, handle)
    and kept open, as the CUDA caching allocators expect (an allocation is
    exported again and again under the same handle); the least recently used
    is closed past ``limit``. ``opens`` counts handles opened."""

    def __init__(self, limit: int = OPENED) -> None:
        self.limit = limit
        self.opens = 0
        self._opened: collections.OrderedDict[tuple[DeviceBackend, bytes], Any] = collections.OrderedDict()

    def open(self, backend: DeviceBackend, memory: bytes, device: int) -> Any:
        """The allocation ``memory`` names, opened on ``device`` (or found open);
        raises what :meth:`DeviceBackend.ipc_open` raises."""
        key = (backend, memory)
        opened = self._opened.get(key)
        if opened is not None:
            self._opened.move_to_end(key)
            return opened
        opened = self._opened[key] = backend.ipc_open(memory, device)
        self.opens += 1
        while len(self._opened) > self.limit:
            (old, _), gone = self._opened.popitem(last=False)
            old.ipc_close(gone)
        return opened

    def close(self) -> None:
        while self._opened:
            (backend, _), opened = self._opened.popitem()
            backend.ipc_close(opened)
