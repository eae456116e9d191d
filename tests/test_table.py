"""Tests of rendezvous.table.WaitingTable (TensorFlow's local rendezvous)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading

import grpc
import numpy as np
import pytest

import rendezvous.table as table_mod
from rendezvous.errors import Aborted, Unavailable
from rendezvous.table import WaitingTable
from rendezvous.items import PendingEntry, Received

ZERO = {"steps": 0, "keys": 0, "tensors": 0, "waiters": 0, "tombstones": 0}

# Bound on any wait that should finish at once: a hang fails the test quickly.
SOON = 2.0


def run(coro):
    return asyncio.run(coro)


async def _settle(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


# ---------------------------------------------------------------- basics


def test_send_before_recv() -> None:
    t = WaitingTable()

    async def main() -> None:
        t.send(1, "k", "v")
        assert t.stats() == {**ZERO, "steps": 1, "keys": 1, "tensors": 1}
        assert len(t) == 1
        assert await t.recv(1, "k") == Received("v", False)
        assert t.stats() == ZERO
        assert len(t) == 0

    run(main())


def test_every_send_is_told_to_on_send_and_a_refused_one_is_not() -> None:
    t = WaitingTable()
    told = []
    t.on_send = lambda: told.append(len(t))

    async def main() -> None:
        waiter = asyncio.ensure_future(t.recv(1, "a"))
        await asyncio.sleep(0)  # the recv waits in the table
        t.send(1, "a", "to the waiter")
        t.send(1, "b", "queued")
        t.send(1, "b", None, is_dead=True)
        assert told == [0, 1, 2]  # after each send took effect (the first went to the waiter)
        assert (await waiter).value == "to the waiter"
        t.abort(1, Aborted("step 1 aborted"))
        with pytest.raises(Aborted):
            t.send(1, "c", "refused")
        assert len(told) == 3

    run(main())


def test_recv_before_send() -> None:
    t = WaitingTable()

    async def main() -> None:
        task = asyncio.create_task(t.recv(1, "k"))
        await _settle()
        assert not task.done()
        assert t.stats() == {**ZERO, "steps": 1, "keys": 1, "waiters": 1}
        t.send(1, "k", 42)
        assert t.stats() == ZERO
        assert await asyncio.wait_for(task, SOON) == Received(42, False)

    run(main())


def test_recv_before_step_known_other_steps_independent() -> None:
    t = WaitingTable()

    async def main() -> None:
        t.send(1, "k", "step1")
        task = asyncio.create_task(t.recv(7, "k"))  # step 7 never seen before
        await _settle()
        assert not task.done()
        t.send(7, "k", "step7")
        assert (await asyncio.wait_for(task, SOON)).value == "step7"
        assert (await t.recv(1, "k")).value == "step1"
        assert t.stats() == ZERO

    run(main())


def test_fifo_repeated_sends_one_key() -> None:
    t = WaitingTable()

    async def main() -> None:
        for i in range(5):
            t.send(1, "k", i)
        got = [(await t.recv(1, "k")).value for _ in range(5)]
        assert got == [0, 1, 2, 3, 4]
        assert t.stats() == ZERO

    run(main())


def test_fifo_multiple_waiters_same_key() -> None:
    # TF's old MPI rendezvous overwrote the first duplicate waiter, which then
    # hung forever: here both are kept and served oldest first.
    t = WaitingTable()

    async def main() -> None:
        tasks = [asyncio.create_task(t.recv(1, "k")) for _ in range(3)]
        await _settle()
        assert t.stats()["waiters"] == 3
        for v in "abc":
            t.send(1, "k", v)
        got = await asyncio.wait_for(asyncio.gather(*tasks), SOON)
        assert [r.value for r in got] == ["a", "b", "c"]
        assert t.stats() == ZERO

    run(main())


def test_is_dead_carried() -> None:
    t = WaitingTable()

    async def main() -> None:
        t.send(1, "k", "ignored", is_dead=True)
        assert await t.recv(1, "k") == Received(None, True)
        task = asyncio.create_task(t.recv(1, "k"))
        await _settle()
        t.send(1, "k", object(), is_dead=True)
        r = await asyncio.wait_for(task, SOON)
        assert r.is_dead is True and r.value is None
        t.send(1, "k", 0)
        assert await t.recv(1, "k") == Received(0, False)

    run(main())


def test_keys_may_be_any_hashable() -> None:
    t = WaitingTable()

    async def main() -> None:
        t.send(1, ("a", 1), "tuple")
        t.send(1, "a;1", "str")
        assert (await t.recv(1, "a;1")).value == "str"
        assert (await t.recv(1, ("a", 1))).value == "tuple"

    run(main())


# ---------------------------------------------------------------- abort


def test_abort_fails_waiters_and_later_ops_with_same_error() -> None:
    t = WaitingTable()
    err = Aborted("boom")

    async def main() -> None:
        waiters = [asyncio.create_task(t.recv(1, k)) for k in ("a", "a", "b")]
        await _settle()
        t.abort(1, err)
        for w in waiters:
            with pytest.raises(Aborted) as ei:
                await asyncio.wait_for(w, SOON)
            assert ei.value.message == "boom"
            assert ei.value.code == grpc.StatusCode.ABORTED
        with pytest.raises(Aborted) as ei:
            t.send(1, "a", 1)
        assert ei.value.message == "boom" and ei.value.code == grpc.StatusCode.ABORTED
        with pytest.raises(Aborted) as ei:
            await t.recv(1, "zzz")
        assert ei.value.message == "boom" and ei.value.code == grpc.StatusCode.ABORTED
        assert t.aborted(1) is err
        assert t.aborted(2) is None
        # a second abort keeps the first error
        t.abort(1, Aborted("second"))
        assert t.aborted(1) is err
        assert t.stats() == {**ZERO, "tombstones": 1}

    run(main())


def test_abort_drops_queued_items_other_steps_unaffected() -> None:
    t = WaitingTable()

    async def main() -> None:
        t.send(1, "a", 1)
        t.send(1, "a", 2)
        t.send(1, "b", 3)
        t.send(2, "a", "other")
        other_waiter = asyncio.create_task(t.recv(3, "x"))
        await _settle()
        t.abort(1, Aborted("boom"))
        assert t.stats() == {**ZERO, "steps": 2, "keys": 2, "tensors": 1, "waiters": 1, "tombstones": 1}
        assert (await t.recv(2, "a")).value == "other"
        assert not other_waiter.done()
        t.send(3, "x", "still works")
        assert (await asyncio.wait_for(other_waiter, SOON)).value == "still works"
        t.cleanup(1)
        # the dropped items are gone for good: a fresh step 1 is empty
        t.send(1, "a", "fresh")
        assert (await t.recv(1, "a")).value == "fresh"
        assert t.stats() == ZERO

    run(main())


def test_cleanup_fails_waiters_and_releases_tombstone() -> None:
    t = WaitingTable()

    async def main() -> None:
        w = asyncio.create_task(t.recv(5, "k"))
        t.send(5, "queued", 1)
        await _settle()
        t.cleanup(5)
        with pytest.raises(Aborted, match="step 5 cleaned up"):
            await asyncio.wait_for(w, SOON)
        assert t.stats() == ZERO
        t.abort(5, Aborted("x"))
        assert t.stats()["tombstones"] == 1
        with pytest.raises(Aborted):
            t.send(5, "k", 1)
        t.cleanup(5)
        assert t.aborted(5) is None
        assert t.stats() == ZERO
        t.send(5, "k", "later")  # a new rendezvous for the same step id
        assert (await t.recv(5, "k")).value == "later"
        t.cleanup(12345)  # unknown step: harmless
        assert t.stats() == ZERO

    run(main())


def test_tombstone_limit_evicts_oldest() -> None:
    t = WaitingTable(tombstone_limit=3)

    async def main() -> None:
        for step in range(1, 6):
            t.abort(step, Aborted(f"a{step}"))
        assert t.stats()["tombstones"] == 3
        assert t.aborted(1) is None and t.aborted(2) is None
        assert [t.aborted(s).message for s in (3, 4, 5)] == ["a3", "a4", "a5"]  # type: ignore[union-attr]
        t.send(1, "k", "evicted step works again")
        assert (await t.recv(1, "k")).value == "evicted step works again"
        with pytest.raises(Aborted, match="a3"):
            t.send(3, "k", 0)

    run(main())
    with pytest.raises(ValueError):
        WaitingTable(tombstone_limit=-1)


def test_close() -> None:
    t = WaitingTable()
    err = Unavailable("server stopping")

    async def main() -> None:
        waiters = [asyncio.create_task(t.recv(s, "k")) for s in (1, 2, 3)]
        t.send(4, "k", "dropped")
        t.abort(9, Aborted("old"))
        await _settle()
        assert not t.closed
        t.close(err)
        assert t.closed
        for w in waiters:
            with pytest.raises(Unavailable, match="server stopping"):
                await asyncio.wait_for(w, SOON)
        assert t.stats() == ZERO
        for step in (1, 4, 9, 100):
            assert t.aborted(step) is err
            with pytest.raises(Unavailable, match="server stopping"):
                t.send(step, "k", 0)
            with pytest.raises(Unavailable, match="server stopping"):
                await t.recv(step, "k")
        t.close(Unavailable("again"))  # idempotent: first error stays
        assert t.aborted(1) is err
        t.abort(1, Aborted("x"))
        t.cleanup(1)
        assert t.aborted(1) is err
        fut = t.send_threadsafe(asyncio.get_running_loop(), 1, "k", 0)
        with pytest.raises(Unavailable):
            await asyncio.wait_for(asyncio.wrap_future(fut), SOON)

    run(main())


# ---------------------------------------------------------- cancellation


def test_cancel_waiting_recv_removes_waiter() -> None:
    t = WaitingTable()

    async def main() -> None:
        task = asyncio.create_task(t.recv(1, "k"))
        await _settle()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert t.stats() == ZERO
        t.send(1, "k", "v")  # queued, not handed to the dead waiter
        assert t.stats() == {**ZERO, "steps": 1, "keys": 1, "tensors": 1}
        assert (await asyncio.wait_for(t.recv(1, "k"), SOON)).value == "v"
        assert t.stats() == ZERO

    run(main())


def test_cancel_one_of_several_waiters_next_one_served() -> None:
    t = WaitingTable()

    async def main() -> None:
        first = asyncio.create_task(t.recv(1, "k"))
        second = asyncio.create_task(t.recv(1, "k"))
        await _settle()
        first.cancel()
        # send in the same iteration: first's future is cancelled but the
        # waiter is still queued; it must be skipped.
        t.send(1, "k", "v")
        with pytest.raises(asyncio.CancelledError):
            await first
        assert (await asyncio.wait_for(second, SOON)).value == "v"
        assert t.stats() == ZERO

    run(main())


def test_cancel_then_send_same_iteration_queues_item() -> None:
    t = WaitingTable()

    async def main() -> None:
        task = asyncio.create_task(t.recv(1, "k"))
        await _settle()
        task.cancel()
        t.send(1, "k", "v")  # the only waiter is cancelled: queue the item
        with pytest.raises(asyncio.CancelledError):
            await task
        assert t.stats() == {**ZERO, "steps": 1, "keys": 1, "tensors": 1}
        assert (await asyncio.wait_for(t.recv(1, "k"), SOON)).value == "v"

    run(main())


def test_cancel_after_handoff_item_recovered() -> None:
    t = WaitingTable()

    async def main() -> None:
        task = asyncio.create_task(t.recv(1, "k"))
        await asyncio.sleep(0)  # task now waits on its future
        t.send(1, "k", "precious")  # handed to the waiter's future...
        task.cancel()  # ...whose task is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()
        assert t.stats() == {**ZERO, "steps": 1, "keys": 1, "tensors": 1}
        assert (await asyncio.wait_for(t.recv(1, "k"), SOON)).value == "precious"
        assert t.stats() == ZERO

    run(main())


def test_cancel_after_handoff_goes_to_front_and_next_waiter() -> None:
    t = WaitingTable()

    async def main() -> None:
        # Front of the queue: the returned item precedes later sends.
        task = asyncio.create_task(t.recv(1, "k"))
        await asyncio.sleep(0)
        t.send(1, "k", "first")
        t.send(1, "k", "second")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await t.recv(1, "k")).value == "first"
        assert (await t.recv(1, "k")).value == "second"

        # Next waiter: the returned item goes to the next receiver in line.
        a = asyncio.create_task(t.recv(1, "j"))
        b = asyncio.create_task(t.recv(1, "j"))
        await asyncio.sleep(0)
        t.send(1, "j", "x")  # handed to a
        a.cancel()
        with pytest.raises(asyncio.CancelledError):
            await a
        assert (await asyncio.wait_for(b, SOON)).value == "x"
        assert t.stats() == ZERO

    run(main())


@pytest.mark.parametrize("end", ["abort", "cleanup", "close"])
def test_cancel_after_handoff_step_ended_drops_item(end: str) -> None:
    t = WaitingTable()

    async def main() -> None:
        task = asyncio.create_task(t.recv(1, "k"))
        await asyncio.sleep(0)
        t.send(1, "k", "stale")
        if end == "abort":
            t.abort(1, Aborted("gone"))
        elif end == "cleanup":
            t.cleanup(1)
        else:
            t.close(Unavailable("bye"))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert t.stats()["tensors"] == 0
        if end == "cleanup":
            # a fresh step 1 must not see the stale item
            t.send(1, "k", "fresh")
            assert (await t.recv(1, "k")).value == "fresh"
            assert t.stats() == ZERO

    run(main())


def test_handoff_then_abort_without_cancel_still_delivers() -> None:
    t = WaitingTable()

    async def main() -> None:
        task = asyncio.create_task(t.recv(1, "k"))
        await asyncio.sleep(0)
        t.send(1, "k", "delivered")
        t.abort(1, Aborted("late"))
        assert (await asyncio.wait_for(task, SOON)).value == "delivered"

    run(main())


def test_wait_for_timeout_leaves_nothing_behind() -> None:
    t = WaitingTable()

    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(t.recv(1, "k"), 0.01)
        assert t.stats() == ZERO
        assert t.pending() == []
        t.send(1, "k", "v")
        assert t.stats() == {**ZERO, "steps": 1, "keys": 1, "tensors": 1}
        assert (await asyncio.wait_for(t.recv(1, "k"), SOON)).value == "v"

    run(main())


def test_many_concurrent_cancellations_nothing_lost_or_duplicated() -> None:
    # Interleave sends with receivers that get cancelled at various points.
    t = WaitingTable()
    n = 2000

    async def main() -> None:
        got: list[int] = []
        receivers = []
        for i in range(n):
            receivers.append(asyncio.create_task(t.recv(1, "k")))
            if i % 3 == 0:
                await asyncio.sleep(0)
            t.send(1, "k", i)
            if i % 2 == 0:
                receivers[-1 - (i % 5)].cancel()
        for r in receivers:
            try:
                got.append((await r).value)
            except asyncio.CancelledError:
                pass
        while t.stats()["tensors"]:
            got.append((await t.recv(1, "k")).value)
        assert sorted(got) == list(range(n))
        assert t.stats() == ZERO

    run(main())


# --------------------------------------------------------------- threads


def test_send_threadsafe_from_many_threads() -> None:
    t = WaitingTable()
    n_threads, per_thread, n_keys = 8, 1250, 10  # 10,000 items in all

    async def main() -> None:
        loop = asyncio.get_running_loop()
        start = threading.Barrier(n_threads)
        futures: list[list[concurrent.futures.Future[None]]] = [[] for _ in range(n_threads)]

        def produce(tid: int) -> None:
            start.wait()
            for i in range(per_thread):
                futures[tid].append(t.send_threadsafe(loop, 1, f"k{i % n_keys}", (tid, i)))

        async def consume(key: str, count: int) -> list[tuple[int, int]]:
            return [(await t.recv(1, key)).value for _ in range(count)]

        consumers = [
            asyncio.create_task(consume(f"k{k}", n_threads * per_thread // n_keys)) for k in range(n_keys)
        ]
        threads = [threading.Thread(target=produce, args=(tid,)) for tid in range(n_threads)]
        for th in threads:
            th.start()
        await asyncio.gather(*(loop.run_in_executor(None, th.join) for th in threads))
        all_futs = [f for fs in futures for f in fs]
        assert len(all_futs) == n_threads * per_thread
        await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(f) for f in all_futs)), 10)
        results = await asyncio.wait_for(asyncio.gather(*consumers), 10)

        items = [item for res in results for item in res]
        assert len(items) == len(set(items)) == n_threads * per_thread
        assert set(items) == {(tid, i) for tid in range(n_threads) for i in range(per_thread)}
        # each producer's items for a key arrive in the order it sent them
        for k, res in enumerate(results):
            assert all(i % n_keys == k for _, i in res)
            per_producer = collections.defaultdict(list)
            for tid, i in res:
                per_producer[tid].append(i)
            assert all(seq == sorted(seq) for seq in per_producer.values())
        assert t.stats() == ZERO

    run(main())


def test_send_threadsafe_to_aborted_step_raises_in_blocking_caller() -> None:
    t = WaitingTable()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        t.abort(3, Aborted("step 3 failed"))

        def blocking_producer() -> tuple[str, object]:
            ok = t.send_threadsafe(loop, 4, "k", "fine").result(timeout=SOON)
            try:
                t.send_threadsafe(loop, 3, "k", "x").result(timeout=SOON)
            except Aborted as exc:
                return exc.message, ok
            return "no error", ok

        message, ok = await loop.run_in_executor(None, blocking_producer)
        assert message == "step 3 failed"
        assert ok is None
        assert (await t.recv(4, "k")).value == "fine"
        assert t.stats() == {**ZERO, "tombstones": 1}

    run(main())


def test_send_threadsafe_closed_loop() -> None:
    t = WaitingTable()
    loop = asyncio.new_event_loop()
    loop.close()
    fut = t.send_threadsafe(loop, 1, "k", 0)
    with pytest.raises(RuntimeError):
        fut.result(timeout=SOON)


def test_off_thread_send_and_other_loop_refused() -> None:
    t = WaitingTable()  # constructed outside any loop

    async def main() -> None:
        t.send(1, "k", 0)  # binds to this loop
        loop = asyncio.get_running_loop()

        def off_thread() -> str:
            try:
                t.send(1, "k", 1)
            except RuntimeError as exc:
                return str(exc)
            return "accepted"

        assert "send_threadsafe" in await loop.run_in_executor(None, off_thread)

    run(main())

    async def other_loop() -> None:
        with pytest.raises(RuntimeError, match="different event loop"):
            await t.recv(1, "k")

    run(other_loop())


# ------------------------------------------------------ memory, pending


def test_memory_released_after_many_keys() -> None:
    t = WaitingTable()
    n = 200_000

    async def main() -> None:
        for i in range(n):
            t.send(i % 7, f"key;{i}", i)
        assert t.stats() == {**ZERO, "steps": 7, "keys": n, "tensors": n}
        for i in range(n):
            assert (await t.recv(i % 7, f"key;{i}")).value == i
        assert t.stats() == ZERO
        assert t._steps == {}

        # receivers first, then producers
        m = 20_000
        tasks = [asyncio.create_task(t.recv(i % 3, f"r;{i}")) for i in range(m)]
        await asyncio.sleep(0)
        assert t.stats()["waiters"] == m
        for i in range(m):
            t.send(i % 3, f"r;{i}", i)
        assert [r.value for r in await asyncio.gather(*tasks)] == list(range(m))
        assert t.stats() == ZERO
        assert t._steps == {}

        # cancelled / timed-out receivers leave nothing either
        tasks = [asyncio.create_task(t.recv(1, f"c;{i}")) for i in range(m)]
        await asyncio.sleep(0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert t.stats() == ZERO
        assert t._steps == {}

        # aborted and cleaned-up steps leave nothing
        for step in range(1000):
            t.send(step, "k", step)
            t.abort(step, Aborted("x"))
            t.cleanup(step)
        assert t.stats() == ZERO
        assert t._steps == {} and not t._tombstones and not t._ended

    run(main())


def test_pending_reports_kind_count_age(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(table_mod, "_now", lambda: clock[0])
    t = WaitingTable()

    async def main() -> None:
        assert t.pending() == []
        t.send(1, "a", "x")
        clock[0] += 1.5
        t.send(1, "a", "y")
        waiter = asyncio.create_task(t.recv(2, "b"))
        await _settle()
        clock[0] += 2.0
        got = sorted(t.pending())
        assert got == [
            PendingEntry(1, "a", "tensor", 2, 3.5),
            PendingEntry(2, "b", "waiter", 1, 2.0),
        ]
        assert len(t) == 3
        t.send(2, "b", "z")
        await asyncio.wait_for(waiter, SOON)
        assert (await t.recv(1, "a")).value == "x"
        assert t.pending() == [PendingEntry(1, "a", "tensor", 1, 2.0)]

    run(main())


def test_refused_send_into_an_aborted_step_does_not_keep_the_tensor():
    import gc
    import weakref

    t = WaitingTable()
    t.abort(1, Aborted("gone"))
    value = np.ones(1024)
    ref = weakref.ref(value)

    def produce(v):
        t.send(1, "k", v)

    with pytest.raises(Aborted):
        produce(value)
    del value
    gc.collect()
    assert ref() is None, "the stored abort error keeps the refused tensor alive"
    assert t.aborted(1).message == "gone"


# ---------------------------------------------------------------- waiters answered by a call


def _waiter(on_item, on_error=lambda error: None):
    """A table Waiter whose calls go to ``on_item`` and ``on_error``."""
    from rendezvous.table import Waiter

    class Calls(Waiter):
        def set_result(self, item):
            self.settled = True
            on_item(item)

        def set_exception(self, error):
            self.settled = True
            on_error(error)

    return Calls()


def test_a_waiter_is_answered_inside_the_send_in_fifo_order_with_futures() -> None:
    t = WaitingTable()

    async def main() -> None:
        got: list = []
        first = _waiter(got.append)
        t.wait(1, "k", first)
        later = asyncio.ensure_future(t.recv(1, "k"))
        await _settle()
        t.send(1, "k", "a")
        assert got == [Received("a", False)] and first.settled  # before send returned
        t.send(1, "k", "b")
        assert await asyncio.wait_for(later, SOON) == Received("b", False)
        assert t.stats() == ZERO

    run(main())


def test_a_waiter_may_use_the_table_while_it_is_answered() -> None:
    """The table is whole again before a waiter's call: one that puts its item
    back (its reply failed) leaves it queued, not lost to the queue's cleanup."""
    t = WaitingTable()

    async def main() -> None:
        t.wait(1, "k", _waiter(lambda item: t.requeue(1, "k", item)))
        t.send(1, "k", "kept")
        assert t.stats() == {**ZERO, "steps": 1, "keys": 1, "tensors": 1}
        assert await t.recv(1, "k") == Received("kept", False)

    run(main())


def test_a_withdrawn_waiter_is_never_called_and_an_ended_step_fails_the_others() -> None:
    t = WaitingTable()

    async def main() -> None:
        calls: list = []
        gone = _waiter(lambda i: calls.append(("gone", i)), lambda e: calls.append(("gone", e)))
        stays = _waiter(lambda i: calls.append(("stays", i)), lambda e: calls.append(("stays", e)))
        t.wait(1, "k", gone)
        t.wait(1, "k", stays)
        assert t.withdraw(1, "k", gone) and not t.withdraw(1, "k", gone)
        assert t.stats()["waiters"] == 1
        error = Aborted("enough")
        t.abort(1, error)
        assert calls == [("stays", error)]
        with pytest.raises(Aborted):
            t.wait(1, "k", _waiter(calls.append, calls.append))  # the step's error, nothing queued
        assert t.stats()["waiters"] == 0

    run(main())
