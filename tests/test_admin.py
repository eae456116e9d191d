"""The Admin service (Stats, Pending) and gRPC health of a rank server and of
rendezvousd, called over gRPC as `rendezvous stats/pending/health` call them."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvous import aio, errors
from rendezvous.client.aio import Client
from rendezvous.rpc.admin import ADMIN_SERVICE, bounded_pending
from rendezvous.v1 import admin_pb2, admin_pb2_grpc
from rendezvous.v1 import local_pb2 as lpb
from rendezvous.v1 import rendezvous_pb2 as pb

from conftest import run, until
from test_daemon import daemons, key, sockdir  # noqa: F401  (sockdir: a fixture)

pytestmark = pytest.mark.timeout(60)

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
WORKER_KEY = ("/job:worker/replica:0/task:0/device:CPU:0;0000000000000000;"
              "/job:worker/replica:0/task:1/device:CPU:0;{};0:0")


async def serving_rank(cluster: dict, job: str = "worker", index: int = 0, **kwargs) -> aio.Server:
    """A started rank server: its Admin and health on its port (``server.admin``)."""
    server = aio.Server(cluster, job, index, **kwargs)
    await server.start()
    return server


async def stop_rank(server: aio.Server) -> None:
    await server.stop(0)


async def check(ch: grpc.aio.Channel, service: str = "") -> int:
    reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return reply.status


def test_a_rank_server_answers_stats_pending_and_health():
    """Stats carries the server's counters and table sizes, Pending its table
    (kind, step, key, count, producer), health SERVING for the server, the
    Rendezvous and Admin services, and NOT_SERVING for good once it drains."""
    async def main():
        server = await serving_rank({"worker": ["127.0.0.1:0", "127.0.0.1:0"]})
        try:
            server.send(WORKER_KEY.format("w"), np.ones(4, np.float32), step_id=3)
            server.send(WORKER_KEY.format("w"), np.ones(4, np.float32), step_id=3)
            async with grpc.aio.insecure_channel(server.target) as ch:
                admin = admin_pb2_grpc.AdminStub(ch)
                stats = await admin.Stats(admin_pb2.StatsRequest(), timeout=5)
                assert stats.task == "/job:worker/replica:0/task:0" and stats.protocol == "grpc"
                table, paths = MessageToDict(stats.table), MessageToDict(stats.paths)
                assert table["tensors"] == 2 and table["keys"] == 1
                assert set(paths) >= {"local", "grpc", "mpi", "gpu"} and paths["grpc"]["served"] == 0
                assert not stats.daemon.fields  # a plain rank server adds nothing
                pending = await admin.Pending(lpb.PendingRequest(), timeout=5)
                (entry,) = pending.entries
                assert (entry.kind, entry.step_id, entry.rendezvous_key, entry.count, entry.producer) == \
                    ("tensor", 3, WORKER_KEY.format("w"), 2, "/job:worker/replica:0/task:0")
                assert entry.oldest_age_seconds >= 0 and pending.omitted == 0
                # a peer takes one over gRPC: counted as served
                request = pb.RecvTensorRequest(step_id=3, rendezvous_key=WORKER_KEY.format("w"))
                await ch.unary_unary("/rendezvous.v1.Rendezvous/RecvTensor")(request.SerializeToString(), timeout=5)
                stats = await admin.Stats(admin_pb2.StatsRequest(), timeout=5)
                assert MessageToDict(stats.paths)["grpc"]["served"] == 1
                assert MessageToDict(stats.table)["tensors"] == 1
                for name in ("", "rendezvous.v1.Rendezvous", ADMIN_SERVICE):
                    assert await check(ch, name) == SERVING, name
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await check(ch, "rendezvous.v1.LocalRendezvous")  # not served on a rank's port
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
                await server.admin.set_serving(False)
                await server.admin.set_serving(True)  # a drain is for good
                for name in ("", "rendezvous.v1.Rendezvous", ADMIN_SERVICE):
                    assert await check(ch, name) == NOT_SERVING, name
        finally:
            await stop_rank(server)
    run(main())


def test_pending_answers_are_bounded_oldest_first():
    entries = [lpb.PendingEntry(step_id=i, rendezvous_key="k" * 100, kind="waiter", count=1,
                                oldest_age_seconds=float(i)) for i in range(100)]
    reply = bounded_pending(entries, max_bytes=1200)
    assert 0 < len(reply.entries) < 100 and reply.omitted == 100 - len(reply.entries)
    assert [e.step_id for e in reply.entries] == list(range(99, 99 - len(reply.entries), -1))
    assert bounded_pending(entries).omitted == 0


def test_a_malformed_request_is_invalid_argument():
    async def main():
        server = await serving_rank({"worker": ["127.0.0.1:0"]})
        try:
            async with grpc.aio.insecure_channel(server.target) as ch:
                for method in ("Stats", "Pending"):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await ch.unary_unary(f"/rendezvous.v1.Admin/{method}")(b"\xff\xff", timeout=5)
                    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        finally:
            await stop_rank(server)
    run(main())


def test_a_daemon_answers_for_the_node_on_both_ports(sockdir):
    """On the rank port and on the local socket: Pending lists the table and the
    local clients' recvs waiting on another task (remote); Stats adds the
    daemon's sessions and local waits. The rank port wants the token for Admin
    (not for health); the local Unix socket wants none."""
    async def main():
        async with daemons(sockdir, 2, token="s3cret") as (d0, d1), \
                Client(d0.local_target) as a, Client(d1.local_target) as b:
            await a.send(key(0, 1, "left"), np.ones(3), step_id=5)
            waiting = asyncio.create_task(b.recv(key(0, 1, "never"), step_id=5, timeout=30))
            await until(lambda: d1.local.waits, what="the remote wait")
            token = (("authorization", "Bearer s3cret"),)
            for target, metadata in ((d1.target, token), (d1.local_target, None)):
                async with grpc.aio.insecure_channel(target) as ch:
                    admin = admin_pb2_grpc.AdminStub(ch)
                    pending = await admin.Pending(lpb.PendingRequest(), timeout=5, metadata=metadata)
                    kinds = {(e.kind, e.rendezvous_key, e.producer) for e in pending.entries}
                    assert ("remote", key(0, 1, "never"), "/job:node/replica:0/task:0") in kinds, target
                    stats = MessageToDict(
                        (await admin.Stats(admin_pb2.StatsRequest(), timeout=5, metadata=metadata)).daemon)
                    assert stats["sessions"] == 1 and stats["local_waits"] == 1 and stats["draining"] is False
                    assert await check(ch) == SERVING
            async with grpc.aio.insecure_channel(d0.target) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await admin_pb2_grpc.AdminStub(ch).Pending(lpb.PendingRequest(), timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert await check(ch) == SERVING  # probes need no token
            async with grpc.aio.insecure_channel(d0.local_target) as ch:
                pending = await admin_pb2_grpc.AdminStub(ch).Pending(lpb.PendingRequest(), timeout=5)
                # the producer's table: the tensor left, and the other node's recv waiting
                assert {(e.kind, e.step_id, e.rendezvous_key, e.count) for e in pending.entries} == \
                    {("tensor", 5, key(0, 1, "left"), 1), ("waiter", 5, key(0, 1, "never"), 1)}
            waiting.cancel()
            with pytest.raises((asyncio.CancelledError, errors.RendezvousError)):
                await waiting
    run(main())

