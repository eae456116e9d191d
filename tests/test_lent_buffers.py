"""Lent buffers: ``Client.empty`` makes an array on a pool segment lent to the
session, a send hands that segment over with no copy, and a receiver on the
node gets a view on the same memory; a received array is sent on the same way.

"No copy" is checked by making the client's copy into a segment fail: a send
that copied would raise. "The same memory" is checked by segment id (the pool's
ids are the daemon's, one per segment)."""

from __future__ import annotations

import asyncio
import gc
import sys

import numpy as np
import pytest

from rendezvous.client import Client as BlockingClient
from rendezvous.client.aio import Client

from conftest import run, until
from test_daemon import HERE, _segment_files, daemons, key

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def sockdir():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="rdv", dir="/tmp") as d:  # a socket path fits 107 bytes
        yield Path(d)


@pytest.fixture(autouse=True)
def no_leaked_segments():
    yield
    gc.collect()
    assert _segment_files() == 0, "pool segments left open or mapped"


def _no_copies(client) -> None:
    """Any copy into a segment by ``client`` fails the send that makes it."""
    def refuse(seg_id, arr):
        raise AssertionError(f"a send copied {arr.nbytes} bytes into segment {seg_id}")
    client._link.segments.write = refuse


def _lent_segment(client, arr: np.ndarray) -> int:
    return client._link.segments._loans[id(arr.base)][0]


def _received_segment(client, arr: np.ndarray) -> int:
    return client._link.segments._views[id(arr.base)][0]


def test_an_empty_array_is_sent_with_no_copy_and_received_on_the_same_memory(sockdir):
    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target) as a, Client(d.local_target) as b:
            x = await a.empty((64, 1024), np.float32)
            assert x.shape == (64, 1024) and x.dtype == np.float32 and x.flags.writeable and x.flags.c_contiguous
            x[:] = np.arange(x.size, dtype=np.float32).reshape(x.shape)
            seg = _lent_segment(a, x)
            _no_copies(a)
            await a.send(key(0, 0, "w"), x, step_id=1)
            assert a.stats() == {"empty_lent": 1, "send_handed_over": 1}
            with pytest.raises(ValueError, match="read-only"):
                x[0, 0] = 1.0  # the tensor's now
            got = await b.recv(key(0, 0, "w"), step_id=1, timeout=10)
            assert _received_segment(b, got) == seg  # the very memory a filled
            np.testing.assert_array_equal(got, np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024))
            assert b.stats()["recv_shm"] == 1
            del got, x
            gc.collect()
            await until(lambda: d.pool.stats()["held"] == 0 and d.pool.stats()["in_table"] == 0,
                        what="the segment back in the pool")
    run(main())


def test_even_a_small_lent_array_is_handed_over(sockdir):
    """Below the shared-memory threshold a copy would go inline; a lent array
    is on a segment already, so it is handed over all the same, by send and
    by send_many (which packs small arrays inline, but never a lent one)."""
    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target) as a, Client(d.local_target) as b:
            x, y = await a.empty(256, np.uint8), await a.empty((16, 16), np.uint8)
            x[:], y[:] = 7, 8
            _no_copies(a)
            await a.send(key(0, 0, "s"), x, step_id=1)
            await a.send_many({key(0, 0, "small"): np.ones(4, np.uint8), key(0, 0, "s2"): y}, step_id=1)
            assert a.stats() == {"empty_lent": 2, "send_handed_over": 2, "send_inline": 1}
            for name, value in (("s", 7), ("s2", 8)):
                got = await b.recv(key(0, 0, name), step_id=1, timeout=10)
                assert got.nbytes == 256 and (got == value).all()
            assert (await b.recv(key(0, 0, "small"), step_id=1, timeout=10) == 1).all()
            del got
    run(main())


def test_a_received_array_is_sent_on_with_no_copy(sockdir):
    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target) as a, \
                Client(d.local_target) as b, Client(d.local_target) as c:
            await a.send(key(0, 0, "first"), np.full(1 << 18, 3, np.int32), step_id=2)
            got = await b.recv(key(0, 0, "first"), step_id=2, timeout=10)
            seg = _received_segment(b, got)
            _no_copies(b)
            await b.send(key(0, 0, "on"), got, step_id=2)
            assert b.stats()["send_handed_over"] == 1 and not got.flags.writeable
            again = await c.recv(key(0, 0, "on"), step_id=2, timeout=10)
            assert _received_segment(c, again) == seg and (again == 3).all()
            del got
            gc.collect()
            # the segment is c's now: b, which sent it on, never releases it (a
            # release told later could let go of the segment when it is b's again)
            assert b._link.segments._released == [] and d.pool.get(seg).held_by is not None
            del again
            gc.collect()
            await until(lambda: d.pool.stats()["held"] == 0 and d.pool.get(seg).free, what="the segment free again")
    run(main())


def test_an_array_dropped_unsent_gives_its_segment_back_to_the_client(sockdir):
    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target) as a:
            x = await a.empty(1 << 20, np.uint8)
            seg = _lent_segment(a, x)
            lent = d.pool.stats()["lent"]
            del x
            gc.collect()
            y = await a.empty(1 << 20, np.uint8)  # from the client's stock: no new lend
            assert _lent_segment(a, y) == seg and d.pool.stats()["lent"] == lent
            assert a.stats() == {"empty_lent": 2}
            del y
    run(main())


def test_lent_arrays_count_against_the_sessions_share(sockdir):
    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target) as a, Client(d.local_target) as b:
            d.sessions.segment_share = 2
            kept = [await a.empty(1 << 16, np.uint8) for _ in range(2)]
            private = await a.empty(1 << 16, np.uint8)  # over the share: an ordinary array
            assert a.stats() == {"empty_lent": 2, "empty_private": 1}
            assert private.base is None or id(private.base) not in a._link.segments._loans
            private[:] = 5
            await a.send(key(0, 0, "p"), private, step_id=1)  # copied as any array (inline: no segment left)
            assert private.flags.writeable
            assert ((await b.recv(key(0, 0, "p"), step_id=1, timeout=10)) == 5).all()
            del kept
    run(main())


def test_a_view_that_does_not_start_the_segment_is_copied(sockdir):
    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target) as a, Client(d.local_target) as b:
            x = await a.zeros(1 << 16, np.float32)
            x[100:] = 2.0
            await a.send(key(0, 0, "tail"), x[100:], step_id=1)
            assert "send_handed_over" not in a.stats() and x.flags.writeable  # still the client's
            got = await b.recv(key(0, 0, "tail"), step_id=1, timeout=10)
            assert got.shape == ((1 << 16) - 100,) and (got == 2.0).all()
            await a.send(key(0, 0, "twice"), x, step_id=1)  # handed over
            await a.send(key(0, 0, "twice"), x, step_id=1)  # the same bytes again: copied
            assert a.stats()["send_handed_over"] == 1
            for _ in range(2):
                again = await b.recv(key(0, 0, "twice"), step_id=1, timeout=10)
                assert (again[:100] == 0).all() and (again[100:] == 2.0).all()
            del got, again, x
    run(main())


def test_without_shared_memory_empty_is_an_ordinary_array(sockdir):
    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target, shm_ok=False) as a, \
                Client(d.local_target) as b:
            x = await a.empty((3, 4), np.int64)
            x[:] = 9
            await a.send(key(0, 0, "g"), x, step_id=1)
            assert a.stats()["empty_private"] == 1 and x.flags.writeable
            assert ((await b.recv(key(0, 0, "g"), step_id=1, timeout=10)) == 9).all()
            with pytest.raises(Exception, match="fixed-size dtypes"):
                await a.empty(3, object)
    run(main())


def test_the_blocking_client_lends_arrays_too(sockdir):
    async def main():
        async with daemons(sockdir) as (d,):
            def work() -> None:
                with BlockingClient(d.local_target) as a, BlockingClient(d.local_target) as b:
                    x = a.zeros((8, 8), np.float64)
                    assert (x == 0).all() and a.stats()["empty_lent"] == 1
                    x += 1.5
                    _no_copies(a)
                    a.send(key(0, 0, "b"), x, step_id=4)
                    got = b.recv(key(0, 0, "b"), step_id=4, timeout=10)
                    assert (got == 1.5).all() and a.stats()["send_handed_over"] == 1
                    assert _received_segment(b, got) is not None
                    del got

            await asyncio.get_running_loop().run_in_executor(None, work)
    run(main())


def test_a_client_killed_holding_lent_arrays_gives_them_back(sockdir):
    async def main():
        async with daemons(sockdir) as (d,):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, str(HERE / "daemon_clients.py"), "hold_lent", d.local_target,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
            try:
                line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
                assert line.startswith("LENT 3"), line
                assert d.pool.stats()["lent"] >= 3
                proc.kill()  # dies holding three lent arrays
                await proc.wait()
                await until(lambda: d.pool.stats()["lent"] == 0, what="the dead client's lent segments back")
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
    run(main())


def test_a_rank_server_sends_on_what_it_received_without_a_copy():
    """In a rank server's own process the table holds the array itself: a
    tensor received and sent on is the same memory at its next receiver."""
    from conftest import cluster, key as rank_key

    async def main():
        async with cluster(2) as (a, b):
            b.send(rank_key(1, 0, "in"), np.arange(1 << 16, dtype=np.float32))
            got = await a.recv(rank_key(1, 0, "in"), timeout=10)
            a.send(rank_key(0, 0, "on"), got)
            again = await a.recv(rank_key(0, 0, "on"), timeout=10)
            assert again is got or np.shares_memory(again, got)
    run(main())


def test_two_threads_sending_one_lent_array_hand_it_over_once(sockdir):
    """The segment goes to one send; the other, racing it, copies the same bytes."""
    async def main():
        async with daemons(sockdir) as (d,):
            def work() -> None:
                import threading

                with BlockingClient(d.local_target) as a, BlockingClient(d.local_target) as b:
                    x = a.empty(1 << 18, np.uint8)
                    x[:] = 42
                    go = threading.Barrier(2)
                    errors: list[BaseException] = []

                    def send(name: str) -> None:
                        try:
                            go.wait(10)
                            a.send(key(0, 0, name), x, step_id=5)
                        except BaseException as exc:  # reported below
                            errors.append(exc)

                    threads = [threading.Thread(target=send, args=(n,)) for n in ("p", "q")]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join(30)
                    assert not errors, errors
                    assert a.stats()["send_handed_over"] == 1 and a.stats()["send_shm"] == 1
                    for name in ("p", "q"):
                        got = b.recv(key(0, 0, name), step_id=5, timeout=10)
                        assert (got == 42).all()
                    del got, x

            await asyncio.get_running_loop().run_in_executor(None, work)
    run(main())


def test_a_received_segment_is_sent_on_only_by_its_holder_and_once(sockdir):
    """A send may name a segment its session holds (a tensor it received): never
    one another client holds, and never one it has sent on already."""
    from rendezvous import errors
    from rendezvous.client.core import LocalOp
    from rendezvous.local.frames import Kind

    from test_daemon import pooled

    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target) as a, \
                Client(d.local_target) as b, Client(d.local_target) as c:
            value = np.arange(1 << 15, dtype=np.float64)
            await a.send(key(0, 0, "x"), value, step_id=1)
            got = await b.recv(key(0, 0, "x"), step_id=1, timeout=10)
            seg = _received_segment(b, got)
            with pytest.raises(errors.InvalidArgument, match="not lent to this client"):
                await c._link.call(LocalOp(Kind.SEND, pooled(1, "stolen", value, seg), 10))
            assert d.pool.get(seg).held_by is not None and not d.server.pending()  # still b's
            await b.send(key(0, 0, "on"), got, step_id=1)  # its holder: handed over
            with pytest.raises(errors.InvalidArgument, match="not lent to this client"):
                await b._link.call(LocalOp(Kind.SEND, pooled(1, "twice", value, seg), 10))
            np.testing.assert_array_equal(await c.recv(key(0, 0, "on"), step_id=1, timeout=10), value)
            assert not d.server.pending()
            del got
    run(main())
