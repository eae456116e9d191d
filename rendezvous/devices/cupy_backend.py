"""CUDA through cupy: :class:`CupyBackend`, the default GPU backend of a server.

cupy (the optional extra ``rendezvous[gpu]``) is imported on first use, so
a server without GPU tensors never loads it. The contract it implements is
:class:`rendezvous.devices.backend.DeviceBackend`; the ordering decisions (which
stream waits for which) are :func:`rendezvous.devices.import_device`'s and
the staging pipelines'. This module only maps the primitives onto cupy:

* two non-blocking copy streams per device, one per direction, so the copy
  engines of a GPU move both ways at once and a receive never queues behind
  a send still waiting for its producer; a third, "peer", on the destination
  device for copies from another GPU (``cudaMemcpyPeerAsync``);
* peer access asked for (``cudaDeviceCanAccessPeer``) and enabled
  (``cudaDeviceEnablePeerAccess``, "already enabled" tolerated) once per pair
  of devices, by the destination for the source's memory; a pair without it,
  or whose enabling fails, is answered False, and placement bounces through
  pinned host memory;
* pinned memory allocated with ``cudaHostAlloc`` directly, not through cupy's
  pinned memory pool (which keeps every freed buffer pinned for the life of
  the process): :class:`rendezvous.devices.PinnedPool` decides what to keep,
  and a buffer it drops is unpinned once its last view is gone;
* event queries that tell a failed copy from one still running
  (:meth:`CupyBackend.event_done` raises the asynchronous error);
* imports that do not synchronize on their own (``from_cai`` hides the
  exporter's stream from ``cupy.asarray``, which would block the host on it):
  the caller has already ordered the streams, on the GPU;
* CUDA IPC (``cudaIpcGetMemHandle`` of the whole allocation, found with
  ``cuMemGetAddressRange``, and an interprocess event recorded on an "ipc"
  stream after the tensor's ready event); the importer's copy waits for that
  event on its peer stream. Not yet run on a GPU: ``make gpu-check`` on one.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

import numpy as np

from .backend import (KDL_CUDA, KDL_GPU_KINDS, STREAM_LEGACY, STREAM_PER_THREAD, DeviceBackend,
                              DeviceTensor)
from ..errors import FailedPrecondition
from ..codec.tensors import TensorMeta

__all__ = ["CupyBackend"]

log = logging.getLogger("rendezvous.cupy")

#: cudaErrorPeerAccessAlreadyEnabled (driver_types.h), for cupy builds that do not name it
_PEER_ACCESS_ALREADY_ENABLED = 704
#: cudaErrorNotReady (driver_types.h): an event query's "not yet"
_NOT_READY = 600


class _Capsule:
    """A DLPack capsule already asked for with the consumer's stream, shown to
    ``cupy.from_dlpack`` as an exporter (which asks again with a stream: the
    exporter's ordering is already done, so any stream is fine)."""

    def __init__(self, capsule: Any, device: int) -> None:
        self._capsule = capsule
        self._device = device

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, self._device)


class _Interface:
    """An exporter's CUDA array interface without its ``stream`` entry (cupy
    would otherwise synchronize the host on it); keeps the exporter alive as
    long as the array viewing its memory."""

    def __init__(self, owner: Any, cai: dict[str, Any]) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {k: v for k, v in cai.items() if k != "stream"}


class CupyBackend(DeviceBackend):
    """CUDA through cupy (the optional extra ``rendezvous[gpu]``), imported on first use."""

    name = "cupy"

    def __init__(self) -> None:
        self._cp: Any = None
        self._available: bool | None = None
        self._count: int | None = None
        self._streams: dict[tuple[int, str], Any] = {}
        self._peers: dict[tuple[int, int], bool] = {}  # (src, dst) -> direct copies possible and enabled
        self._lock = threading.Lock()
        self._uuids: dict[int, bytes] | None = None  # device -> UUID, for CUDA IPC ({}: none)
        self._libcuda: Any = None

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
        try:
            if hasattr(obj, "__cuda_array_interface__"):
                return True
            dev = getattr(obj, "__dlpack_device__", None)
            if dev is None:
                return False
            return int(dev()[0]) in KDL_GPU_KINDS
        except Exception:
            return False

    def available(self) -> bool:
        if self._available is None:
            self._available = self.device_count() > 0
        return self._available

    def device_count(self) -> int:
        if self._count is None:
            try:
                self._count = int(self._cupy().cuda.runtime.getDeviceCount())
            except Exception:
                self._count = 0
        return self._count

    def is_native(self, obj: Any) -> bool:
        return isinstance(obj, self._cupy().ndarray)

    def _stream(self, device: int, direction: str) -> Any:
        with self._lock:
            s = self._streams.get((device, direction))
            if s is None:
                cp = self._cupy()
                with cp.cuda.Device(device):
                    s = cp.cuda.Stream(non_blocking=True)
                self._streams[(device, direction)] = s
            return s

    def wrap(self, obj: Any) -> DeviceTensor:
        cp = self._cupy()
        if isinstance(obj, cp.ndarray):
            arr = obj
        elif hasattr(obj, "__cuda_array_interface__"):
            arr = cp.asarray(obj)  # cupy on its own: honours a version 3 stream only
        else:
            arr = cp.from_dlpack(obj)  # asks the exporter with cupy's current stream
        with arr.device:
            if not arr.flags.c_contiguous:
                arr = cp.ascontiguousarray(arr)  # one device copy, on the current stream
            ready = cp.cuda.Event(disable_timing=True)
            ready.record(cp.cuda.get_current_stream())
        return DeviceTensor(arr, self, arr.device.id, ready)

    def current_stream(self, device: int) -> int:
        cp = self._cupy()
        with cp.cuda.Device(device):
            ptr = int(cp.cuda.get_current_stream().ptr)
        if ptr:
            return ptr
        # cupy's null stream: the legacy default one, or the per-thread one when cupy runs so
        return STREAM_PER_THREAD if os.environ.get("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM") == "1" else STREAM_LEGACY

    def wait_stream(self, device: int, stream: int) -> None:
        cp = self._cupy()
        with cp.cuda.Device(device):
            current = cp.cuda.get_current_stream()
            if int(current.ptr) == stream:
                return  # already in order
            done = cp.cuda.Event(disable_timing=True)
            done.record(cp.cuda.ExternalStream(stream, device))
            current.wait_event(done)

    def synchronize(self, device: int) -> None:
        cp = self._cupy()
        with cp.cuda.Device(device):
            cp.cuda.runtime.deviceSynchronize()

    def from_dlpack(self, capsule: Any, device: int) -> Any:
        cp = self._cupy()
        with cp.cuda.Device(device):
            return cp.from_dlpack(_Capsule(capsule, device))

    def from_cai(self, obj: Any) -> Any:
        return self._cupy().asarray(_Interface(obj, obj.__cuda_array_interface__))

    def device_of(self, array: Any) -> int:
        return int(array.device.id)

    def empty(self, meta: TensorMeta, device: int) -> Any:
        cp = self._cupy()
        with cp.cuda.Device(device):
            return cp.empty(meta.shape, dtype=meta.dtype)

    def record(self, device: int) -> Any:
        cp = self._cupy()
        with cp.cuda.Device(device):
            event = cp.cuda.Event(disable_timing=True)
            event.record(cp.cuda.get_current_stream())
        return event

    def _copy(self, device: int, direction: str, dst_ptr: int, src_ptr: int, nbytes: int, kind: int,
              after: Any) -> Any:
        cp = self._cupy()
        stream = self._stream(device, direction)
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
        return self._copy(src.device, "d2h", host.ctypes.data, src.array.data.ptr + start, host.nbytes,
                          cp.cuda.runtime.memcpyDeviceToHost, src.ready)

    def h2d_async(self, host: np.ndarray, dst: Any, device: int, start: int, after: Any = None) -> Any:
        cp = self._cupy()
        return self._copy(device, "h2d", dst.data.ptr + start, host.ctypes.data, host.nbytes,
                          cp.cuda.runtime.memcpyHostToDevice, after)

    def can_access_peer(self, src: int, dst: int) -> bool:
        if src == dst:
            return False
        with self._lock:
            known = self._peers.get((src, dst))
        if known is None:
            known = self._enable_peer(src, dst)
            with self._lock:
                self._peers[(src, dst)] = known
        return known

    def _enable_peer(self, src: int, dst: int) -> bool:
        """Let ``dst`` read ``src``'s memory: whether it could be done. Two threads
        may race here; the second sees "already enabled", which is success."""
        rt = self._cupy().cuda.runtime
        try:
            if not rt.deviceCanAccessPeer(dst, src):
                return False
            with self._cupy().cuda.Device(dst):
                ensure = getattr(rt, "_deviceEnsurePeerAccess", None)
                if ensure is not None:
                    ensure(src)  # newer cupy: tolerates "already enabled" and clears CUDA's last error
                else:
                    try:
                        rt.deviceEnablePeerAccess(src)
                    except rt.CUDARuntimeError as exc:
                        # enabled before (by cupy, torch or another thread): what we wanted
                        if exc.status != getattr(rt, "errorPeerAccessAlreadyEnabled", _PEER_ACCESS_ALREADY_ENABLED):
                            raise
        except Exception as exc:  # e.g. cudaErrorTooManyPeers: copies still work through the host
            log.warning("peer access GPU:%d -> GPU:%d could not be enabled (%s: %s); tensors between "
                        "them go through pinned host memory", src, dst, type(exc).__name__, exc)
            return False
        return True

    def peer_async(self, src: DeviceTensor, dst: Any, device: int, after: Any = None) -> Any:
        cp = self._cupy()
        nbytes = src.nbytes
        if int(dst.nbytes) != nbytes:
            raise ValueError(f"peer copy of {nbytes} bytes into a destination of {int(dst.nbytes)}")
        stream = self._stream(device, "peer")
        with cp.cuda.Device(device):
            stream.wait_event(src.ready)  # an event of the source device: streams may wait across devices
            if after is not None:
                stream.wait_event(after)
            if nbytes:
                cp.cuda.runtime.memcpyPeerAsync(dst.data.ptr, device, src.array.data.ptr, src.device, nbytes,
                                                stream.ptr)
            event = cp.cuda.Event(disable_timing=True)
            event.record(stream)
        return event

    def event_done(self, event: Any) -> bool:
        # Not ``event.done``: it is ``cudaEventQuery(...) == cudaSuccess``, False for
        # ever when the work before the event failed, so a failed copy would be
        # waited for without end. The status itself tells the three cases apart.
        rt = self._cupy().cuda.runtime
        status = rt.eventQuery(event.ptr)  # some cupy versions raise on an error here themselves
        if status == 0:
            return True
        if status == getattr(rt, "errorNotReady", _NOT_READY):
            return False
        raise rt.CUDARuntimeError(status)

    def event_wait(self, event: Any) -> None:
        event.synchronize()

    def pinned(self, nbytes: int) -> np.ndarray:
        cp = self._cupy()
        # cudaHostAlloc, freed (cudaFreeHost) when the last numpy view of it is gone
        mem = cp.cuda.PinnedMemoryPointer(cp.cuda.PinnedMemory(max(nbytes, 1)), 0)
        return np.frombuffer(mem, dtype=np.uint8, count=nbytes)  # keeps ``mem`` alive

    # -- CUDA IPC --------------------------------------------------------------

    def ipc_devices(self) -> dict[int, bytes] | None:
        if self._uuids is None:
            uuids: dict[int, bytes] = {}
            try:
                rt = self._cupy().cuda.runtime
                for i in range(self.device_count()):
                    uuid = rt.getDeviceProperties(i).get("uuid")
                    if uuid:
                        uuids[i] = bytes(uuid)
            except Exception as exc:  # no driver, an old cupy: GPU tensors go the staged way
                log.info("CUDA IPC unavailable (%s: %s)", type(exc).__name__, exc)
                uuids = {}
            self._uuids = uuids
        return self._uuids or None

    def _allocation_base(self, ptr: int) -> int:
        """The start of the ``cudaMalloc`` allocation holding ``ptr`` (a pool hands
        out pieces of larger ones; an IPC handle names a whole allocation)."""
        if self._libcuda is None:
            self._libcuda = ctypes.CDLL("libcuda.so.1")
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        status = self._libcuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
        if status != 0:
            raise RuntimeError(f"cuMemGetAddressRange failed (CUDA driver error {status})")
        return int(base.value)

    def ipc_export(self, tensor: DeviceTensor) -> tuple[bytes, int, bytes, Any]:
        cp = self._cupy()
        rt = cp.cuda.runtime
        ptr = int(tensor.array.data.ptr)
        stream = self._stream(tensor.device, "ipc")
        with cp.cuda.Device(tensor.device):
            base = self._allocation_base(ptr)
            memory = bytes(rt.ipcGetMemHandle(base))
            event = cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
            stream.wait_event(tensor.ready)
            event.record(stream)
            handle = bytes(rt.ipcGetEventHandle(event.ptr))
        return memory, ptr - base, handle, event

    def ipc_open(self, memory: bytes, device: int) -> Any:
        cp = self._cupy()
        with cp.cuda.Device(device):
            return int(cp.cuda.runtime.ipcOpenMemHandle(memory))  # peer access enabled lazily

    def ipc_close(self, opened: Any) -> None:
        self._cupy().cuda.runtime.ipcCloseMemHandle(opened)

    def ipc_copy(self, opened: Any, offset: int, event: bytes, dst: Any, device: int, after: Any) -> Any:
        cp = self._cupy()
        rt = cp.cuda.runtime
        stream = self._stream(device, "peer")
        with cp.cuda.Device(device):
            if after is not None:
                stream.wait_event(after)
            imported = rt.ipcOpenEventHandle(event)
            try:
                rt.streamWaitEvent(stream.ptr, imported, 0)
            finally:
                rt.eventDestroy(imported)  # released once the wait is done
            nbytes = int(dst.nbytes)
            if nbytes:
                rt.memcpyAsync(dst.data.ptr, opened + offset, nbytes, rt.memcpyDeviceToDevice, stream.ptr)
            done = cp.cuda.Event(disable_timing=True)
            done.record(stream)
        return done

    def user_array(self, array: Any) -> Any:
        return array

    def mpi_buffer(self, array: Any, start: int, stop: int) -> Any:
        return array.reshape(-1).view(self._cupy().uint8)[start:stop]
