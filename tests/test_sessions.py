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

from rendezvous.daemon.pool import Pool
from rendezvous.daemon.sessions import PoolBuffers
from rendezvous.local import frames as lf
from rendezvous.local import messages
from rendezvous.local.frames import Kind
from rendezvous.paths import Path
from rendezvous.table import Received
from rendezvous.tensors import TensorMeta, encode_meta
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
