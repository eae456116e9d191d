"""Jobs without MPI bootstrapped from one known address (rendezvous/rank/bootstrap.py):
MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE as torchrun sets them; every rank but
rank 0 on port 0. README's torchrun example runs here exactly as written, with
the environment torchrun would give it (and under the real torchrun where torch
is installed). Bad joins are refused with the right status and the job still
forms; a rank that never joins fails every start within connect_timeout."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

import rendezvous
from rendezvous import aio
from rendezvous.errors import InvalidArgument, Unavailable
from rendezvous.rank.bootstrap import JOIN_METHOD, Bootstrap, local_host_towards

from conftest import free_port, key, run

pytestmark = pytest.mark.timeout(90)
ROOT = Path(__file__).resolve().parent.parent


def torchrun_env(rank: int, world: int, port: int, addr: str = "127.0.0.1") -> dict[str, str]:
    """What torchrun sets for each process it starts (the variables this reads)."""
    return {**os.environ, "MASTER_ADDR": addr, "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "GRPC_VERBOSITY": "ERROR"}


def readme_example(first_line: str) -> str:
    """The README's python block that starts with ``first_line``, as written."""
    text = (ROOT / "README.md").read_text()
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        if block.startswith(first_line):
            return block
    raise AssertionError(f"README has no python block starting with {first_line!r}")


def run_ranks(script: Path, world: int, timeout: float = 60) -> list[subprocess.CompletedProcess]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script)], env=torchrun_env(r, world, port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            p.kill()
    return done


def test_readme_torchrun_example_runs_as_written(tmp_path):
    script = tmp_path / "ring.py"
    script.write_text(readme_example("# ring.py"))
    results = run_ranks(script, 3)
    for rank, r in enumerate(results):
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.strip() == f"rank {rank}: 3 steps exchanged"
        assert "never consumed" not in r.stderr, r.stderr


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed (not a dependency)")
def test_readme_example_under_the_real_torchrun(tmp_path):
    """torchrun's agent hosts a TCPStore at MASTER_PORT: every rank binds port 0
    and the addresses go through that store."""
    script = tmp_path / "ring.py"
    script.write_text(readme_example("# ring.py"))
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port",
            str(free_port()), str(script)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=80)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(out.stdout.split("\n")[:-1]) == [f"rank {r}: 3 steps exchanged" for r in range(3)]


def test_every_rank_but_rank_0_binds_port_0_and_learns_all_addresses(tmp_path):
    script = tmp_path / "who.py"
    script.write_text(
        "import json, rendezvous\n"
        "with rendezvous.Server.from_env(job_name='trainer') as s:\n"
        "    print(json.dumps({'task': str(s.task), 'target': s.target,\n"
        "                      'cluster': {str(t): s.cluster.address(t) for t in s.cluster.tasks()}}))\n")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script)], env=torchrun_env(r, 3, port), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(3)]
    outs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert outs[0]["target"] == f"127.0.0.1:{port}"
    assert len({o["target"] for o in outs}) == 3
    expected = {f"/job:trainer/replica:0/task:{i}": outs[i]["target"] for i in range(3)}
    assert all(o["cluster"] == expected for o in outs)


@pytest.mark.parametrize("env,said", [
    ({"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "2"}, "missing: MASTER_PORT"),
    ({}, "missing: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE"),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "x", "RANK": "0", "WORLD_SIZE": "2"}, "MASTER_PORT must be an integer"),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "2", "WORLD_SIZE": "2"}, r"RANK must be in \[0, 2\)"),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "0", "RANK": "0", "WORLD_SIZE": "2"}, "MASTER_PORT must be a port"),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE must be at least 1"),
])
def test_the_environment_is_checked_naming_the_variable(env, said):
    with pytest.raises(InvalidArgument, match=said):
        rendezvous.Server.from_env(env=env)


def test_the_address_towards_rank_0_is_loopback_on_loopback():
    assert local_host_towards("127.0.0.1") == "127.0.0.1"
    assert Bootstrap("127.0.0.1", 29500, 1, 2).cluster("w") == {"w": ["127.0.0.1:29500", "127.0.0.1:0"]}


def test_a_world_of_one_forms_at_once():
    async def main():
        s = aio.Server.from_env(env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                                     "WORLD_SIZE": "1"})
        async with s:
            s.send(key(0, 0, "self"), np.ones(2))
            assert (await s.recv(key(0, 0, "self"), timeout=5)).tolist() == [1.0, 1.0]
    run(main())


def test_a_rank_that_never_joins_fails_rank_0_naming_it():
    async def main():
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "3"}
        s = aio.Server.from_env(env=env, connect_timeout=0.5)
        with pytest.raises(Unavailable, match=r"rank\(s\) 1, 2 of 3 never joined .* within 0.5s"):
            await s.start()
    run(main())


def test_a_rank_whose_rank_0_never_answers_fails_in_bound():
    async def main():
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "1", "WORLD_SIZE": "2"}
        s = aio.Server.from_env(env=env, connect_timeout=0.5)
        with pytest.raises(Unavailable, match="rank 1 could not join the job at rank 0"):
            await s.start()
    run(main())


def test_bad_joins_are_refused_and_the_job_still_forms():
    async def main():
        port = free_port()
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "2"}
        zero = aio.Server.from_env(env=env)
        one = aio.Server.from_env(env={**env, "RANK": "1"})
        starting = asyncio.ensure_future(zero.start())
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        join = channel.unary_unary(JOIN_METHOD, request_serializer=None, response_deserializer=None)

        async def refused(body: bytes) -> grpc.StatusCode:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await join(body, timeout=10, wait_for_ready=True)
            return info.value.code()

        def body(**changes) -> bytes:
            return json.dumps({"job": "worker", "rank": 1, "world_size": 2, "address": "127.0.0.1:1234",
                               **changes}).encode()

        try:
            assert await refused(b"\xff garbage") is grpc.StatusCode.INVALID_ARGUMENT
            assert await refused(b"[1, 2]") is grpc.StatusCode.INVALID_ARGUMENT
            assert await refused(body(job="other")) is grpc.StatusCode.INVALID_ARGUMENT
            assert await refused(body(world_size=3)) is grpc.StatusCode.INVALID_ARGUMENT
            assert await refused(body(rank=0)) is grpc.StatusCode.INVALID_ARGUMENT
            assert await refused(body(rank=2)) is grpc.StatusCode.INVALID_ARGUMENT
            assert await refused(body(address="127.0.0.1:0")) is grpc.StatusCode.INVALID_ARGUMENT
            assert await refused(body(address="no port")) is grpc.StatusCode.INVALID_ARGUMENT
            assert await refused(body(incarnation=-1)) is grpc.StatusCode.INVALID_ARGUMENT
            assert await refused(body(incarnation="0x5")) is grpc.StatusCode.INVALID_ARGUMENT
            assert not starting.done()
            # a real rank 1 joins; after that, Join is retired
            await one.start()
            await starting
            assert await refused(body(address="127.0.0.1:1")) is grpc.StatusCode.FAILED_PRECONDITION
            # a repeated join (a retry) gets the same answer
            again = json.loads(await join(body(address=one.target), timeout=10))
            assert again == {"addresses": [zero.target, one.target],
                             "incarnations": [zero.incarnation, one.incarnation]}
            one.send(key(1, 0, "after"), np.arange(3))
            assert (await zero.recv(key(1, 0, "after"), timeout=10)).tolist() == [0, 1, 2]
        finally:
            await channel.close()
            await one.stop(0)
            await zero.stop(0)
            starting.cancel()
    run(main())
