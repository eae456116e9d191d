"""recv_many and send_many through rendezvousd, with both local clients: in key
order from this node and another, all or none (what arrived goes back to the
daemon for the next recv of its key), exactly once with racing deadlines, and
over a TCP local address (no session socket) one key at a time."""

from __future__ import annotations

import asyncio
import concurrent.futures

import numpy as np
import pytest

from rendezvous.client import Client as BlockingClient
from rendezvous.client.aio import Client
from rendezvous.errors import DeadlineExceeded

from conftest import run, until
from racing import paced, race_batches, value
from test_daemon import daemons, sockdir  # noqa: F401 (a fixture)
from test_no_loss import asked_again_through, daemons_settled, left_anywhere, node_key

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("blocking", [False, True], ids=["aio-client", "blocking-client"])
def test_a_batch_through_two_daemons_in_key_order_and_all_or_none(sockdir, blocking):  # noqa: F811
    async def main():
        async with daemons(sockdir, n=2) as (d0, d1), Client(d0.local_target) as c0, Client(d1.local_target) as c1:
            await c1.send_many([(node_key(1, 0, f"r{i}"), np.full(3 + i % 2 * 40000, i)) for i in range(30)],
                               step_id=1)
            await c0.send_many({node_key(0, 0, "own"): np.arange(5)}, step_id=1)
            keys = [node_key(1, 0, f"r{i}") for i in range(30)] + [node_key(0, 0, "own")]
            loop = asyncio.get_running_loop()
            if blocking:
                pool = concurrent.futures.ThreadPoolExecutor(2)
                sync = await loop.run_in_executor(pool, BlockingClient, d0.local_target)

                async def recv_many(ks, timeout):
                    return await loop.run_in_executor(pool, lambda: sync.recv_many(ks, 1, timeout))
            else:
                async def recv_many(ks, timeout):
                    return await c0.recv_many(ks, step_id=1, timeout=timeout)
            try:
                got = await recv_many(keys, 20)
                assert [int(g[0]) for g in got[:30]] == list(range(30)) and got[30].tolist() == [0, 1, 2, 3, 4]
                # the other node's daemon answered its 15 small tensors in group replies
                # (the 320 KB ones are above the fusion threshold: one reply each)
                assert sum(c["served_fused"] for p, c in d1.server.stats().items() if p != "gpu") == 15
                del got
                # a batch with a key nobody sends fails whole; what arrived goes back
                await c1.send_many([(node_key(1, 0, "a"), np.ones(2)), (node_key(1, 0, "b"), np.ones(70000))],
                                   step_id=1)
                with pytest.raises(DeadlineExceeded) as info:
                    await recv_many([node_key(1, 0, "a"), node_key(1, 0, "missing"), node_key(1, 0, "b")], 0.5)
                assert list(info.value.failures) == [node_key(1, 0, "missing")]
                await until(lambda: daemons_settled(d0, d1), what="the batch's withdrawn recvs")
                again = await recv_many([node_key(1, 0, "a"), node_key(1, 0, "b")], 20)
                assert again[0].tolist() == [1.0, 1.0] and again[1].shape == (70000,)
                del again
                await until(lambda: daemons_settled(d0, d1), what="the recvs in flight")
                assert not left_anywhere(d0.server, d1.server)
            finally:
                if blocking:
                    sync.close()
                    pool.shutdown()
    run(main())


@pytest.mark.parametrize("blocking", [False, True], ids=["aio-client", "blocking-client"])
def test_racing_deadlines_deliver_every_tensor_of_a_batch_through_daemons_exactly_once(sockdir, blocking):  # noqa: F811
    n = 400

    async def main():
        async with daemons(sockdir, n=2) as ds, Client(ds[0].local_target) as producer:
            k = lambda i: node_key(0, 1, f"t{i}")  # noqa: E731
            feeder = asyncio.ensure_future(paced(lambda i: producer.send(k(i), value(i), step_id=1), n))
            loop = asyncio.get_running_loop()
            pool = concurrent.futures.ThreadPoolExecutor(8)
            if blocking:
                consumer = await loop.run_in_executor(pool, BlockingClient, ds[1].local_target)
                many = lambda ids, t: loop.run_in_executor(pool, consumer.recv_many,  # noqa: E731
                                                           [k(i) for i in ids], 1, t)
                one = lambda i, t: loop.run_in_executor(pool, consumer.recv, k(i), 1, t)  # noqa: E731
            else:
                consumer = await Client(ds[1].local_target).connect()
                many = lambda ids, t: consumer.recv_many([k(i) for i in ids], step_id=1, timeout=t)  # noqa: E731
                one = lambda i, t: consumer.recv(k(i), step_id=1, timeout=t)  # noqa: E731
            try:
                tally = await race_batches(many, n, seed=5)
                await feeder
                await asked_again_through(ds, one, tally)
            finally:
                if blocking:
                    consumer.close()
                else:
                    await consumer.close()
                pool.shutdown()
    run(main(), 110)


def test_over_a_tcp_local_address_a_batch_is_one_call_and_a_failed_one_takes_nothing(sockdir):  # noqa: F811
    async def main():
        async with daemons(sockdir, n=1, local_address="127.0.0.1:0") as (d,):
            async with Client(d.local_target) as c:
                assert not c.session
                await c.send_many([(node_key(0, 0, "x"), np.arange(3)), (node_key(0, 0, "y"), np.arange(4))])
                assert [g.tolist() for g in await c.recv_many([node_key(0, 0, "x"), node_key(0, 0, "y")],
                                                              timeout=10)] == [[0, 1, 2], [0, 1, 2, 3]]
                await c.send(node_key(0, 0, "x"), np.arange(2))
                await c.send(node_key(0, 0, "x"), np.arange(5))
                with pytest.raises(DeadlineExceeded) as info:
                    await c.recv_many([node_key(0, 0, "x"), node_key(0, 0, "none")], timeout=0.5)
                assert list(info.value.failures) == [node_key(0, 0, "none")]
                assert "nothing of the batch was taken" in str(info.value)
                # the daemon kept what had arrived, in its order
                assert (await c.recv(node_key(0, 0, "x"), timeout=10)).tolist() == [0, 1]
                assert (await c.recv(node_key(0, 0, "x"), timeout=10)).tolist() == [0, 1, 2, 3, 4]
                assert await c.pending() == []
    run(main())
