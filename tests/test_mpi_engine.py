"""The MPI progress engine in one process (a singleton MPI world sending to itself)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

pytest.importorskip("mpi4py")

from rendezvous.errors import Internal, Unavailable  # noqa: E402
from rendezvous.mpi.engine import ProgressEngine  # noqa: E402

from conftest import run, until  # noqa: E402


@pytest.fixture(scope="module")
def comm():
    from rendezvous.mpi.world import import_mpi

    MPI = import_mpi()
    c = MPI.COMM_WORLD.Dup()
    yield c
    c.Free()


def test_pairs_by_tag_not_order_and_chunks(comm):
    async def main():
        engine = ProgressEngine(comm, poll_min_us=5, poll_max_us=200)
        engine.start()
        try:
            a = np.arange(10_000, dtype=np.uint8)
            b = (np.arange(3_001, dtype=np.uint8) * 7).astype(np.uint8)
            got_a, got_b = np.empty_like(a), np.empty_like(b)
            # receives posted in the opposite order of the sends; a is chunked
            ra = engine.irecv(got_a, 0, 11, 1000)
            rb = engine.irecv(got_b, 0, 12, 1000)
            await asyncio.gather(engine.isend(b, 0, 12, 1000), engine.isend(a, 0, 11, 1000), ra, rb)
            assert np.array_equal(got_a, a) and np.array_equal(got_b, b)
            empty = np.empty(0, np.uint8)
            await asyncio.gather(engine.isend(empty, 0, 13, 1000), engine.irecv(np.empty(0, np.uint8), 0, 13, 1000))
            assert engine.in_flight == 0
        finally:
            engine.stop()
    run(main())


def test_errors_are_values_and_call_runs_on_the_mpi_thread(comm):
    async def main():
        import threading

        engine = ProgressEngine(comm)
        engine.start()
        try:
            with pytest.raises(Internal, match="rank 5"):
                await engine.isend(np.ones(4, np.uint8), 5, 1, 1000)  # no such rank
            name = await engine.call(lambda: threading.current_thread().name)
            assert name == "rendezvous-mpi"
            with pytest.raises(ZeroDivisionError):
                await engine.call(lambda: 1 / 0)
            # still working after the errors
            buf = np.empty(8, np.uint8)
            await asyncio.gather(engine.isend(np.full(8, 3, np.uint8), 0, 2, 1000), engine.irecv(buf, 0, 2, 1000))
            assert buf.tolist() == [3] * 8
        finally:
            engine.stop()
        with pytest.raises(Unavailable):
            engine.isend(np.ones(1, np.uint8), 0, 3, 1000)
        engine.stop()  # twice is fine
    run(main())


def test_idle_engine_does_not_poll_and_stop_cancels_unmatched(comm):
    async def main():
        engine = ProgressEngine(comm, poll_min_us=5, poll_max_us=100)
        engine.start()
        await engine.call(lambda: None)
        before = engine.polls
        await asyncio.get_running_loop().run_in_executor(None, engine._thread.join, 0.3)
        assert engine.polls == before, "polled with nothing in flight"
        # a receive nobody sends to: stop() cancels it after its timeout
        pending = engine.irecv(np.empty(4, np.uint8), 0, 99, 1000)
        await asyncio.get_running_loop().run_in_executor(None, engine.stop, 0.2)
        with pytest.raises(Unavailable):
            await pending
    run(main())


def test_listened_messages_are_handed_over_in_the_order_they_were_sent(comm):
    """A large control message (received by MPI's rendezvous protocol) followed by
    small ones (eager) from the same rank: their receives may complete in the
    other order, and a listener once got them so (a stream's cancel before the
    request it cancels: the call then waited forever). They are handed over in
    the order sent."""
    async def main():
        engine = ProgressEngine(comm, poll_min_us=5, poll_max_us=200)
        engine.start()
        got: list[bytes] = []
        arrived = asyncio.Event()
        rounds = 20

        def deliver(messages):
            got.extend(body for _, body in messages)
            if len(got) == 3 * rounds:
                arrived.set()

        try:
            engine.listen(comm, 21, deliver)
            sends = []
            for i in range(rounds):
                big = bytes([i % 251]) * (4 << 20)
                sends += [engine.isend(big, 0, 21, 1 << 30), engine.isend(b"small-%d" % i, 0, 21, 1 << 30),
                          engine.isend(b"tiny-%d" % i, 0, 21, 1 << 30)]
            await asyncio.gather(*sends)
            await asyncio.wait_for(arrived.wait(), 30)
            for i in range(rounds):
                big, small, tiny = got[3 * i:3 * i + 3]
                assert len(big) == 4 << 20 and big[0] == i % 251, (i, len(big))
                assert (small, tiny) == (b"small-%d" % i, b"tiny-%d" % i)
        finally:
            engine.stop()
    run(main())


def test_touch_ends_the_idle_pace_at_once(comm):
    """An engine idle between steps probes for requests only every
    idle_poll_ms (here ten minutes); a tensor produced on its rank (touch)
    makes it probe at once, so a request that came meanwhile is taken now."""
    async def main():
        engine = ProgressEngine(comm, poll_min_us=5, poll_max_us=100, idle_poll_ms=600_000, idle_after_s=0)
        engine.start()
        got = asyncio.Event()
        try:
            engine.listen(comm, 31, lambda messages: got.set())
            await until(lambda: engine._idle, what="the engine to reach its idle pace")
            # sent past the engine (not one of its operations): nothing of its own moved
            req = comm.Isend([b"request", 7, engine._MPI.BYTE], 0, 31)
            engine.touch()
            await asyncio.wait_for(got.wait(), 10)  # not ten minutes
            req.Wait()
        finally:
            engine.stop()
    run(main(), 30)


def test_a_listener_hands_a_sources_messages_over_in_match_order():
    """The rule on its own: receives completing out of order wait for the earlier
    ones of the same source; another source's go at once."""
    from rendezvous.mpi.ops import Listener, Op, OpKind

    loop = asyncio.new_event_loop()
    try:
        listener = Listener(None, 1, loop, lambda m: None)
        ops = {}
        for name, source in (("a1", 1), ("a2", 1), ("b1", 2)):
            op = ops[name] = Op(OpKind.TAKE, loop, None, bytearray(name.encode()), source, 1)
            op.remaining = 1
            listener.matched(op)
        bufs = {name: id(op.buf) for name, op in ops.items()}
        for name in ("a2", "b1"):  # a2 completes before a1; b1 is another source's
            ops[name].remaining = 0
            listener.received(ops[name].peer)
        assert listener.taken == [(2, b"b1")]
        ops["a1"].remaining = 0
        listener.received(1)
        assert listener.taken == [(2, b"b1"), (1, b"a1"), (1, b"a2")]
        # each message is the very buffer it was received into: handed over, not copied
        assert [id(buf) for _, buf in listener.taken] == [bufs[n] for n in ("b1", "a1", "a2")]
        assert not listener.order
    finally:
        loop.close()


@pytest.mark.parametrize("remote", [True, False], ids=["remote-peer", "node-local-peer"])
def test_the_home_loop_polls_only_transfers_with_its_loop_peers(comm, remote):
    """With ``loop_peers`` (the blocking Server), a transfer with a rank in it
    makes the home loop poll (a rank MPI reaches over the network moves only
    as fast as it is polled); any other is left to the MPI thread, and the
    loop thread leaves the GIL to the caller's. Both complete either way."""
    async def main():
        engine = ProgressEngine(comm)
        engine.start(loop_polls=True, loop_peers=frozenset())
        engine.attach(comm)
        engine.loop_peers = frozenset({0}) if remote else frozenset()  # as set once the job's ranks are known
        try:
            data = np.arange(4096, dtype=np.uint8)
            got = np.empty_like(data)
            received = engine.irecv(got, 0, 21, 1 << 20)
            assert engine._loop_polling is remote
            await asyncio.gather(engine.isend(data, 0, 21, 1 << 20), received)
            assert np.array_equal(got, data) and engine.in_flight == 0
        finally:
            engine.stop()
    run(main())


def test_the_home_loop_polls_every_transfer_only_while_a_caller_attends(comm):
    """With callers counted (the blocking Server): nobody waiting, a node-local
    transfer is the MPI thread's; while a caller waits the loop polls it,
    and a caller that stops waiting hands polling back within a turn even
    with a transfer still in flight. Every transfer completes either way."""
    async def main():
        engine = ProgressEngine(comm)
        engine.start(loop_polls=True, loop_peers=frozenset())
        engine.attach(comm)
        engine.attended = 0
        try:
            data = np.arange(4096, dtype=np.uint8)
            got = np.empty_like(data)
            received = engine.irecv(got, 0, 22, 1 << 20)
            assert not engine._loop_polling  # nobody waits: the MPI thread's
            await asyncio.gather(engine.isend(data, 0, 22, 1 << 20), received)
            assert np.array_equal(got, data)

            engine.attend(1)
            assert engine._loop_polling  # a caller waits: the loop polls at once
            got = np.empty_like(data)
            received = engine.irecv(got, 0, 23, 1 << 20)
            await asyncio.gather(engine.isend(data, 0, 23, 1 << 20), received)
            assert np.array_equal(got, data) and engine._loop_polling

            pending = engine.irecv(np.empty_like(data), 0, 24, 1 << 20)  # stays in flight
            engine.attend(-1)
            assert engine.attended == 0
            await until(lambda: not engine._loop_polling, what="the loop handing polling back")
            await asyncio.gather(engine.isend(data, 0, 24, 1 << 20), pending)  # the MPI thread completes it
            assert engine.in_flight == 0 and not engine._loop_polling
        finally:
            engine.stop()
    run(main())


def test_the_world_names_no_rank_remote_on_one_node():
    """A singleton world (one node, shared memory): no rank is reached over the network."""
    from rendezvous.keys import TaskName
    from rendezvous.mpi.world import MpiWorld

    world = MpiWorld.join()
    world.exchange(TaskName("w", 0, 0), "127.0.0.1:1")
    try:
        assert world.remote_ranks == frozenset()
    finally:
        world.control.Free()
        world.comm.Free()


def test_a_quiet_engine_keeps_calling_mpi_ever_less_often(comm):
    """With nothing in flight and nobody listening the MPI thread still calls
    into MPI (a peer's send may wait on it: see test_mpi.py's
    test_an_idle_rank_still_lets_its_peers_sends_complete): every idle_poll
    just after traffic, then a quarter of the time since, at most a second;
    its probes are counted, and nothing is tested for completion."""
    async def main():
        engine = ProgressEngine(comm, idle_poll_ms=10)
        now = 1000.0
        engine._last_activity = now
        assert engine._quiet_pause(now) == engine.idle_poll == 0.01
        assert engine._quiet_pause(now + 0.02) == 0.01
        assert engine._quiet_pause(now + 0.4) == pytest.approx(0.1)
        assert engine._quiet_pause(now + 60) == 1.0
        engine.start()
        try:
            await engine.call(lambda: None)
            probes, polls = engine.probes, engine.polls
            await until(lambda: engine.probes >= probes + 2, what="two progress calls of a quiet engine")
            assert engine.polls == polls  # nothing in flight: nothing tested
        finally:
            engine.stop()
    run(main())


def test_an_idle_listening_engine_probes_ever_less_often(comm):
    """Listening (requests over MPI) and idle, the MPI thread probes every
    idle_poll at first, then at a 32nd of the time since traffic, at most
    every 50 ms: each wake-up costs CPU, and a request reaching a rank quiet
    for a while waits at most a 32nd longer than the quiet. A touch (a
    tensor produced) makes it attentive again at once."""
    engine = ProgressEngine(comm, idle_poll_ms=10)
    now = 1000.0
    engine._last_activity = now - engine.idle_after  # just went idle
    assert engine._listen_pause(now) == engine.idle_poll == 0.01
    engine._last_activity = now - 0.96
    assert engine._listen_pause(now) == pytest.approx(0.03)
    engine._last_activity = now - 600
    assert engine._listen_pause(now) == 0.05
    assert engine._pause_after(20e-6, True, now) == 0.05  # the idle pace
    assert engine._pause_after(20e-6, False, now) == 40e-6  # not idle: the backoff, as before
    engine.touch()
    assert engine._listen_pause(time.monotonic()) == engine.idle_poll  # traffic likely: the pace starts over


def test_a_large_transfer_stalled_in_flight_is_polled_without_pauses(comm):
    """Without a single-copy path a large message moves only as it is polled:
    while one is in flight and nothing has moved for a while the MPI thread
    stops pausing; a small one, a large one that just moved, or an idle
    engine back off as before. The count of large transfers in flight
    returns to zero as they complete."""
    async def main():
        engine = ProgressEngine(comm, poll_min_us=10, poll_max_us=50)
        engine.start()
        try:
            now = 1000.0
            engine._last_activity = now - 1.0  # nothing moved for a second
            assert engine._pause_after(20e-6, False, now) == 40e-6  # nothing large: backing off
            engine._large = 1
            assert engine._pause_after(20e-6, False, now) == 0.0  # large and stalled: no pause
            assert engine._pause_after(20e-6, True, now) == engine._listen_pause(now)  # idle is idle
            engine._last_activity = now  # it just moved: back off as usual
            assert engine._pause_after(20e-6, False, now) == 40e-6
            engine._large = 0
            big = np.arange(1 << 20, dtype=np.uint8)
            small = np.arange(100, dtype=np.uint8)
            got_big, got_small = np.empty_like(big), np.empty_like(small)
            recvs = [engine.irecv(got_big, 0, 21, 1 << 18), engine.irecv(got_small, 0, 22, 1 << 18)]
            await until(lambda: engine._large == 1, what="the large receive (not the small one) to count")
            await asyncio.gather(engine.isend(small, 0, 22, 1 << 18), engine.isend(big, 0, 21, 1 << 18), *recvs)
            assert np.array_equal(got_big, big) and np.array_equal(got_small, small)
            assert engine._large == 0 and engine.in_flight == 0
            # A peer whose large messages move in one copy (this node's, with
            # CMA) needs no polling: its transfers never count, nothing spins.
            engine.copied_peers = frozenset({0})
            recv = engine.irecv(got_big, 0, 23, 1 << 18)
            await until(lambda: engine.in_flight == 1, what="the receive to be posted")
            assert engine._large == 0
            await asyncio.gather(engine.isend(big, 0, 23, 1 << 18), recv)
            assert engine._large == 0 and engine.in_flight == 0
        finally:
            engine.stop()
    run(main())
