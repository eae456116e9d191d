"""A rank of a test's MPI job that fails aborts the whole job: import this
first in a script run under mpiexec (an exception in any thread prints its
traceback, then MPI_Abort, so the other ranks never hang)."""

from __future__ import annotations

import os
import sys
import threading
import traceback


def _abort_job(exc_type, exc, tb):
    traceback.print_exception(exc_type, exc, tb)
    sys.stderr.flush()
    if "mpi4py.MPI" in sys.modules:
        sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(1)
    os._exit(1)


sys.excepthook = _abort_job
threading.excepthook = lambda args: _abort_job(args.exc_type, args.exc_value, args.exc_traceback)
