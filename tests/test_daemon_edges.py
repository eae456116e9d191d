"""The daemon's session socket at its edges: what a client that lies, goes away
or gives up cannot make the daemon lose, deliver twice, or hold.

Each test ends by asking every key again: exactly once means each tensor came
back once, nothing more answers, and nothing is left in the table, kept, or
held on a segment."""

from __future__ import annotations

import asyncio
import socket
import struct
import sys

import grpc
import numpy as np
import pytest

from rendezvous import errors
from rendezvous.codec import groups, wire
from rendezvous.codec import fields as F
from rendezvous.client import Client as BlockingClient
from rendezvous.client.aio import Client
from rendezvous.daemon import placing as daemon_placing
from rendezvous.daemon.sessions import SESSION_HIGH_WATER
from rendezvous.local import frames as lf
from rendezvous.local import messages
from rendezvous.local.address import channel_target
from rendezvous.local.frames import HEADER, Kind

from conftest import run, until
from test_daemon import HERE, daemons, key, sockdir  # noqa: F401 (a fixture)
from test_hostile_clients import replies, session
from test_sessions import answered, ask, code_of, many

pytestmark = pytest.mark.timeout(120)


async def nothing_left(d, keys: list[str], step_id: int = 1) -> None:
    """Every key of ``keys`` asked again gets nothing (each fails its short
    deadline), and nothing waits or is kept anywhere in the daemon."""
    async with Client(d.local_target) as c:
        with pytest.raises(errors.DeadlineExceeded) as caught:
            await c.recv_many(keys, step_id=step_id, timeout=0.2)
    assert set(caught.value.failures) == set(keys), "a key answered twice"
    await until(lambda: not d.local.waits and not d.server.pending() and not d.server.kept,
                what="nothing to be left in the daemon")
    assert d.pool.stats()["held"] == 0 and d.pool.stats()["in_table"] == 0


async def frames_until_closed(sock: socket.socket, within: float = 10.0) -> list[tuple[int, int, bytes]]:
    """Every frame the daemon writes on a raw session until it closes it; fails if
    it has not closed it within ``within`` seconds."""
    loop = asyncio.get_running_loop()
    reader = lf.FrameReader(1 << 30)
    got: list[tuple[int, int, bytes]] = []

    async def read() -> None:
        while True:
            data = await loop.sock_recv(sock, 1 << 16)
            if not data:
                return
            got.extend((k, op, bytes(b)) for k, op, b in reader.feed(data))

    try:
        await asyncio.wait_for(read(), within)
    except TimeoutError:
        raise AssertionError(f"the daemon did not end the session within {within:g}s (frames so far: "
                             f"{[(k, op) for k, op, _ in got]})") from None
    return got


# -- every frame kind is bounded by its header --------------------------------------------------


def test_a_recv_many_frame_is_refused_by_its_header_alone(sockdir):  # noqa: F811
    """A RECV_MANY carries keys, never tensor bytes: like every kind but SEND,
    RETURN and SEND_MANY, it is at most 1 MiB, refused by its header before
    any of its body is read. (A 24 MiB RECV_MANY of 8.4 million keys was read
    whole and parsed before the session's share refused it.)"""
    async def main():
        async with daemons(sockdir) as (d,):
            loop = asyncio.get_running_loop()
            for kind, length in ((Kind.RECV_MANY, 24 << 20), (Kind.RECV_MANY, lf.SMALL_BODY + 1),
                                 (Kind.SEND_MANY, lf.SEND_MANY_BODY + 1)):
                sock = await session(d.sessions.path)
                # the header and a few bytes of the body: this client could not have sent the rest
                await loop.sock_sendall(sock, HEADER.pack(length, kind, 2) + b"\x12\x05")
                got = await frames_until_closed(sock)
                sock.close()
                assert [(k, op) for k, op, _ in got] == [(Kind.ERROR, 0)], got
                assert code_of(got[0][2]) == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "at most" in lf.unpack_error(got[0][2])[1]
            await until(lambda: not d.sessions.sessions, what="the sessions to end")
            # a frame at the bound is read as usual
            sock = await session(d.sessions.path)
            [(kind, op, _)] = await ask(sock, lf.frame(Kind.RECV_MANY, 3, many([key(0, 0, "x")], timeout=0.05)))
            assert (kind, op) == (Kind.RECV_MANY_REPLY, 3)
            sock.close()
    run(main())


@pytest.mark.parametrize("blocking", [False, True])
def test_a_clients_frames_stay_within_the_bounds_the_daemon_reads(sockdir, blocking):  # noqa: F811
    """A batch whose RECV_MANY would pass 1 MiB is refused by the client
    (RESOURCE_EXHAUSTED, nothing asked, the session goes on), and a send_many
    of long keys is packed in SEND_MANY frames the daemon takes."""
    long = "n" * 10_000
    too_many = [key(0, 0, f"{long}{i}") for i in range(120)]  # 1.2 MB of keys
    sent = [(key(0, 0, f"{long}{i}"), np.full(2, i, np.int32)) for i in range(600)]  # 6 MB of keys

    async def main():
        async with daemons(sockdir) as (d,):
            def go():
                with BlockingClient(d.local_target) as c:
                    with pytest.raises(errors.ResourceExhausted, match="fewer keys"):
                        c.recv_many(too_many, step_id=1, timeout=5)
                    c.send_many(sent, step_id=1)
                    return [c.recv_many([k for k, _ in sent[i:i + 50]], step_id=1, timeout=5)
                            for i in range(0, len(sent), 50)]

            if blocking:
                got = await asyncio.get_running_loop().run_in_executor(None, go)
            else:
                async with Client(d.local_target) as c:
                    with pytest.raises(errors.ResourceExhausted, match="fewer keys"):
                        await c.recv_many(too_many, step_id=1, timeout=5)
                    await c.send_many(sent, step_id=1)
                    got = [await c.recv_many([k for k, _ in sent[i:i + 50]], step_id=1, timeout=5)
                           for i in range(0, len(sent), 50)]
            assert [v.tolist() for part in got for v in part] == [v.tolist() for _, v in sent]
            assert not d.sessions.misused  # no frame over a bound: no session ended for it
            await nothing_left(d, [k for k, _ in sent[:50]])
    run(main())


# -- a client that lies ----------------------------------------------------------------------------


def lying_send_many(k: str, dims: tuple[int, ...], step_id: int = 1) -> bytes:
    """A SEND_MANY of one empty float64 tensor whose group claims shape ``dims``."""
    empty = np.zeros(0, np.float64)
    lay = groups.layout([empty])
    lay.ranks = np.array([len(dims)], "<u4").tobytes()
    lay.dims = np.array(dims, "<u8").tobytes()
    head = wire.varint_field(F.SEND_MANY_STEP_ID, step_id) + wire.len_field_header(F.SEND_MANY_KEYS, len(k)) + \
        k.encode()
    return head + b"".join(groups.group_parts([0], [empty], lay, field=F.SEND_MANY_GROUP))


LIES = [(0, 2**62), (2**62, 0), (0, 2**64 - 1), (2**31, 2**31, 0), (0, 2**40, 2**40)]


def test_a_send_many_whose_group_lies_is_invalid_argument_and_the_daemon_serves_on(sockdir):  # noqa: F811
    """A SEND_MANY's group that claims a shape no array can have (no bytes, a
    dimension 0, the others past any index) gets INVALID_ARGUMENT, on the
    session socket and on the gRPC local service; nothing is produced, and the
    session and the daemon serve on. (Such a shape passed the group's checks,
    and making its view raised a ValueError: INTERNAL, logged as a bug.)"""
    k = key(0, 0, "k")

    async def main():
        async with daemons(sockdir) as (d,):
            sock = await session(d.sessions.path)
            ok = messages.send_many_request([k], [np.arange(3.0)], 1)
            got = await ask(sock, *(lf.frame(Kind.SEND_MANY, 10 + i, lying_send_many(k, dims))
                                    for i, dims in enumerate(LIES)),
                            lf.frame(Kind.SEND_MANY, 20, ok), answers=len(LIES) + 1)
            by_op = {op: (kind, code_of(body) if kind == Kind.ERROR else None) for kind, op, body in got}
            assert by_op == {**{10 + i: (Kind.ERROR, grpc.StatusCode.INVALID_ARGUMENT) for i in range(len(LIES))},
                             20: (Kind.OK, None)}
            assert [(e.key, e.count) for e in d.server.pending()] == [(k, 1)]  # the honest one alone
            async with grpc.aio.insecure_channel(channel_target(d.local_target)[0]) as channel:
                send_many = channel.unary_unary(messages.METHOD + "SendMany")
                for dims in LIES:
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await send_many(lying_send_many(k, dims), timeout=10)
                    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
            async with Client(d.local_target) as c:  # another client is served
                assert (await c.recv(k, step_id=1, timeout=5)).tolist() == [0.0, 1.0, 2.0]
            [(kind, op, _)] = await ask(sock, lf.frame(Kind.PENDING, 30))  # and the liar's session goes on
            assert (kind, op) == (Kind.PENDING_REPLY, 30)
            sock.close()
            await nothing_left(d, [k])
    run(main())


# -- a client that goes away ---------------------------------------------------------------------


def test_a_client_killed_while_its_batch_answer_is_written_loses_none_of_it(sockdir, tmp_path):  # noqa: F811
    """A client process asks for 8,000 tensors in one batch, reads nothing and
    is killed while the daemon's answer (about 1.3 MB) is partly in its
    socket. The answer was never all written, so the client never had it:
    every tensor goes to the next client, once. (None of them did: the
    daemon knew the answer was not fully written, and dropped it.)"""
    n = 8000
    keys = [key(0, 0, f"t{i}") for i in range(n)]
    values = [np.full(16, i, np.float64) for i in range(n)]

    async def main():
        async with daemons(sockdir) as (d,):
            d.server.send_many(list(zip(keys, values)), step_id=1)
            keys_file = tmp_path / "keys"
            keys_file.write_text("\n".join(keys))
            proc = await asyncio.create_subprocess_exec(
                sys.executable, str(HERE / "daemon_clients.py"), "ask_many_and_hang", d.sessions.path,
                str(keys_file), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
            try:
                assert (await asyncio.wait_for(proc.stdout.readline(), 30)).strip() == b"ASKED"
                await until(lambda: len(d.sessions.sessions) == 1, what="the client's session")
                (s,) = d.sessions.sessions.values()
                # answered (every tensor taken from the table), and only part of it in the socket
                await until(lambda: not s.recvs and not d.server.pending() and s.conn.backlog > 0, 30,
                            what="the batch's answer to be stuck in the socket")
                proc.kill()
                await proc.wait()
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            await until(lambda: not d.sessions.sessions, what="the dead client's session to end")
            async with Client(d.local_target) as c:
                got = await c.recv_many(keys, step_id=1, timeout=10)
            assert all(np.array_equal(g, v) for g, v in zip(got, values)), "a tensor came back changed"
            await nothing_left(d, keys)
    run(main())


def test_answers_stuck_behind_a_client_that_reads_nothing_come_back_when_it_goes(sockdir):  # noqa: F811
    """A client reads nothing: a 10 MiB answer fills its socket, and its batch's
    answer waits for room. When its session ends, both come back: the batch's
    tensors (never written) and the 10 MiB one (not all written), each to the
    next recv of its key, once."""
    big = np.arange((SESSION_HIGH_WATER + (2 << 20)) // 8, dtype=np.float64)
    smalls = [key(0, 0, f"s{i}") for i in range(10)]

    async def main():
        async with daemons(sockdir) as (d,):
            d.sessions.segment_share = 0  # every tensor crosses inside the frames
            sock = await session(d.sessions.path)
            (s,) = d.sessions.sessions.values()
            loop = asyncio.get_running_loop()
            await loop.sock_sendall(sock, lf.frame(Kind.RECV_MANY, 2, many(smalls, timeout=30.0)))
            await until(lambda: 2 in s.recvs and len(d.local.waits) == len(smalls), what="the batch to wait")
            d.server.send(key(0, 0, "big"), big, step_id=1)
            await loop.sock_sendall(sock, lf.frame(Kind.RECV, 3, messages.recv_request(key(0, 0, "big"), 1, 30.0)))
            await until(lambda: s.conn.blocked, what="the big answer to fill the session's room")
            d.server.send_many([(k, np.full(3, i)) for i, k in enumerate(smalls)], step_id=1)
            # the batch has its tensors and waits for room to write them
            await until(lambda: not d.local.waits and not d.server.pending() and 2 in s.recvs,
                        what="the batch to wait for room")
            sock.close()
            await until(lambda: not d.sessions.sessions, what="the session to end")
            async with Client(d.local_target) as c:
                got = await c.recv_many([*smalls, key(0, 0, "big")], step_id=1, timeout=10)
            assert [g.tolist() for g in got[:-1]] == [[i] * 3 for i in range(len(smalls))]
            assert np.array_equal(got[-1], big)
            del got
            await nothing_left(d, [*smalls, key(0, 0, "big")])
    run(main())


def test_a_batch_whose_answer_cannot_be_made_gives_back_what_it_fetched(sockdir, monkeypatch):  # noqa: F811
    """A batch whose tensors would pass what one frame carries is refused
    (RESOURCE_EXHAUSTED) and takes nothing: every tensor is kept for the next
    recv of its key, in order (FIFO per key), and no segment is handed over."""
    monkeypatch.setattr(daemon_placing, "_MANY_INLINE_BYTES", 1000)
    a, b, big = key(0, 0, "a"), key(0, 0, "b"), key(0, 0, "big")
    sent = [(a, np.arange(100)), (big, np.arange(1 << 13, dtype=np.float64)), (a, np.arange(50)),
            (b, np.arange(100))]  # 2,000 bytes inline (and 64 KiB on a segment)

    async def main():
        async with daemons(sockdir) as (d,):
            for k, v in sent:
                d.server.send(k, v, step_id=1)
            sock = await session(d.sessions.path)
            (s,) = d.sessions.sessions.values()
            asked = [a, big, a, b]
            [(kind, op, body)] = await ask(sock, lf.frame(Kind.RECV_MANY, 4, many(asked, timeout=5.0)))
            assert (kind, op, code_of(body)) == (Kind.ERROR, 4, grpc.StatusCode.RESOURCE_EXHAUSTED)
            await until(lambda: not s.recvs, what="the batch to end")
            assert d.pool.holds(s.id) == 0 and d.pool.stats()["held"] == 0  # nothing handed over
            monkeypatch.setattr(daemon_placing, "_MANY_INLINE_BYTES", 1 << 40)
            [(kind, op, body)] = await ask(sock, lf.frame(Kind.RECV_MANY, 5, many(asked, timeout=5.0)))
            assert (kind, op) == (Kind.RECV_MANY_REPLY, 5)
            got = answered(body, len(asked))
            assert [how for how, _ in got] == ["packed", "pooled", "packed", "packed"]
            assert [got[i][1].tolist() for i in (0, 2, 3)] == [list(range(100)), list(range(50)), list(range(100))]
            [(seg_id, _)] = [(got[1][1].segment, got[1][1].nbytes)]
            await loop_release(sock, seg_id)
            await until(lambda: d.pool.holds(s.id) == 0, what="the segment to be released")
            sock.close()
            await nothing_left(d, asked)
    run(main())


async def loop_release(sock: socket.socket, seg_id: int) -> None:
    await asyncio.get_running_loop().sock_sendall(sock, lf.frame(Kind.RELEASE, 0, lf.pack_ids([seg_id])))


# -- a client that gives up ----------------------------------------------------------------------


def test_a_cancelled_batch_no_longer_counts_against_its_sessions_share(sockdir):  # noqa: F811
    """A client gives up on a batch that fills its session's share and asks the
    same keys again at once (the CANCEL and the new RECV_MANY in one write):
    the new batch is taken, not refused with RESOURCE_EXHAUSTED while the
    cancelled one unwinds, and gets every tensor once."""
    async def main():
        async with daemons(sockdir, max_waiting_calls=512) as (d,):  # a session's share: 64 keys
            sock = await session(d.sessions.path)
            (s,) = d.sessions.sessions.values()
            share = d.sessions.recv_share
            keys = [key(0, 0, f"k{i}") for i in range(share)]
            await asyncio.get_running_loop().sock_sendall(sock, lf.frame(Kind.RECV_MANY, 1, many(keys)))
            await until(lambda: s.waiting == share and len(d.local.waits) == share, what="the batch to wait")
            got = await ask(sock, lf.frame(Kind.CANCEL, 1), lf.frame(Kind.RECV_MANY, 2, many(keys, timeout=10.0)))
            # the cancelled batch's answer, and none for the new one: it waits
            assert [(kind, op, code_of(body) if kind == Kind.ERROR else None) for kind, op, body in got] == \
                [(Kind.ERROR, 1, grpc.StatusCode.CANCELLED)]
            await until(lambda: s.waiting == share and list(s.recvs) == [2], what="the second batch to wait")
            d.server.send_many([(k, np.full(2, i)) for i, k in enumerate(keys)], step_id=1)
            [(kind, op, body)] = await replies(sock, 1)
            assert (kind, op) == (Kind.RECV_MANY_REPLY, 2)
            assert [v.tolist() for _, v in answered(body, share)] == [[i, i] for i in range(share)]
            await until(lambda: s.waiting == 0 and not s.recvs, what="the batch to end")
            sock.close()
            await nothing_left(d, keys)
    run(main())


# -- a session's share of segments ---------------------------------------------------------------


def test_recvs_answered_together_stay_within_the_sessions_share_of_segments(sockdir):  # noqa: F811
    """Two recvs of one session whose tensors are copied into segments off the
    loop: each counted the room left before the other's copy was handed over,
    so together they passed the session's share. The second now crosses inside
    its frame."""
    x, y = np.arange(1 << 19, dtype=np.float64), -np.arange(1 << 19, dtype=np.float64)  # 4 MiB: copied off the loop

    async def main():
        async with daemons(sockdir) as (d,):
            d.sessions.segment_share = share = 2
            d.server.send(key(0, 0, "x"), x, step_id=1)
            d.server.send(key(0, 0, "y"), y, step_id=1)
            sock = await session(d.sessions.path)
            (s,) = d.sessions.sessions.values()
            [(kind, _, body)] = await ask(sock, lf.frame(Kind.LEND, 1, struct.pack("<Q", 1 << 16)))
            assert kind == Kind.OK and d.pool.holds(s.id) == 1  # one segment of the share held: room for one
            got = await ask(sock, lf.frame(Kind.RECV, 2, messages.recv_request(key(0, 0, "x"), 1, 5.0)),
                            lf.frame(Kind.RECV, 3, messages.recv_request(key(0, 0, "y"), 1, 5.0)), answers=2)
            assert sorted((k, op) for k, op, _ in got) == [(Kind.RECV_REPLY, 2), (Kind.RECV_REPLY, 3)]
            pooled = [op for _, op, body in got if messages.reply_fields(body).slot is not None]
            assert len(pooled) == 1 and d.pool.holds(s.id) == share, (pooled, d.pool.holds(s.id))
            [inline] = [body for _, op, body in got if op not in pooled]
            assert np.array_equal(messages.parse_reply(inline).item.value, y if pooled == [2] else x)
            sock.close()
            await until(lambda: not d.sessions.sessions and d.pool.stats()["held"] == 0,
                        what="the session's segments to go back")
            await nothing_left(d, [key(0, 0, "x"), key(0, 0, "y")])
    run(main())


# -- what a client hands out ----------------------------------------------------------------------


@pytest.mark.parametrize("how", ["aio", "blocking", "grpc"])
def test_every_array_a_client_hands_out_is_aligned_to_its_dtype(sockdir, how):  # noqa: F811
    """The payload of a frame starts wherever its 13-byte header ends: views of
    float64 tensors came out at addresses that are not multiples of 8 (torch
    reads such memory wrongly or crashes). Every array a client returns is
    aligned to its dtype: a single recv, a batch's packed tensors, a large
    tensor inside its frame, on the session socket and over gRPC."""
    shapes = [(3,), (5, 7), (200,), (1, 1, 9), (17,), (2, 300)]
    dtypes = [np.float64, np.complex128, np.int32, np.float32, np.int64, np.uint16]
    sent = {key(0, 0, f"t{i}{'x' * i}"): (np.arange(int(np.prod(shape))) * (i + 1)).astype(dt).reshape(shape)
            for i, (shape, dt) in enumerate((s, t) for s in shapes for t in dtypes)}
    large = {key(0, 0, f"large{i}"): np.arange(40_000 + i, dtype=np.float64) for i in range(3)}  # > 256 KiB frames

    async def main():
        async with daemons(sockdir) as (d,):
            d.sessions.segment_share = 0  # large tensors too cross inside the frames
            for k, v in {**sent, **large}.items():
                d.server.send(k, v, step_id=1)
                d.server.send(k, v, step_id=2)
            keys = list({**sent, **large})

            def blocking():
                with BlockingClient(d.local_target, shm_ok=how != "grpc") as c:
                    return [c.recv(k, step_id=1, timeout=5) for k in keys], c.recv_many(keys, step_id=2, timeout=5)

            if how == "aio":
                async with Client(d.local_target) as c:
                    one = [await c.recv(k, step_id=1, timeout=5) for k in keys]
                    batch = await c.recv_many(keys, step_id=2, timeout=5)
            else:
                one, batch = await asyncio.get_running_loop().run_in_executor(None, blocking)
            expected = [{**sent, **large}[k] for k in keys]
            for got in (one, batch):
                assert [g.dtype for g in got] == [v.dtype for v in expected]
                assert all(np.array_equal(g, v) for g, v in zip(got, expected))
                misaligned = [(k, g.dtype, g.__array_interface__["data"][0] % g.dtype.alignment)
                              for k, g in zip(keys, got) if not g.flags.aligned]
                assert not misaligned, misaligned
            del one, batch
            await nothing_left(d, keys, step_id=1)
    run(main())


def test_a_daemons_pending_builds_a_bounded_number_of_rows_on_both_sockets(sockdir, monkeypatch):
    """50,000 tensors wait in a daemon: Pending over its local gRPC service, and
    over the session socket, each builds at most 1,000 rows (counted as they are
    made), lists the oldest first and says how many it left out."""
    from rendezvous.items import PendingEntry

    built = {"rows": 0}
    make_row = PendingEntry.__new__

    def counting_row(cls, *args, **kwargs):
        built["rows"] += 1
        return make_row(cls, *args, **kwargs)

    async def main():
        async with daemons(sockdir) as (d,):
            d.server.send_many([(key(0, 0, f"k{i}"), np.zeros(1)) for i in range(50_000)], step_id=1)
            async with Client(d.local_target) as client:
                for ask_pending in (client.pending, lambda: asyncio.to_thread(_blocking_pending, d.local_target)):
                    built["rows"] = 0
                    monkeypatch.setattr(PendingEntry, "__new__", counting_row)
                    try:
                        entries = await ask_pending()
                    finally:
                        monkeypatch.undo()
                    assert 0 < len(entries) <= built["rows"] <= 1000 + len(entries), built
                    ages = [e.oldest_age_s for e in entries]
                    assert ages == sorted(ages, reverse=True)
    run(main(), timeout=120)


def _blocking_pending(target: str) -> list:
    with BlockingClient(target) as client:
        return client.pending()


def test_a_batch_that_ends_leaves_the_waits_of_batches_still_waiting(sockdir):  # noqa: F811
    """Two local batches wait at once; when the first is answered, the second's
    recvs still count as waiting (the stall watcher and Pending see them), once
    each, and go when it is answered.

    Checked to fail: with a batch's end dropping every wait parked since its
    own began (as it did), the second batch's three waits vanish with the first."""
    first = [key(0, 0, f"first{i}") for i in range(3)]
    second = [key(0, 0, f"second{i}") for i in range(3)]

    async def main():
        async with daemons(sockdir) as (d,):
            async with Client(d.local_target) as a, Client(d.local_target) as b:
                one = asyncio.ensure_future(a.recv_many(first, step_id=1, timeout=30))
                await until(lambda: len(d.local.waits) == 3, what="the first batch to wait")
                two = asyncio.ensure_future(b.recv_many(second, step_id=1, timeout=30))
                await until(lambda: len(d.local.waits) == 6, what="the second batch to wait")
                d.server.send_many([(k, np.full(2, i)) for i, k in enumerate(first)], step_id=1)
                assert [int(v[0]) for v in await one] == [0, 1, 2]
                assert sorted(w.key for w in d.local.waits.values()) == sorted(second)
                reply = d.local.pending_reply()
                assert len(reply.entries) + reply.omitted == 3, reply
                d.server.send_many([(k, np.full(2, i)) for i, k in enumerate(second)], step_id=1)
                assert [int(v[0]) for v in await two] == [0, 1, 2]
                assert not d.local.waits
            await nothing_left(d, first + second)
    run(main())
