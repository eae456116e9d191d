"""Many deadlines on one loop timer (rendezvous/deadlines.py): asyncio.timeout's
meaning, the stall-warning timers' meaning, one loop timer for many, bounded memory."""

from __future__ import annotations

import asyncio

import pytest

from rendezvous import deadlines as dl
from rendezvous.deadlines import Deadlines

pytestmark = pytest.mark.timeout(30)

LONG = 60.0  # a deadline no test waits for


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def times_out(d: Deadlines, delay: float) -> dl.Timeout:
    """A block of ``delay`` seconds that waits for nothing: it must time out."""
    with pytest.raises(TimeoutError):
        async with d.timeout(delay) as t:
            await asyncio.get_running_loop().create_future()
    return t


def test_a_deadline_that_passes_raises_timeout_and_leaves_the_task_uncancelled():
    async def main():
        d = Deadlines()
        t = await times_out(d, 0.01)
        assert t.expired()
        assert asyncio.current_task().cancelling() == 0
        assert len(d) == 0
        await asyncio.sleep(0)  # the task goes on: nothing cancels it later
        return "went on"

    assert run(main()) == "went on"


def test_a_block_that_ends_in_time_leaves_nothing_to_fire():
    async def main():
        d = Deadlines()
        fut = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(fut.set_result, 7)
        async with d.timeout(LONG) as t:
            got = await fut
        assert got == 7 and not t.expired()
        assert len(d) == 0

    run(main())


def test_no_deadline_takes_no_entry():
    async def main():
        d = Deadlines()
        async with d.timeout(None) as t:
            assert len(d) == 0
            await asyncio.sleep(0)
        assert t.when() is None and not t.expired()

    run(main())


def test_a_deadline_already_past_fires_at_the_next_turn():
    async def main():
        d = Deadlines()
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            async with d.timeout_at(loop.time() - 1):
                await loop.create_future()

    run(main())


def test_a_cancel_from_elsewhere_stays_a_cancel():
    async def main():
        d = Deadlines()
        entered = asyncio.Event()

        async def waiter():
            async with d.timeout(LONG):
                entered.set()
                await asyncio.get_running_loop().create_future()

        task = asyncio.create_task(waiter())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(d) == 0

    run(main())


def test_a_cancel_in_the_turn_the_deadline_fires_stays_a_cancel():
    """As asyncio.timeout: a task cancelled from elsewhere too is not told it timed out."""
    async def main():
        d = Deadlines()
        entered = asyncio.Event()
        loop = asyncio.get_running_loop()

        async def waiter():
            async with d.timeout_at(loop.time() - 1):  # due at the next turn
                entered.set()
                await loop.create_future()

        task = asyncio.create_task(waiter())
        await entered.wait()
        task.cancel()  # in the same turn as the deadline's own cancel
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())


def test_nested_blocks_the_outer_deadline_times_out_the_outer_block():
    async def main():
        d = Deadlines()
        seen = []
        with pytest.raises(TimeoutError):
            async with d.timeout(0.01):
                try:
                    async with d.timeout(LONG):
                        await asyncio.get_running_loop().create_future()
                except asyncio.CancelledError:
                    seen.append("inner saw the cancel")
                    raise
        assert seen == ["inner saw the cancel"]
        assert len(d) == 0

    run(main())


def test_an_earlier_deadline_added_after_a_later_one_fires_first():
    async def main():
        d = Deadlines()
        fired = []
        d.call_later(LONG, fired.append, "late")
        d.call_later(0.01, fired.append, "early")
        await times_out(d, 0.05)
        assert fired == ["early"]
        assert len(d) == 1  # the late one still waits

    run(main())


def test_timers_fire_in_deadline_order_and_a_cancelled_one_never():
    async def main():
        d = Deadlines()
        loop = asyncio.get_running_loop()
        fired = []
        done = loop.create_future()
        d.call_later(0.03, fired.append, 3)
        d.call_later(0.01, fired.append, 1)
        d.call_later(0.02, fired.append, 2).cancel()
        d.call_later(0.04, done.set_result, None)
        await done
        assert fired == [1, 3]

    run(main())


def test_a_timer_cancelled_by_another_due_in_the_same_firing_does_not_run():
    async def main():
        d = Deadlines()
        loop = asyncio.get_running_loop()
        fired = []
        when = loop.time() + 0.01
        # both due at once: the first cancels the second before its turn
        second = None

        def first():
            fired.append("first")
            second.cancel()

        assert d._adopt()  # this loop's (as a first entry would make it)
        d._push(when, dl.Timer(d, first, ()))
        second = dl.Timer(d, fired.append, ("second",))
        d._push(when, second)
        await times_out(d, 0.05)
        assert fired == ["first"]

    run(main())


def test_many_deadlines_of_one_step_arm_the_loop_timer_once(monkeypatch):
    """The point of it: a gather of recvs with one timeout arms one loop timer,
    not one each (asyncio.timeout arms and cancels one per block)."""
    async def main():
        d = Deadlines()
        loop = asyncio.get_running_loop()
        armed = []
        call_at = loop.call_at

        def counting(when, callback, *args, **kw):
            armed.append(when)
            return call_at(when, callback, *args, **kw)

        monkeypatch.setattr(loop, "call_at", counting)
        futs = [loop.create_future() for _ in range(500)]

        async def one(f):
            async with d.timeout(LONG):
                return await f

        tasks = asyncio.gather(*(one(f) for f in futs))
        await asyncio.sleep(0)
        for i, f in enumerate(futs):
            f.set_result(i)
        assert await tasks == list(range(500))
        assert len(armed) == 1
        assert len(d) == 0

    run(main())


def test_given_up_entries_do_not_pile_up():
    async def main():
        d = Deadlines()
        blocker = d.call_later(LONG / 2, lambda: None)  # at the top: nothing below it is popped
        for _ in range(5000):
            d.call_later(LONG, lambda: None).cancel()
        assert len(d) == 1
        assert len(d._heap) <= 2 * dl._COMPACT_AT + 2
        blocker.cancel()

    run(main())


def test_a_block_on_another_loop_while_entries_live_falls_back_to_asyncio():
    d = Deadlines()

    async def first():
        d.call_later(LONG, lambda: None)  # a live entry on the first loop
        return asyncio.get_running_loop()

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(first())

        run(times_out(d, 0.01))
    finally:
        loop.close()


def test_an_object_moves_to_a_new_loop_once_the_old_one_has_nothing_live():
    d = Deadlines()

    async def once():
        await times_out(d, 0.01)
        return d._loop

    first = run(once())
    second = run(once())
    assert first is not second and second is not None


def test_an_entry_given_up_holds_nothing_of_its_caller():
    """A block that ended in time, and a timer cancelled, stay in the heap until
    their deadline (or a compaction) but keep no reference to the task or the
    callback's arguments: a recv's task holds its result, the received
    tensor, and a tensor kept alive so was a receive buffer that could never
    be reused (every large recv then took fresh pages: 20 x slower on a
    machine whose fresh pages are slow; see
    test_server.py::test_blocking_recvs_of_large_tensors_reuse_their_receive_buffers)."""
    import weakref

    class Payload:
        pass

    async def main():
        d = Deadlines()
        async with d.timeout(LONG) as block:
            await asyncio.sleep(0)
        arg = Payload()
        timer = d.call_later(LONG, lambda p: None, arg)
        timer.cancel()
        arg_ref = weakref.ref(arg)
        del arg
        assert [entry for _, _, entry in d._heap] == [block, timer]  # still in the heap, given up
        assert block._task is None, "a given-up deadline kept its task (and the task its result) alive"
        assert arg_ref() is None, "a cancelled timer kept its arguments alive"

    run(main())


def _loops():
    yield pytest.param(asyncio.new_event_loop, id="asyncio")
    try:
        import uvloop
    except ImportError:
        return
    yield pytest.param(uvloop.new_event_loop, id="uvloop")


@pytest.mark.parametrize("new_loop", list(_loops()))
def test_no_deadline_fires_before_its_time(new_loop):
    """asyncio.timeout's meaning: a block is never cancelled before its
    deadline, a timer never runs before its time. Entries spread over 50 ms,
    a quarter of a millisecond apart, each checked against the loop's clock
    as it fires (an entry due soon after another must wait for its own time,
    not fire with the earlier one)."""
    spread, step = 0.05, 0.00025

    async def main():
        d = Deadlines()
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.005
        early: list[tuple[str, float]] = []
        timers_done = asyncio.Event()
        count = int(spread / step)
        fired = 0
        assert d._adopt()

        def timer(when: float) -> None:
            nonlocal fired
            now = loop.time()
            if now < when:
                early.append(("timer", when - now))
            fired += 1
            if fired == count:
                timers_done.set()

        for i in range(count):
            when = start + i * step
            d._push(when, dl.Timer(d, timer, (when,)))

        async def block(when: float) -> None:
            try:
                async with d.timeout_at(when):
                    await loop.create_future()
            except TimeoutError:
                now = loop.time()
                if now < when:
                    early.append(("timeout", when - now))

        blocks = [loop.create_task(block(start + (i + 0.5) * step)) for i in range(count)]
        await asyncio.gather(*blocks)
        await asyncio.wait_for(timers_done.wait(), 10)
        assert not early, f"{len(early)} entries fired early, by up to {max(e for _, e in early) * 1e3:.3f} ms"
        assert len(d) == 0

    loop = new_loop()
    try:
        loop.run_until_complete(asyncio.wait_for(main(), 20))
    finally:
        loop.close()


def test_a_timer_that_wakes_early_is_set_again_and_fires_nothing_yet():
    """A loop timer that comes before the earliest entry's time (uvloop rounds a
    delay to the millisecond) fires nothing, and the timer is set again for
    after that time."""
    async def main():
        d = Deadlines()
        loop = asyncio.get_running_loop()
        fired = []
        when = loop.time() + LONG
        assert d._adopt()
        d._push(when, dl.Timer(d, fired.append, ("x",)))
        d._fire()  # as the loop would, woken early
        assert fired == [] and len(d) == 1
        assert d._armed > when and d._handle is not None
        d._heap[0][2].cancel()

    run(main())
