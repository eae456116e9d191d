"""The fake GPU with CUDA IPC: :class:`FakeIpcBackend`, for testing the IPC
plane's ordering rules across real processes without CUDA.

Each process of a test makes its own backend with the same ``node`` name: they
stand for the GPUs of one node (same UUIDs). Device memory is then shared
memory: every block lives in a memfd of its own, and a memory handle names
the exporting process and that memfd (``/proc/<pid>/fd/<fd>``), so another
process maps the very bytes. It fails where CUDA would give wrong data:

* a handle opened in the process that exported it raises, as
  ``cudaIpcOpenMemHandle`` does;
* an IPC event lives in a table of event slots in shared memory: the
  exporter's stream marks the slot once the tensor's ready event is done (a
  producer's kernel held at a gate holds the slot), and an importer's copy
  stream waits for the slot;
* each block has a generation in its memfd's first bytes, bumped when the
  block is freed (the caching allocator may hand it out again): a copy from
  an export whose block was freed since (the exporter let go of the tensor
  before the importer was done) fails and is recorded in
  :attr:`FakeIpcBackend.violations` of the importer, as data a real GPU would
  have read from reused memory;
* ``opened``, ``closed`` and ``exported`` count handles opened and closed
  here, and tensors exported; ``open_faults`` makes the next opens fail.

Event slots are reused round-robin (:data:`EVENT_SLOTS`): far more than a test
has exports in flight.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from typing import Any

import numpy as np

from rendezvous.devices import DeviceTensor

from .fakegpu import FakeBackend, FakeCudaError, FakeDeviceArray, _Block

__all__ = ["FakeIpcBackend", "EVENT_SLOTS"]

#: bytes before a block's memory in its memfd: the block's generation (uint64)
_HEADER = 64
#: IPC event slots per exporting process
EVENT_SLOTS = 1 << 16
_PENDING, _DONE = 0, 1
#: memory handle: exporter pid, memfd number, block address, block bytes
_MEMORY = struct.Struct("<qiQQ")
#: event handle: exporter pid, event table memfd, slot, the block's generation at export
_EVENT = struct.Struct("<qiIQ")


def _map(pid: int, fd: int, size: int) -> mmap.mmap:
    """Another process's memfd ``fd``, mapped here."""
    try:
        own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    except OSError as exc:
        raise FakeCudaError(f"cudaErrorInvalidResourceHandle: cannot open the exporter's memory ({exc})") from None
    try:
        return mmap.mmap(own, size)
    finally:
        os.close(own)


class _Opened:
    """An allocation of another process mapped here (what ``ipc_open`` returns)."""

    def __init__(self, pid: int, fd: int, address: int, nbytes: int) -> None:
        self.pid, self.address, self.nbytes = pid, address, nbytes
        self.map: mmap.mmap | None = _map(pid, fd, _HEADER + max(nbytes, 1))

    def generation(self) -> int:
        assert self.map is not None
        return struct.unpack_from("<Q", self.map, 0)[0]


class _RemoteEvent:
    """An IPC event as an importer's stream waits for it: a slot of the
    exporter's event table (polled: no signal crosses the processes)."""

    def __init__(self, table: mmap.mmap, slot: int) -> None:
        self._table, self._slot = table, slot

    def is_set(self) -> bool:
        return self._table[self._slot] == _DONE

    def wait(self, timeout: float | None = None) -> bool:
        stop = threading.Event()
        while not self.is_set():
            stop.wait(0.0005)
        return True


class FakeIpcBackend(FakeBackend):
    """A :class:`FakeBackend` whose device memory other processes of the same
    ``node`` can open by IPC handles."""

    name = "fake-ipc"

    def __init__(self, node: str = "fake-node", devices: int = 2, peer: set[tuple[int, int]] | None = None) -> None:
        super().__init__(devices, peer)
        self.node = node
        self._shared: dict[int, tuple[int, mmap.mmap]] = {}  # block address -> its memfd and map
        self._events_fd = os.memfd_create("fakegpu-ipc-events")
        os.ftruncate(self._events_fd, EVENT_SLOTS)
        self._events = mmap.mmap(self._events_fd, EVENT_SLOTS)
        self._next_slot = 0
        self._tables: dict[tuple[int, int], mmap.mmap] = {}  # (pid, fd) -> another exporter's event table
        self.exported = 0
        self.opened = 0
        self.closed = 0
        #: errors the next ``ipc_open`` calls raise, in order (a handle that cannot be opened)
        self.open_faults: list[BaseException] = []

    def ipc_devices(self) -> dict[int, bytes]:
        return {i: f"{self.node}/GPU-{i}".encode() for i in range(self.devices)}

    # -- memory in memfds ---------------------------------------------------------

    def _alloc(self, nbytes: int, device: int) -> FakeDeviceArray:
        arr = super()._alloc(nbytes, device)
        block = arr._block
        with self._lock:
            if block.address not in self._shared:
                fd = os.memfd_create(f"fakegpu-{block.address:x}")
                os.ftruncate(fd, _HEADER + max(nbytes, 1))
                shared = mmap.mmap(fd, _HEADER + max(nbytes, 1))
                self._shared[block.address] = (fd, shared)
                block.storage = np.frombuffer(shared, np.uint8, count=max(nbytes, 1), offset=_HEADER)
        return arr

    def _release(self, block: _Block) -> None:
        with self._lock:
            shared = self._shared.get(block.address)
            if shared is not None:  # freed: what an importer reads now is not the export's
                generation = struct.unpack_from("<Q", shared[1], 0)[0]
                struct.pack_into("<Q", shared[1], 0, generation + 1)
        super()._release(block)

    # -- the IPC contract ---------------------------------------------------------

    def ipc_export(self, tensor: DeviceTensor) -> tuple[bytes, int, bytes, Any]:
        arr = tensor.array
        block = arr._block
        with self._lock:
            shared = self._shared.get(block.address)
            slot = self._next_slot
            self._next_slot = (slot + 1) % EVENT_SLOTS
            self.exported += 1
        if shared is None:
            raise FakeCudaError("cudaErrorInvalidValue: the memory is not the fake allocator's own")
        fd, mapped = shared
        generation = struct.unpack_from("<Q", mapped, 0)[0]
        events = self._events
        events[slot] = _PENDING
        stream = self.copy_stream(tensor.device, "ipc")
        stream.wait_event(tensor.ready)
        self._launch(stream, lambda: events.__setitem__(slot, _DONE), [block])
        return (_MEMORY.pack(os.getpid(), fd, block.address, block.nbytes), arr._offset,
                _EVENT.pack(os.getpid(), self._events_fd, slot, generation), None)

    def ipc_open(self, memory: bytes, device: int) -> _Opened:
        self._check_device(device)
        pid, fd, address, nbytes = _MEMORY.unpack(memory)
        if self.open_faults:
            raise self.open_faults.pop(0)
        if pid == os.getpid():
            raise FakeCudaError("cudaErrorInvalidContext: a memory handle cannot be opened by the process "
                                "that exported it")
        opened = _Opened(pid, fd, address, nbytes)
        with self._lock:
            self.opened += 1
        return opened

    def ipc_close(self, opened: Any) -> None:
        if opened.map is not None:
            opened.map.close()
            opened.map = None
            with self._lock:
                self.closed += 1

    def _table(self, pid: int, fd: int) -> mmap.mmap:
        with self._lock:
            table = self._tables.get((pid, fd))
            if table is None:
                table = self._tables[(pid, fd)] = _map(pid, fd, EVENT_SLOTS)
            return table

    def ipc_copy(self, opened: Any, offset: int, event: bytes, dst: Any, device: int, after: Any) -> Any:
        pid, events_fd, slot, generation = _EVENT.unpack(event)
        if opened.map is None:
            raise FakeCudaError("cudaErrorInvalidResourceHandle: the memory handle was closed")
        if pid != opened.pid or offset + dst.nbytes > opened.nbytes:
            raise FakeCudaError("cudaErrorInvalidValue: the copy is outside the opened allocation")
        stream = self.copy_stream(device, "peer")
        if after is not None:
            stream.wait_event(after)
        stream.wait_event(_RemoteEvent(self._table(pid, events_fd), slot))
        source = opened.map
        start = _HEADER + offset
        d_raw = dst._block.storage[dst._offset:dst._offset + dst.nbytes]

        def copy() -> None:
            if opened.generation() != generation:
                self.violations.append(f"an IPC copy read block {opened.address:#x} of process {pid} after its "
                                       "exporter freed it (released too early)")
                raise FakeCudaError("the exported memory was freed before the copy read it")
            d_raw[:] = np.frombuffer(source, np.uint8, count=dst.nbytes, offset=start)
        return self._launch(stream, copy, [dst._block])
