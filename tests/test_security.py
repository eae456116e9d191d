"""Every server the package starts applies the security settings, and rank 0's
Join takes only what a rank can honestly claim (rendezvous/rank/setup.py,
rendezvous/rank/joins.py, rendezvous/rpc/admin.py).

Attacks as a process on the network would make them: a join naming a host
it does not call from, an address rank 0 or another rank already has, a
second claim of a rank, a flood of joins, a join after the job formed, calls
without the token (Join, Admin, RecvTensor) on a rank server that has one,
plaintext to a server with TLS, a forged entry in torchrun's store. And what
an operator relies on: Pending costs a bounded amount of work whatever the
table holds, and shows the tensors a rank keeps; a server whose loop ends
without a stop leaves nothing listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import rendezvous
from rendezvous import aio
from rendezvous.config import Config
from rendezvous.errors import AlreadyExists, InvalidArgument, Unauthenticated
from rendezvous.keys import TaskName
from rendezvous.rank.bootstrap import JOIN_METHOD
from rendezvous.items import PendingEntry, Received
from rendezvous.v1 import admin_pb2, admin_pb2_grpc
from rendezvous.v1 import local_pb2 as lpb
from rendezvous.v1 import rendezvous_pb2 as pb

from conftest import free_port, key, run
from test_auth import _tls, pki  # noqa: F401  (pki: a fixture)

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parent.parent
TOKEN = (("authorization", "Bearer s3cret"),)
RECV_TENSOR = "/rendezvous.v1.Rendezvous/RecvTensor"


def boot_env(port: int, world: int, rank: int = 0, addr: str = "127.0.0.1") -> dict[str, str]:
    return {"MASTER_ADDR": addr, "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world)}


def claim(rank: int, address: str, world: int, job: str = "worker") -> bytes:
    return json.dumps({"job": job, "rank": rank, "world_size": world, "address": address}).encode()


@contextlib.asynccontextmanager
async def stopping(*servers: aio.Server):
    """Stop every server at the end, whatever failed, after the tasks the block
    added to the set it yields: nothing is left waiting or listening."""
    tasks: set[asyncio.Future] = set()
    try:
        yield tasks
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in servers:
            await s.stop(0)


def track(tasks: set, awaitable) -> asyncio.Future:
    """``awaitable`` as a task the enclosing :func:`stopping` ends."""
    task = asyncio.ensure_future(awaitable)
    tasks.add(task)
    return task


async def join(ch: grpc.aio.Channel, body: bytes, metadata=None, timeout: float = 20) -> dict:
    reply = await ch.unary_unary(JOIN_METHOD, request_serializer=None, response_deserializer=None)(
        body, timeout=timeout, wait_for_ready=True, metadata=metadata)
    return json.loads(reply)


async def refusal(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code()


async def served(ch: grpc.aio.Channel) -> None:
    """One health call answered: every call sent on ``ch`` before it was handled
    first (the server takes calls in order, one loop turn each)."""
    await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10, wait_for_ready=True)


def closed(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as probe:
        try:
            probe.connect((host, port))
        except ConnectionRefusedError:
            return True
    return False


# -- Join: who may claim what ------------------------------------------------------------


def test_a_join_naming_another_host_than_its_callers_is_refused_and_the_job_forms_with_the_real_rank():
    """An attacker serves its own tensor for task 2 at 127.0.0.2 and, calling
    from 127.0.0.1, joins as rank 2 at that address. Refused with
    PERMISSION_DENIED; the real rank 2 joins, and task 2's key is its tensor."""
    async def main():
        port = free_port()
        env = boot_env(port, 3)
        zero = aio.Server.from_env(env=env)
        one, two = (aio.Server.from_env(env={**env, "RANK": str(r)}) for r in (1, 2))
        evil = aio.Server({"worker": ["127.0.0.1:0", "127.0.0.1:0", "127.0.0.2:0"]}, "worker", 2)
        async with stopping(zero, one, two, evil) as tasks:
            await evil.start()
            evil.send(key(2, 0, "x"), np.full(3, 666.0))
            starting = track(tasks, zero.start())
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                forged = track(tasks, join(ch, claim(2, evil.target, 3)))
                await asyncio.wait([forged], timeout=10)  # a refusal comes at once; a join taken waits
                await asyncio.gather(one.start(), two.start(), return_exceptions=True)
                await starting
                two.send(key(2, 0, "x"), np.arange(3.0))
                assert (await zero.recv(key(2, 0, "x"), timeout=10)).tolist() == [0.0, 1.0, 2.0]
                assert zero.cluster.address(two.task) == two.target
                assert await refusal(forged) is grpc.StatusCode.PERMISSION_DENIED
    run(main())


def test_a_join_claiming_rank_0s_own_address_is_refused_and_the_job_still_forms():
    async def main():
        port = free_port()
        env = boot_env(port, 2)
        zero, one = aio.Server.from_env(env=env), aio.Server.from_env(env={**env, "RANK": "1"}, connect_timeout=10)
        async with stopping(zero, one) as tasks:
            starting = track(tasks, zero.start())
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                forged = track(tasks, join(ch, claim(1, f"127.0.0.1:{port}", 2)))
                await asyncio.wait([forged], timeout=10)
                assert await asyncio.gather(one.start(), return_exceptions=True) == [None]  # a forged join taken
                # first made this fail
                await starting
                one.send(key(1, 0, "y"), np.ones(2))
                assert (await zero.recv(key(1, 0, "y"), timeout=10)).tolist() == [1.0, 1.0]
                assert await refusal(forged) is grpc.StatusCode.ALREADY_EXISTS
    run(main())


def test_one_address_for_two_ranks_is_refused():
    async def main():
        port = free_port()
        zero = aio.Server.from_env(env=boot_env(port, 3))
        async with stopping(zero) as tasks:
            starting = track(tasks, zero.start())
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                first = track(tasks, join(ch, claim(1, "127.0.0.1:5001", 3)))
                await served(ch)
                assert await refusal(join(ch, claim(2, "127.0.0.1:5001", 3))) is grpc.StatusCode.ALREADY_EXISTS
                assert not first.done() and not starting.done()
                answer = await join(ch, claim(2, "127.0.0.1:5002", 3))
                assert answer["addresses"][1:] == ["127.0.0.1:5001", "127.0.0.1:5002"] == (await first)["addresses"][1:]
                await starting
    run(main())


def test_a_second_claim_of_a_rank_fails_the_formation_and_leaves_nothing_listening():
    """Rank 0 cannot tell which of two processes is rank 1: the job does not
    form, every start and join says why, and rank 0's port is closed."""
    async def main():
        port = free_port()
        zero = aio.Server.from_env(env=boot_env(port, 3), connect_timeout=20)
        async with stopping(zero) as tasks:
            starting = track(tasks, zero.start())
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                first = track(tasks, join(ch, claim(1, "127.0.0.1:5001", 3)))
                await served(ch)
                assert await refusal(join(ch, claim(1, "127.0.0.1:5009", 3))) is grpc.StatusCode.ALREADY_EXISTS
                with pytest.raises(AlreadyExists, match="rank 1 joined at 127.0.0.1:5001, and now 127.0.0.1:5009"):
                    await asyncio.wait_for(starting, 10)
                assert await refusal(first) in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNAVAILABLE)
            assert closed(port)
    run(main())


def test_waiting_joins_are_bounded():
    """Ten joins of rank 1 at once: four wait, the others are refused at once;
    they all hold nothing more once the job formed."""
    async def main():
        port = free_port()
        zero = aio.Server.from_env(env=boot_env(port, 3))
        async with stopping(zero) as tasks:
            starting = track(tasks, zero.start())
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                calls = [track(tasks, join(ch, claim(1, "127.0.0.1:5001", 3))) for _ in range(10)]
                refused = []
                for done in asyncio.as_completed(calls, timeout=10):
                    refused.append(await refusal(done))
                    if len(refused) == 6:
                        break
                assert refused == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 6
                answer = await join(ch, claim(2, "127.0.0.1:5002", 3))
                await asyncio.wait(calls, timeout=10)
                waited = [c.result() for c in calls if c.done() and c.exception() is None]
                assert len(waited) == 4 and all(w == answer for w in waited)
                await starting
    run(main())


def test_join_is_retired_once_the_job_formed_but_a_ranks_retry_is_answered():
    async def main():
        port = free_port()
        zero = aio.Server.from_env(env=boot_env(port, 2))
        async with stopping(zero) as tasks:
            starting = track(tasks, zero.start())
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                answer = await join(ch, claim(1, "127.0.0.1:5001", 2))
                await starting
                assert answer["addresses"] == [zero.target, "127.0.0.1:5001"]
                assert await join(ch, claim(1, "127.0.0.1:5001", 2)) == answer  # a retry
                assert await refusal(join(ch, claim(1, "127.0.0.1:5002", 2))) is grpc.StatusCode.FAILED_PRECONDITION
                assert zero.cluster.address(TaskName("worker", 0, 1)) == "127.0.0.1:5001"
    run(main())


def test_a_name_that_resolves_to_the_caller_may_be_claimed():
    async def main():
        port = free_port()
        zero = aio.Server.from_env(env=boot_env(port, 2))
        async with stopping(zero) as tasks:
            starting = track(tasks, zero.start())
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                assert (await join(ch, claim(1, "localhost:5001", 2)))["addresses"][1] == "localhost:5001"
                await starting
    run(main())


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_the_callers_host_is_checked_over_ipv6_too():
    async def main():
        port = free_port()
        zero = aio.Server.from_env(env=boot_env(port, 2, addr="::1"))
        async with stopping(zero) as tasks:
            starting = track(tasks, zero.start())
            async with grpc.aio.insecure_channel(f"[::1]:{port}") as ch:
                assert await refusal(join(ch, claim(1, "127.0.0.1:5001", 2))) is grpc.StatusCode.PERMISSION_DENIED
                assert (await join(ch, claim(1, "[::1]:5001", 2)))["addresses"] == [f"[::1]:{port}", "[::1]:5001"]
                await starting
    run(main())


def test_the_callers_address_is_read_from_every_form_grpc_gives():
    from ipaddress import ip_address

    from rendezvous.rank.joins import caller_address

    v4, v6 = ip_address("127.0.0.1"), ip_address("::1")
    assert caller_address("ipv4:127.0.0.1:5000") == v4
    assert caller_address("ipv6:[::1]:5000") == v6
    assert caller_address("ipv6:%5B::1%5D:5000") == v6
    assert caller_address("ipv6:[::ffff:127.0.0.1]:5000") == v4  # IPv4-mapped: the IPv4 caller
    assert caller_address("ipv6:[fe80::1%25eth0]:5000") == ip_address("fe80::1")
    assert caller_address("unix:/tmp/x.sock") is None
    assert caller_address("ipv4:not-an-ip:5000") is None


# -- the token and TLS on every rank server ------------------------------------------------


def test_a_rank_server_with_a_token_refuses_admin_and_recv_tensor_without_it(monkeypatch):
    """RENDEZVOUS_TOKEN set: without the token Pending does not list the waiting
    key and RecvTensor does not take its tensor (UNAUTHENTICATED); health needs
    none; with the token both work."""
    monkeypatch.setenv("RENDEZVOUS_TOKEN", "s3cret")

    async def main():
        server = aio.Server({"worker": ["127.0.0.1:0", "127.0.0.1:0"]}, "worker", 0)
        async with stopping(server) as tasks:
            await server.start()
            server.send(key(0, 1, "w"), np.arange(3.0), step_id=4)
            request = pb.RecvTensorRequest(step_id=4, rendezvous_key=key(0, 1, "w")).SerializeToString()
            async with grpc.aio.insecure_channel(server.target) as ch:
                admin = admin_pb2_grpc.AdminStub(ch)
                for md in (None, (("authorization", "Bearer wrong"),)):
                    assert await refusal(admin.Pending(lpb.PendingRequest(), timeout=5, metadata=md)) is \
                        grpc.StatusCode.UNAUTHENTICATED
                    assert await refusal(admin.Stats(admin_pb2.StatsRequest(), timeout=5, metadata=md)) is \
                        grpc.StatusCode.UNAUTHENTICATED
                    assert await refusal(ch.unary_unary(RECV_TENSOR)(request, timeout=5, metadata=md)) is \
                        grpc.StatusCode.UNAUTHENTICATED
                await served(ch)  # health: no token needed
                assert [(p.kind, p.count) for p in server.pending()] == [("tensor", 1)]  # nothing was taken
                pending = await admin.Pending(lpb.PendingRequest(), timeout=5, metadata=TOKEN)
                assert [e.rendezvous_key for e in pending.entries] == [key(0, 1, "w")]
                reply = pb.RecvTensorResponse.FromString(
                    await ch.unary_unary(RECV_TENSOR)(request, timeout=5, metadata=TOKEN))
                assert reply.tensor.dtype and server.pending() == []
    run(main())


def test_the_blocking_server_applies_the_token_too(monkeypatch):
    monkeypatch.setenv("RENDEZVOUS_TOKEN", "s3cret")
    with rendezvous.Server({"worker": ["127.0.0.1:0"]}, "worker", 0) as server, \
            grpc.insecure_channel(server.target) as ch:
        pending = admin_pb2_grpc.AdminStub(ch).Pending
        with pytest.raises(grpc.RpcError) as info:
            pending(lpb.PendingRequest(), timeout=5)
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert pending(lpb.PendingRequest(), timeout=5, metadata=TOKEN).omitted == 0


def test_a_bootstrap_with_a_token_refuses_a_join_without_it_and_forms_with_its_ranks(monkeypatch, tmp_path):
    """The token from RENDEZVOUS_TOKEN_FILE: a join without it is refused, even
    one that names its own host; the real ranks join with it and their peers'
    streams carry it."""
    (tmp_path / "token").write_text("s3cret\n")
    monkeypatch.setenv("RENDEZVOUS_TOKEN_FILE", str(tmp_path / "token"))

    async def main():
        port = free_port()
        env = boot_env(port, 2)
        zero, one = aio.Server.from_env(env=env), aio.Server.from_env(env={**env, "RANK": "1"})
        async with stopping(zero, one) as tasks:
            starting = track(tasks, zero.start())
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                intruder = track(tasks, join(ch, claim(1, "127.0.0.1:5001", 2)))
                await asyncio.wait([intruder], timeout=10)
                await one.start()
                await starting
                assert zero.cluster.address(one.task) == one.target
                assert await refusal(intruder) is grpc.StatusCode.UNAUTHENTICATED
            zero.send(key(0, 1, "down"), np.ones(2))
            one.send(key(1, 0, "up"), np.zeros(2))
            assert (await one.recv(key(0, 1, "down"), timeout=10)).tolist() == [1.0, 1.0]
            assert (await zero.recv(key(1, 0, "up"), timeout=10)).tolist() == [0.0, 0.0]
    run(main())


def test_rank_servers_with_tls_serve_tls_and_talk_tls(pki):  # noqa: F811
    """A plaintext client cannot reach a rank server with TLS settings; a client
    trusting the CA can; two such ranks bootstrap and move tensors over TLS."""
    async def main():
        port = free_port()
        env = boot_env(port, 2)
        zero = aio.Server.from_env(env=env, **_tls(pki), token="s3cret")
        one = aio.Server.from_env(env={**env, "RANK": "1"}, **_tls(pki), token="s3cret")
        async with stopping(zero, one) as tasks:
            await asyncio.gather(zero.start(), one.start())
            one.send(key(1, 0, "t"), np.arange(4.0))
            assert (await zero.recv(key(1, 0, "t"), timeout=10)).tolist() == [0.0, 1.0, 2.0, 3.0]
            async with grpc.aio.insecure_channel(zero.target) as ch:
                assert await refusal(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                                           timeout=5)) is grpc.StatusCode.UNAVAILABLE
            ca = (pki / "ca.pem").read_bytes()
            async with grpc.aio.secure_channel(zero.target, grpc.ssl_channel_credentials(ca)) as ch:
                stats = await admin_pb2_grpc.AdminStub(ch).Stats(admin_pb2.StatsRequest(), timeout=5, metadata=TOKEN)
                assert stats.task == str(zero.task)
    run(main())


def test_a_job_whose_master_addr_is_a_name_joins_over_tls(pki):  # noqa: F811
    """MASTER_ADDR a name (``localhost``): each rank joins from the host it names,
    and rank 0's certificate is still checked against that name."""
    async def main():
        port = free_port()
        env = boot_env(port, 3, addr="localhost")
        ranks = [aio.Server.from_env(env={**env, "RANK": str(r)}, **_tls(pki), token="s3cret") for r in range(3)]
        async with stopping(*ranks):
            await asyncio.gather(*(r.start() for r in ranks))
            assert {str(t): ranks[0].cluster.address(t) for t in ranks[0].cluster.tasks()} == \
                {str(r.task): r.target for r in ranks}
            ranks[2].send(key(2, 1, "n"), np.ones(1))
            assert (await ranks[1].recv(key(2, 1, "n"), timeout=10)).tolist() == [1.0]
    run(main())


def test_a_grpc_setup_that_leaves_out_a_configured_setting_is_refused(pki):  # noqa: F811
    from rendezvous.rank.setup import GrpcSetup

    cluster = {"worker": ["127.0.0.1:0"]}
    with pytest.raises(InvalidArgument, match="a token is set"):
        aio.Server(cluster, "worker", 0, grpc_setup=GrpcSetup(), token="s3cret")
    with pytest.raises(InvalidArgument, match="TLS is set"):
        aio.Server(cluster, "worker", 0, grpc_setup=GrpcSetup(), **_tls(pki))
    config = Config.load({"token": "s3cret", **_tls(pki)}, env={})
    aio.Server(cluster, "worker", 0, config=config, grpc_setup=GrpcSetup.from_config(config))  # applies both


def test_a_daemon_refuses_tls_with_a_local_tcp_address_off_loopback(pki, tmp_path):  # noqa: F811
    from rendezvous.daemon.daemon import Daemon

    def config(local: str) -> Config:
        return Config.load({"cluster": json.dumps({"node": ["127.0.0.1:0"]}), "job_name": "node", "task_index": 0,
                            "local_address": local, **_tls(pki)}, env={})

    with pytest.raises(InvalidArgument, match="the local service has no TLS"):
        Daemon(config("0.0.0.0:7070"))
    Daemon(config("127.0.0.1:0"))  # loopback: the traffic stays on the host
    Daemon(config(f"unix:{tmp_path}/d.sock"))


def test_a_forged_entry_in_torchruns_store_is_refused_with_a_token(monkeypatch):
    """Under torchrun's agent store (here a stand-in for torch's TCPStore, which
    anyone who reaches it may write), an entry for rank 1 not signed with the
    job's token fails rank 0's start; signed entries form the job."""
    entries: dict[str, str] = {}
    changed = threading.Condition()

    class TCPStore:
        def __init__(self, host, port, is_master=False, timeout=None):
            pass

        def set(self, name, value):
            with changed:
                entries[name] = value
                changed.notify_all()

        def wait(self, names, timeout):
            with changed:
                if not changed.wait_for(lambda: all(n in entries for n in names), timeout.total_seconds()):
                    raise RuntimeError(f"timed out waiting for {[n for n in names if n not in entries]}")

        def get(self, name):
            return entries[name].encode()

        def check(self, names):
            return all(n in entries for n in names)

    torch = types.ModuleType("torch")
    distributed = types.ModuleType("torch.distributed")
    distributed.TCPStore = TCPStore
    torch.distributed = distributed
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.distributed", distributed)
    env = {**boot_env(free_port(), 2), "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "r"}

    async def main():
        entries["rendezvous/r.0/worker/1"] = "127.0.0.1:6666"  # planted by a process without the token
        zero = aio.Server.from_env(env=env, token="s3cret", connect_timeout=2)
        async with stopping(zero) as tasks:
            with pytest.raises(Unauthenticated, match="rank 1's entry in torchrun's store"):
                await zero.start()
        entries.clear()
        zero = aio.Server.from_env(env=env, token="s3cret", connect_timeout=5)
        one = aio.Server.from_env(env={**env, "RANK": "1"}, token="s3cret", connect_timeout=5)
        async with stopping(zero, one) as tasks:
            await asyncio.gather(zero.start(), one.start())
            assert zero.cluster.address(one.task) == one.target and one.cluster.address(zero.task) == zero.target
    run(main())


# -- Admin's Pending: bounded work, and the kept tensors ------------------------------------


def test_pending_on_a_full_table_builds_a_bounded_number_of_rows(monkeypatch):
    """50,000 tensors wait: one Pending call builds at most 1,000 rows (table rows
    and messages counted as they are made), lists the oldest of them first, and
    says how many it left out."""
    import rendezvous.rpc.admin as admin_module

    built = {"rows": 0, "entries": 0}
    make_row = PendingEntry.__new__

    def counting_row(cls, *args, **kwargs):
        built["rows"] += 1
        return make_row(cls, *args, **kwargs)

    class CountingMessages:
        def __getattr__(self, name):
            return getattr(lpb, name)

        @staticmethod
        def PendingEntry(**fields):
            built["entries"] += 1
            return lpb.PendingEntry(**fields)

    async def main():
        server = aio.Server({"worker": ["127.0.0.1:0", "127.0.0.1:0"]}, "worker", 0)
        async with stopping(server) as tasks:
            await server.start()
            server.send_many([(key(0, 1, f"k{i}"), np.zeros(1)) for i in range(50_000)])
            monkeypatch.setattr(PendingEntry, "__new__", counting_row)
            monkeypatch.setattr(admin_module, "lpb", CountingMessages())
            async with grpc.aio.insecure_channel(server.target) as ch:
                reply = await admin_pb2_grpc.AdminStub(ch).Pending(lpb.PendingRequest(), timeout=30)
            monkeypatch.undo()
            assert len(reply.entries) <= built["rows"] <= 1000 and len(reply.entries) <= built["entries"] <= 1000, \
                built
            assert 0 < len(reply.entries) <= 1000 and reply.omitted == 50_000 - len(reply.entries)
            ages = [e.oldest_age_seconds for e in reply.entries]
            assert ages == sorted(ages, reverse=True)
    run(main())


def test_pending_lists_a_kept_tensor_until_a_recv_takes_it():
    async def main():
        server = aio.Server({"worker": ["127.0.0.1:0", "127.0.0.1:0"]}, "worker", 0)
        async with stopping(server) as tasks:
            await server.start()
            # fetched from task 1 and never delivered (its recv gave up): kept for the next recv
            server.keep(7, key(1, 0, "late"), Received(np.arange(2.0), False), why=None)
            assert [(p.step_id, p.key, p.kind, p.count) for p in server.pending()] == \
                [(7, key(1, 0, "late"), "kept", 1)]
            async with grpc.aio.insecure_channel(server.target) as ch:
                pending = await admin_pb2_grpc.AdminStub(ch).Pending(lpb.PendingRequest(), timeout=5)
            assert [(e.kind, e.step_id, e.rendezvous_key, e.count, e.producer) for e in pending.entries] == \
                [("kept", 7, key(1, 0, "late"), 1, "/job:worker/replica:0/task:1")]
            assert (await server.recv(key(1, 0, "late"), step_id=7, timeout=5)).tolist() == [0.0, 1.0]
            assert server.pending() == []
    run(main())


# -- a server its loop abandons ------------------------------------------------------------


ABANDONED = textwrap.dedent("""
    import asyncio, gc, socket, sys
    from rendezvous import aio

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    ports = []

    async def main():
        port = free_port()
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "2"}
        zero, one = aio.Server.from_env(env=env), aio.Server.from_env(env={**env, "RANK": "1"})
        await asyncio.gather(zero.start(), one.start())
        ports.extend(int(s.target.rsplit(":", 1)[1]) for s in (zero, one))
        raise AssertionError("a test's assertion failed before it stopped its servers")

    try:
        asyncio.run(main())
    except AssertionError:
        pass
    listening = []
    for port in ports:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                listening.append(port)
    asyncio.run(asyncio.sleep(0))  # the next test's loop
    gc.collect()
    print("listening" if listening else "closed", flush=True)
""")


def test_servers_whose_loop_ends_without_a_stop_leave_nothing_listening():
    """A test whose assertion fails after a bootstrap, without stopping its
    servers: once its loop ends nothing listens, and the process exits (a gRPC
    server left on a closed loop kept pytest from exiting)."""
    out = subprocess.run([sys.executable, "-c", ABANDONED], capture_output=True, text=True, timeout=50,
                         cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "GRPC_VERBOSITY": "ERROR"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "closed", out.stderr[-3000:]


ABANDONED_DAEMON = textwrap.dedent("""
    import asyncio, gc, json, os, socket, tempfile
    from rendezvous.config import Config
    from rendezvous.daemon.daemon import Daemon

    folder = tempfile.mkdtemp(prefix="rdv", dir="/tmp")
    seen = {}

    async def main():
        config = Config.load({"cluster": json.dumps({"node": ["127.0.0.1:0"]}), "job_name": "node",
                              "task_index": 0, "local_address": f"unix:{folder}/d.sock", "stall_warning": 0.0},
                             env={})
        daemon = Daemon(config)
        await daemon.start()
        seen["port"] = int(daemon.target.rsplit(":", 1)[1])
        raise AssertionError("a test's assertion failed before it stopped its daemon")

    try:
        asyncio.run(main())
    except AssertionError:
        pass
    with socket.socket() as probe:
        listening = probe.connect_ex(("127.0.0.1", seen["port"])) == 0
    left = os.listdir(folder)
    asyncio.run(asyncio.sleep(0))
    gc.collect()
    print("listening" if listening else "closed", left, flush=True)
""")


def test_a_daemon_whose_loop_ends_without_a_stop_leaves_nothing_listening():
    out = subprocess.run([sys.executable, "-c", ABANDONED_DAEMON], capture_output=True, text=True, timeout=50,
                         cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "GRPC_VERBOSITY": "ERROR"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "closed []", out.stderr[-3000:]  # the port closed, the socket files gone
