"""GPU tensors at a local client: what crosses to the daemon, where recvs land.

The daemon keeps host tensors only, so a local client moves GPU tensors across
its own PCIe bus: a send copies the tensor to the host once (through pinned
chunks, after the work that wrote it, into the lent segment the send hands
over, or into a new array sent inside the frame); a recv puts each tensor
where its key's dst_device says (``GPU:N``), or where ``device=`` says, as a
server's recv does (:meth:`rendezvous.devices.Devices.place`). A tensor the
client cannot put on its GPU is given back to the daemon, which keeps it for
the next recv of its key (:meth:`ClientGpu.placed_plan`). On the session
socket both go device to device by CUDA IPC where they can
(:mod:`rendezvous.client.ipc`).

The plans of :mod:`rendezvous.client.core` ask for these copies as steps
(:class:`Stage`, :class:`Place`), so the asyncio client runs them off its loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple

import numpy as np

from rendezvous.config import Config
from rendezvous.devices import CPU, Devices, DeviceTensor, Placement, parse_placement, placement_for_device
from rendezvous.errors import RendezvousError, ResourceExhausted
from rendezvous.items import Received
from rendezvous.keys import parse_key

from .ipc import Exported, ClientIpc
from .segments import Segments

__all__ = ["Stage", "Place", "ClientGpu"]


@functools.lru_cache(maxsize=1 << 14)
def _wanted(key: str) -> Placement:
    """Where a canonical key's dst_device wants its tensor (a step's keys recur)."""
    return placement_for_device(parse_key(key).dst)


class Stage(NamedTuple):
    """Copy GPU tensor ``tensor`` to the host: into lent segment ``seg_id`` (None:
    a new array). Its outcome is the host array."""

    tensor: DeviceTensor
    seg_id: int | None


class Place(NamedTuple):
    """Put received ``items`` where ``targets`` say. Its outcome is the items placed."""

    items: list[Received]
    targets: list[Placement]


class ClientGpu:
    """A client's GPU side: its :class:`Devices` (made at the first tensor that
    is not a numpy array, whose backend looks for a GPU only when one is
    involved: host-only work never loads a GPU library) and the staging
    chunks (``RENDEZVOUS_GPU_STAGING_*``, read at the first copy)."""

    def __init__(self, devices: Devices | None) -> None:
        self._devices = devices
        self._config: Config | None = None
        self._ipc: ClientIpc | None = None
        #: the session's segments (None: no session, so no CUDA IPC)
        self.segments: Segments | None = None

    @property
    def devices(self) -> Devices:
        if self._devices is None:
            self._devices = Devices()
        return self._devices

    @property
    def ipc(self) -> ClientIpc | None:
        """CUDA IPC with the daemon (a session only; ``RENDEZVOUS_CUDA_IPC``)."""
        if self._ipc is None and self.segments is not None:
            self._ipc = ClientIpc(self.devices, self._cfg().cuda_ipc)
            self._ipc.segments = self.segments
        return self._ipc

    def close(self) -> None:
        if self._ipc is not None:
            self._ipc.close()

    def _cfg(self) -> Config:
        if self._config is None:
            self._config = Config.load()
        return self._config

    def _pool_args(self) -> tuple[int, int]:
        return self._cfg().gpu_staging_chunk_bytes, self._cfg().gpu_staging_depth

    def offer(self, target: Placement) -> bytes:
        """What a recv bound for ``target`` offers the daemon: a GPU's UUID for CUDA IPC, or b""."""
        ipc = self.ipc if target.is_gpu else None
        return ipc.offer(target) if ipc is not None else b""

    def on_gpu(self, obj: Any) -> bool:
        """Whether a backend takes ``obj`` for a GPU tensor (numpy arrays: never asked)."""
        return type(obj) is not np.ndarray and self.devices.backend_for(obj) is not None

    def stage(self, step: Stage, segments: Segments | None) -> np.ndarray:
        """Carry out ``step``; blocking."""
        tensor = step.tensor
        out = None
        if step.seg_id is not None:
            assert segments is not None
            out = segments.target(step.seg_id, tensor.nbytes).view(tensor.dtype).reshape(tensor.shape)
        return tensor.backend.to_host(tensor, self.devices.pool(tensor.backend, *self._pool_args()), out)

    def targets(self, keys: Sequence[str], device: Any) -> list[Placement] | None:
        """Where each of ``keys``' tensors goes (``device``, else the key's
        dst_device), resolved before anything is asked: a GPU this host lacks
        fails FAILED_PRECONDITION; a key's GPU with no usable GPU here gives
        the host (one warning). None: every one stays on the host as received."""
        explicit = parse_placement(device)
        if explicit is not None:
            return [self.devices.resolve(explicit, True)[0]] * len(keys) if explicit.is_gpu else None
        out: list[Placement] | None = None
        for i, k in enumerate(keys):
            if "gpu" not in k.lower():  # (no GPU device named: no parse)
                continue
            wanted = _wanted(k)
            target = self.devices.resolve(wanted, False)[0] if wanted.is_gpu else CPU
            if target.is_gpu:
                if out is None:
                    out = [CPU] * len(keys)
                out[i] = target
        return out

    def placed_plan(self, keys: Sequence[str], items: list[Received], targets: list[Placement],
                    give_back: Callable[[str, Received], Generator[Any, Any, Any]]
                    ) -> Generator[Any, Any, list[Received]]:
        """The steps of putting a recv's ``items`` where ``targets`` say. If they
        cannot be put there (out of device memory, a CUDA error), each goes back
        to the daemon (``give_back(key, item)``'s steps: kept for the next recv of
        its key) and the recv fails RESOURCE_EXHAUSTED; an export whose IPC copy
        failed went back with its release, and the recv fails UNAVAILABLE."""
        try:
            placed: list[Received] = yield Place(items, targets)
        except Exception as exc:
            for key, item in zip(keys, items):
                if type(item.value) is not Exported:
                    yield from give_back(key, item)
            if isinstance(exc, RendezvousError):  # (IPC's UNAVAILABLE) as it is
                raise
            raise ResourceExhausted(f"cannot put the received tensors on their GPU: {type(exc).__name__}: "
                                    f"{exc}; they are kept for the next recv of their keys") from exc
        return placed

    def place(self, step: Place) -> tuple[list[Received], int]:
        """Carry out ``step`` (blocking); also how many tensors it moved from the host."""
        out: list[Received] = []
        for item, target in zip(step.items, step.targets):
            value = item.value
            if type(value) is Exported:
                assert self._ipc is not None
                out.append(Received(self._ipc.copy(value, target), False))
            elif value is None or not target.is_gpu or getattr(value, "dtype", None) == np.dtype(object):
                out.append(item)  # dead, bound for the host, or strings (no device form)
            else:
                out.append(Received(self.devices.place(value, target, True, self._pool_args()), False))
        return out, sum(a is not b and type(b.value) is not Exported for a, b in zip(out, step.items))
