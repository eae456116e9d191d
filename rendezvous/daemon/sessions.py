"""The session socket: local clients' fast path into rendezvousd.

Beside its gRPC local socket, a daemon listens on a second Unix socket (the
first's path plus ``.session``, mode 0600 like it; the listener is
:mod:`rendezvous.daemon.listener`). A local client connects once and keeps
the connection for its life: that connection is its :class:`Session`.
Frames (:mod:`rendezvous.local.frames`) carry the local service's messages
(:mod:`rendezvous.local.messages`);
replies are tagged with their operation's id, so a client may have any
number of operations in flight and a burst of them costs one write.

Tensors of at least ``shm_threshold`` bytes travel through the daemon's
shared-memory pool (:mod:`rendezvous.daemon.pool`):

* **send**: the client writes into a segment the daemon lent it and names
  the segment; the table holds an array on it (no copy in the daemon). The
  answer lends a replacement of the same size class when the pool has one,
  so a client in a steady rhythm never waits for a lend.
* **recv**: a tensor already on a segment (a local client's send, or a
  receive from a peer, which the daemon makes into pool memory: see
  :class:`PoolBuffers`) is handed over as it is; any other is copied into a
  segment once. The client's array is a view on its mapping; when the array
  is gone the client releases the segment and it returns to the pool.

A segment's descriptor goes to a session once, on first use; both sides keep
their mappings. The kernel tells the daemon who connected (``SO_PEERCRED``),
and only the daemon's user (or root) can open the socket. A session that
ends (closed, or its process died) gives back everything it held; its recvs
in flight are cancelled and whatever they had fetched is kept for the next
recv. A client mistake (a bad frame, a segment it does not hold, a frame
over the limit) gets an ERROR frame, or for broken framing the end of its
session; it never reaches the table or the other sessions.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from google.protobuf.message import DecodeError

from rendezvous.codec import fields as F
from rendezvous.codec import wire
from rendezvous.buffers import RecvBuffers
from rendezvous.errors import Cancelled, InvalidArgument, RendezvousError, ResourceExhausted
from rendezvous.local import ipc as ipc_messages
from rendezvous.local import messages
from rendezvous.local.connection import Connection
from rendezvous.local.frames import (HEADER, SEND_MANY_BODY, SMALL_BODY, FrameError, FrameTooLarge, Kind, frame,
                                     pack_error, pack_grants, unpack_ids)
from rendezvous.paths import Hop
from rendezvous.rpc.admin import PENDING_BYTES
from rendezvous.stats import payload_nbytes
from rendezvous.codec.tensors import TensorMeta
from rendezvous.v1 import local_pb2 as lpb

from .ipc import SessionIpc
from .placing import Answer, Placing
from .pool import Pool, Segment

if TYPE_CHECKING:
    import socket

    from .listener import SessionListener

__all__ = ["Session", "PoolBuffers", "FRAME_SLACK", "SMALL_FRAME", "SHARE", "SESSION_HIGH_WATER", "UCRED"]

log = logging.getLogger("rendezvous.daemon")
UCRED = struct.Struct("3i")
#: frame bytes beyond a tensor's own (key, dtype, shape and field headers)
FRAME_SLACK = 1 << 20
#: the largest frame of an operation that carries no tensor (RECV, RECV_MANY, LEND,
#: CANCEL, RELEASE, ABORT, PENDING, HELLO): a key is at most 16,384 characters
SMALL_FRAME = SMALL_BODY
#: bytes of replies a session may leave unread before the daemon stops taking its
#: frames (one reply larger than this still goes out whole)
SESSION_HIGH_WATER = 8 << 20
#: descriptors a session may leave unread (segments introduced to it) likewise
SESSION_FDS = 32
#: the share of the pool's segments, and of max_waiting_calls, one session may hold:
#: what one client takes, the others still have
SHARE = 8


class PoolBuffers(RecvBuffers):
    """A daemon's receive buffers: a tensor of at least ``threshold`` bytes
    received from a peer lands in a pool segment, which a local client can then
    map as it is (no copy between the network and the client). Smaller ones, and
    all when the pool is full, come from :class:`RecvBuffers`."""

    def __init__(self, pool: Pool, threshold: int, limit: int) -> None:
        super().__init__(limit)
        self.pool = pool
        self.threshold = threshold

    def empty(self, shape: Any, dtype: Any) -> np.ndarray:
        dt = np.dtype(dtype)
        dims = tuple(int(d) for d in shape) if isinstance(shape, (tuple, list)) else (int(shape),)
        nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
        if 0 <= self.threshold <= nbytes and nbytes > 0 and not dt.hasobject:
            arr = self.pool.array(dims, dt)
            if arr is not None:
                return arr
        return super().empty(dims, dt)


class Session(Placing):
    """One client's connection."""

    def __init__(self, server: SessionListener, sid: str, sock: socket.socket, pid: int, uid: int) -> None:
        self.server = server
        self.servicer = server.servicer
        self.pool = server.pool
        self.id = sid
        self.pid, self.uid = pid, uid  # the kernel's word (SO_PEERCRED)
        self.client_id = ""
        self.hello = False
        self.recvs: dict[int, asyncio.Task] = {}  # its RECVs, RECV_MANYs and SEND_IPCs in flight
        self.waiting = 0  # keys those recvs wait for (a RECV_MANY counts each of its keys)
        self._counted: dict[int, int] = {}  # keys of each recv in flight counted in waiting (none once cancelled)
        self._reserved = 0  # segments chosen for answers being made, not handed over yet
        self.bad = 0
        # A tensor's bytes come only in SEND and RETURN (one tensor each) and SEND_MANY
        # (small ones packed) frames; every other kind is bounded by SMALL_FRAME, by its
        # header alone. A few frames are handed over at a time, so a client that reads
        # no replies stops being read within a few of them (see local.connection.Connection).
        self.conn = Connection(sock, limit=SMALL_FRAME, on_frames=self._frames, on_close=self._closed,
                                         limits={Kind.SEND: server.frame_limit, Kind.RETURN: server.frame_limit,
                                                 Kind.SEND_MANY: SEND_MANY_BODY},
                                         high_water=SESSION_HIGH_WATER, max_fds=SESSION_FDS, group=1,
                                         farewell=self._farewell)
        self.ipc = SessionIpc(server.ipc, pid, self.servicer)

    @property
    def lent(self) -> int:
        """Segments lent to this session and not sent into (tests, diagnostics)."""
        return sum(1 for seg in list(self.pool._segments.values()) if seg.lent_to == self.id)

    # -- frames in --------------------------------------------------------------

    def _frames(self, frames_in: list[tuple[int, int, memoryview]], fds: list[int]) -> None:
        for fd in fds:  # the daemon never takes descriptors (recv drops them anyway)
            os.close(fd)
        for kind, op, body in frames_in:
            if self.conn.ending:
                return
            try:
                self._dispatch(kind, op, body)
            except RendezvousError as exc:
                self._error(op, exc)
            except Exception as exc:  # a bug, not the client's: logged, and the session goes on
                log.error("session frame failed", exc_info=exc)
                self._error(op, exc)

    def _dispatch(self, kind: int, op: int, body: memoryview) -> None:
        if not self.hello:
            if kind != Kind.HELLO:
                self._error(op, InvalidArgument("a session begins with HELLO"))
                self.conn.close_after_flush()
                return
            self._hello(op, body)
        elif kind == Kind.SEND or kind == Kind.RETURN:
            self._send(op, body, keep=kind == Kind.RETURN)
        elif kind == Kind.SEND_MANY:
            self.servicer.send_many(body)
            self.conn.write(frame(Kind.OK, op))
        elif kind == Kind.SEND_IPC:
            self._start(op, 0, self.ipc.send(op, ipc_messages.sent(body), self.conn.write, self._error))
        elif kind == Kind.IPC_RELEASE:
            self.ipc.released(body)
        elif kind == Kind.RECV:
            req = messages.parse_recv(body)
            self._start(op, 1, self._recv(op, req))
        elif kind == Kind.RECV_MANY:
            many = messages.parse_recv_many(body)
            self._start(op, len(many.rendezvous_keys), self._recv_many(op, many))
        elif kind == Kind.CANCEL:
            task = self.recvs.get(op)
            if task is not None:
                # a recv given up no longer counts against the share, although it
                # still unwinds: the client may ask its keys again at once
                self.waiting -= self._counted.pop(op, 0)
                task.cancel()
        elif kind == Kind.RELEASE:
            for seg_id in unpack_ids(body):
                if not self.pool.release(seg_id, self.id):
                    self._misuse(f"released segment {seg_id}, which it does not hold")
        elif kind == Kind.LEND:
            (nbytes,) = struct.unpack("<Q", body) if len(body) == 8 else (-1,)
            if nbytes <= 0:
                raise InvalidArgument(f"a lend asks for {nbytes} bytes")
            if nbytes > self.servicer.config.max_tensor_bytes:
                raise ResourceExhausted(f"a lend asks for {nbytes} bytes, more than max_tensor_bytes "
                                        f"({self.servicer.config.max_tensor_bytes})")
            self._lend(op, nbytes, Kind.OK, required=True)
        elif kind == Kind.ABORT:
            try:
                abort = lpb.AbortRequest.FromString(bytes(body))
            except DecodeError as exc:
                raise InvalidArgument(f"malformed AbortRequest: {exc}") from None
            self.servicer.server.abort(abort.step_id, abort.message or "aborted")
            self.conn.write(frame(Kind.OK, op))
        elif kind == Kind.PENDING:
            body_out = self.servicer.pending_reply(PENDING_BYTES).SerializeToString()
            self.conn.write(frame(Kind.PENDING_REPLY, op, body_out))
        elif kind == Kind.HELLO:
            raise InvalidArgument("this session already said HELLO")
        else:
            raise InvalidArgument(f"unknown frame kind {kind}")

    def _hello(self, op: int, body: memoryview) -> None:
        try:
            req = lpb.AttachRequest.FromString(bytes(body))
        except DecodeError as exc:
            raise InvalidArgument(f"malformed AttachRequest: {exc}") from None
        self.hello = True
        self.client_id = req.client_id[:32]
        log.debug("client %s (pid %d, uid %d) opened %s", self.client_id, self.pid, self.uid, self.id)
        welcome = self.servicer.welcome(self.server.threshold, self.server.frame_limit)
        self.conn.write(frame(Kind.WELCOME, op, welcome.SerializeToString()))

    # -- send -------------------------------------------------------------------

    def _resolve(self, seg_id: int, nbytes: int, meta: TensorMeta) -> np.ndarray:
        return self.pool.sent_on(seg_id, self.id, nbytes, meta.dtype, meta.shape)

    def _given_back(self, seg_id: int, nbytes: int, meta: TensorMeta) -> np.ndarray:
        return self.pool.given_back(seg_id, self.id, nbytes, meta.dtype, meta.shape)

    def _send(self, op: int, body: memoryview, keep: bool) -> None:
        try:
            sent = self.servicer.send(body, self._given_back if keep else self._resolve, keep=keep)
        except BaseException:
            self._forfeit(body)
            raise
        metrics = self.servicer.metrics
        if metrics is not None:
            metrics.local_op("send", sent.hop, sent.nbytes)
        if sent.hop is Hop.SHM and not keep:
            self._lend(op, sent.nbytes, Kind.OK, required=False)  # a replacement for the next send
        else:
            self.conn.write(frame(Kind.OK, op))

    def _forfeit(self, body: memoryview) -> None:
        """A failed pooled send gives its segment back: the client forgets it too."""
        try:
            for num, wt, a, b in wire.iter_fields(body):
                if num == F.SEND_POOLED and wt == wire.LEN:
                    self.pool.release(messages.parse_slot(body, a, b)[0], self.id)
        except RendezvousError:
            pass

    def _lend(self, op: int, nbytes: int, kind: int, required: bool) -> None:
        """Answer ``op`` with a segment for ``nbytes`` lent to this session (if the
        pool has room; ``required``: RESOURCE_EXHAUSTED otherwise)."""
        seg = None
        held = self.pool.holds(self.id)
        share = self.server.segment_share
        if held < share:
            seg = self.pool.lend(nbytes, self.id)
        elif required:
            raise ResourceExhausted(
                f"this session already holds {held} shared-memory segments (lent and not sent, or received and "
                f"not released); at most {share} (1/{SHARE} of the pool's {self.pool.max_segments})")
        if seg is None:
            if required:
                raise ResourceExhausted(f"the daemon's shared-memory pool is full ({self.pool.total} of "
                                        f"{self.pool.limit} bytes, shm_pool_bytes): no segment for {nbytes} bytes")
            self.conn.write(frame(Kind.OK, op))
            return
        self._introduce(seg)
        self.conn.write(frame(kind, op, pack_grants([(seg.id, seg.size)])))

    def _introduce(self, seg: Segment) -> None:
        """Send the segment's descriptor if this session has not got it yet."""
        if self.pool.mark_known(seg, self.id):
            fd = os.dup(seg.fd)  # the connection closes its copy once it is sent
            self.conn.write(frame(Kind.SEGMENTS, 0, pack_grants([(seg.id, seg.size)])), [fd])

    # -- recv -------------------------------------------------------------------

    def _start(self, op: int, keys: int, answer: Any) -> None:
        """Run a RECV's or RECV_MANY's ``answer`` (a coroutine) as operation ``op``,
        within this session's share of waiting recvs."""
        if op in self.recvs:
            answer.close()
            raise InvalidArgument(f"operation id {op} is already in flight")
        if self.waiting + keys > self.server.recv_share:
            answer.close()
            raise ResourceExhausted(f"this session already waits for {self.waiting} keys and asks {keys} more (at "
                                    f"most {self.server.recv_share}: 1/{SHARE} of max_waiting_calls)")
        self.waiting += keys
        self._counted[op] = keys
        task = asyncio.get_running_loop().create_task(answer)
        self.recvs[op] = task
        task.add_done_callback(lambda t: self._ended(op, t))

    def _ended(self, op: int, task: asyncio.Task) -> None:
        self.recvs.pop(op, None)
        self.waiting -= self._counted.pop(op, 0)
        if task.cancelled():
            # Cancelled before it ever ran (its CANCEL came in the same read as
            # the RECV): its coroutine never reached the CANCELLED answer it
            # writes itself, and it took nothing. The client waits for one
            # frame for every operation, a cancelled one too.
            self._error(op, Cancelled("the recv was cancelled before it started"))

    async def _recv(self, op: int, req: lpb.LocalRecvRequest) -> None:
        """Answer one RECV: exactly one frame for ``op``, RECV_REPLY or ERROR (CANCELLED
        after the client's CANCEL). Fetched and not handed over is kept."""
        t0 = time.perf_counter()
        metrics = self.servicer.metrics
        try:
            ipc = req.ipc_device  # (a recv bound for a GPU: CUDA IPC, where it can)
            item, path = await self.servicer.fetch(req, self.ipc.device(req) if ipc else "cpu")
            try:
                # a client that reads no replies gets no more written for it: the
                # tensor waits here (and is kept if the session ends)
                await self.conn.room()
                exported, item = await self.ipc.reply(req, item, path) if ipc else (None, item)
                reply = Answer(exported[0], Hop.IPC, 0) if exported else await self._reply(item, path)
            except BaseException:
                self.servicer.give_back(req, item)
                raise
            self.conn.write(frame(Kind.RECV_REPLY, op, reply.body))
            # a client that goes away before all of it is written never had it
            if exported:
                self.conn.on_unsent(self.ipc.unsent, exported[1])
            else:
                self.conn.on_unsent(self.servicer.give_back, req, item)
            if metrics is not None:
                metrics.recv_done(path, time.perf_counter() - t0)
                metrics.local_op("recv", reply.hop, reply.nbytes)
        except asyncio.CancelledError:
            self._error(op, Cancelled(f"recv of {req.rendezvous_key!r} (step {req.step_id}) was cancelled"))
        except RendezvousError as exc:
            self._error(op, exc)
        except Exception as exc:
            log.error("local recv failed", exc_info=exc)
            self._error(op, exc)

    async def _recv_many(self, op: int, req: lpb.LocalRecvManyRequest) -> None:
        """Answer one RECV_MANY: exactly one frame for ``op``, RECV_MANY_REPLY (every
        tensor in key order, or which keys failed: then nothing was taken) or
        ERROR. Fetched and not handed over is kept, in order."""
        t0 = time.perf_counter()
        try:
            try:
                got = await self.servicer.fetch_many(req)
            except RendezvousError as exc:
                failed = self.servicer.many_failed(req.rendezvous_keys, exc)
                if failed is None:
                    raise
                self.conn.write(frame(Kind.RECV_MANY_REPLY, op, failed))
                return
            try:
                await self.conn.room()
                places = await self._places([f.item for f in got])
                parts, hops, handed = self._many_body(got, places)  # no await until the reply is written
                self._hand_over(handed)
            except BaseException:
                self.servicer.give_back_many(req, [f.item for f in got])
                raise
            # gathered by the socket's write: the packed tensors' bytes are not copied here
            self.conn.write(HEADER.pack(sum(len(p) for p in parts), Kind.RECV_MANY_REPLY, op))
            for part in parts:
                self.conn.write(part)
            # a client that goes away before all of it is written never had any of it
            self.conn.on_unsent(self._unsent_batch, req, got)
            self.servicer.batch_done(got, time.perf_counter() - t0, hops)
        except asyncio.CancelledError:
            self._error(op, Cancelled(f"recv_many of {len(req.rendezvous_keys)} keys (step {req.step_id}) "
                                      "was cancelled"))
        except RendezvousError as exc:
            self._error(op, exc)
        except Exception as exc:
            log.error("local recv_many failed", exc_info=exc)
            self._error(op, exc)

    def _unsent_batch(self, req: lpb.LocalRecvManyRequest, got: list[Any]) -> None:
        """A batch's answer that did not all reach the socket before the session
        ended: its client never had it, so every tensor is kept for the next
        recv of its key, in order."""
        log.warning("client %s (pid %d) went away before its answer to a batch of %d keys (step %d) was written; "
                    "its tensors are kept for the next recv of each key", self.client_id or self.id, self.pid,
                    len(got), req.step_id)
        self.servicer.give_back_many(req, [f.item for f in got], why=None)

    # -- errors and the end -----------------------------------------------------------

    def _farewell(self, exc: FrameError) -> bytes:
        """The ERROR frame that tells a client why its session ends (it broke the framing)."""
        self._misuse(str(exc))
        code = ResourceExhausted.code if isinstance(exc, FrameTooLarge) else InvalidArgument.code
        return frame(Kind.ERROR, 0, pack_error(code.value[0], exc.message))

    def _error(self, op: int, exc: BaseException) -> None:
        code, message = self.servicer._error(exc)
        self.conn.write(frame(Kind.ERROR, op, pack_error(code.value[0], message)))

    def _misuse(self, what: str) -> None:
        """A client broke the protocol: counted, and logged for the first and every
        thousandth time in the daemon (a client that opens session after session
        to misbehave in each cannot flood the log)."""
        self.bad += 1
        self.server.misused += 1
        if self.server.misused == 1 or self.server.misused % 1000 == 0:
            log.warning("client %s (pid %d) %s (%d such frames from local clients so far)",
                        self.client_id or self.id, self.pid, what, self.server.misused)
        if self.servicer.metrics is not None:
            self.servicer.metrics.error("INVALID_ARGUMENT")

    def _closed(self, error: BaseException | None) -> None:
        self.server.ended(self)
        for task in list(self.recvs.values()):
            task.cancel()
        n = self.pool.session_gone(self.id)
        if error is not None and not isinstance(error, (ConnectionError, FrameError)):
            log.warning("client %s (pid %d) session ended: %s", self.client_id or self.id, self.pid, error)
        log.debug("client %s (pid %d) closed %s; %d segment hold(s) given back", self.client_id or self.id,
                  self.pid, self.id, n)
