"""The local hop: the ``rendezvous.v1.LocalRendezvous`` service of rendezvousd.

Training processes on a node (local clients, :mod:`rendezvous.client.local`)
send and recv through their node's daemon, which is a rank: ``Send`` puts a
tensor into the daemon's waiting table (the key's producer must be the
daemon's task); ``Recv`` is the daemon's own recv, local or from a remote
task, answered to the client. Handlers take and give raw bytes so a tensor's
bytes are never re-serialized by protobuf.

Shared memory: a client writes a tensor of at least ``shm_threshold`` bytes
into a segment and sends its name (:mod:`rendezvous.shm`); the daemon maps it
and unlinks the name, and the table holds a numpy array on that mapping
(served to remote peers straight from it; freed when consumed or dropped).
Replies of that size go the other way: the daemon writes the tensor into a
segment named under the client's session prefix and the client takes it.
Sessions (``Attach``) let the daemon unlink what a dead client left behind.

Payload copies of the local hop: shared memory, 1 (the writer's); inline,
protobuf's and gRPC's own (small tensors only).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from rendezvous import fields as F
from rendezvous import frames, shm, wire
from rendezvous.errors import (
    InvalidArgument,
    RendezvousError,
    ResourceExhausted,
    Unavailable,
    to_status,
)
from rendezvous.keys import parse_key
from rendezvous.stats import payload_nbytes
from rendezvous.tensors import TensorMeta, check_announced, decode_meta, decode_tensor, encode_meta, is_memcpyable
from rendezvous.v1 import local_pb2 as lpb

__all__ = ["LocalServicer", "SERVICE"]

SERVICE = "rendezvous.v1.LocalRendezvous"
log = logging.getLogger("rendezvous.daemon")
_CLIENT_ID = re.compile(r"[0-9a-f]{12}\Z")
# Copies this big run on a worker thread (numpy releases the GIL) instead of the loop.
_OFF_LOOP_BYTES = 4 << 20

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
    prefix: str
    alive: bool = True


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
        threshold = self.config.shm_threshold
        self.shm_threshold = threshold if threshold >= 0 and shm.available() else -1

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
            path, nbytes = await self._do_send(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await context.abort(*self._error(exc))
        if self.metrics is not None:
            self.metrics.local_op("send", path, nbytes)
        return b""

    async def _do_send(self, raw: bytes) -> tuple[str, int]:
        step_id, key, tensor, is_dead, segment, client_id = 0, "", None, False, None, ""
        for num, wt, a, b in wire.iter_fields(raw):
            if num == F.SEND_STEP_ID and wt == wire.VARINT:
                step_id = wire.to_signed64(a)
            elif num == F.SEND_KEY and wt == wire.LEN:
                key = _text(raw, a, b, "rendezvous_key")
            elif num == F.SEND_TENSOR and wt == wire.LEN:
                tensor = (a, b)
            elif num == F.SEND_IS_DEAD and wt == wire.VARINT:
                is_dead = bool(a)
            elif num == F.SEND_SHM and wt == wire.LEN:
                segment = _segment(raw, a, b)
            elif num == F.SEND_CLIENT_ID and wt == wire.LEN:
                client_id = _text(raw, a, b, "client_id")
        if segment is not None:
            session = self.sessions.get(client_id) if client_id else None
            if session is None or not segment[0].startswith(session.prefix):
                # never touched: it is not this sender's to hand over (or to remove)
                raise InvalidArgument(f"segment {segment[0]!r} is not one of this client's session "
                                      "(a shared-memory send names a segment its own session wrote)")
        if segment is not None and (is_dead or tensor is None):
            shm.discard(segment[0])
            raise InvalidArgument("a shared-memory send needs the tensor's dtype and shape, and is never dead")
        table = self.server.table
        try:
            self._refuse_if_draining()
            # validates the key and that this daemon produces it
            canonical, _ = self.server.prepare_send(key, None, True)
            ended = table.aborted(step_id)
            if ended is not None:
                # A copy: the table's stored error would keep this frame (and the
                # tensor) alive through its traceback.
                raise copy.copy(ended)
        except BaseException:
            if segment is not None:
                shm.discard(segment[0])
            raise
        if is_dead:
            table.send(step_id, canonical, None, True)
            return "inline", 0
        if tensor is None:
            raise InvalidArgument("SendRequest carries no tensor (and is not dead)")
        if segment is not None:
            name, nbytes = segment
            try:
                meta, _, _ = decode_meta(raw, *tensor)
                self._check_size(meta)
                if meta.nbytes != nbytes:
                    raise InvalidArgument(f"segment {name}: {nbytes} bytes announced, dtype {meta.dtype} and "
                                          f"shape {meta.shape} need {meta.nbytes}")
                # Read, not mapped: the client could truncate its segment later, and a
                # mapping of it would then fault and kill the daemon (one copy).
                dest = self.server.buffers.empty(meta.shape, meta.dtype)
                if nbytes >= _OFF_LOOP_BYTES:
                    value = await asyncio.get_running_loop().run_in_executor(None, shm.read, name, nbytes, dest)
                else:
                    value = shm.read(name, nbytes, dest)
            except BaseException:
                shm.discard(name)
                raise
            table.send(step_id, canonical, value, False)  # an aborted step drops (and frees) it
            return "shm", nbytes
        # a view on the request bytes (no copy); its announced size is checked
        # before typed fields are expanded (one value may announce any shape)
        value = decode_tensor(raw, *tensor, max_bytes=self.config.max_tensor_bytes)
        table.send(step_id, canonical, value, False)
        return "inline", payload_nbytes(value)

    def _check_size(self, meta: TensorMeta) -> None:
        check_announced(meta, self.config.max_tensor_bytes)

    # -- Recv -----------------------------------------------------------------

    async def _recv(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        wait_id = None
        t0 = time.perf_counter()
        try:
            try:
                req = lpb.LocalRecvRequest.FromString(request)
            except DecodeError as exc:
                raise InvalidArgument(f"malformed LocalRecvRequest: {exc}") from None
            self._refuse_if_draining()
            key = parse_key(req.rendezvous_key)
            canonical = key.format()
            producer = key.src_task or self.server.task
            if len(self.waits) >= self.config.max_waiting_calls:
                raise ResourceExhausted(f"the daemon already holds {len(self.waits)} waiting local recvs "
                                        "(max_waiting_calls); try again later")
            wait_id = self._next_wait = self._next_wait + 1
            self.waits[wait_id] = _Wait(canonical, req.step_id, str(producer), time.monotonic())
            timeout = req.timeout if req.timeout > 0 else None
            # host arrays always: they go to the client inline or through shared memory
            item, path, _ = await self.server.fetch(canonical, req.step_id, timeout, device="cpu")
            del self.waits[wait_id]
            wait_id = None
            try:
                if context.cancelled():
                    raise Unavailable("the client went away")
                reply, hop, nbytes = await self._reply(item, path, req.client_id)
            except BaseException:
                # fetched but not handed over (the client went, or the reply could
                # not be made): kept for the next recv of this key and step
                self.server.keep(req.step_id, canonical, item, why="was not handed to its local client")
                raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await context.abort(*self._error(exc))
        finally:
            if wait_id is not None:
                self.waits.pop(wait_id, None)
        if self.metrics is not None:
            self.metrics.recv_done(path, time.perf_counter() - t0)
            self.metrics.local_op("recv", hop, nbytes)
        return reply

    async def _reply(self, item: Any, path: str, client_id: str) -> tuple[bytes, str, int]:
        """(LocalRecvResponse bytes, "inline" or "shm", payload bytes)."""
        tail = wire.len_field_header(F.LOCAL_REPLY_PATH, len(path)) + path.encode()
        value = item.value
        session = self.sessions.get(client_id) if client_id else None
        if (item.is_dead or session is None or self.shm_threshold < 0 or not isinstance(value, np.ndarray)
                or not is_memcpyable(value) or value.nbytes == 0 or value.nbytes < self.shm_threshold):
            return frames.unary_response(item) + tail, "inline", payload_nbytes(value)
        if value.nbytes >= _OFF_LOOP_BYTES:
            name, nbytes = await asyncio.get_running_loop().run_in_executor(None, shm.write, session.prefix, value)
        else:
            name, nbytes = shm.write(session.prefix, value)
        if not session.alive:  # the client went while we wrote: nobody will take it
            shm.discard(name)
            raise Unavailable(f"client {client_id} is gone")
        meta = encode_meta(TensorMeta(value.dtype, value.shape))
        seg = wire.len_field_header(F.SEGMENT_NAME, len(name)) + name.encode() + \
            wire.varint_field(F.SEGMENT_NBYTES, nbytes)
        reply = b"".join([wire.len_field_header(F.LOCAL_REPLY_TENSOR, len(meta)), meta,
                          wire.len_field_header(F.LOCAL_REPLY_SHM, len(seg)), seg, tail])
        return reply, "shm", nbytes

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

    async def _pending(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            return lpb.PendingResponse(entries=self.pending()).SerializeToString()
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
        prefix = f"rdv-{req.pid}-{req.client_id}-"
        session = _Session(req.client_id, req.pid, prefix)
        self.sessions[req.client_id] = session
        log.debug("client %s (pid %d) attached", req.client_id, req.pid)
        gone = True
        try:
            yield lpb.AttachResponse(task=str(self.server.task), shm_threshold=self.shm_threshold,
                                     max_tensor_bytes=self.config.max_tensor_bytes,
                                     shm_prefix=prefix).SerializeToString()
            await self._closed.wait()
            gone = False
        finally:
            session.alive = False
            self.sessions.pop(req.client_id, None)
            if gone and not self.closing:
                swept = shm.sweep(prefix)
                log.info("client %s (pid %d) detached; %d shared-memory segment(s) it left unlinked",
                         req.client_id, req.pid, swept)

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


def _segment(buf: bytes, a: int, b: int) -> tuple[str, int]:
    name, nbytes = "", 0
    for num, wt, x, y in wire.iter_fields(buf, a, b):
        if num == F.SEGMENT_NAME and wt == wire.LEN:
            name = _text(buf, x, y, "shm.name")
        elif num == F.SEGMENT_NBYTES and wt == wire.VARINT:
            nbytes = wire.to_signed64(x)
    if not shm.NAME_RE.match(name):
        raise InvalidArgument(f"{name!r} is not a rendezvous shared-memory segment name")
    return name, nbytes
