"""GPU tensors between a daemon and its local clients by CUDA IPC (the session
socket), on the fake GPU's IPC model across real processes: the daemon runs
in this test's process (on a loop thread of its own), each client in a
process of its own (tests/client_ipc_agent.py).

Each rule has a test that fails when it is broken: a send is produced only
once the daemon's copy of it is done (which waits for the client's event);
the daemon holds an export until its client releases it, a client whose
copy fails gives the tensor back, a client that dies lets go of what it
held; where IPC cannot work (the daemon's own process) the host carries the
tensor."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rendezvous.client import Client
from rendezvous.daemon.daemon import Daemon
from rendezvous.devices import Devices
from rendezvous.testing.fakegpu import FakeDeviceArray
from rendezvous.testing.fakegpu_ipc import FakeIpcBackend

from mpi_scenarios import wait_for
from test_daemon import config
from test_ipc import Agent

pytestmark = pytest.mark.timeout(120)

AGENT = str(Path(__file__).resolve().parent / "client_ipc_agent.py")
NODE = "node-c"
N = 1 << 16


def gkey(name: str) -> str:
    return (f"/job:node/replica:0/task:0/device:GPU:0;0000000000000000;"
            f"/job:node/replica:0/task:0/device:GPU:0;{name};0:0")


def values(seed: int, n: int = N) -> list[float]:
    return (seed + np.arange(n, dtype=np.float32)).tolist()


class ClientAgent(Agent):
    """A local client in a process of its own (tests/client_ipc_agent.py)."""

    def __init__(self, address: str, mode: str = "blocking") -> None:  # (Agent's reading and commands)
        self.p = subprocess.Popen([sys.executable, AGENT, NODE, address, mode], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        self.results: dict[int, dict] = {}
        self.cond = threading.Condition()
        self.next_id = 1
        threading.Thread(target=self._read, daemon=True).start()
        self.pid = self.result(0)["pid"]


class Node:
    """A daemon on the fake GPU, on a loop thread of its own."""

    def __init__(self, sockdir: Path, **over: Any) -> None:
        self.fake = FakeIpcBackend(NODE)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.daemon = Daemon(config(sockdir, **over), devices=Devices([self.fake]))
        self.on_loop(self.daemon.start())
        self.address = self.daemon.local_target

    def on_loop(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def state(self) -> dict:
        async def look() -> dict:
            gc.collect()
            sessions = self.daemon.sessions.sessions.values() if self.daemon.sessions else []
            return {"exports": sum(len(s.ipc.exports) for s in sessions), "sessions": len(sessions),
                    "pending": self.daemon.server.pending(), "device_bytes": self.fake.device_bytes(0),
                    "opened": self.fake.opened, "copies_queued": self.fake.copy_stream(0, "peer").pending}
        return self.on_loop(look())

    def until(self, predicate, what: str) -> dict:
        seen: list[dict] = []
        wait_for(lambda: predicate(seen.append(self.state()) or seen[-1]), what, 30)
        return seen[-1]

    def close(self) -> None:
        self.on_loop(self.daemon.stop(0.5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture
def node() -> Iterator[Node]:
    with tempfile.TemporaryDirectory(prefix="rdv", dir="/tmp") as d:
        n = Node(Path(d))
        try:
            yield n
        finally:
            n.close()
        assert n.fake.violations == []


@pytest.fixture(params=["blocking", "aio"])
def agents(node: Node, request: pytest.FixtureRequest) -> Iterator[list[ClientAgent]]:
    """Two clients in processes of their own: both blocking, or both asyncio."""
    made: list[ClientAgent] = []
    try:
        made += [ClientAgent(node.address, request.param), ClientAgent(node.address, request.param)]
        yield made
    finally:
        for a in made:
            a.close()


def _recv(agent: ClientAgent, key: str, **kw: Any) -> dict:
    return agent.result(agent.call(op="recv", key=key, **kw))


def test_a_gpu_tensor_goes_client_to_daemon_to_client_by_ipc(node: Node, agents: list[ClientAgent]) -> None:
    a, b = agents
    for i in range(3):
        a.do(op="send", key=gkey(f"w{i}"), n=N, seed=10 * i)
    sent = a.state()
    assert sent["stats"].get("send_ipc") == 3 and "send_from_gpu" not in sent["stats"], sent["stats"]
    # the daemon copied each onto its own GPU memory; the client's allocator reused one block,
    # exported under one handle: opened once, as the caching allocators expect
    state = node.state()
    assert state["opened"] == 1 and state["device_bytes"] == 3 * N * 4, state
    for i in range(3):
        got = _recv(b, gkey(f"w{i}"))
        assert got["ok"] and got["gpu"] and got["values"] == values(10 * i), got
    got = b.state()
    assert got["stats"].get("recv_ipc") == 3 and "recv_to_gpu" not in got["stats"], got
    assert got["opened"] == 3 and got["violations"] == []  # the daemon held three allocations
    # every export released: the daemon holds nothing, and its device memory is free
    node.until(lambda s: s["exports"] == 0 and s["device_bytes"] == 0 and not s["pending"], "everything let go")
    for i in range(3):  # again: the daemon's freed blocks serve again, under the handles already open
        a.do(op="send", key=gkey(f"v{i}"), n=N, seed=i)
        assert _recv(b, gkey(f"v{i}"))["values"] == values(i)
    got = b.state()
    assert got["stats"]["recv_ipc"] == 6 and got["opened"] == 3 and got["violations"] == [], got
    node.until(lambda s: s["exports"] == 0 and s["device_bytes"] == 0 and not s["pending"], "let go again")
    assert a.state()["violations"] == [] and node.state()["opened"] == 1


def test_a_send_is_produced_only_once_the_daemons_copy_read_the_written_tensor(node: Node,
                                                                              agents: list[ClientAgent]) -> None:
    a, b = agents
    sending = a.call(op="send", key=gkey("g"), n=N, seed=7, gated=True)  # its kernel held: the event waits
    try:
        node.until(lambda s: s["copies_queued"] > 0, "the daemon's copy queued behind the client's event")
        assert sending not in a.results  # the send waits for the copy, which holds the client's memory
        assert not node.state()["pending"]  # and nothing is produced before the copy is done
    finally:
        a.do(op="open")
    assert a.result(sending)["ok"]
    got = _recv(b, gkey("g"))
    assert got["ok"] and got["values"] == values(7), got  # the kernel's values, not what was there before
    node.until(lambda s: s["exports"] == 0 and not s["pending"], "released")


def test_a_copy_the_client_cannot_make_goes_back_to_the_daemon_for_the_next_recv(node: Node,
                                                                               agents: list[ClientAgent]) -> None:
    a, b = agents
    a.do(op="send", key=gkey("x"), n=N, seed=3)
    b.do(op="fail_open")
    failed = _recv(b, gkey("x"))
    assert not failed["ok"] and failed["code"] == "UNAVAILABLE" and "went back" in failed["message"], failed
    got = _recv(b, gkey("x"))  # the daemon kept it; this client sends and receives through the host now
    assert got["ok"] and got["gpu"] and got["values"] == values(3), got
    assert b.state()["stats"].get("recv_to_gpu") == 1
    again = _recv(b, gkey("x"), timeout=0.3)
    assert not again["ok"] and again["code"] == "DEADLINE_EXCEEDED", again  # once
    node.until(lambda s: s["exports"] == 0 and not s["pending"] and s["device_bytes"] == 0, "nothing held")


def test_a_client_that_dies_holding_an_export_lets_it_go(node: Node, agents: list[ClientAgent]) -> None:
    a, b = agents
    a.do(op="send", key=gkey("d"), n=N, seed=5)
    b.do(op="hold")  # its copy cannot run: it never releases
    b.call(op="recv", key=gkey("d"))
    node.until(lambda s: s["exports"] == 1, "the export held for the client")
    os.kill(b.pid, signal.SIGKILL)
    b.p.wait(30)
    # its session ended: what it held is dropped (it may have delivered the tensor), memory freed
    node.until(lambda s: s["sessions"] == 1 and s["exports"] == 0 and s["device_bytes"] == 0
               and not s["pending"], "the dead client's export dropped")
    a.do(op="send", key=gkey("d2"), n=N, seed=6)  # the daemon goes on
    assert a.state()["stats"]["send_ipc"] == 2


def test_a_client_in_the_daemons_own_process_goes_through_the_host(node: Node, agents: list[ClientAgent]) -> None:
    agents[0].do(op="send", key=gkey("h"), n=N, seed=2)  # on the daemon's GPU, by IPC
    fake = FakeIpcBackend(NODE)  # this process's GPU: the daemon cannot open its handles, nor it the daemon's
    with Client(node.address, devices=Devices([fake])) as c:
        got = c.recv(gkey("h"), timeout=10)  # offered IPC, answered through the host
        assert isinstance(got, FakeDeviceArray)
        np.testing.assert_array_equal(fake.raw(got), values(2))
        c.send(gkey("i"), fake.array(np.arange(N, dtype=np.float32), 0))  # refused by IPC: through the host
        np.testing.assert_array_equal(fake.raw(c.recv(gkey("i"), timeout=10)), np.arange(N, dtype=np.float32))
        stats = c.stats()
        assert stats.get("send_from_gpu") == 1 and stats.get("recv_to_gpu") == 2 and "send_ipc" not in stats \
            and "recv_ipc" not in stats, stats
    assert node.state()["opened"] == 1  # the agent's, never this process's


def test_with_cuda_ipc_off_at_the_daemon_gpu_tensors_go_through_the_host() -> None:
    with tempfile.TemporaryDirectory(prefix="rdv", dir="/tmp") as d:
        n = Node(Path(d), cuda_ipc=False)
        a = b = None
        try:
            a, b = ClientAgent(n.address), ClientAgent(n.address)
            a.do(op="send", key=gkey("o"), n=N, seed=1)
            got = _recv(b, gkey("o"))
            assert got["ok"] and got["gpu"] and got["values"] == values(1), got
            assert a.state()["stats"].get("send_from_gpu") == 1 and b.state()["stats"].get("recv_to_gpu") == 1
            assert n.state()["opened"] == 0
        finally:
            for agent in (a, b):
                if agent is not None:
                    agent.close()
            n.close()


def test_an_export_that_answers_a_recv_given_up_is_released_as_failed() -> None:
    """A late answer (its recv gave up first) that is an export goes back by its
    release (the daemon keeps the tensor), never as a RETURN of what it is not."""
    from rendezvous.client.core import LocalOp
    from rendezvous.client.link import Router
    from rendezvous.codec.tensors import TensorMeta
    from rendezvous.local import ipc
    from rendezvous.local.frames import HEADER, Kind
    from rendezvous.paths import Path as Via
    from rendezvous.v1 import rendezvous_pb2 as pb

    class Link(Router):
        def __init__(self) -> None:
            self.written: list[bytes] = []
            self._ops, self._cancelled = {}, {}

        def _write(self, data: bytes) -> None:
            self.written.append(data)

    link = Link()
    link._cancelled[4] = LocalOp(Kind.RECV, b"", key=gkey("late"), step_id=1)
    transfer = pb.IpcTransfer(memory=b"m", offset=0, event=b"e", export_id=77, producer="p", nbytes=16, device=b"g")
    body = ipc.reply_body(TensorMeta(np.dtype(np.float32), (4,)), transfer, Via.LOCAL)
    assert link._route(Kind.RECV_REPLY, 4, memoryview(body)) is None
    [data] = link.written
    size, kind, op = HEADER.unpack_from(data)
    release = ipc.parse_release(data[HEADER.size:HEADER.size + size])
    assert (kind, op, list(release.export_ids), release.failed) == (Kind.IPC_RELEASE, 0, [77], True)


def test_an_ipc_send_anywhere_but_a_send_ipc_frame_is_refused() -> None:
    """A SendRequest with an export, as a plain SEND or over gRPC, would read as a
    tensor of zeros (its bytes are not in it): it is refused instead."""
    from rendezvous.codec.tensors import TensorMeta
    from rendezvous.errors import InvalidArgument
    from rendezvous.local import ipc, messages
    from rendezvous.v1 import rendezvous_pb2 as pb

    body = ipc.send_body(messages.send_head(gkey("z"), 1), TensorMeta(np.dtype(np.float32), (4,)),
                         pb.IpcTransfer(memory=b"m", event=b"e", nbytes=16, device=b"g"))
    with pytest.raises(InvalidArgument, match="SEND_IPC"):
        messages.parse_send(body)
    assert ipc.sent(body)[:2] == (1, gkey("z"))
    with pytest.raises(InvalidArgument, match="announces 8 bytes"):
        ipc.sent(ipc.send_body(messages.send_head(gkey("z"), 1), TensorMeta(np.dtype(np.float32), (4,)),
                               pb.IpcTransfer(memory=b"m", event=b"e", nbytes=8, device=b"g")))
