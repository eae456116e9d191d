"""stop() and the context managers deliver what was produced: by default a
stopping server keeps serving its produced tensors until each is consumed
(bounded by the grace, and said in the log), drops what is left after it
(naming the keys), and a block that raised stops at once. Every call after
stop() is UNAVAILABLE."""

from __future__ import annotations

import asyncio
import logging
import threading

import numpy as np
import pytest

import rendezvous
from rendezvous import aio
from rendezvous.errors import Unavailable
from rendezvous.lifecycle import State

from conftest import cluster, key, run, until

pytestmark = pytest.mark.timeout(60)


def test_the_default_grace_is_ten_seconds_and_a_setting():
    assert rendezvous.Config.load(env={}).grace == 10.0
    assert rendezvous.Config.load(env={"RENDEZVOUS_GRACE": "2.5"}).grace == 2.5


def test_stop_waits_for_produced_tensors_to_be_consumed(caplog):
    """The README's pattern: send, then stop. A consumer asking after stop()
    began still gets the tensor, and stop() returns once it is consumed (a
    grace of 300 s under a 60 s test timeout: it never waited the grace out)."""
    async def main():
        async with cluster(2, grace=300.0) as (a, b):
            value = np.arange(1000, dtype=np.float32)
            b.send(key(1, 0, "w"), value, step_id=3)
            b.send(key(1, 0, "w2"), value * 2, step_id=3)
            stopping = asyncio.ensure_future(b.stop())
            await until(lambda: b._state is State.STOPPING, what="the stop to begin")
            np.testing.assert_array_equal(await a.recv(key(1, 0, "w"), step_id=3, timeout=20), value)
            assert not stopping.done(), "stop() returned with a produced tensor not consumed"
            np.testing.assert_array_equal(await a.recv(key(1, 0, "w2"), step_id=3, timeout=20), value * 2)
            await stopping
            assert b.table.closed
    with caplog.at_level(logging.INFO, logger="rendezvous"):
        run(main())
    said = [r.getMessage() for r in caplog.records]
    assert any("waiting up to 300s for 2 produced tensor(s) to be consumed" in m for m in said), said
    assert not any("never consumed" in m for m in said), said


def test_what_is_left_after_the_grace_is_dropped_and_named(caplog):
    async def main():
        async with cluster(2) as (a, b):
            b.send(key(1, 0, "orphan"), np.ones(4), step_id=9)
            await b.stop(0.2)
            # the producer is gone: asking for the tensor now cannot be served
            with pytest.raises(rendezvous.RendezvousError):
                await a.recv(key(1, 0, "orphan"), step_id=9, timeout=1)
    with caplog.at_level(logging.INFO, logger="rendezvous"):
        run(main())
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("1 produced tensor(s) never consumed, dropped after a grace of 0.2s" in m
               and key(1, 0, "orphan") in m and "(step 9)" in m for m in warned), warned


def test_stop_zero_drops_at_once(caplog):
    async def main():
        async with cluster(1) as (a,):
            a.send(key(0, 0, "x"), np.ones(1))
            await a.stop(0)
    with caplog.at_level(logging.WARNING, logger="rendezvous"):
        run(main())
    assert any("dropped after a grace of 0s" in r.getMessage() for r in caplog.records)


def _consume_once_stopping(consumer: aio.Server, producer: aio.Server, k: str, got: list) -> asyncio.Future:
    async def consume() -> None:
        await until(lambda: producer._state is State.STOPPING, what="the producer's stop to begin")
        got.append(await consumer.recv(k, timeout=20))
    return asyncio.ensure_future(consume())


def test_async_with_delivers_what_the_block_produced():
    async def main():
        async with cluster(1) as (a,):
            b = aio.Server({"worker": [a.target, "127.0.0.1:0"]}, "worker", 1, grace=300.0)
            got: list = []
            async with b:
                a.update_cluster({"worker": [a.target, b.target]})
                b.send(key(1, 0, "grad"), np.full(8, 7.0))
                consumer = _consume_once_stopping(a, b, key(1, 0, "grad"), got)
            await consumer
            assert got[0].tolist() == [7.0] * 8
            assert b._state is State.STOPPED
    run(main())


def test_a_block_that_raised_stops_at_once(caplog):
    class Boom(Exception):
        pass

    async def main():
        b = aio.Server({"worker": ["127.0.0.1:0"]}, "worker", 0, grace=300.0)
        with pytest.raises(Boom):
            async with b:
                b.send(key(0, 0, "g"), np.ones(2))
                raise Boom
        assert b._state is State.STOPPED
    with caplog.at_level(logging.WARNING, logger="rendezvous"):
        run(main())
    assert any("dropped after a grace of 0s" in r.getMessage() for r in caplog.records)


def test_blocking_with_delivers_what_the_block_produced():
    consumer = rendezvous.Server({"worker": ["127.0.0.1:0"]}, "worker", 0)
    consumer.start()
    try:
        producer = rendezvous.Server({"worker": [consumer.target, "127.0.0.1:0"]}, "worker", 1, grace=300.0)
        stopping = threading.Event()
        got: list = []

        def consume() -> None:
            stopping.wait(30)
            got.append(consumer.recv(key(1, 0, "w"), timeout=20))

        reader = threading.Thread(target=consume)
        reader.start()
        with producer:
            consumer.update_cluster({"worker": [consumer.target, producer.target]})
            producer.send(key(1, 0, "w"), np.arange(5))
            stopping.set()  # the recv may now race the stop: it must still be served
        reader.join(30)
        assert got and got[0].tolist() == [0, 1, 2, 3, 4]
    finally:
        consumer.stop(0)


def test_every_call_after_stop_is_unavailable():
    server = rendezvous.Server({"worker": ["127.0.0.1:0"]}, "worker", 0)
    server.start()
    server.stop(0)
    k = key(0, 0, "late")
    calls = {
        "send": lambda: server.send(k, np.ones(1)),
        "recv": lambda: server.recv(k, timeout=1),
        "recv_item": lambda: server.recv_item(k),
        "pending": server.pending,
        "abort": lambda: server.abort(1),
        "cleanup": lambda: server.cleanup(1),
        "update_cluster": lambda: server.update_cluster({"worker": ["127.0.0.1:1"]}),
    }
    for name, call in calls.items():
        with pytest.raises(Unavailable, match="is stopped") as info:
            call()
        assert info.value.code.name == "UNAVAILABLE", name
    server.stop()  # idempotent

    async def main():
        s = aio.Server({"worker": ["127.0.0.1:0"]}, "worker", 0)
        await s.start()
        await s.stop(0)
        with pytest.raises(Unavailable):
            s.send(k, np.ones(1))
        with pytest.raises(Unavailable):
            await s.recv(k, timeout=1)
    run(main())


def test_a_recv_from_a_peer_before_the_server_serves_names_its_state():
    async def main():
        s = aio.Server({"worker": ["127.0.0.1:0", "127.0.0.1:1"]}, "worker", 0)
        with pytest.raises(Unavailable, match=r"^server /job:worker/replica:0/task:0 is new$"):
            await s.recv(key(1, 0, "early"), timeout=1)  # its producer is task 1: a peer recv
    run(main())


def test_a_stop_that_keeps_waiting_says_why_where_a_plain_script_sees_it(caplog):
    async def main():
        async with cluster(1) as (a,):
            a.send(key(0, 0, "unclaimed"), np.ones(1))
            await a.stop(1.5)
    with caplog.at_level(logging.WARNING, logger="rendezvous"):
        run(main())
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("1 produced tensor(s) not consumed yet; serving them for up to" in m
               and "stop(grace=0) drops them" in m for m in warned), warned
