"""``rendezvousd [flags] -- COMMAND``: the daemon runs COMMAND once it serves,
with RENDEZVOUS_LOCAL_ADDRESS pointing at it and without the launcher's MPI
variables, and exits with COMMAND's status once COMMAND ends (after its drain);
a signal to the daemon is passed on; COMMAND dies with a killed daemon.
(Under mpiexec, as the deploy manifests run it: tests/test_deploy.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from proc_wait import wait_gone

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]
RENDEZVOUSD = str(Path(sys.executable).parent / "rendezvousd")
RENDEZVOUS = str(Path(sys.executable).parent / "rendezvous")

TRAINER = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from rendezvous.client import Client

    k = "/job:node/replica:0/task:0/device:CPU:0;0;/job:node/replica:0/task:0/device:CPU:1;x;0:0"
    with Client() as c:
        c.send(k, np.arange(4))
        got = c.recv(k, timeout=20).tolist()
    print(json.dumps({"got": got, "address": os.environ["RENDEZVOUS_LOCAL_ADDRESS"],
                      "pmi": sorted(v for v in os.environ if v.startswith("PMI_"))}), flush=True)
    if len(sys.argv) > 1 and sys.argv[1] == "wait":
        import signal
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))
        print("waiting", flush=True)
        signal.pause()
    sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
""")


def daemon_argv(sock: str, *command: str) -> list[str]:
    return [RENDEZVOUSD, "--cluster", '{"node": ["127.0.0.1:0"]}', "--job-name", "node", "--task-index", "0",
            "--local", f"unix:{sock}", "--grace", "1", "--", *command]


@pytest.fixture
def folder():
    with tempfile.TemporaryDirectory(prefix="rdvchild", dir="/tmp") as d:
        yield d


@pytest.mark.parametrize("status", [0, 3])
def test_the_daemon_runs_its_program_and_exits_with_its_status(folder, status):
    sock = f"{folder}/d.sock"
    script = Path(folder, "train.py")
    script.write_text(TRAINER)
    env = {**os.environ, "PMI_RANK": "0", "PMI_SIZE": "1", "GRPC_VERBOSITY": "ERROR"}  # as a launcher sets them
    out = subprocess.run(daemon_argv(sock, sys.executable, str(script), str(status)), capture_output=True,
                         text=True, timeout=80, env=env)
    assert out.returncode == status, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("rendezvousd: /job:node/replica:0/task:0 serving on"), lines
    said = json.loads(lines[1])
    assert said["got"] == [0, 1, 2, 3] and said["address"] == f"unix:{sock}"
    assert said["pmi"] == []  # the program is not a rank of the daemons' MPI job
    assert not os.path.exists(sock)  # drained and gone


def test_a_signal_to_the_daemon_reaches_its_program_and_the_daemon_follows(folder):
    sock = f"{folder}/d.sock"
    script = Path(folder, "train.py")
    script.write_text(TRAINER)
    p = subprocess.Popen(daemon_argv(sock, sys.executable, str(script), "wait"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "GRPC_VERBOSITY": "ERROR"})
    try:
        for line in p.stdout:  # type: ignore[union-attr]
            if line.startswith("waiting"):
                break
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 7  # the program's status: it got SIGTERM and exited 7
    finally:
        p.kill()
        p.wait()


def test_the_program_dies_with_a_killed_daemon(folder):
    sock = f"{folder}/d.sock"
    pidfile = Path(folder, "pid")
    child = f"import os, signal; open({str(pidfile)!r}, 'w').write(str(os.getpid())); print('up', flush=True); " \
            "signal.pause()"
    p = subprocess.Popen(daemon_argv(sock, sys.executable, "-c", child), stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    try:
        for line in p.stdout:  # type: ignore[union-attr]
            if line.startswith("up"):
                break
        pid = int(pidfile.read_text())
        p.kill()
        p.wait(30)
        # the kernel delivers the parent-death signal: wait on the program's exit
        assert wait_gone([pid], 30) == [], "the program outlived its killed daemon"
    finally:
        p.kill()


@pytest.mark.parametrize("argv,said", [
    ([RENDEZVOUSD, "--cluster", '{"n": ["127.0.0.1:0"]}', "--job-name", "n", "--"], "-- needs a COMMAND"),
    ([RENDEZVOUS, "serve", "--cluster", '{"n": ["127.0.0.1:0"]}', "--job-name", "n", "--", "true"],
     "add --daemon"),
])
def test_a_command_where_none_can_run_is_refused(argv, said):
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and said in out.stderr, out.stderr


def test_a_program_that_cannot_start_fails_the_daemon_saying_why(folder):
    out = subprocess.run(daemon_argv(f"{folder}/d.sock", f"{folder}/no-such-program"), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and "cannot run" in out.stderr and "no-such-program" in out.stderr, out.stderr
