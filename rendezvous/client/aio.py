"""The local client for asyncio code: ``rendezvous.client.aio.Client``.

The same calls as :class:`rendezvous.client.Client`, as coroutines, on one
event loop (the one that first uses it)::

    async with Client("unix:/run/rendezvous/rendezvousd.sock") as c:
        await c.send(key, tensor, step_id=3)
        value = await c.recv(other_key, step_id=3, timeout=30)

Over the session socket any number of calls may be in flight at once; each
loop turn's frames go out in one write. A cancelled ``recv`` cancels the
daemon's wait; a tensor already on its way is given back to the daemon for
the next recv of its key: nothing is consumed. Its decisions are the
blocking client's (:mod:`rendezvous.client.core`); only the waiting differs.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from rendezvous.errors import Unavailable
from rendezvous.keys import Key
from rendezvous.local import messages
from rendezvous.local.address import channel_target, default_address, session_socket
from rendezvous.local.connection import Connection
from rendezvous.local.frames import Kind, frame
from rendezvous.local.messages import PendingList
from rendezvous.rpc.options import local_channel_options
from rendezvous.items import Received
from rendezvous.v1 import local_pb2 as lpb

from .blocking import token_metadata
from rendezvous.devices import Devices

from .core import (GRPC_METHODS, RECVS, ClientCore, Copy, LocalOp, check_socket,
                   connect_within, drive_async)
from .link import InFlight, Router
from .segments import Segments

__all__ = ["Client"]

# Shared-memory copies this big run on a worker thread (numpy releases the GIL).
_OFF_LOOP_BYTES = 4 << 20


class _AioLink(Router):
    """An asyncio client's connection to the session socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.loop = asyncio.get_running_loop()
        self.segments = Segments(self._release_soon)
        self._ops: dict[int, InFlight] = {}
        self._cancelled: dict[int, LocalOp] = {}
        self._ids = itertools.count(1)
        self._error: BaseException | None = None
        self._release_pending = False
        self.conn = Connection(sock, limit=1 << 62, on_frames=self._frames, on_close=self._closed, fds=True)

    def _write(self, data: bytes) -> None:
        self.conn.write(data)

    def _frames(self, frames: list[tuple[int, int, memoryview]], fds: list[int]) -> None:
        self.segments.got_fds(fds)
        for kind, op_id, body in frames:
            entry = self._route(kind, op_id, body)
            if entry is not None:
                entry.answered(kind, body)
                if entry.waiter is not None and not entry.waiter.done():
                    entry.waiter.set_result(None)

    def _closed(self, error: BaseException | None) -> None:
        self._error = Unavailable(f"the daemon's session socket broke: {error}" if error is not None else
                                  "the daemon closed the session (it stopped or restarted)")
        for entry in self._ops.values():
            if entry.waiter is not None and not entry.waiter.done():
                entry.waiter.set_exception(self._error)
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

    async def call(self, op: LocalOp) -> memoryview:
        if self._error is not None:
            raise self._error
        entry = InFlight(op, self.loop.create_future())
        op_id = next(self._ids)
        self._ops[op_id] = entry
        released = self.segments.drain_released()
        self.conn.write(released + frame(op.kind, op_id, op.body) if released else frame(op.kind, op_id, op.body))
        try:
            await asyncio.wait_for(entry.waiter, op.timeout)
        except BaseException:
            if op.kind in RECVS:
                self._give_up(op_id, entry)  # the tensors, now or when they come, are given back
            else:
                self._ops.pop(op_id, None)
            raise
        if entry.kind == Kind.ERROR:
            raise messages.frame_error(entry.body)
        return entry.body

    def close(self) -> None:
        self.conn.close(None)
        self.segments.close()


class Client:
    """An asyncio client of the node's rendezvousd. Connects on first use or in ``async with``.

    A ``unix:`` address whose socket does not exist fails at once (Unavailable
    naming the path); a daemon that exists but does not answer is waited for
    up to ``connect_timeout`` seconds (default 30), or a recv's own
    ``timeout`` when that is smaller, then Unavailable. ``shm_ok``, ``token``
    and ``devices`` as for :class:`rendezvous.client.Client`."""

    def __init__(self, address: str | None = None, *, token: str | None = None, shm_ok: bool | None = None,
                 connect_timeout: float = 30.0, devices: Devices | None = None) -> None:
        self.address = address or default_address()
        self._target, _ = channel_target(self.address)
        self._metadata = token_metadata(self.address, token)
        self._shm_ok = shm_ok
        self._connect_timeout = connect_timeout
        self.client_id = secrets.token_hex(6)
        self._core = ClientCore(devices)
        self._link: _AioLink | None = None
        self._channel: grpc.aio.Channel | None = None
        self._session: grpc.aio.UnaryStreamCall[bytes, bytes] | None = None
        self._lock: asyncio.Lock | None = None
        self._closed = False
        self._connected = False

    @property
    def task(self) -> str:
        """The daemon's task (once connected)."""
        return self._core.task

    @property
    def shm_threshold(self) -> int:
        """Smallest tensor that crosses the local hop through shared memory (-1: never)."""
        return self._core.shm_threshold

    @property
    def session(self) -> bool:
        """Whether this client talks over the session socket (shared memory)."""
        return self._link is not None

    async def connect(self, timeout: float | None = None) -> "Client":
        """Connect (Unavailable if no daemon answers within ``connect_timeout``, or
        ``timeout`` if smaller). Idempotent."""
        if self._closed:
            raise Unavailable("client is closed")
        if self._connected:
            return self
        check_socket(self.address)
        within = connect_within(self._connect_timeout, timeout)
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._connected:
                return self
            path = session_socket(self.address) if self._shm_ok is not False else None
            if path is not None:
                await self._connect_session(path, within)
            else:
                self._core.attached(await self._connect_grpc(within), None)
            self._connected = True
        return self

    async def _connect_session(self, path: str, within: float) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.sock_connect(sock, path), within)
        except (OSError, TimeoutError) as exc:
            sock.close()
            raise Unavailable(f"cannot connect to the daemon's session socket {path}: {exc}") from None
        link = _AioLink(sock)
        try:
            hello = lpb.AttachRequest(client_id=self.client_id, pid=os.getpid()).SerializeToString()
            info = lpb.AttachResponse.FromString(bytes(await link.call(LocalOp(Kind.HELLO, hello, within))))
        except TimeoutError:
            link.close()
            raise Unavailable(f"no rendezvousd answers on {path} within {within:g}s") from None
        except BaseException:
            link.close()
            raise
        self._core.attached(info, link.segments)
        self._link = link

    async def _connect_grpc(self, within: float) -> lpb.AttachResponse:
        channel = grpc.aio.insecure_channel(self._target, options=local_channel_options())
        try:
            await asyncio.wait_for(channel.channel_ready(), within)
            attach: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(messages.METHOD + "Attach")
            session = attach(
                lpb.AttachRequest(client_id=self.client_id, pid=os.getpid()).SerializeToString(),
                metadata=self._metadata)
            first = await session.read()
        except TimeoutError:
            await channel.close()
            raise Unavailable(f"no rendezvousd answers at {self.address} within {within:g}s") from None
        except grpc.RpcError as exc:
            await channel.close()
            raise messages.error_from(exc) from None
        if not isinstance(first, bytes):  # grpc.aio.EOF
            await channel.close()
            raise Unavailable(f"rendezvousd at {self.address} ended the session at once")
        self._channel = channel
        self._session = session
        return lpb.AttachResponse.FromString(first)

    async def _do(self, op: LocalOp) -> bytes | memoryview:
        """Carry out ``op``: on the session socket, or as a gRPC call."""
        if self._link is not None:
            return await self._link.call(op)
        assert self._channel is not None
        try:
            call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = self._channel.unary_unary(
                messages.METHOD + GRPC_METHODS[op.kind])
            return await call(op.body, timeout=op.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise messages.error_from(exc) from None

    async def empty(self, shape: Any, dtype: Any = float) -> np.ndarray:
        """A new array to fill and send without a copy (see the blocking
        :meth:`rendezvous.client.Client.empty`)."""
        await self.connect()
        return await drive_async(self._core.empty_plan(shape, dtype), self._do, self._copy)

    async def zeros(self, shape: Any, dtype: Any = float) -> np.ndarray:
        """:meth:`empty`, filled with zeros."""
        arr = await self.empty(shape, dtype)
        arr.fill(0)
        return arr

    async def send(self, key: Key | str, tensor: Any, step_id: int = 0, is_dead: bool = False) -> None:
        """Produce ``tensor`` under ``key``; returns once the daemon holds it (an
        array from :meth:`empty` or a shared-memory recv is handed over, not
        copied: see :meth:`rendezvous.client.Client.empty`)."""
        await self.connect()
        await drive_async(self._core.send_plan(key, tensor, step_id, is_dead), self._do, self._copy)

    async def _copy(self, step: Any) -> Any:
        if not isinstance(step, Copy):  # a GPU copy: it waits on the device
            return await asyncio.get_running_loop().run_in_executor(None, self._core.run, step)
        assert self._link is not None
        if step.arr.nbytes >= _OFF_LOOP_BYTES:
            await asyncio.get_running_loop().run_in_executor(None, self._link.segments.write, step.seg_id, step.arr)
        else:
            self._link.segments.write(step.seg_id, step.arr)
        return None

    async def recv_item(self, key: Key | str, step_id: int = 0, timeout: float | None = None,
                        device: str | None = None) -> Received:
        """:meth:`recv` as ``Received(value, is_dead)``."""
        await self.connect(timeout)
        op, targets = self._core.recv_op(key, step_id, timeout, device)  # (connected: a session offers IPC)
        item = self._core.received(await self._do(op), targets is not None)
        if targets is None:
            return item
        return (await drive_async(self._core.placed_plan((op.key,), step_id, [item], targets), self._do,
                                  self._copy))[0]

    async def recv(self, key: Key | str, step_id: int = 0, timeout: float | None = None,
                   device: str | None = None) -> Any:
        """The tensor sent under ``key`` in ``step_id`` (None if dead), placed as
        :meth:`rendezvous.client.Client.recv` places it."""
        return (await self.recv_item(key, step_id, timeout, device)).value


    async def send_many(self, items: Iterable[tuple[Any, ...]] | Mapping[Key | str, Any], step_id: int = 0) -> None:
        """See :meth:`rendezvous.client.Client.send_many`."""
        checked = self._core.check_items(items)
        await self.connect()
        batch: list[LocalOp] = []  # SEND_MANY ops written together (in order), answered together
        for step in self._core.send_many_plan(checked, step_id):
            if isinstance(step, LocalOp):
                if self._link is None:  # gRPC calls may overtake each other: one at a time
                    await self._do(step)
                else:
                    batch.append(step)
                continue
            if batch:
                await asyncio.gather(*(self._do(op) for op in batch))
                batch = []
            await self.send(step[0], step[1], step_id, step[2])
        if batch:
            await asyncio.gather(*(self._do(op) for op in batch))

    async def recv_many(self, keys: Sequence[Key | str], step_id: int = 0,
                        timeout: float | None = None, device: str | None = None) -> list[Any]:
        """See :meth:`rendezvous.client.Client.recv_many`."""
        return [item.value for item in await self.recv_many_items(keys, step_id, timeout, device)]

    async def recv_many_items(self, keys: Sequence[Key | str], step_id: int = 0,
                              timeout: float | None = None, device: str | None = None) -> list[Received]:
        """:meth:`recv_many` as ``Received(value, is_dead)`` items."""
        if not keys:
            return []
        op = self._core.recv_many_op(keys, step_id, timeout)
        targets = self._core.gpu.targets(op.keys, device)
        await self.connect(timeout)
        self._core.check_many(op)  # (the first call attaches: now it is known whether a session carries it)
        items = self._core.received_many(await self._do(op), op)
        if targets is None:
            return items
        return await drive_async(self._core.placed_plan(op.keys, step_id, items, targets), self._do, self._copy)

    async def abort(self, step_id: int, message: str = "aborted") -> None:
        """Abort the step in the daemon: its waiters and later sends/recvs fail ABORTED."""
        await self.connect()
        await self._do(self._core.abort_op(step_id, message))

    async def pending(self) -> PendingList:
        """See :meth:`rendezvous.client.Client.pending`."""
        await self.connect()
        return messages.to_pending(await self._do(self._core.pending_op()))

    def stats(self) -> dict[str, int]:
        """See :meth:`rendezvous.client.Client.stats`."""
        return self._core.stats()

    async def close(self) -> None:
        """End the session and close the connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._core.close()
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

