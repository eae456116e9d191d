"""The MPI data plane of protocol ``grpc+mpi``.

Nothing here imports ``mpi4py`` at import time: :mod:`rendezvous.mpi.world`
does so when a ``grpc+mpi`` server starts with MPI enabled, so
``MPI_DISABLED=1`` works without mpi4py installed and outside ``mpiexec``.

* :mod:`.world`: MPI initialization, the thread level, the world identity,
  and the task -> rank map built by allgather at start-up;
* :mod:`.engine`: the progress thread that owns every MPI call;
* :mod:`.plane`: the optimal path itself: which replies become descriptors,
  the producer's non-blocking send, the consumer's receive.
"""
