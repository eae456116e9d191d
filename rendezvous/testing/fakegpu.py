"""A GPU backend in host memory, for testing without CUDA.

:class:`FakeBackend` implements :class:`rendezvous.devices.DeviceBackend`
with host memory standing in for device memory and threads standing in for
CUDA streams, so everything above the backend (placement, the staging
pipelines over real MPI, stream ordering, pinned-buffer reuse, the default
path's host copies) runs and is tested on machines without a GPU. What it
cannot test is cupy and CUDA themselves.

It is built to *fail* where a real GPU would give wrong data, and to fail
every time rather than now and then:

* streams are threads running their work in order, later, never at the call;
  a kernel may be held at a gate (a :class:`threading.Event` the test sets),
  so "the producer is not finished yet" is a state a test sets up, not a race;
* device memory comes from a per-device pool that, like cupy's, hands a freed
  block back to the next allocation *on the stream that allocated it*, at
  once: a copy that writes such a block before work still queued on that
  stream has read it corrupts what that work reads;
* copies hold the raw memory they read and write, never the arrays or
  buffers, so dropping an array or a pinned buffer while its copy is pending
  frees it for reuse, as CUDA would (and records a :attr:`violations` entry);
* pinned host memory is its own type (:class:`FakePinned`); a copy given
  anything else raises, as the staging path must only hand pinned memory to
  the copy engines; freed pinned memory is handed out again;
* foreign tensors (:class:`FakeForeignTensor`, torch-like) export the CUDA
  array interface (version 2 without a stream, or 3 with one) and DLPack
  with a stream argument, and refuse both while they require grad;
* there are two devices by default, each with a default stream, side streams
  (:meth:`FakeBackend.new_stream`) and one copy stream per direction (device
  to host, host to device, and "peer": from another device into this one);
* which pairs of devices have peer access is configurable (``peer``: every
  pair by default); a peer copy between devices without it raises and records
  a violation, so a placement that takes the wrong path fails;
  :attr:`FakeBackend.peer_copies` and :attr:`FakeBackend.host_bounces` say
  which path a GPU-to-GPU placement took;
* a copy can fail on its stream (:attr:`FakeBackend.peer_faults`, and
  :attr:`FakeBackend.copy_faults` for the copies through pinned memory, say
  chunk k of n): its event completes with the error, and both polling it
  (:meth:`FakeBackend.event_done`) and waiting for it raise the error, as
  ``cudaEventQuery`` and ``cudaEventSynchronize`` report an asynchronous
  error; a failed copy leaves its destination unwritten.

:meth:`FakeBackend.settle` waits, without sleeping, until every stream is
idle or blocked (at a gate, or on an event not yet done): after it, whatever
could run has run.

    import rendezvous
    from rendezvous.devices import Devices
    from rendezvous.testing.fakegpu import FakeBackend
    fake = FakeBackend()
    server = rendezvous.Server(cluster, "worker", 0, devices=Devices([fake]))  # GPU placements use it
"""

from __future__ import annotations

import contextlib
import itertools
import math
import queue
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from rendezvous.devices import (
    KDL_CUDA,
    STREAM_LEGACY,
    STREAM_PER_THREAD,
    DeviceBackend,
    DeviceTensor,
    PinnedPool,
)
from rendezvous.codec.tensors import TensorMeta

__all__ = [
    "FakeBackend",
    "FakeCudaError",
    "FakeDeviceArray",
    "FakeEvent",
    "FakeForeignTensor",
    "FakePinned",
    "FakeStream",
]

class FakeCudaError(RuntimeError):
    """What CUDA would report (an invalid device ordinal, a copy from pageable memory)."""


class FakeEvent:
    """A CUDA event: done once the work queued before it on its stream has run."""

    __slots__ = ("_fake", "_flag", "error")

    def __init__(self, fake: FakeBackend) -> None:
        self._flag = threading.Event()
        self._fake = fake
        self.error: BaseException | None = None  # what the work before it raised on its stream

    def set(self) -> None:
        self._flag.set()
        self._fake.changed()

    def is_set(self) -> bool:
        return self._flag.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._flag.wait(timeout)


class FakeStream:
    """An in-order queue of work on its own thread, like a CUDA stream.

    ``handle`` is what the CUDA array interface and DLPack would carry for it.
    """

    def __init__(self, fake: FakeBackend, device: int, handle: int, name: str) -> None:
        self.fake = fake
        self.device = device
        self.handle = handle
        self.name = name
        self._q: Any = queue.SimpleQueue()
        self.pending = 0  # items queued and not finished (under fake._cond)
        self.blocked_on: Any = None  # the gate or event the running item waits for
        self._thread = threading.Thread(target=self._run, name=f"fake-gpu{device}-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            kind, what, done, after = self._q.get()
            if kind in ("wait", "gate") and not what.is_set():
                with self.fake._cond:
                    self.blocked_on = what
                    self.fake._cond.notify_all()
                what.wait()
                with self.fake._cond:
                    self.blocked_on = None
            try:
                if kind == "work":
                    what()
                elif kind == "gated":
                    gate, fn = what
                    if not gate.is_set():
                        with self.fake._cond:
                            self.blocked_on = gate
                            self.fake._cond.notify_all()
                        gate.wait()
                        with self.fake._cond:
                            self.blocked_on = None
                    fn()
            except Exception as exc:  # a failed copy or kernel: reported by waiting for its event
                done.error = exc
            if after is not None:
                after()
            with self.fake._cond:
                self.pending -= 1
            done.set()  # notifies
            del what, done, after  # hold nothing of a finished item (a waiting thread is not a CUDA stream)

    def _put(self, kind: str, what: Any, after: Callable[[], None] | None = None) -> FakeEvent:
        done = FakeEvent(self.fake)
        with self.fake._cond:
            self.pending += 1
        self._q.put((kind, what, done, after))
        return done

    def enqueue(self, fn: Callable[[], Any], gate: threading.Event | None = None,
                after: Callable[[], None] | None = None) -> FakeEvent:
        """Run ``fn`` after the work queued before it (and, with ``gate``, once the
        gate is set); an event done when it has run."""
        if gate is not None:
            return self._put("gated", (gate, fn), after)
        return self._put("work", fn, after)

    def wait_event(self, event: Any) -> None:
        """Work queued after this runs once ``event`` is done (cudaStreamWaitEvent)."""
        self._put("wait", event)

    def hold(self, gate: threading.Event) -> FakeEvent:
        """Nothing queued after this runs before ``gate`` is set (a busy engine)."""
        return self._put("gate", gate)

    def record(self) -> FakeEvent:
        return self._put("work", _nothing)

    def settled(self) -> bool:
        """Idle, or waiting for something not done yet (call under fake._cond)."""
        return self.pending == 0 or (self.blocked_on is not None and not self.blocked_on.is_set())

    def __repr__(self) -> str:
        return f"FakeStream(GPU:{self.device}, {self.name}, handle {self.handle})"


def _nothing() -> None:
    pass


class _Block:
    """A piece of "device memory": host bytes at a fake device address."""

    __slots__ = ("address", "device", "freed", "nbytes", "storage", "stream", "users")

    def __init__(self, address: int, device: int, stream: FakeStream, nbytes: int) -> None:
        self.address = address
        self.device = device
        self.stream = stream  # the stream it was allocated on: its free list
        self.nbytes = nbytes
        self.storage = np.empty(max(nbytes, 1), np.uint8)
        self.users: Counter = Counter()  # stream -> queued work reading or writing it
        self.freed = False


class _PinnedBlock:
    __slots__ = ("live", "nbytes", "storage", "users")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.storage = np.empty(max(nbytes, 1), np.uint8)
        self.users = 0  # copies queued on it
        self.live = True


class FakePinned(np.ndarray):
    """Page-locked host memory of the fake: a numpy array type of its own, so a
    copy can tell it from pageable memory. Views keep the allocation alive."""

    _pinned_block: _PinnedBlock | None

    def __array_finalize__(self, obj: Any) -> None:
        self._pinned_block = getattr(obj, "_pinned_block", None)


class FakeDeviceArray:
    """Host memory standing in for a GPU array: it exports no buffer, DLPack or CUDA
    array interface, so nothing but :class:`FakeBackend` can read it; ``get()``
    copies it out as cupy's does (on the current stream, waiting for it)."""

    def __init__(self, fake: FakeBackend, block: _Block, dtype: Any, shape: tuple[int, ...],
                 offset: int = 0, owner: Any = None) -> None:
        self._fake = fake
        self._block = block
        self._offset = offset
        self._dtype = np.dtype(dtype)
        self._shape = tuple(int(d) for d in shape)
        self._owner = owner  # what keeps the memory of an imported view allocated
        self.device = block.device

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def nbytes(self) -> int:
        return math.prod(self._shape) * self._dtype.itemsize

    @property
    def address(self) -> int:
        return self._block.address + self._offset

    @property
    def _data(self) -> np.ndarray:
        """The bytes, typed, written at once from the host (tests' stand-in for a kernel)."""
        return self._fake.raw(self)

    def get(self) -> np.ndarray:
        out = np.empty(self._shape, self._dtype)
        raw = self._fake.raw(self)
        stream = self._fake.current(self.device)
        self._fake.event_wait(self._fake._launch(stream, lambda: out.__setitem__(..., raw), [self._block]))
        return out

    def __repr__(self) -> str:
        return f"FakeDeviceArray(GPU:{self.device}, {self.dtype}{list(self.shape)})"


class _FakeCapsule:
    """What a fake ``__dlpack__`` returns: the memory it exports, consumable once."""

    def __init__(self, array: FakeDeviceArray, owner: Any) -> None:
        self.array: FakeDeviceArray | None = array
        self.owner = owner


class FakeForeignTensor:
    """A tensor of another GPU library on the fake GPU, written on ``stream``
    (its producer's stream), exporting it as torch or numba would:

    * ``cai_version`` 2: ``__cuda_array_interface__`` names no stream (torch);
      3: it carries ``stream`` (the producer's handle, or None when
      ``cai_stream_none``); None: no CUDA array interface at all;
    * ``dlpack``: ``__dlpack__(stream=S)`` makes stream S wait for the
      producer's stream, as torch does (``stream_arg=False``: an old exporter
      whose ``__dlpack__`` takes no stream);
    * ``requires_grad``: both exports raise RuntimeError, as torch's do;
      ``detach()`` gives one that does not.
    """

    def __init__(self, array: FakeDeviceArray, stream: FakeStream, cai_version: int | None = 2,
                 dlpack: bool = True, requires_grad: bool = False, cai_stream_none: bool = False,
                 stream_arg: bool = True) -> None:
        self._array = array
        self._stream = stream
        self._cai_version = cai_version
        self._dlpack = dlpack
        self._cai_stream_none = cai_stream_none
        self._stream_arg = stream_arg
        self.requires_grad = requires_grad
        self.exports: list[str] = []  # how it was taken: "cai", "dlpack(stream=S)"

    @property
    def dtype(self) -> np.dtype:
        return self._array.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self._array.shape

    @property
    def device(self) -> int:
        return self._array.device

    def detach(self) -> FakeForeignTensor:
        return FakeForeignTensor(self._array, self._stream, self._cai_version, self._dlpack, False,
                                 self._cai_stream_none, self._stream_arg)

    def __getattr__(self, name: str) -> Any:
        if name == "__cuda_array_interface__" and self._cai_version is not None:
            if self.requires_grad:
                raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad. "
                                   "If gradients aren't required, use var.detach() to get Variable that "
                                   "doesn't require grad.")
            self.exports.append("cai")
            cai: dict[str, Any] = {"shape": self.shape, "typestr": self.dtype.str, "strides": None,
                                   "data": (self._array.address, False), "version": self._cai_version}
            if self._cai_version >= 3:
                cai["stream"] = None if self._cai_stream_none else self._stream.handle
            return cai
        if name == "__dlpack__" and self._dlpack:
            return self._export if self._stream_arg else (lambda: self._export(None))
        if name == "__dlpack_device__" and self._dlpack:
            return lambda: (KDL_CUDA, self.device)
        raise AttributeError(name)

    def _export(self, stream: int | None = None) -> _FakeCapsule:
        if self.requires_grad:
            raise RuntimeError("Can't export tensors that require gradient, use tensor.detach()")
        self.exports.append(f"dlpack(stream={stream})")
        if stream is not None and stream != -1:
            consumer = self._array._fake.stream_for(stream, self.device)
            if consumer is not self._stream:
                consumer.wait_event(self._stream.record())
        return _FakeCapsule(self._array, self)


class FakeBackend(DeviceBackend):
    """A GPU backend in host memory, for testing staging and placement without CUDA.

    Each device has a default stream (``stream(device)``, handle 1: what a
    producer's kernels run on unless a test makes another current with
    :meth:`using`), side streams from :meth:`new_stream`, and one copy stream
    per direction; all run their work in order on a thread of their own, so
    copies are really asynchronous and an event is only done once its work
    has run. ``pinned_allocs``, ``copies``, ``peer_copies``, ``host_bounces`` and
    ``violations`` say what happened.

    ``peer``: the (source, destination) pairs of devices with peer access;
    None (the default) for every pair of distinct devices.
    """

    name = "fake"

    def __init__(self, devices: int = 2, peer: set[tuple[int, int]] | None = None) -> None:
        self.devices = devices
        self.peer = None if peer is None else {(int(a), int(b)) for a, b in peer}
        self._cond = threading.Condition()
        self._lock = threading.RLock()
        self._handles = itertools.count(16)
        self._addresses = itertools.count(1)
        self._default: dict[int, FakeStream] = {}
        self._copy: dict[tuple[int, str], FakeStream] = {}
        self._by_handle: dict[int, FakeStream] = {}
        self._streams: list[FakeStream] = []
        self._local = threading.local()
        self._free: dict[tuple[int, int, int], list[_Block]] = {}  # (device, stream handle, nbytes)
        self._live: dict[int, _Block] = {}  # address -> block in use
        self._pinned_free: dict[int, list[_PinnedBlock]] = {}
        self.pinned_allocs = 0
        self.pinned_live_bytes = 0
        self.copies = {"d2h": 0, "h2d": 0}  # chunks copied through pinned memory
        self.peer_copies = 0  # tensors copied device to device (peer_async, run)
        self.host_bounces = 0  # device tensors copied to the host, then onto a device
        #: errors the next peer copies raise on their stream, in order (a copy that fails)
        self.peer_faults: list[BaseException] = []
        #: by direction ("d2h", "h2d"), what the next chunk copies through pinned
        #: memory do, in order: None, run; an error, fail on their stream with it
        #: (``[None, None, err]``: the third copy fails)
        self.copy_faults: dict[str, list[BaseException | None]] = {"d2h": [], "h2d": []}
        self._to_host_results: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
        self.synchronizes = 0
        self.host_waiting = 0  # host threads blocked in event_wait / synchronize
        self.violations: list[str] = []

    # -- streams -------------------------------------------------------------

    def _check_device(self, device: int) -> None:
        if not 0 <= device < self.devices:
            raise FakeCudaError(f"cudaErrorInvalidDevice: invalid device ordinal {device} "
                                f"(the fake has {self.devices})")

    def _new(self, device: int, name: str, handle: int | None = None) -> FakeStream:
        s = FakeStream(self, device, next(self._handles) if handle is None else handle, name)
        self._streams.append(s)
        if handle is None:
            self._by_handle[s.handle] = s
        return s

    def stream(self, device: int = 0) -> FakeStream:
        """The default stream of ``device`` (handle 1, the legacy default stream)."""
        self._check_device(device)
        with self._lock:
            s = self._default.get(device)
            if s is None:
                s = self._default[device] = self._new(device, "default", STREAM_LEGACY)
            return s

    def new_stream(self, device: int = 0) -> FakeStream:
        """A side stream (a ``cudaStream_t`` of its own)."""
        self._check_device(device)
        with self._lock:
            return self._new(device, "side")

    def copy_stream(self, device: int, direction: str) -> FakeStream:
        """The copy stream for ``direction`` ("d2h", "h2d" or "peer") of ``device``."""
        with self._lock:
            s = self._copy.get((device, direction))
            if s is None:
                s = self._copy[(device, direction)] = self._new(device, direction)
            return s

    def stream_for(self, handle: int, device: int) -> FakeStream:
        if handle in (STREAM_LEGACY, STREAM_PER_THREAD):
            return self.stream(device)
        with self._lock:
            s = self._by_handle.get(handle)
        if s is None:
            raise FakeCudaError(f"cudaErrorInvalidResourceHandle: no stream {handle:#x}")
        return s

    def current(self, device: int) -> FakeStream:
        """The calling thread's current stream on ``device``."""
        current = getattr(self._local, "streams", {}).get(device)
        return current if current is not None else self.stream(device)

    @contextlib.contextmanager
    def using(self, stream: FakeStream) -> Iterator[FakeStream]:
        """Make ``stream`` current on its device for this thread (``with cupy.cuda.Stream``)."""
        streams = self._local.__dict__.setdefault("streams", {})
        before = streams.get(stream.device)
        streams[stream.device] = stream
        try:
            yield stream
        finally:
            streams[stream.device] = before

    def changed(self) -> None:
        """Wake :meth:`wait_until` (a test's worker thread calls it when it finishes)."""
        with self._cond:
            self._cond.notify_all()

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
        """Wait, woken by every change of the fake's state, until ``predicate()``."""
        with self._cond:
            if not self._cond.wait_for(predicate, timeout):
                raise AssertionError(f"fake GPU: {what} not reached in {timeout}s")

    def settle(self, timeout: float = 10.0) -> None:
        """Return once every stream is idle or blocked on a gate or an event not done."""
        self.wait_until(lambda: all(s.settled() for s in list(self._streams)), timeout, "streams settled")

    # -- kernels and memory ------------------------------------------------------

    def raw(self, array: FakeDeviceArray) -> np.ndarray:
        """The bytes of ``array`` as a typed numpy view of its block, which does not
        keep ``array`` alive (a kernel's pointer)."""
        start = array._offset
        flat = array._block.storage[start:start + array.nbytes]
        return flat.view(array.dtype).reshape(array.shape)

    def _launch(self, stream: FakeStream, fn: Callable[[], Any], blocks: list[_Block],
                gate: threading.Event | None = None) -> FakeEvent:
        with self._lock:
            for b in blocks:
                b.users[stream] += 1

        def release() -> None:
            with self._lock:
                for b in blocks:
                    b.users[stream] -= 1
        return stream.enqueue(fn, gate=gate, after=release)

    def launch(self, fn: Callable[..., Any], *arrays: FakeDeviceArray, stream: FakeStream | None = None,
               gate: threading.Event | None = None) -> FakeEvent:
        """A "kernel": ``fn(*raw views of arrays)`` on ``stream`` (default: the current
        stream of the first array's device), held until ``gate`` is set when given.
        It holds the arrays' memory, not the arrays: dropping one frees its block."""
        if stream is None:
            stream = self.current(arrays[0].device if arrays else 0)
        views = [self.raw(a) for a in arrays]
        return self._launch(stream, lambda: fn(*views), [a._block for a in arrays], gate)

    def _alloc(self, nbytes: int, device: int) -> FakeDeviceArray:
        self._check_device(device)
        stream = self.current(device)
        with self._lock:
            free = self._free.get((device, stream.handle, nbytes))
            if free:
                block = free.pop()  # cupy's pool: a block freed on this stream, at once
                block.freed = False
            else:
                block = _Block(next(self._addresses) << 32, device, stream, nbytes)  # 4 GiB apart
            self._live[block.address] = block
        arr = FakeDeviceArray(self, block, np.uint8, (nbytes,))
        weakref.finalize(arr, self._release, block)
        return arr

    def _release(self, block: _Block) -> None:
        with self._lock:
            others = [s for s, n in block.users.items() if n > 0 and s is not block.stream]
            if others:
                self.violations.append(f"device block {block.address:#x} freed while {others[0]} still "
                                       "reads or writes it (reusable on its allocating stream at once)")
            block.freed = True
            self._live.pop(block.address, None)
            self._free.setdefault((block.device, block.stream.handle, block.nbytes), []).append(block)

    def device_bytes(self, device: int) -> int:
        """Bytes of device memory allocated on ``device`` and not freed."""
        with self._lock:
            return sum(b.nbytes for b in self._live.values() if b.device == device)

    def array(self, data: Any, device: int = 0) -> FakeDeviceArray:
        """A device array holding ``data``, written on the current stream (waited for)."""
        host = np.ascontiguousarray(np.asarray(data))
        arr = self.empty(TensorMeta(host.dtype, host.shape), device)
        raw = self.raw(arr)
        self.event_wait(self._launch(self.current(device), lambda: raw.__setitem__(..., host), [arr._block]))
        return arr

    def foreign(self, data: Any, device: int = 0, stream: FakeStream | None = None, **exports: Any
                ) -> tuple[FakeForeignTensor, FakeDeviceArray]:
        """A torch-like tensor of ``data``'s shape and dtype on ``stream`` (default: a
        new side stream), and its memory; the test writes it with a (gated) kernel."""
        host = np.asarray(data)
        stream = stream if stream is not None else self.new_stream(device)
        with self.using(stream):
            arr = self.empty(TensorMeta(host.dtype, host.shape), device)
        return FakeForeignTensor(arr, stream, **exports), arr

    # -- the DeviceBackend contract -----------------------------------------------

    def recognizes(self, obj: Any) -> bool:
        return isinstance(obj, (FakeDeviceArray, FakeForeignTensor))

    def available(self) -> bool:
        return self.devices > 0

    def device_count(self) -> int:
        return self.devices

    def is_native(self, obj: Any) -> bool:
        return isinstance(obj, FakeDeviceArray)

    def wrap(self, obj: Any) -> DeviceTensor:
        if not isinstance(obj, FakeDeviceArray):
            obj = self._import_like_cupy(obj)
        return DeviceTensor(obj, self, obj.device, self.record(obj.device))

    def _import_like_cupy(self, obj: Any) -> FakeDeviceArray:
        """A foreign object imported the way cupy does on its own (``asarray``: the
        CUDA array interface first, synchronizing the host on a version 3 stream
        only; else ``from_dlpack`` with the current stream)."""
        cai = getattr(obj, "__cuda_array_interface__", None)
        if cai is not None:
            arr = self.from_cai(obj)
            if cai.get("version", 0) >= 3 and cai.get("stream") is not None:
                self.event_wait(self.stream_for(int(cai["stream"]), arr.device).record())
            return arr
        device = obj.__dlpack_device__()[1]
        return self.from_dlpack(obj.__dlpack__(stream=self.current_stream(device)), device)

    def current_stream(self, device: int) -> int:
        return self.current(device).handle

    def wait_stream(self, device: int, stream: int) -> None:
        producer = self.stream_for(stream, device)
        consumer = self.current(device)
        if producer is not consumer:
            consumer.wait_event(producer.record())

    def synchronize(self, device: int) -> None:
        self.synchronizes += 1
        for s in [s for s in list(self._streams) if s.device == device]:
            self.event_wait(s.record())

    def from_dlpack(self, capsule: Any, device: int) -> FakeDeviceArray:
        if not isinstance(capsule, _FakeCapsule) or capsule.array is None:
            raise FakeCudaError("not a fake DLPack capsule, or one already consumed")
        arr, capsule.array = capsule.array, None
        return FakeDeviceArray(self, arr._block, arr.dtype, arr.shape, arr._offset, owner=capsule.owner)

    def from_cai(self, obj: Any) -> FakeDeviceArray:
        cai = obj.__cuda_array_interface__
        address = int(cai["data"][0])
        dtype = np.dtype(cai["typestr"])
        shape = tuple(int(d) for d in cai["shape"])
        if cai.get("strides") not in (None, tuple(np.empty(shape, dtype).strides)):
            raise FakeCudaError("the fake imports C-contiguous CUDA array interfaces only")
        with self._lock:
            for base, block in self._live.items():
                if base <= address < base + max(block.nbytes, 1):
                    break
            else:
                raise FakeCudaError(f"cudaErrorInvalidValue: {address:#x} is not fake device memory")
        return FakeDeviceArray(self, block, dtype, shape, address - base, owner=obj)

    def device_of(self, array: Any) -> int:
        return array.device

    def empty(self, meta: TensorMeta, device: int) -> Any:
        arr = self._alloc(meta.nbytes, device)
        arr._dtype, arr._shape = np.dtype(meta.dtype), tuple(meta.shape)
        return arr

    def record(self, device: int) -> FakeEvent:
        return self.current(device).record()

    def _pinned_span(self, host: np.ndarray) -> tuple[_PinnedBlock, np.ndarray]:
        block = getattr(host, "_pinned_block", None) if isinstance(host, FakePinned) else None
        if block is None or not block.live:
            self.violations.append(f"an asynchronous copy was given {type(host).__name__} host memory "
                                   "that is not pinned")
            raise FakeCudaError("host buffer of an asynchronous copy is not pinned memory (from pinned())")
        offset = host.__array_interface__["data"][0] - block.storage.__array_interface__["data"][0]
        return block, block.storage[offset:offset + host.nbytes]

    def _copy_on(self, stream: FakeStream, direction: str, block: _Block, dev: np.ndarray,
                 pblock: _PinnedBlock, host: np.ndarray) -> FakeEvent:
        with self._lock:
            block.users[stream] += 1
            pblock.users += 1
            faults = self.copy_faults[direction]
            fault = faults.pop(0) if faults else None

        def copy() -> None:
            if fault is not None:
                raise fault
            if direction == "d2h":
                host[:] = dev
            else:
                dev[:] = host
            self.copies[direction] += 1

        def release() -> None:
            with self._lock:
                block.users[stream] -= 1
                pblock.users -= 1
        return stream.enqueue(copy, after=release)

    def d2h_async(self, src: DeviceTensor, start: int, host: np.ndarray) -> Any:
        pblock, raw_host = self._pinned_span(host)
        stream = self.copy_stream(src.device, "d2h")
        stream.wait_event(src.ready)
        arr = src.array
        base = arr._offset + start
        return self._copy_on(stream, "d2h", arr._block, arr._block.storage[base:base + host.nbytes], pblock,
                             raw_host)

    def h2d_async(self, host: np.ndarray, dst: Any, device: int, start: int, after: Any = None) -> Any:
        pblock, raw_host = self._pinned_span(host)
        stream = self.copy_stream(device, "h2d")
        if after is not None:
            stream.wait_event(after)
        base = dst._offset + start
        return self._copy_on(stream, "h2d", dst._block, dst._block.storage[base:base + host.nbytes], pblock,
                             raw_host)

    def can_access_peer(self, src: int, dst: int) -> bool:
        self._check_device(src)
        self._check_device(dst)
        return src != dst and (self.peer is None or (src, dst) in self.peer)

    def peer_async(self, src: DeviceTensor, dst: Any, device: int, after: Any = None) -> Any:
        if not self.can_access_peer(src.device, device):
            self.violations.append(f"a peer copy GPU:{src.device} -> GPU:{device} was asked for "
                                   "without peer access between them")
            raise FakeCudaError(f"cudaErrorPeerAccessNotEnabled: no peer access GPU:{src.device} -> GPU:{device}")
        if dst.device != device or dst.nbytes != src.nbytes:
            raise FakeCudaError("cudaErrorInvalidValue: the peer copy's destination is not "
                                f"{src.nbytes} bytes on GPU:{device}")
        stream = self.copy_stream(device, "peer")
        stream.wait_event(src.ready)
        if after is not None:
            stream.wait_event(after)
        fault = self.peer_faults.pop(0) if self.peer_faults else None
        s_block, d_block = src.array._block, dst._block
        s_raw = s_block.storage[src.array._offset:src.array._offset + src.nbytes]
        d_raw = d_block.storage[dst._offset:dst._offset + src.nbytes]

        def copy() -> None:
            if fault is not None:
                raise fault
            d_raw[:] = s_raw
            with self._lock:
                self.peer_copies += 1
        return self._launch(stream, copy, [s_block, d_block])

    def to_host(self, src: DeviceTensor, pool: PinnedPool, out: np.ndarray | None = None) -> np.ndarray:
        out = super().to_host(src, pool, out)
        self._to_host_results[id(out)] = out  # a from_host of this very array is a host bounce
        return out

    def from_host(self, host: np.ndarray, device: int, pool: PinnedPool) -> Any:
        if self._to_host_results.get(id(host)) is host:
            self.host_bounces += 1
        return super().from_host(host, device, pool)

    def event_done(self, event: Any) -> bool:
        if not event.is_set():
            return False
        if event.error is not None:
            raise event.error  # what cudaEventQuery reports for work that failed
        return True

    def event_wait(self, event: Any) -> None:
        if not event.is_set():
            with self._cond:
                self.host_waiting += 1
                self._cond.notify_all()
            try:
                event.wait()
            finally:
                with self._cond:
                    self.host_waiting -= 1
        if event.error is not None:
            raise event.error

    def pinned(self, nbytes: int) -> np.ndarray:
        with self._lock:
            free = self._pinned_free.get(nbytes)
            block = free.pop() if free else _PinnedBlock(nbytes)  # freed pinned memory is handed out again
            block.live = True
            self.pinned_allocs += 1
            self.pinned_live_bytes += nbytes
        handle = block.storage[:nbytes].view(FakePinned)
        handle._pinned_block = block
        weakref.finalize(handle, self._unpin, block)
        return handle

    def _unpin(self, block: _PinnedBlock) -> None:
        with self._lock:
            if block.users:
                self.violations.append(f"a pinned buffer of {block.nbytes} bytes was freed while "
                                       f"{block.users} copies on it were pending")
            block.live = False
            self.pinned_live_bytes -= block.nbytes
            self._pinned_free.setdefault(block.nbytes, []).append(block)

    def user_array(self, array: Any) -> Any:
        return array

    def mpi_buffer(self, array: Any, start: int, stop: int) -> Any:
        # Only with RENDEZVOUS_CUDA_AWARE=1: the fake's "device" memory is host memory.
        base = array._offset
        return memoryview(array._block.storage[base:base + array.nbytes])[start:stop]
