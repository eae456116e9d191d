"""Where a tensor lives (host or a GPU) and how its bytes cross between them.

Tensors are typed by protocol, not by library:

* host: numpy arrays, anything with the buffer protocol or ``__array_interface__``,
  and DLPack exporters whose ``__dlpack_device__`` is the CPU (``np.from_dlpack``);
* GPU: objects with ``__cuda_array_interface__`` (cupy, torch, numba, ...) or a
  DLPack exporter on a CUDA device. A :class:`DeviceBackend` that recognizes
  the object imports it; the one shipped here is :class:`CupyBackend`, which
  imports cupy only when a GPU tensor is actually involved.

A GPU tensor given to ``send`` becomes a :class:`DeviceTensor`: the device
array (made contiguous on the producer's stream if it was not) plus an event
recorded on the producer's current stream at the moment of the send. Nothing
reads the device bytes before that event has completed: the staging copies
wait for it on the copy stream, and a CUDA-aware MPI send waits for it on the
host before the buffer is handed to MPI (mpi4py does not synchronize streams).

Where a received tensor goes is a :class:`Placement`: the key's
``dst_device`` by default (``GPU:N`` -> the device, anything else -> host),
or an explicit override. A GPU placement on a machine without a usable GPU
backend falls back to the host with one warning, so CPU-only jobs that name
GPU devices in their keys keep working; an explicit GPU override there is an
error instead.

Host staging uses pinned memory from a :class:`PinnedPool` (reused; pinning
is slow), in chunks, so copies overlap transfers; see
:mod:`rendezvous.mpi.staging` for the MPI pipelines.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import FailedPrecondition, InvalidArgument
from .dtypes import as_array
from .tensors import TensorMeta

__all__ = [
    "Placement",
    "CPU",
    "parse_placement",
    "placement_for_device",
    "DeviceTensor",
    "DeviceBackend",
    "PinnedPool",
    "Devices",
    "import_host",
    "is_device",
]

log = logging.getLogger("rendezvous.devices")

# DLPack device types (dlpack.h): the ones that mean "a CUDA GPU".
KDL_CPU = 1
KDL_CUDA = 2
KDL_CUDA_HOST = 3
KDL_CUDA_MANAGED = 13


@dataclass(frozen=True, slots=True)
class Placement:
    """Host (``CPU:0``) or GPU ``index``."""

    kind: str  # "CPU" or "GPU"
    index: int = 0

    @property
    def is_gpu(self) -> bool:
        return self.kind == "GPU"

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"


CPU = Placement("CPU", 0)
_PLACEMENT = re.compile(r"^(?:/device:)?(cpu|gpu|cuda)(?::(\d+))?$", re.IGNORECASE)


def parse_placement(spec: Placement | str | None) -> Placement | None:
    """``"cpu"``, ``"gpu"``, ``"GPU:1"``, ``"cuda:1"``, ``"/device:GPU:1"`` or a Placement."""
    if spec is None or isinstance(spec, Placement):
        return spec
    m = _PLACEMENT.match(spec.strip()) if isinstance(spec, str) else None
    if m is None:
        raise InvalidArgument(f"device {spec!r} is not one of cpu, gpu, gpu:N (or cuda:N)")
    kind = "CPU" if m.group(1).lower() == "cpu" else "GPU"
    return Placement(kind, int(m.group(2) or 0))


def placement_for_device(device: Any) -> Placement:
    """Where a key's ``dst_device`` (a :class:`rendezvous.keys.DeviceName`) wants its tensors."""
    return Placement("GPU", device.id) if device.is_gpu else CPU


# -- device tensors -------------------------------------------------------------


class DeviceTensor:
    """A GPU tensor waiting in a table or being moved: the backend's device array,
    its device, dtype and shape, and the event after which its bytes are final."""

    __slots__ = ("array", "backend", "device", "dtype", "shape", "ready")

    def __init__(self, array: Any, backend: "DeviceBackend", device: int, ready: Any) -> None:
        self.array = array
        self.backend = backend
        self.device = device
        self.dtype = np.dtype(array.dtype)
        self.shape = tuple(int(d) for d in array.shape)
        self.ready = ready

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def meta(self) -> TensorMeta:
        return TensorMeta(self.dtype, self.shape)

    @property
    def placement(self) -> Placement:
        return Placement("GPU", self.device)

    def __repr__(self) -> str:
        return f"DeviceTensor({self.backend.name}, GPU:{self.device}, {self.dtype}{list(self.shape)})"


def is_device(value: Any) -> bool:
    return isinstance(value, DeviceTensor)


class DeviceBackend(ABC):
    """How one GPU library's arrays are imported, allocated and copied.

    Copies are asynchronous on a copy stream per device owned by the backend
    and return an event; :meth:`event_done` polls it, :meth:`event_wait`
    blocks on it. Events may be polled from any thread.
    """

    name = "?"

    @abstractmethod
    def recognizes(self, obj: Any) -> bool:
        """Whether ``obj`` is a device tensor this backend can import."""

    @abstractmethod
    def available(self) -> bool:
        """Whether this process can allocate on a GPU through this backend."""

    @abstractmethod
    def wrap(self, obj: Any) -> DeviceTensor:
        """Import ``obj`` (no copy unless it is not contiguous) and record its ready event
        on the calling thread's current stream."""

    @abstractmethod
    def empty(self, meta: TensorMeta, device: int) -> Any:
        """A new device array."""

    @abstractmethod
    def d2h_async(self, src: DeviceTensor, start: int, host: np.ndarray) -> Any:
        """Copy ``len(host)`` bytes of ``src`` from byte ``start`` into pinned ``host``,
        after ``src.ready``; an event."""

    @abstractmethod
    def h2d_async(self, host: np.ndarray, dst: Any, device: int, start: int) -> Any:
        """Copy pinned ``host`` into device array ``dst`` at byte ``start``; an event."""

    @abstractmethod
    def event_done(self, event: Any) -> bool: ...

    @abstractmethod
    def event_wait(self, event: Any) -> None: ...

    @abstractmethod
    def pinned(self, nbytes: int) -> np.ndarray:
        """A flat uint8 array of ``nbytes`` of page-locked host memory."""

    @abstractmethod
    def user_array(self, array: Any) -> Any:
        """What ``recv`` returns for a device array of this backend."""

    @abstractmethod
    def mpi_buffer(self, array: Any, start: int, stop: int) -> Any:
        """Bytes ``[start, stop)`` of a contiguous device array as an object MPI can
        take directly (CUDA-aware MPI only)."""

    # -- whole-tensor copies, built on the chunked ones -------------------------

    def to_host(self, src: DeviceTensor, pool: "PinnedPool") -> np.ndarray:
        """The tensor on the host (default path): device -> pinned chunks -> a numpy array.
        Blocking; run it off the event loop. Copies: D2H into pinned memory, then one
        host copy per chunk into the result (overlapped with the next chunk's D2H)."""
        out = np.empty(src.shape, dtype=src.dtype)
        flat = out.reshape(-1).view(np.uint8)
        n = flat.size
        chunk = pool.chunk_bytes
        inflight: list[tuple[int, np.ndarray, Any]] = []
        start = 0
        while start < n or inflight:
            while start < n and len(inflight) < pool.depth:
                buf = pool.take()
                size = min(chunk, n - start)
                inflight.append((start, buf, self.d2h_async(src, start, buf[:size])))
                start += size
            off, buf, ev = inflight.pop(0)
            self.event_wait(ev)
            size = min(chunk, n - off)
            flat[off:off + size] = buf[:size]
            pool.give(buf)
        return out

    def from_host(self, host: np.ndarray, device: int, pool: "PinnedPool") -> Any:
        """A device array holding ``host`` (default path, host -> device): each chunk is
        copied into pinned memory, then to the device, overlapping the next chunk's
        host copy. Blocking; returns once the bytes are on the device."""
        host = np.ascontiguousarray(as_array(host))
        dst = self.empty(TensorMeta(host.dtype, host.shape), device)
        flat = host.reshape(-1).view(np.uint8)
        n = flat.size
        chunk = pool.chunk_bytes
        inflight: list[tuple[np.ndarray, Any]] = []
        for start in range(0, n, chunk):
            if len(inflight) >= pool.depth:
                buf, ev = inflight.pop(0)
                self.event_wait(ev)
                pool.give(buf)
            buf = pool.take()
            size = min(chunk, n - start)
            buf[:size] = flat[start:start + size]
            inflight.append((buf, self.h2d_async(buf[:size], dst, device, start)))
        for buf, ev in inflight:
            self.event_wait(ev)
            pool.give(buf)
        return dst


class PinnedPool:
    """Reusable page-locked host buffers of ``chunk_bytes`` for one backend.

    :meth:`take` never blocks: it reuses a free buffer or pins a new one, so
    transfers in opposite directions can never wait on each other for
    buffers. At most ``keep`` free buffers are kept for reuse. ``depth`` is
    how many chunks one transfer keeps in flight (its pipeline depth).
    """

    def __init__(self, backend: DeviceBackend, chunk_bytes: int, depth: int = 4, keep: int = 16) -> None:
        if chunk_bytes < 1 or depth < 1:
            raise InvalidArgument("pinned staging needs chunk_bytes >= 1 and depth >= 1")
        self.backend = backend
        self.chunk_bytes = chunk_bytes
        self.depth = depth
        self.keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.allocated = 0  # buffers pinned so far (reuse keeps this flat)

    def take(self) -> np.ndarray:
        with self._lock:
            if self._free:
                return self._free.pop()
            self.allocated += 1
        return self.backend.pinned(self.chunk_bytes)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buf)

    @property
    def free(self) -> int:
        return len(self._free)


# -- the devices a server can use -----------------------------------------------

class Devices:
    """The GPU backends a server may use, asked in order, and their pinned
    staging pools. Each server owns one (``rendezvous.Server(devices=...)``);
    by default it holds :class:`CupyBackend`, which imports cupy only when a
    GPU tensor or a GPU placement appears. Tests pass
    ``Devices([FakeBackend()])``. Used from the loop and from copy threads."""

    def __init__(self, backends: list[DeviceBackend] | None = None) -> None:
        if backends is None:
            from .cupy_backend import CupyBackend  # cupy itself is imported only when used

            backends = [CupyBackend()]
        self.backends: tuple[DeviceBackend, ...] = tuple(backends)
        self._pools: dict[tuple[int, int, int], PinnedPool] = {}
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    def backend_for(self, obj: Any) -> DeviceBackend | None:
        """The backend that recognizes ``obj`` as a device tensor, or None for host data."""
        if type(obj) is np.ndarray:
            return None
        for b in self.backends:
            if b.recognizes(obj):
                return b
        return None

    def gpu_backend(self) -> DeviceBackend | None:
        """The backend to allocate GPU destinations with, or None if no GPU can be used."""
        for b in self.backends:
            if b.available():
                return b
        return None

    def pool(self, backend: DeviceBackend, chunk_bytes: int, depth: int) -> PinnedPool:
        """The pinned pool of ``backend`` for this chunk size, shared by this server's transfers."""
        key = (id(backend), chunk_bytes, depth)
        with self._lock:
            p = self._pools.get(key)
            if p is None:
                p = self._pools[key] = PinnedPool(backend, chunk_bytes, depth)
            return p

    def import_tensor(self, obj: Any) -> np.ndarray | DeviceTensor:
        """What ``send`` stores: a numpy array for host data, a :class:`DeviceTensor` for
        GPU data. Typed by protocol: CUDA array interface or DLPack device, then DLPack on
        the CPU, then anything numpy can view. Call on the producer's thread: the ready
        event goes on that thread's current stream."""
        if type(obj) is np.ndarray:
            return as_array(obj)
        if isinstance(obj, DeviceTensor):
            return obj
        backend = self.backend_for(obj)
        if backend is not None:
            return backend.wrap(obj)
        return import_host(obj)

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message)

    def resolve(self, placement: Placement, explicit: bool) -> tuple[Placement, DeviceBackend | None]:
        """The placement that will be used and the backend for it (None for the host).

        A GPU placement without a usable GPU backend falls back to the host (with one
        warning per server) when it came from the key, and fails when it was asked
        for explicitly."""
        if not placement.is_gpu:
            return CPU, None
        backend = self.gpu_backend()
        if backend is None:
            if explicit:
                raise FailedPrecondition(f"recv onto {placement} needs a GPU and cupy (rendezvous[gpu])")
            self._warn_once("no-gpu", f"key names {placement} but no GPU backend is usable here; "
                                      "GPU-bound tensors are received as numpy arrays")
            return CPU, None
        return placement, backend

    def place(self, value: Any, placement: Placement, explicit: bool, pool_args: tuple[int, int]) -> Any:
        """``value`` (numpy array or DeviceTensor, as a table or a reply gave it) where
        ``placement`` says. Blocking copies; run off the loop for large tensors.
        ``pool_args`` is (staging chunk bytes, depth)."""
        if value is None:
            return None
        target, backend = self.resolve(placement, explicit)
        if isinstance(value, DeviceTensor):
            if target.is_gpu and target.index == value.device and backend is value.backend:
                value.backend.event_wait(value.ready)
                return value.backend.user_array(value.array)
            host = value.backend.to_host(value, self.pool(value.backend, *pool_args))
            if not target.is_gpu:
                return host
            value = host
        if not target.is_gpu or backend is None:
            return value
        if getattr(value, "dtype", None) == np.dtype(object):
            return value  # strings have no device form: they stay on the host
        return backend.user_array(backend.from_host(value, target.index, self.pool(backend, *pool_args)))

    def needs_copy(self, value: Any, placement: Placement, explicit: bool) -> bool:
        """Whether :meth:`place` would move bytes (so the caller runs it off the loop)."""
        if value is None:
            return False
        target, backend = self.resolve(placement, explicit)
        if isinstance(value, DeviceTensor):
            return not (target.is_gpu and target.index == value.device and backend is value.backend)
        return target.is_gpu and backend is not None and getattr(value, "dtype", None) != np.dtype(object)


def import_host(obj: Any) -> np.ndarray:
    """``obj`` as a host numpy array: DLPack on the CPU, then anything numpy can
    view. A DLPack tensor on another device is refused (no backend took it)."""
    if not hasattr(obj, "__array_interface__") and hasattr(obj, "__dlpack__"):
        dev = getattr(obj, "__dlpack_device__", None)
        kind = int(dev()[0]) if dev is not None else KDL_CPU
        if kind in (KDL_CPU, KDL_CUDA_HOST):
            return as_array(np.from_dlpack(obj))
        raise InvalidArgument(f"{type(obj).__name__} lives on DLPack device type {kind}, "
                              "which no installed backend handles (CUDA needs cupy: rendezvous[gpu])")
    return as_array(obj)
