"""The local client for asyncio code: ``rendezvous.client.aio.Client``.

The same calls as :class:`rendezvous.client.Client`, as coroutines, on one
event loop (the one that first uses it)::

    async with Client("unix:/run/rendezvous/rendezvousd.sock") as c:
        await c.send(key, tensor, step_id=3)
        value = await c.recv(other_key, step_id=3, timeout=30)

Over the session socket any number of calls may be in flight at once; each
loop turn's frames go out in one write. A cancelled ``recv`` cancels the
daemon's wait; a tensor already on its way is given back to the daemon for
the next recv of its key: nothing is consumed.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import secrets
import socket
import struct
from typing import Any

import grpc
import numpy as np

from rendezvous import localwire
from rendezvous.errors import ResourceExhausted, Unavailable
from rendezvous.keys import Key, as_key
from rendezvous.localwire import Kind
from rendezvous.rpc.options import local_channel_options
from rendezvous.table import Received
from rendezvous.tensors import as_array, is_memcpyable
from rendezvous.v1 import local_pb2 as lpb

from .local import (
    SERVICE,
    PendingList,
    Router,
    Segments,
    _Op,
    channel_target,
    default_address,
    error_from,
    frame_error,
    inline_send,
    parse_reply,
    pooled_send,
    recv_request,
    send_head,
    session_socket,
    to_pending,
    token_metadata,
)

__all__ = ["Client"]

# Shared-memory copies this big run on a worker thread (numpy releases the GIL).
_OFF_LOOP_BYTES = 4 << 20


class _AioSession(Router):
    """An asyncio client's connection to the session socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.loop = asyncio.get_running_loop()
        self.segments = Segments(self._release_soon)
        self._ops: dict[int, tuple[_Op, asyncio.Future]] = {}
        self._cancelled: dict[int, _Op] = {}
        self._ids = itertools.count(1)
        self._error: BaseException | None = None
        self._release_pending = False
        self.conn = localwire.Connection(sock, limit=1 << 62, on_frames=self._frames, on_close=self._closed,
                                         fds=True)

    def _write(self, data: bytes) -> None:
        self.conn.write(data)

    def _frames(self, frames: list[tuple[int, int, memoryview]], fds: list[int]) -> None:
        self.segments.got_fds(fds)
        for kind, op_id, body in frames:
            entry = self._route(kind, op_id, body)
            if entry is not None:
                op, fut = entry
                op.kind, op.body, op.done = kind, body, True
                if not fut.done():
                    fut.set_result(None)

    def _closed(self, error: BaseException | None) -> None:
        self._error = Unavailable(f"the daemon's session socket broke: {error}" if error is not None else
                                  "the daemon closed the session (it stopped or restarted)")
        for _, fut in self._ops.values():
            if not fut.done():
                fut.set_exception(self._error)
        self._ops.clear()

    def _release_soon(self) -> None:
        """A received array went (any thread): tell the daemon on the loop."""
        if self._release_pending or self.conn.closed:
            return
        self._release_pending = True
        try:
            self.loop.call_soon_threadsafe(self._flush_released)
        except RuntimeError:
            pass  # the loop is gone: the session ends with it

    def _flush_released(self) -> None:
        self._release_pending = False
        data = self.segments.drain_released()
        if data:
            self.conn.write(data)

    async def call(self, kind: int, body: bytes, timeout: float | None = None, key: str = "",
                   step_id: int = 0) -> memoryview:
        if self._error is not None:
            raise self._error
        op = _Op(key, step_id)
        op_id = next(self._ids)
        fut = self.loop.create_future()
        self._ops[op_id] = (op, fut)
        released = self.segments.drain_released()
        self.conn.write(released + localwire.frame(kind, op_id, body) if released else
                        localwire.frame(kind, op_id, body))
        try:
            await asyncio.wait_for(fut, timeout)
        except BaseException:
            if kind == Kind.RECV:
                self._give_up(op_id, op)  # the tensor, now or when it comes, is given back
            else:
                self._ops.pop(op_id, None)
            raise
        if op.kind == Kind.ERROR:
            raise frame_error(op.body)
        return op.body

    def close(self) -> None:
        self.conn.close(None)
        self.segments.close()


class Client:
    """An asyncio client of the node's rendezvousd. Connects on first use or in ``async with``."""

    def __init__(self, address: str | None = None, *, token: str | None = None, shm_ok: bool | None = None,
                 connect_timeout: float = 30.0) -> None:
        self.address = address or default_address()
        self._target, _ = channel_target(self.address)
        self._metadata = token_metadata(self.address, token)
        self._shm_ok = shm_ok
        self._connect_timeout = connect_timeout
        self.client_id = secrets.token_hex(6)
        self.task = ""
        self.shm_threshold = -1
        self._link: _AioSession | None = None
        self._channel: grpc.aio.Channel | None = None
        self._session: Any = None
        self._lock: asyncio.Lock | None = None
        self._counts: collections.Counter[str] = collections.Counter()
        self._closed = False
        self._connected = False

    @property
    def session(self) -> bool:
        """Whether this client talks over the session socket (shared memory)."""
        return self._link is not None

    async def connect(self) -> "Client":
        """Connect (Unavailable if no daemon answers in time). Idempotent."""
        if self._closed:
            raise Unavailable("client is closed")
        if self._connected:
            return self
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._connected:
                return self
            path = session_socket(self.address) if self._shm_ok is not False else None
            if path is not None:
                await self._connect_session(path)
            else:
                await self._connect_grpc()
            self._connected = True
        return self

    async def _connect_session(self, path: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.sock_connect(sock, path), self._connect_timeout)
        except (OSError, TimeoutError) as exc:
            sock.close()
            raise Unavailable(f"cannot connect to the daemon's session socket {path}: {exc}") from None
        link = _AioSession(sock)
        try:
            hello = lpb.AttachRequest(client_id=self.client_id, pid=os.getpid()).SerializeToString()
            info = lpb.AttachResponse.FromString(bytes(await link.call(Kind.HELLO, hello, self._connect_timeout)))
        except BaseException:
            link.close()
            raise
        self.task = info.task
        self.shm_threshold = info.shm_threshold
        self._link = link

    async def _connect_grpc(self) -> None:
        channel = grpc.aio.insecure_channel(self._target, options=local_channel_options())
        try:
            await asyncio.wait_for(channel.channel_ready(), self._connect_timeout)
            session = channel.unary_stream(SERVICE + "Attach")(
                lpb.AttachRequest(client_id=self.client_id, pid=os.getpid()).SerializeToString(),
                metadata=self._metadata)
            first = await session.read()
        except TimeoutError:
            await channel.close()
            raise Unavailable(f"no rendezvousd answers at {self.address} within "
                              f"{self._connect_timeout:g}s") from None
        except grpc.RpcError as exc:
            await channel.close()
            raise error_from(exc) from None
        if first is grpc.aio.EOF:
            await channel.close()
            raise Unavailable(f"rendezvousd at {self.address} ended the session at once")
        self.task = lpb.AttachResponse.FromString(first).task
        self._channel = channel
        self._session = session

    async def _call(self, name: str, body: bytes, timeout: float | None = None) -> bytes:
        assert self._channel is not None
        try:
            return await self._channel.unary_unary(SERVICE + name)(body, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from(exc) from None

    async def send(self, key: Key | str, tensor: Any, step_id: int = 0, is_dead: bool = False) -> None:
        """Produce ``tensor`` under ``key``; returns once the daemon holds it."""
        await self.connect()
        head = send_head(key, step_id)
        link = self._link
        if link is None:
            body, _ = inline_send(head, tensor, is_dead)
            await self._call("Send", body)
            self._counts["send_inline"] += 1
            return
        if not is_dead:
            arr = as_array(tensor)
            if 0 <= self.shm_threshold <= arr.nbytes and arr.nbytes and is_memcpyable(arr):
                seg_id = link.segments.take(arr.nbytes)
                if seg_id is None:
                    try:
                        await link.call(Kind.LEND, struct.pack("<Q", arr.nbytes))
                    except ResourceExhausted:
                        pass  # the pool is full: inline
                    seg_id = link.segments.take(arr.nbytes)
                if seg_id is not None:
                    if arr.nbytes >= _OFF_LOOP_BYTES:
                        await asyncio.get_running_loop().run_in_executor(None, link.segments.write, seg_id, arr)
                    else:
                        link.segments.write(seg_id, arr)
                    await link.call(Kind.SEND, pooled_send(head, arr, seg_id))
                    self._counts["send_shm"] += 1
                    return
            tensor = arr
        body, _ = inline_send(head, tensor, is_dead)
        await link.call(Kind.SEND, body)
        self._counts["send_inline"] += 1

    async def recv_item(self, key: Key | str, step_id: int = 0, timeout: float | None = None) -> Received:
        await self.connect()
        body = recv_request(key, step_id, timeout)
        guard = None if timeout is None else timeout + 10.0
        if self._link is None:
            item, path, hop = parse_reply(await self._call("Recv", body, guard))
        else:
            raw = await self._link.call(Kind.RECV, body, guard, as_key(key).format(), step_id)
            item, path, hop = parse_reply(raw, self._link.segments)
        self._counts[f"recv_{hop}"] += 1
        self._counts[path] += 1
        return item

    async def recv(self, key: Key | str, step_id: int = 0, timeout: float | None = None) -> np.ndarray | None:
        """The tensor sent under ``key`` in ``step_id`` (None if dead)."""
        return (await self.recv_item(key, step_id, timeout)).value

    async def abort(self, step_id: int, message: str = "aborted") -> None:
        await self.connect()
        body = lpb.AbortRequest(step_id=step_id, message=message).SerializeToString()
        if self._link is None:
            await self._call("Abort", body)
        else:
            await self._link.call(Kind.ABORT, body)

    async def pending(self) -> PendingList:
        """See :meth:`rendezvous.client.Client.pending`."""
        await self.connect()
        if self._link is None:
            return to_pending(await self._call("Pending", b""))
        return to_pending(await self._link.call(Kind.PENDING, b""))

    def stats(self) -> dict[str, int]:
        return dict(self._counts)

    async def close(self) -> None:
        """End the session and close the connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._link is not None:
            self._link.close()
        if self._session is not None:
            self._session.cancel()
        if self._channel is not None:
            await self._channel.close()

    async def __aenter__(self) -> "Client":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
