"""Promises of rendezvousd's pages (server/README.md, client/README.md) that no other module tests: the drain as seen
from outside (health, local refusals, a produced tensor still served), the
socket folder's and both sockets' modes, the default local address, ``token_file`` over ``token``, ``rendezvous get
--save/--token-file/--token``, the one warning for a GPU key without a GPU,
and the metrics of local recvs, errors by code and the drain.

Each test's docstring says how it was seen to fail with the code broken: the
library was monkeypatched in a scratch run (a sitecustomize on PYTHONPATH,
so the commands run as subprocesses got the same patch), never edited."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import numpy as np
import pytest

from rendezvous import aio as rank_aio
from rendezvous import errors
from rendezvous.local import address as local_address
from rendezvous.client.aio import Client
from rendezvous.config import Config
from rendezvous.daemon.daemon import Daemon
from rendezvous.devices import Devices
from rendezvous.v1 import rendezvous_pb2 as pb

from conftest import run, until
from test_daemon import _segment_files, config, daemons, key, scrape, sockdir  # noqa: F401  (sockdir: a fixture)
from test_daemon_cli import READY, RENDEZVOUSD, Proc, procs  # noqa: F401  (procs: a fixture)

pytestmark = pytest.mark.timeout(90)

RANK_SERVICE = "rendezvous.v1.Rendezvous"
LOCAL_SERVICE = "rendezvous.v1.LocalRendezvous"


@pytest.fixture(autouse=True)
def no_leaked_segments():
    """No pool segment left open or mapped in this process once a test is over."""
    yield
    gc.collect()
    assert _segment_files() == 0, "pool segments left open or mapped"


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without any RENDEZVOUS_ setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUS_")}
    env.update(extra)
    return env


async def _health(target: str, service: str = "") -> int:
    """The health status (SERVING, NOT_SERVING, ...) of ``service`` at ``target``, no token."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(target) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                            timeout=10)
        return reply.status


async def _start_drain(d0: Daemon, grace: float) -> asyncio.Task:
    """Start ``d0.stop(grace)`` as a task; return once the rank server's drain has
    begun (the daemon's own steps, health and the local refusal, come before it)."""
    stopping = asyncio.create_task(d0.stop(grace))
    await until(lambda: d0.server.servicer.draining or stopping.done(), timeout=20, what="the drain to start")
    assert not stopping.done(), "the drain ended at once although a produced tensor was left"
    return stopping


def _metric(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


# -- 1. the drain -----------------------------------------------------------------------------


def test_drain_turns_health_not_serving_refuses_local_calls_and_still_serves_a_produced_tensor(sockdir):
    """Once ``stop(grace)`` begins: health is NOT_SERVING on the remote port and on
    the local socket (overall and both services), a local send and a local recv
    are refused with UNAVAILABLE (and the refused recv consumes nothing), and the
    tensor already in the table is still served to the other daemon's client,
    after which the drain ends well before its grace.

    Checked to fail: with ``Daemon._set_health`` made a no-op for False (health
    stays SERVING); with ``LocalServicer.begin_drain`` a no-op (the local send is
    accepted); with ``aio.Server.stop`` forced to grace 0 (the remote recv fails
    UNAVAILABLE); with ``WaitingTable.try_take`` returning None (a draining
    producer serves nothing: UNAVAILABLE)."""
    from grpc_health.v1 import health_pb2

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    async def main():
        async with daemons(sockdir, 2) as (d0, d1), Client(d0.local_target) as a, Client(d1.local_target) as b:
            await a.connect()
            for target in (d0.target, d0.local_target):
                for service in ("", RANK_SERVICE, LOCAL_SERVICE):
                    assert await _health(target, service) == serving, (target, service)
            value = np.arange(1000, dtype=np.int64)
            await a.send(key(0, 1, "kept"), value, step_id=1)
            stopping = await _start_drain(d0, 30.0)
            for target in (d0.target, d0.local_target):
                for service in ("", RANK_SERVICE, LOCAL_SERVICE):
                    assert await _health(target, service) == not_serving, (target, service)
            with pytest.raises(errors.Unavailable, match="shutting down"):
                await a.send(key(0, 1, "late"), np.ones(3), step_id=1)
            with pytest.raises(errors.Unavailable, match="shutting down"):
                await a.recv(key(0, 1, "kept"), step_id=1, timeout=10)
            assert not stopping.done()
            assert d0.server.table.stats()["tensors"] == 1  # the refused recv took nothing
            # another node's recv still gets the produced tensor (a fresh connection too)
            got = await b.recv(key(0, 1, "kept"), step_id=1, timeout=15)
            np.testing.assert_array_equal(got, value)
            assert b.stats().get("grpc") == 1
            # nothing left to deliver: the drain ends long before its 30 s grace
            await asyncio.wait_for(stopping, 15)
            assert not Path(d0.local_target[5:]).exists()
    run(main(), timeout=80)


def test_draining_gauge_and_refusals_by_code_in_the_metrics(sockdir):
    """``rendezvous_draining`` is 1 while a drain is in progress (0 before), and
    the local calls refused during it count as ``rendezvous_errors_total{code=
    "UNAVAILABLE"}``, not as ``rendezvous_local_ops_total``.

    Checked to fail: with ``Daemon.snapshot`` reporting ``draining`` False (the
    gauge stays 0), and with ``DaemonMetrics.error`` a no-op (no UNAVAILABLE)."""
    async def main():
        async with daemons(sockdir, 2, per=[{"metrics_port": 0}, {}]) as (d0, d1), \
                Client(d0.local_target) as a, Client(d1.local_target) as b:
            await a.send(key(0, 1, "kept"), np.arange(4), step_id=1)
            m = await scrape(d0.metrics_url)
            assert _metric(m, "rendezvous_draining") == 0
            assert _metric(m, "rendezvous_local_ops_total", op="send", path="inline") == 1
            stopping = await _start_drain(d0, 30.0)
            with pytest.raises(errors.Unavailable):
                await a.send(key(0, 1, "late"), np.ones(3), step_id=1)
            with pytest.raises(errors.Unavailable):
                await a.recv(key(0, 1, "kept"), step_id=1, timeout=10)
            m = await scrape(d0.metrics_url)
            assert not stopping.done()
            assert _metric(m, "rendezvous_draining") == 1
            assert _metric(m, "rendezvous_errors_total", code="UNAVAILABLE") == 2
            assert _metric(m, "rendezvous_local_ops_total", op="send", path="inline") == 1  # refused: not an op
            assert _metric(m, "rendezvous_local_ops_total", op="recv", path="inline") == 0
            assert list(await b.recv(key(0, 1, "kept"), step_id=1, timeout=15)) == [0, 1, 2, 3]
            await asyncio.wait_for(stopping, 15)
    run(main(), timeout=80)


# -- 2. the start-up sweep ------------------------------------------------------------------------


def test_the_socket_folder_the_daemon_creates_is_0700_and_the_socket_0600():
    """Under umask 022 (which would give 0755), the folder the daemon creates for
    its socket is 0700 and both sockets (gRPC and session) 0600; a client connects;
    stop removes them.

    Checked to fail: with the daemon's ``os.chmod`` a no-op (socket 0755) and with
    ``_claim_socket`` creating the folder without ``mode`` (folder 0755)."""
    base = Path(tempfile.mkdtemp(prefix="rdv", dir="/tmp"))
    folder = base / "run" / "rdv"
    path = folder / "d.sock"
    assert len(os.fsencode(str(path))) < 107
    old_umask = os.umask(0o022)
    try:
        async def main():
            async with daemons(base, local_address=f"unix:{path}") as (d,):
                assert d.local_target == f"unix:{path}"
                assert stat.S_IMODE(folder.stat().st_mode) == 0o700
                for sock in (path, Path(f"{path}.session")):
                    st = os.lstat(sock)
                    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, sock
                async with Client(d.local_target) as c:
                    assert c.session
                    await c.send(key(0, 0, "x"), np.ones(2))
                    assert list(await c.recv(key(0, 0, "x"), timeout=10)) == [1, 1]
            assert not path.exists() and not Path(f"{path}.session").exists()
        run(main())
    finally:
        os.umask(old_umask)
        shutil.rmtree(base, ignore_errors=True)


# -- 4. the default local address -------------------------------------------------------------------------


@pytest.mark.parametrize("env,expected", [
    ({"RENDEZVOUS_LOCAL_ADDRESS": "unix:/x/d.sock", "XDG_RUNTIME_DIR": "/run/user/7"}, "unix:/x/d.sock"),
    ({"RENDEZVOUS_LOCAL_ADDRESS": "127.0.0.1:7070"}, "127.0.0.1:7070"),
    ({"XDG_RUNTIME_DIR": "/run/user/7"}, "unix:/run/user/7/rendezvous/rendezvousd.sock"),
    ({"RENDEZVOUS_LOCAL_ADDRESS": "", "XDG_RUNTIME_DIR": "/run/user/7"},
     "unix:/run/user/7/rendezvous/rendezvousd.sock"),
    ({}, "unix:/run/rendezvous/rendezvousd.sock"),
    ({"XDG_RUNTIME_DIR": ""}, "unix:/run/rendezvous/rendezvousd.sock"),
], ids=["variable-wins", "variable-tcp", "xdg", "empty-variable", "nothing", "empty-xdg"])
def test_the_clients_default_address(env, expected):
    """``$RENDEZVOUS_LOCAL_ADDRESS``, else ``$XDG_RUNTIME_DIR/rendezvous/rendezvousd.sock``,
    else ``/run/rendezvous/rendezvousd.sock`` (an empty variable counts as unset).

    Checked to fail: with ``default_address`` ignoring the variable, and with it
    ignoring ``XDG_RUNTIME_DIR``."""
    assert local_address.default_address(env) == expected


@pytest.mark.parametrize("env,expected", [
    ({"XDG_RUNTIME_DIR": "/run/user/7"}, "unix:/run/user/7/rendezvous/rendezvousd.sock"),
    ({}, "unix:/run/rendezvous/rendezvousd.sock"),
    # the daemon takes RENDEZVOUS_LOCAL_ADDRESS through its config (local_address), so
    # its default is what it falls back to: the variable is not read twice
    ({"RENDEZVOUS_LOCAL_ADDRESS": "unix:/x/d.sock", "XDG_RUNTIME_DIR": "/run/user/7"},
     "unix:/run/user/7/rendezvous/rendezvousd.sock"),
], ids=["xdg", "nothing", "variable-is-config"])
def test_the_daemons_default_local_address(env, expected):
    """The daemon's fallback is the client's default without the variable.

    Checked to fail: with ``default_daemon_address`` returning ``/run/...`` whatever
    ``XDG_RUNTIME_DIR`` says."""
    assert local_address.default_daemon_address(env) == expected


def test_a_daemon_without_local_address_listens_where_a_default_client_looks(monkeypatch):
    """No ``local_address``: the daemon listens on ``$XDG_RUNTIME_DIR/rendezvous/
    rendezvousd.sock`` (folder 0700, created), and ``Client()`` with no address finds
    it; with ``RENDEZVOUS_LOCAL_ADDRESS`` set, daemon (through its config) and client
    both follow the variable instead.

    Checked to fail: with ``Daemon`` reading ``default_daemon_address`` that ignores
    ``XDG_RUNTIME_DIR`` (it tries /run/rendezvous, not ours), and with
    ``local.address.default_address`` ignoring the variable (Client() finds no daemon)."""
    xdg = Path(tempfile.mkdtemp(prefix="rdv", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    monkeypatch.delenv("RENDEZVOUS_LOCAL_ADDRESS", raising=False)
    expected = xdg / "rendezvous" / "rendezvousd.sock"
    try:
        async def main():
            async with daemons(xdg, local_address="") as (d,):
                assert d.local_target == f"unix:{expected}"
                assert stat.S_ISSOCK(os.lstat(expected).st_mode)
                assert stat.S_IMODE((xdg / "rendezvous").stat().st_mode) == 0o700
                async with Client(connect_timeout=10) as c:
                    assert c.address == f"unix:{expected}"
                    await c.send(key(0, 0, "x"), np.arange(3))
                    assert list(await c.recv(key(0, 0, "x"), timeout=10)) == [0, 1, 2]
            assert not expected.exists()
            # the variable wins, for the daemon (its config) and the client
            other = xdg / "other.sock"
            monkeypatch.setenv("RENDEZVOUS_LOCAL_ADDRESS", f"unix:{other}")
            base = {"cluster": json.dumps({"node": ["127.0.0.1:0"]}), "job_name": "node", "grace": 0.5,
                    "stall_warning": 0.0}
            d = Daemon(Config.load(base, env={"RENDEZVOUS_LOCAL_ADDRESS": f"unix:{other}"}))
            await d.start()
            try:
                assert d.local_target == f"unix:{other}" and not expected.exists()
                async with Client(connect_timeout=10) as c:
                    await c.send(key(0, 0, "y"), np.arange(2))
                    assert list(await c.recv(key(0, 0, "y"), timeout=10)) == [0, 1]
            finally:
                await d.stop(0.5)
        run(main())
    finally:
        shutil.rmtree(xdg, ignore_errors=True)


def test_rendezvousd_without_local_listens_under_xdg_runtime_dir(procs):
    """The command with ``XDG_RUNTIME_DIR`` set and no ``--local``: its ready line
    names ``$XDG_RUNTIME_DIR/rendezvous/rendezvousd.sock``, the folder it created is
    0700 and the socket 0600; SIGTERM exits 0 and removes the socket.

    Checked to fail (the same patches through sitecustomize in the child): the
    daemon's ``os.chmod`` a no-op, and the default ignoring ``XDG_RUNTIME_DIR``."""
    xdg = Path(tempfile.mkdtemp(prefix="rdv", dir="/tmp"))
    try:
        cluster = json.dumps({"node": ["127.0.0.1:0"]})
        d = Proc([RENDEZVOUSD, "--cluster", cluster, "--job-name", "node", "--grace", "0.3"],
                 env={"XDG_RUNTIME_DIR": str(xdg), "RENDEZVOUS_LOCAL_ADDRESS": "", "RENDEZVOUS_CONFIG": ""})
        procs.append(d)
        m = READY.match(d.line("rendezvousd: "))
        assert m, "ready line"
        sock = xdg / "rendezvous" / "rendezvousd.sock"
        assert m.group(3) == f"unix:{sock}"
        assert stat.S_IMODE((xdg / "rendezvous").stat().st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(sock).st_mode) == 0o600
        d.p.send_signal(signal.SIGTERM)
        assert d.p.wait(30) == 0, "".join(d.err)
        assert not sock.exists()
    finally:
        shutil.rmtree(xdg, ignore_errors=True)


# -- 5. the token file ---------------------------------------------------------------------------------


def test_token_file_wins_over_token(sockdir, tmp_path):
    """Both set: the file's token (its trailing newline stripped) is the one
    checked, and the one daemons send each other (their plain tokens differ, so
    a daemon sending its plain token would be refused); the plain token is refused.

    Checked to fail: with ``auth.load_token`` preferring ``token`` (the peers'
    recv and the file token's call fail UNAUTHENTICATED)."""
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file\n")

    async def main():
        async with daemons(sockdir, 2, token_file=str(token_file),
                           per=[{"token": "plain-0"}, {"token": "plain-1"}]) as (d0, d1), \
                Client(d0.local_target) as a, Client(d1.local_target) as b:
            await a.send(key(0, 1, "t"), np.arange(3), step_id=1)
            await a.send(key(0, 1, "t"), np.arange(3) * 2, step_id=1)
            assert list(await b.recv(key(0, 1, "t"), step_id=1, timeout=15)) == [0, 1, 2]  # peers use the file's
            request = pb.RecvTensorRequest(step_id=1, rendezvous_key=key(0, 1, "t")).SerializeToString()
            async with grpc.aio.insecure_channel(d0.target) as ch:
                call = ch.unary_unary("/rendezvous.v1.Rendezvous/RecvTensor")
                for token in ("plain-0", "plain-1"):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call(request, timeout=10, metadata=(("authorization", f"Bearer {token}"),))
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, token
                raw = await call(request, timeout=10, metadata=(("authorization", "Bearer from-the-file"),))
            reply = pb.RecvTensorResponse.FromString(raw)
            assert np.frombuffer(reply.tensor.tensor_content, np.int64).tolist() == [0, 2, 4]
            assert not d0.server.pending()
    run(main())


@pytest.mark.parametrize("content", ["", " \n\n"], ids=["empty", "blank"])
def test_an_empty_token_file_is_refused_at_start(sockdir, tmp_path, content):
    """An empty (or blank) token file is an error naming the file, even with a
    plain ``token`` set: never a daemon without the intended token.

    Checked to fail: with ``auth.read_token`` returning ``token`` for an empty file
    (the daemon starts)."""
    token_file = tmp_path / "token"
    token_file.write_text(content)
    with pytest.raises(errors.InvalidArgument, match="is empty") as info:
        Daemon(config(sockdir, token="plain", token_file=str(token_file)))
    assert str(token_file) in info.value.message
    assert not list(sockdir.iterdir())


def test_rendezvousd_with_an_empty_token_file_exits_with_a_clear_error(sockdir, tmp_path):
    """The command: exit status 1, one line ``rendezvousd: INVALID_ARGUMENT: token_file
    '...' is empty`` on stderr, no traceback, no ready line, no socket.

    Checked to fail: with ``auth.read_token`` accepting an empty file (the daemon
    serves; killed at the timeout)."""
    token_file = tmp_path / "token"
    token_file.write_text("")
    cluster = json.dumps({"node": ["127.0.0.1:0"]})
    try:
        out = subprocess.run([RENDEZVOUSD, "--cluster", cluster, "--job-name", "node",
                              "--local", f"unix:{sockdir}/d.sock"], capture_output=True, text=True, timeout=30,
                             env=_env(RENDEZVOUS_TOKEN="plain", RENDEZVOUS_TOKEN_FILE=str(token_file)),
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"rendezvousd started with an empty token file: {exc.stdout!r}") from None
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    assert f"rendezvousd: INVALID_ARGUMENT: token_file '{token_file}' is empty" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "serving on" not in out.stdout
    assert not (sockdir / "d.sock").exists()


def test_print_config_masks_the_token():
    """``rendezvousd --print-config`` with ``RENDEZVOUS_TOKEN=s3cret``: the token line
    says ``"***"`` and where it came from, and ``s3cret`` appears nowhere; a token
    file's content is not shown either (its path is).

    Checked to fail: with ``render_config`` ignoring the secret flag (s3cret shown)."""
    out = subprocess.run([RENDEZVOUSD, "--print-config"], capture_output=True, text=True, timeout=30,
                         env=_env(RENDEZVOUS_TOKEN="s3cret"), stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    assert "s3cret" not in out.stdout + out.stderr
    lines = {line.split(" = ")[0]: line for line in out.stdout.splitlines() if " = " in line}
    assert lines["token"] == 'token = "***"  # env RENDEZVOUS_TOKEN'


def test_print_config_does_not_show_a_token_files_content(tmp_path):
    """The file's path is shown, never the token in it.

    Checked to fail: with ``render_config`` patched to append the token it reads
    with ``load_token(config)``."""
    token_file = tmp_path / "token"
    token_file.write_text("filesecret\n")
    out = subprocess.run([RENDEZVOUSD, "--print-config"], capture_output=True, text=True, timeout=30,
                         env=_env(RENDEZVOUS_TOKEN_FILE=str(token_file)), stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    assert "filesecret" not in out.stdout + out.stderr
    assert f'token_file = "{token_file}"  # env RENDEZVOUS_TOKEN_FILE' in out.stdout


# -- 6. rendezvous get --------------------------------------------------------------------------------------


def _get(target: str, k: str, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rendezvous", "get", k, "--from", target, "--step", "1",
                           "--timeout", "15", *flags], capture_output=True, text=True, timeout=60,
                          env=_env(**(env or {})), stdin=subprocess.DEVNULL)


def test_get_saves_with_numpy_and_reads_the_token_file(sockdir, tmp_path):
    """Against a daemon with a token: ``--token-file`` gets the tensor and ``--save``
    writes it so that ``np.load`` gives it back (dtype and shape too), with no
    warning; a wrong token file is UNAUTHENTICATED (exit 1, nothing saved).

    Checked to fail: with ``np.save`` in the command made a no-op (no file), and
    with ``auth.read_token`` ignoring the file (UNAUTHENTICATED)."""
    good, wrong = tmp_path / "token", tmp_path / "wrong"
    good.write_text("s3cret\n")
    wrong.write_text("nope\n")
    saved, not_saved = tmp_path / "t.npy", tmp_path / "u.npy"
    value = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7

    async def main():
        async with daemons(sockdir, token="s3cret") as (d,), Client(d.local_target) as a:
            await a.send(key(0, 0, "t"), value, step_id=1)
            out = await asyncio.to_thread(_get, d.target, key(0, 0, "t"), "--token-file", str(wrong),
                                          "--save", str(not_saved))
            assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr, out
            assert not not_saved.exists()
            out = await asyncio.to_thread(_get, d.target, key(0, 0, "t"), "--token-file", str(good),
                                          "--save", str(saved))
            assert out.returncode == 0, out.stderr
            assert "dtype=float32 shape=(2, 3, 4)" in out.stdout
            assert "warning" not in out.stderr
            assert not d.server.pending()
    run(main(), timeout=80)
    back = np.load(saved)
    assert back.dtype == np.float32 and back.shape == (2, 3, 4)
    np.testing.assert_array_equal(back, value)


def test_get_with_token_on_the_command_line_warns(sockdir):
    """``get --token`` works and says on stderr that the token shows in the process
    list; the same token from ``RENDEZVOUS_TOKEN`` works without the warning.

    Checked to fail: with ``cli._get`` run with ``sys.argv`` cut to the program
    name (so it sees no ``--token`` and prints no warning)."""
    async def main():
        async with daemons(sockdir, token="s3cret") as (d,), Client(d.local_target) as a:
            await a.send(key(0, 0, "t"), np.arange(3), step_id=1)
            await a.send(key(0, 0, "t"), np.arange(3), step_id=1)
            out = await asyncio.to_thread(_get, d.target, key(0, 0, "t"), "--token", "s3cret")
            assert out.returncode == 0, out.stderr
            assert "deprecated" in out.stderr and "process list" in out.stderr, out.stderr
            out = await asyncio.to_thread(_get, d.target, key(0, 0, "t"), env={"RENDEZVOUS_TOKEN": "s3cret"})
            assert out.returncode == 0, out.stderr
            assert "warning" not in out.stderr
    run(main(), timeout=80)


def test_get_called_through_main_with_token_warns(sockdir, capsys):
    """``rendezvous.cli.main([... "--token", T])`` is the same command as the
    ``rendezvous`` executable: it prints the same warning. (It once read the
    process's own sys.argv instead of the argv given to main, and did not.)"""
    from rendezvous import cli

    async def main():
        async with daemons(sockdir, token="s3cret") as (d,), Client(d.local_target) as a:
            await a.send(key(0, 0, "t"), np.arange(3), step_id=1)
            rc = await asyncio.to_thread(cli.main, ["get", key(0, 0, "t"), "--from", d.target, "--step", "1",
                                                    "--timeout", "15", "--token", "s3cret"])
            assert rc == 0
    run(main(), timeout=60)
    assert "process list" in capsys.readouterr().err


# -- 7. one warning for a GPU key without a GPU ------------------------------------------------------------


def _gpu_key(src: int, dst: int, name: str) -> str:
    return (f"/job:worker/replica:0/task:{src}/device:CPU:0;0000000000000000;"
            f"/job:worker/replica:0/task:{dst}/device:GPU:0;{name};0:0")


def test_a_gpu_key_without_a_gpu_gives_numpy_with_one_warning(caplog):
    """A server with no usable GPU backend (``Devices([])``, on any machine)
    receives tensors whose keys name ``/device:GPU:0``: numpy arrays each time (two
    from a peer, one from its own table), and the "no GPU backend is usable"
    warning exactly once.

    Checked to fail: with ``Devices._warn_once`` logging every time (3 warnings)
    and never (0)."""
    caplog.set_level(logging.WARNING, logger="rendezvous.devices")

    async def main():
        spec = {"worker": ["127.0.0.1:0", "127.0.0.1:0"]}
        servers = [rank_aio.Server(spec, "worker", i, devices=Devices([])) for i in range(2)]
        try:
            for s in servers:
                await s.start()
            for s in servers:
                s.update_cluster({"worker": [x.target for x in servers]})
            a, b = servers
            for i, name in enumerate(("first", "second")):
                b.send(_gpu_key(1, 0, name), np.arange(5, dtype=np.float32) + i, step_id=1)
            a.send(_gpu_key(0, 0, "own"), np.arange(3, dtype=np.int16), step_id=1)
            for i, name in enumerate(("first", "second")):
                got = await a.recv(_gpu_key(1, 0, name), step_id=1, timeout=15)
                assert type(got) is np.ndarray and got.tolist() == (np.arange(5) + i).tolist()
            got = await a.recv(_gpu_key(0, 0, "own"), step_id=1, timeout=15)
            assert type(got) is np.ndarray and got.tolist() == [0, 1, 2]
        finally:
            for s in servers:
                await s.stop(0)

    run(main())
    warnings = [r for r in caplog.records
                if r.name == "rendezvous.devices" and "no GPU backend is usable" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert warnings[0].levelno == logging.WARNING and "GPU:0" in warnings[0].getMessage()


# -- 8. metrics ------------------------------------------------------------------------------------------------


def test_metrics_count_local_recvs_by_path_and_failed_calls_by_code(sockdir):
    """``rendezvous_local_ops_total`` / ``_local_bytes_total`` count each local send
    and recv once by op and path (inline and shm), a failed recv counts under
    ``rendezvous_errors_total`` by its code and not as an op, and so does a
    garbage request (INVALID_ARGUMENT).

    Checked to fail: with ``DaemonMetrics.local_op`` counting only sends (no recv
    ops) and with ``LocalServicer._error`` not reporting to the metrics."""
    async def main():
        async with daemons(sockdir, metrics_port=0) as (d,), Client(d.local_target) as a, \
                Client(d.local_target) as b:
            small = np.arange(10, dtype=np.int32)  # 40 bytes: inline
            big = np.ones(1 << 17, np.float32)  # 512 KiB: shared memory
            await a.send(key(0, 0, "small"), small, step_id=1)
            await a.send(key(0, 0, "big"), big, step_id=1)
            assert list(await b.recv(key(0, 0, "small"), step_id=1, timeout=10)) == list(range(10))
            got = await b.recv(key(0, 0, "big"), step_id=1, timeout=10)
            assert got.nbytes == 1 << 19
            del got
            assert b.stats() == {"recv_inline": 1, "recv_shm": 1, "local": 2}
            with pytest.raises(errors.DeadlineExceeded):
                await b.recv(key(0, 0, "never"), step_id=1, timeout=0.2)
            async with grpc.aio.insecure_channel(d.local_target) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await ch.unary_unary(f"/{LOCAL_SERVICE}/Recv")(b"\xff\xff\xff", timeout=10)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            m = await scrape(d.metrics_url)
            for op in ("send", "recv"):
                assert _metric(m, "rendezvous_local_ops_total", op=op, path="inline") == 1, op
                assert _metric(m, "rendezvous_local_ops_total", op=op, path="shm") == 1, op
                assert _metric(m, "rendezvous_local_bytes_total", op=op, path="inline") == 40, op
                assert _metric(m, "rendezvous_local_bytes_total", op=op, path="shm") == 1 << 19, op
            assert _metric(m, "rendezvous_errors_total", code="DEADLINE_EXCEEDED") == 1
            assert _metric(m, "rendezvous_errors_total", code="INVALID_ARGUMENT") == 1
    run(main())
