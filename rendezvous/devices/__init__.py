"""Where a tensor lives (host or a GPU) and how its bytes cross between them.

Tensors are typed by protocol, not by library:

* host: numpy arrays, anything with the buffer protocol or ``__array_interface__``,
  and DLPack exporters whose ``__dlpack_device__`` is the CPU (``np.from_dlpack``);
* GPU: objects with ``__cuda_array_interface__`` (cupy, torch, numba, ...) or a DLPack
  exporter on a CUDA device. A :class:`DeviceBackend` that recognizes the object imports
  it; the one shipped is :class:`rendezvous.devices.cupy_backend.CupyBackend`, which
  imports cupy only when a GPU tensor is actually involved.

The producer's stream need not be the caller's: a torch tensor written on a side stream,
a numba array on another. :func:`import_device` decides, for every backend alike, how
the caller's stream is ordered after the producer's before the tensor's ready event is
recorded (DLPack asked with the caller's stream; CUDA array interface v3 ``stream``
waited on; v2, which names no stream, a device synchronize); backends only supply the
primitives.

The contract a GPU library implements (:class:`DeviceBackend`), the device tensors it
makes and placements are in :mod:`rendezvous.devices.backend`, and importable from here
too. This module holds what a server owns: its backends, asked in order
(:class:`Devices`), and their pinned staging pools.

A GPU tensor placed onto another GPU of the same process (a local recv whose key names
another device, a received tensor that must move) is copied device to device when the
backend says the pair has peer access (:meth:`DeviceBackend.can_access_peer`): one copy,
on the destination's peer copy stream, after the source's ready event and the
destination's allocation event (:meth:`DeviceBackend.to_peer`). Without peer access it
goes through pinned host memory, as a tensor from another process does.

Where a received tensor goes is a :class:`Placement`: the key's ``dst_device`` by
default (``GPU:N`` -> the device, anything else -> host), or an explicit override. A GPU
placement on a machine without a usable GPU backend falls back to the host with one
warning, so CPU-only jobs that name GPU devices in their keys keep working; an explicit
GPU override there is an error instead.

Host staging uses pinned memory from a :class:`PinnedPool` (reused; pinning is slow), in
chunks, so copies overlap transfers; see :mod:`rendezvous.mpi.staging` for the MPI
pipelines. A buffer goes back to the pool only once the copy using it has completed
(:meth:`PinnedPool.give` with ``after``), also when a transfer fails or is cancelled,
and the pools of one :class:`Devices` keep at most ``pinned_keep_bytes`` idle: pinned
memory beyond that is released.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from rendezvous.codec.dtypes import as_array
from rendezvous.errors import FailedPrecondition, InvalidArgument

# the contract's names, importable from here too
from .backend import __all__ as backend_all
from .backend import (CPU, KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED, KDL_GPU_KINDS, STREAM_LEGACY,
                      STREAM_PER_THREAD, Allocation, DeviceBackend, DeviceTensor, Placement, is_device,
                      parse_placement, placement_for_device)

__all__ = [*backend_all, "PinnedPool", "PinnedBudget", "Devices", "import_device", "import_host"]

log = logging.getLogger("rendezvous.devices")

#: idle pinned memory the pools of one :class:`Devices` keep for reuse, at most
PINNED_KEEP_BYTES = 64 << 20


class PinnedBudget:
    """How much idle pinned memory the pools of one :class:`Devices` may keep
    together; what a pool cannot keep within it is released."""

    def __init__(self, keep_bytes: int = PINNED_KEEP_BYTES) -> None:
        if keep_bytes < 0:
            raise InvalidArgument("pinned_keep_bytes must be >= 0")
        self.keep_bytes = keep_bytes
        self.idle_bytes = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> bool:
        with self._lock:
            if self.idle_bytes + nbytes > self.keep_bytes:
                return False
            self.idle_bytes += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.idle_bytes -= nbytes


class PinnedPool:
    """Reusable page-locked host buffers of ``chunk_bytes`` for one backend.

    :meth:`take` never blocks: it reuses a free buffer or pins a new one, so
    transfers in opposite directions can never wait on each other for
    buffers. A buffer given back with ``after`` (a copy event) is held, not
    reused, until that event is done (or its copy failed): a cancelled or
    failed transfer gives its buffers back while the copy engine may still be
    writing them. At most
    ``keep`` free buffers, and no more than the shared ``budget`` allows, are
    kept for reuse; the rest are dropped, and the backend unpins them.
    ``depth`` is how many chunks one transfer keeps in flight (its pipeline depth).
    """

    def __init__(self, backend: DeviceBackend, chunk_bytes: int, depth: int = 4, keep: int = 16,
                 budget: PinnedBudget | None = None) -> None:
        if chunk_bytes < 1 or depth < 1:
            raise InvalidArgument("pinned staging needs chunk_bytes >= 1 and depth >= 1")
        self.backend = backend
        self.chunk_bytes = chunk_bytes
        self.depth = depth
        self.keep = keep
        self.budget = budget if budget is not None else PinnedBudget()
        self._free: list[np.ndarray] = []
        # (buffer, event, what the copy uses besides): given back before their copies finished
        self._pending: list[tuple[np.ndarray, Any, Any]] = []
        self._lock = threading.Lock()
        self.allocated = 0  # buffers pinned so far (reuse keeps this flat)
        self.released = 0  # buffers dropped beyond keep or the budget

    def take(self) -> np.ndarray:
        self.reap()
        with self._lock:
            if self._free:
                self.budget.release(self.chunk_bytes)
                return self._free.pop()
            self.allocated += 1
        return self.backend.pinned(self.chunk_bytes)

    def give(self, buf: np.ndarray, after: Any = None, hold: Any = None) -> None:
        """Return ``buf``; with ``after``, only once that event is done (``hold``, the
        device array the copy reads or writes, is kept alive until then too)."""
        if after is not None and not _finished(self.backend, after):
            with self._lock:
                self._pending.append((buf, after, hold))
            return
        self._keep(buf)
        self.reap()

    def reap(self) -> None:
        """Return the held buffers whose copies have completed."""
        if not self._pending:
            return
        with self._lock:
            finished = [_finished(self.backend, entry[1]) for entry in self._pending]
            done = [entry for entry, over in zip(self._pending, finished) if over]
            self._pending = [entry for entry, over in zip(self._pending, finished) if not over]
        for buf, _, _ in done:
            self._keep(buf)

    def _keep(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < self.keep and self.budget.reserve(self.chunk_bytes):
                self._free.append(buf)
                return
            self.released += 1  # dropped here: unpinned once the last view goes

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def pending(self) -> int:
        """Buffers given back whose copies have not completed yet."""
        return len(self._pending)


# -- the devices a server can use -----------------------------------------------

class Devices:
    """The GPU backends a server may use, asked in order, and their pinned
    staging pools. Each server owns one (``rendezvous.Server(devices=...)``);
    by default it holds :class:`CupyBackend`, which imports cupy only when a
    GPU tensor or a GPU placement appears. Tests pass
    ``Devices([FakeBackend()])``. Used from the loop and from copy threads.

    ``pinned_keep_bytes`` bounds the idle pinned memory all its pools keep
    together for reuse."""

    def __init__(self, backends: list[DeviceBackend] | None = None,
                 pinned_keep_bytes: int = PINNED_KEEP_BYTES) -> None:
        if backends is None:  # (imported here: cupy_backend imports .backend, which runs this package first)
            from rendezvous.devices.cupy_backend import CupyBackend
            backends = [CupyBackend()]
        self.backends: tuple[DeviceBackend, ...] = tuple(backends)
        self.budget = PinnedBudget(pinned_keep_bytes)
        self._pools: dict[tuple[int, int, int], PinnedPool] = {}
        # (backend, event, what its copy reads and writes): peer copies whose wait failed
        self._held: list[tuple[DeviceBackend, Any, tuple[Any, ...]]] = []
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        #: run once, when a GPU is first used here (see :meth:`when_used`)
        self._when_used: list[Callable[[], None]] | None = []

    def when_used(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when a GPU is first used here (a GPU tensor sent, a recv bound for a
        usable GPU), or now if one was: a host-only program never imports cupy."""
        if self._when_used is None:
            fn()
        else:
            self._when_used.append(fn)

    def _used(self) -> None:  # (what waits runs once: later calls find None)
        waiting, self._when_used = self._when_used, None
        for fn in waiting or ():
            fn()

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
                self._used()
                return b
        return None

    def pool(self, backend: DeviceBackend, chunk_bytes: int, depth: int) -> PinnedPool:
        """The pinned pool of ``backend`` for this chunk size, shared by this server's transfers."""
        key = (id(backend), chunk_bytes, depth)
        with self._lock:
            p = self._pools.get(key)
            if p is None:
                p = self._pools[key] = PinnedPool(backend, chunk_bytes, depth, budget=self.budget)
        p.reap()
        return p

    def import_tensor(self, obj: Any) -> np.ndarray | DeviceTensor:
        """What ``send`` stores: a numpy array for host data, a :class:`DeviceTensor` for
        GPU data. Typed by protocol (see :func:`import_device`), then DLPack on the CPU,
        then anything numpy can view. A tensor that records gradients (torch's
        ``requires_grad``) is detached first: its bytes are what is sent. Call on the
        producer's thread: the ready event goes on that thread's current stream."""
        if type(obj) is np.ndarray:
            return as_array(obj)
        if isinstance(obj, DeviceTensor):
            return obj
        obj = _without_grad(obj)
        backend = self.backend_for(obj)
        if backend is not None:
            tensor = import_device(backend, obj)
            self._used()
            return tensor
        return import_host(obj)

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message)

    def resolve(self, placement: Placement, explicit: bool) -> tuple[Placement, DeviceBackend | None]:
        """The placement that will be used and the backend for it (None for the host).

        A GPU placement without a usable GPU backend falls back to the host (with one
        warning per server) when it came from the key, and fails when it was asked
        for explicitly. A GPU that does not exist on this host fails either way
        (FailedPrecondition naming how many there are), before anything is received."""
        if not placement.is_gpu:
            return CPU, None
        backend = self.gpu_backend()
        if backend is None:
            if explicit:
                raise FailedPrecondition(f"recv onto {placement} needs a GPU and cupy (rendezvous[gpu])")
            self._warn_once("no-gpu", f"key names {placement} but no GPU backend is usable here; "
                                      "GPU-bound tensors are received as numpy arrays")
            return CPU, None
        count = backend.device_count()
        if placement.index >= count:
            where = "the key's dst_device" if not explicit else "the device asked for"
            raise FailedPrecondition(f"{where} is {placement}, which does not exist: this host has {count} "
                                     f"GPU{'s' if count != 1 else ''} ({backend.name}), GPU:0 to GPU:{count - 1}")
        return placement, backend

    def place(self, value: Any, placement: Placement, explicit: bool, pool_args: tuple[int, int]) -> Any:
        """``value`` (numpy array or DeviceTensor, as a table or a reply gave it) where
        ``placement`` says. Blocking copies; run off the loop for large tensors.
        ``pool_args`` is (staging chunk bytes, depth).

        A DeviceTensor goes to another GPU of its backend directly when the pair has
        peer access (:meth:`DeviceBackend.to_peer`), else through pinned host memory;
        to the host through pinned memory; on its own GPU it is handed over as it is."""
        self.reap()
        if value is None:
            return None
        target, backend = self.resolve(placement, explicit)
        if isinstance(value, DeviceTensor):
            if target.is_gpu and backend is value.backend:
                if target.index == value.device:
                    value.backend.event_wait(value.ready)
                    return value.backend.user_array(value.array)
                if backend.can_access_peer(value.device, target.index):
                    return backend.user_array(self._to_peer(value, target.index))
            host = value.backend.to_host(value, self.pool(value.backend, *pool_args))
            if not target.is_gpu:
                return host
            value = host
        if not target.is_gpu or backend is None:
            return value
        if getattr(value, "dtype", None) == np.dtype(object):
            return value  # strings have no device form: they stay on the host
        return backend.user_array(backend.from_host(value, target.index, self.pool(backend, *pool_args)))

    def _to_peer(self, src: DeviceTensor, device: int) -> Any:
        """``src`` copied onto GPU ``device`` by its backend's peer copy; blocks until the
        bytes are there. If the copy fails, or the wait does while the copy may still
        run, the error says which copy it was, and ``src`` and the destination are
        held until the copy's event is done (never freed under a pending copy)."""
        backend = src.backend
        moved: DeviceTensor | None = None
        try:
            moved = backend.to_peer(src, device)
            backend.event_wait(moved.ready)
        except BaseException as exc:
            if moved is not None and not _finished(backend, moved.ready):
                with self._lock:
                    self._held.append((backend, moved.ready, (src, moved)))
            exc.add_note(f"while copying {src.nbytes} bytes GPU:{src.device} -> GPU:{device} "
                         f"directly (peer access, {backend.name})")
            raise
        return moved.array

    def reap(self) -> None:
        """Let go of the tensors held for peer copies that have since finished."""
        if not self._held:
            return
        with self._lock:
            held, self._held = self._held, []
        still = [entry for entry in held if not _finished(entry[0], entry[1])]
        if still:
            with self._lock:
                self._held.extend(still)

    @property
    def held(self) -> int:
        """Peer copies whose tensors are held because their wait failed (not done yet)."""
        return len(self._held)

    def needs_copy(self, value: Any, placement: Placement, explicit: bool) -> bool:
        """Whether :meth:`place` would move bytes (so the caller runs it off the loop)."""
        if value is None:
            return False
        target, backend = self.resolve(placement, explicit)
        if isinstance(value, DeviceTensor):
            return not (target.is_gpu and target.index == value.device and backend is value.backend)
        return target.is_gpu and backend is not None and getattr(value, "dtype", None) != np.dtype(object)


def _finished(backend: DeviceBackend, event: Any) -> bool:
    """Whether the work before ``event`` is over, failed or not: an event whose
    query fails (the copy before it failed, or a broken context, where nothing
    will run any more) counts as done, so what the work used may be let go."""
    try:
        return backend.event_done(event)
    except Exception:
        return True


def _without_grad(obj: Any) -> Any:
    """``obj`` detached from autograd if it records gradients (torch refuses to
    export such a tensor through DLPack, the CUDA array interface or numpy);
    the detached tensor shares its memory, so nothing is copied."""
    if getattr(obj, "requires_grad", False) is not True:
        return obj
    detach = getattr(obj, "detach", None)
    if not callable(detach):
        raise InvalidArgument(f"{type(obj).__name__} requires grad and has no detach(): "
                              "send tensor.detach() instead")
    return detach()


def _dlpack_device(obj: Any) -> tuple[int, int] | None:
    """``obj.__dlpack_device__()`` as (device type, id), or None if it has none."""
    dev = getattr(obj, "__dlpack_device__", None)
    if not callable(dev) or not callable(getattr(obj, "__dlpack__", None)):
        return None
    kind, index = dev()
    return int(kind), int(index)


def import_device(backend: DeviceBackend, obj: Any) -> DeviceTensor:
    """``obj`` (recognized by ``backend``) as a :class:`DeviceTensor` whose ready event,
    recorded on the caller's current stream, follows the producer's work.

    The order of protocols, and why:

    1. the backend's own array: produced on the caller's current stream (the
       library's convention), nothing to order;
    2. DLPack on a CUDA device, asked with the caller's stream: the exporter
       makes that stream wait for its own (torch does). DLPack comes before the
       CUDA array interface because torch exports the interface as version 2,
       which names no stream;
    3. CUDA array interface version 3 with ``stream``: the caller's stream
       waits for that stream on the GPU (None: the exporter says no wait is
       needed);
    4. CUDA array interface without a stream (version 2, or 3 without the
       entry): the producer's stream is unknown, so the device is synchronized
       before the event is recorded. Correct, and as slow as it sounds.

    An exporter whose ``__dlpack__`` takes no ``stream`` is treated like 4.
    """
    if backend.is_native(obj):
        return backend.wrap(obj)
    dl = _dlpack_device(obj)
    if dl is not None and dl[0] in KDL_GPU_KINDS:
        device = dl[1]
        try:
            capsule = obj.__dlpack__(stream=backend.current_stream(device))
        except TypeError:  # an exporter from before the stream argument: it cannot order our stream
            capsule = obj.__dlpack__()
            backend.synchronize(device)
        return backend.wrap(backend.from_dlpack(capsule, device))
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        array = backend.from_cai(obj)
        device = backend.device_of(array)
        if int(cai.get("version", 0)) >= 3 and "stream" in cai:
            stream = cai["stream"]
            if stream is not None:
                if int(stream) == 0:
                    raise InvalidArgument("__cuda_array_interface__ stream 0 is disallowed (ambiguous): "
                                          "use 1 for the legacy default stream, 2 for the per-thread one")
                backend.wait_stream(device, int(stream))
        else:
            backend.synchronize(device)
        return backend.wrap(array)
    return backend.wrap(obj)


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
