"""What both local clients do, whatever way they wait.

The blocking :class:`rendezvous.client.Client` and the asyncio
:class:`rendezvous.client.aio.Client` make the same decisions: whether a
send goes through a lent pool segment or inside the frame, asking for a
segment when the client has none, how a reply becomes an array, what is
counted (a frame that answers no caller: :mod:`rendezvous.client.link`; GPU
tensors: :mod:`rendezvous.client.gpu`). Those decisions are written once
here; each client only carries out the operations they ask for, blocking or
awaiting.

A send (:meth:`ClientCore.send_plan`), like the lending of an array
(:meth:`ClientCore.empty_plan`) or the placing of received GPU tensors
(:meth:`ClientCore.placed_plan`), is a generator that yields what it needs
done (an :class:`LocalOp` for the daemon, a :class:`Copy` into a segment, a
GPU copy) and is sent each one's outcome; :func:`drive` runs it with a
blocking caller, and the asyncio client awaits each step the same way.
"""

from __future__ import annotations

import collections
import math
import os
import struct
import threading
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np

from rendezvous.codec import groups
from rendezvous.devices import Devices, DeviceTensor, Placement
from rendezvous.errors import InvalidArgument, ResourceExhausted, Unavailable, batch_failure
from rendezvous.keys import Key, as_key, canonical_key
from rendezvous.local import ipc as local_ipc
from rendezvous.local import messages
from rendezvous.local.address import parse_local_address
from rendezvous.local.frames import SEND_MANY_TENSORS, SMALL_BODY, Kind
from rendezvous.paths import Hop
from rendezvous.table import send_items
from rendezvous.items import Received
from rendezvous.codec.dtypes import as_array, is_memcpyable
from rendezvous.codec.tensors import check_sendable
from rendezvous.v1 import local_pb2 as lpb

from .gpu import ClientGpu, Place, Stage
from .ipc import Exported
from .segments import Segments

__all__ = ["LocalOp", "Copy", "ClientCore", "RECVS", "drive", "drive_async", "GRPC_METHODS",
           "check_socket", "connect_within"]

#: the gRPC method of each operation, for a client without a session socket
GRPC_METHODS = {Kind.SEND: "Send", Kind.SEND_MANY: "SendMany", Kind.RECV: "Recv", Kind.RECV_MANY: "RecvMany",
                Kind.ABORT: "Abort", Kind.PENDING: "Pending", Kind.RETURN: "Return"}
#: operations whose answer carries tensors: a caller that gives up gives them back
RECVS = (Kind.RECV, Kind.RECV_MANY)
#: the most bytes (tensors, keys and their records) one SEND_MANY carries (send_many
#: sends more as several); its last tensor may pass it alone, within SEND_MANY_BODY
SEND_MANY_BYTES = SEND_MANY_TENSORS
#: a SEND_MANY's bytes for one tensor beyond its own and its key's: its call id,
#: dtype, rank, offset, alignment and the key's field header (plus 8 per dimension)
_SEND_MANY_ENTRY = 40


def check_socket(address: str) -> None:
    """Unavailable at once, naming the path, when ``address`` is a Unix socket
    that does not exist: no daemon has started there (waiting for one would
    only wait out the connect timeout)."""
    if not address.startswith("unix:"):
        return
    _, path = parse_local_address(address)
    if not os.path.exists(path):
        raise Unavailable(f"no rendezvousd at {address}: {path} does not exist. Start the node's daemon "
                          "(rendezvousd --cluster FILE --job-name JOB, or its systemd unit), or give the client "
                          "the address it listens on (Client(address) or RENDEZVOUS_LOCAL_ADDRESS)")


def connect_within(connect_timeout: float, timeout: float | None) -> float:
    """How long a connection may take: ``connect_timeout``, or a call's own
    ``timeout`` if that is smaller."""
    return connect_timeout if timeout is None else max(0.0, min(connect_timeout, timeout))


class LocalOp(NamedTuple):
    """One operation for the daemon: its kind, body, a deadline for the answer
    (None: none), and for a RECV (RECV_MANY) the key (keys) and step, to give
    a late reply back."""

    kind: Kind
    body: bytes
    timeout: float | None = None
    key: str = ""
    step_id: int = 0
    keys: tuple[str, ...] = ()


class Copy(NamedTuple):
    """Copy ``arr`` into lent segment ``seg_id`` (a send's one copy)."""

    seg_id: int
    arr: np.ndarray


Step = LocalOp | Copy | Stage | Place
SendPlan = Generator[Step, Any, Hop]
R = TypeVar("R")


class ClientCore:
    """A local client's state and decisions: the daemon's task and shared-memory
    threshold once attached, its segments (None without a session socket), and
    its counts (thread-safe); ``gpu``, its GPU side (``devices``: its backends)."""

    def __init__(self, devices: Devices | None = None) -> None:
        self.task = ""
        self.shm_threshold = -1
        self.segments: Segments | None = None
        self._counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self.gpu = ClientGpu(devices)

    def attached(self, info: lpb.AttachResponse, segments: Segments | None) -> None:
        """The daemon said who it is (WELCOME, or the Attach stream's first message)."""
        self.task = info.task
        self.segments = self.gpu.segments = segments
        self.shm_threshold = info.shm_threshold if segments is not None else -1

    # -- operations ---------------------------------------------------------------

    def empty_plan(self, shape: Any, dtype: Any) -> Generator[Step, Any, np.ndarray]:
        """The steps of ``Client.empty``: an array of ``shape`` and ``dtype`` on a
        pool segment lent to this session (asked for when none of its size
        class is in stock), which a send hands over with no copy; a private
        array where no segment can be had (no session socket, the pool or this
        client's share of it full, nothing to hold), which a send copies."""
        dt = np.dtype(dtype)
        dims = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
        if not is_memcpyable(dt) or any(d < 0 for d in dims):
            raise InvalidArgument(f"Client.empty makes arrays of fixed-size dtypes and sizes >= 0, not {dt} {dims}")
        nbytes = math.prod(dims) * dt.itemsize
        segments = self.segments
        seg_id = None
        if segments is not None and nbytes:
            seg_id = yield from self._segment(nbytes)  # None when full: a private array
        if segments is None or seg_id is None:
            self._count("empty_private")
            return np.empty(dims, dt)
        self._count("empty_lent")
        return segments.lend_array(seg_id, dims, dt)

    def send_plan(self, key: Key | str, tensor: Any, step_id: int, is_dead: bool,
                  kind: Kind = Kind.SEND) -> SendPlan:
        """The steps of one send; returns how it crossed the local hop. An array
        lent by ``Client.empty`` (or a received one on shared memory) is handed
        over as it is; any other tensor of at least the threshold goes into a
        segment lent for its size class (asked for when none is in stock; if
        the pool is full, inline); a GPU tensor is copied to the host first.
        ``kind`` RETURN gives back a received tensor that could not be placed."""
        head = messages.send_head(key, step_id)
        segments = self.segments
        seg_id = None
        if not is_dead:
            if type(tensor) is not np.ndarray:
                tensor = self.gpu.devices.import_tensor(tensor)
                if isinstance(tensor, DeviceTensor):
                    return (yield from self._send_device(head, tensor, kind))
            tensor = arr = as_array(tensor)
            seg_id = segments.hand_over(arr) if segments is not None else None
            if seg_id is not None:
                return (yield from self._sent(head, arr, seg_id, kind, counted="send_handed_over"))
            if self._pooled(arr.nbytes) and is_memcpyable(arr):
                seg_id = yield from self._segment(arr.nbytes)
                if seg_id is not None:
                    yield from self._into(seg_id, Copy(seg_id, arr))
        return (yield from self._sent(head, tensor, seg_id, kind, is_dead))

    def _sent(self, head: bytes, value: Any, seg_id: int | None, kind: Kind, is_dead: bool = False,
              counted: str = "") -> SendPlan:
        """The send (``kind``) of ``value``: naming segment ``seg_id``, which holds
        its bytes, else inline; counted under ``counted`` (default: its hop)."""
        if seg_id is not None:
            yield LocalOp(kind, messages.pooled_send(head, value, seg_id))
            hop = Hop.SHM
        else:
            body, _ = messages.inline_send(head, value, is_dead)
            yield LocalOp(kind, body)
            hop = Hop.INLINE
        self._count(counted or f"send_{hop}")
        return hop

    def _pooled(self, nbytes: int) -> bool:
        """Whether a tensor of ``nbytes`` crosses through a segment (a session, and
        at least the daemon's threshold)."""
        return self.segments is not None and 0 <= self.shm_threshold <= nbytes and nbytes > 0

    def _segment(self, nbytes: int) -> Generator[Step, Any, int | None]:
        """A segment from this session's stock for ``nbytes``, lent for it when none
        is in stock; None when the pool (or this client's share of it) is full."""
        assert self.segments is not None
        seg_id = self.segments.take(nbytes)
        if seg_id is None:
            try:
                yield LocalOp(Kind.LEND, struct.pack("<Q", nbytes))
            except ResourceExhausted:
                pass  # full: the caller sends inline
            seg_id = self.segments.take(nbytes)
        return seg_id

    def _send_device(self, head: bytes, tensor: DeviceTensor, kind: Kind) -> SendPlan:
        """A GPU tensor's send: by CUDA IPC on a session (the daemon copies it), or
        copied to the host once, through pinned chunks, into a lent segment (or a
        new array, sent inline), after its ready event."""
        ipc = self.gpu.ipc if kind == Kind.SEND else None
        export = ipc.export(tensor) if ipc is not None else None
        if export is not None:
            assert ipc is not None
            ipc.held.append(export)  # until the daemon answers (interrupted, held: its copy may still read)
            try:
                yield LocalOp(Kind.SEND_IPC, local_ipc.send_body(head, tensor.meta, export[0]))
            except Exception as exc:
                ipc.held.remove(export)
                if not isinstance(exc, Unavailable):
                    raise
                ipc.off(exc)  # the daemon cannot open it: through the host, from now on
            else:
                ipc.held.remove(export)
                self._count("send_ipc")
                return Hop.IPC
        seg_id = (yield from self._segment(tensor.nbytes)) if self._pooled(tensor.nbytes) else None
        host = yield from self._into(seg_id, Stage(tensor, seg_id))
        self._count("send_from_gpu")
        return (yield from self._sent(head, host, seg_id, kind))

    def _into(self, seg_id: int | None, step: Copy | Stage) -> Generator[Step, Any, Any]:
        """``step`` (a copy into segment ``seg_id``); the segment back in stock if it fails."""
        try:
            return (yield step)
        except BaseException:
            if seg_id is not None and self.segments is not None:
                self.segments.restock(seg_id)
            raise

    def close(self) -> None:
        """The client is closing: the GPU handles it opened are closed."""
        self.gpu.close()

    def run(self, step: Stage | Place) -> Any:
        """Carry out a GPU copy a plan asks for (blocking: the asyncio client runs it off its loop)."""
        if isinstance(step, Stage):
            return self.gpu.stage(step, self.segments)
        placed, moved = self.gpu.place(step)
        if moved:
            self._count("recv_to_gpu", moved)
        return placed

    def check_items(self, items: Iterable[tuple[Any, ...]] | Mapping[Any, Any]) -> list[tuple[Any, Any, bool]]:
        """send_many's items as (key, tensor, is_dead) (:func:`rendezvous.table.send_items`),
        every key and host array checked before any is sent (InvalidKey, UnsupportedDType)."""
        out = send_items(items)
        for key, tensor, dead in out:
            as_key(key)
            if not dead and (type(tensor) is np.ndarray or not hasattr(tensor, "__dlpack__")
                             and not self.gpu.on_gpu(tensor)):
                check_sendable(as_array(tensor))
        return out

    def send_many_plan(self, items: list[tuple[Any, Any, bool]], step_id: int) -> list[LocalOp | tuple[Any, Any, bool]]:
        """send_many's checked ``items`` as what to do, in their order (so FIFO per
        key holds): a SEND_MANY op for each run of host arrays that travel
        inside frames (a fixed-size dtype, under the shared-memory threshold),
        packed in one group, up to :data:`SEND_MANY_BYTES` each; the others
        (dead, strings, large: through a segment) as items for :meth:`send_plan`."""
        plan: list[LocalOp | tuple[Any, Any, bool]] = []
        keys: list[str] = []
        arrays: list[np.ndarray] = []
        size = packed = 0
        threshold = self.shm_threshold if self.segments is not None else -1

        def flush() -> None:
            nonlocal size
            if arrays:
                plan.append(LocalOp(Kind.SEND_MANY, messages.send_many_request(keys, arrays, step_id)))
                keys.clear()
                arrays.clear()
                size = 0

        segments = self.segments
        for key, tensor, dead in items:
            arr = None if dead or self.gpu.on_gpu(tensor) else as_array(tensor)
            if arr is None or not groups.fusable(arr, SEND_MANY_BYTES) or 0 <= threshold <= arr.nbytes \
                    or (segments is not None and segments.on_pool(arr)):
                flush()
                plan.append((key, tensor, dead))
                continue
            k = canonical_key(key)
            # what it adds to the frame (keys are ASCII, but a name need not be)
            entry = arr.nbytes + _SEND_MANY_ENTRY + 8 * arr.ndim + (len(k) if k.isascii() else len(k.encode()))
            if size + entry > SEND_MANY_BYTES:
                flush()
            keys.append(k)
            arrays.append(arr)
            size += entry
            packed += 1
        flush()
        if packed:
            self._count(f"send_{Hop.INLINE}", packed)
        return plan

    def recv_op(self, key: Key | str, step_id: int, timeout: float | None,
                device: Any = None) -> tuple[LocalOp, list[Placement] | None]:
        """The RECV of ``key``, and where its tensor goes (None: the host, as
        received; see :meth:`ClientGpu.targets`): bound for a GPU, it offers the
        daemon CUDA IPC. The daemon enforces ``timeout`` (DEADLINE_EXCEEDED
        naming the key); the client's own deadline, 10 s later, only guards
        against a daemon that never answers."""
        canonical = canonical_key(key)
        targets = self.gpu.targets((canonical,), device)
        offer = self.gpu.offer(targets[0]) if targets is not None else b""
        guard = None if timeout is None else timeout + 10.0
        return LocalOp(Kind.RECV, messages.recv_request(canonical, step_id, timeout, offer), guard, canonical,
                       step_id), targets

    def received(self, raw: bytes | memoryview, offered: bool = False) -> Received:
        """A RECV's answer as the item (a view on shared memory for a pooled reply;
        an :class:`Exported` for an export, when ``offered``, to copy as it is placed)."""
        exported = local_ipc.replied(raw) if offered else None
        if exported is not None:
            self._count("recv_ipc")
            return Received(Exported(*exported), False)
        reply = messages.parse_reply(raw, self.segments.view if self.segments is not None else None)
        with self._lock:
            self._counts[f"recv_{reply.hop}"] += 1
            self._counts[reply.path] += 1
        return reply.item

    def placed_plan(self, keys: Sequence[str], step_id: int, items: list[Received],
                    targets: list[Placement]) -> Generator[Step, Any, list[Received]]:
        """The steps of putting a recv's ``items`` where ``targets`` say (see
        :meth:`ClientGpu.placed_plan`), what cannot be placed given back (RETURN)."""
        return self.gpu.placed_plan(keys, items, targets, lambda key, item: self.send_plan(
            key, item.value, step_id, item.is_dead, Kind.RETURN))

    def recv_many_op(self, keys: Sequence[Key | str], step_id: int, timeout: float | None) -> LocalOp:
        """The RECV_MANY of ``keys``: one operation, one deadline (the daemon's;
        the client's guard is 10 s later, as for :meth:`recv_op`). On the
        session socket its frame is at most :data:`SMALL_BODY`, as the daemon
        reads it: a batch of more keys is refused here (RESOURCE_EXHAUSTED),
        before anything is asked."""
        canonical = tuple(canonical_key(k) for k in keys)  # a malformed key: refused before anything is sent
        guard = None if timeout is None else timeout + 10.0
        op = LocalOp(Kind.RECV_MANY, messages.recv_many_request(list(canonical), step_id, timeout), guard,
                step_id=step_id, keys=canonical)
        self.check_many(op)
        return op

    def check_many(self, op: LocalOp) -> None:
        """RESOURCE_EXHAUSTED for a RECV_MANY larger than the session socket's
        daemon reads (:data:`SMALL_BODY`); nothing is asked then. (A client not
        attached yet is checked again once it is.)"""
        if self.segments is not None and len(op.body) > SMALL_BODY:
            raise ResourceExhausted(f"a recv_many of {len(op.keys)} keys asks in {len(op.body)} bytes; the daemon "
                                    f"reads at most {SMALL_BODY} in one (about 8,000 keys of 120 characters): ask "
                                    "for fewer keys at once")

    def received_many(self, raw: bytes | memoryview, op: LocalOp) -> list[Received]:
        """A RECV_MANY's answer as the items, in key order, or its error naming each
        key that failed (nothing of the batch was taken)."""
        got = messages.parse_many(raw, len(op.keys))
        if got.failures:
            raise batch_failure(list(op.keys), op.step_id, got.failures)
        items: list[Received] = []
        packed: collections.Counter[str] = collections.Counter()
        base, shift = messages.packed_base(raw, got)  # each view aligned to its dtype
        for answer in got.answers:
            if len(answer) == 2:
                items.append(self.received(raw[answer[0]:answer[1]]))
            else:  # a view on the answer's bytes, as an inline reply's tensor is
                items.append(Received(messages.packed_view(base, answer, shift), False))
                packed[answer[3]] += 1
        if packed:
            with self._lock:
                self._counts[f"recv_{Hop.INLINE}"] += sum(packed.values())
                self._counts.update(packed)
        return items

    @staticmethod
    def abort_op(step_id: int, message: str) -> LocalOp:
        return LocalOp(Kind.ABORT, lpb.AbortRequest(step_id=step_id, message=message).SerializeToString())

    @staticmethod
    def pending_op() -> LocalOp:
        return LocalOp(Kind.PENDING, b"")

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n

    def stats(self) -> dict[str, int]:
        """Counts: send_/recv_ inline|shm (the local hop; send_handed_over: a
        lent or received array sent with no copy), empty_lent|private (arrays
        made by ``Client.empty``), local|grpc|mpi (how the daemon got what was
        received), send_from_gpu and recv_to_gpu (GPU tensors copied across)."""
        with self._lock:
            return {str(k): v for k, v in self._counts.items()}


def drive(plan: Generator[Step, Any, R], do: Callable[[LocalOp], Any],
          copy: Callable[[Any], Any] | None) -> R:
    """Run a plan's steps with a blocking ``do(op)`` (its answer, or raises) and
    ``copy(step)`` for any other step (its outcome; None for a plan that copies nothing)."""
    outcome: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = plan.throw(error) if error is not None else plan.send(outcome)
        except StopIteration as stop:
            done: R = stop.value
            return done
        outcome, error = None, None
        try:
            if isinstance(step, LocalOp):
                outcome = do(step)
            else:
                assert copy is not None
                outcome = copy(step)
        except Exception as exc:  # handed to the plan, which decides
            error = exc


async def drive_async(plan: Generator[Step, Any, R], do: Callable[[LocalOp], Awaitable[Any]],
                      copy: Callable[[Any], Awaitable[Any]]) -> R:
    """:func:`drive`, each step awaited."""
    outcome: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = plan.throw(error) if error is not None else plan.send(outcome)
        except StopIteration as stop:
            done: R = stop.value
            return done
        outcome, error = None, None
        try:
            outcome = await (do(step) if isinstance(step, LocalOp) else copy(step))
        except Exception as exc:  # handed to the plan, which decides
            error = exc
