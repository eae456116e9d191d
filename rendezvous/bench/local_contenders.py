"""``rendezvous bench``'s local-client cells: a training process's client
through its node's rendezvousd, on each way a client reaches its daemon.

Each rank of the bench job is a node's daemon (as ``rendezvousd`` under
``mpiexec`` is: a :class:`rendezvous.daemon.daemon.Daemon` on the rank's
loop, ``grpc+mpi``, the optimal path), and each has one client in a process
of its own (a :mod:`rendezvous.bench.daemon_workers` worker). Rank 1's
client sends into its daemon; rank 0's client receives through its own,
which fetches the tensor from rank 1's daemon (its bytes over MPI) and hands
it over the local hop. Rank 0's client times each recv in its own process,
as a training script would see it.

* ``local_socket``: the client's session socket (frames on a Unix socket,
  tensors of ``shm_threshold`` and up in the daemon's shared-memory pool);
* ``local_grpc``: the daemon's local gRPC service on a TCP address (the
  bytes inside gRPC messages).

Both are compared with raw MPI (the bytes between the daemons) in the
matrix. The client's CPU is spent in its own process, outside the CPU
figures the bench takes of each rank.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from typing import Any

from .contenders import Contender, rest

__all__ = ["LocalClient", "LOCAL_CELLS"]

#: the local-client cells, in the order tables list them
LOCAL_CELLS = ("local_socket", "local_grpc")


class LocalClient(Contender):
    """The blocking ``rendezvous.client.Client`` through rendezvousd (see the module)."""

    rate = False  # one client thread
    rss = False  # the RSS that matters is the client's and the daemon's: bench-daemon measures it

    def __init__(self, ctx: Any, session: bool) -> None:
        super().__init__(ctx)
        self.session = session
        self.name = LOCAL_CELLS[0] if session else LOCAL_CELLS[1]
        self.label = ("local Client via rendezvousd, " +
                      ("session socket" if session else "local gRPC address"))
        self.job = self.name.replace("_", "")
        self.daemon: Any = None
        self.worker: Any = None
        self._group: Any = None
        self._dir = ""

    def key(self, n: int) -> str:
        return (f"/job:{self.job}/replica:0/task:1/device:CPU:0;0000000000000000;"
                f"/job:{self.job}/replica:0/task:0/device:CPU:0;bench_{n};0:0")

    async def setup(self) -> None:
        from rendezvous.config import Config
        from rendezvous.daemon.daemon import Daemon

        from .daemon_workers import ClientsWorker
        from .procs import ProcGroup

        rank = self.ctx.rank
        self._dir = tempfile.mkdtemp(prefix="rendezvous-bench-")
        address = f"unix:{self._dir}/rendezvousd-{rank}.sock" if self.session else "127.0.0.1:0"
        config = Config.load({"job_name": self.job, "task_index": rank, "protocol": "grpc+mpi",
                              "local_address": address, "metrics_port": -1, "grace": 1.0})
        # Collective (the daemons' rank servers start with MPI's exchange), as the others' setup.
        self.daemon = Daemon(config, cluster=self.ctx.cluster(self.job))
        await self.daemon.start()
        self._group = ProcGroup(timeout=24 * 3600, label="rendezvous bench: ")
        self.worker = await asyncio.to_thread(self._group.worker, f"{self.name}-{rank}", ClientsWorker,
                                              f"rendezvous-bench-client-{rank}")
        await asyncio.to_thread(self.worker.call, "connect", "c", self.daemon.local_target, "blocking",
                                self.session)

    async def prepare(self, n: int, count: int, batch: int) -> None:
        await asyncio.to_thread(self.worker.call, "send_run", "c", self.key(n), n, count, batch,
                                timeout=_timeout(n, count))

    async def consume(self, n: int, count: int, batch: int) -> list[int]:
        return await asyncio.to_thread(self.worker.call, "recv_run", "c", self.key(n), n, count, batch,
                                       _timeout(n, 1), timeout=_timeout(n, count))

    async def finish(self, n: int, batch: int) -> None:
        self.daemon.server.cleanup(batch)
        rest(self.daemon.server)

    async def close(self) -> None:
        try:
            if self.worker is not None:
                await asyncio.to_thread(self.worker.ask_to_stop)
        finally:
            if self.daemon is not None:
                await self.daemon.stop(1.0)
            shutil.rmtree(self._dir, ignore_errors=True)


def _timeout(n: int, count: int) -> float:
    """Seconds ``count`` transfers of ``n`` bytes may take before the run calls them hung."""
    return 60.0 + count * (1.0 + n / 20e6)
