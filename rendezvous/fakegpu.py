"""A GPU backend in host memory, for testing without CUDA.

:class:`FakeBackend` implements :class:`rendezvous.devices.DeviceBackend`
with host memory standing in for device memory and threads standing in for
CUDA streams, so everything above the backend (placement, the staging
pipelines over real MPI, stream synchronization before MPI, pinned-buffer
reuse, the default path's host copies) runs and is tested on machines
without a GPU. What it cannot test is cupy and CUDA themselves.

    import rendezvous
    from rendezvous.devices import Devices
    from rendezvous.fakegpu import FakeBackend
    fake = FakeBackend()
    server = rendezvous.Server(cluster, "worker", 0, devices=Devices([fake]))  # GPU placements use it
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from typing import Any

import numpy as np

from .buffers import RecvBuffers
from .devices import DeviceBackend, DeviceTensor
from .errors import FailedPrecondition
from .tensors import TensorMeta

__all__ = ["FakeBackend", "FakeDeviceArray"]


class _FakeStream:
    """An in-order queue of work on its own thread, like a CUDA stream."""

    def __init__(self, name: str) -> None:
        self._q: Any = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            fn, event = self._q.get()
            fn()
            event.set()

    def enqueue(self, fn: Any) -> threading.Event:
        event = threading.Event()
        self._q.put((fn, event))
        return event

    def wait_event(self, event: threading.Event) -> None:
        self.enqueue(event.wait)


class FakeDeviceArray:
    """Host memory standing in for a GPU array: it exports no buffer, DLPack or CUDA
    array interface, so nothing but :class:`FakeBackend` can read it; ``get()``
    copies it out as cupy's does."""

    def __init__(self, data: np.ndarray, device: int) -> None:
        self._data = np.ascontiguousarray(data)
        self.device = device

    @property
    def dtype(self) -> np.dtype:
        return self._data.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self._data.shape

    def get(self) -> np.ndarray:
        return self._data.copy()

    def __repr__(self) -> str:
        return f"FakeDeviceArray(GPU:{self.device}, {self.dtype}{list(self.shape)})"


class FakeBackend(DeviceBackend):
    """A GPU backend in host memory, for testing staging and placement without CUDA.

    Each device has a user stream (``stream(device)``: what a producer's kernels
    would run on) and a copy stream; both run their work in order on a thread of
    their own, so copies are really asynchronous and an event is only done once
    its work has run. ``pinned_allocs`` and ``copies`` count what happened."""

    name = "fake"

    def __init__(self, devices: int = 1) -> None:
        self.devices = devices
        self._user: dict[int, _FakeStream] = defaultdict(lambda: _FakeStream("fake-gpu-user"))
        self._copy: dict[int, _FakeStream] = defaultdict(lambda: _FakeStream("fake-gpu-copy"))
        self.pinned_allocs = 0
        self.copies = {"d2h": 0, "h2d": 0}
        self._memory = RecvBuffers()  # "device memory": large buffers reused, as cupy's pool does

    def stream(self, device: int = 0) -> _FakeStream:
        return self._user[device]

    def array(self, data: np.ndarray, device: int = 0) -> FakeDeviceArray:
        return FakeDeviceArray(np.array(data), device)

    def recognizes(self, obj: Any) -> bool:
        return isinstance(obj, FakeDeviceArray)

    def available(self) -> bool:
        return self.devices > 0

    def wrap(self, obj: Any) -> DeviceTensor:
        return DeviceTensor(obj, self, obj.device, self._user[obj.device].enqueue(lambda: None))

    def empty(self, meta: TensorMeta, device: int) -> Any:
        if not 0 <= device < self.devices:
            raise FailedPrecondition(f"no GPU:{device} (fake backend has {self.devices})")
        # Reused host buffers, as a device memory pool (cupy's) reuses device memory.
        return FakeDeviceArray(self._memory.empty(meta.shape, meta.dtype), device)

    def d2h_async(self, src: DeviceTensor, start: int, host: np.ndarray) -> Any:
        stream = self._copy[src.device]
        stream.wait_event(src.ready)
        flat = src.array._data.reshape(-1).view(np.uint8)

        def copy() -> None:
            host[:] = flat[start:start + host.size]
            self.copies["d2h"] += 1
        return stream.enqueue(copy)

    def h2d_async(self, host: np.ndarray, dst: Any, device: int, start: int) -> Any:
        flat = dst._data.reshape(-1).view(np.uint8)
        data = host  # the pinned buffer is not reused before this event is done

        def copy() -> None:
            flat[start:start + data.size] = data
            self.copies["h2d"] += 1
        return self._copy[device].enqueue(copy)

    def event_done(self, event: Any) -> bool:
        return event.is_set()

    def event_wait(self, event: Any) -> None:
        event.wait()

    def pinned(self, nbytes: int) -> np.ndarray:
        self.pinned_allocs += 1
        return np.empty(nbytes, dtype=np.uint8)

    def user_array(self, array: Any) -> Any:
        return array

    def mpi_buffer(self, array: Any, start: int, stop: int) -> Any:
        # Only with RENDEZVOUS_CUDA_AWARE=1: the fake's "device" memory is host memory.
        return memoryview(array._data.reshape(-1).view(np.uint8))[start:stop]
