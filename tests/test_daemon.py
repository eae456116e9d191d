"""rendezvousd in process: the local hop (inline and shared memory), health,
reflection, metrics over real HTTP, stalls, limits, TLS and the token."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import datetime
import gc
import ipaddress
import json
import logging
import os
import signal
import socket
import subprocess
import struct
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from rendezvous.client.core import LocalOp
from rendezvous import aio as rank_aio
from rendezvous import errors
from rendezvous.local import frames as localwire
from rendezvous.local import segments as shm
from rendezvous.client.aio import Client
from rendezvous.config import Config
from rendezvous.daemon.daemon import Daemon
from rendezvous.local.frames import Kind
from rendezvous.v1 import local_pb2 as lpb
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import tensor_pb2 as tpb

from conftest import run, until

pytestmark = pytest.mark.timeout(60)
HERE = Path(__file__).resolve().parent


def dev(task: int, device: int = 0) -> str:
    return f"/job:node/replica:0/task:{task}/device:CPU:{device}"


def key(src: int, dst: int, name: str, src_dev: int = 0, dst_dev: int = 1) -> str:
    return f"{dev(src, src_dev)};0000000000000000;{dev(dst, dst_dev)};{name};0:0"


@pytest.fixture
def sockdir():
    # Short: a Unix socket path must fit in 107 bytes.
    with tempfile.TemporaryDirectory(prefix="rdv", dir="/tmp") as d:
        yield Path(d)


def _segment_files() -> int:
    """Descriptors and mappings of pool segments this process has open."""
    n = sum(1 for fd in os.listdir("/proc/self/fd") if "memfd:rendezvous-segment" in _link(f"/proc/self/fd/{fd}"))
    with open("/proc/self/maps") as f:
        return n + sum(1 for line in f if "memfd:rendezvous-segment" in line)


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


@pytest.fixture(autouse=True)
def no_leaked_segments():
    """Every test's daemons stop and its clients close: then no segment may be left
    open or mapped in this process (the daemons' and the clients' side both)."""
    yield
    gc.collect()
    assert _segment_files() == 0, "pool segments left open or mapped"


def config(sockdir: Path, index: int = 0, n: int = 1, **over) -> Config:
    base = dict(cluster=json.dumps({"node": ["127.0.0.1:0"] * n}), job_name="node", task_index=index,
                local_address=f"unix:{sockdir}/d{index}.sock", grace=0.5, connect_timeout=5.0,
                stall_warning=0.0)
    return Config.load({**base, **over}, env={})


@contextlib.asynccontextmanager
async def daemons(sockdir: Path, n: int = 1, per: list[dict] | None = None, **over) -> AsyncIterator[list[Daemon]]:
    """``n`` started daemons of one cluster (OS-chosen ports, published to each other)."""
    started: list[Daemon] = []
    try:
        for i in range(n):
            d = Daemon(config(sockdir, i, n, **{**over, **((per or [{}] * n)[i])}))
            await d.start()
            started.append(d)
        full = {"node": [d.target for d in started]}
        for d in started:
            d.server.update_cluster(full)
        yield started
    finally:
        for d in started:
            await d.stop(0.5)


async def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """GET /metrics from another thread (the collector needs the loop free)."""
    from prometheus_client.parser import text_string_to_metric_families

    def get() -> str:
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert resp.status == 200
            return resp.read().decode()

    text = await asyncio.get_running_loop().run_in_executor(None, get)
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# -- the local hop -------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes,hop", [(0, "inline"), (100, "inline"), (65535, "inline"), (65536, "shm"),
                                        ((4 << 20) + 3, "shm")])
def test_local_send_and_recv(sockdir, nbytes, hop):
    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target) as a, Client(d.local_target) as b:
            value = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)
            await a.send(key(0, 0, "t"), value, step_id=3)
            got = await b.recv(key(0, 0, "t"), step_id=3, timeout=10)
            assert np.array_equal(got, value) and got.dtype == np.uint8
            assert a.stats() == {f"send_{hop}": 1}
            assert b.stats() == {f"recv_{hop}": 1, "local": 1}
            if hop == "shm":
                # the client's array lives on the mapping of the daemon's segment (no
                # copy into other memory), and it is the client's to write
                base = got
                while isinstance(base, np.ndarray) and base.base is not None:
                    base = base.base
                base = base.obj if isinstance(base, memoryview) else base
                maps = b._link.segments._maps.values()
                assert any(m.buffer is base for m in maps) and got.flags.writeable
            # dtypes and shapes survive both ways
            m = np.arange(24, dtype=np.float64).reshape(2, 3, 4)
            await a.send(key(0, 0, "m"), m, step_id=3)
            assert np.array_equal(await b.recv(key(0, 0, "m"), step_id=3, timeout=10), m)
            await a.send(key(0, 0, "dead"), None, step_id=3, is_dead=True)
            assert (await b.recv_item(key(0, 0, "dead"), step_id=3, timeout=10)).is_dead
            del got
    run(main())


def test_recv_waits_for_a_later_send_and_pending_shows_it(sockdir):
    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target) as a, Client(d.local_target) as b:
            waiting = asyncio.create_task(b.recv(key(0, 0, "later"), step_id=1, timeout=10))
            await until(lambda: d.server.table.stats()["waiters"] == 1, what="the recv waiting")
            entries = await a.pending()
            assert [(e.kind, e.key, e.producer) for e in entries] == [
                ("waiter", key(0, 0, "later"), "/job:node/replica:0/task:0")]
            await a.send(key(0, 0, "later"), np.ones(70000, np.uint8), step_id=1)
            assert (await waiting).sum() == 70000
            sent = time.monotonic()
            await a.send(key(0, 0, "kept"), np.ones(3), step_id=2)
            (entry,) = await b.pending()
            assert entry.kind == "tensor" and entry.count == 1
            assert 0 <= entry.oldest_age_s <= time.monotonic() - sent  # its age since it was produced
    run(main())


def test_errors_have_their_status_and_the_daemon_keeps_serving(sockdir):
    async def main():
        async with daemons(sockdir, 2) as (d, _), Client(d.local_target) as c:
            with pytest.raises(errors.InvalidKey):
                await c.send("not a key", np.ones(3))
            with pytest.raises(errors.FailedPrecondition, match="produced by /job:node/replica:0/task:1"):
                await c.send(key(1, 0, "theirs"), np.ones(3))  # only task 0's keys can be sent here
            with pytest.raises(errors.DeadlineExceeded, match="timed out"):
                await c.recv(key(0, 0, "never"), step_id=1, timeout=0.2)
            with pytest.raises(errors.NotFound, match="not in the cluster"):
                await c.recv(key(0, 0, "x").replace("task:0/device:CPU:0", "task:9/device:CPU:0", 1), timeout=1)
            # garbage bytes straight to the service
            channel = grpc.aio.insecure_channel(d.local_target)
            for method in ("Send", "Recv", "Abort"):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await channel.unary_unary(f"/rendezvous.v1.LocalRendezvous/{method}")(b"\xff\xff\xff", timeout=5)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, info.value)
            await channel.close()
            await c.send(key(0, 0, "ok"), np.arange(4), step_id=1)
            assert list(await c.recv(key(0, 0, "ok"), step_id=1, timeout=5)) == [0, 1, 2, 3]
    run(main())


def test_abort_fails_waiters_and_frees_shared_memory(sockdir):
    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target) as a, Client(d.local_target) as b:
            await a.send(key(0, 0, "big"), np.ones(1 << 20, np.float32), step_id=5)
            # the table holds the daemon's array on the segment the client wrote
            # into; the answer lent the client a replacement for its next send
            assert d.pool.stats()["in_table"] == 1 and d.pool.stats()["lent"] == 1
            assert d.server.table.stats()["tensors"] == 1
            waiter = asyncio.create_task(b.recv(key(0, 0, "other"), step_id=5, timeout=10))
            await until(lambda: d.server.table.stats()["waiters"] == 1, what="the recv waiting")
            await a.abort(5, "stop step 5")
            with pytest.raises(errors.Aborted, match="stop step 5"):
                await waiter
            with pytest.raises(errors.Aborted):
                await a.send(key(0, 0, "late"), np.ones(1 << 20, np.float32), step_id=5)
            gc.collect()
            assert d.server.table.stats()["tensors"] == 0, "an aborted step's tensor is still held"
            stats = d.pool.stats()
            # the aborted tensor's segment is free again; the refused send gave its
            # segment back too, and the client has no lent segment left
            assert stats["in_table"] == 0 and stats["lent"] == 0 and stats["held"] == 0, stats
            assert stats["free_bytes"] == stats["bytes"]
            # consumption: the client's array is a view on the segment the sender
            # wrote (no copy), held until the array goes, then free for reuse
            created = stats["created"]
            await a.send(key(0, 0, "eaten"), np.ones(1 << 20, np.float32), step_id=6)
            got = await b.recv(key(0, 0, "eaten"), step_id=6, timeout=5)
            assert d.pool.stats()["held"] == 1 and d.pool.stats()["created"] == created
            del got
            gc.collect()
            await until(lambda: d.pool.stats()["held"] == 0, what="the released segment back in the pool")
            assert d.pool.stats()["created"] == created, "a steady rhythm reuses its segments"
    run(main())


def test_a_dead_clients_holds_go_back_to_the_pool(sockdir):
    """A client killed while it holds a received segment and a lent one: the
    daemon takes both back when its session socket closes."""
    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target) as a:
            await a.send(key(0, 0, "held"), np.ones(1 << 16, np.uint8), step_id=1)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, str(HERE / "daemon_clients.py"), "hold", d.local_target, key(0, 0, "held"),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
            try:
                line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
                assert line.startswith("HOLDING "), line
                stats = d.pool.stats()
                assert stats["held"] == 1 and stats["lent"] >= 2, stats  # a's replacement and the child's lend
                proc.kill()  # dies holding both
                await proc.wait()
                await until(lambda: d.pool.stats()["held"] == 0 and d.pool.stats()["lent"] == 1,
                            what="the dead client's segments back in the pool")
                await until(lambda: not d.sessions.sessions or len(d.sessions.sessions) == 1,
                            what="the session to end")
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
    run(main())


def test_local_limits(sockdir):
    async def main():
        async with daemons(sockdir, max_tensor_bytes=1 << 20) as (d,), Client(d.local_target) as c:
            with pytest.raises(errors.ResourceExhausted, match="max_tensor_bytes"):
                await c.send(key(0, 0, "huge"), np.ones((1 << 20) + 8, np.uint8))  # no segment is lent for it
            assert d.pool.stats()["lent"] == 0
            # Inline sends the client library would never write: a few bytes that
            # announce a huge tensor (one float_val filling 2**28 floats, 2**26
            # empty strings), and real content over the limit. Each once expanded.
            one_float = tpb.TensorProto(dtype=1, float_val=[1.0])
            one_float.tensor_shape.dim.add(size=1 << 28)
            no_strings = tpb.TensorProto(dtype=7)
            no_strings.tensor_shape.dim.add(size=1 << 26)
            content = tpb.TensorProto(dtype=4, tensor_content=bytes(3 << 19))
            content.tensor_shape.dim.add(size=3 << 19)
            for tensor in (one_float, no_strings, content):
                raw = lpb.SendRequest(step_id=1, rendezvous_key=key(0, 0, "hostile"), tensor=tensor)
                assert len(raw.SerializeToString()) < (1 << 20) or tensor is content
                with pytest.raises(errors.ResourceExhausted, match="max_tensor_bytes"):
                    await c._link.call(LocalOp(Kind.SEND, raw.SerializeToString(), 10))
            assert not d.server.pending()  # none of them was queued
            await c.send(key(0, 0, "fits"), np.ones(1 << 20, np.uint8))
    run(main())


def test_local_clients_over_tcp_need_the_token(sockdir):
    async def main():
        async with daemons(sockdir, local_address="127.0.0.1:0", token="s3cret") as (d,):
            assert d.local_target.startswith("127.0.0.1:") and not list(sockdir.iterdir())
            with pytest.raises(errors.Unauthenticated):
                await Client(d.local_target, token="").connect()
            with pytest.raises(errors.Unauthenticated):
                await Client(d.local_target, token="wrong").connect()
            async with Client(d.local_target, token="s3cret") as c:
                value = np.arange(1 << 16, dtype=np.float32)  # over TCP: inside the messages
                await c.send(key(0, 0, "t"), value, step_id=1)
                assert np.array_equal(await c.recv(key(0, 0, "t"), step_id=1, timeout=5), value)
                assert c.stats() == {"send_inline": 1, "recv_inline": 1, "local": 1} and not c.session
    run(main())


# -- across daemons ----------------------------------------------------------------------------


def test_two_daemons_move_tensors_between_nodes(sockdir):
    async def main():
        async with daemons(sockdir, 2) as (d0, d1), Client(d0.local_target) as a, Client(d1.local_target) as b:
            small, big = np.arange(10, dtype=np.int64), np.arange(1 << 18, dtype=np.float32)
            await a.send(key(0, 1, "small"), small, step_id=1)
            await a.send(key(0, 1, "big"), big, step_id=1)
            assert np.array_equal(await b.recv(key(0, 1, "small"), step_id=1, timeout=10), small)
            assert np.array_equal(await b.recv(key(0, 1, "big"), step_id=1, timeout=10), big)
            assert b.stats() == {"recv_inline": 1, "recv_shm": 1, "grpc": 2}
            # a recv waiting on the other node shows up there as "remote"
            waiting = asyncio.create_task(b.recv(key(0, 1, "later"), step_id=2, timeout=10))
            await until(lambda: d1.local.waits, what="the remote wait")
            (entry,) = await b.pending()
            assert (entry.kind, entry.producer) == ("remote", "/job:node/replica:0/task:0")
            await a.send(key(0, 1, "later"), np.ones(2), step_id=2)
            assert list(await waiting) == [1, 1]
    run(main())


def test_health_reflection_and_draining(sockdir):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def main():
        d = Daemon(config(sockdir, grace=10.0))
        await d.start()
        try:
            # reflection lists exactly what each port serves: no LocalRendezvous on the rank port
            ops = {"rendezvous.v1.Admin", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
            expected = {d.target: ops | {"rendezvous.v1.Rendezvous"},
                        d.local_target: ops | {"rendezvous.v1.LocalRendezvous"}}
            for target in (d.target, d.local_target):
                async with grpc.aio.insecure_channel(target) as ch:
                    check = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                    assert check.status == health_pb2.HealthCheckResponse.SERVING
                    named = await health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service="rendezvous.v1.Rendezvous"), timeout=5)
                    assert named.status == health_pb2.HealthCheckResponse.SERVING
                    stub = reflection_pb2_grpc.ServerReflectionStub(ch)
                    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
                    services = {s.name async for r in call for s in r.list_services_response.service}
                    assert services == expected[target], target
                    # health answers for the whole server and each service it serves
                    for name in {""} | services - ops | {"rendezvous.v1.Admin"}:
                        answer = await health_pb2_grpc.HealthStub(ch).Check(
                            health_pb2.HealthCheckRequest(service=name), timeout=5)
                        assert answer.status == health_pb2.HealthCheckResponse.SERVING, (target, name)
            # a tensor nobody consumes keeps the drain going for the grace period:
            # health reads NOT_SERVING all that time
            async with Client(d.local_target) as c:
                await c.send(key(0, 0, "unconsumed"), np.ones(3), step_id=1)
            async with grpc.aio.insecure_channel(d.target) as ch:
                watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=30)
                first = await watch.read()
                assert first.status == health_pb2.HealthCheckResponse.SERVING
                stopping = asyncio.create_task(d.stop(1.0))
                second = await watch.read()
                assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
                check = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
                await stopping
        finally:
            await d.stop(0)
        assert not (sockdir / "d0.sock").exists()
    run(main())


def test_metrics_over_http(sockdir):
    async def main():
        async with daemons(sockdir, 2, metrics_port=0) as (d0, d1), \
                Client(d0.local_target) as a, Client(d1.local_target) as b:
            assert d0.metrics_url.startswith("http://127.0.0.1:")
            await a.send(key(0, 1, "big"), np.ones(1 << 17, np.float32), step_id=1)
            await b.recv(key(0, 1, "big"), step_id=1, timeout=10)
            await a.send(key(0, 0, "left"), np.ones(5), step_id=2)
            with pytest.raises(errors.FailedPrecondition):
                await a.send(key(1, 0, "theirs"), np.ones(1))  # task 1's key, sent to task 0's daemon
            m0, m1 = await scrape(d0.metrics_url), await scrape(d1.metrics_url)
            assert m1[("rendezvous_transfers_total", (("path", "grpc"),))] == 1
            assert m1[("rendezvous_bytes_total", (("path", "grpc"),))] == 1 << 19
            assert m0[("rendezvous_served_total", (("path", "grpc"),))] == 1
            assert m0[("rendezvous_local_ops_total", (("op", "send"), ("path", "shm")))] == 1
            assert m0[("rendezvous_local_ops_total", (("op", "send"), ("path", "inline")))] == 1
            assert m1[("rendezvous_local_bytes_total", (("op", "recv"), ("path", "shm")))] == 1 << 19
            assert m1[("rendezvous_recv_seconds_count", (("path", "grpc"),))] == 1
            assert m0[("rendezvous_errors_total", (("code", "FAILED_PRECONDITION"),))] == 1
            assert m0[("rendezvous_waiting_tensors", ())] == 1
            assert m0[("rendezvous_waiting_oldest_seconds", ())] > 0
            assert m0[("rendezvous_local_clients", ())] == 1
            assert m0[("rendezvous_mpi_in_flight", ())] == 0
            assert m0[("rendezvous_draining", ())] == 0
    run(main())


def test_stall_warning_names_key_and_producer(sockdir, caplog):
    async def main():
        # task 1 of the cluster never answers (a socket on an OS-chosen port that
        # listens but never speaks): a recv of its key just waits
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        async with daemons(sockdir, stall_warning=0.2) as (d,), Client(d.local_target) as c:
            d.server.update_cluster({"node": [d.target, f"127.0.0.1:{silent.getsockname()[1]}"]})
            waiting = asyncio.create_task(c.recv(key(1, 0, "slow"), step_id=4, timeout=30))
            local = asyncio.create_task(c.recv(key(0, 0, "mine"), step_id=4, timeout=30))
            await until(lambda: sum("has waited" in r.getMessage() for r in caplog.records) >= 2, timeout=20,
                        what="two stall warnings")
            waiting.cancel()
            local.cancel()
            await asyncio.gather(waiting, local, return_exceptions=True)
        silent.close()
        stalls = [r for r in caplog.records if "has waited" in r.getMessage()]
        by_key = {r.key: r for r in stalls}
        assert len(stalls) == 2, [r.getMessage() for r in stalls]  # each once
        assert by_key[key(1, 0, "slow")].producer == "/job:node/replica:0/task:1"
        assert by_key[key(0, 0, "mine")].producer == "/job:node/replica:0/task:0"
        assert "/job:node/replica:0/task:1" in by_key[key(1, 0, "slow")].getMessage()

    caplog.set_level(logging.WARNING, logger="rendezvous.daemon")
    run(main())


def test_json_log_lines():
    """python-json-logger writes the fields the docs name: time (UTC, ms, Z),
    level, logger, message, the extra= fields, and an exception's traceback."""
    from rendezvous.daemon.setup import json_formatter

    record = logging.LogRecord("rendezvous.daemon", logging.WARNING, __file__, 1, "recv of %s waits", ("k",), None)
    record.created, record.msecs = 1700000000.25, 250.0
    record.producer, record.key, record.step_id = "/job:node/replica:0/task:1", "k", 7
    line = json.loads(json_formatter().format(record))
    assert line == {"time": "2023-11-14T22:13:20.250Z", "level": "WARNING", "logger": "rendezvous.daemon",
                    "message": "recv of k waits", "producer": "/job:node/replica:0/task:1", "key": "k",
                    "step_id": 7}
    try:
        raise ValueError("boom")
    except ValueError:
        failed = logging.LogRecord("rendezvous", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = json.loads(json_formatter().format(failed))
    assert line["message"] == "failed" and "ValueError: boom" in line["exception"]


def test_a_daemon_that_does_not_answer_is_waited_for_at_most_connect_timeout(sockdir):
    """Sockets that accept connections and never speak (a hung daemon): the
    blocking client gives up after ``connect_timeout``; the asyncio client after
    ``connect_timeout`` or a recv's own timeout, whichever is smaller; both
    with Unavailable naming the socket, on the session socket and over gRPC."""
    from rendezvous.client import Client as BlockingClient

    hung = []
    for name in ("d.sock", "d.sock.session"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(sockdir / name))
        s.listen(16)
        hung.append(s)
    address = f"unix:{sockdir}/d.sock"
    try:
        for shm_ok in (None, False):
            started = time.monotonic()
            with pytest.raises(errors.Unavailable, match="within 0.5s"):
                BlockingClient(address, connect_timeout=0.5, shm_ok=shm_ok)
            assert time.monotonic() - started < 5, shm_ok

        async def main():
            for shm_ok in (None, False):
                c = Client(address, connect_timeout=30, shm_ok=shm_ok)
                started = time.monotonic()
                with pytest.raises(errors.Unavailable, match=f"{sockdir}/d.sock.* within 0.5s"):
                    await c.recv(key(0, 0, "x"), timeout=0.5)
                assert time.monotonic() - started < 5, shm_ok
                await c.close()
                c = Client(address, connect_timeout=0.3, shm_ok=shm_ok)
                with pytest.raises(errors.Unavailable, match="within 0.3s"):
                    await c.recv(key(0, 0, "x"), timeout=30)
                await c.close()
        run(main())
    finally:
        for s in hung:
            s.close()


def test_a_client_fails_at_once_where_no_daemon_ever_started(sockdir):
    """The asyncio client (the blocking one: tests/test_daemon_cli.py): no socket
    file, no wait."""
    async def main():
        c = Client(f"unix:{sockdir}/none.sock", connect_timeout=30)
        with pytest.raises(errors.Unavailable, match=f"{sockdir}/none.sock does not exist.*rendezvousd"):
            await c.recv(key(0, 0, "x"))
        await c.close()

    started = time.monotonic()
    run(main())
    assert time.monotonic() - started < 5


def test_a_second_daemon_on_the_same_socket_is_refused_and_a_stale_socket_replaced(sockdir):
    async def main():
        async with daemons(sockdir) as (d,):
            other = Daemon(config(sockdir))
            with pytest.raises(errors.Unavailable, match="another daemon is listening"):
                await other.start()
        # a socket file nobody listens on (a killed daemon's) is replaced
        import socket as socketlib

        path = sockdir / "d0.sock"
        stale = socketlib.socket(socketlib.AF_UNIX)
        stale.bind(str(path))
        stale.close()
        async with daemons(sockdir) as (d,), Client(d.local_target) as c:
            await c.send(key(0, 0, "x"), np.ones(1))
            assert oct(path.stat().st_mode & 0o777) == oct(0o600)
        assert not path.exists()
    run(main())


# -- security ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a node certificate it signed (127.0.0.1 and localhost, server and client
    use), and a certificate of another CA: made at run time, never stored."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder = tmp_path_factory.mktemp("pki")
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem: str, key, cert) -> None:
        (folder / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        (folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def ca(stem: str):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(stem)).issuer_name(name(stem))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(key, hashes.SHA256()))
        write(stem, key, cert)
        return key, cert

    def leaf(stem: str, issuer):
        ca_key, ca_cert = issuer
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(stem)).issuer_name(ca_cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([
                    x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        write(stem, key, cert)

    good = ca("ca")
    leaf("node", good)
    leaf("intruder", ca("other-ca"))
    return folder


def _tls(pki: Path, mutual: bool) -> dict:
    return dict(tls_cert=str(pki / "node.pem"), tls_key=str(pki / "node.key"), tls_ca=str(pki / "ca.pem"),
                tls_client_auth=mutual)


async def _health(target: str, credentials: grpc.ChannelCredentials | None, metadata=None) -> grpc.StatusCode:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    ch = grpc.aio.secure_channel(target, credentials) if credentials else grpc.aio.insecure_channel(target)
    try:
        await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5, metadata=metadata)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        await ch.close()


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_tls_accepts_the_cluster_ca_and_refuses_the_rest(sockdir, pki, mutual):
    read = lambda name: (pki / name).read_bytes()  # noqa: E731

    async def main():
        async with daemons(sockdir, 2, **_tls(pki, mutual)) as (d0, d1), \
                Client(d0.local_target) as a, Client(d1.local_target) as b:
            await a.send(key(0, 1, "secret"), np.arange(5), step_id=1)  # crosses TLS between the daemons
            assert list(await b.recv(key(0, 1, "secret"), step_id=1, timeout=15)) == [0, 1, 2, 3, 4]
            trusted = grpc.ssl_channel_credentials(read("ca.pem"), read("node.key"), read("node.pem"))
            assert await _health(d0.target, trusted) == grpc.StatusCode.OK
            assert await _health(d0.target, None) == grpc.StatusCode.UNAVAILABLE  # plaintext
            wrong_ca = grpc.ssl_channel_credentials(read("other-ca.pem"))
            assert await _health(d0.target, wrong_ca) == grpc.StatusCode.UNAVAILABLE  # server not trusted
            anonymous = grpc.ssl_channel_credentials(read("ca.pem"))
            intruder = grpc.ssl_channel_credentials(read("ca.pem"), read("intruder.key"), read("intruder.pem"))
            expected = grpc.StatusCode.UNAVAILABLE if mutual else grpc.StatusCode.OK
            assert await _health(d0.target, anonymous) == expected
            assert await _health(d0.target, intruder) == expected
    run(main())


def test_token_is_required_on_every_call_and_sent_by_peers(sockdir):
    from rendezvous.v1 import rendezvous_pb2

    async def main():
        async with daemons(sockdir, 2, token="s3cret", metrics_port=0) as (d0, d1), \
                Client(d0.local_target) as a, Client(d1.local_target) as b:
            await a.send(key(0, 1, "t"), np.arange(3), step_id=1)
            await a.send(key(0, 1, "t"), np.arange(3), step_id=1)
            assert list(await b.recv(key(0, 1, "t"), step_id=1, timeout=10)) == [0, 1, 2]  # peers send it
            request = rendezvous_pb2.RecvTensorRequest(step_id=1, rendezvous_key=key(0, 1, "t")).SerializeToString()
            async with grpc.aio.insecure_channel(d0.target) as ch:
                call = ch.unary_unary("/rendezvous.v1.Rendezvous/RecvTensor")
                for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call(request, timeout=5, metadata=metadata)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                stream = ch.stream_stream("/rendezvous.v1.Rendezvous/RecvTensorStream")(timeout=5)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stream.read()
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert await call(request, timeout=5, metadata=(("authorization", "Bearer s3cret"),))
            assert await _health(d0.target, None) == grpc.StatusCode.OK  # probes need no token
            m0 = await scrape(d0.metrics_url)
            assert m0[("rendezvous_errors_total", (("code", "UNAUTHENTICATED"),))] == 4
    run(main())


def test_a_daemon_without_the_token_cannot_fetch(sockdir):
    async def main():
        async with daemons(sockdir, 2, per=[{"token": "s3cret"}, {}]) as (d0, d1), \
                Client(d0.local_target) as a, Client(d1.local_target) as b:
            await a.send(key(0, 1, "t"), np.arange(3), step_id=1)
            with pytest.raises(errors.Unauthenticated):
                await b.recv(key(0, 1, "t"), step_id=1, timeout=10)
            assert len(await a.pending()) == 1  # nothing was taken
    run(main())


def test_a_peer_announcing_a_huge_tensor_is_refused_before_allocating():
    """A malicious or broken peer replies with dtype and shape of 4 TiB."""
    async def main():
        async def stream(requests, context):
            async for raw in requests:
                req = pb.StreamRequest.FromString(raw)
                reply = pb.StreamResponse(call_id=req.call_id, response=pb.RecvTensorResponse(
                    tensor={"dtype": 1, "tensor_shape": {"dim": [{"size": 1 << 40}]}}))
                await context.write(reply.SerializeToString())

        fake = grpc.aio.server()
        fake.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "rendezvous.v1.Rendezvous", {"RecvTensorStream": grpc.stream_stream_rpc_method_handler(stream)})])
        port = fake.add_insecure_port("127.0.0.1:0")
        await fake.start()
        server = rank_aio.Server({"node": ["127.0.0.1:0", f"127.0.0.1:{port}"]}, "node", 0,
                                 max_tensor_bytes=1 << 30)
        await server.start()
        try:
            with pytest.raises(errors.ResourceExhausted, match="max_tensor_bytes"):
                await server.recv(key(1, 0, "huge"), step_id=1, timeout=10)
        finally:
            await server.stop(0)
            await fake.stop(0)
    run(main())


def test_sigterm_handler_ignores_a_duplicate_delivery_but_not_a_later_signal(sockdir):
    """The command's signal handling, in a child process. Two SIGTERMs sent at
    once usually reach a process as one (the kernel merges a pending signal), so
    that case proves nothing here: the duplicate window is tested with the
    window under the test's control in tests/test_lifecycle.py. What this test
    shows is the other half: the same signal again *after* the window (a person
    pressing Ctrl-C twice) exits at once, long before the drain's grace."""
    from rendezvous.client import Client as BlockingClient
    from rendezvous.lifecycle import SAME_SIGNAL_S

    cluster = json.dumps({"node": ["127.0.0.1:0"]})
    proc = subprocess.Popen([sys.executable, "-m", "rendezvous", "serve", "--daemon", "--cluster", cluster,
                             "--job-name", "node", "--local", f"unix:{sockdir}/d.sock", "--grace", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "serving on 127.0.0.1:" in line, line + proc.stderr.read()
        with BlockingClient(f"unix:{sockdir}/d.sock") as c:
            c.send(key(0, 0, "unconsumed"), np.ones(4), step_id=1)  # keeps the drain going for its grace
        first = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        while "draining" not in proc.stderr.readline():  # the drain has begun
            assert proc.poll() is None
        while time.monotonic() - first <= SAME_SIGNAL_S:  # the window is what is tested
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 1  # at once, not after the 60 s grace
        assert "second signal (SIGTERM)" in proc.stderr.read()
        assert not (sockdir / "d.sock").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_get_command_sends_the_token_and_speaks_tls(sockdir, pki, capsys):
    from rendezvous import cli

    def get(target, name, *flags):
        return cli.main(["get", key(0, 1, name), "--from", target, "--step", "1", "--timeout", "10", *flags])

    async def main():
        async with daemons(sockdir, 2, token="s3cret", **_tls(pki, True)) as (d0, d1), \
                Client(d0.local_target) as a:
            await a.send(key(0, 1, "t"), np.arange(4, dtype=np.int32), step_id=1)
            ca, cert, pkey = (str(pki / n) for n in ("ca.pem", "node.pem", "node.key"))
            tls = ("--tls-ca", ca, "--tls-cert", cert, "--tls-key", pkey)
            assert await asyncio.to_thread(get, d0.target, "t", *tls) == 1  # no token
            assert "UNAUTHENTICATED" in capsys.readouterr().err
            assert await asyncio.to_thread(get, d0.target, "t", "--token", "s3cret") == 1  # no TLS
            assert "UNAVAILABLE" in capsys.readouterr().err
            assert await asyncio.to_thread(get, d0.target, "t", "--token", "s3cret", *tls) == 0
            assert "dtype=int32 shape=(4,)" in capsys.readouterr().out
            assert await asyncio.to_thread(get, d0.target, "t", "--tls-cert", cert) == 1
            assert "go together" in capsys.readouterr().err
    run(main())


async def lend(c: Client, nbytes: int) -> int:
    await c._link.call(LocalOp(Kind.LEND, struct.pack("<Q", nbytes)))
    seg_id = c._link.segments.take(nbytes)
    assert seg_id is not None
    return seg_id


def pooled(step: int, name: str, value: np.ndarray, seg_id: int, nbytes: int | None = None) -> bytes:
    meta = tpb.TensorProto(dtype=tpb.DT_FLOAT if value.dtype == np.float32 else tpb.DT_DOUBLE)
    for d in value.shape:
        meta.tensor_shape.dim.add(size=d)
    return lpb.SendRequest(step_id=step, rendezvous_key=key(0, 0, name), tensor=meta,
                           pooled=lpb.PoolSlot(segment=seg_id, nbytes=value.nbytes if nbytes is None else nbytes)
                           ).SerializeToString()


def test_a_client_cannot_hand_over_another_clients_segment(sockdir):
    """A send may only name a segment the daemon lent to that same session: the
    other client's bytes never become this one's tensor."""
    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target) as a, Client(d.local_target) as b:
            value = np.arange(1 << 16, dtype=np.float64)
            seg_id = await lend(a, value.nbytes)  # a's, written and not yet sent
            a._link.segments.write(seg_id, value)
            for bogus in (seg_id, seg_id + 1000):
                with pytest.raises(errors.InvalidArgument, match="not lent to this client"):
                    await b._link.call(LocalOp(Kind.SEND, pooled(1, "stolen", value, bogus), 10))
            assert d.pool.get(seg_id).lent_to is not None  # untouched: still a's to send
            assert not d.server.pending()
            with pytest.raises(errors.InvalidArgument, match="holds"):  # more than the segment holds
                await a._link.call(LocalOp(Kind.SEND, pooled(1, "big", np.zeros(1 << 20), seg_id), 10))
            # a refused pooled send gives the segment back: the client must ask again
            assert d.pool.get(seg_id).lent_to is None
            seg_id = await lend(a, value.nbytes)
            a._link.segments.write(seg_id, value)
            # its owner may send it, once
            await a._link.call(LocalOp(Kind.SEND, pooled(1, "mine", value, seg_id), 10))
            with pytest.raises(errors.InvalidArgument, match="not lent"):
                await a._link.call(LocalOp(Kind.SEND, pooled(1, "twice", value, seg_id), 10))
            np.testing.assert_array_equal(await b.recv(key(0, 0, "mine"), step_id=1, timeout=10), value)
            # a release of a segment the client does not hold changes nothing
            a._link.conn.write(localwire.frame(Kind.RELEASE, 0, localwire.pack_ids([seg_id, 99999])))
            await a.pending()  # a round trip: the release was handled before it
            assert d.sessions.sessions and all(s.bad <= 2 for s in d.sessions.sessions.values())
            assert sum(s.bad for s in d.sessions.sessions.values()) == 2
    run(main())


def test_a_pooled_reply_whose_recv_gave_up_is_given_back_and_kept(sockdir):
    """A large reply that arrives after its recv gave up goes back as RETURN with
    the segment it was handed: the daemon keeps it for the next recv of its key
    (it was once refused, and the tensor lost)."""
    from rendezvous.local.messages import returned

    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target) as a, Client(d.local_target) as b:
            value = np.arange(1 << 17, dtype=np.float64)  # 1 MiB
            await a.send(key(0, 0, "late"), value, step_id=3)
            req = lpb.LocalRecvRequest(step_id=3, rendezvous_key=key(0, 0, "late")).SerializeToString()
            raw = await b._link.call(LocalOp(Kind.RECV, req, 10))  # as if its caller had given up meanwhile
            assert d.pool.stats()["held"] == 1
            await b._link.call(LocalOp(Kind.RETURN, returned(key(0, 0, "late"), 3, raw), 10))
            stats = d.pool.stats()
            assert stats["held"] == 0 and stats["in_table"] == 1, stats
            # the same tensor, on the same segment, for the next recv (here another client's)
            np.testing.assert_array_equal(await a.recv(key(0, 0, "late"), step_id=3, timeout=10), value)
            # a RETURN naming a segment the client does not hold is refused
            with pytest.raises(errors.InvalidArgument, match="not held"):
                await b._link.call(LocalOp(Kind.RETURN, returned(key(0, 0, "late"), 3, raw), 10))
            assert not d.server.pending() and not d.server.kept
    run(main())


def test_a_session_that_skips_hello_is_told_why_and_closed(sockdir):
    async def main():
        def talk(path: str) -> bytes:  # on a thread: the daemon lives on this loop
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            try:
                sock.connect(path)
                sock.sendall(localwire.frame(Kind.PENDING, 7) + localwire.frame(Kind.PENDING, 8))
                got = b""
                while chunk := sock.recv(4096):  # until the daemon closes it
                    got += chunk
                return got
            finally:
                sock.close()

        async with daemons(sockdir) as (d,):
            got = await asyncio.to_thread(talk, d.sessions.path)
            [(kind, op, body)] = localwire.FrameReader(1 << 20).feed(got)
            assert (kind, op) == (Kind.ERROR, 7)
            code, message = localwire.unpack_error(body)
            assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "HELLO" in message
    run(main())


def test_a_lent_segment_released_unused_no_longer_counts_against_the_session(sockdir):
    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target) as a:
            for _ in range(d.sessions.segment_share + 5):
                seg_id = await lend(a, 1 << 16)
                a._link.conn.write(localwire.frame(Kind.RELEASE, 0, localwire.pack_ids([seg_id])))
            await a.pending()
            (session,) = d.sessions.sessions.values()
            assert session.lent == 0 and d.pool.stats()["lent"] == 0 and session.bad == 0
            assert d.pool.holds(session.id) == 0
    run(main())


def test_no_client_can_truncate_a_segment_under_the_daemon(sockdir):
    """The daemon once mapped a client's shared-memory file: truncating it after
    the hand-off made the next access fault (SIGBUS) and killed the daemon. Pool
    segments are sealed before any client sees them: they cannot shrink or grow."""
    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target) as a, Client(d.local_target) as b:
            value = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
            await a.send(key(0, 0, "cut"), value, step_id=1)
            for seg in list(d.pool._segments.values()):
                # the daemon's descriptor and a client's copy of it (as a client got it)
                path = f"/proc/self/fd/{seg.fd}"
                fd = os.open(path, os.O_RDWR)
                try:
                    for size in (0, seg.size // 2, seg.size * 2):
                        with pytest.raises(PermissionError):
                            os.ftruncate(fd, size)
                    with pytest.raises(PermissionError):
                        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # the seals are sealed too
                finally:
                    os.close(fd)
            np.testing.assert_array_equal(await b.recv(key(0, 0, "cut"), step_id=1, timeout=10), value)
            # a client refuses to map a descriptor whose size is not sealed
            plain = os.memfd_create("not-sealed")
            try:
                os.ftruncate(plain, 1 << 16)
                with pytest.raises(errors.InvalidArgument, match="seal"):
                    shm.map_segment(plain, 1 << 16)
            finally:
                os.close(plain)
    run(main())


def test_a_fetched_tensor_the_daemon_cannot_hand_over_is_kept_for_the_next_recv(sockdir, monkeypatch):
    """The daemon took the tensor from its table but could not make the reply:
    the tensor was once lost. Now the next recv gets it."""
    from rendezvous.daemon import sessions

    async def main():
        async with daemons(sockdir) as (d,), Client(d.local_target) as a, Client(d.local_target) as b:
            value = np.arange(1 << 17, dtype=np.float64)  # 1 MiB: a shared-memory reply
            await a.send(key(0, 0, "full"), value, step_id=2)
            real = sessions.Session._reply
            calls = []

            async def broken(self, item, path):
                calls.append(path)
                raise errors.ResourceExhausted("cannot make the reply")
            monkeypatch.setattr(sessions.Session, "_reply", broken)
            with pytest.raises(errors.ResourceExhausted):
                await b.recv(key(0, 0, "full"), step_id=2, timeout=10)
            assert calls
            monkeypatch.setattr(sessions.Session, "_reply", real)
            np.testing.assert_array_equal(await b.recv(key(0, 0, "full"), step_id=2, timeout=10), value)
            assert not d.server.pending() and not d.server.kept
    run(main())
