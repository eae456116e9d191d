"""Ranks as separate OS processes on loopback (rendezvous.rank.launch.run_local)."""

from __future__ import annotations

import numpy as np
import pytest

from rendezvous import errors
from rendezvous.rank.launch import RankFailed, run_local

SIZES = [0, 1, 1000, 1 << 16, (1 << 20) + 7, 16 << 20, 256 << 20]


def _k(src: int, dst: int, name: str) -> str:
    return (f"/job:worker/replica:0/task:{src}/device:CPU:0;0000000000000000;"
            f"/job:worker/replica:0/task:{dst}/device:CPU:0;{name};0:0")


def _pattern(n: int, seed: int) -> np.ndarray:
    # cheap to build and to check, and different at every offset
    return (np.arange(n, dtype=np.uint64) * 2654435761 + seed).astype(np.uint8)


def exchange(server, sizes):
    """Each rank sends every size to the other and checks what it receives."""
    me = server.task.task
    other = 1 - me
    for i, n in enumerate(sizes):
        server.send(_k(me, other, f"t{i}"), _pattern(n, me), step_id=1)
    checked = []
    for i, n in enumerate(sizes):
        got = server.recv(_k(other, me, f"t{i}"), step_id=1, timeout=120)
        assert got.shape == (n,) and got.dtype == np.uint8
        assert np.array_equal(got, _pattern(n, other)), f"size {n}: content differs"
        checked.append(n)
    return {"checked": checked, "stats": server.stats()}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_exchange_all_sizes():
    results = run_local(exchange, {"worker": 2}, args=(SIZES,), timeout=280)
    assert len(results) == 2
    for r in results.values():
        assert r["checked"] == SIZES
        assert r["stats"]["grpc"]["transfers"] == len(SIZES)
        assert r["stats"]["grpc"]["bytes"] == sum(SIZES)


def fail_on_one(server):
    if server.task.task == 1:
        raise ValueError("rank 1 broke on purpose")
    # rank 0 would wait forever for a tensor rank 1 never sends
    return server.recv(_k(1, 0, "never"), timeout=100)


@pytest.mark.timeout(60)
def test_failing_rank_ends_the_run():
    with pytest.raises(RankFailed, match="rank 1 broke on purpose"):
        run_local(fail_on_one, {"worker": 2}, timeout=50)


def _producer(conn):
    import rendezvous

    server = rendezvous.Server({"worker": ["127.0.0.1:0", "127.0.0.1:0"]}, "worker", 1)
    server.start()
    server.send(_k(1, 0, "first"), np.arange(3), step_id=1)
    conn.send(server.target)
    conn.recv()  # until killed


@pytest.mark.timeout(60)
def test_peer_death_gives_unavailable():
    import asyncio
    import multiprocessing as mp

    from rendezvous import aio

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(child,))
    proc.start()
    try:
        assert parent.poll(30), "producer did not start"
        target = parent.recv()

        async def main():
            a = aio.Server({"worker": ["127.0.0.1:0", target]}, "worker", 0, reconnect_attempts=2)
            await a.start()
            try:
                np.testing.assert_array_equal(await a.recv(_k(1, 0, "first"), step_id=1, timeout=20), np.arange(3))
                orphan = asyncio.ensure_future(a.recv(_k(1, 0, "orphan"), step_id=1, timeout=30))
                proc.kill()
                with pytest.raises(errors.PeerUnavailable, match="task:1"):
                    await orphan
                # and a fresh recv to the dead peer fails the same way, quickly
                with pytest.raises(errors.PeerUnavailable):
                    await a.recv(_k(1, 0, "after"), step_id=1, timeout=30)
            finally:
                await a.stop(0)

        asyncio.run(main())
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()


def three_ranks(server):
    me = server.task.task
    for dst in range(3):
        if dst != me:
            server.send(_k(me, dst, "hello"), np.array([me, dst]), step_id=2)
    got = sorted(tuple(server.recv(_k(src, me, "hello"), step_id=2, timeout=60)) for src in range(3) if src != me)
    return got


@pytest.mark.timeout(120)
def test_three_ranks_all_to_all():
    results = run_local(three_ranks, {"worker": 3}, timeout=100)
    for name, got in results.items():
        me = int(name.rsplit(":", 1)[1])
        assert got == sorted((src, me) for src in range(3) if src != me)
