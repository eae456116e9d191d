"""README promises about rank servers that had no test of their own.

Re-sent recvs after a stream breaks, the retry cache (by itself and through a
server), deadlines racing tensors, ``connect_timeout``, ``max_request_bytes``,
the bound address, and the Errors table's status codes through real servers.

Each test says in its docstring how it was checked to fail when the code it
covers is broken: the library was monkeypatched in a scratch run (never
edited) and the test was seen to fail.
"""

from __future__ import annotations

import asyncio
import random
import socket

import grpc
import numpy as np
import pytest

from rendezvous import aio, errors
from rendezvous.cluster import parse_address
from rendezvous.config import Config
from rendezvous.errors import Aborted, DeadlineExceeded, FailedPrecondition, InvalidArgument
from rendezvous.rpc import retry as retry_module
from rendezvous.rpc.options import server_options
from rendezvous.rpc.retry import RetryCache
from rendezvous.table import WaitingTable
from rendezvous.v1 import rendezvous_pb2 as pb

from conftest import cluster, free_port, key, run, until

pytestmark = pytest.mark.timeout(60)

UNARY = "/rendezvous.v1.Rendezvous/RecvTensor"


# -- helpers ------------------------------------------------------------------


def _unary(target: str):
    channel = grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", -1),
                                                         ("grpc.max_send_message_length", -1)])
    return channel, channel.unary_unary(UNARY)


def _request(k: str, step_id: int, request_id: int = 0) -> bytes:
    return pb.RecvTensorRequest(rendezvous_key=k, step_id=step_id, request_id=request_id).SerializeToString()


def _content(raw: bytes) -> bytes:
    return pb.RecvTensorResponse.FromString(raw).tensor.tensor_content


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        low, v = v & 0x7F, v >> 7
        if v:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _padded(request: bytes, total: int) -> bytes:
    """``request`` plus an unknown length-delimited field (number 1000), so the
    message is exactly ``total`` bytes; a parser keeps and ignores it."""
    tag = _varint(1000 << 3 | 2)
    for width in range(1, 6):  # the bytes of the padding's length varint
        n = total - len(request) - len(tag) - width
        if n >= 0 and len(_varint(n)) == width:
            return request + tag + _varint(n) + b"\0" * n
    raise AssertionError(f"cannot pad {len(request)} bytes to {total}")


def _record_request_ids(server: aio.Server) -> list[int]:
    """The request_id of every recv request that reaches ``server``'s servicer
    (each stream request goes through ``take_now`` first)."""
    seen: list[int] = []
    take_now = server.servicer.take_now

    def recording(req, owner=None):
        seen.append(req.request_id)
        return take_now(req, owner)

    server.servicer.take_now = recording
    return seen


class _Clock:
    """Stands in for the retry cache's ``time`` module: a monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(retry_module, "time", fake)
    return fake


def _taker(table: WaitingTable, step_id: int, k: str):
    """A ``take`` for RetryCache.run that counts how often it is called."""
    calls = [0]

    def take():
        calls[0] += 1
        return table.recv(step_id, k)

    return take, calls


# -- 1. re-sending recvs after a stream breaks -----------------------------------


async def _producer_listener(spec: dict, address: str) -> tuple[aio.Server, grpc.aio.Server, list[int]]:
    """Task 1's servicer on a gRPC server of our own at ``address``, so the test
    can stop the listener abruptly (streams break, nothing is drained)."""
    producer = aio.Server(spec, "worker", 1)
    seen = _record_request_ids(producer)
    listener = grpc.aio.server(options=server_options(producer.config.max_request_bytes))
    listener.add_generic_rpc_handlers(producer.servicer.handlers())
    assert listener.add_insecure_port(address) == parse_address(address)[1]
    await listener.start()
    return producer, listener, seen


def test_a_recv_is_resent_with_its_request_id_when_the_producers_server_restarts():
    """A recv waits at the producer; the producer's gRPC server stops (its stream
    breaks under the recv) and a new rank server starts on the same host:port.
    The recv is re-sent there, once, with the request_id it first carried, and
    completes with the tensor the new server produces; nothing is left behind.

    Checked to fail: with recv_request (in rendezvous.rpc.consumer_stream) patched to draw a new
    request_id per request (a re-send under a new id) the id assertion fails;
    with PeerClient.recv patched to ignore reconnect_attempts (as if 0) the
    recv fails with PeerUnavailable."""
    async def main():
        address = f"127.0.0.1:{free_port()}"
        consumer = aio.Server({"worker": ["127.0.0.1:0", address]}, "worker", 0, reconnect_attempts=3)
        await consumer.start()
        spec = {"worker": [consumer.target, address]}
        consumer.update_cluster(spec)
        first, listener, first_ids = await _producer_listener(spec, address)
        second = None
        k = key(1, 0, "resent")
        try:
            recv = asyncio.ensure_future(consumer.recv(k, step_id=1, timeout=10))
            await until(first.pending, what="the recv to wait at the first producer")
            await listener.stop(0)  # the stream breaks; the recv is still waiting
            second = aio.Server(spec, "worker", 1)
            second_ids = _record_request_ids(second)
            await second.start()
            assert second.target == address
            second.send(k, np.arange(4, dtype=np.int32), step_id=1)
            got = await recv
            assert got.tolist() == [0, 1, 2, 3]
            assert len(first_ids) == 1 and first_ids[0] != 0
            assert second_ids == first_ids  # re-sent once, with the same request_id
            assert second.pending() == []
            assert consumer.stats()["grpc"]["transfers"] == 1
            assert consumer.stats()["grpc"]["errors"] == 0
            # the broken call's wait at the first producer was withdrawn
            await until(lambda: not first.pending(), what="the broken call's wait to be withdrawn")
        finally:
            await consumer.stop(0)
            if second is not None:
                await second.stop(0)
            await listener.stop(0)
    run(main())


def test_without_reconnect_attempts_a_broken_stream_fails_the_recv_with_unavailable():
    """With reconnect_attempts=0 the same break fails the recv with UNAVAILABLE
    (PeerUnavailable), although the restarted producer already holds the
    tensor: it is never asked (no request reaches it), it keeps the tensor, and
    a later recv gets it.

    Checked to fail: with PeerClient patched to read reconnect_attempts as 3,
    the recv is re-sent and returns the tensor instead of raising."""
    async def main():
        address = f"127.0.0.1:{free_port()}"
        consumer = aio.Server({"worker": ["127.0.0.1:0", address]}, "worker", 0, reconnect_attempts=0)
        await consumer.start()
        spec = {"worker": [consumer.target, address]}
        consumer.update_cluster(spec)
        first, listener, first_ids = await _producer_listener(spec, address)
        second = None
        k = key(1, 0, "not-resent")
        try:
            recv = asyncio.ensure_future(consumer.recv(k, step_id=1, timeout=10))
            await until(first.pending, what="the recv to wait at the first producer")
            await listener.stop(0)
            second = aio.Server(spec, "worker", 1)
            second_ids = _record_request_ids(second)
            await second.start()
            second.send(k, np.arange(3), step_id=1)
            with pytest.raises(errors.PeerUnavailable) as info:
                await recv
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            assert len(first_ids) == 1 and second_ids == []
            assert [(p.kind, p.count) for p in second.pending()] == [("tensor", 1)]  # nothing consumed
            assert consumer.stats()["grpc"]["errors"] == 1
            # the peer is reachable again: a new recv gets the tensor
            np.testing.assert_array_equal(await consumer.recv(k, step_id=1, timeout=10), np.arange(3))
            assert second.pending() == []
        finally:
            await consumer.stop(0)
            if second is not None:
                await second.stop(0)
            await listener.stop(0)
    run(main())


# -- 2. the retry cache, by itself ---------------------------------------------------


def test_retry_cache_keeps_an_answer_for_its_window_then_refuses_the_retry(clock):
    """A retry within the window gets the very same answer without a second take;
    once the window has passed it gets FAILED_PRECONDITION, still without a take.

    Checked to fail: with RetryCache._expire patched to release nothing, the
    late retry returns the answer; with RetryCache.run patched to always take,
    the in-window retry returns the second tensor."""
    async def main():
        table = WaitingTable()
        for i in range(3):
            table.send(1, "k", np.array([i]))
        take, calls = _taker(table, 1, "k")
        cache = RetryCache(window=10, max_bytes=1 << 30)
        first = await cache.run(1, 5, take, "k")
        clock.now += 9.9
        again = await cache.run(1, 5, take, "k")
        assert again is first and first.value[0] == 0
        assert calls[0] == 1 and table.stats()["tensors"] == 2
        clock.now += 0.2  # the window is over
        with pytest.raises(FailedPrecondition, match="already answered") as info:
            await cache.run(1, 5, take, "k")
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert calls[0] == 1 and table.stats()["tensors"] == 2
        assert not cache.has(5) and cache.known(5)
        cache.close()
    run(main())


def test_retry_cache_byte_limit_releases_the_oldest_answers_first(clock):
    """Three 1000-byte answers under a 2500-byte limit: the oldest is released
    (its retry is refused, no second tensor), the two newer ones are still held.

    Checked to fail: with RetryCache._expire patched to ignore max_bytes, the
    oldest answer is still held; with it patched to release the newest answer
    first, the newest one's retry is refused."""
    async def main():
        table = WaitingTable()
        takes = {}
        for name in ("a", "b", "c"):
            for j in range(2):
                table.send(1, name, np.full(125, j, np.float64))  # 1000 bytes each
            takes[name] = _taker(table, 1, name)
        cache = RetryCache(window=60, max_bytes=2500)
        answers = {}
        for rid, name in enumerate(("a", "b", "c"), start=1):
            answers[name] = await cache.run(1, rid, takes[name][0], name)
        assert [cache.has(r) for r in (1, 2, 3)] == [False, True, True]
        assert (await cache.run(1, 2, takes["b"][0], "b")) is answers["b"]
        assert (await cache.run(1, 3, takes["c"][0], "c")) is answers["c"]
        with pytest.raises(FailedPrecondition):
            await cache.run(1, 1, takes["a"][0], "a")
        assert [takes[n][1][0] for n in "abc"] == [1, 1, 1]
        assert table.stats()["tensors"] == 3
        cache.close()
    run(main())


def test_retry_cache_remembers_only_the_last_max_ids_released_ids(clock):
    """Four answers released by the window with max_ids=2: only the last two ids
    are remembered (a retry of one is refused without a take); the older ids
    are forgotten.

    Checked to fail: with RetryCache._release patched to never trim its
    remembered ids, the first two ids are still known."""
    async def main():
        table = WaitingTable()
        for i in range(6):
            table.send(1, "k", np.array([i]))
        take, calls = _taker(table, 1, "k")
        cache = RetryCache(window=10, max_bytes=1 << 30, max_ids=2)
        for rid in range(1, 5):
            await cache.run(1, rid, take, "k")
        clock.now += 11  # all four windows are over: the next request releases them
        assert (await cache.run(1, 5, take, "k")).value[0] == 4
        assert [cache.known(r) for r in (1, 2, 3, 4, 5)] == [False, False, True, True, True]
        with pytest.raises(FailedPrecondition):
            await cache.run(1, 4, take, "k")
        assert calls[0] == 5 and table.stats()["tensors"] == 1
        cache.close()
    run(main())


def test_retry_cache_drop_step_forgets_that_steps_answers_only(clock):
    """drop_step(1): step 1's answer is released (its retry refused, no second
    tensor) and its bytes freed (a new 1000-byte answer fits a 1500-byte limit);
    step 2's answer is kept; a take of step 1 still waiting is withdrawn, so a
    tensor sent later for a reused step 1 is not swallowed by it.

    Checked to fail: with RetryCache.drop_step patched to do nothing, step 1's
    retry returns the old answer; with RetryCache._release patched not to
    subtract the released bytes, the new answer is released at once; with
    RetryCache._release patched not to cancel a pending take, the withdrawn
    take never ends (the bounded wait fails)."""
    async def main():
        table = WaitingTable()
        for step in (1, 2):
            for j in range(2):
                table.send(step, "k", np.full(125, step * 10 + j, np.float64))
        take1, calls1 = _taker(table, 1, "k")
        take2, calls2 = _taker(table, 2, "k")
        cache = RetryCache(window=60, max_bytes=1500)
        await cache.run(1, 11, take1, "k")
        waiting = asyncio.ensure_future(cache.run(1, 12, lambda: table.recv(1, "w"), "w"))
        await until(lambda: table.stats()["waiters"] == 1, what="the take of step 1 to wait")
        cache.drop_step(1)
        assert not cache.has(11) and cache.known(11) and not cache.has(12)
        second = await cache.run(2, 22, take2, "k")  # 1000 bytes: fits once step 1's are freed
        assert cache.has(22)
        with pytest.raises(FailedPrecondition):
            await cache.run(1, 11, take1, "k")
        assert (await cache.run(2, 22, take2, "k")) is second
        assert calls1[0] == 1 and calls2[0] == 1
        (outcome,) = await asyncio.wait_for(asyncio.gather(waiting, return_exceptions=True), 5)
        assert isinstance(outcome, BaseException)  # no tensor was taken for it
        assert table.stats()["waiters"] == 0
        table.send(1, "w", np.array([1]))
        assert table.stats()["tensors"] == 3  # the late tensor stays: nothing took it
        cache.close()
    run(main())


def test_retry_cache_a_failed_answer_is_kept_even_when_a_fresh_take_would_succeed():
    """Errors are answers too: a request whose take failed with ABORTED gets the
    same ABORTED on retry, even after the table forgot the step and a tensor for
    the key is there (a fresh take would succeed); the tensor is not consumed.

    Checked to fail: with RetryCache._completed patched to drop failed answers,
    the retry takes and returns the tensor."""
    async def main():
        table = WaitingTable()
        take, calls = _taker(table, 3, "k")
        cache = RetryCache(window=60, max_bytes=1 << 30)
        waiting = asyncio.ensure_future(cache.run(3, 8, take, "k"))
        await until(lambda: table.stats()["waiters"] == 1, what="the take to wait")
        table.abort(3, Aborted("bad batch"))
        with pytest.raises(Aborted, match="bad batch"):
            await waiting
        table.cleanup(3)  # the table forgets the step; the cache does not
        table.send(3, "k", np.array([1]))
        with pytest.raises(Aborted, match="bad batch") as info:
            await cache.run(3, 8, take, "k")
        assert info.value.code == grpc.StatusCode.ABORTED
        assert calls[0] == 1 and table.stats()["tensors"] == 1
        assert (await cache.run(3, 9, take, "k")).value[0] == 1  # a new id takes it
        cache.close()
    run(main())


# -- 2. the retry cache, through a server (unary RecvTensor with a request_id) ------


def test_server_retry_in_the_window_gets_the_same_answer_and_after_it_failed_precondition(clock):
    """Through b's unary RecvTensor: a retry in the window is answered with the
    same tensor and consumes no second one; after the window it is refused with
    FAILED_PRECONDITION and the second tensor is still there for a recv.

    Checked to fail: with RetryCache.__init__ patched to stretch the window a
    thousandfold, the late retry gets the tensor again; with RetryCache.run
    patched to always take, the in-window retry gets the second tensor."""
    async def main():
        async with cluster(2, retry_window=10.0) as (a, b):
            k = key(1, 0, "window")
            b.send(k, np.array([1.0]), step_id=2)
            b.send(k, np.array([2.0]), step_id=2)
            channel, call = _unary(b.target)
            async with channel:
                req = _request(k, 2, request_id=9001)
                first = _content(await call(req, timeout=5))
                clock.now += 9.5
                again = _content(await call(req, timeout=5))
                assert first == again == np.array([1.0]).tobytes()
                assert [p.count for p in b.pending()] == [1]
                clock.now += 1.0
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(req, timeout=5)
                assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "no longer held" in info.value.details()
                assert [p.count for p in b.pending()] == [1]
            assert (await a.recv(k, step_id=2, timeout=5))[0] == 2.0
    run(main())


def test_server_retry_cache_bytes_release_the_oldest_answers_first():
    """retry_cache_bytes=2500 and three 1000-byte answers: the oldest request's
    retry is refused (FAILED_PRECONDITION, nothing consumed), the two newer
    ones get their answers again.

    Checked to fail: with RetryCache._expire patched to ignore max_bytes, the
    oldest request's retry is answered with its tensor."""
    async def main():
        async with cluster(2, retry_cache_bytes=2500) as (a, b):
            names = ["b0", "b1", "b2"]
            for i, name in enumerate(names):
                b.send(key(1, 0, name), np.full(125, i, np.float64), step_id=1)
                b.send(key(1, 0, name), np.full(125, 10 + i, np.float64), step_id=1)
            channel, call = _unary(b.target)
            async with channel:
                reqs = [_request(key(1, 0, n), 1, request_id=700 + i) for i, n in enumerate(names)]
                answers = [_content(await call(r, timeout=5)) for r in reqs]
                assert answers == [np.full(125, i, np.float64).tobytes() for i in range(3)]
                assert _content(await call(reqs[1], timeout=5)) == answers[1]
                assert _content(await call(reqs[2], timeout=5)) == answers[2]
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(reqs[0], timeout=5)
                assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert sorted(p.count for p in b.pending()) == [1, 1, 1]
            assert (await a.recv(key(1, 0, "b0"), step_id=1, timeout=5))[0] == 10.0
    run(main())


def test_server_cleanup_forgets_the_steps_answers_even_an_abort():
    """A request waits on step 4; the step is aborted: ABORTED with the abort's
    message, and a retry in the window gets the same. Server.cleanup(4) then
    forgets the step's answers: the step id is reused, a tensor is sent, and the
    retry of the aborted request gets FAILED_PRECONDITION (its answer is no
    longer held), not that tensor, which a new recv gets. Another step's answer
    is untouched by the cleanup.

    Checked to fail: with RetryCache.drop_step patched to do nothing, the retry
    after the cleanup gets the cached ABORTED instead of FAILED_PRECONDITION."""
    async def main():
        async with cluster(2) as (a, b):
            k = key(1, 0, "aborted")
            other = key(1, 0, "kept")
            b.send(other, np.array([5.0]), step_id=5)
            channel, call = _unary(b.target)
            async with channel:
                kept = _request(other, 5, request_id=505)
                kept_answer = _content(await call(kept, timeout=5))
                req = _request(k, 4, request_id=31337)
                waiting = asyncio.ensure_future(call(req, timeout=5))
                await until(b.pending, what="the request to wait")
                b.abort(4, "input pipeline failed")
                for attempt in (waiting, call(req, timeout=5)):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await attempt
                    assert info.value.code() == grpc.StatusCode.ABORTED
                    assert info.value.details() == "input pipeline failed"
                b.cleanup(4)
                b.send(k, np.array([7.0]), step_id=4)  # the step is reused
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(req, timeout=5)
                assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "already answered" in info.value.details()
                assert [(p.step_id, p.kind, p.count) for p in b.pending()] == [(4, "tensor", 1)]
                assert _content(await call(kept, timeout=5)) == kept_answer
            assert (await a.recv(k, step_id=4, timeout=5))[0] == 7.0
    run(main())


def test_server_a_cached_error_is_the_retry_answer_while_fresh_requests_succeed():
    """Errors are answers too, through a server: a request waiting when the
    server starts draining is answered UNAVAILABLE ("shutting down"). Its key's
    tensor is then produced; during the grace period a retry with the same
    request_id gets that same cached UNAVAILABLE and does not take the tensor,
    while a fresh request (no request_id) does get it.

    Checked to fail: with RetryCache._completed patched to drop failed answers,
    the retry is served the tensor."""
    async def main():
        server = aio.Server({"worker": ["127.0.0.1:0", "127.0.0.1:0"]}, "worker", 1)
        await server.start()
        k, other = key(1, 0, "late"), key(1, 0, "held")
        stopping = None
        try:
            server.send(other, np.array([2]), step_id=1)  # keeps the drain waiting for its grace
            channel, call = _unary(server.target)
            async with channel:
                req = _request(k, 1, request_id=8080)
                waiting = asyncio.ensure_future(call(req, timeout=5))
                await until(lambda: any(p.kind == "waiter" for p in server.pending()),
                            what="the request to wait")
                stopping = asyncio.ensure_future(server.stop(grace=10))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await waiting
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                cached = info.value.details()
                assert "shutting down" in cached
                server.send(k, np.array([1]), step_id=1)  # a fresh take would now succeed
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(req, timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert info.value.details() == cached
                assert sorted(p.count for p in server.pending()) == [1, 1]  # nothing taken
                assert np.frombuffer(_content(await call(_request(k, 1), timeout=5)), np.int64).tolist() == [1]
                assert np.frombuffer(_content(await call(_request(other, 1), timeout=5)), np.int64).tolist() == [2]
            await asyncio.wait_for(stopping, 10)  # nothing left to deliver: the drain ends
        finally:
            if stopping is None:
                await server.stop(0)
            else:  # ends by itself within its grace
                await asyncio.wait_for(asyncio.shield(stopping), 15)
    run(main())


def test_producer_cleanup_answers_waiting_recvs_with_aborted():
    """Cleaning up a step once cancelled the retry cache's waiting takes, so recvs with a request_id got no answer at all."""
    """Server.cleanup(step) "aborts the step's waiters": a remote recv waiting at
    the producer (stream) and a unary request with a request_id both get
    ABORTED ("step 6 cleaned up") at once, not their deadline.

    Checked to pass once fixed: with RetryCache.run patched to raise
    Aborted("step N cleaned up") when its shared take was cancelled by a release
    while the caller itself was not cancelled, both get ABORTED and the test
    XPASSes (a strict failure), every other test still passing."""
    async def main():
        async with cluster(2) as (a, b):
            channel, call = _unary(b.target)
            async with channel:
                remote = asyncio.ensure_future(a.recv(key(1, 0, "p"), step_id=6, timeout=5))
                unary = asyncio.ensure_future(call(_request(key(1, 0, "q"), 6, request_id=4242), timeout=5))
                await until(lambda: len(b.pending()) == 2, what="both recvs to wait at the producer")
                b.cleanup(6)
                got_remote, got_unary = await asyncio.gather(remote, unary, return_exceptions=True)
            assert isinstance(got_remote, errors.Aborted), repr(got_remote)
            assert "cleaned up" in got_remote.message
            assert isinstance(got_unary, grpc.aio.AioRpcError), repr(got_unary)
            assert got_unary.code() == grpc.StatusCode.ABORTED, got_unary
    run(main())


# -- 3. deadlines racing the tensor ------------------------------------------------


def _race_key(src: int, i: int) -> str:
    return key(src, 0, f"race{i}")


def test_local_recvs_whose_deadline_is_the_send_get_each_tensor_once_or_leave_it():
    """300 local recvs, each with its tensor sent at the moment its deadline
    passes (a timer set just before the recv's own, or a little before or
    after). Each recv gets its tensor or DEADLINE_EXCEEDED; every tensor not
    received is still in the table, once; later recvs get exactly those.

    Checked to fail: with WaitingTable._cancelled patched to drop an item
    already handed to a recv that timed out, tensors are missing from the table."""
    n, timeout = 300, 0.1

    async def main():
        async with cluster(1) as (a,):
            loop = asyncio.get_running_loop()
            rng = random.Random(11)
            sent = [0]

            def send(i: int) -> None:
                a.send(_race_key(0, i), np.array([i]), step_id=1)
                sent[0] += 1

            async def one(i: int) -> int | None:
                skew = 0.0 if i % 2 else rng.uniform(-300e-6, 100e-6)
                loop.call_at(loop.time() + timeout + skew, send, i)
                try:
                    got = await a.recv(_race_key(0, i), step_id=1, timeout=timeout)
                except DeadlineExceeded as exc:
                    assert exc.code == grpc.StatusCode.DEADLINE_EXCEEDED
                    return None
                return int(got[0])

            results = await asyncio.gather(*(one(i) for i in range(n)))
            await until(lambda: sent[0] == n, what="every tensor to be sent")
            received = {i for i, v in enumerate(results) if v is not None}
            assert all(results[i] == i for i in received)
            missed = set(range(n)) - received
            assert missed, "no deadline passed: the race was not exercised"
            left = {p.key: (p.kind, p.count) for p in a.pending()}
            assert left == {_race_key(0, i): ("tensor", 1) for i in missed}
            for i in sorted(missed):
                assert (await a.recv(_race_key(0, i), step_id=1, timeout=5))[0] == i
            assert a.pending() == []
    run(main())


def test_remote_recvs_whose_deadline_is_the_send_get_each_tensor_once_or_leave_it():
    """300 remote recvs, each with its tensor sent by the producer at (or a few
    milliseconds before, or just after) the moment its deadline passes. Each
    gets its tensor or DEADLINE_EXCEEDED; once everything settles every tensor
    not received is held once, in the producer's table or kept by the consumer's
    server (a reply already on its way), never lost, never twice; later recvs
    get exactly those.

    Checked to fail: with rendezvous.rpc.delivery.put_back patched to do nothing
    (a cancelled call's tensor dropped), or aio.Server._unclaimed patched to do
    nothing (a reply arriving after its deadline dropped), tensors go missing
    and the settling wait fails."""
    n, timeout = 300, 0.1

    async def main():
        async with cluster(2) as (consumer, producer):
            loop = asyncio.get_running_loop()
            rng = random.Random(5)
            sent = [0]

            def send(i: int) -> None:
                producer.send(_race_key(1, i), np.array([i]), step_id=1)
                sent[0] += 1

            async def one(i: int) -> int | None:
                skew = 0.0 if i % 3 == 0 else rng.uniform(-5e-3, 1e-3)
                loop.call_at(loop.time() + timeout + skew, send, i)
                try:
                    got = await consumer.recv(_race_key(1, i), step_id=1, timeout=timeout)
                except DeadlineExceeded as exc:
                    assert exc.code == grpc.StatusCode.DEADLINE_EXCEEDED
                    return None
                return int(got[0])

            results = await asyncio.gather(*(one(i) for i in range(n)))
            await until(lambda: sent[0] == n, what="every tensor to be sent")
            received = {i for i, v in enumerate(results) if v is not None}
            assert all(results[i] == i for i in received)
            missed = set(range(n)) - received
            assert missed, "no deadline passed: the race was not exercised"

            def at_producer() -> list[str]:
                return [p.key for p in producer.pending() if p.kind == "tensor" for _ in range(p.count)]

            def kept() -> list[str]:
                return [k for (_, k), items in consumer.kept.items() for _ in items]

            await until(lambda: len(at_producer()) + len(kept()) == len(missed), timeout=10,
                        what="every tensor not received to be back in a table (none lost)")
            held = at_producer() + kept()
            assert sorted(held) == sorted(_race_key(1, i) for i in missed)  # each once, none received twice
            for i in sorted(missed):
                assert (await consumer.recv(_race_key(1, i), step_id=1, timeout=5))[0] == i
            assert producer.pending() == [] and not consumer.kept
    run(main())


# -- 4. connect_timeout --------------------------------------------------------------


def test_connect_timeout_to_a_peer_that_accepts_tcp_but_never_speaks_http2():
    """The producer's address is a listening socket that never accepts: TCP
    connects, HTTP/2 never answers. With connect_timeout=1: a recv with its own
    0.3 s timeout gets DEADLINE_EXCEEDED after about 0.3 s; a recv with a 10 s
    timeout gets UNAVAILABLE naming the connect timeout after about 1 s. The
    socket's backlog then holds the connection with gRPC's HTTP/2 preface.

    Checked to fail: with PeerClient patched to read connect_timeout as 60, the
    second recv ends with DEADLINE_EXCEEDED after 10 s; with PeerClient.recv
    patched to wait for the connection before its deadline applies, the first
    recv gets UNAVAILABLE after 1 s."""
    async def main():
        loop = asyncio.get_running_loop()
        with socket.socket() as hung:
            hung.bind(("127.0.0.1", 0))
            hung.listen(16)
            address = "127.0.0.1:%d" % hung.getsockname()[1]
            consumer = aio.Server({"worker": ["127.0.0.1:0", address]}, "worker", 0, connect_timeout=1.0)
            await consumer.start()
            try:
                k = key(1, 0, "never")
                start = loop.time()
                with pytest.raises(DeadlineExceeded) as info:
                    await consumer.recv(k, step_id=1, timeout=0.3)
                took = loop.time() - start
                assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
                assert 0.25 <= took < 0.9, took
                start = loop.time()
                with pytest.raises(errors.PeerUnavailable, match=r"could not connect .* within 1s") as info:
                    await asyncio.wait_for(consumer.recv(k, step_id=1, timeout=10), 15)
                took = loop.time() - start
                assert info.value.code == grpc.StatusCode.UNAVAILABLE
                assert 0.9 <= took < 3.0, took
            finally:
                await consumer.stop(0)

            def first_connection() -> bytes:
                hung.settimeout(5)
                conn, _ = hung.accept()
                with conn:
                    conn.settimeout(5)
                    data = b""
                    while len(data) < 24:
                        chunk = conn.recv(24 - len(data))
                        if not chunk:
                            break
                        data += chunk
                    return data
            assert (await loop.run_in_executor(None, first_connection)).startswith(b"PRI * HTTP/2.0")
    run(main())


# -- 5. max_request_bytes --------------------------------------------------------------


@pytest.mark.parametrize("limit", [64 << 10, None])
def test_requests_over_max_request_bytes_are_refused_and_the_server_serves_on(limit, monkeypatch):
    """A unary request one byte over max_request_bytes (64 KiB, the least it may
    be, and the 256 KiB default) is refused by gRPC with RESOURCE_EXHAUSTED and
    consumes nothing; a request of exactly the limit is served; the server's
    stream goes on too; a limit below 64 KiB is refused at start-up.

    Checked to fail: with aio.server_options patched to give the gRPC server no
    receive limit, the oversized request is served its tensor."""
    monkeypatch.delenv("RENDEZVOUS_MAX_REQUEST_BYTES", raising=False)
    overrides = {} if limit is None else {"max_request_bytes": limit}
    size = limit or 256 << 10
    with pytest.raises(InvalidArgument, match="max_request_bytes must be at least 65536"):
        Config.load({"max_request_bytes": (64 << 10) - 1}, env={})

    async def main():
        async with cluster(2, **overrides) as (a, b):
            assert b.config.max_request_bytes == size
            k = key(1, 0, "limit")
            b.send(k, np.arange(3), step_id=1)
            over, at = _padded(_request(k, 1), size + 1), _padded(_request(k, 1), size)
            assert len(over) == size + 1 and len(at) == size
            channel, call = _unary(b.target)
            async with channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(over, timeout=10)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert [(p.kind, p.count) for p in b.pending()] == [("tensor", 1)]
                assert np.frombuffer(_content(await call(at, timeout=10)), np.int64).tolist() == [0, 1, 2]
            b.send(key(1, 0, "after"), np.arange(2), step_id=1)
            np.testing.assert_array_equal(await a.recv(key(1, 0, "after"), step_id=1, timeout=10), np.arange(2))
    run(main())


# -- 6. the bound address ----------------------------------------------------------------


def test_a_server_binds_only_its_cluster_host():
    """Cluster address 127.0.0.1:0: the target's host is 127.0.0.1, the port is
    served there, and a connect to 127.0.0.2 on the same port is refused (it
    did not bind all interfaces).

    Checked to fail: with aio.add_port patched to bind 0.0.0.0 with the same
    port, the connect to 127.0.0.2 succeeds."""
    async def main():
        async with cluster(1) as (s,):
            host, port = parse_address(s.target)
            assert host == "127.0.0.1" and port != 0
            s.send(key(0, 1, "here"), np.arange(2))
            channel, call = _unary(s.target)
            async with channel:
                assert np.frombuffer(_content(await call(_request(key(0, 1, "here"), 0), timeout=5)),
                                     np.int64).tolist() == [0, 1]
            with socket.socket() as probe:
                probe.settimeout(5)
                with pytest.raises(ConnectionRefusedError):
                    probe.connect(("127.0.0.2", port))
    run(main())


def test_a_cluster_address_of_0000_binds_every_interface():
    """Cluster address 0.0.0.0:0 does bind every interface: a gRPC call to
    127.0.0.2 on the bound port is served.

    Checked to fail: with aio.add_port patched to bind 127.0.0.1 whatever the
    cluster says, the call to 127.0.0.2 fails with UNAVAILABLE."""
    async def main():
        s = aio.Server({"worker": ["0.0.0.0:0"]}, "worker", 0)
        await s.start()
        try:
            host, port = parse_address(s.target)
            assert host == "0.0.0.0" and port != 0
            s.send(key(0, 1, "any"), np.arange(3))
            channel, call = _unary(f"127.0.0.2:{port}")
            async with channel:
                raw = await call(_request(key(0, 1, "any"), 0), timeout=5)
            assert np.frombuffer(_content(raw), np.int64).tolist() == [0, 1, 2]
        finally:
            await s.stop(0)
    run(main())


# -- 7. the Errors table, through real servers ---------------------------------------------


def test_a_key_of_a_task_outside_the_cluster_is_unknown_task_not_found():
    """A recv whose key's source task is not in the cluster (an index past the
    job's end, a job the cluster lacks) fails at once with UnknownTask, status
    NOT_FOUND, naming the task; no peer is contacted.

    Checked to fail: with ClusterSpec.address patched to route unknown tasks to
    the first task's address, the recv fails with FAILED_PRECONDITION instead."""
    async def main():
        async with cluster(2) as (a, b):
            for k, task in [(key(5, 0, "x"), "/job:worker/replica:0/task:5"),
                            (key(0, 0, "y", job="ps"), "/job:ps/replica:0/task:0")]:
                with pytest.raises(errors.UnknownTask) as info:
                    await a.recv(k, step_id=1, timeout=5)
                assert info.value.code == grpc.StatusCode.NOT_FOUND
                assert task in info.value.message
            assert a.stats()["grpc"]["transfers"] == 0 and b.pending() == []
    run(main())


def test_failed_precondition_for_a_key_another_task_produces():
    """Sending a key another task produces is FAILED_PRECONDITION and queues
    nothing; a recv sent to a server that does not produce its key (the
    consumer's cluster routes task 1 to task 2's server) fails with
    FailedPrecondition naming both tasks, and that server holds nothing.

    Checked to fail: with RecvTensorServicer._check_key patched to skip the
    producer check, the misrouted recv waits and ends with DEADLINE_EXCEEDED."""
    async def main():
        async with cluster(3) as (a, b, c):
            with pytest.raises(FailedPrecondition) as info:
                a.send(key(1, 0, "not-mine"), np.ones(1))
            assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert a.pending() == []
            a.update_cluster({"worker": [a.target, c.target, b.target]})  # tasks 1 and 2 swapped
            with pytest.raises(FailedPrecondition) as info:
                await a.recv(key(1, 0, "misrouted"), step_id=1, timeout=5)
            assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "task:1" in info.value.message and "task:2" in info.value.message
            assert c.pending() == [] and b.pending() == []
    run(main())


def test_a_malformed_key_is_invalid_key_invalid_argument_locally_and_remotely():
    """A malformed key: recv and send raise InvalidKey (INVALID_ARGUMENT) naming
    the wrong field; a unary request carrying it gets INVALID_ARGUMENT from the
    producer, which serves on.

    Checked to fail: with the servicer's parse_key patched to raise a plain
    ValueError, the unary request gets INTERNAL."""
    bad_incarnation = key(1, 0, "x").replace("0000000000000000", "zz", 1)
    assert "zz" in bad_incarnation

    async def main():
        async with cluster(2) as (a, b):
            for bad, field in [("not a key", "key"), (bad_incarnation, "src_incarnation")]:
                with pytest.raises(errors.InvalidKey) as info:
                    await a.recv(bad, step_id=1, timeout=5)
                assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
                assert info.value.field == field
                with pytest.raises(errors.InvalidKey):
                    a.send(bad, np.ones(1))
            channel, call = _unary(b.target)
            async with channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(_request(bad_incarnation, 1), timeout=5)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "incarnation" in info.value.details()
            b.send(key(1, 0, "ok"), np.arange(2), step_id=1)
            np.testing.assert_array_equal(await a.recv(key(1, 0, "ok"), step_id=1, timeout=5), np.arange(2))
    run(main())


def test_aborted_with_the_aborts_message_local_and_remote():
    """ABORTED carries the abort's message: a local recv waiting when its step is
    aborted, and a later one; a remote recv waiting at a producer that aborts,
    and a later one through the stream; a remote recv whose consumer aborts the
    step (the producer's wait is withdrawn). Cleanup aborts too: a local waiter
    and a unary request without a request_id get ABORTED "step N cleaned up".

    Checked to fail: with aio.Server.abort patched not to cancel the step's
    remote waits, the consumer-side abort leaves the remote recv waiting until
    DEADLINE_EXCEEDED; with errors.from_status patched to map ABORTED to
    Unavailable, the producer-side abort arrives as Unavailable."""
    async def main():
        async with cluster(2) as (a, b):
            # local
            waiting = asyncio.ensure_future(a.recv(key(0, 0, "l"), step_id=3, timeout=5))
            await until(a.pending, what="the local recv to wait")
            a.abort(3, "local reason")
            for attempt in (waiting, a.recv(key(0, 0, "l2"), step_id=3, timeout=5)):
                with pytest.raises(errors.Aborted) as info:
                    await attempt
                assert info.value.code == grpc.StatusCode.ABORTED and info.value.message == "local reason"
            # remote: the producer aborts
            waiting = asyncio.ensure_future(a.recv(key(1, 0, "r"), step_id=4, timeout=5))
            await until(b.pending, what="the remote recv to wait at the producer")
            b.abort(4, "producer reason")
            for attempt in (waiting, a.recv(key(1, 0, "r2"), step_id=4, timeout=5)):
                with pytest.raises(errors.Aborted) as info:
                    await attempt
                assert info.value.code == grpc.StatusCode.ABORTED and info.value.message == "producer reason"
            # remote: the consumer aborts
            waiting = asyncio.ensure_future(a.recv(key(1, 0, "c"), step_id=5, timeout=5))
            await until(b.pending, what="the remote recv to wait at the producer")
            a.abort(5, "consumer reason")
            with pytest.raises(errors.Aborted) as info:
                await waiting
            assert info.value.code == grpc.StatusCode.ABORTED and info.value.message == "consumer reason"
            await until(lambda: not b.pending(), what="the producer's wait to be withdrawn")
            # cleanup: a local waiter, and a unary request without a request_id
            waiting = asyncio.ensure_future(a.recv(key(0, 0, "cl"), step_id=6, timeout=5))
            await until(a.pending, what="the local recv to wait")
            a.cleanup(6)
            with pytest.raises(errors.Aborted, match="step 6 cleaned up"):
                await waiting
            channel, call = _unary(b.target)
            async with channel:
                waiting = asyncio.ensure_future(call(_request(key(1, 0, "u"), 7), timeout=5))
                await until(b.pending, what="the unary request to wait")
                b.cleanup(7)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await waiting
                assert info.value.code() == grpc.StatusCode.ABORTED
                assert info.value.details() == "step 7 cleaned up"
    run(main())


def test_consumer_cleanup_fails_a_remote_recv_with_aborted():
    """Cleaning up a step on the consumer once made its remote recvs raise CancelledError instead of ABORTED."""
    """Server.cleanup(step) on the consumer "aborts the step's waiters": its
    remote recv of that step fails with Aborted ("step 6 cleaned up"), as its
    local recv does, and the producer's wait is withdrawn.

    Checked to pass once fixed: with aio.Server._recv_remote patched to raise
    Aborted("step N cleaned up") for an _ABORT cancel when the step has no
    tombstone, the test XPASSes (a strict failure)."""
    async def main():
        async with cluster(2) as (a, b):
            remote = asyncio.ensure_future(a.recv(key(1, 0, "c"), step_id=6, timeout=5))
            local = asyncio.ensure_future(a.recv(key(0, 0, "c"), step_id=6, timeout=5))
            await until(lambda: b.pending() and a.pending(), what="both recvs to wait")
            a.cleanup(6)
            got_remote, got_local = await asyncio.gather(remote, local, return_exceptions=True)
            assert isinstance(got_local, errors.Aborted) and got_local.message == "step 6 cleaned up"
            await until(lambda: not b.pending(), what="the producer's wait to be withdrawn")
            assert isinstance(got_remote, errors.Aborted), repr(got_remote)
            assert got_remote.message == "step 6 cleaned up"
    run(main())
