from __future__ import annotations

import os

# The test process is a program: it keeps gRPC's core (connection events such
# as a peer's GOAWAY, logged at INFO) off its output, as the commands do. Read
# when gRPC initializes, so before anything imports it.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import asyncio  # noqa: E402
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator

import pytest
from hypothesis import HealthCheck, settings

import rendezvous
from rendezvous import aio
from rendezvous.keys import make_key


# Hypothesis: no per-example deadline (a busy 2-core machine runs live servers:
# time is not what the properties test); each property sets its own max_examples.
settings.register_profile("rendezvous", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("rendezvous")


# Settings of the test run itself, read by the tests: they stay.
_TEST_SETTINGS = {"RENDEZVOUS_MPIEXEC", "RENDEZVOUS_SOAK_OPS", "RENDEZVOUS_RACE_TENSORS"}


@pytest.fixture(autouse=True)
def _isolated_environment(monkeypatch):
    """The developer's shell must not reach into the servers a test builds: a
    RENDEZVOUS_TOKEN, TLS files or chunk sizes exported there would change what
    every in-process server does (and the children it starts inherit the
    environment). Each test starts from none of them."""
    for name in list(os.environ):
        if (name.startswith("RENDEZVOUS_") and name not in _TEST_SETTINGS) or \
                name in ("MPI_DISABLED", "MPI_OPTIMAL_PATH"):
            monkeypatch.delenv(name)


def dev(job: str, task: int, kind: str = "CPU") -> str:
    return f"/job:{job}/replica:0/task:{task}/device:{kind}:0"


def key(src: int, dst: int, name: str, job: str = "worker") -> str:
    """A key produced by task ``src`` for task ``dst`` of ``job``."""
    return make_key(dev(job, src), dev(job, dst), name).format()


@contextlib.asynccontextmanager
async def cluster(n: int = 2, job: str = "worker", **overrides) -> AsyncIterator[list[aio.Server]]:
    """``n`` started aio servers in this loop, on OS-chosen loopback ports."""
    spec = {job: ["127.0.0.1:0"] * n}
    servers = [aio.Server(spec, job, i, **overrides) for i in range(n)]
    try:
        for s in servers:
            await s.start()
        full = {job: [s.target for s in servers]}
        for s in servers:
            s.update_cluster(full)
        yield servers
    finally:
        for s in servers:
            await s.stop(0)


@contextlib.contextmanager
def two_servers() -> Iterator[tuple[rendezvous.Server, rendezvous.Server]]:
    """Two started blocking servers (tasks 0 and 1 of job "worker") on
    OS-chosen loopback ports, each knowing the other's address."""
    spec = {"worker": ["127.0.0.1:0", "127.0.0.1:0"]}
    a = rendezvous.Server(spec, "worker", 0)
    b = rendezvous.Server(spec, "worker", 1)
    with a, b:
        full = {"worker": [a.target, b.target]}
        a.update_cluster(full)
        b.update_cluster(full)
        yield a, b


def run(coro, timeout: float = 60.0):
    """Run a coroutine on a fresh loop with a hard time limit."""
    async def guarded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(guarded())



async def until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """Wait for ``predicate()`` to hold, checking on each loop turn (a condition
    wait, not a timed sleep); fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


def free_ports(n: int = 1) -> list[int]:
    """``n`` distinct ports nobody listens on now, chosen by the OS (bound to
    port 0 together, read, closed): for programs that must be told a port
    before they start."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """One port, as :func:`free_ports`."""
    return free_ports(1)[0]
