"""Nothing produced is lost, and nothing is delivered twice, when recvs race
their deadlines.

A recv that gives up (deadline, cancel) must consume nothing: the tensor
stays in the producer's table, or, when its reply was already on the way,
the consumer's server keeps it for the next recv of that key and step (or
hands it to such a recv already waiting). Exactly once is checked the way
``racing.py`` describes: after the race, every key is asked again and none
may answer, and nothing may be pending anywhere.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os

import numpy as np
import pytest

from rendezvous.client import Client as BlockingClient
from rendezvous.client.aio import Client
from rendezvous.errors import DeadlineExceeded

from conftest import cluster, run, until
from racing import ask_again, paced, race, value
from test_daemon import daemons, sockdir  # noqa: F401 (a fixture)

#: tensors per race; ``make soak`` raises it
RACE = int(os.environ.get("RENDEZVOUS_RACE_TENSORS", "2000"))
#: seconds a race may take: what the default takes here, with room, and more for more
LIMIT = max(110, RACE // 20)
#: recvs one local client keeps in flight in a race: below a session's share of its
#: daemon's waiting recvs (1/8 of max_waiting_calls, 8,192), which more would exceed
#: (RESOURCE_EXHAUSTED, as documented) once ``make soak`` raises RACE past 16,000
SESSION_IN_FLIGHT = 4096

pytestmark = pytest.mark.timeout(LIMIT + 10)


def key(name: str) -> str:
    return (f"/job:worker/replica:0/task:1/device:CPU:0;0000000000000000;"
            f"/job:worker/replica:0/task:0/device:CPU:0;{name};0:0")


def node_key(src: int, dst: int, name: str) -> str:
    return (f"/job:node/replica:0/task:{src}/device:CPU:0;0000000000000000;"
            f"/job:node/replica:0/task:{dst}/device:CPU:0;{name};0:0")


def nothing_in_flight(*servers) -> bool:
    """No reply on its way to or from any of ``servers`` (aio rank servers)."""
    for server in servers:
        if any(c.replies or c.writing or c.flushing for c in server.servicer._streams):
            return False
        for peer in server.peers.values():
            stream = peer.live_stream()
            if stream is not None and (stream.pending or stream.moving):
                return False
    return True


def left_anywhere(*servers) -> list:
    """What the servers still hold of a race: produced tensors and waiters in
    their tables, and tensors kept for a next recv."""
    return [entry for s in servers for entry in s.pending()] + \
        [k for s in servers for k, q in s.kept.items() if q]


def test_racing_deadlines_deliver_every_tensor_exactly_once():
    """Rank servers: the producer sends while the consumer asks for each tensor
    with a 2-20 ms deadline, again and again until it arrives (16 B and 256 KiB
    in turn). Then every key is asked again: nothing answers, nothing is left."""
    async def main():
        async with cluster(2) as (consumer, producer):
            feeder = asyncio.ensure_future(
                paced(lambda i: producer.send(key(f"t{i}"), value(i), step_id=1), RACE))
            recv = lambda i, t: consumer.recv(key(f"t{i}"), step_id=1, timeout=t)  # noqa: E731
            tally = await race(recv, RACE, seed=7)
            await feeder
            await until(lambda: nothing_in_flight(consumer, producer), what="the replies in flight")
            await ask_again(recv, tally)
            tally.check()
            await until(lambda: nothing_in_flight(consumer, producer), what="the withdrawn requests")
            assert not left_anywhere(consumer, producer)
            # unanswered request ids are remembered only for streams that broke
            assert not any(p.in_doubt for p in consumer.peers.values())
    run(main(), LIMIT)


def daemons_settled(*ds) -> bool:
    return all(not d.local.waits and nothing_in_flight(d.server) and
               not any(s.recvs for s in d.sessions.sessions.values()) for d in ds)


async def asked_again_through(ds, recv, tally) -> None:
    """After a race through daemons ``ds``: once nothing is in flight, every key
    asked again with ``recv`` (nothing may answer), the tally checked, and
    nothing left anywhere once the withdrawn recvs settled."""
    await until(lambda: daemons_settled(*ds), what="the recvs in flight")
    await ask_again(recv, tally)
    tally.check()
    await until(lambda: daemons_settled(*ds), what="the withdrawn recvs")
    assert not left_anywhere(*(d.server for d in ds))


@pytest.mark.parametrize("nodes", [1, 2], ids=["one-daemon", "two-daemons"])
@pytest.mark.parametrize("blocking", [False, True], ids=["aio-client", "blocking-client"])
def test_racing_deadlines_through_daemons_deliver_every_tensor_exactly_once(sockdir, nodes, blocking):  # noqa: F811
    """Local clients: one produces through its daemon, another receives through
    its own (the same daemon, or a second node's), with racing deadlines."""
    n = RACE // 2

    async def main():
        async with daemons(sockdir, n=nodes) as ds, Client(ds[0].local_target) as producer:
            home = ds[-1]
            dst = nodes - 1
            k = lambda i: node_key(0, dst, f"t{i}")  # noqa: E731
            feeder = asyncio.ensure_future(paced(lambda i: producer.send(k(i), value(i), step_id=1), n))
            loop = asyncio.get_running_loop()
            if blocking:
                pool = concurrent.futures.ThreadPoolExecutor(16)
                consumer = await loop.run_in_executor(pool, BlockingClient, home.local_target)
                recv = lambda i, t: loop.run_in_executor(pool, consumer.recv, k(i), 1, t)  # noqa: E731
            else:
                consumer = await Client(home.local_target).connect()
                recv = lambda i, t: consumer.recv(k(i), step_id=1, timeout=t)  # noqa: E731
            try:
                tally = await race(recv, n, seed=nodes, in_flight=SESSION_IN_FLIGHT)
                await feeder
                await asked_again_through(ds, recv, tally)
            finally:
                if blocking:
                    consumer.close()
                    pool.shutdown()
                else:
                    await consumer.close()
    run(main(), LIMIT)


def test_local_recvs_cancelled_by_their_caller_race_replies_and_lose_nothing(sockdir):  # noqa: F811
    """The caller's own deadline (``asyncio.wait_for`` around the recv, no
    deadline given to the daemon): the daemon's wait is cancelled, and a reply
    already on its way is given back (RETURN) and kept for the next recv."""
    n = RACE // 2

    async def main():
        async with daemons(sockdir, n=2) as (d0, d1), Client(d0.local_target) as producer, \
                Client(d1.local_target) as consumer:
            k = lambda i: node_key(0, 1, f"c{i}")  # noqa: E731

            async def recv(i: int, t: float):
                try:
                    return await asyncio.wait_for(consumer.recv(k(i), step_id=1), t)
                except TimeoutError:
                    raise DeadlineExceeded(f"c{i}") from None

            feeder = asyncio.ensure_future(paced(lambda i: producer.send(k(i), value(i), step_id=1), n))
            tally = await race(recv, n, seed=11, in_flight=SESSION_IN_FLIGHT)
            await feeder
            await until(lambda: daemons_settled(d0, d1) and not consumer._link._cancelled,
                        what="the cancelled recvs' answers")
            await ask_again(recv, tally)
            tally.check()
            await until(lambda: daemons_settled(d0, d1) and not consumer._link._cancelled,
                        what="the withdrawn recvs")
            assert not left_anywhere(d0.server, d1.server)
    run(main(), LIMIT)


@pytest.mark.parametrize("chunk", [64 << 10])
def test_a_large_tensor_whose_recvs_time_out_mid_reply_is_not_lost(chunk):
    """A reply that takes longer than the recv's deadline: the first recvs give
    up while its chunks are on the way; a later recv gets the tensor."""
    async def main():
        async with cluster(2, chunk_bytes=chunk) as (consumer, producer):
            value = np.arange(4 << 20, dtype=np.float32)  # 16 MiB, 256 chunks
            producer.send(key("big"), value, step_id=2)
            misses = 0
            for _ in range(3):
                try:
                    got = await consumer.recv(key("big"), step_id=2, timeout=0.005)
                    break
                except DeadlineExceeded:
                    misses += 1
            else:
                got = await consumer.recv(key("big"), step_id=2, timeout=30)
            assert misses >= 1
            np.testing.assert_array_equal(got, value)
            # the recvs that gave up withdraw their requests: nothing is left anywhere
            await until(lambda: not producer.pending(), what="the withdrawn requests")
            assert not consumer.kept
    run(main(), 110)


def _cancel_mid_reply(consumer, producer, name: str, step: int, value) -> asyncio.Future:
    """A recv of ``name`` cancelled once the producer has started its reply."""
    async def go():
        before = producer.stats()["grpc"]["served"]
        producer.send(key(name), value, step_id=step)
        recv = asyncio.ensure_future(consumer.recv(key(name), step_id=step, timeout=30))
        await until(lambda: producer.stats()["grpc"]["served"] > before, what="the reply to start")
        recv.cancel()
        with pytest.raises(asyncio.CancelledError):
            await recv
    return go()


def test_a_cancelled_recv_whose_reply_was_on_its_way_leaves_the_tensor_for_the_next():
    async def main():
        async with cluster(2, chunk_bytes=64 << 10) as (consumer, producer):
            value = np.arange(4 << 20, dtype=np.float32)
            await _cancel_mid_reply(consumer, producer, "c", 3, value)
            await until(lambda: consumer.kept, what="the reply to be received and kept")
            np.testing.assert_array_equal(await consumer.recv(key("c"), step_id=3, timeout=10), value)
            assert not consumer.kept and not producer.pending()
    run(main(), 60)


def test_a_kept_tensor_is_dropped_with_its_step():
    async def main():
        async with cluster(2, chunk_bytes=64 << 10) as (consumer, producer):
            await _cancel_mid_reply(consumer, producer, "gone", 4, np.arange(4 << 20, dtype=np.float32))
            await until(lambda: consumer.kept, what="the reply to be received and kept")
            consumer.cleanup(4)
            producer.cleanup(4)
            assert not consumer.kept and not producer.pending()
    run(main(), 60)
