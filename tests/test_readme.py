"""README's examples, run as written. Every python block in README.md is either
a program (its first line names it: ``# ring.py: ...``) that a test runs
exactly as written, or a fragment, marked ``<!-- fragment -->`` on the line
before it (it needs a real cluster, a GPU, or names the reader supplies)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from rendezvous import make_key
from rendezvous.client import Client

from conftest import free_ports

pytestmark = pytest.mark.timeout(90)
ROOT = Path(__file__).resolve().parent.parent
RENDEZVOUSD = str(Path(sys.executable).parent / "rendezvousd")
#: the programs in README, by their first line, and the test that runs each
PROGRAMS = {"# ring.py": "tests/test_bootstrap.py::test_readme_torchrun_example_runs_as_written",
            "# node0_train.py": "tests/test_readme.py::test_readme_local_client_example_runs_as_written"}


def python_blocks() -> list[tuple[str, str]]:
    """(the line before, the block) for every python block in README.md."""
    text = (ROOT / "README.md").read_text()
    return [(before, block) for before, block in re.findall(r"([^\n]*)\n```python\n(.*?)```", text, re.S)]


def test_every_python_block_is_a_program_run_here_or_a_marked_fragment():
    blocks = python_blocks()
    assert len(blocks) >= 4
    seen = set()
    for before, block in blocks:
        first = block.split(":", 1)[0]
        if first in PROGRAMS:
            seen.add(first)
        else:
            assert before.strip() == "<!-- fragment -->", f"README block neither a program nor a fragment:\n{block}"
    assert seen == set(PROGRAMS), f"README lost a program: {set(PROGRAMS) - seen}"


def readme_program(first: str) -> str:
    for _, block in python_blocks():
        if block.startswith(first):
            return block
    raise AssertionError(f"no README block starts with {first!r}")


def test_readme_local_client_example_runs_as_written():
    """Two daemons (nodes 0 and 1); README's node-0 program runs against node
    0's daemon, and this test plays node 1's training process."""
    ports = free_ports(2)
    cluster = '{"node": ["127.0.0.1:%d", "127.0.0.1:%d"]}' % tuple(ports)
    with tempfile.TemporaryDirectory(prefix="rdvreadme", dir="/tmp") as folder:
        env = {**os.environ, "GRPC_VERBOSITY": "ERROR"}
        daemons = [subprocess.Popen([RENDEZVOUSD, "--cluster", cluster, "--job-name", "node", "--task-index",
                                     str(i), "--local", f"unix:{folder}/node{i}.sock"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
        try:
            for d in daemons:
                assert d.stdout.readline().startswith("rendezvousd: "), d.stderr.read()  # type: ignore[union-attr]
            script = Path(folder, "node0_train.py")
            script.write_text(readme_program("# node0_train.py"))
            program = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True,
                                       env={**env, "RENDEZVOUS_LOCAL_ADDRESS": f"unix:{folder}/node0.sock"})
            node0, node1 = "/job:node/replica:0/task:0/device:CPU:0", "/job:node/replica:0/task:1/device:CPU:0"
            with Client(f"unix:{folder}/node1.sock") as me:
                got = me.recv(make_key(node0, node1, "grad"), step_id=3, timeout=60)
                assert got.shape == (1 << 20,) and float(got.sum()) == float(1 << 20)
                del got
                me.send(make_key(node1, node0, "grad"), np.full(1 << 20, 2.0), step_id=3)
            out, err = program.communicate(timeout=60)
            assert program.returncode == 0, err[-3000:]
            assert "got (1048576,) float64 from node 1" in out
        finally:
            for d in daemons:
                d.terminate()
            for d in daemons:
                d.wait(30)
