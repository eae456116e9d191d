"""A producer with no room for more waiting recvs (``max_waiting_calls``)
refuses them with RESOURCE_EXHAUSTED, and the consumer then counts the
request_id as settled: it never asks with it again. So a refusal must never
leave anything behind for that id. A retry whose answer is already held is
not a waiting recv at all: it is answered (the tensor, or the descriptor
whose transfer waits for it), never refused. A retry whose first call's take
still waits is refused, and that take is withdrawn with it: the tensor
produced later stays in the table for the next recv, and is not taken for
an id nobody will ask with again."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from rendezvous import errors
from rendezvous.v1 import rendezvous_pb2 as pb

from conftest import run, until
from test_servicer import K, _handed_over, _tensors, _waiters, recv, recv_many, serving

pytestmark = pytest.mark.timeout(60)


async def _full(h) -> None:
    """Fill the server: one recv waits (for a key nobody sends) and no more may."""
    h.servicer.max_waiting = 1
    filler = h.stream()
    await filler.send(recv(1, K("never")))
    await until(lambda: _waiters(h.table) == {K("never"): 1}, what="the filler to wait")
    assert h.servicer.waiting_calls() == 1


def _unary_request(name: str, request_id: int) -> bytes:
    return pb.RecvTensorRequest(step_id=1, rendezvous_key=K(name), request_id=request_id).SerializeToString()


def test_a_retry_whose_answer_is_held_is_answered_on_a_full_server():
    """The reply of id 41 went into a connection that died; the consumer asks
    again on a new stream while the server is full. Refused, the id would be
    settled at the consumer and the tensor held for it never delivered."""
    async def main():
        async with serving() as h:
            h.table.send(1, K("held"), np.array([7.0]))
            h.table.send(1, K("held"), np.array([8.0]))
            lost = h.stream()
            await lost.send(recv(1, K("held"), request_id=41))
            assert (await lost.value(1))[0] == 7.0  # (the consumer never saw it)
            await _full(h)
            again = h.stream()
            await again.send(recv(1, K("held"), request_id=41))
            got = await again.result(1)
            assert isinstance(got, np.ndarray), f"the retry of a held answer was refused: {got!r}"
            assert got[0] == 7.0
            # exactly once: the second tensor is still there, for a new request only
            assert _tensors(h.table) == {K("held"): 1}
            h.servicer.max_waiting = 1 << 16
            await again.send(recv(2, K("held"), request_id=42))
            assert (await again.value(2))[0] == 8.0
            assert _tensors(h.table) == {}
    run(main(), 30)


def test_a_unary_retry_whose_answer_is_held_is_answered_on_a_full_server():
    async def main():
        async with serving() as h:
            h.table.send(1, K("u"), np.array([3], dtype=np.int32))
            first = await h.unary()(_unary_request("u", 43))
            await _full(h)
            try:
                again = await h.unary()(_unary_request("u", 43))
            except grpc.aio.AioRpcError as exc:
                raise AssertionError(f"the unary retry of a held answer was refused: {exc.code()}") from None
            assert pb.RecvTensorResponse.FromString(again).tensor == pb.RecvTensorResponse.FromString(first).tensor
            # a new request on the full server is still refused, and takes nothing
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.unary()(_unary_request("u", 44))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert len(h.table) == 1 and _waiters(h.table) == {K("never"): 1}
    run(main(), 30)


def test_a_retry_of_a_handed_over_descriptor_gets_it_again_on_a_full_server():
    """The descriptor's transfer is posted and waits for this consumer's
    receive: refusing the retry would leave it unmatched and the tensor lost."""
    async def main():
        async with serving(descriptor=True) as h:
            plane, first = await _handed_over(h, 45)
            await _full(h)
            again = h.stream()
            await again.send(recv(1, K("d"), request_id=45))
            got = await again.result(1)
            assert isinstance(got, tuple) and got[0] == "descriptor", f"refused: {got!r}"
            assert again.options[1] == first.options[1] and plane.started == [0]
    run(main(), 30)


@pytest.mark.parametrize("batched", [False, True], ids=["recv", "batch-key"])
def test_a_refused_retry_withdraws_the_take_still_waiting_for_its_id(batched):
    """The first call of id 51 waits for its tensor on a stream that died
    unnoticed; its retry on a new stream finds the server full and is refused,
    so the consumer counts 51 as settled. The tensor produced next must stay in
    the table for the next recv: taken for 51, it would be written into the
    dead connection and held for an id nobody asks with again."""
    async def main():
        async with serving() as h:
            h.servicer.max_waiting = 1
            unnoticed = h.stream()
            if batched:  # a batch's key waits with no task of its own
                await unnoticed.send(recv_many(1, [K("p")], request_ids=[51]))
            else:
                await unnoticed.send(recv(1, K("p"), request_id=51))
            await until(lambda: _waiters(h.table) == {K("p"): 1}, what="the first call to wait")
            again = h.stream()
            await again.send(recv(1, K("p"), request_id=51))
            refusal = await again.result(1)
            assert isinstance(refusal, errors.ResourceExhausted), refusal
            h.table.send(1, K("p"), np.array([5.0]))
            assert _tensors(h.table) == {K("p"): 1}, "the tensor was taken for a refused id"
            # the first call's take was withdrawn, and its call answered with the refusal
            assert isinstance(await unnoticed.result(1), errors.ResourceExhausted)
            await until(lambda: h.servicer.waiting_calls() == 0, what="the withdrawn take to end")
            assert not h.servicer.retry.has(51)
            await again.send(recv(2, K("p"), request_id=52))
            assert (await again.value(2))[0] == 5.0
            assert len(h.table) == 0 and h.servicer.retry.held() == 1
    run(main(), 30)


#: tensors in the race below
RACE = 600


@pytest.mark.timeout(150)
def test_racing_recvs_on_a_full_producer_whose_connections_are_cut_get_every_tensor_once():
    """Rank servers that hold at most 16 waiting recvs, the consumer reaching the
    producer through a relay that resets the connection every 25 tensors to
    arrive: replies are lost in dead connections, and their request_ids are
    asked again while the producer is full. A refused recv is asked again as a
    new one. Every tensor arrives once with its own contents; then every key
    is asked again (nothing answers) and nothing is left anywhere: no table
    entry, no kept tensor, no answer held for an id, no id left in doubt."""
    from cutting import Relay
    from racing import ask_again, paced, race, value

    from rendezvous.errors import DeadlineExceeded, ResourceExhausted
    from rendezvous.keys import TaskName
    from test_no_loss import left_anywhere, nothing_in_flight

    from conftest import cluster, key as task_key

    async def main():
        async with cluster(2, max_waiting_calls=16, reconnect_attempts=1000) as (c, p):
            relay = Relay(p.target)
            c.update_cluster(c.cluster.with_address(TaskName("worker", 0, 1), await relay.start()))
            k = lambda i: task_key(1, 0, f"t{i}")  # noqa: E731
            seen = {"arrived": 0, "refused": 0}

            async def ask(i: int, t: float):
                try:
                    return await c.recv(k(i), step_id=1, timeout=t)
                except ResourceExhausted:  # nothing answered: as a deadline that passed
                    seen["refused"] += 1
                    raise DeadlineExceeded("refused") from None

            arrived: set[int] = set()

            async def recv(i: int, t: float):
                got = await ask(i, t)
                arrived.add(i)
                seen["arrived"] += 1
                if seen["arrived"] % 25 == 0:
                    relay.cut()
                return got

            try:
                feeder = asyncio.ensure_future(paced(lambda i: p.send(k(i), value(i), step_id=1), RACE))
                try:  # (it takes about 2 s here)
                    tally = await asyncio.wait_for(race(recv, RACE, seed=13), 60)
                except TimeoutError:
                    lost = sorted(set(range(RACE)) - arrived)
                    raise AssertionError(f"{len(lost)} tensors never arrived, asked again and again: "
                                         f"{lost[:20]} (refusals: {seen['refused']})") from None
                await feeder
                assert seen["refused"] > 0 and relay.cuts > 0, (seen, relay.cuts)
                await until(lambda: nothing_in_flight(c, p), what="the replies in flight")
                # an id left in doubt by a cut is settled by asking its key again
                for _ in range(20):
                    await ask_again(ask, tally)
                    await until(lambda: nothing_in_flight(c, p), what="the withdrawn requests")
                    if not any(peer.in_doubt for peer in c.peers.values()):
                        break
                tally.check()
                assert not any(peer.in_doubt for peer in c.peers.values())
                assert not left_anywhere(c, p)
            finally:
                await relay.close()
    run(main(), 140)
