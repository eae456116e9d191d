"""Peers that die or hang: recvs fail with a clear status within a bounded,
configurable time, and the job recovers without restarting what stayed up."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from rendezvous import aio
from rendezvous.config import Config
from rendezvous.errors import DeadlineExceeded, PeerUnavailable

from conftest import run

pytestmark = pytest.mark.timeout(90)

KEY = "/job:worker/replica:0/task:1/cpu:0;0000000000000000;/job:worker/replica:0/task:0/cpu:0;x;0:0"


async def _with_producer_process(consumer: aio.Server, keepalive: str | None = "1"):
    """Task 1 of the job as a `rendezvous serve` child process; returns it once it serves."""
    cluster = json.dumps({"worker": [consumer.target, "127.0.0.1:0"]})
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUS_KEEPALIVE")}
    if keepalive is not None:
        env["RENDEZVOUS_KEEPALIVE_TIME"] = keepalive
    child = subprocess.Popen([sys.executable, "-m", "rendezvous", "serve", "--cluster", cluster,
                              "--job-name", "worker", "--task-index", "1"],
                             stdout=subprocess.PIPE, text=True, env=env)
    line = await asyncio.get_running_loop().run_in_executor(None, child.stdout.readline)
    assert "serving on" in line, line
    consumer.update_cluster({"worker": [consumer.target, line.split("serving on ")[1].split()[0]]})
    return child


@pytest.mark.slow
def test_a_hung_peer_is_noticed_within_the_keepalive_bound():
    """A recv with no deadline waited forever on a peer that stopped answering
    (SIGSTOP: its socket stays open). With keepalive it fails with UNAVAILABLE
    within keepalive_time + keepalive_timeout (plus its re-sends), and once the
    peer answers again a new recv reaches it on the same server."""
    async def main():
        spec = {"worker": ["127.0.0.1:0", "127.0.0.1:0"]}
        consumer = aio.Server(spec, "worker", 0, keepalive_time=1.0, keepalive_timeout=1.0,
                              reconnect_attempts=1)
        await consumer.start()
        child = await _with_producer_process(consumer)
        try:
            # the connection is up and the recv waits at the producer
            with pytest.raises(DeadlineExceeded):
                await consumer.recv(KEY, step_id=1, timeout=0.5)
            waiting = asyncio.ensure_future(consumer.recv(KEY, step_id=1))  # no deadline
            await asyncio.sleep(0)
            os.kill(child.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            with pytest.raises(PeerUnavailable):
                await asyncio.wait_for(waiting, 30)
            took = time.monotonic() - stopped
            assert took < 15, f"a hung peer took {took:.1f}s to notice"
            os.kill(child.pid, signal.SIGCONT)
            # the peer is back: a recv reaches it again (it waits there: no tensor)
            with pytest.raises(DeadlineExceeded):
                await consumer.recv(KEY, step_id=1, timeout=3)
        finally:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.wait()
            await consumer.stop(0)
    run(main(), 80)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_hung_peer_is_noticed_within_the_documented_bound_with_default_keepalive():
    """The same with every setting at its default (keepalive 20 s + 10 s, three
    re-sends): a recv with no deadline from a SIGSTOPped producer fails with
    UNAVAILABLE within the documented bound, two keepalive periods (60 s): the
    ping that goes unanswered, then one reconnect window."""
    async def main():
        spec = {"worker": ["127.0.0.1:0", "127.0.0.1:0"]}
        consumer = aio.Server(spec, "worker", 0, config=Config.load(env={}))
        cfg = consumer.config
        bound = 2 * (cfg.keepalive_time + cfg.keepalive_timeout)
        assert (cfg.keepalive_time, cfg.keepalive_timeout, bound) == (20.0, 10.0, 60.0)
        await consumer.start()
        child = await _with_producer_process(consumer, keepalive=None)
        try:
            with pytest.raises(DeadlineExceeded):  # the connection is up and the recv waits there
                await consumer.recv(KEY, step_id=1, timeout=0.5)
            waiting = asyncio.ensure_future(consumer.recv(KEY, step_id=1))  # no deadline
            await asyncio.sleep(0)
            os.kill(child.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            with pytest.raises(PeerUnavailable):
                await asyncio.wait_for(waiting, bound + 30)
            took = time.monotonic() - stopped
            assert took <= bound + 5, f"a hung peer took {took:.1f}s to notice (bound {bound:g}s)"
        finally:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.wait()
            await consumer.stop(0)
    run(main(), 140)


_CONSUMER = r"""
import asyncio, json, sys
import numpy as np
from rendezvous import aio
async def main():
    cluster = json.loads(sys.argv[1])
    s = aio.Server(cluster, "worker", 0)
    await s.start()
    print("ready", flush=True)
    got = await s.recv(sys.argv[2], step_id=1, timeout=60)
    print("got", int(got[0]), flush=True)
    await s.stop(0)
asyncio.run(main())
"""


def test_a_consumer_killed_mid_reply_leaves_the_tensor_in_the_producers_table():
    """The consumer process dies while its reply is on the way (stopped first, so
    the reply is stuck half-written in flow control): the producer puts the
    tensor back, and another consumer then gets it."""
    async def main():
        spec = {"worker": ["127.0.0.1:0", "127.0.0.1:0"]}
        producer = aio.Server(spec, "worker", 1, chunk_bytes=256 << 10)
        await producer.start()
        cluster = json.dumps({"worker": ["127.0.0.1:0", producer.target]})
        child = subprocess.Popen([sys.executable, "-c", _CONSUMER, cluster, KEY], stdout=subprocess.PIPE,
                                 text=True)
        try:
            line = await asyncio.get_running_loop().run_in_executor(None, child.stdout.readline)
            assert line.strip() == "ready", line
            value = np.arange(16 << 20, dtype=np.float32)  # 64 MiB: far more than flow control lets through
            deadline = time.monotonic() + 30
            while producer.servicer.open_streams() == 0:  # the consumer's stream is open
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            os.kill(child.pid, signal.SIGSTOP)
            producer.send(KEY, value, step_id=1)
            while producer.stats()["grpc"]["served"] == 0:  # its reply has started
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert not producer.pending()  # taken by the reply
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
            while not producer.pending():  # the cut-off reply's tensor goes back
                assert time.monotonic() < deadline, "the tensor of a dead consumer's reply was lost"
                await asyncio.sleep(0.01)
            (entry,) = producer.pending()
            assert entry.kind == "tensor" and entry.count == 1
            # a consumer that comes later gets it
            consumer = aio.Server(spec, "worker", 0)
            await consumer.start()
            consumer.update_cluster({"worker": [consumer.target, producer.target]})
            got = await consumer.recv(KEY, step_id=1, timeout=30)
            assert got.shape == value.shape and got[-1] == value[-1]
            await consumer.stop(0)
        finally:
            if child.poll() is None:
                os.kill(child.pid, signal.SIGKILL)
                child.wait()
            await producer.stop(0)
    run(main(), 80)


_PRODUCER = r"""
import asyncio, json, sys
import numpy as np
from rendezvous import aio
async def main():
    s = aio.Server(json.loads(sys.argv[1]), "worker", 1, chunk_bytes=64 << 10)
    await s.start()
    print(s.target, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    s.send(sys.argv[2], np.arange(32 << 20, dtype=np.float32), step_id=1)  # 128 MiB, 2048 frames
    await asyncio.Event().wait()
asyncio.run(main())
"""


def test_a_producer_killed_mid_reply_fails_the_recv_promptly():
    """The producer process dies while its reply's frames are arriving: the recv
    (no deadline) fails with UNAVAILABLE within seconds instead of hanging, and
    the consumer's server goes on serving."""
    async def main():
        spec = {"worker": ["127.0.0.1:0", "127.0.0.1:0"]}
        consumer = aio.Server(spec, "worker", 0, reconnect_attempts=2, connect_timeout=2.0)
        await consumer.start()
        cluster = json.dumps({"worker": [consumer.target, "127.0.0.1:0"]})
        child = subprocess.Popen([sys.executable, "-c", _PRODUCER, cluster, KEY], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            target = (await asyncio.get_running_loop().run_in_executor(None, child.stdout.readline)).strip()
            consumer.update_cluster({"worker": [consumer.target, target]})
            waiting = asyncio.ensure_future(consumer.recv(KEY, step_id=1))  # no deadline
            deadline = time.monotonic() + 30

            def assembling() -> bool:
                stream = consumer.peers[next(iter(consumer.peers))]._stream if consumer.peers else None
                return stream is not None and any(p.assembly is not None for p in stream.pending.values())
            while not consumer.peers:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            child.stdin.write("go\n")
            child.stdin.flush()
            while not assembling():  # the reply's first frames are here
                assert time.monotonic() < deadline and not waiting.done()
                await asyncio.sleep(0.001)
            child.kill()
            child.wait()
            killed = time.monotonic()
            with pytest.raises(PeerUnavailable):
                await asyncio.wait_for(waiting, 30)
            assert time.monotonic() - killed < 15
            consumer.send("/job:worker/replica:0/task:0/cpu:0;0000000000000000;/job:worker/replica:0/task:0/cpu:0;"
                          "local;0:0", np.ones(2))
            assert (await consumer.recv("/job:worker/replica:0/task:0/cpu:0;0000000000000000;"
                                        "/job:worker/replica:0/task:0/cpu:0;local;0:0", timeout=5)).sum() == 2
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            await consumer.stop(0)
    run(main(), 80)
