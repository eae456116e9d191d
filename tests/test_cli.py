"""The `rendezvous` command: serve, get, stats, pending, health, --help,
--version, -v; and the wheel's layout."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import grpc
import numpy as np
import pytest

import rendezvous
from rendezvous import cli

from conftest import run
from test_admin import serving_rank, stop_rank

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parent.parent
KEY = ("/job:worker/replica:0/task:1/device:CPU:0;0000000000000000;"
       "/job:worker/replica:0/task:0/device:CPU:0;weights;0:0")


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without any RENDEZVOUS_ setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUS_")}
    env.update(extra)
    return env


def _cli(*args: str, timeout: float = 30, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rendezvous", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)


async def _acli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """:func:`_cli` from a coroutine (the loop keeps serving meanwhile)."""
    return await asyncio.to_thread(_cli, *args, env=env)


def _serve(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`rendezvous serve` of a one-task job on an OS-chosen port; (process, address) once it serves."""
    proc = subprocess.Popen([sys.executable, "-m", "rendezvous", "serve", "--cluster",
                             json.dumps({"worker": ["127.0.0.1:0"]}), "--job-name", "worker", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            stdin=subprocess.DEVNULL)
    line = proc.stdout.readline()
    if "serving on" not in line:
        proc.kill()
        raise AssertionError(line + proc.stderr.read())
    return proc, line.split("serving on ")[1].split()[0]


def _end(proc: subprocess.Popen) -> str:
    """SIGTERM, a clean exit, and its stderr."""
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        return err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_help_reads_well():
    out = _cli("--help")
    assert out.returncode == 0
    for word in ("serve", "get", "examples:"):
        assert word in out.stdout
    get_help = _cli("get", "--help").stdout
    assert "--from HOST:PORT" in get_help and "--text" in get_help


def test_get_fetches_from_a_rank_server():
    spec = {"worker": ["127.0.0.1:0", "127.0.0.1:0"]}
    with rendezvous.Server(spec, "worker", 1) as server:
        value = np.arange(6, dtype=np.float32).reshape(2, 3)
        server.send(KEY, value, step_id=4)
        server.send(KEY, value * 2, step_id=4)
        out = _cli("get", KEY, "--from", server.target, "--step", "4")
        assert out.returncode == 0, out.stderr
        assert "dtype=float32 shape=(2, 3)" in out.stdout
        text = _cli("get", KEY, "--from", server.target, "--step", "4", "--text")
        assert text.returncode == 0, text.stderr
        assert "dtype: DT_FLOAT" in text.stdout and "size: 3" in text.stdout
        assert "tensor_content" in text.stdout
        # nothing left: a short deadline answers DEADLINE_EXCEEDED, exit 1, naming the key and the server
        late = _cli("get", KEY, "--from", server.target, "--step", "4", "--timeout", "0.3")
        assert late.returncode == 1 and "DEADLINE_EXCEEDED" in late.stderr
        assert f"no tensor for {KEY} (step 4) from {server.target} within 0.3 s" in late.stderr, late.stderr
        bad = _cli("get", "not-a-key", "--from", server.target)
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "'not-a-key'" in bad.stderr
        # a key another task produces: the server's refusal, with the key
        theirs = KEY.replace("task:1", "task:0", 1)
        other = _cli("get", theirs, "--from", server.target, "--step", "4", "--timeout", "5")
        assert other.returncode == 1 and theirs in other.stderr and server.target in other.stderr, other.stderr


def test_serve_runs_until_sigterm(tmp_path):
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"worker": ["127.0.0.1:0"]}))
    proc = subprocess.Popen([sys.executable, "-m", "rendezvous", "serve", "--cluster", str(cluster),
                             "--job-name", "worker", "--task-index", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "serving on 127.0.0.1:" in line, line + proc.stderr.read()
        address = line.split("serving on ")[1].split()[0]
        # it answers: an empty table and a short deadline give DEADLINE_EXCEEDED
        key = KEY.replace("task:1", "task:0", 1)
        out = _cli("get", key, "--from", address, "--timeout", "0.3")
        assert "DEADLINE_EXCEEDED" in out.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_reports_bad_cluster():
    out = _cli("serve", "--cluster", '{"worker": ["nonsense"]}', "--job-name", "worker")
    assert out.returncode != 0 and "host:port" in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_wheel_holds_every_subpackage(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, timeout=170,
                   env={**os.environ, "PIP_NO_INDEX": "1"})
    wheel = next(tmp_path.glob("rendezvous-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {"rendezvous/py.typed"}
    for source in (ROOT / "rendezvous").rglob("*.py"):
        expected.add(source.relative_to(ROOT).as_posix())
    missing = sorted(expected - names)
    assert not missing, f"missing from {wheel.name}: {missing}"


def test_serve_takes_its_settings_from_the_environment(tmp_path):
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"ps": ["127.0.0.1:0"], "worker": ["127.0.0.1:0"]}))
    env = {**os.environ, "RENDEZVOUS_CLUSTER": str(cluster), "RENDEZVOUS_JOB_NAME": "worker",
           "RENDEZVOUS_TASK_INDEX": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "rendezvous", "serve"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "task /job:worker/replica:0/task:0 serving on 127.0.0.1:" in line, line + proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    missing = _cli("serve")
    assert missing.returncode == 2 and "--cluster and --job-name" in missing.stderr


# -- --version, -v anywhere ------------------------------------------------------------------------


def test_version_of_both_commands():
    version = importlib.metadata.version("rendezvous")
    out = _cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"rendezvous {version}"
    daemon = subprocess.run([str(Path(sys.executable).parent / "rendezvousd"), "--version"], capture_output=True,
                            text=True, timeout=30)
    assert daemon.returncode == 0 and daemon.stdout.strip() == f"rendezvousd {version}"


def test_verbose_is_taken_before_and_after_the_subcommand_and_counts_add():
    for argv, count in ((["get", KEY, "--from", "h:1"], 0), (["-v", "get", KEY, "--from", "h:1"], 1),
                        (["get", KEY, "--from", "h:1", "-v"], 1), (["-v", "stats", "-v"], 2),
                        (["serve", "-vv"], 2), (["health", "--verbose"], 1)):
        assert cli.parse(argv).verbose == count, argv


def test_verbose_after_serve_acts():
    """`serve -v` logs at INFO although RENDEZVOUS_LOG_LEVEL says WARNING: the
    server's own "serving on" line appears on stderr (and without -v it does not)."""
    quiet, address = _serve(env=_env(RENDEZVOUS_LOG_LEVEL="WARNING"))
    assert "serving on" not in _end(quiet)
    loud, address = _serve("-v", env=_env(RENDEZVOUS_LOG_LEVEL="WARNING"))
    assert f"INFO rendezvous: task /job:worker/replica:0/task:0 serving on {address}" in _end(loud)


# -- serve: flags only where they act ------------------------------------------------------------------


@pytest.mark.parametrize("flag,value", [("--local", "unix:/tmp/x.sock"), ("--metrics-port", "0"),
                                        ("--metrics-host", "127.0.0.1")])
def test_serve_refuses_daemon_flags_without_daemon(flag, value):
    out = _cli("serve", "--cluster", '{"worker": ["127.0.0.1:0"]}', "--job-name", "worker", flag, value)
    assert out.returncode == 2, out
    assert f"{flag} acts only in the daemon: add --daemon" in out.stderr and "Traceback" not in out.stderr


def test_serve_takes_daemon_settings_from_the_environment_without_complaint():
    """Only flags are refused: a RENDEZVOUS_METRICS_PORT set for the whole machine
    does not stop a plain rank server."""
    proc, _ = _serve(env=_env(RENDEZVOUS_METRICS_PORT="0", RENDEZVOUS_STALL_WARNING="1"))
    _end(proc)


def test_serve_logs_json():
    """--log-format json acts for a plain rank server too: every stderr line is
    one JSON object with time, level, logger, message."""
    proc, address = _serve("--log-format", "json", "-v", env=_env())
    lines = [json.loads(line) for line in _end(proc).splitlines()]
    serving = next(rec for rec in lines if "serving on" in rec["message"])
    assert serving["level"] == "INFO" and serving["logger"] == "rendezvous" and address in serving["message"]
    assert serving["time"].endswith("Z") and "T" in serving["time"]


def test_serve_applies_the_token_and_get_names_the_key_when_refused():
    """RENDEZVOUS_TOKEN acts for `rendezvous serve` as for the daemon: a get without
    it is UNAUTHENTICATED (naming the key), with it the call goes through."""
    proc, address = _serve(env=_env(RENDEZVOUS_TOKEN="s3cret"))
    try:
        key = KEY.replace("task:1", "task:0", 1)
        refused = _cli("get", key, "--from", address, "--timeout", "5", env=_env())
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr and key in refused.stderr
        through = _cli("get", key, "--from", address, "--timeout", "0.3", env=_env(RENDEZVOUS_TOKEN="s3cret"))
        assert through.returncode == 1 and "DEADLINE_EXCEEDED" in through.stderr  # authenticated; nothing sent
    finally:
        _end(proc)


# -- stats, pending, health ---------------------------------------------------------------------------


WORKER_KEY = ("/job:worker/replica:0/task:0/device:CPU:0;0000000000000000;"
              "/job:worker/replica:0/task:1/device:CPU:0;{};0:0")


def test_stats_pending_and_health_of_a_rank_server():
    async def main():
        server = await serving_rank({"worker": ["127.0.0.1:0", "127.0.0.1:0"]})
        try:
            for _ in range(2):
                server.send(WORKER_KEY.format("grad"), np.ones(8, np.float32), step_id=4)
            stats = await _acli("stats", "--from", server.target)
            assert stats.returncode == 0, stats.stderr
            lines = stats.stdout.splitlines()
            assert lines[0] == f"/job:worker/replica:0/task:0 at {server.target} (protocol grpc)"
            assert lines[1].split()[:3] == ["path", "transfers", "bytes"]
            assert [line.split()[0] for line in lines[2:5]] == ["local", "grpc", "mpi"]
            assert any(line.startswith("table: ") and "tensors 2" in line for line in lines), stats.stdout
            data = json.loads((await _acli("stats", "--from", server.target, "--json")).stdout)
            assert data["table"]["tensors"] == 2 and data["paths"]["grpc"]["served"] == 0
            assert data["task"] == "/job:worker/replica:0/task:0" and data["daemon"] == {}

            pending = await _acli("pending", "--from", server.target)
            assert pending.returncode == 0, pending.stderr
            (line,) = pending.stdout.splitlines()
            assert line.split()[:5] == ["tensor", "step", "4", "count", "2"]
            assert WORKER_KEY.format("grad") in line and "(producer /job:worker/replica:0/task:0)" in line
            data = json.loads((await _acli("pending", "--from", server.target, "--json")).stdout)
            assert [(e["kind"], e["step_id"], e["key"], e["count"]) for e in data["entries"]] == \
                [("tensor", 4, WORKER_KEY.format("grad"), 2)] and data["omitted"] == 0

            health = await _acli("health", "--from", server.target)
            assert (health.returncode, health.stdout.strip()) == (0, "SERVING")
            data = json.loads((await _acli("health", "--from", server.target, "--json",
                                           "--service", "rendezvous.v1.Rendezvous")).stdout)
            assert data == {"address": server.target, "service": "rendezvous.v1.Rendezvous", "status": "SERVING"}
            unknown = await _acli("health", "--from", server.target, "--service", "no.Such")
            assert unknown.returncode == 2 and "knows no service 'no.Such'" in unknown.stderr
            await server.admin.set_serving(False)  # a drain begins
            health = await _acli("health", "--from", server.target)
            assert (health.returncode, health.stdout.strip()) == (1, "NOT_SERVING")
        finally:
            await stop_rank(server)
        empty = await serving_rank({"worker": ["127.0.0.1:0"]})
        try:
            out = await _acli("pending", "--from", empty.target)
            assert out.stdout.strip() == f"nothing pending at {empty.target}"
        finally:
            await stop_rank(empty)
    run(main())


def test_pending_says_how_many_it_left_out():
    async def main():
        server = await serving_rank({"worker": ["127.0.0.1:0", "127.0.0.1:0"]})
        try:
            name = "n" * 4000  # 300 entries of about 4 KB: more than one 1 MiB answer holds
            for step in range(300):
                server.send(WORKER_KEY.format(name), np.ones(1), step_id=step)
            out = await _acli("pending", "--from", server.target)
            assert out.returncode == 0, out.stderr
            lines = out.stdout.splitlines()
            shown = len(lines) - 1
            assert 0 < shown < 300 and lines[-1] == f"{300 - shown} more not shown"
        finally:
            await stop_rank(server)
    run(main())


def test_admin_commands_need_the_token_of_a_secured_server():
    async def main():
        from rendezvous.config import Config
        from rendezvous.daemon.setup import grpc_security

        setup, _ = grpc_security(Config.load({"token": "s3cret"}, env={}))
        server = await serving_rank({"worker": ["127.0.0.1:0"]}, grpc_setup=setup)
        try:
            refused = await _acli("stats", "--from", server.target, env=_env())
            assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
            assert "--token-file" in refused.stderr and "Traceback" not in refused.stderr
            with tempfile.NamedTemporaryFile("w", suffix=".token") as f:
                f.write("s3cret\n")
                f.flush()
                ok = await _acli("pending", "--from", server.target, "--token-file", f.name, env=_env())
                assert ok.returncode == 0 and "nothing pending" in ok.stdout, ok.stderr
            ok = await _acli("stats", "--from", server.target, env=_env(RENDEZVOUS_TOKEN="s3cret"))
            assert ok.returncode == 0, ok.stderr
            probe = await _acli("health", "--from", server.target, env=_env())  # health needs no token
            assert probe.returncode == 0 and probe.stdout.strip() == "SERVING"
        finally:
            await stop_rank(server)
    run(main())


def test_admin_commands_report_what_they_cannot_reach():
    """A missing socket, a closed port, a server that never answers and a gRPC
    server without our services: one line naming the address, no traceback,
    exit 1 (health: 2, printing "unreachable")."""
    with tempfile.TemporaryDirectory(prefix="rdv", dir="/tmp") as d:
        missing = f"unix:{d}/none.sock"
        for command in ("stats", "pending", "health"):
            out = _cli(command, "--from", missing, env=_env())
            assert out.returncode == (2 if command == "health" else 1), out
            assert f"cannot reach {missing}: no socket at {d}/none.sock" in out.stderr
            assert "rendezvousd" in out.stderr and "Traceback" not in out.stderr
        default = _cli("health", env=_env(RENDEZVOUS_LOCAL_ADDRESS=missing))  # no --from: the daemon's address
        assert default.returncode == 2 and default.stdout.strip() == "unreachable" and missing in default.stderr
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    out = _cli("health", "--from", f"127.0.0.1:{port}", "--json", env=_env())
    assert out.returncode == 2 and json.loads(out.stdout)["status"] == "UNREACHABLE"
    out = _cli("stats", "--from", f"127.0.0.1:{port}", env=_env())
    assert out.returncode == 1 and f"cannot reach 127.0.0.1:{port}" in out.stderr and "Traceback" not in out.stderr
    with socket.socket() as silent:  # accepts connections (the backlog), never speaks
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        out = _cli("pending", "--from", address, "--timeout", "0.5", env=_env())
        assert out.returncode == 1 and f"cannot reach {address}: no answer within 0.5 s" in out.stderr, out.stderr

    async def other_grpc_server():
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await _acli("stats", "--from", f"127.0.0.1:{port}", env=_env()), port
        finally:
            await server.stop(0)

    out, port = run(other_grpc_server())
    assert out.returncode == 1 and f"127.0.0.1:{port} does not serve rendezvous.v1.Admin" in out.stderr


def test_health_and_stats_of_rendezvous_serve():
    proc, address = _serve(env=_env())
    try:
        assert _cli("health", "--from", address, env=_env()).stdout.strip() == "SERVING"
        stats = json.loads(_cli("stats", "--from", address, "--json", env=_env()).stdout)
        assert stats["task"] == "/job:worker/replica:0/task:0"
    finally:
        _end(proc)
