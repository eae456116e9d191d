"""The MPI job this process is part of: initialization, identity, rank map.

MPI is initialized (by importing ``mpi4py.MPI``) at the thread level
MULTIPLE, which mpi4py requests by default. The design needs at least
SERIALIZED: only the engine thread makes MPI calls, but it is not the thread
that initialized MPI. A lower granted level is refused with a clear error.

At start-up every rank contributes (task name, gRPC address) to an allgather
over a private duplicate of ``MPI_COMM_WORLD`` (names of any length; a rank
whose server does not take part is simply absent). Duplicate task names are
refused on every rank alike. Rank 0 also picks a random ``world_id`` so a
consumer in another MPI job (another ``mpiexec``) is never sent MPI bytes.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

from rendezvous.errors import FailedPrecondition, InvalidArgument
from rendezvous.keys import TaskName

__all__ = ["MpiWorld", "RankAddress", "import_mpi", "SINGLE_COPY_PROBE_BYTES", "SINGLE_COPY_PROBE_PAUSE"]

#: the single-copy probe's message: past every library's eager and single-copy thresholds
SINGLE_COPY_PROBE_BYTES = 1 << 20
#: how long the probe's sender stays out of MPI (see MpiWorld.probe_single_copy)
SINGLE_COPY_PROBE_PAUSE = 0.02
_PROBE_TAG = 7


class RankAddress(NamedTuple):
    """Where a task of the job is: its MPI rank, its gRPC address, and the
    incarnation of its server."""

    rank: int
    address: str
    incarnation: int = 0


def _loaded_mpi_libraries() -> list[str]:
    """Paths of the MPI shared libraries mapped into this process (Linux)."""
    found: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                name = os.path.basename(path)
                if name.startswith("libmpi") and ".so" in name and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found

_LEVELS = ("SINGLE", "FUNNELED", "SERIALIZED", "MULTIPLE")


def import_mpi() -> Any:
    """``mpi4py.MPI``, initializing MPI; FailedPrecondition if it cannot be had."""
    try:
        import mpi4py
    except ImportError:
        raise FailedPrecondition(
            "protocol grpc+mpi needs mpi4py: pip install 'rendezvous[mpi]' "
            "(or set MPI_DISABLED=1 to run over gRPC only)") from None
    mpi4py.rc.thread_level = "multiple"
    try:
        from mpi4py import MPI
    except Exception as exc:  # the MPI library itself failed to load or initialize
        raise FailedPrecondition(f"MPI could not be initialized: {exc} (MPI_DISABLED=1 runs over gRPC)") from exc
    return MPI


@dataclass
class MpiWorld:
    MPI: Any
    comm: Any          # our private duplicate of COMM_WORLD
    rank: int
    size: int
    thread_level: str
    world_id: int
    library: str
    control: Any = None  # the communicator of the request path's messages (made with ``comm``)
    #: ranks MPI reaches over the network, not through this node's shared memory
    #: (``COMM_TYPE_SHARED``; with ``MPIR_CVAR_NOLOCAL=1`` every other rank)
    remote_ranks: frozenset[int] = frozenset()
    #: whether MPI moves a large message between two ranks of this node in one
    #: copy made by the receiver, without the sender's MPI calls (CMA, XPMEM,
    #: KNEM), as found by trying at start-up (:meth:`probe_single_copy`);
    #: None: no other rank shares this node
    single_copy: bool | None = None

    @classmethod
    def join(cls) -> "MpiWorld":
        """Initialize MPI (if needed) and check the thread level. Not collective."""
        MPI = import_mpi()
        level = MPI.Query_thread()
        name = _LEVELS[level] if 0 <= level < len(_LEVELS) else str(level)
        if level < MPI.THREAD_SERIALIZED:
            raise FailedPrecondition(
                f"MPI granted thread level {name}; grpc+mpi needs SERIALIZED or MULTIPLE "
                "(its progress thread is not the thread that initialized MPI)")
        world = MPI.COMM_WORLD
        library = " ".join(MPI.Get_library_version().splitlines()[0].split())
        return cls(MPI, None, world.Get_rank(), world.Get_size(), name, 0, library)

    def probe_cuda_aware(self) -> tuple[bool, str]:
        """(whether MPI takes CUDA device buffers, how that was found). Call after init.

        Asks the loaded MPI library itself: MPICH's ``MPIX_GPU_query_support``
        (CUDA), else ``MPIX_Query_cuda_support`` (Open MPI, MPICH). A library
        with neither is taken as not CUDA-aware."""
        import ctypes

        for path in _loaded_mpi_libraries():
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            query = getattr(lib, "MPIX_GPU_query_support", None)
            if query is not None:
                flag = ctypes.c_int(0)
                query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
                if query(0, ctypes.byref(flag)) == 0:  # 0: MPIX_GPU_SUPPORT_CUDA
                    return bool(flag.value), f"MPIX_GPU_query_support in {os.path.basename(path)}"
            query = getattr(lib, "MPIX_Query_cuda_support", None)
            if query is not None:
                query.restype = ctypes.c_int
                return bool(query()), f"MPIX_Query_cuda_support in {os.path.basename(path)}"
        return False, "the MPI library offers no CUDA query"

    def _node(self) -> tuple[frozenset[int], bool | None]:
        """Collective: the ranks outside this node's shared-memory group, as MPI
        itself sees them (so network-namespace hosts told ``MPIR_CVAR_NOLOCAL``
        count as remote, as they are to MPI), and whether a single copy moves
        large messages within the node (:meth:`probe_single_copy`)."""
        local = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED)
        near_group, all_group = local.Get_group(), self.comm.Get_group()
        try:
            near = near_group.Translate_ranks(list(range(near_group.Get_size())), all_group)
            single_copy = self.probe_single_copy(local)
        finally:
            near_group.Free()
            all_group.Free()
            local.Free()
        return frozenset(range(self.size)) - frozenset(near), single_copy

    def probe_single_copy(self, local: Any) -> bool | None:
        """Collective over ``local`` (this node's ranks, ``COMM_TYPE_SHARED``):
        whether a large message between two ranks of the node moves in a single
        copy made by the receiver, without the sender calling MPI while it
        moves (CMA, XPMEM, KNEM). Found by trying, not by reading settings (a
        library may have CMA on and the kernel refuse it): the node's first
        two ranks time one message of ``SINGLE_COPY_PROBE_BYTES`` whose sender
        makes no MPI call for ``SINGLE_COPY_PROBE_PAUSE`` seconds after posting
        it (both read ``CLOCK_MONOTONIC``: one clock per node). Without a
        single-copy path the message moves through shared-memory cells only as
        both sides poll, so it lands after the sender's pause; with one, the
        receiver copies it as soon as its receive matches. Every rank of the
        node gets the answer; None where no other rank shares the node. Costs
        one pause at start-up."""
        import numpy as np

        MPI = self.MPI
        if local.Get_size() < 2:
            return None
        me = local.Get_rank()
        verdict = None
        local.Barrier()
        if me == 1:
            buf = np.ones(SINGLE_COPY_PROBE_BYTES, np.uint8)
            posted = time.monotonic()
            req = local.Isend([buf, MPI.BYTE], 0, _PROBE_TAG)
            time.sleep(SINGLE_COPY_PROBE_PAUSE)  # no MPI call: only a single copy moves it now
            req.Wait()
            local.send(posted, 0, _PROBE_TAG)
        elif me == 0:
            buf = np.empty(SINGLE_COPY_PROBE_BYTES, np.uint8)
            local.Recv([buf, MPI.BYTE], 1, _PROBE_TAG)
            landed = time.monotonic()
            verdict = landed - local.recv(source=1, tag=_PROBE_TAG) < SINGLE_COPY_PROBE_PAUSE / 2
        return bool(local.bcast(verdict, root=0))

    def exchange(self, task: TaskName, address: str, incarnation: int = 0) -> dict[TaskName, RankAddress]:
        """Collective (run on the engine thread): {task: (rank, address, incarnation)} for the whole job."""
        world = self.MPI.COMM_WORLD
        self.comm = world.Dup()
        self.control = self.comm.Dup()  # requests and replies: never matched by a data transfer
        self.world_id = self.comm.bcast(secrets.randbits(63) | 1 if self.rank == 0 else None, root=0)
        self.remote_ranks, self.single_copy = self._node()
        entries = self.comm.allgather((task.job, task.replica, task.task, address, incarnation))
        table: dict[TaskName, RankAddress] = {}
        for rank, (job, replica, index, addr, inc) in enumerate(entries):
            t = TaskName(job, replica, index)
            if t in table:
                raise InvalidArgument(
                    f"task {t} is claimed by MPI ranks {table[t].rank} and {rank}; "
                    "each rank must run a different task")
            table[t] = RankAddress(rank, addr, inc)
        return table
