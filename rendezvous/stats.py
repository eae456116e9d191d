"""Transfer counters per path (:class:`rendezvous.paths.Path`: local, grpc, mpi, ipc).

Each path counts, on the consumer side, ``transfers`` completed, their payload
``bytes``, ``errors``, and ``fallbacks`` (transfers that took this path because
a faster one could not be used); on the producer side ``served`` replies and
``served_bytes``, and of those ``served_fused``: tensors that went packed with
others in one group reply (:mod:`rendezvous.codec.groups`). Updated on the event-loop thread only; read from anywhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .paths import Path

__all__ = ["Stats", "PATHS", "COUNTERS", "GPU_COUNTERS", "payload_nbytes"]

PATHS = tuple(Path)
COUNTERS = ("transfers", "bytes", "errors", "fallbacks", "served", "served_bytes", "served_fused")
#: GPU tensors: staged (through pinned host buffers) or direct (CUDA-aware MPI)
#: MPI transfers per direction, whole-tensor host<->device copies (default
#: gRPC path, local hand-offs to another device), and CUDA IPC exports, copies,
#: handles opened, and GPU tensors IPC could not carry (another node or GPU).
GPU_COUNTERS = ("staged_sends", "staged_recvs", "direct_sends", "direct_recvs", "staged_bytes",
                "to_host", "to_device", "ipc_sends", "ipc_recvs", "ipc_fallbacks", "ipc_opens")


class Stats:
    def __init__(self) -> None:
        self._paths: dict[Path, dict[str, int]] = {p: dict.fromkeys(COUNTERS, 0) for p in PATHS}
        self._gpu: dict[str, int] = dict.fromkeys(GPU_COUNTERS, 0)

    def received(self, path: Path, nbytes: int, count: int = 1) -> None:
        c = self._paths[path]
        c["transfers"] += count
        c["bytes"] += nbytes

    def served(self, path: Path, nbytes: int, count: int = 1, fused: bool = False) -> None:
        c = self._paths[path]
        c["served"] += count
        if fused:
            c["served_fused"] += count
        c["served_bytes"] += nbytes

    def error(self, path: Path) -> None:
        self._paths[path]["errors"] += 1

    def fallback(self, path: Path) -> None:
        self._paths[path]["fallbacks"] += 1

    def gpu(self, counter: str, n: int = 1) -> None:
        self._gpu[counter] += n

    def snapshot(self) -> dict[str, dict[str, int]]:
        """The counters by path name ("local", "grpc", "mpi", "ipc")."""
        return {str(p): dict(c) for p, c in self._paths.items()}

    def gpu_snapshot(self) -> dict[str, int]:
        return dict(self._gpu)


def payload_nbytes(value: Any) -> int:
    """Bytes a transfer of ``value`` carries (0 for dead tensors and strings)."""
    if type(value) is np.ndarray:  # the usual case, counted per tensor: no dtype built to compare
        return 0 if value.dtype.char == "O" else value.nbytes
    nbytes = getattr(value, "nbytes", 0)
    return int(nbytes) if getattr(value, "dtype", None) != object else 0
