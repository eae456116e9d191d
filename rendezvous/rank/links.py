"""The one place a rank server's link to its job is chosen: :func:`choose`,
and what the server learns from it at start: :func:`joined`.

See :mod:`rendezvous.transport.link`: under ``protocol="grpc+mpi"`` without
``MPI_DISABLED`` the link is the rank's MPI half (mpi4py is imported here,
never otherwise); every other server's is :class:`GrpcOnly`.
"""

from __future__ import annotations

import logging

from rendezvous.cluster import ClusterSpec
from rendezvous.config import Config, Protocol
from rendezvous.keys import TaskName
from rendezvous.transport.link import GrpcOnly, RankLink

from .launcher import launcher_rank

__all__ = ["choose", "joined"]

log = logging.getLogger("rendezvous.server")

_WARNED: set[str] = set()


def choose(config: Config, protocol: Protocol) -> RankLink:
    """The link of a rank server with ``config`` and ``protocol``: made at once
    (joining the MPI job initializes MPI)."""
    if config.uses_mpi(protocol):
        from rendezvous.mpi.rank import MpiRank  # imports mpi4py: never with MPI_DISABLED=1

        return MpiRank.join(config)
    if protocol is Protocol.GRPC_MPI:
        return GrpcOnly("MPI_DISABLED=1: MPI off, all transfers over gRPC")
    return GrpcOnly()


def joined(cluster: ClusterSpec, task: TaskName, link: RankLink,
           addresses: dict[TaskName, tuple[str, int]]) -> ClusterSpec:
    """``cluster`` with the addresses and incarnations ``link`` found at start;
    says which tasks the link does not reach (once per process, as a warning,
    when this process is a job of one rank started without a launcher)."""
    if not addresses:
        return cluster
    for other, (address, incarnation) in addresses.items():
        if other in cluster:
            cluster = cluster.with_address(other, address, incarnation)
        else:
            log.warning("MPI rank %d runs %s, which is not in the cluster", link.ranks[other], other)
    outside = [str(t) for t in cluster.tasks() if t not in addresses]
    if len(addresses) == 1 and outside and launcher_rank() is None:
        # Started as a plain process: MPI makes each one a world of its own.
        message = (f"protocol grpc+mpi outside an MPI launcher: task {task} is an MPI world of one "
                   f"rank, so every tensor to or from the {len(outside)} other task(s) of the cluster goes "
                   "over gRPC. Start the job with mpiexec (e.g. mpiexec -n N python -m mpi4py train.py), "
                   "or set MPI_DISABLED=1 to run over gRPC without this warning.")
        if message not in _WARNED:
            _WARNED.add(message)
            log.warning(message)
    elif outside:
        log.info("tasks outside this MPI job, served over gRPC: %s", ", ".join(outside))
    return cluster
