"""recv_many and send_many on the rank servers: key order, local and remote keys
from several producers mixed, FIFO per key, dead tensors, one deadline, all or
none (a failed batch consumes nothing: what arrived is kept for the next recv
of its key, the error names the keys that failed), and exactly once when
deadlines race the batch's transfers."""

from __future__ import annotations

import asyncio
import random
import threading

import numpy as np
import pytest

import rendezvous
from rendezvous.errors import Aborted, DeadlineExceeded, InvalidArgument, InvalidKey, UnsupportedDType

from conftest import cluster, key, run, until

pytestmark = pytest.mark.timeout(90)


def test_results_come_in_key_order_from_several_producers_and_the_own_table():
    async def main():
        async with cluster(3) as (a, b, c):
            b.send_many([(key(1, 0, f"b{i}"), np.full(3, i)) for i in range(50)], step_id=2)
            c.send_many({key(2, 0, f"c{i}"): np.full(2, 100 + i) for i in range(50)}, step_id=2)
            a.send(key(0, 0, "own"), np.arange(4), step_id=2)
            keys = [key(1, 0, f"b{i}") if i % 2 else key(2, 0, f"c{i}") for i in range(50)] + [key(0, 0, "own")]
            got = await a.recv_many(keys, step_id=2, timeout=20)
            assert [g[0] for g in got[:50]] == [i if i % 2 else 100 + i for i in range(50)]
            assert got[50].tolist() == [0, 1, 2, 3]
            left = await a.recv_many([key(1, 0, f"b{i}") for i in range(0, 50, 2)] +
                                     [key(2, 0, f"c{i}") for i in range(1, 50, 2)], step_id=2, timeout=20)
            assert len(left) == 50
            assert b.pending() == [] and c.pending() == [] and a.pending() == []
    run(main())


def test_a_key_asked_twice_gets_its_tensors_in_fifo_order_and_dead_ones_are_none():
    async def main():
        async with cluster(2) as (a, b):
            k = key(1, 0, "fifo")
            b.send_many([(k, np.array([1])), (k, np.array([2])), (key(1, 0, "dead"), None, True)])
            got = await a.recv_many([k, key(1, 0, "dead"), k], timeout=10)
            assert got[0].tolist() == [1] and got[1] is None and got[2].tolist() == [2]
            items = await a.recv_many_items([], timeout=1)
            assert items == []
    run(main())


def test_a_batch_that_fails_consumes_nothing_and_names_the_failed_keys():
    async def main():
        async with cluster(2) as (a, b):
            b.send_many([(key(1, 0, "x"), np.ones(3)), (key(1, 0, "y"), np.ones(5) * 2)], step_id=1)
            a.send(key(0, 0, "own"), np.ones(1), step_id=1)
            keys = [key(0, 0, "own"), key(1, 0, "x"), key(1, 0, "never"), key(1, 0, "y")]
            with pytest.raises(DeadlineExceeded) as info:
                await a.recv_many(keys, step_id=1, timeout=0.5)
            assert list(info.value.failures) == [key(1, 0, "never")]
            message = str(info.value)
            assert "1 failed" in message and key(1, 0, "never") in message and "what had arrived is kept" in message
            # every tensor that arrived is there for its next recv, exactly once
            again = await a.recv_many([key(0, 0, "own"), key(1, 0, "x"), key(1, 0, "y")], step_id=1, timeout=10)
            assert [g.tolist() for g in again] == [[1.0], [1.0] * 3, [2.0] * 5]
            for k in keys:
                with pytest.raises(DeadlineExceeded):
                    await a.recv(k, step_id=1, timeout=0.2)
            await until(lambda: b.pending() == [], what="the timed-out requests to be withdrawn")
            assert not a.kept.has(1, key(1, 0, "x"))
    run(main())


def test_an_abort_fails_the_batch_with_aborted():
    async def main():
        async with cluster(2) as (a, b):
            waiting = asyncio.ensure_future(a.recv_many([key(1, 0, "p"), key(1, 0, "q")], step_id=5, timeout=20))
            await until(lambda: len(b.pending()) == 2, what="both requests to reach the producer")
            b.send(key(1, 0, "p"), np.ones(2), step_id=5)
            a.abort(5, "bad batch")
            with pytest.raises(Aborted, match="bad batch"):
                await waiting
    run(main())


def test_malformed_keys_and_bad_items_are_refused_before_anything_moves():
    async def main():
        async with cluster(2) as (a, b):
            with pytest.raises(InvalidKey):
                await a.recv_many([key(1, 0, "ok"), "not a key"], timeout=1)
            with pytest.raises(UnsupportedDType):
                b.send_many([(key(1, 0, "fine"), np.ones(1)), (key(1, 0, "bad"), np.array(["text"]))])
            with pytest.raises(InvalidArgument, match="send_many takes"):
                b.send_many([(key(1, 0, "short"),)])
            assert b.pending() == []  # the good one before the bad one was not sent either
    run(main())


def test_a_cancelled_batch_keeps_what_arrived():
    async def main():
        async with cluster(2) as (a, b):
            b.send(key(1, 0, "here"), np.arange(3))
            task = asyncio.ensure_future(a.recv_many([key(1, 0, "here"), key(1, 0, "later")], timeout=20))
            await until(lambda: any(p.kind == "waiter" for p in b.pending()), what="the second request")
            await until(lambda: not any(p.kind == "tensor" for p in b.pending()), what="the first answer")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert (await a.recv(key(1, 0, "here"), timeout=10)).tolist() == [0, 1, 2]
            await until(lambda: b.pending() == [], what="the cancelled request to be withdrawn")
    run(main())


def test_racing_deadlines_deliver_every_tensor_of_a_batch_exactly_once():
    """Batches of 20 keys asked with deadlines of 2-20 ms while their tensors are
    produced; each batch is asked again until it succeeds. Every tensor is
    received once, in order, and afterwards nothing answers and nothing waits."""
    async def main():
        async with cluster(2) as (a, b):
            rng = random.Random(7)
            n, size = 400, 20
            keys = [key(1, 0, f"t{i}") for i in range(n)]

            async def produce() -> None:
                for i in range(0, n, 10):
                    b.send_many([(keys[j], np.full(64 if j % 2 else 1 << 16, j, np.int32)) for j in range(i, i + 10)])
                    await asyncio.sleep(0)

            producer = asyncio.ensure_future(produce())
            seen: list[int] = []
            for start in range(0, n, size):
                batch = keys[start:start + size]
                while True:
                    try:
                        got = await a.recv_many(batch, timeout=rng.uniform(0.002, 0.02))
                        break
                    except DeadlineExceeded:
                        continue
                seen.extend(int(g[0]) for g in got)
            await producer
            assert seen == list(range(n))
            for k in rng.sample(keys, 20):
                with pytest.raises(DeadlineExceeded):
                    await a.recv(k, timeout=0.05)
            await until(lambda: b.pending() == [], what="the timed-out requests to be withdrawn")
            assert a.pending() == [] and not a.kept.held  # nothing left anywhere
    run(main(), timeout=80)


def test_the_blocking_server_in_one_trip_each_way():
    with rendezvous.Server({"worker": ["127.0.0.1:0"]}, "worker", 0) as s:
        keys = [key(0, 0, f"k{i}") for i in range(100)]
        s.send_many([(k, np.full(2, i)) for i, k in enumerate(keys)], step_id=4)
        got = s.recv_many(keys, step_id=4, timeout=10)
        assert [int(g[0]) for g in got] == list(range(100))
        s.send(keys[0], np.ones(1), step_id=4)
        with pytest.raises(DeadlineExceeded) as info:
            s.recv_many([keys[0], keys[1]], step_id=4, timeout=0.3)
        assert list(info.value.failures) == [keys[1]]
        assert s.recv(keys[0], step_id=4, timeout=5).tolist() == [1.0]


def test_a_blocking_batch_whose_caller_gave_up_keeps_its_tensors():
    with rendezvous.Server({"worker": ["127.0.0.1:0"]}, "worker", 0) as s:
        keys = [key(0, 0, "a"), key(0, 0, "b")]
        started = threading.Event()

        def late_producer() -> None:
            started.wait(10)
            s.send_many([(k, np.ones(1)) for k in keys])

        t = threading.Thread(target=late_producer)
        t.start()
        started.set()
        got = s.recv_many(keys, timeout=10)
        t.join()
        assert len(got) == 2


def test_a_cancelled_batch_keeps_what_it_took_without_holding_it_after_delivery():
    """A batch cancelled while one key's tensor was already taken keeps it for the
    next recv, and once that recv delivered it nothing of the batch refers to it
    (the cancelled batch's frame lives on in its error's traceback; it held the
    tensor, and a daemon's pool segment under it stayed counted in its table)."""
    import gc
    import weakref

    async def main():
        async with cluster(1) as (s,):
            took, waits = key(0, 0, "took"), key(0, 0, "waits")
            arr = np.arange(16.0)
            gone = weakref.ref(arr)
            s.send(took, arr, step_id=3)
            del arr
            batch = asyncio.create_task(s.recv_many([took, waits], step_id=3))
            await until(lambda: s.table.stats()["waiters"] == 1, 10, "the batch to wait for its second key")
            batch.cancel()
            with pytest.raises(asyncio.CancelledError):
                await batch
            got = await s.recv(took, step_id=3, timeout=5)  # kept for it, in front
            assert got[3] == 3.0
            del got
            assert gone() is None, "the delivered tensor is still referred to"
            assert batch.cancelled()

    gc.disable()  # the collector would hide a reference it can free: none may be left for it
    try:
        run(main())
    finally:
        gc.enable()
