"""Names for the ways a tensor travels, used from the stats to the clients.

:class:`Path` is how a tensor reached a rank (counted in ``stats()``, the
daemon's metrics, and a local client's counts); :class:`Hop` how it crossed
the local hop between a daemon and its client; :class:`AddressKind` how a
local client reaches its daemon.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Path", "Hop", "AddressKind"]


class Path(StrEnum):
    """The way a tensor travelled, as counted in ``stats()`` and the metrics."""

    LOCAL = "local"  # from this process's own table
    GRPC = "grpc"    # inside the gRPC reply
    MPI = "mpi"      # asked, or moved, by MPI
    IPC = "ipc"      # copied device to device from another process of the node (CUDA IPC)


class Hop(StrEnum):
    """How a tensor crossed the local hop between a daemon and its client."""

    INLINE = "inline"  # inside the frame (or the gRPC message)
    SHM = "shm"        # through a shared-memory segment of the daemon's pool
    IPC = "ipc"        # GPU to GPU, CUDA IPC (the session socket)


class AddressKind(StrEnum):
    """How a local client reaches its daemon."""

    UNIX = "unix"  # a Unix socket (and the session socket beside it)
    TCP = "tcp"    # a TCP port (the gRPC service only)
