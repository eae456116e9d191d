"""The optimal path: descriptor over gRPC, bytes over MPI.

Producer (:meth:`MpiPlane.plan`, called by the servicer for every reply):
a tensor goes over MPI when the optimal path is on, its dtype is memcpy-able,
it is at least the threshold, and the consumer is in the same MPI job (its
request carries an :class:`MpiEndpoint` with our ``world_id``). Then a tag
unique among the pair's transfers in flight is taken, a non-blocking send of
the tensor's own buffer is posted (no copy), and the reply is a descriptor.
Anything else returns None: the reply goes inline over gRPC.

Consumer (:meth:`MpiPlane.receive`): allocate the destination from the
descriptor's dtype and shape, post the receive for (source rank, tag), await
it. Payload copies: zero on both sides beyond MPI's own.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

import numpy as np
from google.protobuf import any_pb2

from rendezvous import frames
from rendezvous.config import Config
from rendezvous.errors import Internal, InvalidArgument
from rendezvous.stats import Stats
from rendezvous.table import Received
from rendezvous.tensors import TensorMeta, decode_meta, is_memcpyable
from rendezvous.v1 import rendezvous_pb2 as pb

from .engine import ProgressEngine
from .world import MpiWorld

__all__ = ["MpiPlane"]

log = logging.getLogger("rendezvous.mpi")
_ENDPOINT_URL = "type.googleapis.com/rendezvous.v1.MpiEndpoint"
_TRANSFER_URL = "type.googleapis.com/rendezvous.v1.MpiTransfer"
_FIRST_TAG = 1


def _string_bytes(arr: np.ndarray) -> int:
    return sum(len(v) for v in arr.flat if isinstance(v, (bytes, bytearray)))


class _Tags:
    """Tags per destination rank: cycled, never one still in flight to that rank."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.next: dict[int, int] = defaultdict(lambda: _FIRST_TAG)
        self.busy: dict[int, set[int]] = defaultdict(set)

    def take(self, rank: int) -> int:
        busy = self.busy[rank]
        if len(busy) >= self.limit - _FIRST_TAG:
            raise Internal(f"all {self.limit} MPI tags to rank {rank} are in flight")
        tag = self.next[rank]
        while tag in busy:
            tag = tag + 1 if tag < self.limit else _FIRST_TAG
        self.next[rank] = tag + 1 if tag < self.limit else _FIRST_TAG
        busy.add(tag)
        return tag

    def give_back(self, rank: int, tag: int) -> None:
        self.busy[rank].discard(tag)


class MpiPlane:
    def __init__(self, world: MpiWorld, engine: ProgressEngine, config: Config, stats: Stats) -> None:
        self.world = world
        self.engine = engine
        self.config = config
        self.stats = stats
        tag_ub = world.comm.Get_attr(world.MPI.TAG_UB) or 32767
        self._tags = _Tags(min(int(tag_ub), 1 << 30))
        endpoint = any_pb2.Any()
        endpoint.Pack(pb.MpiEndpoint(world_id=world.world_id, rank=world.rank))
        #: what every request of ours carries (RecvTensorRequest.transport_options)
        self.endpoint = endpoint.SerializeToString()

    # -- producer -----------------------------------------------------------

    def plan(self, req: pb.RecvTensorRequest, item: Received) -> bytes | None:
        """A descriptor reply with the MPI send posted, or None for inline."""
        arr = item.value
        if not self.config.mpi_optimal_path or not isinstance(arr, np.ndarray):
            return None
        if not is_memcpyable(arr):
            # strings and the like cannot go buffer to buffer; a fallback when
            # they are big enough that MPI would otherwise have carried them
            if arr.dtype == object and _string_bytes(arr) >= self.config.mpi_threshold:
                self.stats.fallback("grpc")
            return None
        if arr.nbytes < self.config.mpi_threshold:
            return None  # small: inline by design, not a fallback
        opts = req.transport_options
        if opts.type_url != _ENDPOINT_URL:
            self.stats.fallback("grpc")  # the consumer has no MPI
            return None
        endpoint = pb.MpiEndpoint()
        if not opts.Unpack(endpoint) or endpoint.world_id != self.world.world_id:
            self.stats.fallback("grpc")  # the consumer is in another MPI job
            return None
        if not 0 <= endpoint.rank < self.world.size:
            raise InvalidArgument(f"MPI rank {endpoint.rank} is outside this world of {self.world.size}")
        buf = np.ascontiguousarray(arr)  # no copy for a C-contiguous array
        rank = endpoint.rank
        tag = self._tags.take(rank)
        chunk = self.config.mpi_chunk_bytes
        try:
            done = self.engine.isend(buf, rank, tag, chunk)
        except BaseException:
            self._tags.give_back(rank, tag)
            raise
        done.add_done_callback(lambda f, r=rank, t=tag: self._sent(f, r, t))
        transfer = any_pb2.Any()
        transfer.Pack(pb.MpiTransfer(world_id=self.world.world_id, source_rank=self.world.rank,
                                     tag=tag, nbytes=buf.nbytes, chunk_bytes=chunk))
        return frames.descriptor_response(TensorMeta(buf.dtype, buf.shape), transfer.SerializeToString())

    def _sent(self, future: asyncio.Future, rank: int, tag: int) -> None:
        self._tags.give_back(rank, tag)
        if not future.cancelled() and future.exception() is not None:
            self.stats.error("mpi")
            log.warning("MPI send to rank %d (tag %d) failed: %s", rank, tag, future.exception())

    # -- consumer -----------------------------------------------------------

    async def receive(self, buf: bytes, head: frames.ReplyHead) -> np.ndarray:
        """Move the bytes a descriptor reply announces; the tensor once they are here."""
        transfer, meta = self._parse(buf, head)
        dest = np.empty(meta.shape, dtype=meta.dtype)
        # If this await is cancelled (deadline, abort) the receive stays posted and
        # completes into ``dest``: its bytes are already on the way.
        await self.engine.irecv(dest, transfer.source_rank, transfer.tag, transfer.chunk_bytes)
        return dest

    def drain(self, buf: bytes, head: frames.ReplyHead) -> None:
        """A descriptor for a recv nobody waits for any more: receive and drop its
        bytes, so they can never match a later transfer on the same tag."""
        try:
            transfer, meta = self._parse(buf, head)
        except Exception:
            return
        fut = self.engine.irecv(np.empty(meta.nbytes, np.uint8), transfer.source_rank, transfer.tag,
                                transfer.chunk_bytes)
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _parse(self, buf: bytes, head: frames.ReplyHead) -> tuple[pb.MpiTransfer, TensorMeta]:
        if head.tensor is None or head.transport_options is None:
            raise Internal("MPI descriptor without dtype and shape")
        a, b = head.transport_options
        opts = any_pb2.Any.FromString(bytes(buf[a:b]))
        transfer = pb.MpiTransfer()
        if opts.type_url != _TRANSFER_URL or not opts.Unpack(transfer):
            raise Internal(f"reply names an unknown transport {opts.type_url!r}")
        if transfer.world_id != self.world.world_id:
            raise Internal("MPI descriptor from another MPI job")
        meta, _, _ = decode_meta(buf, *head.tensor)
        if meta.nbytes != transfer.nbytes:
            raise Internal(f"descriptor announces {transfer.nbytes} bytes for {meta.dtype}{list(meta.shape)}"
                           f" ({meta.nbytes} bytes)")
        if transfer.chunk_bytes <= 0:
            raise Internal("descriptor without a chunk size")
        return transfer, meta
