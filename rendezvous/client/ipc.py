"""CUDA IPC between a local client and its daemon (the session socket only):
:class:`ClientIpc`. The messages are in :mod:`rendezvous.local.ipc`, the
daemon's side in :mod:`rendezvous.daemon.ipc`.

* A send of a GPU tensor exports it (the allocation's handle, an IPC event
  after the tensor's ready event) in a ``SEND_IPC``; the daemon copies it to
  its own memory on that GPU and answers once the copy is done, so the
  export is held until then. UNAVAILABLE (the daemon cannot open it: another
  GPU, IPC off there, the daemon's own process) sends it through the host,
  and every later one too.
* A recv bound for a GPU names that GPU's UUID; an answer exported by the
  daemon is an :class:`Exported`, copied when the recv places it (the handle
  opened once per allocation, the copy after the daemon's event), then
  released (``IPC_RELEASE``; ``failed`` when the copy could not be made: the
  daemon keeps the tensor for the next recv of its key).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from rendezvous.codec.tensors import TensorMeta
from rendezvous.devices import DeviceBackend, DeviceTensor, Devices, Placement
from rendezvous.devices.ipc_handles import OpenedHandles
from rendezvous.errors import Unavailable
from rendezvous.local.frames import Kind, frame
from rendezvous.local.ipc import release_body
from rendezvous.v1 import rendezvous_pb2 as pb

from .segments import Segments

__all__ = ["Exported", "ClientIpc"]

log = logging.getLogger("rendezvous.client")


class Exported(NamedTuple):
    """A recv's tensor the daemon exported, to copy when it is placed."""

    transfer: pb.IpcTransfer
    meta: TensorMeta


class ClientIpc:
    """A session client's CUDA IPC (``on``: ``RENDEZVOUS_CUDA_IPC``, and no
    failure yet): its GPUs' UUIDs (asked of the backends at the first GPU
    tensor), the daemon's allocations opened here, and the releases to tell."""

    def __init__(self, devices: Devices, on: bool) -> None:
        self.devices = devices
        self.on = on
        self.handles = OpenedHandles()
        self._uuids: dict[tuple[DeviceBackend, int], bytes] | None = None
        self.segments: Segments | None = None  # where releases go (the session's)
        #: exports of sends the daemon has not answered (an interrupted send's stay until close)
        self.held: list[Any] = []

    def uuid(self, backend: DeviceBackend, index: int) -> bytes | None:
        """The UUID of GPU ``index`` of ``backend`` if IPC can use it here."""
        if self._uuids is None:
            self._uuids = {}
            for b in self.devices.backends:
                for i, u in ((b.ipc_devices() or {}) if b.available() else {}).items():
                    self._uuids[(b, i)] = u
        return self._uuids.get((backend, index))

    def off(self, why: BaseException) -> None:
        if self.on:
            log.warning("CUDA IPC with the daemon failed (%s); GPU tensors go through the host from now on", why)
        self.on = False

    def export(self, tensor: DeviceTensor) -> tuple[pb.IpcTransfer, Any] | None:
        """A send's export of ``tensor`` and what must be held until the daemon
        answers; None when IPC is off or cannot take it."""
        uuid = self.uuid(tensor.backend, tensor.device) if self.on else None
        if uuid is None:
            return None
        try:
            memory, offset, event, keep = tensor.backend.ipc_export(tensor)
        except Exception as exc:  # memory of another allocator: through the host
            self.off(exc)
            return None
        return pb.IpcTransfer(memory=memory, offset=offset, event=event, nbytes=tensor.nbytes, device=uuid), \
            (keep, tensor)

    def offer(self, target: Placement) -> bytes:
        """The UUID a recv bound for ``target`` names (b"": none, no IPC)."""
        backend = self.devices.gpu_backend() if self.on and target.is_gpu else None
        return (self.uuid(backend, target.index) or b"") if backend is not None else b""

    def copy(self, exported: Exported, target: Placement) -> Any:
        """The daemon's export copied onto ``target`` (blocking), then released;
        released as failed (the daemon keeps the tensor) if the copy cannot be made."""
        backend = self.devices.gpu_backend()
        transfer = exported.transfer
        try:
            if backend is None:
                raise Unavailable("no GPU backend here")
            opened = self.handles.open(backend, transfer.memory, target.index)
            dst, allocated = backend.allocate(exported.meta, target.index)
            backend.event_wait(backend.ipc_copy(opened, transfer.offset, transfer.event, dst, target.index,
                                                allocated))
        except Exception as exc:
            self.release(transfer.export_id, failed=True)
            self.off(exc)
            raise Unavailable(f"CUDA IPC copy from the daemon failed ({type(exc).__name__}: {exc}); the tensor "
                              "went back to the daemon for the next recv") from None
        self.release(transfer.export_id, failed=False)
        return backend.user_array(dst)

    def release(self, export_id: int, failed: bool) -> None:
        if self.segments is not None:
            self.segments.note(frame(Kind.IPC_RELEASE, 0, release_body([export_id], failed)))

    def close(self) -> None:
        self.handles.close()
        self.held.clear()
