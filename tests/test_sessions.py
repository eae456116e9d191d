"""One client's session on the daemon's session socket (rendezvous/daemon/sessions.py),
frame by frame: what each operation answers, what a mistake gets, and what a
session gives back when it ends."""

from __future__ import annotations

import asyncio
import os
import struct

import grpc
import numpy as np
import pytest

from rendezvous.client.aio import Client
from rendezvous.daemon.pool import Pool
from rendezvous.daemon.sessions import PoolBuffers
from rendezvous.local import frames as lf
from rendezvous.codec import wire
from rendezvous.local import messages
from rendezvous.local.frames import Kind
from rendezvous.paths import Path
from rendezvous.items import Received
from rendezvous.codec.tensors import TensorMeta, encode_meta
from rendezvous.v1 import local_pb2 as lpb

from conftest import run, until
from test_daemon import daemons, key, sockdir  # noqa: F401 (a fixture)
from test_hostile_clients import replies, session

pytestmark = pytest.mark.timeout(60)


def code_of(body: bytes) -> grpc.StatusCode:
    code, _ = lf.unpack_error(body)
    return next(c for c in grpc.StatusCode if c.value[0] == code)


async def ask(sock, *frames_: bytes, answers: int = 1) -> list[tuple[int, int, bytes]]:
    await asyncio.get_running_loop().sock_sendall(sock, b"".join(frames_))
    return await replies(sock, answers)


def test_mistakes_get_their_status_and_the_session_goes_on(sockdir):  # noqa: F811
    async def main():
        async with daemons(sockdir) as (d,):
            sock = await session(d.sessions.path)
            (s,) = d.sessions.sessions.values()
            recv = messages.recv_request(key(0, 0, "later"), 1, None)
            got = await ask(sock, lf.frame(Kind.RECV, 5, recv), lf.frame(Kind.RECV, 5, recv),  # the id twice
                            lf.frame(Kind.HELLO, 6, b""),  # a second hello
                            lf.frame(0x42, 7, b""),  # no such kind
                            lf.frame(Kind.LEND, 8, struct.pack("<Q", 0)),  # nothing to lend
                            lf.frame(Kind.LEND, 9, struct.pack("<Q", 1 << 62)),  # above max_tensor_bytes
                            lf.frame(Kind.RECV, 10, b"\xff\xff"),  # not a LocalRecvRequest
                            lf.frame(Kind.CANCEL, 999),  # nothing to cancel: no answer
                            answers=6)
            by_op = {op: (kind, code_of(body)) for kind, op, body in got}
            assert by_op == {5: (Kind.ERROR, grpc.StatusCode.INVALID_ARGUMENT),
                             6: (Kind.ERROR, grpc.StatusCode.INVALID_ARGUMENT),
                             7: (Kind.ERROR, grpc.StatusCode.INVALID_ARGUMENT),
                             8: (Kind.ERROR, grpc.StatusCode.INVALID_ARGUMENT),
                             9: (Kind.ERROR, grpc.StatusCode.RESOURCE_EXHAUSTED),
                             10: (Kind.ERROR, grpc.StatusCode.INVALID_ARGUMENT)}
            # the first recv of id 5 still waits, and is answered when the tensor comes
            assert list(s.recvs) == [5]
            d.server.send(key(0, 0, "later"), np.arange(3), step_id=1)
            [(kind, op, body)] = await replies(sock, 1)
            assert (kind, op) == (Kind.RECV_REPLY, 5)
            assert messages.parse_reply(body).item.value.tolist() == [0, 1, 2]
            sock.close()
    run(main())


def test_releasing_what_it_does_not_hold_is_counted_not_answered(sockdir):  # noqa: F811
    async def main():
        async with daemons(sockdir) as (d,):
            sock = await session(d.sessions.path)
            (s,) = d.sessions.sessions.values()
            got = await ask(sock, lf.frame(Kind.RELEASE, 0, lf.pack_ids([12345, 67890])),
                            lf.frame(Kind.PENDING, 3))
            assert [(k, op) for k, op, _ in got] == [(Kind.PENDING_REPLY, 3)]  # no answer to RELEASE
            assert s.bad == 2 and d.sessions.misused >= 2
            sock.close()
    run(main())


def test_a_failed_pooled_send_gives_its_segment_back(sockdir):  # noqa: F811
    async def main():
        async with daemons(sockdir) as (d,):
            sock = await session(d.sessions.path)
            (s,) = d.sessions.sessions.values()
            [(kind, _, body)] = await ask(sock, lf.frame(Kind.LEND, 4, struct.pack("<Q", 1 << 16)))
            [(seg_id, size)] = lf.unpack_grants(body)
            assert kind == Kind.OK and d.pool.holds(s.id) == 1
            # names the segment but announces more bytes than its dtype and shape need
            value = np.zeros(10, np.float32)
            raw = lpb.SendRequest(step_id=1, rendezvous_key=key(0, 0, "t"),
                                  pooled=lpb.PoolSlot(segment=seg_id, nbytes=value.nbytes + 4))
            raw.tensor.ParseFromString(encode_meta(TensorMeta(value.dtype, value.shape)))
            [(kind, _, body)] = await ask(sock, lf.frame(Kind.SEND, 5, raw.SerializeToString()))
            assert kind == Kind.ERROR and code_of(body) == grpc.StatusCode.INVALID_ARGUMENT
            assert d.pool.holds(s.id) == 0 and d.pool.get(seg_id).lent_to is None  # given back
            assert not d.server.pending()
            sock.close()
    run(main())


def test_a_returned_tensor_is_kept_for_the_next_recv_of_its_key(sockdir):  # noqa: F811
    async def main():
        async with daemons(sockdir) as (d,):
            sock = await session(d.sessions.path)
            reply = messages.inline_reply(Received(np.arange(5), False), Path.GRPC)
            back = messages.returned(key(1, 0, "late"), 2, reply)  # a key another task produces
            [(kind, op, _)] = await ask(sock, lf.frame(Kind.RETURN, 6, back))
            assert (kind, op) == (Kind.OK, 6)
            assert d.server.kept.count() == 1
            recv = messages.recv_request(key(1, 0, "late"), 2, 5.0)
            [(kind, op, body)] = await ask(sock, lf.frame(Kind.RECV, 7, recv))
            assert (kind, op) == (Kind.RECV_REPLY, 7)
            assert messages.parse_reply(body).item.value.tolist() == [0, 1, 2, 3, 4]
            assert not d.server.kept
            sock.close()
    run(main())


def test_a_session_that_ends_cancels_its_recvs_and_gives_back_its_segments(sockdir):  # noqa: F811
    async def main():
        async with daemons(sockdir) as (d,):
            sock = await session(d.sessions.path)
            (s,) = d.sessions.sessions.values()
            await ask(sock, lf.frame(Kind.LEND, 1, struct.pack("<Q", 1 << 16)))
            await asyncio.get_running_loop().sock_sendall(
                sock, lf.frame(Kind.RECV, 2, messages.recv_request(key(0, 0, "never"), 1, None)))
            await until(lambda: s.recvs and d.local.waits, what="the recv to wait")
            assert d.pool.holds(s.id) == 1 and d.sessions._per_pid[os.getpid()] == 1
            sock.close()
            await until(lambda: not d.sessions.sessions, what="the session to end")
            await until(lambda: not d.local.waits and not d.server.pending(), what="its recv to be cancelled")
            assert d.pool.holds(s.id) == 0 and d.pool.stats()["lent"] == 0
            assert os.getpid() not in d.sessions._per_pid
    run(main())


def test_pool_buffers_put_large_receives_in_the_pool():
    pool = Pool(8 << 20, max_segments=4)
    try:
        buffers = PoolBuffers(pool, threshold=64 << 10, limit=0)
        small = buffers.empty((16,), np.float32)
        large = buffers.empty((1 << 16,), np.float32)  # 256 KiB
        assert pool.segment_of(small) is None and pool.segment_of(large) is not None
        assert large.shape == (1 << 16,) and large.dtype == np.float32
        held = [buffers.empty((1 << 18,), np.uint8) for _ in range(8)]  # the pool runs out: host memory
        assert sum(pool.segment_of(a) is not None for a in held) < 8 and all(a.nbytes == 1 << 18 for a in held)
        del small, large, held
    finally:
        pool.close()


# -- RECV_MANY: a batch as one operation ------------------------------------------------


def many(keys: list[str], step_id: int = 1, timeout: float | None = None) -> bytes:
    return messages.recv_many_request(keys, step_id, timeout)


def answered(body: bytes, n: int) -> list[tuple[str, object]]:
    """A RECV_MANY_REPLY's answers: ("packed", array), ("pooled", (segment, nbytes))
    or ("reply", item), in key order."""
    out = []
    for answer in messages.parse_many(body, n).answers:
        if len(answer) == 4:
            out.append(("packed", messages.packed_view(body, answer)))
            continue
        raw = body[answer[0]:answer[1]]
        fields = messages.reply_fields(raw)
        if fields.slot is not None:
            out.append(("pooled", lpb.PoolSlot.FromString(raw[fields.slot[0]:fields.slot[1]])))
        else:
            out.append(("reply", messages.parse_reply(raw).item))
    return out


def test_recv_many_answers_every_key_in_order_in_one_frame(sockdir):  # noqa: F811
    async def main():
        async with daemons(sockdir) as (d,):
            sock = await session(d.sessions.path)
            (s,) = d.sessions.sessions.values()
            big = np.arange(1 << 16, dtype=np.float64)  # above the pool's threshold: handed over on a segment
            d.server.send(key(0, 0, "a"), np.arange(3), step_id=1)
            d.server.send(key(0, 0, "a"), np.arange(4), step_id=1)  # the same key twice: FIFO
            d.server.send(key(0, 0, "big"), big, step_id=1)
            d.server.send(key(0, 0, "dead"), None, step_id=1, is_dead=True)
            keys = [key(0, 0, "a"), key(0, 0, "big"), key(0, 0, "dead"), key(0, 0, "a")]
            [(kind, op, body)] = await ask(sock, lf.frame(Kind.RECV_MANY, 3, many(keys, timeout=5.0)))
            assert (kind, op) == (Kind.RECV_MANY_REPLY, 3)
            await until(lambda: s.waiting == 0 and not s.recvs, what="the batch to end")
            got = answered(body, len(keys))
            # the small ones packed in one group, the big one on a segment, the dead one a reply
            assert [how for how, _ in got] == ["packed", "pooled", "reply", "packed"]
            assert got[0][1].tolist() == [0, 1, 2] and got[3][1].tolist() == [0, 1, 2, 3]
            assert got[1][1].nbytes == big.nbytes and got[2][1].is_dead
            assert d.pool.holds(s.id) == 1  # the big one's segment, the client's until it releases it
            assert not d.server.pending() and s.waiting == 0 and not s.recvs and not d.local.waits
            sock.close()
    run(main())


def test_a_failed_recv_many_names_its_keys_and_takes_nothing(sockdir):  # noqa: F811
    async def main():
        async with daemons(sockdir) as (d,):
            sock = await session(d.sessions.path)
            (s,) = d.sessions.sessions.values()
            d.server.send(key(0, 0, "x"), np.arange(2), step_id=1)
            d.server.send(key(0, 0, "x"), np.arange(5), step_id=1)
            d.server.send(key(0, 0, "y"), np.arange(1 << 16, dtype=np.float64), step_id=1)
            keys = [key(0, 0, "x"), key(0, 0, "none"), key(0, 0, "y"), key(0, 0, "x")]
            [(kind, op, body)] = await ask(sock, lf.frame(Kind.RECV_MANY, 4, many(keys, timeout=0.3)))
            assert (kind, op) == (Kind.RECV_MANY_REPLY, 4)
            got = messages.parse_many(body, len(keys))
            assert list(got.failures) == [1] and got.failures[1].code == grpc.StatusCode.DEADLINE_EXCEEDED
            await until(lambda: s.waiting == 0, what="the batch to end")
            # nothing was taken or handed over: both x, in their order, and y are still there
            assert d.pool.holds(s.id) == 0 and s.waiting == 0 and not d.local.waits
            again = [key(0, 0, "x"), key(0, 0, "y"), key(0, 0, "x")]
            [(_, _, body)] = await ask(sock, lf.frame(Kind.RECV_MANY, 5, many(again, timeout=5.0)))
            got = answered(body, 3)
            assert [how for how, _ in got] == ["packed", "pooled", "packed"]
            assert got[0][1].tolist() == [0, 1] and got[2][1].tolist() == [0, 1, 2, 3, 4]
            assert not d.server.pending() and not d.server.kept
            sock.close()
    run(main())


def unkept(d) -> list:
    """What the daemon's pending() lists besides the tensors it keeps for the next recv of their keys."""
    return [e for e in d.server.pending() if e.kind != "kept"]


def test_a_cancelled_or_abandoned_recv_many_keeps_what_arrived(sockdir):  # noqa: F811
    async def main():
        async with daemons(sockdir) as (d,):
            sock = await session(d.sessions.path)
            (s,) = d.sessions.sessions.values()
            d.server.send(key(0, 0, "here"), np.arange(3), step_id=1)
            keys = [key(0, 0, "here"), key(0, 0, "later")]
            await asyncio.get_running_loop().sock_sendall(sock, lf.frame(Kind.RECV_MANY, 6, many(keys)))
            await until(lambda: s.waiting == 2 and len(d.local.waits) == 2, what="the batch to wait")
            [(kind, op, body)] = await ask(sock, lf.frame(Kind.CANCEL, 6))
            assert (kind, op, code_of(body)) == (Kind.ERROR, 6, grpc.StatusCode.CANCELLED)
            await until(lambda: s.waiting == 0 and not s.recvs, what="the batch to end")
            assert not d.local.waits and not unkept(d) and d.server.kept.count() == 1
            # the session ends while a batch waits: the same
            await asyncio.get_running_loop().sock_sendall(sock, lf.frame(Kind.RECV_MANY, 7, many(keys)))
            await until(lambda: s.waiting == 2, what="the second batch to wait")
            sock.close()
            await until(lambda: not d.sessions.sessions, what="the session to end")
            await until(lambda: not d.local.waits, what="its batch to be cancelled")
            assert not unkept(d) and d.server.kept.count() == 1
            async with Client(d.local_target) as c:  # kept for the next recv
                assert (await c.recv(key(0, 0, "here"), step_id=1, timeout=5)).tolist() == [0, 1, 2]
    run(main())


def test_recv_many_mistakes_and_its_share_of_waiting_recvs(sockdir):  # noqa: F811
    async def main():
        async with daemons(sockdir, max_waiting_calls=512) as (d,):  # a session's share: 64 keys
            sock = await session(d.sessions.path)
            (s,) = d.sessions.sessions.values()
            share = d.sessions.recv_share
            assert share == 64
            waits = [lf.frame(Kind.RECV, i, messages.recv_request(key(0, 0, f"w{i}"), 1, None)) for i in range(1, 11)]
            got = await ask(sock, *waits,
                            lf.frame(Kind.RECV_MANY, 20, many([key(0, 0, f"k{i}") for i in range(share - 9)])),
                            lf.frame(Kind.RECV_MANY, 21, b"\xff\xff"),  # not a LocalRecvManyRequest
                            lf.frame(Kind.RECV_MANY, 22, many(["not a key"])),
                            lf.frame(Kind.RECV_MANY, 23, many([])),  # nothing asked: answered at once
                            answers=4)
            by_op = {op: (kind, code_of(body) if kind == Kind.ERROR else body) for kind, op, body in got}
            assert by_op == {20: (Kind.ERROR, grpc.StatusCode.RESOURCE_EXHAUSTED),
                             21: (Kind.ERROR, grpc.StatusCode.INVALID_ARGUMENT),
                             22: (Kind.ERROR, grpc.StatusCode.INVALID_ARGUMENT),
                             23: (Kind.RECV_MANY_REPLY, b"")}
            assert s.waiting == 10
            # the share left is taken whole by a batch that fits it
            fits = [key(0, 0, f"k{i}") for i in range(share - 10)]
            await asyncio.get_running_loop().sock_sendall(sock, lf.frame(Kind.RECV_MANY, 24, many(fits)))
            await until(lambda: s.waiting == share, what="the batch to wait")
            d.server.send_many([(k, np.arange(1)) for k in fits], step_id=1)
            [(kind, op, body)] = await replies(sock, 1)
            assert (kind, op) == (Kind.RECV_MANY_REPLY, 24) and len(answered(body, len(fits))) == 54
            await until(lambda: s.waiting == 10, what="the batch to end")
            sock.close()
    run(main())


def test_a_late_batch_reply_goes_back_in_order(sockdir):  # noqa: F811
    """A client whose batch gave up before its answer came returns every tensor
    (last first, so the daemon, which keeps each in front, keeps their order)."""
    from rendezvous.client.core import LocalOp
    from rendezvous.client.link import Router

    class Link(Router):
        def __init__(self):
            self.written = []
            self._ops, self._cancelled = {}, {}

        def _write(self, data):
            self.written.append(data)

    async def main():
        async with daemons(sockdir) as (d,):
            k = key(1, 0, "late")  # another task's key: a recv would ask it
            # the first and last packed, the middle one a reply of its own
            reply = b"".join(messages.many_answer([(Received(np.arange(n), False), Path.GRPC) for n in (1, 2, 3)], 1 << 20,
                                         {1: messages.inline_reply(Received(np.arange(2), False), Path.GRPC)}))
            assert [len(a) for a in messages.parse_many(reply, 3).answers] == [4, 2, 4]
            link = Link()
            link._cancelled[9] = LocalOp(Kind.RECV_MANY, b"", step_id=3, keys=(k, key(0, 0, "other"), k))
            assert link._route(Kind.RECV_MANY_REPLY, 9, memoryview(reply)) is None
            [data] = link.written
            sock = await session(d.sessions.path)
            got = await ask(sock, data, answers=3)
            assert [kind for kind, _, _ in got] == [Kind.OK] * 3
            [(_, _, body)] = await ask(sock, lf.frame(Kind.RECV_MANY, 2, many([k, k, key(0, 0, "other")], 3, 5.0)))
            assert [v.tolist() for _, v in answered(body, 3)] == [[0], [0, 1, 2], [0, 1]]
            # a failed batch's late answer has nothing to give back
            link.written.clear()
            link._cancelled[10] = LocalOp(Kind.RECV_MANY, b"", step_id=3, keys=(k,))
            link._route(Kind.RECV_MANY_REPLY, 10, memoryview(messages.many_failed([(0, 4, "late")])))
            assert link.written == []
            sock.close()
    run(main())


def test_a_batch_answer_that_lies_is_invalid_argument():
    from rendezvous.codec import groups
    from rendezvous.errors import InvalidArgument

    arrays = [np.arange(3), np.ones(2, np.float32)]
    group = b"".join(groups.group_parts([0, 1], arrays, groups.layout(arrays), field=3))
    paths = bytes([1, 2])
    ok = group + b"\x22" + bytes([len(paths)]) + paths  # field 4, LEN
    assert [messages.packed_view(ok, a).tolist() for a in messages.parse_many(ok, 2).answers] == [[0, 1, 2], [1, 1]]
    reply = messages.inline_reply(Received(np.arange(1), False), Path.LOCAL)
    lies = [
        (ok, 3),  # answers 2 of 3
        (ok, 1),  # names key 1 of a batch of 1
        (group, 2),  # no paths
        (group + b"\x22\x01\x01", 2),  # one path for two tensors
        (group + b"\x22\x02\x01\x09", 2),  # a path that does not exist
        (b"".join(messages.many_reply([reply, reply])) + ok, 2),  # a key answered twice
        (messages.many_failed([(5, 4, "x")]), 2),  # a failure outside the batch
    ]
    for raw, n in lies:
        with pytest.raises(InvalidArgument):
            messages.parse_many(raw, n)


# -- SEND_MANY: small tensors packed in one operation ------------------------------------


def test_send_many_produces_every_tensor_in_order_or_none(sockdir):  # noqa: F811
    async def main():
        async with daemons(sockdir) as (d,):
            sock = await session(d.sessions.path)
            k = key(0, 0, "k")
            values = [np.arange(3), np.ones((2, 2), np.float32), np.arange(5, dtype=np.int8)]
            body = messages.send_many_request([k, key(0, 0, "other"), k], values, 4)
            [(kind, op, _)] = await ask(sock, lf.frame(Kind.SEND_MANY, 3, body))
            assert (kind, op) == (Kind.OK, 3)
            assert {(e.key, e.count) for e in d.server.pending()} == {(k, 2), (key(0, 0, "other"), 1)}
            got = await d.server.recv_many([k, key(0, 0, "other"), k], step_id=4, timeout=5)
            assert [g.tolist() for g in got] == [v.tolist() for v in values]  # FIFO for k
            # refused whole: a key another task produces, a malformed body, a group that does not
            # answer its keys in order, an aborted step
            arrays = [np.arange(2), np.arange(3)]
            from rendezvous.codec import groups
            shuffled = b"".join([wire.varint_field(1, 4), *(wire.len_field_header(2, len(x)) + x.encode()
                                                            for x in (k, k)),
                                 *groups.group_parts([1, 0], arrays, groups.layout(arrays), field=3)])
            d.server.abort(9, "gone")
            got = await ask(sock,
                            lf.frame(Kind.SEND_MANY, 4, messages.send_many_request([k, key(1, 0, "theirs")], arrays, 4)),
                            lf.frame(Kind.SEND_MANY, 5, b"\x1a\x05junk!"),
                            lf.frame(Kind.SEND_MANY, 6, shuffled),
                            lf.frame(Kind.SEND_MANY, 7, messages.send_many_request([k, k], arrays, 9)),
                            lf.frame(Kind.SEND_MANY, 8, messages.send_many_request([k], arrays, 4)),  # 2 for 1 key
                            answers=5)
            assert [(op, code_of(body)) for _, op, body in got] == [
                (4, grpc.StatusCode.FAILED_PRECONDITION), (5, grpc.StatusCode.INVALID_ARGUMENT),
                (6, grpc.StatusCode.INVALID_ARGUMENT), (7, grpc.StatusCode.ABORTED),
                (8, grpc.StatusCode.INVALID_ARGUMENT)]
            assert not d.server.pending()  # none of them produced anything
            sock.close()
    run(main())


@pytest.mark.parametrize("blocking", [False, True])
def test_a_clients_send_many_packs_small_tensors_and_keeps_the_order(sockdir, blocking):  # noqa: F811
    from rendezvous.client import Client as BlockingClient

    k = key(0, 0, "k")
    big = np.arange(1 << 15, dtype=np.float64)  # above the threshold: through a segment
    items = [(k, np.arange(3)), (k, big), (k, np.arange(4)), (key(0, 0, "dead"), None, True),
             (k, np.array([b"a", b"bc"])), (k, np.arange(5))]

    async def main():
        async with daemons(sockdir) as (d,):
            if blocking:
                def go():
                    with BlockingClient(d.local_target) as c:
                        c.send_many(items, step_id=2)
                        return c.stats()
                stats = await asyncio.get_running_loop().run_in_executor(None, go)
            else:
                async with Client(d.local_target) as c:
                    await c.send_many(items, step_id=2)
                    stats = c.stats()
            assert stats == {"send_inline": 5, "send_shm": 1}
            got = await d.server.recv_many([k] * 5 + [key(0, 0, "dead")], step_id=2, timeout=5)
            assert [g.tolist() for g in got[:5]] == [[0, 1, 2], big.tolist(), [0, 1, 2, 3], [b"a", b"bc"],
                                                     [0, 1, 2, 3, 4]]
            assert got[5] is None and not d.server.pending()
    run(main())
