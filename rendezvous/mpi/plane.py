"""The optimal path: descriptor over gRPC, bytes over MPI.

:class:`MpiPlane` is a :class:`rendezvous.transport.DataPlane`.

Producer (:meth:`MpiPlane.plan`, asked by the server's planes for every reply):
a tensor goes over MPI when the optimal path is on, its dtype is memcpy-able,
it is at least the threshold, and the consumer is in the same MPI job (its
request carries an :class:`MpiEndpoint` with our ``world_id``). Then a tag
unique among the pair's transfers in flight is taken and the reply is a
descriptor; the non-blocking send of the tensor's own buffer (no copy) is
posted when the stream hands the descriptor over (``Reply.carry``), so a
reply dropped unsent (cancelled, or its stream gone) leaves no send behind
that no receive will ever match. Anything else returns None: the reply goes
inline over gRPC.

Consumer (:meth:`MpiPlane.receive`): allocate the destination from the
descriptor's dtype and shape, post the receive for (source rank, tag), await
it. Payload copies: zero on both sides beyond MPI's own.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError

from rendezvous.codec import groups
from rendezvous.codec.parsing import ReplyHead
from rendezvous.codec.replies import descriptor_response, with_call_id
from rendezvous.buffers import RecvBuffers
from rendezvous.config import Config
from rendezvous.devices import Devices, DeviceTensor, Placement
from rendezvous.errors import Internal, InvalidArgument, NotPlaced
from rendezvous.stats import Stats
from rendezvous.items import Received
from rendezvous.codec.dtypes import is_memcpyable
from rendezvous.codec.tensors import TensorMeta, decode_meta
from rendezvous.transport import Arrival, Carry, DataPlane, Path, Reply
from rendezvous.v1 import rendezvous_pb2 as pb

from .aborts import SendAborted
from .engine import ProgressEngine
from .staging import DirectRecv, DirectSend, StagedRecv, StagedSend
from .world import MpiWorld

__all__ = ["MpiPlane"]

log = logging.getLogger("rendezvous.mpi")
#: A completed send this big went by MPI's rendezvous protocol (every MPI's
#: eager limit is far below it): the consumer has matched it and holds the bytes,
#: so no retry of its request can come. A smaller send may complete while its
#: bytes wait in the consumer's MPI buffers: its answer stays for retries.
DELIVERED_BYTES = 1 << 20
_ENDPOINT_URL = "type.googleapis.com/rendezvous.v1.MpiEndpoint"
_TRANSFER_URL = "type.googleapis.com/rendezvous.v1.MpiTransfer"
_FIRST_TAG = 1


def _string_bytes(arr: np.ndarray) -> int:
    return sum(len(v) for v in arr.flat if isinstance(v, (bytes, bytearray)))


def _no_unary() -> bytes:
    raise Internal("an MPI descriptor reply is sent on a stream, which starts its transfer; never unary")


def _pack(message: Any) -> bytes:
    wrapped = any_pb2.Any()
    wrapped.Pack(message)
    return wrapped.SerializeToString()


class _Tags:
    """Tags per destination rank: cycled, never one still in flight to that rank."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.next: dict[int, int] = defaultdict(lambda: _FIRST_TAG)
        self.busy: dict[int, set[int]] = defaultdict(set)

    def take(self, rank: int) -> int:
        busy = self.busy[rank]
        if len(busy) >= self.limit - _FIRST_TAG + 1:  # tags _FIRST_TAG..limit, all usable
            raise Internal(f"all {self.limit} MPI tags to rank {rank} are in flight")
        tag = self.next[rank]
        while tag in busy:
            tag = tag + 1 if tag < self.limit else _FIRST_TAG
        self.next[rank] = tag + 1 if tag < self.limit else _FIRST_TAG
        busy.add(tag)
        return tag

    def give_back(self, rank: int, tag: int) -> None:
        self.busy[rank].discard(tag)


class MpiPlane(DataPlane):
    path = Path.MPI
    descriptor_url = _TRANSFER_URL

    def __init__(self, world: MpiWorld, engine: ProgressEngine, config: Config, stats: Stats, *,
                 buffers: RecvBuffers, devices: Devices) -> None:
        self.world = world
        self.engine = engine
        self.config = config
        self.stats = stats
        self.buffers = buffers
        self.devices = devices
        #: called with a request's id once its direct send of at least DELIVERED_BYTES
        #: completed: the consumer's buffer holds the bytes (the server lets the retry
        #: cache drop the answer, so a daemon's pool segment is free again at once)
        self.delivered: Callable[[int], None] | None = None
        #: called with a request and the tensor it took when that tensor's send
        #: from a GPU gave up partway (SendAborted: its consumer cannot hold the
        #: whole tensor): the server puts the tensor back for a later recv
        self.aborted: Callable[[Any, Received], None] | None = None
        tag_ub = world.comm.Get_attr(world.MPI.TAG_UB) or 32767
        self._tags = _Tags(min(int(tag_ub), 1 << 30))
        if config.cuda_aware is None:
            self.cuda_aware, self.cuda_aware_source = world.probe_cuda_aware()
        else:
            self.cuda_aware, self.cuda_aware_source = config.cuda_aware, "RENDEZVOUS_CUDA_AWARE"
        #: what every request of ours carries (RecvTensorRequest.transport_options)
        # Asked over MPI, a tensor below one reply frame comes back inside it: one
        # message (header and bytes) instead of a descriptor and a transfer.
        inline = config.chunk_bytes if config.mpi_requests else 0
        self.endpoint = _pack(pb.MpiEndpoint(world_id=world.world_id, rank=world.rank, inline_below=inline))
        self._staged_endpoint = _pack(pb.MpiEndpoint(world_id=world.world_id, rank=world.rank,
                                                     max_chunk_bytes=config.gpu_staging_chunk_bytes,
                                                     inline_below=inline))

    # -- producer -----------------------------------------------------------

    def plan(self, req: pb.RecvTensorRequest, item: Received) -> Reply | None:
        """A descriptor reply whose MPI send starts as the stream hands it over
        (its ``carry``), or None: inline."""
        arr = item.value
        on_device = isinstance(arr, DeviceTensor)
        if not self.config.mpi_optimal_path or not (on_device or isinstance(arr, np.ndarray)):
            return None
        if not is_memcpyable(arr.dtype):
            # strings and the like cannot go buffer to buffer; a fallback when
            # they are big enough that MPI would otherwise have carried them
            if arr.dtype == object and _string_bytes(arr) >= self.config.mpi_threshold:
                self.stats.fallback(Path.GRPC)
            return None
        if arr.nbytes < self.config.mpi_threshold:
            return None  # small: inline by design, not a fallback
        endpoint = self._endpoint(req)
        if endpoint is None:
            return None
        if not on_device and arr.nbytes < endpoint.inline_below:
            return None  # the consumer wants it inside the reply (asked over MPI): by design
        chunk = self._chunk(endpoint)
        rank = endpoint.rank
        if not on_device:
            buf = np.ascontiguousarray(arr)  # no copy for a C-contiguous array
            post = lambda t: self.engine.isend(buf, rank, t, chunk)  # noqa: E731
        elif self.cuda_aware:
            post = lambda t: self.engine.pipeline(  # noqa: E731
                lambda comm, MPI: DirectSend(comm, MPI, arr, rank, t, chunk))
        else:
            chunk = min(chunk, self.config.gpu_staging_chunk_bytes)
            pool = self.devices.pool(arr.backend, chunk, self.config.gpu_staging_depth)
            post = lambda t: self.engine.pipeline(  # noqa: E731
                lambda comm, MPI: StagedSend(comm, MPI, arr, rank, t, chunk, pool))
        nbytes = arr.nbytes
        stats = self.stats

        def counted(tag: int) -> asyncio.Future:
            done = post(tag)
            done.add_done_callback(lambda f: self._gave_up(f, req, item))
            if on_device:
                stats.gpu("direct_sends" if self.cuda_aware else "staged_sends")
                if not self.cuda_aware:
                    stats.gpu("staged_bytes", nbytes)
            return done

        carry = self._plan_send(rank, counted if on_device else post, nbytes, chunk,
                                req.request_id if nbytes >= DELIVERED_BYTES else 0)
        response = descriptor_response(TensorMeta(arr.dtype, arr.shape), carry.options)
        # the send starts as the stream hands the descriptor over (Carry)
        return Reply(Path.MPI, lambda call_id: iter((with_call_id(call_id, response),)),
                     _no_unary, item, carry=carry)

    def _endpoint(self, req: Any) -> pb.MpiEndpoint | None:
        """The consumer's MPI endpoint from its request, or None (counted as a
        fallback) when it has none in this MPI job."""
        opts = req.transport_options
        if opts.type_url != _ENDPOINT_URL:
            self.stats.fallback(Path.GRPC)  # the consumer has no MPI
            return None
        endpoint = pb.MpiEndpoint()
        try:
            unpacked = opts.Unpack(endpoint)
        except DecodeError:
            raise InvalidArgument("request carries a malformed MpiEndpoint") from None
        if not unpacked or endpoint.world_id != self.world.world_id:
            self.stats.fallback(Path.GRPC)  # the consumer is in another MPI job
            return None
        if not 0 <= endpoint.rank < self.world.size:
            raise InvalidArgument(f"MPI rank {endpoint.rank} is outside this world of {self.world.size}")
        return endpoint

    def plan_group(self, req: Any, arrays: Any, layout: Any) -> Carry | None:
        """The fusion buffer: a group's tensors copied into one buffer and sent
        as one MPI message (when the group frame is handed over), when the
        optimal path is on, the group is at least the threshold and the
        consumer is in this MPI job and does not want it inside the reply
        (asked over MPI)."""
        nbytes = layout.nbytes
        if not self.config.mpi_optimal_path or nbytes < self.config.mpi_threshold:
            return None
        endpoint = self._endpoint(req)
        if endpoint is None or nbytes < endpoint.inline_below:
            return None
        buf = np.empty(nbytes, np.uint8)
        groups.fill(buf, layout)
        chunk = self._chunk(endpoint)
        rank = endpoint.rank
        return self._plan_send(rank, lambda t: self.engine.isend(buf, rank, t, chunk), nbytes, chunk)

    def _chunk(self, endpoint: pb.MpiEndpoint) -> int:
        """Bytes per MPI message to this consumer (it may ask for smaller ones)."""
        chunk = self.config.mpi_chunk_bytes
        return min(chunk, endpoint.max_chunk_bytes) if endpoint.max_chunk_bytes > 0 else chunk

    def _plan_send(self, rank: int, post: Callable[[int], asyncio.Future], nbytes: int, chunk: int,
                   request_id: int = 0) -> Carry:
        """Take a tag to ``rank`` for a send that ``post(tag)`` posts once the
        descriptor leaves (``Carry.start``); the tag is given back when the
        send completes (see _sent), or at once if the send is never started
        (``Carry.release``)."""
        tag = self._tags.take(rank)
        settled = False

        def start() -> None:
            nonlocal settled
            if settled:
                raise Internal(f"MPI send on tag {tag} to rank {rank} started twice")
            settled = True
            try:
                done = post(tag)
            except BaseException:
                self._tags.give_back(rank, tag)
                raise
            done.add_done_callback(lambda f: self._sent(f, rank, tag, request_id))

        def release() -> None:
            nonlocal settled
            if not settled:
                settled = True
                self._tags.give_back(rank, tag)

        return Carry(self._transfer_any(tag, nbytes, chunk), start, release)

    def _transfer_any(self, tag: int, nbytes: int, chunk: int) -> bytes:
        """The ``Any`` a descriptor carries: an MpiTransfer of ours on ``tag``."""
        return _pack(pb.MpiTransfer(world_id=self.world.world_id, source_rank=self.world.rank,
                                    tag=tag, nbytes=nbytes, chunk_bytes=chunk))

    def _gave_up(self, future: asyncio.Future, req: Any, item: Received) -> None:
        if not future.cancelled() and isinstance(future.exception(), SendAborted) and self.aborted is not None:
            self.aborted(req, item)

    def _sent(self, future: asyncio.Future, rank: int, tag: int, request_id: int = 0) -> None:
        self._tags.give_back(rank, tag)
        if not future.cancelled() and future.exception() is not None:
            self.stats.error(Path.MPI)
            log.warning("MPI send to rank %d (tag %d) failed: %s", rank, tag, future.exception())
        elif request_id and not future.cancelled() and self.delivered is not None:
            self.delivered(request_id)

    # -- consumer -----------------------------------------------------------

    def offer(self, placement: Placement | None) -> bytes:
        """What a request for a tensor bound for ``placement`` carries: our MPI
        endpoint, asking for staging-sized messages when the bytes will be staged
        onto a GPU."""
        staged = placement is not None and placement.is_gpu and not self.cuda_aware
        return self._staged_endpoint if staged else self.endpoint

    def receive(self, buf: bytes, head: ReplyHead, placement: Placement | None = None) -> Arrival:
        """Post the receive a descriptor reply announces (the descriptor is checked
        first); the arrival's ``pending`` gives the tensor on ``placement``."""
        transfer, meta = self._parse(buf, head)
        if placement is None or not placement.is_gpu:
            # Posted here, in the reply's own turn (a task would post it a turn
            # later): a large message's single copy starts as soon as it can.
            dest = self.buffers.empty(meta.shape, meta.dtype)  # a large one is reused once dropped
            done = self.engine.irecv(dest, transfer.source_rank, transfer.tag, transfer.chunk_bytes)
            return Arrival(Path.MPI, pending=_landing(done, dest), placed=True)
        return Arrival(Path.MPI, pending=self._receive(transfer, meta, placement), placed=True)

    async def _receive(self, transfer: pb.MpiTransfer, meta: TensorMeta, placement: Placement | None) -> Any:
        """Move the bytes of ``transfer``; the tensor once they are here, on
        ``placement`` (a resolved placement: a GPU one has a usable backend;
        host receives are posted by :meth:`receive` itself).

        If this await is cancelled (deadline, abort) the receive stays posted and
        completes into its destination: its bytes are already on the way."""
        backend = self.devices.gpu_backend() if placement is not None and placement.is_gpu else None
        if backend is None:
            dest = self.buffers.empty(meta.shape, meta.dtype)  # a large one is reused once dropped
            await self.engine.irecv(dest, transfer.source_rank, transfer.tag, transfer.chunk_bytes)
            return dest
        device = placement.index  # type: ignore[union-attr]
        try:
            dst, allocated = backend.allocate(meta, device)  # copies and MPI wait for ``allocated``
        except Exception as exc:  # out of device memory, most likely: the bytes still come
            host = np.empty(meta.shape, dtype=meta.dtype)
            await self.engine.irecv(host, transfer.source_rank, transfer.tag, transfer.chunk_bytes)
            raise NotPlaced(f"cannot allocate {meta.nbytes} bytes on GPU:{device} ({exc}); "
                            "the tensor is kept on the host for the next recv of this key", host) from None
        nbytes, src, tag, chunk = meta.nbytes, transfer.source_rank, transfer.tag, transfer.chunk_bytes
        if self.cuda_aware:
            await self.engine.pipeline(
                lambda comm, MPI: DirectRecv(comm, MPI, backend, dst, nbytes, src, tag, chunk, allocated))
            self.stats.gpu("direct_recvs")
        elif chunk <= self.config.gpu_staging_chunk_bytes:
            pool = self.devices.pool(backend, chunk, self.config.gpu_staging_depth)
            await self.engine.pipeline(
                lambda comm, MPI: StagedRecv(comm, MPI, backend, dst, device, nbytes, src, tag, chunk, pool,
                                             allocated))
            self.stats.gpu("staged_recvs")
            self.stats.gpu("staged_bytes", nbytes)
        else:
            # A producer that ignored our chunk size: land on the host, then copy over.
            host = np.empty(meta.shape, dtype=meta.dtype)
            await self.engine.irecv(host, src, tag, chunk)
            pool = self.devices.pool(backend, self.config.gpu_staging_chunk_bytes, self.config.gpu_staging_depth)
            dst = await asyncio.get_running_loop().run_in_executor(None, backend.from_host, host, device, pool)
            self.stats.gpu("to_device")
        return backend.user_array(dst)

    def drain(self, buf: bytes, head: ReplyHead) -> None:
        """A descriptor for a recv nobody waits for any more: receive and drop its
        bytes, so they can never match a later transfer on the same tag."""
        try:
            transfer, meta = self._parse(buf, head)
        except Exception:
            return
        fut = self.engine.irecv(np.empty(meta.nbytes, np.uint8), transfer.source_rank, transfer.tag,
                                transfer.chunk_bytes)
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    def receive_group(self, buf: bytes, group: groups.Group) -> asyncio.Future:
        """Post the receive of a group's fusion buffer (checked against the group
        first); the future gives the buffer. It lands even if nobody waits."""
        assert group.transport_options is not None
        transfer = self._transfer(buf, group.transport_options)
        if transfer.nbytes != group.nbytes:
            raise Internal(f"group's MPI transfer announces {transfer.nbytes} bytes; its offsets say {group.nbytes}")
        dest = self.buffers.empty(group.nbytes, np.uint8)  # a large one is reused once its views are dropped
        done = self.engine.irecv(dest, transfer.source_rank, transfer.tag, transfer.chunk_bytes)
        return _landing(done, dest)

    def _transfer(self, buf: bytes, span: tuple[int, int]) -> pb.MpiTransfer:
        """The MpiTransfer in the ``Any`` at ``span``, checked: ours, from this job, chunked."""
        a, b = span
        opts = any_pb2.Any.FromString(bytes(buf[a:b]))
        transfer = pb.MpiTransfer()
        if opts.type_url != _TRANSFER_URL or not opts.Unpack(transfer):
            raise Internal(f"reply names an unknown transport {opts.type_url!r}")
        if transfer.world_id != self.world.world_id:
            raise Internal("MPI descriptor from another MPI job")
        if transfer.chunk_bytes <= 0:
            raise Internal("descriptor without a chunk size")
        return transfer

    def _parse(self, buf: bytes, head: ReplyHead) -> tuple[pb.MpiTransfer, TensorMeta]:
        if head.tensor is None or head.transport_options is None:
            raise Internal("MPI descriptor without dtype and shape")
        transfer = self._transfer(buf, head.transport_options)
        meta, _, _ = decode_meta(buf, *head.tensor)
        if meta.nbytes != transfer.nbytes:
            raise Internal(f"descriptor announces {transfer.nbytes} bytes for {meta.dtype}{list(meta.shape)}"
                           f" ({meta.nbytes} bytes)")
        return transfer, meta


def _landing(done: asyncio.Future, dest: Any) -> asyncio.Future:
    """A future of ``dest`` once the receive ``done`` into it completes. Cancelling
    it leaves the receive posted: its bytes are on their way and land in ``dest``
    (never in a later transfer's buffer)."""
    out = asyncio.get_running_loop().create_future()

    def landed(f: asyncio.Future) -> None:
        if out.cancelled():
            return
        if f.cancelled():
            out.cancel()
        elif f.exception() is not None:
            out.set_exception(f.exception())  # type: ignore[arg-type]
        else:
            out.set_result(dest)
    done.add_done_callback(landed)
    return out
