"""The local hop: the ``rendezvous.v1.LocalRendezvous`` service of rendezvousd.

Training processes on a node (local clients, :mod:`rendezvous.client`)
send and recv through their node's daemon, which is a rank: ``Send`` puts a
tensor into the daemon's waiting table (the key's producer must be the
daemon's task); ``Recv`` is the daemon's own recv, local or from a remote
task, answered to the client. Handlers take and give raw bytes so a tensor's
bytes are never re-serialized by protobuf.

Two ways in share this servicer's logic (:meth:`LocalServicer.send`,
:meth:`LocalServicer.fetch`): the gRPC service registered here, whose
messages carry every tensor inline (clients over TCP, tools), and the session
socket (:mod:`rendezvous.daemon.sessions`), where a tensor of at least
``shm_threshold`` bytes travels through the daemon's shared-memory pool.

Payload copies of the gRPC service: protobuf's and gRPC's own.
"""

from __future__ import annotations

import asyncio
import functools
import copy
import logging
import re
import time
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from rendezvous.errors import InvalidArgument, RendezvousError, ResourceExhausted, Unavailable, to_status
from rendezvous.keys import parse_key
from rendezvous.local import messages
from rendezvous.local.messages import SERVICE, parse_recv
from rendezvous.paths import Hop, Path
from rendezvous.rpc.admin import PENDING_BYTES, PENDING_ROWS, bounded_pending, pending_entries
from rendezvous.stats import payload_nbytes
from rendezvous.items import Received
from rendezvous.codec.tensors import TensorMeta, check_announced, decode_meta, decode_tensor
from rendezvous.v1 import local_pb2 as lpb

__all__ = ["LocalServicer", "SERVICE", "PENDING_BYTES", "Sent", "LocalFetched"]

#: a PENDING answer lists at most this many bytes of entries, and says how many it left out
log = logging.getLogger("rendezvous.daemon")
_CLIENT_ID = re.compile(r"[0-9a-f]{12}\Z")

#: Resolves a send's PoolSlot: (segment id, nbytes, meta) -> the daemon's array on it.
Resolve = Callable[[int, int, TensorMeta], np.ndarray]

class Sent(NamedTuple):
    """What a local send put into the table: how it crossed the hop, its payload bytes."""

    hop: Hop
    nbytes: int


class LocalFetched(NamedTuple):
    """What a local client's recv got: the item (a host array), and how the daemon got it."""

    item: Received
    path: Path


class Stall(NamedTuple):
    """A local client's recv that has waited too long."""

    key: str
    step_id: int
    producer: str
    age_s: float


@dataclass
class _Wait:
    key: str
    step_id: int
    producer: str
    started: float
    warned: bool = False


@dataclass
class _Attached:
    client_id: str
    pid: int


class LocalServicer:
    """Serves local clients from one daemon's rank server (``rendezvous.aio.Server``)."""

    def __init__(self, server: Any, metrics: Any | None = None) -> None:
        self.server = server
        self.config = server.config
        self.metrics = metrics
        self.draining = False
        self.closing = False
        #: clients attached over gRPC (the Attach stream), by client_id
        self.attached: dict[str, _Attached] = {}
        #: recvs of local clients in progress, by an id: what the stall watcher looks at
        self.waits: dict[int, _Wait] = {}
        self._next_wait = 0
        #: how many of :attr:`waits` wait for another task (the rest are in the table too)
        self._remote_waits = 0
        self._closed = asyncio.Event()
        #: the session socket's path, told to gRPC clients in Attach (set by the daemon)
        self.session_socket = ""

    # -- registration -----------------------------------------------------

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        return [grpc.method_handlers_generic_handler(SERVICE, {
            "Send": grpc.unary_unary_rpc_method_handler(self._send),
            "Return": grpc.unary_unary_rpc_method_handler(functools.partial(self._send, keep=True)),
            "SendMany": grpc.unary_unary_rpc_method_handler(self._send_many),
            "Recv": grpc.unary_unary_rpc_method_handler(self._recv),
            "RecvMany": grpc.unary_unary_rpc_method_handler(self._recv_many),
            "Abort": grpc.unary_unary_rpc_method_handler(self._abort),
            "Pending": grpc.unary_unary_rpc_method_handler(self._pending),
            "Attach": grpc.unary_stream_rpc_method_handler(self._attach),
        })]

    def begin_drain(self) -> None:
        """Refuse new sends and recvs with UNAVAILABLE (recvs in flight are failed by
        the rank server's own drain)."""
        self.draining = True

    def close(self) -> None:
        """End every session stream (the daemon is going; nothing is swept)."""
        self.closing = True
        self._closed.set()

    # -- helpers --------------------------------------------------------------

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise Unavailable(f"rendezvousd {self.server.task} is shutting down")

    def _error(self, exc: BaseException) -> tuple[grpc.StatusCode, str]:
        if not isinstance(exc, RendezvousError):
            log.error("local call failed", exc_info=exc)
        code, message = to_status(exc)
        if self.metrics is not None:
            self.metrics.error(code)
        return code, message

    # -- Send -----------------------------------------------------------------

    async def _send(self, request: bytes, context: grpc.aio.ServicerContext, keep: bool = False) -> bytes:
        try:
            sent = self.send(request, keep=keep)
        except Exception as exc:
            await context.abort(*self._error(exc))
        if self.metrics is not None and not keep:
            self.metrics.local_op("send", sent.hop, sent.nbytes)
        return b""

    def send(self, raw: bytes | memoryview, resolve: Resolve | None = None, keep: bool = False) -> Sent:
        """Put a SendRequest's tensor into the table. ``resolve``: how the session
        socket turns a PoolSlot into an array (the gRPC service has none: a slot is
        refused). ``keep`` (RETURN, and gRPC's Return): the tensor was fetched for a
        recv its client gave up on or could not place: it goes back in front of the
        next recv of its key and step, whoever produces the key."""
        step_id, key, tensor, is_dead, slot = messages.parse_send(raw)
        if slot is not None and resolve is None:
            raise InvalidArgument("a pooled send is only valid on the session socket")
        if slot is not None and (is_dead or tensor is None):
            raise InvalidArgument("a shared-memory send needs the tensor's dtype and shape, and is never dead")
        self._refuse_if_draining()
        table = self.server.table
        if keep:
            canonical = parse_key(key).format()
        else:
            # validates the key and that this daemon produces it
            canonical, _ = self.server.prepare_send(key, None, True)
        ended = table.aborted(step_id)
        if ended is not None:
            # A copy: the table's stored error would keep this frame (and the
            # tensor) alive through its traceback.
            raise copy.copy(ended)
        if is_dead:
            value, hop, nbytes = None, Hop.INLINE, 0
        elif tensor is None:
            raise InvalidArgument("SendRequest carries no tensor (and is not dead)")
        elif slot is not None:
            meta, _, _ = decode_meta(raw, *tensor)
            check_announced(meta, self.config.max_tensor_bytes)
            if meta.nbytes != slot[1]:
                raise InvalidArgument(f"segment {slot[0]}: {slot[1]} bytes announced, dtype {meta.dtype} and "
                                      f"shape {meta.shape} need {meta.nbytes}")
            assert resolve is not None
            value, hop, nbytes = resolve(slot[0], slot[1], meta), Hop.SHM, slot[1]
        else:
            # a view on the request bytes (no copy); its announced size is checked
            # before typed fields are expanded (one value may announce any shape)
            value = decode_tensor(raw, *tensor, max_bytes=self.config.max_tensor_bytes)
            hop, nbytes = Hop.INLINE, payload_nbytes(value)
        if keep:
            # a local recv that gave up (its deadline, a cancel, its batch failing):
            # expected, and said by the client's own error; kept without a warning
            self.server.keep(step_id, canonical, Received(value, is_dead), why=None)
            log.debug("recv of %r (step %d) was given back by its local client; kept for the next recv",
                      canonical, step_id)
        else:
            table.send(step_id, canonical, value, is_dead)  # an aborted step drops (and frees) it
        return Sent(hop, nbytes)

    async def _send_many(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            self.send_many(request)
        except Exception as exc:
            await context.abort(*self._error(exc))
        return b""

    def send_many(self, raw: bytes | memoryview) -> None:
        """Put a LocalSendManyRequest's tensors into the table (views on its bytes):
        every key checked first, none produced if one is refused; counted in the metrics."""
        step_id, keys, values = messages.parse_send_many(raw)
        self._refuse_if_draining()
        canonical = [self.server.prepare_send(key, None, True)[0] for key in keys]  # this daemon's own keys
        table = self.server.table
        ended = table.aborted(step_id)
        if ended is not None:
            raise copy.copy(ended)  # (a copy: see send)
        for key, value in zip(canonical, values):
            table.send(step_id, key, value, False)
        if self.metrics is not None:
            self.metrics.local_op("send", Hop.INLINE, sum(v.nbytes for v in values), len(values))

    # -- Recv -----------------------------------------------------------------

    async def _recv(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        t0 = time.perf_counter()
        try:
            req = parse_recv(request)
            item, path = await self.fetch(req)
            try:
                if context.cancelled():
                    raise Unavailable("the client went away")
                reply = messages.inline_reply(item, path)
            except BaseException:
                self.give_back(req, item)
                raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await context.abort(*self._error(exc))
        if self.metrics is not None:
            self.metrics.recv_done(path, time.perf_counter() - t0)
            self.metrics.local_op("recv", Hop.INLINE, payload_nbytes(item.value))
        return reply

    async def _recv_many(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        t0 = time.perf_counter()
        req = None
        try:
            req = messages.parse_recv_many(request)
            got = await self.fetch_many(req)
            try:
                if context.cancelled():
                    raise Unavailable("the client went away")
                reply = b"".join(messages.many_answer(got, self.config.max_tensor_bytes))
            except BaseException:
                self.give_back_many(req, [f.item for f in got])
                raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failed = self.many_failed(req.rendezvous_keys, exc) if req is not None else None
            if failed is not None:
                return failed
            await context.abort(*self._error(exc))
        self.batch_done(got, time.perf_counter() - t0,
                        {Hop.INLINE: [len(got), sum(payload_nbytes(f.item.value) for f in got)]})
        return reply

    def batch_done(self, got: list[LocalFetched], took: float, hops: dict[Hop, list[int]]) -> None:
        """A local client's batch answered after ``took`` seconds: its latency once
        for each path that brought some of its tensors, and per hop the tensors
        and bytes that crossed it (``[count, nbytes]``)."""
        if self.metrics is None:
            return
        for path in {f.path for f in got}:
            self.metrics.recv_done(path, took)
        for hop, (count, nbytes) in hops.items():
            self.metrics.local_op("recv", hop, nbytes, count)

    async def fetch(self, req: lpb.LocalRecvRequest, device: str = "cpu") -> LocalFetched:
        """A local client's recv: the item (a host array; on a GPU, ``device``, for
        CUDA IPC) and how the daemon got it. Counted in :attr:`waits` while it waits."""
        self._refuse_if_draining()
        key = parse_key(req.rendezvous_key)
        canonical = key.format()
        producer = key.src_task or self.server.task
        if len(self.waits) >= self.config.max_waiting_calls:
            raise ResourceExhausted(f"the daemon already holds {len(self.waits)} waiting local recvs "
                                    "(max_waiting_calls); try again later")
        wait_id = self._park(canonical, req.step_id, str(producer), time.monotonic())
        try:
            timeout = req.timeout if req.timeout > 0 else None
            # host arrays (inline or through shared memory), unless the session asks IPC's GPU
            fetched = await self.server.fetch(canonical, req.step_id, timeout, device=device)
        finally:
            self._unpark(wait_id)
        return LocalFetched(fetched.item, fetched.path)

    async def fetch_many(self, req: lpb.LocalRecvManyRequest) -> list[LocalFetched]:
        """A local client's batch (all or none: see ``Server.recv_many``), each key
        counted in :attr:`waits` while it waits."""
        self._refuse_if_draining()
        keys = [parse_key(k) for k in req.rendezvous_keys]  # a malformed key: nothing is asked
        if len(self.waits) + len(keys) > self.config.max_waiting_calls:
            raise ResourceExhausted(f"a batch of {len(keys)} recvs would pass the daemon's max_waiting_calls "
                                    f"({len(self.waits)} of {self.config.max_waiting_calls} wait now); "
                                    "try again later")
        now = time.monotonic()
        ids = [self._park(key.format(), req.step_id, str(key.src_task or self.server.task), now) for key in keys]
        try:
            timeout = req.timeout if req.timeout > 0 else None
            fetched = await self.server.fetch_many(keys, req.step_id, timeout, device="cpu")
        finally:
            for wait_id in ids:
                self._unpark(wait_id)
        return [LocalFetched(f.item, f.path) for f in fetched]

    def _park(self, key: str, step_id: int, producer: str, started: float) -> int:
        self._next_wait += 1
        self.waits[self._next_wait] = _Wait(key, step_id, producer, started)
        self._remote_waits += producer != str(self.server.task)
        return self._next_wait

    def _unpark(self, wait_id: int) -> None:
        w = self.waits.pop(wait_id, None)
        if w is not None:
            self._remote_waits -= w.producer != str(self.server.task)

    def give_back_many(self, req: lpb.LocalRecvManyRequest, items: list[Received],
                       why: str | None = "was not handed to its local client") -> None:
        """A batch's items that were not handed to their client: each kept for the
        next recv of its key, in their order (logged per key with ``why``,
        unless None: the caller said it once)."""
        self.server.give_back(req.step_id, list(req.rendezvous_keys), items, why=why)

    def many_failed(self, keys: Any, exc: BaseException) -> bytes | None:
        """The LocalRecvManyResponse naming each key of a batch that failed, or None
        if ``exc`` is not a batch's failure (it is answered as an error)."""
        failures = getattr(exc, "failures", None)
        if not isinstance(failures, dict):
            return None
        out = []
        for i, key in enumerate(keys):
            err = failures.get(parse_key(key).format())
            if err is not None:
                code, message = self._error(err)
                out.append((i, code.value[0], message))
        return messages.many_failed(out) if out else None

    def give_back(self, req: lpb.LocalRecvRequest, item: Received) -> None:
        """A fetched item that was not handed to its client (it went, or the reply
        could not be made): kept for the next recv of this key and step."""
        self.server.keep(req.step_id, parse_key(req.rendezvous_key).format(), item,
                         why="was not handed to its local client")

    # -- Abort, Pending ----------------------------------------------------------

    async def _abort(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            req = lpb.AbortRequest.FromString(request)
            self.server.abort(req.step_id, req.message or "aborted")
        except DecodeError as exc:
            await context.abort(*self._error(InvalidArgument(f"malformed AbortRequest: {exc}")))
        except Exception as exc:
            await context.abort(*self._error(exc))
        return b""

    def pending(self, limit: int = PENDING_ROWS) -> tuple[list[lpb.PendingEntry], int]:
        """What waits on this node, for Pending (a :data:`~rendezvous.rpc.admin.PendingSource`):
        the rank server's rows (its table, its kept tensors), then the local
        clients' recvs waiting for another task (``"remote"``); at most ``limit``
        rows, made as they are taken, and how many there are at most."""
        entries = pending_entries(self.server, limit)
        if len(entries) < limit:
            me = str(self.server.task)
            now = time.monotonic()
            remote = (w for w in self.waits.values() if w.producer != me)
            entries.extend(lpb.PendingEntry(step_id=w.step_id, rendezvous_key=w.key, kind="remote", count=1,
                                            oldest_age_seconds=now - w.started, producer=w.producer)
                           for w in itertools.islice(remote, limit - len(entries)))
        return entries, self.server.pending_count() + self._remote_waits

    def pending_reply(self, max_bytes: int = PENDING_BYTES) -> lpb.PendingResponse:
        """:meth:`pending` as one answer of at most about ``max_bytes`` and
        ``PENDING_ROWS`` rows (the oldest of them first, and the count left out)."""
        entries, total = self.pending()
        return bounded_pending(entries, max_bytes, total=total)

    async def _pending(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            return self.pending_reply().SerializeToString()
        except Exception as exc:
            await context.abort(*self._error(exc))

    # -- Attach (clients over gRPC) ------------------------------------------------------

    async def _attach(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            req = lpb.AttachRequest.FromString(request)
        except DecodeError as exc:
            await context.abort(*self._error(InvalidArgument(f"malformed AttachRequest: {exc}")))
        if not _CLIENT_ID.match(req.client_id) or req.pid <= 0:
            await context.abort(*self._error(InvalidArgument("client_id must be 12 lowercase hex digits, pid > 0")))
        if req.client_id in self.attached:
            await context.abort(*self._error(InvalidArgument(f"client_id {req.client_id} is already attached")))
        self.attached[req.client_id] = _Attached(req.client_id, req.pid)
        log.debug("client %s (pid %d) attached over gRPC", req.client_id, req.pid)
        try:
            yield self.welcome().SerializeToString()
            await self._closed.wait()
        finally:
            self.attached.pop(req.client_id, None)

    def welcome(self, shm_threshold: int = -1, max_frame_bytes: int = 0) -> lpb.AttachResponse:
        return lpb.AttachResponse(task=str(self.server.task), shm_threshold=shm_threshold,
                                  max_tensor_bytes=self.config.max_tensor_bytes,
                                  session_socket=self.session_socket, max_frame_bytes=max_frame_bytes)

    # -- stalls -----------------------------------------------------------------

    def stalled(self, older_than: float) -> list[Stall]:
        """Recvs waiting longer than ``older_than`` seconds and not reported yet.
        Each is reported once."""
        now = time.monotonic()
        out = []
        for w in list(self.waits.values()):
            age = now - w.started
            if not w.warned and age >= older_than:
                w.warned = True
                out.append(Stall(w.key, w.step_id, w.producer, age))
        return out
