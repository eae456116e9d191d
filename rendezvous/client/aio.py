"""The local client for asyncio code: ``rendezvous.client.aio.Client``.

The same calls as :class:`rendezvous.client.Client`, as coroutines, on one
event loop (the one that first uses it)::

    async with Client("unix:/run/rendezvous/rendezvousd.sock") as c:
        await c.send(key, tensor, step_id=3)
        value = await c.recv(other_key, step_id=3, timeout=30)

A cancelled ``recv`` cancels the daemon's wait; nothing is consumed.
"""

from __future__ import annotations

import asyncio
import collections
import os
import secrets
from typing import Any

import grpc
import numpy as np

from rendezvous import shm
from rendezvous.errors import Unavailable
from rendezvous.keys import Key
from rendezvous.rpc.options import local_channel_options
from rendezvous.table import Received
from rendezvous.v1 import local_pb2 as lpb

from .local import (
    SERVICE,
    LocalPending,
    Prepared,
    channel_target,
    default_address,
    error_from,
    parse_reply,
    prepare_send,
    recv_request,
    to_pending,
    token_metadata,
)

__all__ = ["Client"]

# Shared-memory copies this big run on a worker thread (numpy releases the GIL).
_OFF_LOOP_BYTES = 4 << 20


class Client:
    """An asyncio client of the node's rendezvousd. Connects on first use or in ``async with``."""

    def __init__(self, address: str | None = None, *, token: str | None = None, shm_ok: bool | None = None,
                 connect_timeout: float = 30.0) -> None:
        self.address = address or default_address()
        self._target, self._same_host = channel_target(self.address)
        self._metadata = token_metadata(self.address, token)
        self._shm_ok = shm_ok
        self._connect_timeout = connect_timeout
        self.client_id = secrets.token_hex(6)
        self.task = ""
        self.shm_threshold = -1
        self._prefix: str | None = None
        self._channel: grpc.aio.Channel | None = None
        self._session: Any = None
        self._lock: asyncio.Lock | None = None
        self._counts: collections.Counter[str] = collections.Counter()
        self._closed = False

    async def connect(self) -> "Client":
        """Connect and attach (Unavailable if no daemon answers in time). Idempotent."""
        if self._closed:
            raise Unavailable("client is closed")
        if self._session is not None:
            return self
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._session is not None:
                return self
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
            info = lpb.AttachResponse.FromString(first)
            self.task = info.task
            use = (self._same_host if self._shm_ok is None else self._shm_ok) and shm.available() \
                and info.shm_threshold >= 0
            self.shm_threshold = info.shm_threshold if use else -1
            self._prefix = info.shm_prefix if use else None
            self._channel = channel
            self._session = session
        return self

    async def _call(self, name: str, body: bytes, timeout: float | None = None) -> bytes:
        await self.connect()
        assert self._channel is not None
        try:
            return await self._channel.unary_unary(SERVICE + name)(body, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from(exc) from None

    async def send(self, key: Key | str, tensor: Any, step_id: int = 0, is_dead: bool = False) -> None:
        """Produce ``tensor`` under ``key``; returns once the daemon holds it."""
        await self.connect()
        nbytes = getattr(tensor, "nbytes", 0) if not is_dead else 0
        if self._prefix and nbytes >= _OFF_LOOP_BYTES:
            prepared: Prepared = await asyncio.get_running_loop().run_in_executor(
                None, prepare_send, key, tensor, step_id, is_dead, self._prefix, self.shm_threshold,
                self.client_id)
        else:
            prepared = prepare_send(key, tensor, step_id, is_dead, self._prefix, self.shm_threshold,
                                    self.client_id)
        try:
            await self._call("Send", prepared.body)
        except BaseException:
            if prepared.segment is not None:
                shm.discard(prepared.segment)
            raise
        self._counts[f"send_{prepared.path}"] += 1

    async def recv_item(self, key: Key | str, step_id: int = 0, timeout: float | None = None) -> Received:
        await self.connect()
        body = recv_request(key, step_id, timeout, self.client_id if self._prefix else "")
        raw = await self._call("Recv", body, None if timeout is None else timeout + 10.0)
        item, path, hop = parse_reply(raw)
        self._counts[f"recv_{hop}"] += 1
        self._counts[path] += 1
        return item

    async def recv(self, key: Key | str, step_id: int = 0, timeout: float | None = None) -> np.ndarray | None:
        """The tensor sent under ``key`` in ``step_id`` (None if dead)."""
        return (await self.recv_item(key, step_id, timeout)).value

    async def abort(self, step_id: int, message: str = "aborted") -> None:
        await self._call("Abort", lpb.AbortRequest(step_id=step_id, message=message).SerializeToString())

    async def pending(self) -> list[LocalPending]:
        return to_pending(await self._call("Pending", b""))

    def stats(self) -> dict[str, int]:
        return dict(self._counts)

    async def close(self) -> None:
        """End the session and close the channel. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._session is not None:
            self._session.cancel()
        if self._channel is not None:
            await self._channel.close()
        if self._prefix:
            shm.sweep(self._prefix)

    async def __aenter__(self) -> "Client":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
