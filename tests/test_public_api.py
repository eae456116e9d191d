"""One behaviour suite for the four public classes, through their Protocols.

``rendezvous.Server``, ``rendezvous.aio.Server``, ``rendezvous.client.Client``
and ``rendezvous.client.aio.Client`` meet the Protocols of
:mod:`rendezvous.api` (mypy checks that, in ``make test``). Each test here
runs the same behaviour against all four, calling only the methods their
Protocol names, each as the Protocol declares it (awaited where it says
``async``): the servers as a producing rank and a consuming one, the clients
as a producing and a consuming client of one daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

import rendezvous
from rendezvous import api
from rendezvous.client import Client
from rendezvous.client.aio import Client as AsyncClient
from rendezvous.errors import Aborted, DeadlineExceeded, InvalidKey
from rendezvous.keys import canonical_key
from rendezvous.items import Received

from conftest import cluster, key as rank_key, run
from test_daemon import daemons, key as node_key, no_leaked_segments, sockdir  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(90)

#: a recv that must time out waits this long
SHORT = 0.3
#: a recv that must succeed waits at most this long
LONG = 20.0


class Side:
    """One object of a public class, driven from the test's coroutine through
    its Protocol's methods only: a blocking class's in a worker thread (they
    block), the asyncio ones' on this loop (the aio server's must run there),
    awaited exactly where the Protocol declares them ``async``."""

    def __init__(self, obj: Any, protocol: type, blocking: bool) -> None:
        self.obj, self.protocol, self.blocking = obj, protocol, blocking

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        declared = None if name.startswith("_") else getattr(self.protocol, name, None)
        if declared is None:
            raise AttributeError(f"{self.protocol.__name__} has no method {name}")
        method = getattr(self.obj, name)
        awaited = inspect.iscoroutinefunction(declared)

        async def call(*args: Any, **kwargs: Any) -> Any:
            result = await asyncio.to_thread(method, *args, **kwargs) if self.blocking else method(*args, **kwargs)
            if awaited:
                return await result
            assert not inspect.isawaitable(result), f"{name} is not awaited in {self.protocol.__name__}"
            return result
        return call


class Pair(NamedTuple):
    producer: Side
    consumer: Side
    key: Callable[[str], str]  # a key produced by the producer for the consumer


@contextlib.asynccontextmanager
async def blocking_servers(_: Path) -> AsyncIterator[Pair]:
    spec = {"worker": ["127.0.0.1:0"] * 2}
    servers = [rendezvous.Server(spec, "worker", i) for i in range(2)]
    started: list[rendezvous.Server] = []
    try:
        for s in servers:
            await asyncio.to_thread(s.start)
            started.append(s)
        for s in servers:
            await asyncio.to_thread(s.update_cluster, {"worker": [s.target for s in servers]})
        yield Pair(Side(servers[0], api.Rendezvous, True), Side(servers[1], api.Rendezvous, True),
                   lambda name: rank_key(0, 1, name))
    finally:
        for s in started:
            await asyncio.to_thread(s.stop, 0)


@contextlib.asynccontextmanager
async def asyncio_servers(_: Path) -> AsyncIterator[Pair]:
    async with cluster(2) as (producer, consumer):
        yield Pair(Side(producer, api.LoopRendezvous, False), Side(consumer, api.LoopRendezvous, False),
                   lambda name: rank_key(0, 1, name))


@contextlib.asynccontextmanager
async def blocking_clients(sockdir: Path) -> AsyncIterator[Pair]:
    async with daemons(sockdir) as (d,):
        clients: list[Client] = []
        try:
            for _ in range(2):
                clients.append(await asyncio.to_thread(Client, d.local_target))
            yield Pair(Side(clients[0], api.Rendezvous, True), Side(clients[1], api.Rendezvous, True),
                       lambda name: node_key(0, 0, name))
        finally:
            for c in clients:
                await asyncio.to_thread(c.close)


@contextlib.asynccontextmanager
async def asyncio_clients(sockdir: Path) -> AsyncIterator[Pair]:
    async with daemons(sockdir) as (d,), AsyncClient(d.local_target) as a, AsyncClient(d.local_target) as b:
        yield Pair(Side(a, api.AsyncRendezvous, False), Side(b, api.AsyncRendezvous, False),
                   lambda name: node_key(0, 0, name))


KINDS = {"rendezvous.Server": blocking_servers, "rendezvous.aio.Server": asyncio_servers,
         "rendezvous.client.Client": blocking_clients, "rendezvous.client.aio.Client": asyncio_clients}


#: builds one of the four as a producer and a consumer
MakePair = Callable[[], contextlib.AbstractAsyncContextManager[Pair]]


@pytest.fixture(params=list(KINDS))
def pair(request: pytest.FixtureRequest, sockdir: Path) -> MakePair:  # noqa: F811 (test_daemon's fixture)
    return lambda: KINDS[request.param](sockdir)


def exercise(pair: MakePair, body: Callable[[Side, Side, Callable[[str], str]], Awaitable[None]]) -> None:
    async def main() -> None:
        async with pair() as (producer, consumer, key):
            await body(producer, consumer, key)
    run(main(), timeout=75)


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout: float = LONG) -> None:
    """Wait until ``check()`` holds, asking again each few milliseconds (a
    condition wait); fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not await check():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def rows(side: Side, key: str, step_id: int) -> list[tuple[str, int]]:
    """(kind, count) of each of ``side.pending()``'s rows for ``key`` in ``step_id``."""
    return [(r.kind, r.count) for r in await side.pending() if r.key == canonical_key(key) and r.step_id == step_id]


def same(got: Any, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray), type(got)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape)
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------- the behaviours


def test_a_tensor_sent_is_received_with_its_dtype_and_shape(pair):
    async def body(p: Side, c: Side, key: Callable[[str], str]) -> None:
        for i, value in enumerate([np.arange(24, dtype=np.float32).reshape(2, 3, 4),
                                   np.array([[1, -2], [3, -4]], dtype=np.int16),
                                   np.arange(1 << 17, dtype=np.float64)]):  # 1 MiB: the large-tensor paths
            await p.send(key(f"t{i}"), value, step_id=1)
            same(await c.recv(key(f"t{i}"), step_id=1, timeout=LONG), value)
    exercise(pair, body)


def test_a_recv_waits_for_a_later_send(pair):
    async def body(p: Side, c: Side, key: Callable[[str], str]) -> None:
        value = np.arange(10, dtype=np.int64)
        waiting = asyncio.ensure_future(c.recv(key("later"), step_id=2, timeout=LONG))
        await eventually(lambda: _has(p, key("later"), 2, "waiter"), "the recv waiting at the producer")
        assert not waiting.done()
        await p.send(key("later"), value, step_id=2)
        same(await waiting, value)
    exercise(pair, body)


def test_recv_item_of_a_dead_tensor(pair):
    async def body(p: Side, c: Side, key: Callable[[str], str]) -> None:
        await p.send(key("dead"), None, step_id=3, is_dead=True)
        assert await c.recv_item(key("dead"), step_id=3, timeout=LONG) == Received(None, True)
        value = np.ones(3, np.uint8)
        await p.send(key("alive"), value, step_id=3)
        item = await c.recv_item(key("alive"), step_id=3, timeout=LONG)
        assert item.is_dead is False
        same(item.value, value)
    exercise(pair, body)


def test_send_many_and_recv_many_in_key_order(pair):
    async def body(p: Side, c: Side, key: Callable[[str], str]) -> None:
        values = {name: np.full((2, i + 1), i, dtype=dtype)
                  for i, (name, dtype) in enumerate([("a", np.float32), ("b", np.int64), ("c", np.uint8)])}
        await p.send_many([(key(name), value) for name, value in values.items()], step_id=4)
        order = ["c", "a", "b"]  # not the order they were sent in
        got = await c.recv_many([key(name) for name in order], step_id=4, timeout=LONG)
        assert len(got) == 3
        for name, value in zip(order, got):
            same(value, values[name])
        await p.send_many({key("d"): np.arange(3), key("e"): np.arange(4.0)}, step_id=4)
        await p.send_many([(key("f"), None, True)], step_id=4)
        items = await c.recv_many_items([key("f"), key("e"), key("d")], step_id=4, timeout=LONG)
        assert [item.is_dead for item in items] == [True, False, False] and items[0].value is None
        same(items[1].value, np.arange(4.0))
        same(items[2].value, np.arange(3))
    exercise(pair, body)


def test_a_recv_that_times_out_leaves_nothing_behind(pair):
    async def body(p: Side, c: Side, key: Callable[[str], str]) -> None:
        k, value = key("late"), np.arange(5, dtype=np.int32)
        with pytest.raises(DeadlineExceeded):
            await c.recv(k, step_id=5, timeout=SHORT)
        await eventually(lambda: _none(p, k, 5), "the recv that gave up to leave the producer")
        await p.send(k, value, step_id=5)
        same(await c.recv(k, step_id=5, timeout=LONG), value)  # the recv that gave up took nothing
        with pytest.raises(DeadlineExceeded):  # and it arrives once
            await c.recv(k, step_id=5, timeout=SHORT)
        await eventually(lambda: _none(p, k, 5), "the producer to hold nothing of the key")
    exercise(pair, body)


def test_abort_fails_a_waiting_recv(pair):
    async def body(p: Side, c: Side, key: Callable[[str], str]) -> None:
        waiting = asyncio.ensure_future(c.recv(key("never"), step_id=6, timeout=LONG))
        await eventually(lambda: _has(p, key("never"), 6, "waiter"), "the recv waiting at the producer")
        await c.abort(6, "step 6 is over")
        with pytest.raises(Aborted, match="step 6 is over"):
            await waiting
        with pytest.raises(Aborted):  # and every later recv of the step
            await c.recv(key("later"), step_id=6, timeout=LONG)
    exercise(pair, body)


def test_a_malformed_key_is_invalid(pair):
    async def body(p: Side, c: Side, key: Callable[[str], str]) -> None:
        with pytest.raises(InvalidKey):
            await p.send("not a key", np.ones(2), step_id=7)
        with pytest.raises(InvalidKey):
            await c.recv("not a key", step_id=7, timeout=LONG)
        with pytest.raises(InvalidKey):
            await c.recv(key("x").replace("/job:", "/jbo:", 1), step_id=7, timeout=LONG)
        await p.send(key("fine"), np.ones(2), step_id=7)  # nothing broke
        same(await c.recv(key("fine"), step_id=7, timeout=LONG), np.ones(2))
    exercise(pair, body)


def test_pending_lists_a_produced_tensor(pair):
    async def body(p: Side, c: Side, key: Callable[[str], str]) -> None:
        k = key("kept")
        assert await rows(p, k, 8) == []
        await p.send(k, np.ones(3), step_id=8)
        await p.send(k, np.zeros(3), step_id=8)
        assert await rows(p, k, 8) == [("tensor", 2)]
        (row,) = [r for r in await p.pending() if r.key == canonical_key(k)]
        assert 0 <= row.oldest_age_s < LONG
        same(await c.recv(k, step_id=8, timeout=LONG), np.ones(3))  # the oldest first
        assert await rows(p, k, 8) == [("tensor", 1)]
        same(await c.recv(k, step_id=8, timeout=LONG), np.zeros(3))
        assert await rows(p, k, 8) == []
    exercise(pair, body)


def test_stats_count_what_is_received(pair):
    async def body(p: Side, c: Side, key: Callable[[str], str]) -> None:
        counts = [_total(await c.stats())]
        for i in range(2):
            await p.send(key(f"s{i}"), np.arange(100), step_id=9)
            await c.recv(key(f"s{i}"), step_id=9, timeout=LONG)
            counts.append(_total(await c.stats()))
        assert counts[0] < counts[1] < counts[2], counts
    exercise(pair, body)


# ---------------------------------------------------------------------------- helpers of the checks


async def _has(side: Side, key: str, step_id: int, kind: str) -> bool:
    return any(k == kind for k, _ in await rows(side, key, step_id))


async def _none(side: Side, key: str, step_id: int) -> bool:
    return await rows(side, key, step_id) == []


def _total(counts: api.Counts) -> int:
    """Every count of ``stats()``, a server's nested per path or a client's flat, added up."""
    total = 0
    for value in counts.values():
        assert isinstance(value, int) or all(isinstance(v, int) for v in value.values()), value
        total += value if isinstance(value, int) else sum(value.values())
    return total
