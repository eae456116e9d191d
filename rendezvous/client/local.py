"""The local client: a training process's handle on its node's rendezvousd.

    from rendezvous.client import Client

    with Client() as c:                      # the default Unix socket, or Client("unix:/path")
        c.send(key, np.ones(1 << 20), step_id=3)
        grads = c.recv(other_key, step_id=3, timeout=30)

``send`` puts a tensor into the daemon's waiting table (the key's producer
must be the daemon's task); ``recv`` asks the daemon for a tensor produced on
this node or anywhere in the cluster. Tensors of at least the daemon's
shared-memory threshold cross the local hop through a segment
(:mod:`rendezvous.shm`): written once by the sender, mapped by the receiver,
no socket copy. Smaller ones travel in the gRPC message.

Every error is a :class:`rendezvous.RendezvousError` with the daemon's status
(``Aborted``, ``DeadlineExceeded``, ``Unavailable`` while it drains, ...).
:class:`rendezvous.client.aio.Client` is the same for coroutines.

Addresses: ``unix:PATH`` or ``HOST:PORT``; by default ``$RENDEZVOUS_LOCAL_ADDRESS``,
else ``unix:$XDG_RUNTIME_DIR/rendezvous/rendezvousd.sock``, else
``unix:/run/rendezvous/rendezvousd.sock``.
"""

from __future__ import annotations

import collections
import os
import secrets
import threading
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import numpy as np

from rendezvous import auth, shm, wire
from rendezvous import fields as F
from rendezvous.rpc.options import local_channel_options
from rendezvous.errors import InvalidArgument, RendezvousError, Unavailable, from_status
from rendezvous.keys import Key, as_key
from rendezvous.table import Received
from rendezvous.tensors import TensorMeta, as_array, decode_meta, decode_tensor, encode_header, encode_meta, \
    is_memcpyable
from rendezvous.v1 import local_pb2 as lpb

__all__ = ["Client", "LocalPending", "default_address", "channel_target"]

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


def token_metadata(address: str, token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The token goes over TCP only (a Unix socket is guarded by its file mode)."""
    token = os.environ.get("RENDEZVOUS_TOKEN", "") if token is None else token
    if not token or address.startswith("unix:"):
        return None
    return auth.token_metadata(token)


# -- the messages (shared with the async client) --------------------------------------


class Prepared(NamedTuple):
    body: bytes
    segment: str | None  # a segment to discard if the send fails
    path: str
    nbytes: int


def prepare_send(key: Key | str, tensor: Any, step_id: int, is_dead: bool, prefix: str | None,
                 threshold: int, client_id: str) -> Prepared:
    """The SendRequest bytes; a tensor of at least ``threshold`` bytes is written
    to shared memory first (``prefix`` and ``client_id``: the session's)."""
    k = as_key(key).format().encode()
    head = wire.varint_field(F.SEND_STEP_ID, step_id) + wire.len_field_header(F.SEND_KEY, len(k)) + k
    if is_dead:
        return Prepared(head + wire.varint_field(F.SEND_IS_DEAD, 1), None, "inline", 0)
    arr = as_array(tensor)
    if (prefix is not None and threshold >= 0 and is_memcpyable(arr) and arr.nbytes
            and arr.nbytes >= threshold):
        name, nbytes = shm.write(prefix, arr)
        meta = encode_meta(TensorMeta(arr.dtype, arr.shape))
        seg = wire.len_field_header(F.SEGMENT_NAME, len(name)) + name.encode() + \
            wire.varint_field(F.SEGMENT_NBYTES, nbytes)
        who = client_id.encode()
        return Prepared(b"".join([head, wire.len_field_header(F.SEND_TENSOR, len(meta)), meta,
                                  wire.len_field_header(F.SEND_SHM, len(seg)), seg,
                                  wire.len_field_header(F.SEND_CLIENT_ID, len(who)), who]), name, "shm", nbytes)
    header, payload = encode_header(arr)
    size = len(header) + (len(payload) if payload is not None else 0)
    parts = [head, wire.len_field_header(F.SEND_TENSOR, size), header]
    if payload is not None:
        parts.append(payload)
    return Prepared(b"".join(parts), None, "inline", arr.nbytes if is_memcpyable(arr) else 0)


def recv_request(key: Key | str, step_id: int, timeout: float | None, client_id: str) -> bytes:
    return lpb.LocalRecvRequest(step_id=step_id, rendezvous_key=as_key(key).format(),
                                timeout=timeout or 0.0, client_id=client_id).SerializeToString()


def parse_reply(raw: bytes) -> tuple[Received, str, str]:
    """(item, daemon path, local hop "inline"|"shm") of a LocalRecvResponse."""
    tensor = segment = None
    is_dead = False
    path = "local"
    for num, wt, a, b in wire.iter_fields(raw):
        if num == F.LOCAL_REPLY_TENSOR and wt == wire.LEN:
            tensor = (a, b)
        elif num == F.LOCAL_REPLY_IS_DEAD and wt == wire.VARINT:
            is_dead = bool(a)
        elif num == F.LOCAL_REPLY_SHM and wt == wire.LEN:
            segment = (a, b)
        elif num == F.LOCAL_REPLY_PATH and wt == wire.LEN:
            path = bytes(raw[a:b]).decode()
    if is_dead:
        return Received(None, True), path, "inline"
    if tensor is None:
        raise InvalidArgument("daemon reply carries no tensor")
    if segment is not None:
        seg = lpb.ShmSegment.FromString(bytes(raw[segment[0]:segment[1]]))
        meta, _, _ = decode_meta(raw, *tensor)
        return Received(shm.take(seg.name, seg.nbytes, meta.dtype, meta.shape), False), path, "shm"
    return Received(decode_tensor(raw, *tensor), False), path, "inline"


def error_from(exc: grpc.RpcError) -> RendezvousError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    return from_status(code, exc.details() if hasattr(exc, "details") else str(exc))


def to_pending(raw: bytes) -> list[LocalPending]:
    return [LocalPending(e.step_id, e.rendezvous_key, e.kind, e.count, e.oldest_age_seconds, e.producer)
            for e in lpb.PendingResponse.FromString(raw).entries]


# -- the blocking client --------------------------------------------------------------------


class Client:
    """A blocking client of the node's rendezvousd; usable from any thread.

    Connects and attaches a session at construction (Unavailable if no daemon
    answers within ``connect_timeout`` seconds). ``shm``: use shared memory
    for large tensors (default: when the daemon is on this machine).
    ``token``: sent over TCP (default ``$RENDEZVOUS_TOKEN``)."""

    def __init__(self, address: str | None = None, *, token: str | None = None, shm_ok: bool | None = None,
                 connect_timeout: float = 30.0) -> None:
        self.address = address or default_address()
        target, same_host = channel_target(self.address)
        self._metadata = token_metadata(self.address, token)
        self._channel = grpc.insecure_channel(target, options=local_channel_options())
        self._calls = {name: self._channel.unary_unary(SERVICE + name)
                       for name in ("Send", "Recv", "Abort", "Pending")}
        self._counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self.client_id = secrets.token_hex(6)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout)
            self._session = self._channel.unary_stream(SERVICE + "Attach")(
                lpb.AttachRequest(client_id=self.client_id, pid=os.getpid()).SerializeToString(),
                metadata=self._metadata)
            info = lpb.AttachResponse.FromString(next(self._session))
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise Unavailable(f"no rendezvousd answers at {self.address} within {connect_timeout:g}s") from None
        except grpc.RpcError as exc:
            self._channel.close()
            raise error_from(exc) from None
        self.task = info.task  #: the daemon's task
        use_shm = (same_host if shm_ok is None else shm_ok) and shm.available() and info.shm_threshold >= 0
        self.shm_threshold = info.shm_threshold if use_shm else -1
        self._prefix = info.shm_prefix if use_shm else None
        self._closed = False

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
        prepared = prepare_send(key, tensor, step_id, is_dead, self._prefix, self.shm_threshold,
                                self.client_id)
        try:
            self._call("Send", prepared.body)
        except BaseException:
            if prepared.segment is not None:
                shm.discard(prepared.segment)
            raise
        with self._lock:
            self._counts[f"send_{prepared.path}"] += 1

    def recv_item(self, key: Key | str, step_id: int = 0, timeout: float | None = None) -> Received:
        body = recv_request(key, step_id, timeout, self.client_id if self._prefix else "")
        # The daemon enforces ``timeout`` (DEADLINE_EXCEEDED naming the key); the
        # gRPC deadline behind it only guards against a daemon that never answers.
        raw = self._call("Recv", body, None if timeout is None else timeout + 10.0)
        item, path, hop = parse_reply(raw)
        with self._lock:
            self._counts[f"recv_{hop}"] += 1
            self._counts[path] += 1
        return item

    def recv(self, key: Key | str, step_id: int = 0, timeout: float | None = None) -> np.ndarray | None:
        """The tensor sent under ``key`` in ``step_id`` (None if dead), produced on
        this node or fetched by the daemon from its producer."""
        return self.recv_item(key, step_id, timeout).value

    def abort(self, step_id: int, message: str = "aborted") -> None:
        """Abort the step in the daemon: its waiters and later sends/recvs fail ABORTED."""
        self._call("Abort", lpb.AbortRequest(step_id=step_id, message=message).SerializeToString())

    def pending(self) -> list[LocalPending]:
        """What waits in the daemon: produced tensors, waiting consumers, local recvs
        waiting on other tasks; with the age of the oldest of each."""
        return to_pending(self._call("Pending", b""))

    def stats(self) -> dict[str, int]:
        """This client's counts: send_/recv_ inline|shm (the local hop), and
        local|grpc|mpi (how the daemon got what was received)."""
        with self._lock:
            return dict(self._counts)

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """End the session and close the channel. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._session.cancel()
        self._channel.close()
        if self._prefix:
            shm.sweep(self._prefix)  # a segment of a send that never reached the daemon

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
