"""The `rendezvous` command: serve, get, --help; and the wheel's layout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import rendezvous

ROOT = Path(__file__).resolve().parent.parent
KEY = ("/job:worker/replica:0/task:1/device:CPU:0;0000000000000001;"
       "/job:worker/replica:0/task:0/device:CPU:0;weights;0:0")


def _cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rendezvous", *args], capture_output=True, text=True,
                          timeout=timeout)


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
        # nothing left: a short deadline answers DEADLINE_EXCEEDED, exit 1
        late = _cli("get", KEY, "--from", server.target, "--step", "4", "--timeout", "0.3")
        assert late.returncode == 1 and "DEADLINE_EXCEEDED" in late.stderr
        bad = _cli("get", "not-a-key", "--from", server.target)
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr


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
