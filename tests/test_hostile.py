"""Hostile and careless inputs: each gets a clear status, the server keeps
serving, and nothing it holds grows without bound."""

from __future__ import annotations

import asyncio
import gc

import grpc
import numpy as np
import pytest

from rendezvous import keys
from rendezvous.errors import InvalidKey
from rendezvous.v1 import rendezvous_pb2 as pb

from conftest import cluster, run, until

pytestmark = pytest.mark.timeout(60)

PRODUCER = "/job:worker/replica:0/task:1/device:CPU:0"
CONSUMER = "/job:worker/replica:0/task:0/device:CPU:0"


def test_a_key_longer_than_the_limit_is_refused_naming_the_limit():
    long_name = "n" * keys.MAX_KEY_LENGTH
    with pytest.raises(InvalidKey, match=f"more than the {keys.MAX_KEY_LENGTH}"):
        keys.parse_key(f"{PRODUCER};0000000000000000;{CONSUMER};{long_name};0:0")
    fits = "n" * (keys.MAX_KEY_LENGTH - 200)
    assert keys.parse_key(f"{PRODUCER};0000000000000000;{CONSUMER};{fits};0:0").name == fits


def test_long_keys_are_refused_and_nothing_keeps_them():
    """Distinct 1 MB keys with short deadlines once grew a server by the size of
    every key it was sent (kept in several caches): now each is INVALID_ARGUMENT
    (here keys of 100,000 characters, which fit in a request) and no cache holds one."""
    async def main():
        async with cluster(2) as (a, b):
            before = keys._parse_key_cached.cache_info().currsize
            async with grpc.aio.insecure_channel(b.target) as channel:
                call = channel.unary_unary("/rendezvous.v1.Rendezvous/RecvTensor")
                for i in range(20):
                    huge = f"{PRODUCER};0000000000000000;{CONSUMER};{str(i % 10) * 100_000};0:0"
                    request = pb.RecvTensorRequest(step_id=1, rendezvous_key=huge).SerializeToString()
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call(request, timeout=10)
                    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert "characters" in info.value.details()
                # a key of ordinary length is still served
                ok = f"{PRODUCER};0000000000000000;{CONSUMER};fine;0:0"
                b.send(ok, np.array([1]), step_id=1)
                reply = pb.RecvTensorResponse.FromString(
                    await call(pb.RecvTensorRequest(step_id=1, rendezvous_key=ok).SerializeToString(), timeout=10))
                assert reply.tensor.tensor_content == np.array([1]).tobytes()
            held = sum(len(k) for k in b.servicer._canonical)
            assert held < 1 << 12, f"the servicer keeps {held} characters of keys"
            assert keys._parse_key_cached.cache_info().currsize <= before + 1
    run(main())


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_requests_larger_than_a_request_needs_are_refused_before_they_cost_memory():
    """60 refused 4 MB keys once raised a daemon's RSS by about 300 MB (the server
    took requests of up to 4 MiB, then refused the key). A RecvTensor request
    needs a few KiB: a larger one is RESOURCE_EXHAUSTED as it arrives
    (max_request_bytes, 256 KiB), and the server keeps serving."""
    async def main():
        async with cluster(2) as (a, b):
            gc.collect()
            before = _rss_mib()
            async with grpc.aio.insecure_channel(b.target) as channel:
                call = channel.unary_unary("/rendezvous.v1.Rendezvous/RecvTensor")
                for i in range(60):
                    huge = f"{PRODUCER};0000000000000000;{CONSUMER};{str(i % 10) * 4_000_000};0:0"
                    request = pb.RecvTensorRequest(step_id=1, rendezvous_key=huge).SerializeToString()
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call(request, timeout=10)
                    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    del request, huge
                ok = f"{PRODUCER};0000000000000000;{CONSUMER};fine;0:0"
                b.send(ok, np.array([1]), step_id=1)
                reply = pb.RecvTensorResponse.FromString(
                    await call(pb.RecvTensorRequest(step_id=1, rendezvous_key=ok).SerializeToString(), timeout=10))
                assert reply.tensor.tensor_content == np.array([1]).tobytes()
            gc.collect()
            # this process is the client too (its 4 MB requests); the server used to add ~250 MB
            assert _rss_mib() - before < 120, f"grew {_rss_mib() - before:.0f} MiB"
            # a consumer's own requests stay within every producer's limit, however many are queued
            keys_ = [f"{PRODUCER};0000000000000000;{CONSUMER};{'n' * 16_000}{i};0:0" for i in range(200)]
            for k in keys_:
                b.send(k, np.array([2]), step_id=2)
            got = await asyncio.gather(*(a.recv(k, step_id=2, timeout=30) for k in keys_))
            assert all(int(g[0]) == 2 for g in got)
    run(main())


def test_long_keys_that_are_valid_are_served_but_not_cached():
    async def main():
        async with cluster(2) as (a, b):
            k = f"{PRODUCER};0000000000000000;{CONSUMER};{'x' * 8000};0:0"
            b.send(k, np.array([7]), step_id=1)
            assert (await a.recv(k, step_id=1, timeout=10))[0] == 7
            assert all(len(raw) <= 1024 for raw in b.servicer._canonical)
    run(main())


def test_waiting_recvs_are_bounded_per_server():
    """200,000 waiting calls on one stream once took a daemon to 700 MB: beyond
    max_waiting_calls a recv fails with RESOURCE_EXHAUSTED, the others wait on,
    and a recv whose tensor is already there is still answered."""
    import asyncio

    from rendezvous.errors import ResourceExhausted

    async def main():
        async with cluster(2, max_waiting_calls=50) as (a, b):
            def k(i):
                return f"{PRODUCER};0000000000000000;{CONSUMER};w{i};0:0"
            waits = [asyncio.ensure_future(a.recv(k(i), step_id=1, timeout=30)) for i in range(60)]
            await until(lambda: sum(w.done() for w in waits) >= 10 and b.servicer.waiting_calls() == 50,
                        what="the recvs over the limit to be refused")
            refused = [w for w in waits if w.done() and isinstance(w.exception(), ResourceExhausted)]
            assert len(refused) == 10, [w.exception() for w in waits if w.done()]
            assert "max_waiting_calls" in str(refused[0].exception())
            assert b.servicer.waiting_calls() == 50
            b.send(k(1000), np.array([9]), step_id=1)  # produced already: answered at once
            assert (await a.recv(k(1000), step_id=1, timeout=10))[0] == 9
            for i in range(60):
                b.send(k(i), np.array([i]), step_id=1)
            served = [w for w in waits if w not in refused]
            assert [int((await w)[0]) for w in served] == [i for i, w in enumerate(waits) if w not in refused]
    run(main())
