"""Soak: many transfers through two daemons with deadlines racing replies and
hostile requests mixed in; every tensor is accounted for.

The default run does a short pass (``RENDEZVOUS_SOAK_OPS``, 400) so the soak
itself is tested in CI; ``make soak`` runs it long and prints the figures that
RELIABILITY.md records.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import resource
import time

import numpy as np
import pytest

from rendezvous.client.core import LocalOp
from rendezvous import errors
from rendezvous.local.frames import Kind
from rendezvous.client.aio import Client
from rendezvous.v1 import local_pb2 as lpb
from rendezvous.v1 import tensor_pb2 as tpb

from conftest import run, until
from test_daemon import daemons

OPS = int(os.environ.get("RENDEZVOUS_SOAK_OPS", "400"))
pytestmark = [pytest.mark.timeout(max(120, OPS // 20)), pytest.mark.slow]

SIZES = (64, 4 << 10, 256 << 10, 1 << 20)  # inline and shared memory on the local hop


def key(src: int, dst: int, name: str) -> str:
    return (f"/job:node/replica:0/task:{src}/device:CPU:0;0000000000000000;"
            f"/job:node/replica:0/task:{dst}/device:CPU:0;{name};0:0")


def _value(i: int) -> np.ndarray:
    n = SIZES[i % len(SIZES)] // 8
    return np.full(n, i, dtype=np.int64)


async def _hostile(client: Client, i: int) -> str:
    """One request no client library would send; returns the status it got."""
    kind = i % 4
    meta = tpb.TensorProto(dtype=9)
    meta.tensor_shape.dim.add(size=1 << 40 if kind == 0 else 8)
    if kind == 0:  # announces a huge tensor with one typed value
        meta.int64_val.append(1)
        raw = lpb.SendRequest(step_id=1, rendezvous_key=key(0, 1, f"h{i}"), tensor=meta).SerializeToString()
    elif kind == 1:  # names a pool segment the daemon did not lend it
        raw = lpb.SendRequest(step_id=1, rendezvous_key=key(0, 1, f"h{i}"), tensor=meta,
                              pooled=lpb.PoolSlot(segment=1 + i, nbytes=64)).SerializeToString()
    elif kind == 2:  # garbage
        raw = bytes(random.Random(i).getrandbits(8) for _ in range(64))
    else:  # a key of a task this daemon does not produce
        raw = lpb.SendRequest(step_id=1, rendezvous_key=key(1, 0, f"h{i}"),
                              tensor=tpb.TensorProto(dtype=9)).SerializeToString()
    try:
        await client._link.call(LocalOp(Kind.SEND, raw, 10))
    except errors.RendezvousError as exc:
        return exc.code.name
    return "OK"


def test_soak_every_tensor_arrives_once_and_memory_stays_bounded(tmp_path):
    async def main():
        sockdir = tmp_path
        rng = random.Random(11)
        # answers kept for retries are bounded by retry_cache_bytes per daemon (1 GiB
        # by default): the bound on the process's growth below counts on 32 MiB
        async with daemons(sockdir, n=2, retry_cache_bytes=32 << 20) as (d0, d1), \
                Client(d0.local_target) as producer, Client(d1.local_target) as remote, \
                Client(d0.local_target) as local:
            timeouts = statuses = 0
            seen: dict[str, int] = {}
            window = asyncio.Semaphore(32)

            async def one(i: int) -> None:
                nonlocal timeouts
                async with window:
                    consumer, dst = (remote, 1) if i % 3 else (local, 0)
                    k = key(0, dst, f"t{i}")
                    send = asyncio.ensure_future(producer.send(k, _value(i), step_id=1))
                    try:
                        got = await consumer.recv(k, step_id=1, timeout=rng.uniform(0.001, 0.03))
                    except errors.DeadlineExceeded:
                        timeouts += 1
                        got = await consumer.recv(k, step_id=1, timeout=60)
                    await send
                    assert got.shape == _value(i).shape and int(got[0]) == i and int(got[-1]) == i
                    seen[k] = seen.get(k, 0) + 1

            start = time.monotonic()
            rss0 = None
            batch = 200
            for lo in range(0, OPS, batch):
                await asyncio.gather(*(one(i) for i in range(lo, min(OPS, lo + batch))))
                for j in range(lo, min(OPS, lo + batch), 50):
                    assert (await _hostile(producer, j)) != "OK"
                    statuses += 1
                gc.collect()
                if rss0 is None:
                    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            took = time.monotonic() - start
            grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
            assert len(seen) == OPS and set(seen.values()) == {1}  # each exactly once
            for d in (d0, d1):  # nothing left anywhere (withdrawn recvs' cancels may be in flight)
                await until(lambda d=d: not d.server.pending() and not d.server.kept,
                            what="the daemons' tables to empty")
            gc.collect()
            # every segment back: none held by a client; on the producer's node only
            # the answers kept for retries (a window of retry_cache_bytes) stay
            retained = d0.server._retry.held()
            for d, kept in ((d0, retained), (d1, 0)):
                await until(lambda d=d, kept=kept: d.pool.stats()["held"] == 0 and d.pool.stats()["in_table"] <= kept,
                            what=f"the pool's segments free again ({d.pool.stats()})")
            assert grown_mib < 160, f"the process grew by {grown_mib:.0f} MiB after the first batch"
            print(f"\nsoak: {OPS} transfers through two daemons in {took:.1f}s, {timeouts} recvs timed out "
                  f"and were retried, {statuses} hostile requests refused, 0 lost, 0 twice, "
                  f"peak RSS growth after warm-up {grown_mib:.0f} MiB")
    run(main(), max(100, OPS // 25))
