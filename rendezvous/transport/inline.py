"""The inline plane: a tensor's bytes inside the gRPC reply itself.

The default path, and the fallback of every other plane: it carries any
tensor (strings too) to any consumer. Replies are written by hand
(:mod:`rendezvous.codec.replies`): a header, then the tensor's own bytes, chunked
into ``chunk_bytes`` frames on the stream. A GPU tensor is first copied to
the host off the loop (device -> pinned chunks -> numpy).

Consumer side: a one-frame reply is a numpy view on the received message (no
copy); a chunked one is assembled into a buffer from the server's receive
cache (one copy). Copies per tensor: producer 1 (joining header and bytes)
plus gRPC's own, consumer 0 or 1.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, NoReturn

from rendezvous.codec.assembly import Assembly
from rendezvous.codec.parsing import ReplyHead, decode_inline
from rendezvous.codec.replies import stream_frames, unary_response
from rendezvous.buffers import RecvBuffers
from rendezvous.devices import Devices, DeviceTensor
from rendezvous.errors import Internal
from rendezvous.stats import Stats
from rendezvous.items import Received

from . import Arrival, DataPlane, Path, Reply

__all__ = ["InlinePlane"]


def _now_micros() -> int:
    return time.time_ns() // 1000


def _unprepared(*_: Any) -> NoReturn:
    raise AssertionError("a reply with `prepare` must be prepared before it is written")


class InlinePlane(DataPlane):
    path = Path.GRPC

    def __init__(self, *, chunk_bytes: int, buffers: RecvBuffers, devices: Devices,
                 staging: tuple[int, int], stats: Stats) -> None:
        self.chunk_bytes = chunk_bytes
        self.buffers = buffers
        self.devices = devices
        self.staging = staging  # (chunk bytes, depth) of the pinned host copy of GPU tensors
        self.stats = stats

    # -- producer -----------------------------------------------------------

    def plan(self, request: Any, item: Received) -> Reply:
        if isinstance(item.value, DeviceTensor):
            return Reply(Path.GRPC, _unprepared, _unprepared, item, prepare=lambda: self._host_reply(item))
        return self.reply(item)

    def reply(self, item: Received, original: Received | None = None) -> Reply:
        """The inline reply for ``item`` (host data); ``original`` is what goes
        back to the table if it is never started (default: ``item``)."""
        now = _now_micros()
        chunk = self.chunk_bytes
        return Reply(Path.GRPC,
                     lambda call_id: stream_frames(call_id, item, chunk, now),
                     lambda: unary_response(item, now),
                     original if original is not None else item)

    async def _host_reply(self, item: Received) -> Reply:
        value = item.value
        pool = self.devices.pool(value.backend, *self.staging)
        host = await asyncio.get_running_loop().run_in_executor(None, value.backend.to_host, value, pool)
        self.stats.gpu("to_host")
        copied = Received(host, item.is_dead)
        reply = self.reply(copied, original=item)
        reply.host = copied
        return reply

    # -- consumer -----------------------------------------------------------

    def receive(self, reply: bytes, head: ReplyHead, placement: Any) -> Arrival:
        """A host array (placement is the caller's business), whole or to assemble."""
        if head.tensor is None:
            raise Internal("reply carries neither a tensor nor a descriptor")
        value = decode_inline(reply, head.tensor, head.decoded, self.buffers)
        if isinstance(value, Assembly):
            return Arrival(Path.GRPC, assembly=value)
        return Arrival(Path.GRPC, value=value)
