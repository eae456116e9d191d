"""rendezvousd as a process: SIGTERM drains with a recv in flight and exits 0,
the socket goes, a restart on the same socket and port works at once, and a
second signal exits at once."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

from rendezvous.client import Client

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]
HERE = Path(__file__).resolve().parent
RENDEZVOUSD = str(Path(sys.executable).parent / "rendezvousd")
READY = re.compile(r"rendezvousd: (\S+) serving on (\S+) .*; local (\S+); .*pid (\d+)")


def key(name: str, src: int = 0) -> str:
    return f"/job:node/replica:0/task:{src}/device:CPU:0;0000000000000000;/job:node/replica:0/task:0/device:CPU:1;{name};0:0"


class Proc:
    """A child process whose stdout and stderr lines are collected as they come."""

    def __init__(self, argv: list[str], env: dict | None = None) -> None:
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                  text=True, env={**os.environ, **(env or {})}, start_new_session=True)
        self.out: queue.Queue[str] = queue.Queue()
        self.err: list[str] = []
        self._err_new = threading.Condition()
        threading.Thread(target=self._pump, args=(self.p.stdout, self.out.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.p.stderr, self._add_err), daemon=True).start()

    @staticmethod
    def _pump(stream, put) -> None:
        for line in stream:
            put(line)

    def _add_err(self, line: str) -> None:
        with self._err_new:
            self.err.append(line)
            self._err_new.notify_all()

    def line(self, prefix: str, timeout: float = 60) -> str:
        while True:
            try:
                line = self.out.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} line within {timeout}s; stderr:\n{''.join(self.err)[-3000:]}")
            if line.startswith(prefix):
                return line

    def wait_err(self, needle: str, timeout: float = 30) -> str:
        with self._err_new:
            ok = self._err_new.wait_for(lambda: any(needle in e for e in self.err), timeout)
        assert ok, f"no {needle!r} on stderr within {timeout}s:\n{''.join(self.err)[-3000:]}"
        return next(e for e in self.err if needle in e)

    def kill(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()


@pytest.fixture
def procs():
    started: list[Proc] = []
    yield started
    for p in started:
        p.kill()
    for p in started:
        assert p.p.poll() is not None


@pytest.fixture
def sockdir():
    with tempfile.TemporaryDirectory(prefix="rdv", dir="/tmp") as d:
        yield Path(d)


def start_daemon(procs, sockdir: Path, port: int = 0, *extra: str) -> tuple[Proc, str, str, int]:
    cluster = sockdir / "cluster.json"
    cluster.write_text(json.dumps({"node": [f"127.0.0.1:{port}"]}))
    d = Proc([RENDEZVOUSD, "--cluster", str(cluster), "--job-name", "node", "--local", f"unix:{sockdir}/d.sock",
              "--log-format", "json", *extra])
    procs.append(d)
    m = READY.match(d.line("rendezvousd: "))
    assert m, "ready line"
    return d, m.group(2), m.group(3), int(m.group(4))


def test_sigterm_drains_a_recv_in_flight_then_restart_works_at_once(procs, sockdir):
    daemon, target, local, pid = start_daemon(procs, sockdir, 0, "--grace", "0.3")
    assert daemon.p.pid == pid
    waiter = Proc([sys.executable, str(HERE / "daemon_clients.py"), "waiter", local, key("never")])
    procs.append(waiter)
    waiter.line("WAITING")
    with Client(local) as c:
        c.send(key("unconsumed"), np.ones(4), step_id=2)
        # the waiter's recv is in the table (a condition, checked until it holds)
        deadline = 200
        while not any(e.kind == "waiter" for e in c.pending()):
            deadline -= 1
            assert deadline, "the waiter's recv never reached the daemon"
            threading.Event().wait(0.05)
        daemon.p.send_signal(signal.SIGTERM)
        outcome = json.loads(waiter.line("RESULT ")[7:])
        assert outcome["error"] == "UNAVAILABLE", outcome
        assert waiter.p.wait(30) == 0
    assert daemon.p.wait(30) == 0, "".join(daemon.err)
    drained = json.loads(daemon.wait_err("never consumed"))
    assert drained["level"] == "WARNING" and "1 produced tensor(s) never consumed" in drained["message"]
    assert not (sockdir / "d.sock").exists()
    # restart at once on the same socket and the same port
    port = int(target.rsplit(":", 1)[1])
    again, target2, local2, _ = start_daemon(procs, sockdir, port, "--grace", "0.3")
    assert (target2, local2) == (target, local)
    with Client(local2) as c:
        c.send(key("hello"), np.arange(100000, dtype=np.int32), step_id=1)
        assert c.recv(key("hello"), step_id=1, timeout=10).sum() == sum(range(100000))
    again.p.send_signal(signal.SIGINT)
    assert again.p.wait(30) == 0


def test_a_second_signal_exits_at_once(procs, sockdir):
    daemon, _, local, _ = start_daemon(procs, sockdir, 0, "--grace", "60")
    with Client(local) as c:
        c.send(key("unconsumed"), np.ones(4), step_id=1)  # keeps the drain going for the whole grace
    daemon.p.send_signal(signal.SIGTERM)
    daemon.wait_err("draining (grace 60s)")
    daemon.p.send_signal(signal.SIGINT)
    assert daemon.p.wait(10) == 1  # long before the 60 s grace
    assert "second signal (SIGINT)" in "".join(daemon.err)
    assert not (sockdir / "d.sock").exists()


def test_a_killed_daemon_fails_waiting_clients_and_a_restart_takes_over(procs, sockdir):
    """SIGKILL: no drain, no cleanup. A client's recv that waited without a
    deadline fails with UNAVAILABLE at once (not a hang); the socket file left
    behind is replaced by the next daemon, which serves."""
    daemon, target, local, _ = start_daemon(procs, sockdir, 0)
    waiter = Proc([sys.executable, str(HERE / "daemon_clients.py"), "waiter", local, key("never")])
    procs.append(waiter)
    waiter.line("WAITING")
    with Client(local) as c:
        deadline = 200
        while not any(e.kind == "waiter" for e in c.pending()):
            deadline -= 1
            assert deadline, "the waiter's recv never reached the daemon"
            threading.Event().wait(0.05)
    daemon.p.send_signal(signal.SIGKILL)
    daemon.p.wait(30)
    outcome = json.loads(waiter.line("RESULT ")[7:])
    assert outcome["error"] == "UNAVAILABLE", outcome
    assert waiter.p.wait(30) == 0
    assert (sockdir / "d.sock").exists()  # a killed daemon leaves its socket file
    again, _, local2, _ = start_daemon(procs, sockdir, int(target.rsplit(":", 1)[1]))
    assert local2 == local
    with Client(local2) as c:
        c.send(key("after"), np.arange(1 << 17, dtype=np.int32), step_id=1)  # through shared memory
        assert c.recv(key("after"), step_id=1, timeout=10).sum() == sum(range(1 << 17))
    again.p.send_signal(signal.SIGTERM)
    assert again.p.wait(30) == 0


def _rendezvous(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rendezvous", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


def test_stats_pending_and_health_of_a_daemon_from_the_shell(procs, sockdir):
    """Against a running rendezvousd: with no --from the commands find the daemon
    where it listens (RENDEZVOUS_LOCAL_ADDRESS), over its local socket; with
    --from its rank port, the same answers; health turns NOT_SERVING (exit 1)
    once it drains, and unreachable (exit 2) once it is gone."""
    daemon, target, local, _ = start_daemon(procs, sockdir, 0, "--grace", "30")
    here = {"RENDEZVOUS_LOCAL_ADDRESS": local}
    with Client(local) as c:
        c.send(key("left"), np.ones(4), step_id=7)
        health = _rendezvous("health", env=here)
        assert (health.returncode, health.stdout.strip()) == (0, "SERVING"), health.stderr
        stats = _rendezvous("stats", env=here)
        assert stats.returncode == 0 and stats.stdout.startswith(f"/job:node/replica:0/task:0 at {local}")
        assert "daemon: " in stats.stdout and "sessions 1" in stats.stdout, stats.stdout
        for where in ((), ("--from", target)):
            data = json.loads(_rendezvous("stats", "--json", *where, env=here).stdout)
            assert data["table"]["tensors"] == 1 and data["daemon"]["sessions"] == 1, where
            pending = json.loads(_rendezvous("pending", "--json", *where, env=here).stdout)
            assert [(e["kind"], e["step_id"], e["key"]) for e in pending["entries"]] == \
                [("tensor", 7, key("left"))], where
        daemon.p.send_signal(signal.SIGTERM)  # the unconsumed tensor keeps it draining for its grace
        daemon.wait_err("draining")
        health = _rendezvous("health", "--from", target)
        assert (health.returncode, health.stdout.strip()) == (1, "NOT_SERVING")
    daemon.p.send_signal(signal.SIGINT)  # a second signal: gone at once
    daemon.p.wait(30)
    gone = _rendezvous("health", env=here)
    assert gone.returncode == 2 and gone.stdout.strip() == "unreachable" and local in gone.stderr


def test_a_client_without_a_daemon_fails_at_once_naming_the_socket(sockdir):
    """No socket file: Unavailable at once (not after connect_timeout), naming the
    path and how to start a daemon."""
    import time

    from rendezvous import errors

    started = time.monotonic()
    with pytest.raises(errors.Unavailable, match=f"{sockdir}/none.sock does not exist.*rendezvousd"):
        Client(f"unix:{sockdir}/none.sock", connect_timeout=30)
    assert time.monotonic() - started < 5
