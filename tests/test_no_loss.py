"""Nothing produced is lost when a recv fails: deadlines racing replies.

A recv that gives up (deadline, cancel) must consume nothing: the tensor
stays in the producer's table, or, when its reply was already on the way,
the consumer's server keeps it for the next recv of that key and step (or
hands it to such a recv already waiting). Every produced tensor is counted.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from rendezvous.errors import DeadlineExceeded

from conftest import cluster, run, until

pytestmark = pytest.mark.timeout(120)


def key(name: str) -> str:
    return (f"/job:worker/replica:0/task:1/device:CPU:0;0000000000000001;"
            f"/job:worker/replica:0/task:0/device:CPU:0;{name};0:0")


def test_short_deadlines_racing_a_stream_of_tensors_lose_none():
    """The producer sends one tensor a millisecond; the consumer asks for each
    with a 2-20 ms deadline and, when that passes, asks again with a long one.
    Every tensor arrives exactly once, with its own value."""
    n = 300

    async def main():
        async with cluster(2) as (consumer, producer):
            rng = random.Random(7)
            timed_out = 0

            async def produce():
                for i in range(n):
                    producer.send(key(f"t{i}"), np.full(64, i, np.int64), step_id=1)
                    await asyncio.sleep(0.001)

            async def consume(i: int) -> int:
                nonlocal timed_out
                try:
                    got = await consumer.recv(key(f"t{i}"), step_id=1, timeout=rng.uniform(0.002, 0.02))
                except DeadlineExceeded:
                    timed_out += 1
                    got = await consumer.recv(key(f"t{i}"), step_id=1, timeout=30)
                return int(got[0]) if (got == got[0]).all() else -1

            feeder = asyncio.ensure_future(produce())
            got = await asyncio.gather(*(consume(i) for i in range(n)))
            await feeder
            assert got == list(range(n))
            assert timed_out > 0, "no deadline passed: the race was not exercised"
            # nothing left behind on either side
            assert not producer.pending() and not consumer._undelivered
    run(main(), 110)


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
            assert not consumer._undelivered
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
            await until(lambda: consumer._undelivered, what="the reply to be received and kept")
            np.testing.assert_array_equal(await consumer.recv(key("c"), step_id=3, timeout=10), value)
            assert not consumer._undelivered and not producer.pending()
    run(main(), 60)


def test_a_kept_tensor_is_dropped_with_its_step():
    async def main():
        async with cluster(2, chunk_bytes=64 << 10) as (consumer, producer):
            await _cancel_mid_reply(consumer, producer, "gone", 4, np.arange(4 << 20, dtype=np.float32))
            await until(lambda: consumer._undelivered, what="the reply to be received and kept")
            consumer.cleanup(4)
            producer.cleanup(4)
            assert not consumer._undelivered and not producer.pending()
    run(main(), 60)
