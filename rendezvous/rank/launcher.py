"""What a launcher (``mpiexec``, ``srun``) tells a process about its place in
the job, read from the environment without touching MPI.

The rank server reads it (a ``grpc+mpi`` server outside any launcher warns
that MPI cannot reach the other tasks), and so do the daemon and the
programs; :mod:`rendezvous.rank.launch`, which starts ranks itself, sits
above the blocking server and offers these names too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["RANK_VARIABLES", "SIZE_VARIABLES", "launcher_rank"]

#: Environment variables MPI launchers and schedulers set to a process's rank.
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")
SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS")


def launcher_rank(env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """(rank, size) as the launcher (mpiexec, srun) set them, without touching MPI.

    Works with ``MPI_DISABLED=1`` too; None outside any launcher."""
    env = os.environ if env is None else env
    rank = next((env[v] for v in RANK_VARIABLES if env.get(v, "").isdigit()), None)
    size = next((env[v] for v in SIZE_VARIABLES if env.get(v, "").isdigit()), None)
    if rank is None:
        return None
    return int(rank), int(size) if size is not None else int(rank) + 1
