"""What a GPU library supplies (:class:`DeviceBackend`), and the device
tensors it makes. The one shipped is :class:`rendezvous.devices.cupy_backend.CupyBackend`;
tests use :class:`rendezvous.testing.fakegpu.FakeBackend`. Which backends a server
uses, its pinned staging pools and the import of a tensor by protocol are
:mod:`rendezvous.devices`'s.

A GPU tensor given to ``send`` becomes a :class:`DeviceTensor`: the device
array (made contiguous on the caller's stream if it was not) plus an event
recorded on the caller's current stream at the moment of the send. Nothing
reads the device bytes before that event has completed: the staging copies
wait for it on the copy stream, and a CUDA-aware MPI send waits for it on the
host before the buffer is handed to MPI (mpi4py does not synchronize streams).

Ordering on the receiving side: a destination is allocated on the caller's
current stream, where the device memory pool may hand back a block that work
queued on that stream still reads. :meth:`DeviceBackend.allocate` records an
event right after the allocation; host-to-device copies (on the backend's own
copy stream) wait for it, and MPI writes into device memory only once it is
done. Copies from and to the device run on two streams per device (one per
direction), so a receive never queues behind a send that waits for its
producer; copies from another GPU of the process run on a third.

A :class:`Placement` says where a received tensor goes: the host or GPU ``N``.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from rendezvous.codec.dtypes import as_array
from rendezvous.errors import InvalidArgument
from rendezvous.codec.tensors import TensorMeta

if TYPE_CHECKING:
    from rendezvous.devices import PinnedPool

__all__ = [
    "Placement",
    "CPU",
    "parse_placement",
    "placement_for_device",
    "DeviceTensor",
    "DeviceBackend",
    "Allocation",
    "is_device",
]

# DLPack device types (dlpack.h): the ones that mean "a CUDA GPU".
KDL_CPU = 1
KDL_CUDA = 2
KDL_CUDA_HOST = 3
KDL_CUDA_MANAGED = 13
KDL_GPU_KINDS = (KDL_CUDA, KDL_CUDA_MANAGED)

#: CUDA stream handles as the CUDA array interface and DLPack write them:
#: 1 the legacy default stream, 2 the per-thread default stream, anything else
#: a ``cudaStream_t``; 0 is ambiguous and disallowed.
STREAM_LEGACY = 1
STREAM_PER_THREAD = 2


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


class Allocation(NamedTuple):
    """A new device array and the event after which it may be written from
    another stream (recorded on the allocating stream right after the allocation)."""

    array: Any
    ready: Any


class DeviceBackend(ABC):
    """How one GPU library's arrays are imported, allocated and copied.

    A backend supplies primitives; the decisions about ordering (which stream
    waits for which, when a buffer may be reused) are made once, for every
    backend, in :mod:`rendezvous.devices` and :mod:`rendezvous.mpi.staging`.

    Streams: the *current* stream of a device is the calling thread's (the
    library's notion: cupy's ``get_current_stream``). Copies are asynchronous
    on copy streams the backend owns, one per device and direction (device to
    host, host to device, and peer: from another GPU into the device), and
    return an event; :meth:`event_done` polls it, :meth:`event_wait` blocks on
    it. Events may be polled from any thread. Stream handles are ints as the
    CUDA array interface writes them (:data:`STREAM_LEGACY`,
    :data:`STREAM_PER_THREAD`, or a ``cudaStream_t``).
    """

    name = "?"

    @abstractmethod
    def recognizes(self, obj: Any) -> bool:
        """Whether ``obj`` is a device tensor this backend can import (its own
        arrays, or a CUDA array interface / CUDA DLPack exporter)."""

    @abstractmethod
    def available(self) -> bool:
        """Whether this process can allocate on a GPU through this backend."""

    @abstractmethod
    def device_count(self) -> int:
        """How many GPUs this backend can use (0 when none)."""

    @abstractmethod
    def is_native(self, obj: Any) -> bool:
        """Whether ``obj`` is this backend's own device array (no import needed)."""

    @abstractmethod
    def wrap(self, obj: Any) -> DeviceTensor:
        """``obj`` as a :class:`DeviceTensor` (made contiguous on the current stream if
        it is not), its ready event recorded on the device's current stream.

        Given a native array this does no stream ordering at all: that is
        :func:`import_device`'s job, done before. Given a foreign object it
        imports it as the library would on its own (cupy: ``asarray`` /
        ``from_dlpack``)."""

    @abstractmethod
    def current_stream(self, device: int) -> int:
        """The handle of the calling thread's current stream on ``device``."""

    @abstractmethod
    def wait_stream(self, device: int, stream: int) -> None:
        """Make the current stream of ``device`` wait (on the GPU, the host does not
        block) for the work queued so far on foreign stream ``stream``."""

    @abstractmethod
    def synchronize(self, device: int) -> None:
        """Block the host until all work queued on ``device``, on any stream, is done."""

    @abstractmethod
    def from_dlpack(self, capsule: Any, device: int) -> Any:
        """A native array viewing the memory of a DLPack ``capsule`` (from
        ``__dlpack__``, already asked for with the right stream), on ``device``."""

    @abstractmethod
    def from_cai(self, obj: Any) -> Any:
        """A native array viewing the memory ``obj.__cuda_array_interface__`` describes,
        without any stream synchronization (the caller orders streams)."""

    @abstractmethod
    def device_of(self, array: Any) -> int:
        """The device a native array lives on."""

    @abstractmethod
    def empty(self, meta: TensorMeta, device: int) -> Any:
        """A new device array, allocated on the current stream of ``device``. Use
        :meth:`allocate` to get it with the event copies into it must wait for."""

    @abstractmethod
    def record(self, device: int) -> Any:
        """An event recorded on the current stream of ``device``."""

    @abstractmethod
    def d2h_async(self, src: DeviceTensor, start: int, host: np.ndarray) -> Any:
        """Copy ``len(host)`` bytes of ``src`` from byte ``start`` into pinned ``host``
        on the device-to-host copy stream, after ``src.ready``; an event."""

    @abstractmethod
    def h2d_async(self, host: np.ndarray, dst: Any, device: int, start: int, after: Any = None) -> Any:
        """Copy pinned ``host`` into device array ``dst`` at byte ``start`` on the
        host-to-device copy stream, after event ``after`` (the allocation's) when given;
        an event."""

    @abstractmethod
    def can_access_peer(self, src: int, dst: int) -> bool:
        """Whether device ``dst`` can copy directly from device ``src``'s memory (peer
        access over NVLink or PCIe), ready for :meth:`peer_async`: a backend enables
        the access here, once per pair. False for ``src == dst`` and where the
        devices cannot, or the access could not be enabled: placement then goes
        through pinned host memory. Cheap after the first call for a pair."""

    @abstractmethod
    def peer_async(self, src: DeviceTensor, dst: Any, device: int, after: Any = None) -> Any:
        """Copy all of ``src`` into device array ``dst`` (same size) on ``device`` on
        ``device``'s peer copy stream, after ``src.ready`` and after event ``after``
        (the allocation's) when given; an event. Only for a pair
        :meth:`can_access_peer` allowed. Raises if the copy cannot be queued, in
        which case nothing was."""

    @abstractmethod
    def event_done(self, event: Any) -> bool:
        """Whether the work queued before ``event`` has run: True, False while it
        has not, and it raises the error of that work if it failed (an
        asynchronous error, as ``cudaEventQuery`` reports it): a copy that
        failed must never pass for one whose bytes are there."""

    @abstractmethod
    def event_wait(self, event: Any) -> None:
        """Block until the work queued before ``event`` has run; raise its error if
        it failed (as :meth:`event_done` does)."""

    @abstractmethod
    def pinned(self, nbytes: int) -> np.ndarray:
        """A flat uint8 array of ``nbytes`` of page-locked host memory, released
        (unpinned) once the last reference to it is dropped."""

    @abstractmethod
    def user_array(self, array: Any) -> Any:
        """What ``recv`` returns for a device array of this backend."""

    @abstractmethod
    def mpi_buffer(self, array: Any, start: int, stop: int) -> Any:
        """Bytes ``[start, stop)`` of a contiguous device array as an object MPI can
        take directly (CUDA-aware MPI only)."""

    # -- CUDA IPC: device memory shared with another process of the node ----------

    def ipc_devices(self) -> dict[int, bytes] | None:
        """Device index -> UUID of each GPU whose memory this process can export
        and open by IPC handles; None: no IPC (the default)."""
        return None

    def ipc_export(self, tensor: DeviceTensor) -> tuple[bytes, int, bytes, Any]:
        """``tensor`` for another process: the memory handle of its allocation,
        its offset there, the handle of an interprocess event recorded once
        ``tensor.ready`` is done, and what to hold with the tensor (the event).
        The caller holds both until the importer says it is done with them."""
        raise NotImplementedError(f"{self.name} has no CUDA IPC")

    def ipc_open(self, memory: bytes, device: int) -> Any:
        """Another process's allocation mapped here, for :meth:`ipc_copy` (the
        caller caches it per allocation and closes it with :meth:`ipc_close`)."""
        raise NotImplementedError(f"{self.name} has no CUDA IPC")

    def ipc_close(self, opened: Any) -> None:
        """Unmap what :meth:`ipc_open` mapped."""

    def ipc_copy(self, opened: Any, offset: int, event: bytes, dst: Any, device: int, after: Any) -> Any:
        """Copy ``dst``'s size of bytes at ``offset`` of ``opened`` into ``dst`` on
        ``device``'s peer copy stream once the exporter's ``event`` and ``after``
        (the allocation's event) are done; an event."""
        raise NotImplementedError(f"{self.name} has no CUDA IPC")

    def allocate(self, meta: TensorMeta, device: int) -> Allocation:
        """A new device array and the event after which another stream (a copy
        stream) or MPI may write it.

        The memory pool may hand back a block freed on the current stream that
        work queued there still reads; a write ordered only by the host would
        race with that work, so writers wait for this event instead."""
        array = self.empty(meta, device)
        return Allocation(array, self.record(device))

    # -- whole-tensor copies, built on the chunked ones -------------------------

    def to_peer(self, src: DeviceTensor, device: int) -> DeviceTensor:
        """``src`` on GPU ``device`` without a host bounce (the pair must have peer
        access): the destination is allocated on ``device``'s current stream and one
        device-to-device copy (copy count: 1, no host memory) runs on ``device``'s
        peer copy stream once ``src.ready`` and the allocation's event are done.
        Does not block: the result's ready event is the copy's, and ``src`` must
        stay alive until it is done (:meth:`Devices.place` sees to that)."""
        dst, allocated = self.allocate(src.meta, device)
        return DeviceTensor(dst, self, device, self.peer_async(src, dst, device, after=allocated))

    def to_host(self, src: DeviceTensor, pool: "PinnedPool", out: np.ndarray | None = None) -> np.ndarray:
        """The tensor on the host (default path): device -> pinned chunks -> a numpy array
        (``out``, C-contiguous and of the tensor's size, when given: a local client's
        shared-memory segment). Blocking; run it off the event loop. Copies: D2H into
        pinned memory, then one host copy per chunk into the result (overlapped with
        the next chunk's D2H). If anything fails, the chunks in flight go back to the
        pool once their copies are done (never while the copy engine may still write them)."""
        if out is None:
            out = np.empty(src.shape, dtype=src.dtype)
        elif out.nbytes != src.nbytes or not out.flags.c_contiguous:
            raise InvalidArgument(f"to_host into {out.nbytes} bytes (contiguous: {out.flags.c_contiguous}) "
                                  f"for {src!r}")
        flat = out.reshape(-1).view(np.uint8)
        n = flat.size
        chunk = pool.chunk_bytes
        inflight: list[tuple[int, np.ndarray, Any]] = []
        start = 0
        try:
            while start < n or inflight:
                while start < n and len(inflight) < pool.depth:
                    buf = pool.take()
                    size = min(chunk, n - start)
                    try:
                        event = self.d2h_async(src, start, buf[:size])
                    except BaseException:
                        pool.give(buf)  # no copy was queued
                        raise
                    inflight.append((start, buf, event))
                    start += size
                off, buf, ev = inflight[0]
                self.event_wait(ev)
                inflight.pop(0)
                size = min(chunk, n - off)
                flat[off:off + size] = buf[:size]
                pool.give(buf)
        except BaseException:
            for _, buf, ev in inflight:
                pool.give(buf, after=ev, hold=src)
            raise
        return out

    def from_host(self, host: np.ndarray, device: int, pool: "PinnedPool") -> Any:
        """A device array holding ``host`` (default path, host -> device): each chunk is
        copied into pinned memory, then to the device after the allocation's event,
        overlapping the next chunk's host copy. Blocking; returns once the bytes are
        on the device. On failure the chunks in flight (and the destination they
        write) are held until their copies are done."""
        host = np.ascontiguousarray(as_array(host))
        dst, allocated = self.allocate(TensorMeta(host.dtype, host.shape), device)
        flat = host.reshape(-1).view(np.uint8)
        n = flat.size
        chunk = pool.chunk_bytes
        inflight: list[tuple[np.ndarray, Any]] = []
        try:
            for start in range(0, n, chunk):
                if len(inflight) >= pool.depth:
                    buf, ev = inflight[0]
                    self.event_wait(ev)
                    inflight.pop(0)
                    pool.give(buf)
                buf = pool.take()
                size = min(chunk, n - start)
                try:
                    buf[:size] = flat[start:start + size]
                    event = self.h2d_async(buf[:size], dst, device, start, after=allocated)
                except BaseException:
                    pool.give(buf)
                    raise
                inflight.append((buf, event))
            while inflight:
                buf, ev = inflight[0]
                self.event_wait(ev)
                inflight.pop(0)
                pool.give(buf)
        except BaseException:
            for buf, ev in inflight:
                pool.give(buf, after=ev, hold=dst)
            raise
        return dst
