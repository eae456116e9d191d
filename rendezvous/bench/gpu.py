"""GPU contenders: device tensors between the two ranks, and the copy they are
bounded by.

* ``gpu_staged``: ``await server.recv(key)`` of a tensor produced on rank 1's
  GPU into rank 0's GPU on the optimal path: without CUDA-aware MPI the bytes
  are staged through pinned host chunks on both sides, the device-to-host
  copy of chunk i+1 overlapping the MPI send of chunk i (and host-to-device
  overlapping the receive on the other side);
* ``gpu_serial``: the same with one chunk in flight (no overlap), to show
  what the pipelining buys;
* ``d2h``: one device-to-pinned-host copy of the same bytes on rank 0, the
  other bound of the staged path (``raw MPI`` is the first);
* ``gpu_staged_<CHUNK>_x<DEPTH>`` (``--gpu-staging 4M:4,16M:2``): ``gpu_staged``
  with that staging chunk size and depth, to measure both instead of guessing.

The GPU is cupy's on a machine with one (``--gpu cupy``), or
:class:`rendezvous.testing.fakegpu.FakeBackend` (``--gpu fake``): host memory and
copy threads standing in for a GPU, which measures the pipeline's overlap
and overhead on any machine but says nothing about PCIe or NVLink.
"""

from __future__ import annotations

import re
import time
from typing import Any

import numpy as np

from .contenders import Contender, ServerContender, check

__all__ = ["GPU_CONTENDERS", "gpu_backend", "GpuRendezvous", "DeviceToHost", "staging_setting", "staging_name",
           "is_gpu_contender"]

GPU_CONTENDERS = ("gpu_staged", "gpu_serial", "d2h")
_SETTING = re.compile(r"gpu_staged_(\d+[KMG]?)_x(\d+)")


def staging_setting(name: str) -> tuple[int, int] | None:
    """(chunk bytes, depth) of a contender ``gpu_staged_<CHUNK>_x<DEPTH>``, else None
    (ValueError for a chunk under 4 KiB or a depth under 1)."""
    m = _SETTING.fullmatch(name)
    if m is None:
        return None
    from .stats import parse_size

    chunk, depth = parse_size(m.group(1)), int(m.group(2))
    if chunk < 4096 or depth < 1:
        raise ValueError(f"{name}: a staging chunk of at least 4K and a depth of at least 1")
    return chunk, depth


def staging_name(spec: str) -> str:
    """``"4M:4"`` -> ``"gpu_staged_4M_x4"`` (ValueError if it does not read)."""
    chunk, sep, depth = spec.strip().upper().partition(":")
    name = f"gpu_staged_{chunk}_x{depth}"
    if not sep or staging_setting(name) is None:
        raise ValueError(f"--gpu-staging takes CHUNK:DEPTH items (4M:4), not {spec!r}")
    return name


def is_gpu_contender(name: str) -> bool:
    return name in GPU_CONTENDERS or _SETTING.fullmatch(name) is not None


def gpu_backend(kind: str) -> tuple[Any, str]:
    """(backend, note) for ``--gpu fake|cupy``; the GPU contenders' servers use it."""
    if kind == "fake":
        from rendezvous.testing.fakegpu import FakeBackend

        return FakeBackend(), "GPU contenders on the fake GPU (host memory, copy threads): pipeline overlap only"
    from rendezvous.devices.cupy_backend import CupyBackend

    backend = CupyBackend()
    if not backend.available():
        raise SystemExit("--gpu cupy needs cupy and a CUDA device")
    import cupy

    return backend, f"GPU contenders on {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}"


def _to_device(backend: Any, host: np.ndarray) -> Any:
    if backend.name == "fake":
        return backend.array(host)
    import cupy

    return cupy.asarray(host)


def _to_host(value: Any) -> np.ndarray:
    return value.get()


class GpuRendezvous(ServerContender):
    """GPU -> GPU through rank servers on the optimal path: the host contender's
    round trip with device tensors at both ends."""

    rate = False  # the 1 KiB rate and the host RSS tests are the host contenders'
    rss = False

    def __init__(self, ctx: Any, backend: Any, depth: int | None, name: str | None = None) -> None:
        super().__init__(ctx, optimal=True)
        self.backend = backend
        self.depth = depth
        self.chunk: int | None = None
        self.name = "gpu_serial" if depth == 1 else "gpu_staged"
        self.label = "rendezvous GPU->GPU, 1 chunk in flight" if depth == 1 else "rendezvous GPU->GPU"
        self.job = "gpu1" if depth == 1 else "gpu"
        setting = staging_setting(name) if name is not None else None
        if name is not None and setting is not None:
            from .stats import format_size

            self.chunk, self.depth = setting
            self.name, self.job = name, f"gpu{self.chunk}x{self.depth}"
            self.label = f"rendezvous GPU->GPU, {format_size(self.chunk)} chunks x {self.depth}"
        self._src: tuple[int, Any] | None = None

    async def setup(self) -> None:
        from rendezvous import aio

        cluster = self.ctx.cluster(self.job)
        extra: dict[str, Any] = {"gpu_staging_depth": self.depth} if self.depth else {}
        if self.chunk:
            extra["gpu_staging_chunk_bytes"] = self.chunk
        from rendezvous.devices import Devices

        # (the staged path is the one across nodes: on one node CUDA IPC would take it over)
        self.server = aio.Server(cluster, self.job, self.ctx.rank, protocol="grpc+mpi",
                                 devices=Devices([self.backend]), mpi_optimal_path=True,
                                 mpi_disabled=False, cuda_ipc=False, **extra)
        await self.server.start()  # collective: both ranks, same order

    def key(self, n: int, i: int = 0) -> str:
        return super().key(n, i).replace("/device:CPU:0;", "/device:GPU:0;")

    async def prepare(self, n: int, count: int, batch: int) -> None:
        if self._src is None or self._src[0] != n:
            self._src = None
            self._src = (n, _to_device(self.backend, self.ctx.source(n)))
        for _ in range(count):
            self.server.send(self.key(n), self._src[1], step_id=batch)

    @staticmethod
    def on_host(value: Any) -> Any:
        return _to_host(value)

    def release(self) -> None:
        self._src = None


class DeviceToHost(Contender):
    """One device -> pinned host copy of ``n`` bytes on rank 0 (the staging copy's bound)."""

    name = "d2h"
    label = "device -> pinned host copy"
    rss = False

    def __init__(self, ctx: Any, backend: Any) -> None:
        super().__init__(ctx)
        self.backend = backend
        self._bufs: tuple[int, Any, np.ndarray] | None = None

    async def consume(self, n: int, count: int, batch: int) -> list[int]:
        b = self.backend
        if self._bufs is None or self._bufs[0] != n:
            self._bufs = None
            self._bufs = (n, b.wrap(_to_device(b, self.ctx.source(n))), b.pinned(max(n, 1))[:n])
        _, src, host = self._bufs
        out = []
        clock = time.perf_counter_ns
        for _ in range(count):
            t0 = clock()
            b.event_wait(b.d2h_async(src, 0, host))
            out.append(clock() - t0)
        check(host, n)
        return out

    def release(self) -> None:
        self._bufs = None
