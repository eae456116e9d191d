"""Run a function on several local ranks, each a separate OS process on loopback.

Each rank binds ``127.0.0.1:0`` (the OS picks the port), reports its address to
the parent through a pipe, and gets the whole cluster back before the function
runs, so nothing races for a port. If any rank fails or the time limit passes,
every rank is killed and the parent raises: nothing hangs.

    results = run_local(fn, {"ps": 1, "worker": 2}, args=(...))

``fn(server, *args)`` runs with a started blocking :class:`rendezvous.Server`;
its return value (picklable) is collected per task.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import time
import os
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from rendezvous.errors import DeadlineExceeded, RendezvousError
from rendezvous.keys import TaskName

from .blocking import Server
# offered here too: the daemon, the programs and the examples import them from this module
from .launcher import RANK_VARIABLES, SIZE_VARIABLES, launcher_rank

__all__ = ["run_local", "RankFailed", "launcher_rank", "RANK_VARIABLES", "SIZE_VARIABLES"]


class RankFailed(RendezvousError):
    """A rank raised; the message holds its traceback."""


def _rank_main(conn: Any, fn: Callable[..., Any], jobs: dict[str, int], job: str, index: int,
               args: tuple, protocol: str, overrides: dict[str, Any], env: dict[str, str]) -> None:
    os.environ.update(env)
    server = None
    try:
        cluster = {j: ["127.0.0.1:0"] * n for j, n in jobs.items()}
        server = Server(cluster, job, index, protocol, **overrides)
        server.start()
        conn.send(("address", server.target))
        kind, full = conn.recv()
        server.update_cluster(full)
        result = fn(server, *args)
        conn.send(("result", result))
        # Stay up until the parent says every rank is done: peers may still
        # be fetching tensors this rank produced.
        conn.recv()
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
    finally:
        if server is not None:
            server.stop(1.0)


def run_local(fn: Callable[..., Any], jobs: Mapping[str, int], *, args: tuple = (),
              timeout: float = 120.0, protocol: str = "grpc",
              env: Mapping[str, str] | None = None, **overrides: Any) -> dict[str, Any]:
    """Run ``fn`` on every task of ``jobs``; {"/job:J/replica:0/task:T": result}."""
    ctx = mp.get_context("spawn")
    ranks = []
    for job in sorted(jobs):
        for index in range(jobs[job]):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, name=f"{job}:{index}",
                               args=(child, fn, dict(jobs), job, index, args, protocol, overrides, dict(env or {})))
            proc.start()
            child.close()
            ranks.append((job, index, parent, proc))
    deadline = time.monotonic() + timeout

    def gather(what: str) -> dict[str, Any]:
        """One message from every rank; the first failure (or silence) ends the run."""
        waiting = {conn: f"/job:{job}/replica:0/task:{index}" for job, index, conn, _ in ranks}
        got: dict[str, Any] = {}
        while waiting:
            remaining = deadline - time.monotonic()
            ready = mp_connection.wait(list(waiting), timeout=max(0.0, remaining))
            if not ready:
                raise DeadlineExceeded(
                    f"no {what} within {timeout:g}s from: {', '.join(sorted(waiting.values()))}")
            for conn in (c for c in ready if isinstance(c, mp_connection.Connection)):  # (all are)
                name = waiting.pop(conn)
                try:
                    kind, value = conn.recv()
                except EOFError:
                    raise RankFailed(f"rank {name} died before sending its {what}") from None
                if kind == "error":
                    raise RankFailed(f"rank {name} failed:\n{value}")
                got[name] = value
        return got

    try:
        addresses: dict[str, list[str]] = {j: [""] * n for j, n in jobs.items()}
        for name, address in gather("address").items():
            task = TaskName.parse(name)
            addresses[task.job][task.task] = address
        for _, _, conn, _ in ranks:
            conn.send(("cluster", addresses))
        results = gather("result")
        for _, _, conn, _ in ranks:
            conn.send(("exit", None))
        for _, _, _, proc in ranks:
            proc.join(max(1.0, deadline - time.monotonic()))
        return results
    finally:
        for _, _, conn, proc in ranks:
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()

