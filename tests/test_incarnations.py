"""Incarnations: every server has one, publishes it with its address, and
refuses a key made for another incarnation of its task with ABORTED, so that
a consumer of a restarted producer fails closed instead of taking what the
new process makes under the old key. A key of incarnation 0 is taken by any."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import numpy as np
import pytest

import rendezvous
from rendezvous import aio, errors, make_key
from rendezvous.cluster import ClusterSpec
from rendezvous.keys import TaskName
from rendezvous.v1 import rendezvous_pb2 as pb

from conftest import run

PRODUCER = TaskName("worker", 0, 1)


def _key(name: str, incarnation: int, src: int = 1, dst: int = 0) -> str:
    return make_key(f"/job:worker/replica:0/task:{src}/device:CPU:0",
                    f"/job:worker/replica:0/task:{dst}/device:CPU:0", name, incarnation=incarnation).format()


async def _pair(**producer_overrides) -> tuple[aio.Server, aio.Server]:
    producer = aio.Server({"worker": ["127.0.0.1:0", "127.0.0.1:0"]}, "worker", 1, **producer_overrides)
    await producer.start()
    consumer = aio.Server({"worker": ["127.0.0.1:0", {"address": producer.target,
                                                     "incarnation": producer.incarnation}]}, "worker", 0)
    await consumer.start()
    return producer, consumer


@pytest.mark.parametrize("unary", [False, True], ids=["stream", "unary"])
def test_a_restarted_producer_refuses_its_old_incarnations_keys_naming_both(unary):
    async def main():
        first, consumer = await _pair()
        try:
            old = first.incarnation
            assert old != 0 and consumer.incarnation_of(PRODUCER) == old
            assert consumer.incarnation_of("/job:worker/replica:0/task:1/device:CPU:0") == old
            k_old = _key("w", consumer.incarnation_of(PRODUCER))
            first.send(k_old, np.arange(3.0), step_id=1)
            assert (await consumer.recv(k_old, step_id=1, timeout=10)).tolist() == [0.0, 1.0, 2.0]
            address = first.target
            await first.stop(0)
            # the producer's process restarts on the same address: a new incarnation
            second = aio.Server({"worker": ["127.0.0.1:0", address]}, "worker", 1)
            await second.start()
            try:
                new = second.incarnation
                assert new not in (0, old)
                # what the new process makes under its own keys, and under incarnation 0
                second.send(_key("w", new), np.full(3, 666.0), step_id=2)
                second.send(_key("w", 0), np.full(3, 7.0), step_id=2)
                with pytest.raises(errors.Aborted) as info:
                    second.send(k_old, np.full(3, 666.0), step_id=2)  # nor may it send under the old one
                assert f"{old:#x}" in str(info.value) and f"{new:#x}" in str(info.value)
                if unary:  # TensorFlow's unary RecvTensor, as another client would ask
                    channel = grpc.aio.insecure_channel(second.target)
                    try:
                        call = channel.unary_unary("/rendezvous.v1.Rendezvous/RecvTensor")
                        request = pb.RecvTensorRequest(step_id=2, rendezvous_key=k_old).SerializeToString()
                        with pytest.raises(grpc.aio.AioRpcError) as refused:
                            await call(request, timeout=10)
                    finally:
                        await channel.close()
                    assert refused.value.code() is grpc.StatusCode.ABORTED
                    message = refused.value.details()
                else:
                    with pytest.raises(errors.Aborted) as info:
                        await consumer.recv(k_old, step_id=2, timeout=10)
                    message = str(info.value)
                assert f"{old:#x}" in message and f"{new:#x}" in message, message
                assert "restarted" in message
                # incarnation 0 keeps today's meaning: any incarnation's tensor
                assert (await consumer.recv(_key("w", 0), step_id=2, timeout=10)).tolist() == [7.0] * 3
                # the refusal consumed nothing: the new incarnation's own tensor is still there
                assert [(p.key, p.count) for p in second.pending()] == [(_key("w", new), 1)]
                assert (await consumer.recv(_key("w", new), step_id=2, timeout=10)).tolist() == [666.0] * 3
                assert second.pending() == [] and consumer.pending() == []
            finally:
                await second.stop(0)
        finally:
            await consumer.stop(0)
    run(main())


def test_recv_many_of_a_restarted_producer_fails_with_aborted_and_takes_nothing():
    async def main():
        producer, consumer = await _pair()
        try:
            stale = producer.incarnation ^ 1
            producer.send(_key("a", producer.incarnation), np.ones(2), step_id=3)
            with pytest.raises(errors.Aborted) as info:
                await consumer.recv_many([_key("a", producer.incarnation), _key("b", stale)], step_id=3,
                                         timeout=10)
            assert list(info.value.failures) == [_key("b", stale)], info.value
            # nothing was consumed: the good key's tensor is still there for the next recv
            assert (await consumer.recv(_key("a", producer.incarnation), step_id=3, timeout=10)).tolist() == [1, 1]
            assert producer.pending() == [] and consumer.pending() == []
        finally:
            await consumer.stop(0)
            await producer.stop(0)
    run(main())


def test_the_incarnation_comes_from_the_setting_then_the_cluster_then_chance(monkeypatch):
    spec = {"worker": [{"address": "127.0.0.1:0", "incarnation": "0x5eed"}, "127.0.0.1:0"]}
    assert aio.Server(spec, "worker", 0).incarnation == 0x5EED
    assert aio.Server(spec, "worker", 0, incarnation=9).incarnation == 9
    monkeypatch.setenv("RENDEZVOUS_INCARNATION", "0x10")
    assert aio.Server(spec, "worker", 1).incarnation == 16
    monkeypatch.delenv("RENDEZVOUS_INCARNATION")
    drawn = {aio.Server(spec, "worker", 1).incarnation for _ in range(4)}
    assert len(drawn) == 4 and 0 not in drawn
    with pytest.raises(errors.InvalidArgument, match="incarnation"):
        aio.Server(spec, "worker", 1, incarnation=-1)
    with pytest.raises(errors.InvalidArgument, match="incarnation"):
        ClusterSpec.from_any({"worker": [{"address": "127.0.0.1:1", "incarnation": "zz"}]})
    with pytest.raises(errors.InvalidArgument, match="address"):
        ClusterSpec.from_any({"worker": [{"where": "127.0.0.1:1"}]})


def test_a_cluster_file_publishes_incarnations_and_the_cluster_writes_them_back(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"worker": ["127.0.0.1:5000", {"address": "127.0.0.1:5001", "incarnation": 42}]}))
    server = aio.Server(str(path), "worker", 0)
    assert server.incarnation_of(PRODUCER) == 42
    assert server.incarnation_of(TaskName("worker", 0, 0)) == server.incarnation
    back = server.cluster.as_dict()["worker"]
    assert back[1] == {"address": "127.0.0.1:5001", "incarnation": 42}
    assert back[0] == {"address": "127.0.0.1:5000", "incarnation": server.incarnation}
    # a new address for the producer without an incarnation: its old one is no longer known
    server.update_cluster({"worker": ["127.0.0.1:5000", "127.0.0.1:5009"]})
    assert server.incarnation_of(PRODUCER) == 0
    assert server.incarnation_of(TaskName("worker", 0, 0)) == server.incarnation


def test_the_bootstrap_publishes_every_ranks_incarnation():
    async def main():
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
        zero = aio.Server.from_env(env={**env, "RANK": "0"})
        one = aio.Server.from_env(env={**env, "RANK": "1"})
        try:
            await asyncio.gather(zero.start(), one.start())
            assert zero.incarnation_of(one.task) == one.incarnation != 0
            assert one.incarnation_of(zero.task) == zero.incarnation != 0
            k = _key("b", one.incarnation)
            one.send(k, np.arange(2), step_id=1)
            assert (await zero.recv(k, step_id=1, timeout=10)).tolist() == [0, 1]
        finally:
            await one.stop(0)
            await zero.stop(0)
    run(main())


def test_the_blocking_server_tells_its_incarnation():
    server = rendezvous.Server({"worker": ["127.0.0.1:0", {"address": "127.0.0.1:1", "incarnation": 3}]},
                               "worker", 0, incarnation=5)
    try:
        assert server.incarnation == 5
        assert server.incarnation_of("/job:worker/task:1") == 3
        assert re.fullmatch(r"\d+", str(server.incarnation_of("/job:worker/replica:0/task:0/device:CPU:0")))
    finally:
        server.stop(0)
