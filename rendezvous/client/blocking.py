"""The local client: a training process's handle on its node's rendezvousd.

    from rendezvous.client import Client

    with Client() as c:                      # the default Unix socket, or Client("unix:/path")
        c.send(key, np.ones(1 << 20), step_id=3)
        grads = c.recv(other_key, step_id=3, timeout=30)

On the daemon's machine the client keeps one connection to the daemon's
session socket (:mod:`rendezvous.daemon.sessions`) for its life, and large
tensors cross through the daemon's pool of shared-memory segments; over TCP
(or with ``shm_ok=False``) it calls the daemon's gRPC service, every tensor
inside the messages. client/README.md tells every call, the addresses and the
pool. :class:`rendezvous.client.aio.Client` is the same for coroutines; both
make their decisions in :mod:`rendezvous.client.core` (GPU tensors:
:mod:`rendezvous.client.gpu`). Every error is a
:class:`rendezvous.RendezvousError` with the daemon's status.
"""

from __future__ import annotations

import itertools
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from rendezvous import auth
from rendezvous.devices import Devices
from rendezvous.errors import DeadlineExceeded, RendezvousError, Unavailable
from rendezvous.keys import Key
from rendezvous.local import messages
from rendezvous.local.address import channel_target, default_address, session_socket
from rendezvous.local.frames import MAX_FDS, READ_BYTES, FrameReader, Kind, frame, take_fds
from rendezvous.local.messages import PendingList
from rendezvous.rpc.options import local_channel_options
from rendezvous.items import Received
from rendezvous.v1 import local_pb2 as lpb

from .core import GRPC_METHODS, RECVS, ClientCore, Copy, LocalOp, check_socket, drive
from .link import InFlight, Router
from .segments import Segments

__all__ = ["Client", "token_metadata"]


def token_metadata(address: str, token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The token goes over TCP only (a Unix socket is guarded by its file mode)."""
    token = os.environ.get("RENDEZVOUS_TOKEN", "") if token is None else token
    if not token or address.startswith("unix:"):
        return None
    return auth.token_metadata(token)


class _BlockingLink(Router):
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
        self.reader = FrameReader(1 << 62)  # the daemon is trusted with the frame sizes it sends
        self.segments = Segments(self._release_soon)
        self._ops: dict[int, InFlight] = {}
        self._cancelled: dict[int, LocalOp] = {}
        self._ids = itertools.count(1)
        self._wlock = threading.Lock()
        self._rlock = threading.Lock()
        self._cond = threading.Condition()
        self._error: RendezvousError | None = None
        #: the frames of the read being routed: the last one routed whole, and
        #: the one begun (its position, and the waiting call it answers, if any)
        self._routed = -1
        self._routing: tuple[int, InFlight | None] = (-1, None)
        hello = lpb.AttachRequest(client_id=client_id, pid=os.getpid()).SerializeToString()
        try:
            self.info = lpb.AttachResponse.FromString(bytes(self.call(LocalOp(Kind.HELLO, hello, timeout))))
        except DeadlineExceeded:
            self.close()
            raise Unavailable(f"no rendezvousd answers on {path} within {timeout:g}s") from None

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

    def call(self, op: LocalOp) -> memoryview:
        """Send one operation and wait for its answer (its body; the error it carries
        is raised). ``op.timeout``: give up (DeadlineExceeded) after this many seconds."""
        if self._error is not None:
            raise self._error
        entry = InFlight(op)
        op_id = next(self._ids)
        self._ops[op_id] = entry
        try:
            self._write(frame(op.kind, op_id, op.body))
            self._wait(entry, None if op.timeout is None else time.monotonic() + op.timeout)
        except BaseException as exc:
            if op.kind in RECVS:
                # interrupted (Ctrl-C) or out of time: the tensor is given back
                try:
                    with self._cond:
                        self._give_up(op_id, entry)
                except RendezvousError:
                    pass
            else:
                self._ops.pop(op_id, None)
            if isinstance(exc, TimeoutError):
                raise DeadlineExceeded(f"the daemon did not answer within {op.timeout:g}s") from None
            raise
        if entry.kind == Kind.ERROR:
            raise messages.frame_error(entry.body)
        return entry.body

    def _wait(self, entry: InFlight, deadline: float | None) -> None:
        self._wait_until(lambda: entry.done, deadline)

    def _wait_until(self, ready: Callable[[], bool], deadline: float | None) -> None:
        while not ready():
            if self._error is not None:
                raise self._error
            if self._rlock.acquire(blocking=False):
                try:
                    while not ready():
                        self._read(deadline)
                finally:
                    self._rlock.release()
                    with self._cond:
                        self._cond.notify_all()
            else:
                with self._cond:
                    if not ready() and self._rlock.locked() and self._error is None:
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            raise TimeoutError
                        self._cond.wait(left)

    def _read(self, deadline: float | None) -> None:
        if self._error is not None:
            raise self._error
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                raise TimeoutError
        anc = socket.CMSG_SPACE(MAX_FDS * 4)
        try:
            into = self.reader.into()
            if into is not None:
                n, ancdata, _, _ = self.sock.recvmsg_into([into], anc)
                fds = take_fds(ancdata)
                frames = self.reader.filled(n) if n else None
            else:
                data, ancdata, _, _ = self.sock.recvmsg(READ_BYTES, anc)
                fds = take_fds(ancdata)
                frames = self.reader.feed(data) if data else None
        except OSError as exc:
            raise self._fail(Unavailable(f"the daemon's session socket broke: {exc}")) from None
        self.segments.got_fds(fds)
        if frames is None:
            raise self._fail(Unavailable("the daemon closed the session (it stopped or restarted)"))
        self._route_all(frames)

    def _route_all(self, frames: list[tuple[int, int, memoryview]]) -> None:
        """Route the frames of one read, read for every caller. A caller
        interrupted here (Ctrl-C) finishes first: the answer whose routing the
        interrupt cut short is marked answered (so that its caller, when it is
        this one, gives it back: see :meth:`call`), and the frames after it are
        routed (other callers wait for them)."""
        self._routed = -1
        try:
            for i, (kind, op_id, body) in enumerate(frames):
                self._frame(i, kind, op_id, body)
        except BaseException:
            self._finish(frames)
            raise

    def _frame(self, i: int, kind: int, op_id: int, body: memoryview) -> None:
        with self._cond:  # routed and marked done at once: see _give_up
            self._routing = (i, self._ops.get(op_id))
            entry = self._route(kind, op_id, body)
            if entry is not None:
                entry.answered(kind, body)
                self._cond.notify_all()
            self._routed = i  # the last step: nothing left to finish for this frame

    def _finish(self, frames: list[tuple[int, int, memoryview]]) -> None:
        """Route what an interrupt left of ``frames`` (see :meth:`_route_all`)."""
        cut = self._routed + 1
        if cut >= len(frames):
            return
        kind, op_id, body = frames[cut]
        at, waiting = self._routing
        with self._cond:
            if at != cut or (waiting is not None and self._ops.get(op_id) is waiting):
                self._frame(cut, kind, op_id, body)  # not begun, or not taken off the waiting calls yet
            elif waiting is not None and not waiting.done:
                waiting.answered(kind, body)  # taken off the waiting calls, not marked: its caller gives it back
                self._cond.notify_all()
            # else a frame of segments, or a late answer, cut short inside: left as it is
            for i in range(cut + 1, len(frames)):
                self._frame(i, *frames[i])

    def _fail(self, error: RendezvousError) -> RendezvousError:
        """Fail the link with ``error`` (its first error stays); returns the link's error."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()
            return self._error

    def close(self) -> None:
        self._fail(Unavailable("client is closed"))
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.segments.close()


class Client:
    """A blocking client of the node's rendezvousd; usable from any thread.

    Connects at construction. A ``unix:`` address whose socket does not exist
    fails at once (Unavailable naming the path: no daemon runs there); a daemon
    that exists but does not answer is waited for up to ``connect_timeout``
    seconds (default 30), then Unavailable. ``shm_ok``: use the session
    socket and shared memory (default: when the daemon offers a session
    socket beside a ``unix:`` address). ``token``: sent over TCP (default
    ``$RENDEZVOUS_TOKEN``). ``devices``: the GPU backends GPU tensors are sent
    and received with (default: cupy's, loaded at the first GPU tensor)."""

    def __init__(self, address: str | None = None, *, token: str | None = None, shm_ok: bool | None = None,
                 connect_timeout: float = 30.0, devices: Devices | None = None) -> None:
        self.address = address or default_address()
        target, _ = channel_target(self.address)
        check_socket(self.address)
        self._metadata = token_metadata(self.address, token)
        self._core = ClientCore(devices)
        self.client_id = secrets.token_hex(6)
        self._closed = False
        self._link: _BlockingLink | None = None
        self._channel: grpc.Channel | None = None
        path = session_socket(self.address) if shm_ok is not False else None
        if path is not None:
            self._link = _BlockingLink(path, self.client_id, connect_timeout)
            self._core.attached(self._link.info, self._link.segments)
        else:
            self._core.attached(self._connect_grpc(target, connect_timeout), None)

    def _connect_grpc(self, target: str, connect_timeout: float) -> lpb.AttachResponse:
        self._channel = grpc.insecure_channel(target, options=local_channel_options())
        self._calls: dict[str, grpc.UnaryUnaryMultiCallable[bytes, bytes]] = {
            name: self._channel.unary_unary(messages.METHOD + name) for name in GRPC_METHODS.values()}
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout)
            attach: grpc.UnaryStreamMultiCallable[bytes, bytes] = self._channel.unary_stream(messages.METHOD + "Attach")
            self._session = attach(
                lpb.AttachRequest(client_id=self.client_id, pid=os.getpid()).SerializeToString(),
                metadata=self._metadata)
            return lpb.AttachResponse.FromString(next(self._session))
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise Unavailable(f"no rendezvousd answers at {self.address} within {connect_timeout:g}s") from None
        except grpc.RpcError as exc:
            self._channel.close()
            raise messages.error_from(exc) from None

    @property
    def task(self) -> str:
        """The daemon's task."""
        return self._core.task

    @property
    def shm_threshold(self) -> int:
        """Smallest tensor that crosses the local hop through shared memory (-1: never)."""
        return self._core.shm_threshold

    @property
    def session(self) -> bool:
        """Whether this client talks over the session socket (shared memory)."""
        return self._link is not None

    # -- calls -----------------------------------------------------------------------

    def _do(self, op: LocalOp) -> bytes | memoryview:
        """Carry out ``op``: on the session socket, or as a gRPC call."""
        if self._closed:
            raise Unavailable("client is closed")
        if self._link is not None:
            return self._link.call(op)
        fut = self._calls[GRPC_METHODS[op.kind]].future(op.body, timeout=op.timeout, metadata=self._metadata)
        try:
            return fut.result()
        except grpc.RpcError as exc:
            raise messages.error_from(exc) from None
        except BaseException:
            fut.cancel()  # Ctrl-C: stop the daemon's wait too (nothing is consumed)
            raise

    def empty(self, shape: Any, dtype: Any = float) -> np.ndarray:
        """A new array to fill and send without a copy: on a pool segment lent to
        this client, which :meth:`send` hands over as it is (a receiver on this
        node gets a view on the same memory). After the send it is the tensor's:
        read-only, and not to be read once it may be received. Dropped unsent, its
        segment goes back to this client. Without a session socket, or beyond this
        client's share of the pool, an ordinary array. client/README.md: "Lent buffers"."""
        if self._closed:
            raise Unavailable("client is closed")
        return drive(self._core.empty_plan(shape, dtype), self._do, None)

    def zeros(self, shape: Any, dtype: Any = float) -> np.ndarray:
        """:meth:`empty`, filled with zeros."""
        arr = self.empty(shape, dtype)
        arr.fill(0)
        return arr

    def send(self, key: Key | str, tensor: Any, step_id: int = 0, is_dead: bool = False) -> None:
        """Produce ``tensor`` under ``key`` (whose producer is the daemon's task). Returns
        once the daemon holds it; the caller may then reuse its array, unless it came
        from :meth:`empty` or a recv on shared memory: that one was handed over."""
        if self._closed:
            raise Unavailable("client is closed")
        drive(self._core.send_plan(key, tensor, step_id, is_dead), self._do, self._copy)

    def _copy(self, step: Any) -> Any:
        if not isinstance(step, Copy):
            return self._core.run(step)  # a GPU copy
        assert self._link is not None
        self._link.segments.write(step.seg_id, step.arr)
        return None

    def recv_item(self, key: Key | str, step_id: int = 0, timeout: float | None = None,
                  device: str | None = None) -> Received:
        """:meth:`recv` as ``Received(value, is_dead)``."""
        op, targets = self._core.recv_op(key, step_id, timeout, device)
        item = self._core.received(self._do(op), targets is not None)
        return item if targets is None else \
            drive(self._core.placed_plan((op.key,), step_id, [item], targets), self._do, self._copy)[0]

    def recv(self, key: Key | str, step_id: int = 0, timeout: float | None = None,
             device: str | None = None) -> Any:
        """The tensor sent under ``key`` in ``step_id`` (None if dead), from this node
        or fetched by the daemon. A large one is a view on shared memory (over the
        session socket), yours until you drop it; on the key's dst_device (``GPU:N``:
        a cupy array on GPU N) or ``device`` ("cpu", "gpu:N"), as a server's recv."""
        return self.recv_item(key, step_id, timeout, device).value

    def send_many(self, items: Iterable[tuple[Any, ...]] | Mapping[Key | str, Any], step_id: int = 0) -> None:
        """Send many tensors (``(key, tensor)`` or ``(key, tensor, is_dead)``
        items, or a mapping): every one checked first, then sent in their order:
        each run of small host arrays (under the shared-memory threshold) packed
        in one operation of up to 4 MiB, the others (large, dead, strings) one
        by one. Returns once the daemon holds them all."""
        for step in self._core.send_many_plan(self._core.check_items(items), step_id):
            if isinstance(step, LocalOp):
                self._do(step)  # a run of small tensors, packed in one operation
            else:
                self.send(step[0], step[1], step_id, step[2])

    def recv_many(self, keys: Sequence[Key | str], step_id: int = 0,
                  timeout: float | None = None, device: str | None = None) -> list[Any]:
        """Many tensors, in key order, under one deadline, all or none: if one key
        fails, nothing is taken (the daemon keeps what had arrived for the next
        recv of its key), and the error names the keys that failed (see
        :meth:`rendezvous.aio.Server.recv_many`), each placed as :meth:`recv`'s. One
        operation for the daemon, which asks each remote producer once for its keys."""
        return [item.value for item in self.recv_many_items(keys, step_id, timeout, device)]

    def recv_many_items(self, keys: Sequence[Key | str], step_id: int = 0,
                        timeout: float | None = None, device: str | None = None) -> list[Received]:
        """:meth:`recv_many` as ``Received(value, is_dead)`` items."""
        if not keys:
            return []
        op = self._core.recv_many_op(keys, step_id, timeout)
        targets = self._core.gpu.targets(op.keys, device)
        items = self._core.received_many(self._do(op), op)
        return items if targets is None else \
            drive(self._core.placed_plan(op.keys, step_id, items, targets), self._do, self._copy)

    def abort(self, step_id: int, message: str = "aborted") -> None:
        """Abort the step in the daemon: its waiters and later sends/recvs fail ABORTED."""
        self._do(self._core.abort_op(step_id, message))

    def pending(self) -> PendingList:
        """What waits in the daemon: produced tensors, waiting consumers, local recvs
        waiting on other tasks; with the age of the oldest of each, the oldest
        first (``omitted``: how many more the daemon left out of its answer)."""
        return messages.to_pending(self._do(self._core.pending_op()))

    def stats(self) -> dict[str, int]:
        """This client's counts (see :meth:`rendezvous.client.core.ClientCore.stats`)."""
        return self._core.stats()

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """End the session (the daemon takes back the shared memory it lent, and
        what it exported by IPC) and close the connection. Arrays received stay valid."""
        if self._closed:
            return
        self._closed = True
        self._core.close()
        if self._link is not None:
            self._link.close()
        if self._channel is not None:
            self._session.cancel()
            self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
