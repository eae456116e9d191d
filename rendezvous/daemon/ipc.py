"""CUDA IPC between a daemon and its local clients (session socket only):
:class:`DaemonIpc` (the daemon's GPUs, the handles it opened) and
:class:`SessionIpc` (one session's copies and exports). The messages are in
:mod:`rendezvous.local.ipc`.

* A client's **send** of a tensor on a GPU the daemon can open: the daemon
  opens the export (once per allocation), copies it onto the same GPU after
  the client's event, and only once that copy is done produces the tensor
  and answers OK (so the client's memory is read before it lets go, and
  FIFO per key holds for a caller that waits for each send). A copy that
  cannot be made answers UNAVAILABLE and produces nothing: the client sends
  that tensor, and the later ones, through the host.
* A client's **recv** that names a GPU the daemon has: the daemon fetches
  the tensor onto that GPU, exports it and holds it until the client's
  ``IPC_RELEASE`` (``failed``: kept for the next recv of its key). A reply
  never written (the client went) gives the tensor back; exports still held
  when a session ends are dropped, never put back (the client may have
  delivered the tensor before its release left).

The daemon looks at its GPUs only when a client asks for IPC: a daemon whose
clients move no GPU tensors never loads a GPU library.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Callable
from typing import Any

from rendezvous.codec.tensors import TensorMeta
from rendezvous.devices import CPU, DeviceBackend, DeviceTensor
from rendezvous.devices.ipc_handles import OpenedHandles
from rendezvous.errors import Cancelled, Unavailable
from rendezvous.items import Received
from rendezvous.local import ipc as messages
from rendezvous.local.frames import Kind, frame
from rendezvous.paths import Path
from rendezvous.v1 import local_pb2 as lpb
from rendezvous.v1 import rendezvous_pb2 as pb

__all__ = ["DaemonIpc", "SessionIpc"]

log = logging.getLogger("rendezvous.daemon")


class DaemonIpc:
    """The daemon's GPUs as CUDA IPC sees them (their UUIDs, looked at when a
    client first asks; none with ``cuda_ipc`` off) and the handles it opened."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.pid = os.getpid()
        self.handles = OpenedHandles()
        self._gpus: dict[bytes, tuple[DeviceBackend, int]] | None = None

    def gpus(self) -> dict[bytes, tuple[DeviceBackend, int]]:
        """UUID -> (backend, index) of each GPU here that IPC can use."""
        if self._gpus is None:
            self._gpus = {}
            if self.server.config.cuda_ipc:
                for backend in self.server.devices.backends:
                    for index, uuid in ((backend.ipc_devices() or {}) if backend.available() else {}).items():
                        self._gpus.setdefault(uuid, (backend, index))
        return self._gpus

    def uuid(self, backend: DeviceBackend, index: int) -> bytes | None:
        return next((u for u, found in self.gpus().items() if found == (backend, index)), None)

    def close(self) -> None:
        self.handles.close()


class SessionIpc:
    """One session's CUDA IPC (its client is on this node, its process the one
    the kernel names; never the daemon's own): the copies of its sends in
    flight (their destinations held until done), and the exports of its recvs."""

    def __init__(self, daemon: DaemonIpc, pid: int, servicer: Any) -> None:
        self.daemon = daemon
        self.pid = pid
        self.servicer = servicer  # the LocalServicer: its drain, and where a tensor goes back
        self.copies: dict[asyncio.Future, Any] = {}
        #: export id -> (the request, the item, what the backend holds with it)
        self.exports: dict[int, tuple[lpb.LocalRecvRequest, Received, Any]] = {}

    def _gpu(self, uuid: bytes) -> tuple[DeviceBackend, int] | None:
        """The GPU with ``uuid`` here, if IPC with this client can use it."""
        return self.daemon.gpus().get(uuid) if uuid and self.pid != self.daemon.pid else None

    async def imported(self, transfer: pb.IpcTransfer, meta: TensorMeta) -> DeviceTensor:
        """The client's export copied onto the same GPU here, once the copy is done
        (UNAVAILABLE if it cannot be made)."""
        found = self._gpu(transfer.device)
        if found is None:
            raise Unavailable("CUDA IPC: the daemon cannot open memory of that GPU (another GPU, IPC off, or the "
                              "daemon's own process); send it through the host")
        backend, index = found
        try:
            opened = self.daemon.handles.open(backend, transfer.memory, index)
            dst, allocated = backend.allocate(meta, index)
            done = backend.ipc_copy(opened, transfer.offset, transfer.event, dst, index, allocated)
        except Exception as exc:
            raise Unavailable(f"CUDA IPC: the daemon cannot copy the client's tensor ({type(exc).__name__}: "
                              f"{exc}); send it through the host") from None
        copied = asyncio.get_running_loop().run_in_executor(None, backend.event_wait, done)
        self.copies[copied] = dst  # the destination stays until the copy is done, whoever waits
        copied.add_done_callback(self._copied)
        try:
            await asyncio.shield(copied)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise Unavailable(f"CUDA IPC: the daemon's copy of the client's tensor failed ({type(exc).__name__}: "
                              f"{exc}); send it through the host") from None
        return DeviceTensor(dst, backend, index, done)

    async def send(self, op: int, got: tuple[int, str, pb.IpcTransfer, TensorMeta],
                   write: Callable[[bytes], None], error: Callable[[int, BaseException], None]) -> None:
        """Operation ``op``, a SEND_IPC (parsed: step, key, transfer, meta): the key
        checked, the client's tensor copied here, then produced; answered OK
        (``write``), or with the error (``error``: the session's, held only while
        this runs, so a closed session is freed at once)."""
        step_id, key, transfer, meta = got
        server = self.daemon.server
        try:
            if self.servicer.draining:
                raise Unavailable(f"rendezvousd {server.task} is shutting down")
            server.prepare_send(key, None, True)  # a key this daemon does not produce: refused before a copy
            server.send(key, await self.imported(transfer, meta), step_id)
        except asyncio.CancelledError:
            error(op, Cancelled("an IPC send was cancelled: its session ends"))
        except Exception as exc:
            error(op, exc)
        else:
            write(frame(Kind.OK, op))

    async def reply(self, req: lpb.LocalRecvRequest, item: Received, path: Path
                    ) -> tuple[tuple[bytes, int] | None, Received]:
        """A recv's IPC reply and export id when it asked for one and its tensor is
        on a GPU here, else None and the item on the host (moved there if it was
        fetched onto a GPU but cannot be exported)."""
        exported = self.export(req, item, path) if self._gpu(req.ipc_device) is not None else None
        if exported is not None or item.value is None or self.daemon.server.devices.backend_for(item.value) is None:
            return exported, item
        server = self.daemon.server
        staging = (server.config.gpu_staging_chunk_bytes, server.config.gpu_staging_depth)
        host = await asyncio.get_running_loop().run_in_executor(None, server.devices.place, item.value, CPU, True,
                                                                staging)
        return None, Received(host, False)

    def _copied(self, copied: asyncio.Future) -> None:
        self.copies.pop(copied, None)

    def device(self, req: lpb.LocalRecvRequest) -> str:
        """Where the daemon fetches a recv's tensor: onto the GPU it names, when
        this session uses IPC and the daemon has that GPU; else the host."""
        found = self._gpu(req.ipc_device)
        return f"gpu:{found[1]}" if found is not None else "cpu"

    def export(self, req: lpb.LocalRecvRequest, item: Received, path: Path) -> tuple[bytes, int] | None:
        """A fetched GPU tensor's reply and export id, the tensor held until released;
        None when it is not a GPU tensor or cannot be exported (it goes by the host)."""
        value = item.value
        backend = self.daemon.server.devices.backend_for(value) if value is not None else None
        if backend is None:
            return None
        tensor = value if isinstance(value, DeviceTensor) else backend.wrap(value)
        uuid = self.daemon.uuid(backend, tensor.device)
        try:
            if uuid is None:
                raise Unavailable("not a GPU IPC can use")
            memory, offset, event, keep = backend.ipc_export(tensor)
        except Exception as exc:
            log.warning("CUDA IPC export to a local client failed (%s); the tensor goes through the host", exc)
            return None
        export_id = secrets.randbits(64)
        self.exports[export_id] = (req, item, keep)
        transfer = pb.IpcTransfer(memory=memory, offset=offset, event=event, export_id=export_id,
                                  producer=str(self.daemon.server.task), nbytes=tensor.nbytes, device=uuid)
        return messages.reply_body(TensorMeta(tensor.dtype, tensor.shape), transfer, path), export_id

    def released(self, body: bytes | memoryview) -> None:
        """An ``IPC_RELEASE``: the exports are let go; ``failed`` ones go back to
        be kept for the next recv of their keys. Ids not held are ignored."""
        release = messages.parse_release(body)
        for export_id in release.export_ids:
            self.unsent(export_id, back=release.failed)

    def unsent(self, export_id: int, back: bool = True) -> None:
        """Let go of export ``export_id`` (a reply that never reached its client:
        the tensor goes ``back``)."""
        held = self.exports.pop(export_id, None)
        if held is not None and back:
            self.servicer.give_back(held[0], held[1])
