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

import pytest

from rendezvous import aio
from rendezvous.errors import DeadlineExceeded, PeerUnavailable

from conftest import run

pytestmark = pytest.mark.timeout(90)

KEY = "/job:worker/replica:0/task:1/cpu:0;0000000000000001;/job:worker/replica:0/task:0/cpu:0;x;0:0"


async def _with_producer_process(consumer: aio.Server):
    """Task 1 of the job as a `rendezvous serve` child process; returns it once it serves."""
    cluster = json.dumps({"worker": [consumer.target, "127.0.0.1:0"]})
    child = subprocess.Popen([sys.executable, "-m", "rendezvous", "serve", "--cluster", cluster,
                              "--job-name", "worker", "--task-index", "1"],
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "RENDEZVOUS_KEEPALIVE_TIME": "1"})
    line = await asyncio.get_running_loop().run_in_executor(None, child.stdout.readline)
    assert "serving on" in line, line
    consumer.update_cluster({"worker": [consumer.target, line.split("serving on ")[1].split()[0]]})
    return child


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
