"""GPU tensors between processes of one node by CUDA IPC: :class:`IpcPlane`.

A recv bound for a GPU offers an ``IpcEndpoint``: the node (the kernel's boot
id), the consumer's process and the UUIDs of the GPUs whose memory it can
open, with the next plane's offer inside it (``next``: MPI's endpoint), so a
tensor IPC does not carry still takes the path it took before. A producer
whose tensor sits on one of those GPUs, on that node, in another process,
exports it (:meth:`DeviceBackend.ipc_export`: the allocation's memory handle,
the tensor's offset, an IPC event recorded once the tensor is written) and
answers with an ``IpcTransfer`` descriptor; the consumer opens the handle
(once per allocation: opened handles are cached, as the CUDA caching
allocators expect), copies device to device on its own stream after the
producer's event, and releases the export once its copy is done.

Ordering and ownership:

* the consumer's copy waits for the producer's event, never for the host;
* the producer holds the tensor (its memory) from the descriptor's hand-over
  until the consumer's release (``StreamRequest.release``), sent only once
  the copy's event is done;
* a consumer that cannot open or copy releases with ``failed``: the tensor
  goes back to the producer's table for a later recv (nothing is lost), and
  its recv fails with UNAVAILABLE; one that cannot open a handle offers IPC
  no more (its later recvs take the staged or default path);
* a consumer process that ends releases what it holds: the producer watches
  each consumer process it exports to (a pidfd on its loop) and drops its
  exports once it exits, however it ends (never put back: the consumer may
  have delivered the tensor before its release left);
* a receive cancelled while its copy runs (its server stopping) holds the
  destination until the copy is done, then releases as failed; with no
  stream left to send that on, the export is held until the process exits.

Counted under ``Path.IPC`` and the GPU counters ``ipc_sends``, ``ipc_recvs``,
``ipc_opens`` and ``ipc_fallbacks`` (a GPU tensor offered IPC that it could
not carry: another node, a GPU the consumer cannot open, the same process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import Callable
from typing import Any, NamedTuple

from google.protobuf import any_pb2
from google.protobuf.message import DecodeError

from rendezvous.codec.parsing import ReplyHead
from rendezvous.codec.replies import descriptor_response, with_call_id
from rendezvous.codec.tensors import TensorMeta, decode_meta
from rendezvous.config import Config
from rendezvous.devices import DeviceBackend, DeviceTensor, Devices, Placement
from rendezvous.devices.ipc_handles import OpenedHandles, node_id
from rendezvous.errors import Internal, InvalidArgument, Unavailable
from rendezvous.items import Received
from rendezvous.stats import Stats
from rendezvous.v1 import rendezvous_pb2 as pb

from rendezvous.transport import Arrival, Carry, DataPlane, Path, Planes, Reply

__all__ = ["IpcPlane", "join", "ENDPOINT_URL", "TRANSFER_URL", "node_id", "inner_offer"]

log = logging.getLogger("rendezvous")

ENDPOINT_URL = "type.googleapis.com/rendezvous.v1.IpcEndpoint"
TRANSFER_URL = "type.googleapis.com/rendezvous.v1.IpcTransfer"


def _pack(msg: Any) -> bytes:
    out = any_pb2.Any()
    out.Pack(msg)
    return out.SerializeToString()


def _endpoint(options: Any) -> pb.IpcEndpoint | None:
    """The ``IpcEndpoint`` a request's ``options`` carry, or None when they are
    another plane's (INVALID_ARGUMENT when it does not parse)."""
    if options.type_url != ENDPOINT_URL:
        return None
    endpoint = pb.IpcEndpoint()
    try:
        options.Unpack(endpoint)
    except DecodeError:
        raise InvalidArgument("request carries a malformed IpcEndpoint") from None
    return endpoint


def inner_offer(options: Any) -> Any | None:
    """The next plane's offer inside an ``IpcEndpoint`` (an ``Any``, possibly
    empty), or None when ``options`` is not one."""
    endpoint = _endpoint(options)
    return None if endpoint is None else endpoint.next


class _Export(NamedTuple):
    pid: int        # the consumer's process
    request: Any    # what it was asked with (a failed release puts the tensor back)
    item: Received  # the tensor: held until the consumer releases it
    keep: Any       # what the backend holds with it (its IPC event)


class IpcPlane(DataPlane):
    path = Path.IPC
    descriptor_url = TRANSFER_URL
    wraps_offers = True

    def __init__(self, task: str, devices: Devices, stats: Stats, *, node: bytes | None = None) -> None:
        self.task = task
        self.devices = devices
        self.stats = stats
        self.node = node_id() if node is None else node
        self.pid = os.getpid()
        #: backend -> its GPUs' UUIDs by index (only backends with IPC)
        self._uuids: dict[DeviceBackend, dict[int, bytes]] = {}
        for backend in devices.backends:
            uuids = backend.ipc_devices() if backend.available() else None
            if uuids:
                self._uuids[backend] = uuids
        #: export id -> what the producer holds for it until released
        self.exports: dict[int, _Export] = {}
        #: consumer pid -> (its pidfd, watched on the loop; its exports held)
        self._watched: dict[int, tuple[int, int]] = {}
        #: the allocations of other processes opened here
        self._opened = OpenedHandles()
        #: consumer: ``release(producer task, export ids, failed)`` sends a release
        #: to the producer (set by the rank server, which has the streams)
        self.release: Callable[[str, list[int], bool], None] | None = None
        #: producer: ``gave_back(request, item)`` puts a tensor back in the table
        #: (set by the rank server), for a release that says the copy failed
        self.gave_back: Callable[[Any, Received], None] | None = None
        #: producer: ``delivered(request_id)``: the consumer has the tensor (its
        #: release): the retry cache need not hold it any longer
        self.delivered: Callable[[int], None] | None = None
        #: what a recv bound for a GPU offers (None: nothing; after a handle could not be opened)
        self._offer: bytes | None = _pack(pb.IpcEndpoint(
            node=self.node, pid=self.pid, devices=[u for m in self._uuids.values() for u in m.values()])) \
            if self._uuids else None

    @property
    def usable(self) -> bool:
        """Whether any backend here can export and open by IPC."""
        return bool(self._uuids)

    # -- consumer -----------------------------------------------------------

    def offer(self, placement: Placement | None) -> bytes | None:
        return self._offer if placement is not None and placement.is_gpu else None

    def wrap(self, offer: bytes, rest: bytes | None) -> bytes:
        """``offer`` with the next plane's offer inside it (``next``)."""
        if not rest:
            return offer
        outer = any_pb2.Any.FromString(offer)
        endpoint = pb.IpcEndpoint()
        outer.Unpack(endpoint)
        endpoint.next.ParseFromString(rest)
        return _pack(endpoint)

    def inner(self, options: Any) -> Any | None:
        return inner_offer(options)

    def receive(self, buf: bytes, head: ReplyHead, placement: Placement | None = None) -> Arrival:
        transfer, meta = self._parse(buf, head)
        backend = self.devices.gpu_backend()
        if placement is None or not placement.is_gpu or backend not in self._uuids:
            self._released(transfer, failed=True)  # the tensor goes back: nothing is lost to a wrong answer
            raise Internal("an IPC descriptor answered a recv that was offered no IPC (bound for the host, or "
                           "in a process without it)")
        return Arrival(Path.IPC, pending=self._copy(backend, transfer, meta, placement.index), placed=True)

    async def _copy(self, backend: DeviceBackend, transfer: pb.IpcTransfer, meta: TensorMeta, device: int) -> Any:
        """Open (or find open) the producer's allocation, copy the tensor onto
        ``device`` after the producer's event, then release the export: done,
        or failed (the producer puts the tensor back). Cancelled (the server
        stops) while the copy runs, it releases as failed once the copy is done,
        holding the destination until then."""
        try:
            opened = self._open(backend, transfer.memory, device)
            dst, allocated = backend.allocate(meta, device)
            done = backend.ipc_copy(opened, transfer.offset, transfer.event, dst, device, allocated)
        except Exception as exc:
            raise self._failed(transfer, exc) from None
        copied = asyncio.get_running_loop().run_in_executor(None, backend.event_wait, done)
        try:
            await asyncio.shield(copied)
        except asyncio.CancelledError:
            def back(_: asyncio.Future, held: Any = dst) -> None:  # (held: dst stays until the copy is done)
                self._released(transfer, failed=True)
            copied.add_done_callback(back)
            raise
        except Exception as exc:
            raise self._failed(transfer, exc) from None
        self._released(transfer, failed=False)
        self.stats.gpu("ipc_recvs")
        return backend.user_array(dst)

    def _failed(self, transfer: pb.IpcTransfer, exc: Exception) -> Unavailable:
        """The copy of ``transfer`` could not be made: released as failed (the
        tensor goes back to its producer); the recv's error."""
        self._released(transfer, failed=True)
        return Unavailable(f"CUDA IPC copy from {transfer.producer} failed ({type(exc).__name__}: {exc}); "
                           "the tensor went back to its producer for the next recv")

    def _open(self, backend: DeviceBackend, memory: bytes, device: int) -> Any:
        opens = self._opened.opens
        try:
            opened = self._opened.open(backend, memory, device)
        except Exception as exc:  # this process cannot open handles: no IPC from now on
            log.warning("CUDA IPC: cannot open a memory handle (%s: %s); GPU tensors from other processes "
                        "of this node take the staged or default path from now on", type(exc).__name__, exc)
            self._offer = None
            raise
        if self._opened.opens != opens:
            self.stats.gpu("ipc_opens")
        return opened

    def _released(self, transfer: pb.IpcTransfer, failed: bool) -> None:
        if self.release is not None:
            self.release(transfer.producer, [transfer.export_id], failed)

    def drain(self, buf: bytes, head: ReplyHead) -> None:
        """A descriptor nobody waits for: released as failed, so the producer puts
        its tensor back (never dropped)."""
        try:
            transfer, _ = self._parse(buf, head)
        except Exception:
            return
        self._released(transfer, failed=True)

    def _parse(self, buf: bytes, head: ReplyHead) -> tuple[pb.IpcTransfer, TensorMeta]:
        if head.tensor is None or head.transport_options is None:
            raise Internal("IPC descriptor without dtype and shape")
        a, b = head.transport_options
        opts = any_pb2.Any.FromString(bytes(buf[a:b]))
        transfer = pb.IpcTransfer()
        try:
            unpacked = opts.Unpack(transfer)
        except DecodeError:
            unpacked = False
        if opts.type_url != TRANSFER_URL or not unpacked or not transfer.memory or not transfer.producer:
            raise Internal("malformed IPC descriptor")
        meta, _, _ = decode_meta(buf, *head.tensor)
        if meta.nbytes != transfer.nbytes:
            raise Internal(f"IPC descriptor announces {transfer.nbytes} bytes for {meta.dtype}{list(meta.shape)}"
                           f" ({meta.nbytes} bytes)")
        return transfer, meta

    # -- producer -----------------------------------------------------------

    def plan(self, req: Any, item: Received) -> Reply | None:
        tensor = item.value
        if not isinstance(tensor, DeviceTensor):
            return None
        endpoint = _endpoint(req.transport_options)
        if endpoint is None:
            return None
        uuid = self._uuids.get(tensor.backend, {}).get(tensor.device)
        if uuid is None or endpoint.node != self.node or endpoint.pid in (self.pid, 0) or endpoint.pid < 0 \
                or uuid not in endpoint.devices:
            self.stats.gpu("ipc_fallbacks")
            return None
        try:
            memory, offset, event, keep = tensor.backend.ipc_export(tensor)
        except Exception as exc:  # not exportable (memory of another allocator): the next plane carries it
            log.warning("CUDA IPC export of a tensor on GPU:%d failed (%s); it goes another way", tensor.device, exc)
            self.stats.gpu("ipc_fallbacks")
            return None
        export_id = secrets.randbits(64)
        transfer = _pack(pb.IpcTransfer(memory=memory, offset=offset, event=event, export_id=export_id,
                                        producer=self.task, nbytes=tensor.nbytes))
        exports, stats, pid = self.exports, self.stats, endpoint.pid

        def start() -> None:
            exports[export_id] = _Export(pid, req, item, keep)
            self._watch(pid)
            stats.gpu("ipc_sends")

        response = descriptor_response(TensorMeta(tensor.dtype, tensor.shape), transfer)
        return Reply(Path.IPC, lambda call_id: iter((with_call_id(call_id, response),)), _no_unary, item,
                     carry=Carry(transfer, start, _nothing))

    def released(self, export_ids: Any, failed: bool) -> None:
        """The consumer is done with ``export_ids`` (copied, or ``failed``: each
        tensor goes back to the table). An id not held (released before, or
        never ours) is ignored: a release frees nothing twice."""
        for export_id in export_ids:
            held = self.exports.pop(export_id, None)
            if held is None:
                continue
            self._unwatch(held.pid)
            if failed and self.gave_back is not None:
                self.gave_back(held.request, held.item)
            elif not failed and held.request.request_id and self.delivered is not None:
                self.delivered(held.request.request_id)

    def _watch(self, pid: int) -> None:
        """Hold one more export for consumer ``pid``; the first is when its exit
        starts being watched (its exports are dropped when it exits)."""
        fd, held = self._watched.get(pid, (-1, 0))
        if held == 0:
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # gone already (or never a process): nobody will release it
                self._gone(pid)
                return
            asyncio.get_running_loop().add_reader(fd, self._gone, pid)
        self._watched[pid] = (fd, held + 1)

    def _unwatch(self, pid: int) -> None:
        fd, held = self._watched.get(pid, (-1, 0))
        if held > 1:
            self._watched[pid] = (fd, held - 1)
        elif held == 1:
            del self._watched[pid]
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    def _gone(self, pid: int) -> None:
        """Consumer ``pid`` exited: what it held is dropped (its copies ended with it)."""
        dropped = [i for i, e in self.exports.items() if e.pid == pid]
        for export_id in dropped:
            del self.exports[export_id]
        fd, _ = self._watched.pop(pid, (-1, 0))
        if fd >= 0:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
        if dropped:
            log.info("consumer process %d exited holding %d CUDA IPC exports: released", pid, len(dropped))

    def close(self) -> None:
        self.exports.clear()
        for fd, _ in self._watched.values():
            with contextlib.suppress(RuntimeError):  # the loop is closed: its readers went with it
                asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
        self._watched.clear()
        self._opened.close()


def join(planes: Planes, config: Config, task: str, devices: Devices, stats: Stats, *,
         release: Callable[[str, list[int], bool], None], gave_back: Callable[[Any, Received], None],
         delivered: Callable[[int], None]) -> None:
    """A rank server's IPC plane joins its ``planes`` (ahead of the others)
    once a GPU is first used here (:meth:`Devices.when_used`: no GPU library is
    loaded before), when ``cuda_ipc`` is on and a GPU backend can export and
    open memory by IPC. ``release``, ``gave_back``, ``delivered``: see the
    plane's attributes of those names."""
    if not config.cuda_ipc:
        return

    def joined() -> None:
        plane = IpcPlane(task, devices, stats)
        if plane.usable:
            plane.release, plane.gave_back, plane.delivered = release, gave_back, delivered
            planes.register(plane)
    devices.when_used(joined)


def _nothing() -> None:
    pass


def _no_unary() -> bytes:
    raise Internal("an IPC descriptor is sent on a stream, which holds the export; never unary")
