"""A rank server's MPI half: :class:`MpiRank`, its link to the other ranks of
its MPI job (a :class:`~rendezvous.transport.link.RankLink`).

Under ``protocol="grpc+mpi"`` (and without ``MPI_DISABLED``) a rank server
holds one ``MpiRank`` as its link and knows MPI only through it: it is made when the
server is (joining the MPI job: ``MPI_Init``), started when the server
starts (the progress engine, the collective exchange of every rank's task
and address, the MPI data plane, and with ``mpi_requests`` the request
path), described in the start-up line, counted in ``stats()``, and closed
when the server stops. Everything MPI (mpi4py's import included) stays
behind it.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from rendezvous.config import Config
from rendezvous.keys import TaskName
from rendezvous.transport.link import RankParts

from .control import MpiRequests
from .engine import ProgressEngine
from .plane import MpiPlane
from .world import MpiWorld

__all__ = ["MpiRank"]

log = logging.getLogger("rendezvous.mpi")

T = TypeVar("T")


class MpiRank:
    """This rank's part of its MPI job. ``join`` at construction, ``start`` (a
    collective: every rank of the job reaches it), ``close_requests`` while
    the server drains, ``stop`` at the end."""

    def __init__(self, world: MpiWorld, config: Config) -> None:
        self.world = world
        self.config = config
        self.engine: ProgressEngine | None = None
        self.plane: MpiPlane | None = None
        self.requests: MpiRequests | None = None
        #: the task of every rank of the job, once started
        self.ranks: dict[TaskName, int] = {}
        #: a caller's wait goes through :meth:`attending` (the engine may poll meanwhile)
        self.attends = True

    @classmethod
    def join(cls, config: Config) -> "MpiRank":
        """Join the MPI job (initializing MPI at the thread level the engine needs)."""
        return cls(MpiWorld.join(), config)

    async def start(self, task: TaskName, address: str, incarnation: int,
                    parts: RankParts) -> dict[TaskName, tuple[str, int]]:
        """Start the progress engine, exchange every rank's task, address and
        incarnation (the job's collective), and make the MPI data plane
        (``self.plane``, for the server's planes) and, with ``mpi_requests``, the
        request path served by ``parts.servicer``. Returns each task of the job
        with its address and incarnation. On failure everything started is
        stopped again."""
        cfg, loop_polls, servicer, buffers = self.config, parts.loop_polls, parts.servicer, parts.buffers
        engine = ProgressEngine(poll_min_us=cfg.mpi_poll_min_us, poll_max_us=cfg.mpi_poll_max_us)
        # The aio server's loop polls every transfer while traffic is expected
        # (small transfers at MPI latency, and a large one moves as fast as it
        # is polled), with gRPC requests or MPI ones. With ``loop_polls="remote"``
        # it polls only transfers with ranks MPI reaches over the network (each
        # progress call moves only what the socket takes); with ``"attended"``
        # (the blocking Server) those, and with requests over MPI every
        # transfer while a caller waits on the loop (see ProgressEngine.attend);
        # the MPI thread polls the rest. See aio.Server.poll_on_loop.
        remote_only = loop_polls in ("remote", "attended")
        engine.start(loop_polls=bool(loop_polls), loop_peers=frozenset() if remote_only else None)
        if loop_polls == "attended" and cfg.mpi_requests:
            engine.attended = 0
        self.engine = engine
        # mpi4py finalizes MPI at exit; atexit runs last-registered first, so
        # this stops the engine before that even if stop() is never called.
        atexit.register(engine.stop, 5.0)
        try:
            world = self.world
            found = await engine.call(lambda: world.exchange(task, address, incarnation))
            engine.attach(world.comm)
            if world.single_copy:  # this node's large messages need no polling to move
                engine.copied_peers = frozenset(range(world.size)) - world.remote_ranks - {world.rank}
            if remote_only:
                engine.loop_peers = world.remote_ranks
            self.ranks = {t: where.rank for t, where in found.items()}
            self.plane = MpiPlane(world, engine, cfg, parts.stats, buffers=buffers, devices=parts.devices)
            self.plane.delivered = parts.delivered
            self.plane.aborted = parts.aborted
            if cfg.mpi_requests:
                self.requests = MpiRequests(engine, world.control, world.rank, servicer, buffers=buffers)
                self.requests.start()
                # a tensor produced here is likely asked for soon: an engine idle
                # between steps (probing every idle_poll_ms) is attentive again
                servicer.table.on_send = engine.touch
        except BaseException:
            await self.stop(0)
            raise
        return {t: (where.address, where.incarnation) for t, where in found.items()}

    def open_call(self, task: TaskName) -> Callable[[], Any] | None:
        """How a peer client opens its stream to ``task`` over MPI (requests over
        MPI, and ``task`` a rank of this job), or None: over gRPC."""
        requests, rank = self.requests, self.ranks.get(task)
        if requests is None or rank is None:
            return None
        return lambda: requests.open_call(rank)

    async def attending(self, waited: Awaitable[T]) -> T:
        """``await waited`` for a caller blocked on it in another thread: with the
        engine attended (the blocking Server, requests over MPI) the loop polls
        every transfer meanwhile (see ProgressEngine.attend)."""
        engine = self.engine
        if engine is None or engine.attended is None:
            return await waited
        engine.attend(1)
        try:
            return await waited
        finally:
            engine.attend(-1)

    def describe(self) -> str:
        """The MPI part of the server's start-up line."""
        cfg, world = self.config, self.world
        src = cfg.sources.get("mpi_optimal_path", "default")
        setting = f"MPI_OPTIMAL_PATH={int(cfg.mpi_optimal_path)} ({'unset, default' if src == 'default' else src})"
        line = (f"MPI rank {world.rank}/{world.size} ({world.library}), thread level {world.thread_level}; "
                f"{setting}, threshold {cfg.mpi_threshold} B; requests over "
                f"{'MPI (RENDEZVOUS_MPI_REQUESTS=1)' if cfg.mpi_requests else 'gRPC'}")
        if world.single_copy is not None:
            line += ("; large messages within this node: one copy by the receiver" if world.single_copy else
                     "; large messages within this node: no single-copy path (they move only as both ranks poll; "
                     "run rendezvous doctor)")
        plane = self.plane
        if plane is not None:
            how = "GPU buffers to MPI directly" if plane.cuda_aware else \
                f"GPU tensors staged through pinned host memory in {cfg.gpu_staging_chunk_bytes >> 10} KiB chunks"
            line += f"; CUDA-aware MPI: {'yes' if plane.cuda_aware else 'no'} ({plane.cuda_aware_source}): {how}"
        return line

    def stats(self) -> dict[str, int]:
        """``in_flight`` (MPI operations posted and not complete) and ``cuda_aware``."""
        return {"in_flight": self.engine.in_flight if self.engine is not None else 0,
                "cuda_aware": int(bool(self.plane is not None and self.plane.cuda_aware))}

    def rest(self) -> None:
        """The engine goes to its idle pace at once (see ProgressEngine.rest)."""
        if self.engine is not None:
            self.engine.rest()

    async def close_requests(self) -> None:
        """End the MPI request streams (the server is draining: their replies are written)."""
        if self.requests is not None:
            await self.requests.close()

    async def stop(self, grace: float) -> None:
        """Let sends in flight finish (their consumers are posting receives) for up to
        ``grace`` seconds, then stop the engine: before MPI is finalized at exit."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        if self.requests is not None and self.requests.servicer.table.on_send == engine.touch:
            self.requests.servicer.table.on_send = None
        await asyncio.get_running_loop().run_in_executor(None, engine.stop, grace)
        atexit.unregister(engine.stop)
