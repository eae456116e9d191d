"""The local hop: the ``rendezvous.v1.LocalRendezvous`` service of rendezvousd.

Training processes on a node (local clients, :mod:`rendezvous.client.local`)
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
import copy
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from rendezvous import fields as F
from rendezvous import frames, wire
from rendezvous.errors import (
    InvalidArgument,
    RendezvousError,
    ResourceExhausted,
    Unavailable,
    to_status,
)
from rendezvous.keys import parse_key
from rendezvous.stats import payload_nbytes
from rendezvous.table import Received
from rendezvous.tensors import TensorMeta, check_announced, decode_meta, decode_tensor
from rendezvous.v1 import local_pb2 as lpb

__all__ = ["LocalServicer", "SERVICE", "PENDING_BYTES"]

SERVICE = "rendezvous.v1.LocalRendezvous"
#: a PENDING answer lists at most this many bytes of entries, and says how many it left out
PENDING_BYTES = 1 << 20
log = logging.getLogger("rendezvous.daemon")
_CLIENT_ID = re.compile(r"[0-9a-f]{12}\Z")

#: Resolves a send's PoolSlot: (segment id, nbytes, meta) -> the daemon's array on it.
Resolve = Callable[[int, int, TensorMeta], np.ndarray]

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
class _Session:
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
        self.sessions: dict[str, _Session] = {}
        #: recvs of local clients in progress, by an id: what the stall watcher looks at
        self.waits: dict[int, _Wait] = {}
        self._next_wait = 0
        self._closed = asyncio.Event()
        #: the session socket's path, told to gRPC clients in Attach (set by the daemon)
        self.session_socket = ""

    # -- registration -----------------------------------------------------

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        return [grpc.method_handlers_generic_handler(SERVICE, {
            "Send": grpc.unary_unary_rpc_method_handler(self._send),
            "Recv": grpc.unary_unary_rpc_method_handler(self._recv),
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

    async def _send(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            path, nbytes = self.send(request)
        except Exception as exc:
            await context.abort(*self._error(exc))
        if self.metrics is not None:
            self.metrics.local_op("send", path, nbytes)
        return b""

    def send(self, raw: bytes | memoryview, resolve: Resolve | None = None,
             keep: bool = False) -> tuple[str, int]:
        """Put a SendRequest's tensor into the table; ("inline" or "shm", payload bytes).

        ``resolve``: how the session socket turns a PoolSlot into an array (the
        gRPC service has none: a slot is refused). ``keep``: the tensor was
        fetched for a recv its client gave up on (the session socket's
        RETURN): it goes back in front of the next recv of its key and step,
        whoever produces the key."""
        step_id, key, tensor, is_dead, slot = 0, "", None, False, None
        for num, wt, a, b in wire.iter_fields(raw):
            if num == F.SEND_STEP_ID and wt == wire.VARINT:
                step_id = wire.to_signed64(a)
            elif num == F.SEND_KEY and wt == wire.LEN:
                key = _text(raw, a, b, "rendezvous_key")
            elif num == F.SEND_TENSOR and wt == wire.LEN:
                tensor = (a, b)
            elif num == F.SEND_IS_DEAD and wt == wire.VARINT:
                is_dead = bool(a)
            elif num == F.SEND_POOLED and wt == wire.LEN:
                slot = _slot(raw, a, b)
            elif num == F.SEND_NAMED_SHM:
                raise InvalidArgument("named shared-memory segments are no longer accepted: a client on the "
                                      "daemon's machine sends through the session socket's pool")
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
            value, path, nbytes = None, "inline", 0
        elif tensor is None:
            raise InvalidArgument("SendRequest carries no tensor (and is not dead)")
        elif slot is not None:
            meta, _, _ = decode_meta(raw, *tensor)
            check_announced(meta, self.config.max_tensor_bytes)
            if meta.nbytes != slot[1]:
                raise InvalidArgument(f"segment {slot[0]}: {slot[1]} bytes announced, dtype {meta.dtype} and "
                                      f"shape {meta.shape} need {meta.nbytes}")
            assert resolve is not None
            value, path, nbytes = resolve(slot[0], slot[1], meta), "shm", slot[1]
        else:
            # a view on the request bytes (no copy); its announced size is checked
            # before typed fields are expanded (one value may announce any shape)
            value = decode_tensor(raw, *tensor, max_bytes=self.config.max_tensor_bytes)
            path, nbytes = "inline", payload_nbytes(value)
        if keep:
            self.server.keep(step_id, canonical, Received(value, is_dead), why="was given back by its local client")
        else:
            table.send(step_id, canonical, value, is_dead)  # an aborted step drops (and frees) it
        return path, nbytes

    # -- Recv -----------------------------------------------------------------

    async def _recv(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        t0 = time.perf_counter()
        try:
            req = parse_recv(request)
            item, path = await self.fetch(req)
            try:
                if context.cancelled():
                    raise Unavailable("the client went away")
                reply = frames.unary_response(item) + path_field(path)
            except BaseException:
                self.give_back(req, item)
                raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await context.abort(*self._error(exc))
        if self.metrics is not None:
            self.metrics.recv_done(path, time.perf_counter() - t0)
            self.metrics.local_op("recv", "inline", payload_nbytes(item.value))
        return reply

    async def fetch(self, req: lpb.LocalRecvRequest) -> tuple[Received, str]:
        """A local client's recv: (the item, how the daemon got it), as a host array.
        Counted in :attr:`waits` (the stall watcher's) while it waits."""
        self._refuse_if_draining()
        key = parse_key(req.rendezvous_key)
        canonical = key.format()
        producer = key.src_task or self.server.task
        if len(self.waits) >= self.config.max_waiting_calls:
            raise ResourceExhausted(f"the daemon already holds {len(self.waits)} waiting local recvs "
                                    "(max_waiting_calls); try again later")
        self._next_wait += 1
        wait_id = self._next_wait
        self.waits[wait_id] = _Wait(canonical, req.step_id, str(producer), time.monotonic())
        try:
            timeout = req.timeout if req.timeout > 0 else None
            # host arrays always: they go to the client inline or through shared memory
            item, path, _ = await self.server.fetch(canonical, req.step_id, timeout, device="cpu")
        finally:
            self.waits.pop(wait_id, None)
        return item, path

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

    def pending(self) -> list[lpb.PendingEntry]:
        """The node's waiting table plus local clients' recvs from other tasks."""
        out = []
        me = str(self.server.task)
        for e in self.server.pending():
            try:
                producer = str(parse_key(e.key).src_task or me)
            except RendezvousError:
                producer = me
            out.append(lpb.PendingEntry(step_id=e.step_id, rendezvous_key=str(e.key), kind=e.kind, count=e.count,
                                        oldest_age_seconds=e.oldest_age_s, producer=producer))
        now = time.monotonic()
        for w in list(self.waits.values()):
            if w.producer != me:
                out.append(lpb.PendingEntry(step_id=w.step_id, rendezvous_key=w.key, kind="remote", count=1,
                                            oldest_age_seconds=now - w.started, producer=w.producer))
        return out

    def pending_reply(self, max_bytes: int = PENDING_BYTES) -> lpb.PendingResponse:
        """:meth:`pending` as one answer of at most about ``max_bytes``: the oldest
        entries first, and the count of those left out (a client can park any
        number of recvs with long keys; the answer stays one bounded message)."""
        entries = sorted(self.pending(), key=lambda e: -e.oldest_age_seconds)
        reply = lpb.PendingResponse()
        size = 0
        for i, entry in enumerate(entries):
            size += entry.ByteSize() + 4
            if size > max_bytes:
                reply.omitted = len(entries) - i
                break
            reply.entries.append(entry)
        return reply

    async def _pending(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            return self.pending_reply().SerializeToString()
        except Exception as exc:
            await context.abort(*self._error(exc))

    # -- Attach (sessions) ------------------------------------------------------

    async def _attach(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            req = lpb.AttachRequest.FromString(request)
        except DecodeError as exc:
            await context.abort(*self._error(InvalidArgument(f"malformed AttachRequest: {exc}")))
        if not _CLIENT_ID.match(req.client_id) or req.pid <= 0:
            await context.abort(*self._error(InvalidArgument("client_id must be 12 lowercase hex digits, pid > 0")))
        if req.client_id in self.sessions:
            await context.abort(*self._error(InvalidArgument(f"client_id {req.client_id} is already attached")))
        self.sessions[req.client_id] = _Session(req.client_id, req.pid)
        log.debug("client %s (pid %d) attached over gRPC", req.client_id, req.pid)
        try:
            yield self.welcome().SerializeToString()
            await self._closed.wait()
        finally:
            self.sessions.pop(req.client_id, None)

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


def _text(buf: bytes, a: int, b: int, what: str) -> str:
    try:
        return bytes(buf[a:b]).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument(f"{what} is not UTF-8") from None


def _slot(buf: bytes | memoryview, a: int, b: int) -> tuple[int, int]:
    segment, nbytes = 0, 0
    for num, wt, x, y in wire.iter_fields(buf, a, b):
        if num == F.SLOT_SEGMENT and wt == wire.VARINT:
            segment = x
        elif num == F.SLOT_NBYTES and wt == wire.VARINT:
            nbytes = wire.to_signed64(x)
    if segment <= 0 or nbytes <= 0:
        raise InvalidArgument(f"a pooled send names segment {segment} with {nbytes} bytes")
    return segment, nbytes


def parse_recv(raw: bytes | memoryview) -> lpb.LocalRecvRequest:
    try:
        return lpb.LocalRecvRequest.FromString(bytes(raw))
    except DecodeError as exc:
        raise InvalidArgument(f"malformed LocalRecvRequest: {exc}") from None


def path_field(path: str) -> bytes:
    """LocalRecvResponse's path field."""
    return wire.len_field_header(F.LOCAL_REPLY_PATH, len(path)) + path.encode()
