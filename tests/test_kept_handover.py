"""A tensor kept for "the next recv of its key" (a batch that took it and then
was cancelled, a late answer a local client gives back with RETURN) goes at
once to a recv of that key and step that is already waiting, wherever it
waits: on the consumer's stream to the producer (its request is then
cancelled there), in this rank's own table, at the producer for a remote
consumer, and through daemons. Before, the waiting recv sat out its whole
deadline (forever without one) while a recv asked a moment later got the
tensor at once.

Each waiting recv has a long deadline; the test gives it a few seconds to
complete (a wait on the task, not a timing), then asks every key again:
nothing may answer, nothing may be left anywhere."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rendezvous.client.aio import Client
from rendezvous.client.core import LocalOp
from rendezvous.errors import DeadlineExceeded
from rendezvous.items import Received
from rendezvous.local.frames import Kind
from rendezvous.local.messages import returned
from rendezvous.v1 import local_pb2 as lpb

from conftest import cluster, key, run, until
from test_daemon import daemons, sockdir  # noqa: F401 (a fixture)
from test_daemon import key as node_key
from test_no_loss import daemons_settled, left_anywhere, nothing_in_flight

pytestmark = pytest.mark.timeout(90)

#: the waiting recvs' own deadline: they must be answered long before it
LONG = 60.0
#: how long a waiting recv is given to get the kept tensor
PROMPTLY = 10.0


def _at(server, k: str, kind: str) -> int:
    """Tensors (``kind`` "tensor") or waiters ("waiter") of ``k`` in ``server``'s table."""
    return sum(e.count for e in server.pending() if e.key == k and e.kind == kind)


def _asking(consumer, k: str) -> int:
    """Calls of ``k`` on ``consumer``'s streams still waiting for their answer."""
    n = 0
    for peer in consumer.peers.values():
        stream = peer.live_stream()
        if stream is not None:
            n += sum(1 for p in stream.pending.values() if p.key == k and not p.orphan and not p.future.done())
    return n


async def _got_promptly(recv: asyncio.Future) -> object:
    done, _ = await asyncio.wait({recv}, timeout=PROMPTLY)
    assert recv in done, f"a recv already waiting was not given the kept tensor (its deadline is {LONG:g}s)"
    return recv.result()


async def _nothing_answers(recv_again, *keys: str) -> None:
    for k in keys:
        with pytest.raises(DeadlineExceeded):
            await recv_again(k)


@pytest.mark.parametrize("where", ["own-table", "producer"])
def test_a_tensor_kept_after_a_recv_was_called_and_before_it_waits_is_that_recvs(where):
    """A recv's checks run when it is called (what is kept among them) and it
    waits once its coroutine runs, a turn later: a tensor kept in between (a
    cut transfer that landed) is that recv's. ``own-table``: this rank's own
    key; ``producer``: another task's key, the recv about to ask it (there the
    tensor was served once: the producer would wait for another)."""
    async def main():
        async with cluster(2) as (c, p):
            k = key(0, 0, "k") if where == "own-table" else key(1, 0, "k")
            value = np.arange(6, dtype=np.int32)
            recv = asyncio.ensure_future(c.receiver.fetch(k, 4, LONG, None))  # called, not yet running
            c.kept.keep(4, k, Received(value, False), why=None)
            np.testing.assert_array_equal((await _got_promptly(recv)).item.value, value)
            await until(lambda: nothing_in_flight(c, p), what="the recvs in flight")
            await _nothing_answers(lambda x: c.recv(x, step_id=4, timeout=0.3), k)
            await until(lambda: nothing_in_flight(c, p), what="the withdrawn recv")
            assert not left_anywhere(c, p)
    run(main(), 60)


@pytest.mark.parametrize("where", ["consumer", "own-table", "producer"])
def test_a_tensor_a_cancelled_batch_took_goes_to_a_recv_of_its_key_already_waiting(where):
    """``consumer``: a key of another task, the recv waiting on the stream to it;
    ``own-table``: this rank's own key, the recv waiting in its table;
    ``producer``: the producer's own batch took it, and a remote consumer's
    recv waits for it at the producer."""
    async def main():
        async with cluster(2) as (c, p):
            if where == "consumer":
                batcher, waiter, producer = c, c, p
                k, missing = key(1, 0, "k"), key(1, 0, "missing")
            elif where == "own-table":
                batcher, waiter, producer = c, c, c
                k, missing = key(0, 0, "k"), key(0, 0, "missing")
            else:
                batcher, waiter, producer = p, c, p
                k, missing = key(1, 0, "k"), key(1, 0, "missing")
            value = np.arange(6, dtype=np.float32)
            producer.send(k, value, step_id=1)
            batch = asyncio.ensure_future(batcher.recv_many([k, missing], step_id=1))
            await until(lambda: _at(producer, k, "tensor") == 0 and _at(producer, missing, "waiter") == 1
                        and _asking(batcher, k) == 0, what="the batch to hold the tensor and wait")
            recv = asyncio.ensure_future(waiter.recv(k, step_id=1, timeout=LONG))
            await until(lambda: _at(producer, k, "waiter") == 1, what="the recv to wait at the producer")
            batch.cancel()
            with pytest.raises(asyncio.CancelledError):
                await batch
            np.testing.assert_array_equal(await _got_promptly(recv), value)
            # exactly once: every key asked again, nothing answers, nothing is left
            await until(lambda: nothing_in_flight(c, p), what="the cancelled requests to settle")
            await _nothing_answers(lambda x: waiter.recv(x, step_id=1, timeout=0.3), k, missing)
            await until(lambda: nothing_in_flight(c, p), what="the withdrawn requests")
            assert not left_anywhere(c, p)
    run(main(), 60)


def test_tensors_kept_together_go_to_the_waiting_recvs_oldest_first():
    """A batch that took two tensors of one key is cancelled while two recvs of
    that key wait: the older tensor to the older recv."""
    async def main():
        async with cluster(2) as (c, p):
            k, missing = key(1, 0, "twice"), key(1, 0, "missing")
            p.send(k, np.array([0.0]), step_id=1)
            p.send(k, np.array([1.0]), step_id=1)
            batch = asyncio.ensure_future(c.recv_many([k, k, missing], step_id=1))
            await until(lambda: _at(p, k, "tensor") == 0 and _at(p, missing, "waiter") == 1
                        and _asking(c, k) == 0, what="the batch to hold both tensors")
            older = asyncio.ensure_future(c.recv(k, step_id=1, timeout=LONG))
            await until(lambda: _at(p, k, "waiter") == 1, what="the first recv to wait")
            newer = asyncio.ensure_future(c.recv(k, step_id=1, timeout=LONG))
            await until(lambda: _at(p, k, "waiter") == 2, what="the second recv to wait")
            batch.cancel()
            await asyncio.gather(batch, return_exceptions=True)
            assert (await _got_promptly(older))[0] == 0.0
            assert (await _got_promptly(newer))[0] == 1.0
            await until(lambda: nothing_in_flight(c, p), what="the cancelled requests to settle")
            await _nothing_answers(lambda x: c.recv(x, step_id=1, timeout=0.3), k, missing)
            await until(lambda: nothing_in_flight(c, p), what="the withdrawn requests")
            assert not left_anywhere(c, p)
    run(main(), 60)


@pytest.mark.parametrize("nodes", [1, 2], ids=["own-key", "two-daemons"])
def test_a_late_answer_given_back_goes_to_a_local_recv_of_its_key_already_waiting(sockdir, nodes):  # noqa: F811
    """Client ``b``'s recv was answered as it gave up, and it gives the tensor
    back (RETURN) while client ``c``'s recv of the key waits: in the daemon's
    own table (one daemon), or at the producer's daemon (two)."""
    async def main():
        async with daemons(sockdir, n=nodes) as ds, Client(ds[0].local_target) as a, \
                Client(ds[-1].local_target) as b, Client(ds[-1].local_target) as c:
            home, producer = ds[-1], ds[0]
            k = node_key(0, nodes - 1, "late")
            value = np.arange(5, dtype=np.int64)
            await a.send(k, value, step_id=3)
            req = lpb.LocalRecvRequest(step_id=3, rendezvous_key=k).SerializeToString()
            raw = await b._link.call(LocalOp(Kind.RECV, req, 10))  # as if its caller had given up meanwhile
            recv = asyncio.ensure_future(c.recv(k, step_id=3, timeout=LONG))
            await until(lambda: _at(producer.server, k, "waiter") == 1, what="c's recv to wait")
            await b._link.call(LocalOp(Kind.RETURN, returned(k, 3, raw), 10))
            np.testing.assert_array_equal(await _got_promptly(recv), value)
            await until(lambda: daemons_settled(*ds), what="the recvs in flight")
            await _nothing_answers(lambda x: c.recv(x, step_id=3, timeout=0.3), k)
            await until(lambda: daemons_settled(*ds), what="the withdrawn recvs")
            assert not left_anywhere(*(d.server for d in ds))
            assert home.server.kept.count() == 0
    run(main(), 60)


def test_a_batch_a_local_client_cancels_hands_what_it_took_to_a_waiting_recv(sockdir):  # noqa: F811
    """Through two daemons: client ``b``'s batch has its tensor of ``k`` when b
    cancels it (the daemon keeps what arrived) while client ``c``'s recv of
    ``k`` waits at the producer's daemon."""
    async def main():
        async with daemons(sockdir, n=2) as (d0, d1), Client(d0.local_target) as a, \
                Client(d1.local_target) as b, Client(d1.local_target) as c:
            k, missing = node_key(0, 1, "k"), node_key(0, 1, "missing")
            value = np.arange(7, dtype=np.float64)
            await a.send(k, value, step_id=1)
            batch = asyncio.ensure_future(b.recv_many([k, missing], step_id=1))
            await until(lambda: _at(d0.server, k, "tensor") == 0 and _at(d0.server, missing, "waiter") == 1
                        and _asking(d1.server, k) == 0, what="b's batch to hold the tensor and wait")
            recv = asyncio.ensure_future(c.recv(k, step_id=1, timeout=LONG))
            await until(lambda: _at(d0.server, k, "waiter") == 1, what="c's recv to wait")
            batch.cancel()
            await asyncio.gather(batch, return_exceptions=True)
            np.testing.assert_array_equal(await _got_promptly(recv), value)
            await until(lambda: daemons_settled(d0, d1) and not b._link._cancelled, what="the recvs in flight")
            await _nothing_answers(lambda x: c.recv(x, step_id=1, timeout=0.3), k, missing)
            await until(lambda: daemons_settled(d0, d1), what="the withdrawn recvs")
            assert not left_anywhere(d0.server, d1.server)
    run(main(), 60)
