"""Answers by request_id: same answer, nothing consumed twice, bounded memory."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rendezvous.errors import Aborted, FailedPrecondition, InvalidArgument
from rendezvous.table import WaitingTable
from rendezvous.rpc.retry import Handed, RetryCache

from conftest import run, until


def test_retry_gets_the_same_answer_and_expired_ids_never_consume():
    async def main():
        table = WaitingTable()
        cache = RetryCache(window=60, max_bytes=1 << 30, max_entries=2, max_ids=10)
        for i in range(5):
            table.send(1, "k", np.array([i]))
        take = lambda: table.recv(1, "k")  # noqa: E731
        first = await cache.run(1, 100, take)
        again = await cache.run(1, 100, take)
        assert first is again and first.value[0] == 0
        await cache.run(1, 101, take)
        await cache.run(1, 102, take)  # three answers held, limit two: 100 is released
        with pytest.raises(FailedPrecondition, match="already answered"):
            await cache.run(1, 100, take)
        assert table.stats()["tensors"] == 2  # 100 consumed one tensor, not two
    run(main())


def test_duplicates_in_flight_share_one_take_and_errors_are_answers_too():
    async def main():
        table = WaitingTable()
        cache = RetryCache(window=60, max_bytes=1 << 30)
        take = lambda: table.recv(2, "k")  # noqa: E731
        a = asyncio.ensure_future(cache.run(2, 7, take))
        b = asyncio.ensure_future(cache.run(2, 7, take))
        await asyncio.sleep(0)
        table.send(2, "k", np.array([1]))
        table.send(2, "k", np.array([2]))
        ra, rb = await asyncio.gather(a, b)
        assert ra is rb and ra.value[0] == 1
        assert table.stats()["tensors"] == 1
        # Errors are answers too: request 8 fails (its step is aborted while it
        # waits); the step is then cleaned up, so a fresh take would now wait (or
        # succeed), yet a retry of request 8 gets the recorded error at once. (The
        # check once aborted the step before asking, so a fresh take failed the
        # same way and the cache was never exercised.)
        first = asyncio.ensure_future(cache.run(3, 8, lambda: table.recv(3, "k")))
        await asyncio.sleep(0)
        table.abort(3, Aborted("gone"))
        with pytest.raises(Aborted, match="gone"):
            await first
        table.cleanup(3)
        table.send(3, "k", np.array([5]))  # a fresh take would get this tensor
        takes = []
        with pytest.raises(Aborted, match="gone"):
            await cache.run(3, 8, lambda: takes.append(1) or table.recv(3, "k"))
        assert takes == [] and table.stats()["tensors"] == 2  # answered from the cache
    run(main())


def test_cancelled_sole_caller_withdraws_the_take():
    async def main():
        table = WaitingTable()
        cache = RetryCache(window=60, max_bytes=1 << 30)
        task = asyncio.ensure_future(cache.run(4, 9, lambda: table.recv(4, "k")))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        assert len(cache) == 0 and table.stats()["waiters"] == 0
        table.send(4, "k", np.array([5]))
        assert (await cache.run(4, 9, lambda: table.recv(4, "k"))).value[0] == 5
    run(main())


def test_an_idle_cache_releases_answers_when_their_window_ends():
    """Served tensors were released only when the next request arrived: an idle
    producer held them (up to retry_cache_bytes) for good."""
    import asyncio

    import numpy as np

    from rendezvous.items import Received

    async def main():
        cache = RetryCache(window=0.05, max_bytes=1 << 30)
        loop = asyncio.get_running_loop()
        cache.record(1, 7, Received(np.ones(1024), False), "k")
        assert cache.has(7)
        end = loop.time() + 5
        while cache.has(7) and loop.time() < end:  # no request comes: the timer releases it
            await asyncio.sleep(0.01)
        assert not cache.has(7) and cache.known(7)  # released, and a late retry still refused
        cache.close()

    asyncio.run(main())


def test_a_delivered_answer_goes_at_once_and_its_id_is_not_answered_again():
    """An MPI send that completed put the bytes in the consumer's buffer: the
    answer is released then (a daemon's pool segment is free for the next send)
    and a late retry of its id is refused rather than given another tensor."""
    async def main():
        table = WaitingTable()
        cache = RetryCache(window=60, max_bytes=1 << 30)
        table.send(1, "k", np.arange(4), False)
        table.send(1, "k", np.arange(4) + 10, False)
        first = await cache.run(1, 7, lambda: table.recv(1, "k"), "k")
        assert len(cache) == 1
        cache.delivered(7)
        assert len(cache) == 0
        with pytest.raises(FailedPrecondition, match="already answered"):
            await cache.run(1, 7, lambda: table.recv(1, "k"), "k")
        assert list(first.value) == [0, 1, 2, 3]
        assert list((await table.recv(1, "k")).value) == [10, 11, 12, 13]  # the second was never taken
        cache.delivered(99)  # unknown ids change nothing
        cache.close()

    run(main())


def test_a_cut_off_reply_goes_back_only_when_no_retry_of_its_id_carries_the_tensor():
    """A reply written into a dead connection and its retry on a new stream both
    got the answer: when the first is cut off, the second carries the tensor
    (it must not go back to the table too); when every reply of the id was cut
    off, the tensor goes back and the id is forgotten."""
    async def main():
        table = WaitingTable()
        cache = RetryCache(window=60, max_bytes=1 << 30)
        table.send(1, "k", np.arange(3), False)
        take = lambda: table.recv(1, "k")  # noqa: E731
        first = await cache.run(1, 5, take, "k")    # the reply into the dead stream
        retried = await cache.run(1, 5, take, "k")  # the retry on the new stream
        assert first is retried
        assert not cache.cut_off(5)  # the first reply is cut off: the retry carries it
        assert cache.known(5)
        assert cache.cut_off(5)      # the retry is cut off as well: put the tensor back
        assert not cache.known(5)
        # One reply only (the usual case): cut off means back to the table.
        table.send(1, "j", np.arange(2), False)
        await cache.run(1, 6, lambda: table.recv(1, "j"), "j")
        assert cache.cut_off(6) and not cache.known(6)
        cache.record(1, 8, first, "k")  # taken without waiting: one reply
        assert cache.cut_off(8)
        assert cache.cut_off(99)  # an id never seen: nothing else carries it
        cache.close()

    run(main())


def test_only_the_newest_reply_of_an_id_decides_whether_its_tensor_goes_back():
    """Replies on streams (``owner``): a retry reaches the producer on a new
    stream only once its consumer's old one broke, so the old stream's reply
    can deliver no more. The retry's reply cut off (its consumer cancelled)
    puts the tensor back even though the old reply was handed the answer
    first (it was kept: the tensor was lost); the old reply cut off after the
    retry was handed the answer puts nothing back; and once the tensor is
    back, an old reply cut off later does not put it back a second time."""
    async def main():
        table = WaitingTable()
        cache = RetryCache(window=60, max_bytes=1 << 30)
        old, new, newer = object(), object(), object()
        item = (await _taken(table, "k"))
        cache.record(1, 5, item, "k", old)  # written into a connection that died
        assert await cache.run(1, 5, _never, "k", new) is item  # the retry, on a new stream
        assert cache.cut_off(5, new)  # the retry's reply cancelled unsent: back to the table
        assert not cache.known(5)
        assert not cache.cut_off(5, old)  # the dead stream's reply cut off later: back once only
        # the old reply cut off while the retry's reply carries the tensor: nothing goes back
        cache.record(1, 6, item, "k", old)
        assert await cache.run(1, 6, _never, "k", new) is item
        assert not cache.cut_off(6, old) and cache.known(6)
        # a retry of a retry: only the newest decides
        assert await cache.run(1, 6, _never, "k", newer) is item
        assert not cache.cut_off(6, new)
        assert cache.cut_off(6, newer) and not cache.known(6)
        # the id asked afresh after it went back: its new answer is cut off as usual
        cache.record(1, 5, item, "k", newer)
        assert cache.cut_off(5, newer)
        cache.close()

    run(main())


def test_a_retry_of_a_handed_over_descriptor_gets_it_once_per_hand_over():
    """A descriptor handed over for ids 11, 12, 13 (a group): a retry of any of
    them (the connection died under it) claims it, and the others no longer
    get it (their retries are answered afresh); a re-send dropped unsent is
    restored for its own id only; the descriptor goes with its answer."""
    async def main():
        table = WaitingTable()
        cache = RetryCache(window=60, max_bytes=1 << 30)
        item = await _taken(table, "k")
        for rid in (11, 12, 13):
            cache.record(1, rid, item, "k")
        group = Handed(lambda ids: ids, [11, 12, 13])
        cache.hand_over(group)
        assert cache.take_resend(12) is group
        assert cache.take_resend(11) is None and cache.take_resend(13) is None and cache.take_resend(12) is None
        again = Handed(group.make, [0, 12, 0])
        cache.restore(12, again)  # the re-send never left: the next retry of 12 gets it
        assert cache.take_resend(11) is None and cache.take_resend(12) is again
        cache.hand_over(Handed(group.make, [99]))  # an id with no answer held: nothing to re-send
        assert cache.take_resend(99) is None
        cache.hand_over(again)
        cache.cut_off(12)  # its answer went back to the table: nothing to re-send either
        assert cache.take_resend(12) is None
        cache.close()

    run(main())


async def _taken(table: WaitingTable, key: str):
    table.send(1, key, np.arange(3), False)
    return await table.recv(1, key)


async def _never():
    raise AssertionError("a retry takes nothing")


def test_a_request_id_asks_for_one_tensor_only():
    """A retry asks again for what its id first asked for: the same id for another
    key or another step is INVALID_ARGUMENT, and takes nothing."""
    async def main():
        table = WaitingTable()
        cache = RetryCache(window=60, max_bytes=1 << 30)
        for k in ("a", "b"):
            table.send(1, k, np.array([1]))
        table.send(2, "a", np.array([2]))
        await cache.run(1, 9, lambda: table.recv(1, "a"), "a")
        with pytest.raises(InvalidArgument, match="first used for key 'a', now for 'b'"):
            await cache.run(1, 9, lambda: table.recv(1, "b"), "b")
        with pytest.raises(InvalidArgument, match="first used for step 1, now for step 2"):
            await cache.run(2, 9, lambda: table.recv(2, "a"), "a")
        assert table.stats()["tensors"] == 2  # b of step 1 and a of step 2: untouched
        cache.close()
    run(main())


# -- answers recorded together (record_many): one group, ids split off as needed ------

def _batch(cache: RetryCache, step: int, rids: list[int], owner: object = None) -> list:
    from rendezvous.items import Received

    items = [Received(np.full(256, rid, np.float32), False) for rid in rids]  # 1 KiB each
    cache.record_many(step, list(rids), list(items), [f"k{rid}" for rid in rids], owner)  # lists it keeps
    return items


def test_a_batch_recorded_together_answers_each_id_as_if_recorded_alone():
    """A retry of one id of a batch gets that id's answer and consumes nothing;
    the id is checked against its own step and key; the others stay held;
    the held count and byte limit count answers, not groups; a released id is
    refused, never answered with another tensor."""
    async def main():
        cache = RetryCache(window=60, max_bytes=1 << 30, max_entries=5)
        items = _batch(cache, 1, [11, 12, 13])
        never = lambda: pytest.fail("a retry of a recorded id took a tensor")  # noqa: E731
        assert cache.held() == 3 and len(cache) == 3
        assert await cache.run(1, 12, never, "k12") is items[1]
        assert await cache.run(1, 12, never, "k12") is items[1]  # split off once, still the same answer
        with pytest.raises(InvalidArgument, match="step 1"):
            await cache.run(2, 13, never, "k13")
        with pytest.raises(InvalidArgument, match="key"):
            await cache.run(1, 13, never, "other")
        assert cache.held() == 3
        _batch(cache, 1, [21, 22, 23])  # six held, limit five: the oldest answers go first
        assert cache.held() == 5 and not cache.has(11) and cache.has(12) and cache.has(21)
        with pytest.raises(FailedPrecondition, match="already answered"):
            await cache.run(1, 11, never, "k11")
        cache.delivered(22)  # one id of a group released on its own
        assert not cache.has(22) and cache.known(22) and cache.held() == 4
        cache.drop_step(1)
        assert cache.held() == 0 and len(cache) == 0
        for rid in (12, 13, 21, 23):
            with pytest.raises(FailedPrecondition, match="already answered"):
                await cache.run(1, rid, never, f"k{rid}")
        cache.close()

    run(main())


def test_an_id_of_a_batch_cut_off_or_unclaimed_goes_back_once():
    """The newest reply decides for an id recorded with a batch too: a reply on
    the stream the batch was answered on that is cut off puts the answer back
    (once), one on an older stream does not; an unclaimed answer is handed
    back and its id forgotten; the rest of the batch stays held."""
    async def main():
        cache = RetryCache(window=60, max_bytes=1 << 30)
        old, new = object(), object()
        items = _batch(cache, 1, [31, 32, 33], new)
        assert not cache.cut_off(31, old)  # a reply on an older stream: the newest carries it
        assert cache.has(31)
        assert cache.cut_off(32, new)  # the newest reply, cut off: back to the table
        assert not cache.has(32) and not cache.cut_off(32, old)  # and only once
        assert cache.unclaimed(33) is items[2] and not cache.has(33)
        assert cache.held() == 1 and cache.has(31)
        cache.close()
        assert cache.held() == 0 and cache.known(31)

    run(main())


def test_descriptors_handed_over_for_a_batchs_ids_are_resent_once_each():
    async def main():
        cache = RetryCache(window=60, max_bytes=1 << 30)
        _batch(cache, 1, [41, 42, 43])
        handed = Handed(lambda ids: ids, [41, 42, 43])
        cache.hand_over(handed)
        assert cache.take_resend(42) is handed
        # claimed for 42: the others' retries are answered afresh, 42's again only once restored
        assert cache.take_resend(41) is None and cache.take_resend(42) is None
        again = Handed(lambda ids: ids, [0, 42, 0])
        cache.restore(42, again)
        assert cache.take_resend(42) is again
        assert cache.held() == 3
        cache.close()

    run(main())


def test_a_retry_answers_at_once_when_held_and_a_refused_one_withdraws_the_take_still_waiting():
    """What a producer with no room for waiting recvs needs: whether a retry of
    an id would wait (``answers_at_once``: not when its answer, or its error,
    is held, or the id was released), and, when it refuses one that would,
    the take still waiting for the id withdrawn (``withdraw``): its callers
    get the refusal, nothing is taken for the id, and the id is forgotten."""
    from rendezvous.errors import ResourceExhausted

    async def main():
        table = WaitingTable()
        cache = RetryCache(window=60, max_bytes=1 << 30)
        table.send(1, "k", np.array([1]))
        table.send(1, "g", np.array([2]))
        await cache.run(1, 1, lambda: table.recv(1, "k"), "k")
        cache.record_many(1, [2], [table.try_take(1, "g")], ["g"])
        assert cache.answers_at_once(1) and cache.answers_at_once(2)  # held, alone or in a batch's group
        cache.delivered(1)
        assert cache.answers_at_once(1)  # released: refused at once with FAILED_PRECONDITION
        assert not cache.answers_at_once(3)  # unknown: a new request
        waiting = asyncio.ensure_future(cache.run(1, 4, lambda: table.recv(1, "w"), "w"))
        await until(lambda: table.stats()["waiters"] == 1, what="the take to wait")
        assert not cache.answers_at_once(4)
        cache.withdraw(4, ResourceExhausted("full"))
        with pytest.raises(ResourceExhausted, match="full"):
            await waiting
        assert table.stats()["waiters"] == 0 and not cache.known(4)
        table.send(1, "w", np.array([4]))
        assert table.stats()["tensors"] == 1  # nothing taken for the refused id
        cache.withdraw(2, ResourceExhausted("full"))  # a held answer is never withdrawn
        assert cache.answers_at_once(2) and cache.held() == 1
        cache.close()

    run(main())
