"""CUDA through cupy: :class:`CupyBackend`, the default GPU backend of a server.

cupy (the optional extra ``rendezvous[gpu]``) is imported on first use, so
a server without GPU tensors never loads it. The contract it implements is
:class:`rendezvous.devices.DeviceBackend`.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .devices import KDL_CUDA, KDL_CUDA_MANAGED, DeviceBackend, DeviceTensor
from .errors import FailedPrecondition
from .tensors import TensorMeta

__all__ = ["CupyBackend"]


class CupyBackend(DeviceBackend):
    """CUDA through cupy (the optional extra ``rendezvous[gpu]``), imported on first use."""

    name = "cupy"

    def __init__(self) -> None:
        self._cp: Any = None
        self._available: bool | None = None
        self._streams: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _cupy(self) -> Any:
        if self._cp is None:
            try:
                import cupy
            except ImportError:
                raise FailedPrecondition(
                    "a GPU tensor needs cupy: pip install 'rendezvous[gpu]'") from None
            self._cp = cupy
        return self._cp

    def recognizes(self, obj: Any) -> bool:
        if hasattr(obj, "__cuda_array_interface__"):
            return True
        dev = getattr(obj, "__dlpack_device__", None)
        if dev is None:
            return False
        try:
            kind = int(dev()[0])
        except Exception:
            return False
        return kind in (KDL_CUDA, KDL_CUDA_MANAGED)

    def available(self) -> bool:
        if self._available is None:
            try:
                self._available = self._cupy().cuda.runtime.getDeviceCount() > 0
            except Exception:
                self._available = False
        return self._available

    def _stream(self, device: int) -> Any:
        with self._lock:
            s = self._streams.get(device)
            if s is None:
                cp = self._cupy()
                with cp.cuda.Device(device):
                    s = cp.cuda.Stream(non_blocking=True)
                self._streams[device] = s
            return s

    def wrap(self, obj: Any) -> DeviceTensor:
        cp = self._cupy()
        if isinstance(obj, cp.ndarray):
            arr = obj
        elif hasattr(obj, "__cuda_array_interface__"):
            arr = cp.asarray(obj)  # honours the exporter's stream (CAI v3)
        else:
            arr = cp.from_dlpack(obj)  # the exporter syncs to our current stream
        with arr.device:
            if not arr.flags.c_contiguous:
                arr = cp.ascontiguousarray(arr)  # one device copy, on the current stream
            ready = cp.cuda.Event(disable_timing=True)
            ready.record(cp.cuda.get_current_stream())
        return DeviceTensor(arr, self, arr.device.id, ready)

    def empty(self, meta: TensorMeta, device: int) -> Any:
        cp = self._cupy()
        with cp.cuda.Device(device):
            return cp.empty(meta.shape, dtype=meta.dtype)

    def _copy(self, device: int, dst_ptr: int, src_ptr: int, nbytes: int, kind: int, after: Any) -> Any:
        cp = self._cupy()
        stream = self._stream(device)
        with cp.cuda.Device(device):
            if after is not None:
                stream.wait_event(after)
            if nbytes:
                cp.cuda.runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, kind, stream.ptr)
            event = cp.cuda.Event(disable_timing=True)
            event.record(stream)
        return event

    def d2h_async(self, src: DeviceTensor, start: int, host: np.ndarray) -> Any:
        cp = self._cupy()
        return self._copy(src.device, host.ctypes.data, src.array.data.ptr + start, host.nbytes,
                          cp.cuda.runtime.memcpyDeviceToHost, src.ready)

    def h2d_async(self, host: np.ndarray, dst: Any, device: int, start: int) -> Any:
        cp = self._cupy()
        return self._copy(device, dst.data.ptr + start, host.ctypes.data, host.nbytes,
                          cp.cuda.runtime.memcpyHostToDevice, None)

    def event_done(self, event: Any) -> bool:
        return bool(event.done)

    def event_wait(self, event: Any) -> None:
        event.synchronize()

    def pinned(self, nbytes: int) -> np.ndarray:
        cp = self._cupy()
        mem = cp.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(mem, dtype=np.uint8, count=nbytes)  # keeps ``mem`` alive

    def user_array(self, array: Any) -> Any:
        return array

    def mpi_buffer(self, array: Any, start: int, stop: int) -> Any:
        return array.reshape(-1).view(self._cupy().uint8)[start:stop]
