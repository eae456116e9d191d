"""The local client: a training process's handle on its node's rendezvousd.

    from rendezvous.client import Client

    with Client() as c:                      # the default Unix socket, or Client("unix:/path")
        c.send(key, np.ones(1 << 20), step_id=3)
        grads = c.recv(other_key, step_id=3, timeout=30)

``send`` puts a tensor into the daemon's waiting table (the key's producer
must be the daemon's task); ``recv`` asks the daemon for a tensor produced on
this node or anywhere in the cluster.

On the daemon's machine the client keeps one connection to the daemon's
session socket (:mod:`rendezvous.daemon.sessions`) for its life. Tensors of
at least the daemon's shared-memory threshold cross the local hop through
the daemon's pool of shared-memory segments (:mod:`rendezvous.shm`): a send
copies the array into a segment once; a recv returns an array that *is* a
view on a segment (read in place, writable), which goes back to the pool
when the array and every view of it are gone. Smaller tensors travel in the
frames. Over TCP (or with ``shm_ok=False``) the client uses the daemon's
gRPC service instead, every tensor inside its messages.

Every error is a :class:`rendezvous.RendezvousError` with the daemon's status
(``Aborted``, ``DeadlineExceeded``, ``Unavailable`` while it drains, ...).
:class:`rendezvous.client.aio.Client` is the same for coroutines.

Addresses: ``unix:PATH`` or ``HOST:PORT``; by default ``$RENDEZVOUS_LOCAL_ADDRESS``,
else ``unix:$XDG_RUNTIME_DIR/rendezvous/rendezvousd.sock``, else
``unix:/run/rendezvous/rendezvousd.sock``.
"""

from __future__ import annotations

import collections
import itertools
import os
import secrets
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import numpy as np

from rendezvous import auth, localwire, shm, wire
from rendezvous import fields as F
from rendezvous.errors import (
    DeadlineExceeded,
    InvalidArgument,
    RendezvousError,
    ResourceExhausted,
    Unavailable,
    from_status,
)
from rendezvous.keys import Key, as_key
from rendezvous.localwire import Kind
from rendezvous.rpc.options import local_channel_options
from rendezvous.table import Received
from rendezvous.tensors import TensorMeta, as_array, decode_meta, decode_tensor, encode_header, encode_meta, \
    is_memcpyable
from rendezvous.v1 import local_pb2 as lpb

__all__ = ["Client", "LocalPending", "PendingList", "default_address", "channel_target", "session_socket"]

SERVICE = "/rendezvous.v1.LocalRendezvous/"
SOCKET_NAME = "rendezvousd.sock"


class LocalPending(NamedTuple):
    """One entry of :meth:`Client.pending`."""

    step_id: int
    key: str
    kind: str  # "tensor" (produced, not consumed), "waiter" (a consumer waits here), "remote" (a local recv waits)
    count: int
    oldest_age_s: float
    producer: str  # the task producing the key


def default_address(env: Any = None) -> str:
    """``$RENDEZVOUS_LOCAL_ADDRESS``, else the daemon's default Unix socket."""
    env = os.environ if env is None else env
    given = env.get("RENDEZVOUS_LOCAL_ADDRESS")
    if given:
        return given
    base = env.get("XDG_RUNTIME_DIR")
    folder = Path(base) / "rendezvous" if base else Path("/run/rendezvous")
    return f"unix:{folder / SOCKET_NAME}"


def channel_target(address: str) -> tuple[str, bool]:
    """(gRPC target, whether shared memory can work: same machine)."""
    if address.startswith("unix:"):
        return address, True
    host = address.rsplit(":", 1)[0].strip("[]")
    if ":" not in address:
        raise InvalidArgument(f"local address {address!r} is neither unix:PATH nor HOST:PORT")
    return address, host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")


def session_socket(address: str) -> str | None:
    """The daemon's session socket beside a ``unix:`` local address, if it exists."""
    if not address.startswith("unix:") or not shm.available():
        return None
    path = address[5:]
    if path.startswith("//"):
        path = path[2:]
    path += ".session"
    return path if os.path.exists(path) else None


def token_metadata(address: str, token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The token goes over TCP only (a Unix socket is guarded by its file mode)."""
    token = os.environ.get("RENDEZVOUS_TOKEN", "") if token is None else token
    if not token or address.startswith("unix:"):
        return None
    return auth.token_metadata(token)


# -- the messages (shared with the async client) --------------------------------------


def send_head(key: Key | str, step_id: int) -> bytes:
    k = as_key(key).format().encode()
    return wire.varint_field(F.SEND_STEP_ID, step_id) + wire.len_field_header(F.SEND_KEY, len(k)) + k


def inline_send(head: bytes, tensor: Any, is_dead: bool) -> tuple[bytes, int]:
    """The SendRequest bytes with the tensor inside; (body, payload bytes)."""
    if is_dead:
        return head + wire.varint_field(F.SEND_IS_DEAD, 1), 0
    arr = as_array(tensor)
    header, payload = encode_header(arr)
    size = len(header) + (len(payload) if payload is not None else 0)
    parts = [head, wire.len_field_header(F.SEND_TENSOR, size), header]
    if payload is not None:
        parts.append(payload)
    return b"".join(parts), arr.nbytes if is_memcpyable(arr) else 0


def pooled_send(head: bytes, arr: np.ndarray, seg_id: int) -> bytes:
    """The SendRequest bytes naming pool segment ``seg_id``, which holds ``arr``'s bytes."""
    meta = encode_meta(TensorMeta(arr.dtype, arr.shape))
    slot = wire.varint_field(F.SLOT_SEGMENT, seg_id) + wire.varint_field(F.SLOT_NBYTES, arr.nbytes)
    return b"".join([head, wire.len_field_header(F.SEND_TENSOR, len(meta)), meta,
                     wire.len_field_header(F.SEND_POOLED, len(slot)), slot])


def recv_request(key: Key | str, step_id: int, timeout: float | None) -> bytes:
    return lpb.LocalRecvRequest(step_id=step_id, rendezvous_key=as_key(key).format(),
                                timeout=timeout or 0.0).SerializeToString()


def _reply_fields(raw: bytes | memoryview) -> tuple[Any, bool, Any, str]:
    """(tensor span, is_dead, pooled slot span, path) of a LocalRecvResponse."""
    tensor = slot = None
    is_dead = False
    path = "local"
    for num, wt, a, b in wire.iter_fields(raw):
        if num == F.LOCAL_REPLY_TENSOR and wt == wire.LEN:
            tensor = (a, b)
        elif num == F.LOCAL_REPLY_IS_DEAD and wt == wire.VARINT:
            is_dead = bool(a)
        elif num == F.LOCAL_REPLY_POOLED and wt == wire.LEN:
            slot = (a, b)
        elif num == F.LOCAL_REPLY_PATH and wt == wire.LEN:
            path = bytes(raw[a:b]).decode()
    return tensor, is_dead, slot, path


def parse_reply(raw: bytes | memoryview, segments: "Segments | None" = None) -> tuple[Received, str, str]:
    """(item, daemon path, local hop "inline"|"shm") of a LocalRecvResponse."""
    tensor, is_dead, slot, path = _reply_fields(raw)
    if is_dead:
        return Received(None, True), path, "inline"
    if tensor is None:
        raise InvalidArgument("daemon reply carries no tensor")
    if slot is not None:
        if segments is None:
            raise InvalidArgument("a pooled reply outside a session")
        seg = lpb.PoolSlot.FromString(bytes(raw[slot[0]:slot[1]]))
        meta, _, _ = decode_meta(raw, *tensor)
        return Received(segments.view(seg.segment, seg.nbytes, meta), False), path, "shm"
    return Received(decode_tensor(raw, *tensor), False), path, "inline"


def error_from(exc: grpc.RpcError) -> RendezvousError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    return from_status(code, exc.details() if hasattr(exc, "details") else str(exc))


def frame_error(body: bytes | memoryview) -> RendezvousError:
    code, message = localwire.unpack_error(body)
    return from_status(code, message)


class PendingList(list):  # list[LocalPending]
    """What :meth:`Client.pending` returns: the entries (the oldest first), and in
    ``omitted`` how many the daemon left out to keep its answer one bounded message."""

    omitted: int = 0


def to_pending(raw: bytes | memoryview) -> PendingList:
    reply = lpb.PendingResponse.FromString(bytes(raw))
    out = PendingList(LocalPending(e.step_id, e.rendezvous_key, e.kind, e.count, e.oldest_age_seconds, e.producer)
                      for e in reply.entries)
    out.omitted = reply.omitted
    return out


# -- a session's shared memory (shared with the async client) ------------------------------


class Segments:
    """A session client's side of the pool: the segments it has mapped (kept
    mapped for reuse, until the daemon retires them) and the ones lent to it for
    its next sends (its stock). Thread-safe."""

    def __init__(self, on_release: Callable[[], None]) -> None:
        self._maps: dict[int, shm.Mapping] = {}
        self._stock: dict[int, list[int]] = {}  # size -> lent segment ids
        self._sizes: dict[int, int] = {}
        self._fds: collections.deque[int] = collections.deque()
        self._released: list[int] = []
        # re-entrant: a finalizer (a received array going) may run inside any of these methods
        self._lock = threading.RLock()
        self._on_release = on_release  # a release is waiting to be told
        self.closed = False

    def got_fds(self, fds: list[int]) -> None:
        self._fds.extend(fds)

    def introduce(self, body: bytes | memoryview) -> None:
        """A SEGMENTS frame: map each granted segment with the next descriptor."""
        grants = localwire.unpack_grants(body)
        for seg_id, size in grants:
            if not self._fds:
                raise localwire.FrameError("a SEGMENTS frame came without its descriptors")
            fd = self._fds.popleft()
            try:
                mm = shm.map_segment(fd, size)
            finally:
                os.close(fd)
            with self._lock:
                old = self._maps.pop(seg_id, None)
                self._maps[seg_id] = mm
                self._sizes[seg_id] = size
            if old is not None:
                old.close()

    def retire(self, body: bytes | memoryview) -> None:
        for seg_id in localwire.unpack_ids(body):
            with self._lock:
                mm = self._maps.pop(seg_id, None)
                size = self._sizes.pop(seg_id, 0)
                stock = self._stock.get(size)
                if stock and seg_id in stock:
                    stock.remove(seg_id)
            if mm is not None:
                mm.close()

    def lent(self, body: bytes | memoryview) -> None:
        """An OK frame's grants: segments lent for sends."""
        for seg_id, size in localwire.unpack_grants(body):
            with self._lock:
                if seg_id in self._maps:
                    self._stock.setdefault(size, []).append(seg_id)

    def take(self, nbytes: int) -> int | None:
        """A lent segment for ``nbytes`` (of its size class), or None."""
        with self._lock:
            stock = self._stock.get(shm.size_class(nbytes))
            return stock.pop() if stock else None

    def write(self, seg_id: int, arr: np.ndarray) -> None:
        """Copy ``arr``'s bytes into segment ``seg_id`` (the send's one copy)."""
        with self._lock:
            mm = self._maps[seg_id]
        dest = np.frombuffer(mm.buffer, np.uint8, arr.nbytes)
        np.copyto(dest, np.ascontiguousarray(arr).reshape(-1).view(np.uint8))

    def view(self, seg_id: int, nbytes: int, meta: TensorMeta) -> np.ndarray:
        """The received tensor on segment ``seg_id``; released when it (and every
        view of it) is gone."""
        with self._lock:
            mm = self._maps.get(seg_id)
            size = self._sizes.get(seg_id, 0)
        if mm is None:
            raise InvalidArgument(f"the daemon named segment {seg_id}, which this client does not map")
        if meta.nbytes != nbytes or not 0 < nbytes <= size:
            raise InvalidArgument(f"segment {seg_id} of {size} bytes cannot hold {meta.dtype} {meta.shape} "
                                  f"({nbytes} bytes announced)")
        owner = np.frombuffer(mm.buffer, np.uint8, nbytes)
        weakref.finalize(owner, self._released_one, seg_id)
        return owner.view(meta.dtype).reshape(meta.shape)

    def _released_one(self, seg_id: int) -> None:
        with self._lock:
            if self.closed:
                return
            self._released.append(seg_id)
        self._on_release()

    def drain_released(self) -> bytes:
        """A RELEASE frame for every segment let go since the last call (or b"")."""
        with self._lock:
            ids, self._released = self._released, []
        return localwire.frame(Kind.RELEASE, 0, localwire.pack_ids(ids)) if ids else b""

    def close(self) -> None:
        with self._lock:
            self.closed = True
            maps, self._maps = self._maps, {}
            self._stock.clear()
            fds = list(self._fds)
            self._fds.clear()
        for fd in fds:
            os.close(fd)
        for mm in maps.values():
            mm.close()  # unmapped now, or with the last array on it


class _Op:
    __slots__ = ("kind", "body", "done", "key", "step_id")

    def __init__(self, key: str = "", step_id: int = 0) -> None:
        self.kind = 0
        self.body: Any = b""
        self.done = False
        self.key = key
        self.step_id = step_id


def returned(op: _Op, body: bytes | memoryview) -> bytes:
    """A RETURN frame's body for a RECV_REPLY whose recv gave up: the same
    tensor, as a SendRequest the daemon keeps for the next recv of its key."""
    head = send_head(op.key, op.step_id)
    tensor, is_dead, slot, _ = _reply_fields(body)
    parts = [head]
    if is_dead:
        parts.append(wire.varint_field(F.SEND_IS_DEAD, 1))
    if tensor is not None:
        parts += [wire.len_field_header(F.SEND_TENSOR, tensor[1] - tensor[0]), bytes(body[tensor[0]:tensor[1]])]
    if slot is not None:  # field 7 in both messages: the slot passes as it is
        parts += [wire.len_field_header(F.SEND_POOLED, slot[1] - slot[0]), bytes(body[slot[0]:slot[1]])]
    return b"".join(parts)


class Router:
    """What both session clients do with a frame from the daemon that is not
    the answer itself: map and retire segments, take lent grants, and give back
    a tensor whose recv gave up. Subclasses hold ``segments``, ``_ops`` (op id
    -> pending entry), ``_cancelled`` (op id -> the _Op of a recv that gave up)
    and ``_write(data)``."""

    segments: Segments
    _ops: dict[int, Any]
    _cancelled: dict[int, _Op]

    def _write(self, data: bytes) -> None:
        raise NotImplementedError

    def _give_up(self, op_id: int, op: _Op) -> None:
        """The caller of RECV ``op_id`` stopped waiting (a deadline of its own, a
        cancel, Ctrl-C). Its answer is given back, never dropped: if it already
        came, the tensor goes back now (RETURN); if not, the daemon's wait is
        cancelled and a tensor that still comes is given back when it does.
        (The blocking client calls this under the lock its reader routes under.)"""
        if self._ops.pop(op_id, None) is not None:
            self._cancelled[op_id] = op
            self._write(localwire.frame(Kind.CANCEL, op_id))
        elif op.done and op.kind == Kind.RECV_REPLY:
            self._write(localwire.frame(Kind.RETURN, 0, returned(op, op.body)))

    def _route(self, kind: int, op_id: int, body: memoryview) -> Any:
        """The pending entry this frame answers, or None (handled here)."""
        if kind == Kind.SEGMENTS:
            self.segments.introduce(body)
            return None
        if kind == Kind.RETIRE:
            self.segments.retire(body)
            return None
        entry = self._ops.pop(op_id, None)
        if entry is None:
            late = self._cancelled.pop(op_id, None)
            if late is not None and kind == Kind.RECV_REPLY:
                self._write(localwire.frame(Kind.RETURN, 0, returned(late, body)))
            return None
        if kind == Kind.OK:
            self.segments.lent(body)
        return entry


# -- the blocking session ------------------------------------------------------------------------


class _Session(Router):
    """A blocking client's connection to the session socket. Any thread may call;
    whichever caller is waiting reads for everyone (no reader thread, so a
    lone caller reads its own reply with no hand-off)."""

    def __init__(self, path: str, client_id: str, timeout: float) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.settimeout(None)
        except OSError as exc:
            sock.close()
            raise Unavailable(f"cannot connect to the daemon's session socket {path}: {exc}") from None
        self.sock = sock
        self.path = path
        self.reader = localwire.FrameReader(1 << 62)  # the daemon is trusted with the frame sizes it sends
        self.segments = Segments(self._release_soon)
        self._ops: dict[int, _Op] = {}
        self._cancelled: dict[int, _Op] = {}
        self._ids = itertools.count(1)
        self._wlock = threading.Lock()
        self._rlock = threading.Lock()
        self._cond = threading.Condition()
        self._error: RendezvousError | None = None
        welcome = self.call(Kind.HELLO, lpb.AttachRequest(client_id=client_id, pid=os.getpid()).SerializeToString(),
                            timeout=timeout)
        self.info = lpb.AttachResponse.FromString(bytes(welcome))

    # -- writing ----------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        with self._wlock:
            released = self.segments.drain_released()
            try:
                self.sock.sendall(released + data if released else data)
            except OSError as exc:
                raise Unavailable(f"the daemon's session socket broke: {exc}") from None

    def _release_soon(self) -> None:
        """A received array went: tell the daemon now if no write is in progress
        (else the next write carries it)."""
        if self._error is None and self._wlock.acquire(blocking=False):
            try:
                released = self.segments.drain_released()
                if released:
                    self.sock.sendall(released)
            except OSError:
                pass
            finally:
                self._wlock.release()

    # -- calls ------------------------------------------------------------------

    def call(self, kind: int, body: bytes, timeout: float | None = None, key: str = "",
             step_id: int = 0) -> memoryview:
        """Send one operation and wait for its answer (its body; the error it carries
        is raised). ``timeout``: give up (DeadlineExceeded) after this many seconds."""
        if self._error is not None:
            raise self._error
        op = _Op(key, step_id)
        op_id = next(self._ids)
        self._ops[op_id] = op
        try:
            self._write(localwire.frame(kind, op_id, body))
            self._wait(op, None if timeout is None else _now() + timeout)
        except BaseException as exc:
            if kind == Kind.RECV:
                # interrupted (Ctrl-C) or out of time: the tensor is given back
                try:
                    with self._cond:
                        self._give_up(op_id, op)
                except RendezvousError:
                    pass
            else:
                self._ops.pop(op_id, None)
            if isinstance(exc, TimeoutError):
                raise DeadlineExceeded(f"the daemon did not answer within {timeout:g}s") from None
            raise
        if op.kind == Kind.ERROR:
            raise frame_error(op.body)
        return op.body

    def _wait(self, op: _Op, deadline: float | None) -> None:
        while not op.done:
            if self._error is not None:
                raise self._error
            if self._rlock.acquire(blocking=False):
                try:
                    while not op.done:
                        self._read(deadline)
                finally:
                    self._rlock.release()
                    with self._cond:
                        self._cond.notify_all()
            else:
                with self._cond:
                    if not op.done and self._rlock.locked() and self._error is None:
                        left = None if deadline is None else deadline - _now()
                        if left is not None and left <= 0:
                            raise TimeoutError
                        self._cond.wait(left)

    def _read(self, deadline: float | None) -> None:
        if self._error is not None:
            raise self._error
        if deadline is not None:
            left = deadline - _now()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                raise TimeoutError
        anc = socket.CMSG_SPACE(localwire.MAX_FDS * 4)
        try:
            into = self.reader.into()
            if into is not None:
                n, ancdata, _, _ = self.sock.recvmsg_into([into], anc)
                fds = localwire.take_fds(ancdata)
                frames = self.reader.filled(n) if n else None
            else:
                data, ancdata, _, _ = self.sock.recvmsg(256 << 10, anc)
                fds = localwire.take_fds(ancdata)
                frames = self.reader.feed(data) if data else None
        except OSError as exc:
            self._fail(Unavailable(f"the daemon's session socket broke: {exc}"))
            raise self._error from None
        self.segments.got_fds(fds)
        if frames is None:
            self._fail(Unavailable("the daemon closed the session (it stopped or restarted)"))
            raise self._error
        for kind, op_id, body in frames:
            self._frame(kind, op_id, body)

    def _frame(self, kind: int, op_id: int, body: memoryview) -> None:
        with self._cond:  # routed and marked done at once: see _give_up
            op = self._route(kind, op_id, body)
            if op is not None:
                op.kind, op.body, op.done = kind, body, True
                self._cond.notify_all()

    def _fail(self, error: RendezvousError) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def close(self) -> None:
        self._fail(Unavailable("client is closed"))
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.segments.close()


def _now() -> float:
    return time.monotonic()


# -- the blocking client --------------------------------------------------------------------


class Client:
    """A blocking client of the node's rendezvousd; usable from any thread.

    Connects at construction (Unavailable if no daemon answers within
    ``connect_timeout`` seconds). ``shm_ok``: use the session socket and
    shared memory (default: when the daemon offers a session socket beside a
    ``unix:`` address). ``token``: sent over TCP (default ``$RENDEZVOUS_TOKEN``)."""

    def __init__(self, address: str | None = None, *, token: str | None = None, shm_ok: bool | None = None,
                 connect_timeout: float = 30.0) -> None:
        self.address = address or default_address()
        target, _ = channel_target(self.address)
        self._metadata = token_metadata(self.address, token)
        self._counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self.client_id = secrets.token_hex(6)
        self._closed = False
        self._link: _Session | None = None
        self._channel: grpc.Channel | None = None
        path = session_socket(self.address) if shm_ok is not False else None
        if path is not None:
            self._link = _Session(path, self.client_id, connect_timeout)
            info = self._link.info
            self.shm_threshold = info.shm_threshold
        else:
            self._connect_grpc(target, connect_timeout)
            info = self._info
            self.shm_threshold = -1
        self.task = info.task  #: the daemon's task

    def _connect_grpc(self, target: str, connect_timeout: float) -> None:
        self._channel = grpc.insecure_channel(target, options=local_channel_options())
        self._calls = {name: self._channel.unary_unary(SERVICE + name)
                       for name in ("Send", "Recv", "Abort", "Pending")}
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout)
            self._session = self._channel.unary_stream(SERVICE + "Attach")(
                lpb.AttachRequest(client_id=self.client_id, pid=os.getpid()).SerializeToString(),
                metadata=self._metadata)
            self._info = lpb.AttachResponse.FromString(next(self._session))
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise Unavailable(f"no rendezvousd answers at {self.address} within {connect_timeout:g}s") from None
        except grpc.RpcError as exc:
            self._channel.close()
            raise error_from(exc) from None

    @property
    def session(self) -> bool:
        """Whether this client talks over the session socket (shared memory)."""
        return self._link is not None

    # -- calls -----------------------------------------------------------------------

    def _call(self, name: str, body: bytes, timeout: float | None = None) -> bytes:
        if self._closed:
            raise Unavailable("client is closed")
        fut = self._calls[name].future(body, timeout=timeout, metadata=self._metadata)
        try:
            return fut.result()
        except grpc.RpcError as exc:
            raise error_from(exc) from None
        except BaseException:
            fut.cancel()  # Ctrl-C: stop the daemon's wait too (nothing is consumed)
            raise

    def send(self, key: Key | str, tensor: Any, step_id: int = 0, is_dead: bool = False) -> None:
        """Produce ``tensor`` under ``key`` (whose producer is the daemon's task).
        Returns once the daemon holds it; the caller may then reuse its array."""
        if self._closed:
            raise Unavailable("client is closed")
        head = send_head(key, step_id)
        link = self._link
        if link is None:
            body, _ = inline_send(head, tensor, is_dead)
            self._call("Send", body)
            self._count("send_inline")
            return
        if not is_dead:
            arr = as_array(tensor)
            if 0 <= self.shm_threshold <= arr.nbytes and arr.nbytes and is_memcpyable(arr):
                seg_id = link.segments.take(arr.nbytes)
                if seg_id is None:
                    try:
                        link.call(Kind.LEND, struct.pack("<Q", arr.nbytes))
                    except ResourceExhausted:
                        pass  # the pool is full: inline
                    seg_id = link.segments.take(arr.nbytes)
                if seg_id is not None:
                    link.segments.write(seg_id, arr)
                    link.call(Kind.SEND, pooled_send(head, arr, seg_id))
                    self._count("send_shm")
                    return
            tensor = arr
        body, _ = inline_send(head, tensor, is_dead)
        link.call(Kind.SEND, body)
        self._count("send_inline")

    def recv_item(self, key: Key | str, step_id: int = 0, timeout: float | None = None) -> Received:
        if self._closed:
            raise Unavailable("client is closed")
        body = recv_request(key, step_id, timeout)
        # The daemon enforces ``timeout`` (DEADLINE_EXCEEDED naming the key); the
        # deadline behind it only guards against a daemon that never answers.
        guard = None if timeout is None else timeout + 10.0
        if self._link is None:
            item, path, hop = parse_reply(self._call("Recv", body, guard))
        else:
            raw = self._link.call(Kind.RECV, body, guard, as_key(key).format(), step_id)
            item, path, hop = parse_reply(raw, self._link.segments)
        with self._lock:
            self._counts[f"recv_{hop}"] += 1
            self._counts[path] += 1
        return item

    def recv(self, key: Key | str, step_id: int = 0, timeout: float | None = None) -> np.ndarray | None:
        """The tensor sent under ``key`` in ``step_id`` (None if dead), produced on
        this node or fetched by the daemon from its producer. Over the session
        socket a large one is a view on shared memory, yours until you drop it."""
        return self.recv_item(key, step_id, timeout).value

    def abort(self, step_id: int, message: str = "aborted") -> None:
        """Abort the step in the daemon: its waiters and later sends/recvs fail ABORTED."""
        body = lpb.AbortRequest(step_id=step_id, message=message).SerializeToString()
        if self._link is None:
            self._call("Abort", body)
        else:
            self._link.call(Kind.ABORT, body)

    def pending(self) -> PendingList:
        """What waits in the daemon: produced tensors, waiting consumers, local recvs
        waiting on other tasks; with the age of the oldest of each, the oldest
        first (``omitted``: how many more the daemon left out of its answer)."""
        if self._link is None:
            return to_pending(self._call("Pending", b""))
        return to_pending(self._link.call(Kind.PENDING, b""))

    def _count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    def stats(self) -> dict[str, int]:
        """This client's counts: send_/recv_ inline|shm (the local hop), and
        local|grpc|mpi (how the daemon got what was received)."""
        with self._lock:
            return dict(self._counts)

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """End the session (the daemon takes back the shared memory it lent) and
        close the connection. Arrays received stay valid. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._link is not None:
            self._link.close()
        if self._channel is not None:
            self._session.cancel()
            self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
