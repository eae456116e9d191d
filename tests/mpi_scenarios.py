"""Scenarios run under `mpiexec -n N python tests/mpi_scenarios.py NAME` by test_mpi.py.

Each rank prints `RESULT <json>` lines for the test to check. Any exception
aborts the whole MPI job (when MPI is up) so a failing rank never leaves the
others hanging; without MPI the rank just exits non-zero.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time

import numpy as np

import rendezvous
from rendezvous.keys import TaskName
from rendezvous.rank.launch import launcher_rank


import mpi_abort  # noqa: E402,F401  (a failing rank aborts the job)


def key(src: str, dst: str, name: str) -> str:
    return f"{src}/device:CPU:0;0000000000000000;{dst}/device:CPU:0;{name};0:0"


def worker(i: int) -> str:
    return f"/job:worker/replica:0/task:{i}"


def pattern(n: int, seed: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint64) * 2654435761 + seed).astype(np.uint8)


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    """Poll ``predicate`` until it holds; fail (and so abort the job) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.001)


def result(**fields) -> None:
    sys.stdout.write("RESULT " + json.dumps(fields) + "\n")  # one write
    sys.stdout.flush()


def start(n: int, **overrides) -> rendezvous.Server:
    rank, _ = launcher_rank() or (0, 1)
    server = rendezvous.Server({"worker": ["127.0.0.1:0"] * n}, "worker", rank, protocol="grpc+mpi", **overrides)
    server.start()
    if server.config.mpi_disabled:
        # No MPI allgather to publish the OS-chosen ports: ask the test's coordinator.
        server.update_cluster({"worker": exchange_addresses(rank, server.target)})
    return server


def exchange_addresses(rank: int, address: str) -> list[str]:
    import socket

    host, port = os.environ["RENDEZVOUS_TEST_COORD"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall((json.dumps([rank, address]) + "\n").encode())
        return json.loads(conn.makefile().readline())


def finish(server: rendezvous.Server, step_id: int = 999) -> None:
    """Tell the other rank we are done fetching, and wait for it to be done too,
    so no rank stops while its peer still fetches from it."""
    me = server.task.task
    other = 1 - me
    server.send(key(worker(me), worker(other), "finished"), np.ones(1), step_id=step_id)
    server.recv(key(worker(other), worker(me), "finished"), step_id=step_id, timeout=120)


def expected_path(nbytes: int, cfg) -> str:
    if cfg.mpi_disabled:
        return "grpc"
    if cfg.mpi_requests:
        return "mpi"  # asked and answered over MPI: inline replies too
    if not cfg.mpi_optimal_path or nbytes < cfg.mpi_threshold:
        return "grpc"
    return "mpi"


def sizes(arg: str = "full") -> None:
    """Every size to the other rank and back, content checked, path checked."""
    table = {
        "full": [0, 1, 1023, 1024, 1 << 16, (1 << 20) + 7, 16 << 20, 256 << 20],
        "small": [0, 100, 1023, 1024, 1 << 20],
    }[arg]
    server = start(2)
    me = server.task.task
    other = 1 - me
    cfg = server.config
    for i, n in enumerate(table):
        server.send(key(worker(me), worker(other), f"t{i}"), pattern(n, me), step_id=1)
    for i, n in enumerate(table):
        before = server.stats()
        got = server.recv(key(worker(other), worker(me), f"t{i}"), step_id=1, timeout=120)
        after = server.stats()
        assert got.dtype == np.uint8 and got.shape == (n,), (got.dtype, got.shape)
        assert np.array_equal(got, pattern(n, other)), f"size {n}: content differs"
        path = expected_path(n, cfg)
        assert after[path]["transfers"] == before[path]["transfers"] + 1, (n, path, after)
    # a non-memcpy-able dtype above the threshold falls back to gRPC
    strings = np.array([b"x" * 2000, b"y"], dtype=object)
    server.send(key(worker(me), worker(other), "strings"), strings, step_id=2)
    got = server.recv(key(worker(other), worker(me), "strings"), step_id=2, timeout=60)
    assert got.tolist() == strings.tolist()
    finish(server)  # the peer has fetched everything we serve: our counters are final
    stats = server.stats()
    server.stop(5)
    result(rank=me, stats=stats, mpi_disabled=cfg.mpi_disabled, optimal=cfg.mpi_optimal_path,
           mpi_imported="mpi4py" in sys.modules)


def abort() -> None:
    """Abort while waiting for a descriptor, and while an MPI receive is held back."""
    server = start(2)
    me = server.task.task
    if me == 1:
        # producer: tells the consumer once its recv of "never" waits here; step 4
        # tensor only after the consumer has aborted; then a checked tensor on the
        # same pair to prove no stale bytes are matched
        wait_for(lambda: any(e.kind == "waiter" for e in server.pending()), "the consumer's recv to wait here")
        server.send(key(worker(1), worker(0), "waiting"), np.ones(1), step_id=2)
        server.send(key(worker(1), worker(0), "held"), pattern(4 << 20, 11), step_id=4)
        server.recv(key(worker(0), worker(1), "go"), step_id=5, timeout=60)
        server.send(key(worker(1), worker(0), "after"), pattern(4 << 20, 12), step_id=6)
        server.recv(key(worker(0), worker(1), "done"), step_id=7, timeout=60)
        result(rank=me, ok=True)
        server.stop(5)
        return
    # 1) abort while the request waits in the producer's table (no descriptor yet)
    aio = server.aio
    import asyncio

    fut = asyncio.run_coroutine_threadsafe(aio.recv(key(worker(1), worker(0), "never"), step_id=3, timeout=60),
                                           server.loop)
    server.recv(key(worker(1), worker(0), "waiting"), step_id=2, timeout=60)  # the producer saw it wait
    server.abort(3, "stop step 3")
    try:
        fut.result(30)
        raise AssertionError("recv of an aborted step returned")
    except rendezvous.Aborted as exc:
        assert "stop step 3" in exc.message
    # 2) abort while the MPI receive for a descriptor is held back: the descriptor
    # arrived, and its receive is posted only once the gate opens (after the
    # abort). Like any receive whose recv gave up, it is still posted and
    # completes into its own buffer, so its bytes cannot match a later transfer.
    engine = aio.link.engine
    real_irecv = engine.irecv
    held, gate, received = threading.Event(), threading.Event(), threading.Event()

    def held_irecv(buf, source, tag, chunk):
        held.set()
        loop = asyncio.get_running_loop()

        async def after_gate():
            await loop.run_in_executor(None, gate.wait, 60)
            try:
                return await real_irecv(buf, source, tag, chunk)
            finally:
                received.set()

        return asyncio.shield(asyncio.ensure_future(after_gate()))

    engine.irecv = held_irecv
    fut = asyncio.run_coroutine_threadsafe(aio.recv(key(worker(1), worker(0), "held"), step_id=4, timeout=60),
                                           server.loop)
    wait_for(held.is_set, "the descriptor's receive to be held back")
    server.abort(4, "stop step 4")
    try:
        fut.result(30)
        raise AssertionError("recv of an aborted step returned")
    except rendezvous.Aborted as exc:
        assert "stop step 4" in exc.message
    gate.set()
    wait_for(received.is_set, "the held receive to complete")
    engine.irecv = real_irecv
    server.send(key(worker(0), worker(1), "go"), np.ones(1), step_id=5)
    got = server.recv(key(worker(1), worker(0), "after"), step_id=6, timeout=60)
    assert np.array_equal(got, pattern(4 << 20, 12)), "bytes of the aborted transfer leaked into the next"
    server.send(key(worker(0), worker(1), "done"), np.ones(1), step_id=7)
    stats = server.stats()
    # "after" (and, with requests over MPI, the small "waiting" too)
    assert stats["mpi"]["transfers"] == (2 if server.config.mpi_requests else 1), stats
    result(rank=me, ok=True, stats=stats)
    server.stop(5)


def idle(seconds: str = "2") -> None:
    """CPU used by an idle rank (after a burst of MPI transfers) over a few seconds."""
    server = start(2)
    me = server.task.task
    other = 1 - me
    for i in range(20):
        server.send(key(worker(me), worker(other), f"b{i}"), np.ones(1 << 18), step_id=i)
    for i in range(20):
        server.recv(key(worker(other), worker(me), f"b{i}"), step_id=i, timeout=60)
    finish(server, step_id=998)  # both ranks have everything
    engine = server.aio.link.engine
    # a send's completion is noticed by the engine after its consumer has the bytes
    wait_for(lambda: engine.in_flight == 0, "the last sends' completions")
    polls0 = engine.polls
    wall0, cpu0 = time.monotonic(), time.process_time()
    # measuring idleness itself, not synchronizing: the first half includes the
    # engine settling; the second half is a rank idle for over a quarter second
    time.sleep(float(seconds) / 2)
    probes0, late0, late_cpu0 = engine.probes, time.monotonic(), time.process_time()
    time.sleep(float(seconds) / 2)
    late_wall = time.monotonic() - late0
    late_cpu = (time.process_time() - late_cpu0) / late_wall
    wall = time.monotonic() - wall0
    cpu = (time.process_time() - cpu0) / wall
    result(rank=me, cpu=cpu, late_cpu=late_cpu, polls=engine.polls - polls0, probes=engine.probes - probes0,
           late_wall=late_wall, stats=server.stats())
    finish(server)
    server.stop(5)


def fail() -> None:
    """Rank 1 raises after start-up while rank 0 waits for its tensor."""
    server = start(2)
    if server.task.task == 1:
        raise RuntimeError("rank 1 fails on purpose")
    server.recv(key(worker(1), worker(0), "never"), timeout=600)


def outside() -> None:
    """Two MPI ranks plus a ps task outside the MPI job (launched on its own)."""
    rank, _ = launcher_rank()
    ps_address = os.environ["PS_ADDRESS"]
    cluster = {"worker": ["127.0.0.1:0"] * 2, "ps": [ps_address]}
    server = rendezvous.Server(cluster, "worker", rank, protocol="grpc+mpi")
    server.start()
    if rank == 0:
        print("CLUSTER " + json.dumps(server.aio.cluster.as_dict()), flush=True)
    me, other = worker(rank), worker(1 - rank)
    ps = "/job:ps/replica:0/task:0"
    big = pattern(1 << 20, rank)
    server.send(key(me, ps, "to_ps"), big, step_id=1)
    server.send(key(me, other, "peer"), big, step_id=1)
    from_ps = server.recv(key(ps, me, "from_ps"), step_id=1, timeout=60)
    assert np.array_equal(from_ps, pattern(1 << 20, 100 + rank))
    assert np.array_equal(server.recv(key(other, me, "peer"), step_id=1, timeout=60), pattern(1 << 20, 1 - rank))
    server.recv(key(ps, me, "done"), step_id=2, timeout=60)
    stats = server.stats()
    result(rank=rank, stats=stats)
    server.stop(5)


def outside_ps() -> None:
    """The ps side of `outside`: a plain process, no MPI (MPI_DISABLED=1)."""
    server = rendezvous.Server({"ps": ["127.0.0.1:0"], "worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                               "ps", 0, protocol="grpc+mpi")
    server.start()
    print("ADDRESS " + server.target, flush=True)
    cluster = json.loads(sys.stdin.readline())
    server.update_cluster(cluster)
    ps = "/job:ps/replica:0/task:0"
    for w in range(2):
        server.send(key(ps, worker(w), "from_ps"), pattern(1 << 20, 100 + w), step_id=1)
    for w in range(2):
        got = server.recv(key(worker(w), ps, "to_ps"), step_id=1, timeout=60)
        assert np.array_equal(got, pattern(1 << 20, w))
    for w in range(2):
        server.send(key(ps, worker(w), "done"), np.ones(1), step_id=2)
    # wait for the workers to take "done" before stopping
    wait_for(lambda: not server.pending(), "the workers to take 'done'")
    result(role="ps", stats=server.stats(), mpi_imported="mpi4py" in sys.modules)
    server.stop(5)


def single_copy() -> None:
    """Each rank's server says whether this node's large messages move in one
    copy (the start-up probe), and its engine polls for them accordingly."""
    server = start(2)
    engine = server.aio.link.engine
    world = server.aio.link.world
    result(single_copy=world.single_copy, copied=sorted(engine.copied_peers))
    finish(server)
    server.stop(5)


def names() -> None:
    """Task names of any length map to ranks; two ranks claiming one task are refused."""
    rank, _ = launcher_rank()
    long_job = "j" + "x" * 299  # far past the old design's 128-byte limit
    server = rendezvous.Server({long_job: ["127.0.0.1:0"] * 2}, long_job, rank, protocol="grpc+mpi")
    server.start()
    other = f"/job:{long_job}/replica:0/task:{1 - rank}"
    me = f"/job:{long_job}/replica:0/task:{rank}"
    server.send(key(me, other, "hi"), pattern(4096, rank), step_id=1)
    assert np.array_equal(server.recv(key(other, me, "hi"), step_id=1, timeout=60), pattern(4096, 1 - rank))
    ranks = {str(t): r for t, r in server.aio.mpi_ranks.items()}
    server.send(key(me, other, "finished"), np.ones(1), step_id=2)
    server.recv(key(other, me, "finished"), step_id=2, timeout=60)
    server.stop(5)
    dup = rendezvous.Server({"worker": ["127.0.0.1:0"] * 2}, "worker", 0, protocol="grpc+mpi")
    try:
        dup.start()
        message = None
    except rendezvous.InvalidArgument as exc:
        message = exc.message
    result(rank=rank, ranks=ranks, duplicate_error=message)


def huge() -> None:
    """A tensor over 2 GiB over MPI."""
    server = start(2)
    me = server.task.task
    n = (2 << 30) + 4099
    if me == 1:
        value = np.ones(n, np.uint8)
        value[-4099:] = 3
        server.send(key(worker(1), worker(0), "huge"), value, step_id=1)
        server.recv(key(worker(0), worker(1), "done"), step_id=1, timeout=300)
        finish(server)
    else:
        got = server.recv(key(worker(1), worker(0), "huge"), step_id=1, timeout=300)
        assert got.nbytes == n and got[0] == 1 and got[-1] == 3 and got[-4100] == 1
        assert server.stats()["mpi"]["bytes"] == n
        server.send(key(worker(0), worker(1), "done"), np.ones(1), step_id=1)
        finish(server)
    result(rank=me, ok=True)
    server.stop(5)


def exactly_once(count: str = "1000", api: str = "aio", cuts: str = "0") -> None:
    """Deadlines racing transfers on whatever path the environment picks: rank 1
    produces ``count`` tensors (16 B and 256 KiB in turn) while rank 0 receives
    each with a 2-20 ms deadline, retried until it arrives, many recvs in flight
    (``api``: the asyncio server, the blocking ``Server`` called from a pool
    of threads, or ``batch``: the asyncio server's recv_many, ten keys under
    one deadline); then rank 0 asks every key again (any answer is a second
    delivery) and both ranks report what is left anywhere once the traffic has
    settled. With ``cuts`` (gRPC requests only), rank 0 reaches rank 1 through
    a relay (tests/cutting.py) that resets the connection under the stream that
    many times during the race, every 50 tensors to arrive: replies in flight
    are lost, and recvs ask again on a new connection."""
    import concurrent.futures

    from rendezvous import aio
    from cutting import Relay
    from racing import ask_again, paced, race, race_batches, value

    n = int(count)
    cut_left = int(cuts)
    rank, _ = launcher_rank() or (0, 1)
    blocking = api == "blocking"

    # a recv cut off more often than reconnect_attempts (3) fails with UNAVAILABLE;
    # one whose deadline has grown long sees several cuts: it is re-sent each time
    settings = {"reconnect_attempts": 1000} if cut_left else {}

    async def main() -> None:
        loop = asyncio.get_running_loop()
        pool = concurrent.futures.ThreadPoolExecutor(16)
        if blocking:
            sync = rendezvous.Server({"worker": ["127.0.0.1:0"] * 2}, "worker", rank, protocol="grpc+mpi",
                                     **settings)
            await loop.run_in_executor(pool, sync.start)
            server = sync.aio  # what is left is read on its loop (below)
        else:
            server = aio.Server({"worker": ["127.0.0.1:0"] * 2}, "worker", rank, protocol="grpc+mpi", **settings)
            await server.start()

        async def on_server(fn):  # run fn() (a function or a coroutine function) on the server's loop
            if not blocking:
                return await _as_coro(fn)
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_as_coro(fn), sync.loop))

        async def send(k, v, step_id):
            if blocking:
                await loop.run_in_executor(pool, sync.send, k, v, step_id)
            else:
                server.send(k, v, step_id=step_id)

        async def recv(k, step_id, timeout):
            if blocking:
                return await loop.run_in_executor(pool, sync.recv, k, step_id, timeout)
            return await server.recv(k, step_id=step_id, timeout=timeout)

        if server.config.mpi_disabled:
            addresses = await loop.run_in_executor(None, exchange_addresses, rank, server.target)
            await on_server(lambda: server.update_cluster({"worker": addresses}))
        me, other = worker(rank), worker(1 - rank)
        name = lambda i: key(worker(1), worker(0), f"x{i}")  # noqa: E731
        relay = None
        if cut_left and rank == 0:
            producer = TaskName("worker", 0, 1)
            relay = Relay(server.cluster.address(producer))
            through = await relay.start()
            await on_server(lambda: server.update_cluster(server.cluster.with_address(producer, through)))
        arrived = 0
        every = 5 if api == "batch" else 50  # batches of ten: the same tensors apart

        async def counted(receiving):
            """What ``receiving`` gives; every ``every``-th arrival cuts the relay's connections."""
            nonlocal arrived, cut_left
            got = await receiving
            arrived += 1
            if cut_left and arrived % every == 0 and relay.cut():
                cut_left -= 1  # (a tensor kept here may arrive while no connection is open)
            return got

        if rank == 1:
            await recv(key(other, me, "go"), 2, 60)
            await paced(lambda i: send(name(i), value(i), 1), n)
            await recv(key(other, me, "done"), 2, 300)
            await on_server(lambda: quiet(server))
            left = await on_server(lambda: [e for e in server.pending() if e.step_id == 1])
            fused = sum(c["served_fused"] for p, c in server.stats().items() if p != "gpu")
            result(rank=rank, left=len(left), left_items=repr(left)[:2000], fused=fused)
        else:
            await send(key(me, other, "go"), np.zeros(1), 2)
            if api == "batch":  # recv_many, batches of 10 under one racing deadline
                tally = await race_batches(
                    lambda ids, t: counted(server.recv_many([name(i) for i in ids], step_id=1, timeout=t)), n,
                    seed=3)
            else:
                tally = await race(lambda i, t: counted(recv(name(i), 1, t)), n, seed=3)
            await on_server(lambda: quiet(server))
            # Every key asked again: an answer is a second delivery. A recv cut off
            # with its connection leaves its request_id in doubt (several for one
            # key, when retries were cut off too); each ask settles one, so the
            # keys are asked until none is left.
            for _ in range(20):
                await ask_again(lambda i, t: recv(name(i), 1, t), tally)
                await on_server(lambda: quiet(server))
                unsettled = await on_server(lambda: sum(len(p.in_doubt) for p in server.peers.values()))
                if not unsettled:
                    break
            kept = await on_server(lambda: sum(len(q) for q in server.kept.values()))
            stats = server.stats()
            result(rank=rank, n=n, timed_out=tally.timed_out, wrong=tally.wrong, twice=tally.twice,
                   kept=kept, unsettled=unsettled, mpi=stats["mpi"]["transfers"], grpc=stats["grpc"]["transfers"],
                   cuts=relay.cuts if relay else 0, connections=relay.connections if relay else 0)
            if relay is not None:
                await relay.close()
            await send(key(me, other, "done"), np.zeros(1), 2)
        if blocking:
            await loop.run_in_executor(pool, sync.stop, 5)
        else:
            await server.stop(5)
        pool.shutdown()

    asyncio.run(main())


async def _as_coro(fn):
    got = fn()
    return (await got) if asyncio.iscoroutine(got) else got


async def quiet(server) -> None:
    """Until no reply is in flight to or from ``server`` (requests answered, MPI
    transfers landed, orphans received): what is left then stays."""
    loop = asyncio.get_running_loop()
    end = loop.time() + 60

    def busy() -> bool:
        streams = [p.live_stream() for p in server.peers.values()]
        replying = any(c.replies or c.writing or c._late for c in server.servicer._streams)
        return (replying or server.stats()["mpi"]["in_flight"] > 0
                or any(s is not None and (s.pending or s.moving) for s in streams))

    while busy():
        if loop.time() > end:
            streams = [p.live_stream() for p in server.peers.values()]
            raise AssertionError(
                "the traffic did not settle within 60 s: "
                f"replies {[(len(c.replies), c.writing, len(c.waiting)) for c in server.servicer._streams]}, "
                f"MPI in flight {server.stats()['mpi']['in_flight']}, "
                f"streams {[(len(s.pending), len(s.moving)) if s else None for s in streams]}, "
                f"first {[[(c, p.orphan, p.key[-6:]) for c, p in list(s.pending.items())[:6]] for s in streams if s]}, "
                f"writer {[(s.writer.done(), s.outbox.qsize(), s.reader.done()) for s in streams if s]}, "
                f"{_engine_state(server)}")
        await asyncio.sleep(0.005)


def _engine_state(server) -> str:
    """What the MPI engine holds, for a failure's message: each operation in
    flight (kind, peer, tag, bytes) and whether its thread still runs."""
    engine = getattr(server.link, "engine", None)
    if engine is None:
        return "no MPI engine"
    ops = [(op.kind.name, op.peer, op.tag, len(memoryview(op.buf).cast("B")) if op.buf is not None else None)
           for op in dict.fromkeys(list(engine._owners))]
    alive = engine._thread is not None and engine._thread.is_alive()
    return f"MPI thread alive {alive}, loop polling {engine._loop_polling}, ops in flight {ops[:30]}"


def stats_paths() -> None:
    """Each transfer and each failed recv counted under the path it took, on both
    ranks: rank 1 produces a small tensor (inside the reply) and a large one (the
    optimal path), and aborts a step while rank 0 waits on it; rank 0 receives."""
    server = start(2)
    me = server.task.task
    other = 1 - me
    small, large = np.arange(8, dtype=np.int64), np.arange(1 << 16, dtype=np.float32)
    if me == 1:
        server.send(key(worker(1), worker(0), "small"), small, step_id=1)
        server.send(key(worker(1), worker(0), "large"), large, step_id=1)
        server.recv(key(worker(0), worker(1), "waiting"), step_id=3, timeout=60)  # rank 0's recv of step 2 waits
        server.abort(2, "the step is over")
        finish(server)
    else:
        assert np.array_equal(server.recv(key(worker(1), worker(0), "small"), step_id=1, timeout=60), small)
        assert np.array_equal(server.recv(key(worker(1), worker(0), "large"), step_id=1, timeout=60), large)
        import threading

        failed: list[str] = []

        def doomed() -> None:
            try:
                server.recv(key(worker(1), worker(0), "never"), step_id=2, timeout=60)
            except rendezvous.RendezvousError as exc:
                failed.append(exc.code.name)

        t = threading.Thread(target=doomed)
        t.start()
        wait_for(lambda: any(e.step_id == 2 for e in _remote_pending(server, other)), "the recv to wait")
        server.send(key(worker(0), worker(1), "waiting"), np.zeros(1), step_id=3)
        t.join(60)
        assert failed == ["ABORTED"], failed
        finish(server)
    server.stop(5)  # its tensors served first (the handshake's last one may still be asked for)
    result(rank=me, stats=server.stats(), requests="mpi" if server.config.mpi_requests else "grpc")


def _remote_pending(server, other: int) -> list:
    """What waits at the other rank's table for this one (asked through its stats-free pending)."""
    import asyncio as _asyncio

    async def ask():
        streams = [p.live_stream() for p in server.aio.peers.values()]
        return [p for s in streams if s is not None for p in s.pending.values()]

    return _asyncio.run_coroutine_threadsafe(ask(), server.loop).result(10)


def control_order(rounds: str = "50") -> None:
    """Rank 1 sends rank 0, on one tag, a large message then two small ones,
    ``rounds`` times; rank 0's engine listens: every message is handed over, in
    the order sent (receives of a large and a small message complete in any order)."""
    from rendezvous.mpi.engine import ProgressEngine
    from rendezvous.mpi.world import import_mpi

    n = int(rounds)
    MPI = import_mpi()
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()

    async def main() -> list[bytes]:
        engine = ProgressEngine(comm, poll_min_us=5, poll_max_us=200)
        engine.start(loop_polls=True)
        got: list[bytes] = []
        done = asyncio.Event()

        def deliver(messages):
            got.extend(body for _, body in messages)
            if len(got) == 3 * n:
                done.set()

        try:
            if rank == 0:
                engine.listen(comm, 5, deliver)
                await engine.call(comm.Barrier)
                await asyncio.wait_for(done.wait(), 60)
            else:
                await engine.call(comm.Barrier)
                sends = []
                for i in range(n):
                    sends += [engine.isend(bytes([i % 251]) * (1 << 20), 0, 5, 1 << 30),
                              engine.isend(b"small-%d" % i, 0, 5, 1 << 30), engine.isend(b"tiny-%d" % i, 0, 5, 1 << 30)]
                    if i % 4 == 3:
                        # a pace, not a synchronization: the receiver's loop goes quiet between
                        # bursts, and its MPI thread and its loop both take messages
                        await asyncio.sleep(0.003)
                await asyncio.gather(*sends)
            await engine.call(comm.Barrier)
        finally:
            engine.stop()
        return got

    got = asyncio.run(main())
    if rank == 0:
        order = [("big", len(b), b[0]) if len(b) > 100 else (b.decode(),) for b in got]
        want = [m for i in range(n) for m in (("big", 1 << 20, i % 251), (f"small-{i}",), (f"tiny-{i}",))]
        result(rank=rank, in_order=order == want, first_wrong=next(
            (i for i, (a, b) in enumerate(zip(order, want)) if a != b), None))
    else:
        result(rank=rank)
    comm.Free()


def owed_progress(rounds: str = "2", per_round: str = "40") -> None:
    """Rank 1 sends rank 0 ``rounds`` bursts of 256 KiB messages with plain
    mpi4py and makes no MPI call between them (a rank busy elsewhere); rank
    0's engine receives each burst, then has nothing in flight. A send
    completes only once the receiver's MPI has told the sender the bytes
    arrived; rank 1, not polling, lets its queue of such messages fill, so
    the last ones wait in rank 0 and leave only when rank 0 calls MPI again.
    Rank 0 stays idle; rank 1 reports whether its sends completed within 20
    s. The ranks signal each other over a loopback socket (any MPI call on
    either would make the progress under test)."""
    import socket

    from rendezvous.mpi.engine import ProgressEngine
    from rendezvous.mpi.world import import_mpi

    n_rounds, n = int(rounds), int(per_round)
    size = 256 << 10
    MPI = import_mpi()
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    listener = None
    if rank == 0:
        listener = socket.create_server(("127.0.0.1", 0))
    port = comm.bcast(listener.getsockname()[1] if listener else None, root=0)
    conn = listener.accept()[0] if listener else socket.create_connection(("127.0.0.1", port), timeout=60)
    conn.settimeout(60)
    comm.Barrier()

    if rank == 1:
        bufs, reqs = [], []
        for r in range(n_rounds):
            for i in range(n):
                bufs.append(np.full(size, (r * n + i) % 251, np.uint8))
                reqs.append(comm.Isend([bufs[-1], MPI.BYTE], 0, 100 + r * n + i))
            assert conn.recv(1) == b"r", "rank 0 ended"  # the burst is in; no MPI call meanwhile
        started = time.monotonic()
        try:
            wait_for(lambda: MPI.Request.Testall(reqs), "rank 1's sends to complete", 20)
            complete = True
        except AssertionError:
            complete = False
        conn.sendall(b"k")
        result(rank=rank, complete=complete, seconds=time.monotonic() - started)
    else:
        async def main() -> bool:
            loop = asyncio.get_running_loop()
            engine = ProgressEngine(comm)
            engine.start(loop_polls=True)  # as a rank server's
            try:
                right = True
                for r in range(n_rounds):
                    bufs = [np.empty(size, np.uint8) for _ in range(n)]
                    await asyncio.wait_for(asyncio.gather(*(
                        engine.irecv(b, 1, 100 + r * n + i, 1 << 30) for i, b in enumerate(bufs))), 60)
                    right = right and all(b[0] == b[-1] == (r * n + i) % 251 for i, b in enumerate(bufs))
                    conn.sendall(b"r")
                assert engine.in_flight == 0
                # idle until rank 1 has its verdict
                assert await loop.run_in_executor(None, conn.recv, 1) == b"k"
                return right
            finally:
                engine.stop()

        result(rank=rank, right=asyncio.run(main()))
    conn.close()
    comm.Barrier()  # rank 0 calls MPI here: sends still waiting complete now
    if rank == 1:
        MPI.Request.Waitall(reqs)
    comm.Free()


def idle_listener() -> None:
    """Rank 0's engine listens (as for requests over MPI) and is idle, probing
    every 300 ms; rank 1 sends it a message with plain mpi4py, then says so
    over a loopback socket. Rank 0 reports how many of its engine's wake-ups
    (polls on the MPI thread) came after that word until the message was
    taken: the first probe after a pause misses a message that arrived
    during it (MPICH), and the engine probes again at once."""
    import socket

    from rendezvous.mpi.engine import ProgressEngine
    from rendezvous.mpi.world import import_mpi

    MPI = import_mpi()
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    listener = socket.create_server(("127.0.0.1", 0)) if rank == 0 else None
    port = comm.bcast(listener.getsockname()[1] if listener else None, root=0)
    conn = listener.accept()[0] if listener else socket.create_connection(("127.0.0.1", port), timeout=60)
    conn.settimeout(60)
    comm.Barrier()
    tag = 7
    if rank == 1:
        assert conn.recv(1) == b"i", "rank 0 ended"  # its engine is idle
        comm.Send([np.arange(16, dtype=np.uint8), MPI.BYTE], 0, tag)  # small: done once buffered
        conn.sendall(b"s")
        assert conn.recv(1) == b"k", "rank 0 ended"
        result(rank=rank)
    else:
        async def main() -> dict:
            loop = asyncio.get_running_loop()
            engine = ProgressEngine(comm, idle_poll_ms=300, idle_after_s=0.0)
            wakes, taken_at = [0], []
            poll, take = engine._poll, engine._take_arrivals

            def counted_poll(on_loop: bool) -> bool:
                wakes[0] += not on_loop
                return poll(on_loop)

            def noted_take(reqs: list, owners: list) -> bool:
                found = take(reqs, owners)
                if found:
                    taken_at.append(wakes[0])
                return found

            engine._poll, engine._take_arrivals = counted_poll, noted_take  # type: ignore[method-assign]
            got = loop.create_future()
            engine.start(loop_polls=True)  # as a rank server's
            try:
                engine.listen(comm, tag, lambda msgs: got.done() or got.set_result(msgs))
                # (waited for on a thread: the loop stays free to poll, as a server's)
                await loop.run_in_executor(None, wait_for, lambda: engine._idle, "rank 0's engine to go idle")
                conn.sendall(b"i")
                assert await loop.run_in_executor(None, conn.recv, 1) == b"s"
                said = wakes[0]
                msgs = await asyncio.wait_for(got, 30)
                conn.sendall(b"k")
                return {"wakes_after": taken_at[0] - said, "source": msgs[0][0],
                        "right": bytes(msgs[0][1]) == bytes(range(16))}
            finally:
                engine.stop()

        result(rank=rank, **asyncio.run(main()))
    conn.close()
    comm.Barrier()
    comm.Free()


def stopped_producer(folder: str) -> None:
    """Rank 1 is stopped (SIGSTOP, by the test) while rank 0 recvs from it with no
    deadline: keepalive fails that recv with UNAVAILABLE within its bound; once
    rank 1 is continued, the job goes on."""
    rank, _ = launcher_rank() or (0, 1)
    # the stopped rank's own clock jumps while it is stopped: its connect timeout is long
    server = start(2, keepalive_time=1.0, keepalive_timeout=1.0, reconnect_attempts=1,
                   connect_timeout=5.0 if rank == 0 else 60.0)
    me = server.task.task
    Path = __import__("pathlib").Path
    if me == 1:
        Path(folder, "producer.pid").write_text(str(os.getpid()))
        got = server.recv(key(worker(0), worker(1), "go-on"), step_id=1, timeout=120)
        finish(server)
        result(rank=me, go_on=int(got[0]))
    else:
        Path(folder, "consumer.ready").write_text("1")
        wait_for(lambda: Path(folder, "stopped").exists(), "the test to stop rank 1", timeout=90)
        t0 = time.monotonic()
        try:
            server.recv(key(worker(1), worker(0), "never"), step_id=1)  # no deadline
            error = None
        except rendezvous.RendezvousError as exc:
            error = exc.code.name
        took = time.monotonic() - t0
        Path(folder, "failed").write_text("1")
        server.send(key(worker(0), worker(1), "go-on"), np.array([7]), step_id=1)
        finish(server)
        result(rank=me, error=error, seconds=took)
    server.stop(5)


def network_peers(api: str = "aio") -> None:
    """The aio server with gRPC requests, or the blocking Server with either:
    which ranks MPI reaches over the network (``MPIR_CVAR_NOLOCAL=1`` makes
    every other rank one), which transfers the server's loop polls (``None``:
    all), and that tensors of every size cross and land whole either way."""
    import asyncio

    from rendezvous import aio

    async def main() -> None:
        rank, _ = launcher_rank() or (0, 1)
        server = aio.Server({"worker": ["127.0.0.1:0"] * 2}, "worker", rank, protocol="grpc+mpi")
        await server.start()
        me, other = rank, 1 - rank
        table = [100, 1 << 16, (1 << 20) + 7, 8 << 20]
        server.send_many([(key(worker(me), worker(other), f"t{i}"), pattern(n, me)) for i, n in enumerate(table)],
                         step_id=1)
        got = await server.recv_many([key(worker(other), worker(me), f"t{i}") for i in range(len(table))],
                                     step_id=1, timeout=120)
        for n, value in zip(table, got):
            assert np.array_equal(value, pattern(n, other)), f"size {n}: content differs"
        server.send(key(worker(me), worker(other), "finished"), np.ones(1), step_id=999)
        await server.recv(key(worker(other), worker(me), "finished"), step_id=999, timeout=120)
        stats = server.stats()
        engine = server.link.engine
        result(rank=me, remote=sorted(server.link.world.remote_ranks),
               loop_peers=None if engine.loop_peers is None else sorted(engine.loop_peers),
               home=engine.home is asyncio.get_running_loop(), mpi_transfers=stats["mpi"]["transfers"])
        await server.stop(5)

    if api == "aio":
        asyncio.run(main())
        return
    server = start(2)  # the blocking Server, requests as the environment says
    me, other = server.task.task, 1 - server.task.task
    table = [1 << 16, 8 << 20]
    server.send_many([(key(worker(me), worker(other), f"t{i}"), pattern(n, me)) for i, n in enumerate(table)],
                     step_id=1)
    got = server.recv_many([key(worker(other), worker(me), f"t{i}") for i in range(len(table))], step_id=1,
                           timeout=120)
    for n, value in zip(table, got):
        assert np.array_equal(value, pattern(n, other)), f"size {n}: content differs"
    finish(server)
    engine = server.aio.link.engine
    result(rank=me, remote=sorted(server.aio.link.world.remote_ranks), loop_peers=sorted(engine.loop_peers),
           home=engine.home is server.loop, mpi_transfers=server.stats()["mpi"]["transfers"],
           attended=engine.attended)
    server.stop(5)


def incarnations() -> None:
    """Each rank learns the other's incarnation from MPI's exchange (checked
    against an allgather of its own): a key of that incarnation is served, a
    key of another is ABORTED naming both, over whichever request path the
    environment picks, and nothing is consumed by the refusal."""
    from mpi4py import MPI

    server = start(2)
    me, other = server.task.task, 1 - server.task.task
    theirs = MPI.COMM_WORLD.allgather(server.incarnation)[other]
    known = server.incarnation_of(TaskName("worker", 0, other))
    assert known == theirs != 0, (known, theirs)

    def k(name: str, src: int, dst: int, incarnation: int) -> str:
        return rendezvous.make_key(f"{worker(src)}/device:CPU:0", f"{worker(dst)}/device:CPU:0", name,
                                   incarnation=incarnation).format()

    mine = server.incarnation
    for n in (16, 2 << 20):  # inline, and (optimal path) a descriptor and an MPI transfer
        server.send(k(f"t{n}", me, other, mine), pattern(n, me), step_id=1)
    got = [server.recv(k(f"t{n}", other, me, known), step_id=1, timeout=60) for n in (16, 2 << 20)]
    assert all(np.array_equal(g, pattern(n, other)) for g, n in zip(got, (16, 2 << 20)))
    try:
        server.recv(k("t16", other, me, known ^ 0x5A5A), step_id=2, timeout=60)
        refusal = ""
    except rendezvous.errors.Aborted as exc:
        refusal = str(exc)
    finish(server)
    result(rank=me, refusal=refusal, known=f"{known:#x}", stale=f"{known ^ 0x5A5A:#x}",
           path=server.config.mpi_requests,
           # the finishing handshake's own tensor may still wait for the other rank: not counted
           pending=len([e for e in server.pending() if e.step_id != 999]))
    server.stop(5)


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    globals()[name](*args)
