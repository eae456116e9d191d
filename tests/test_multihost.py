"""Across hosts: three network namespaces on one bridge (tests/netns.py) stand
in for three machines. The demo runs across them with gRPC only and with MPI
on its network path; the step bench runs its two ranks on two of them; a
rendezvousd per host serves local clients; cables are pulled during waits and
during a large transfer, and a whole host is lost.

Skipped, with the reason, where namespaces cannot be built (not root)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import netns
from mpi_scenarios import wait_for
from netns_agent import digest, payload

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow, pytest.mark.multihost]

BIN = Path(sys.executable).parent
RENDEZVOUSD = str(BIN / "rendezvousd")
AGENT = str(Path(__file__).resolve().parent / "netns_agent.py")
READY = re.compile(r"rendezvousd: (\S+) serving on (\S+) .*; local (\S+); metrics (\S+); pid (\d+)")

# The keepalive the partition tests configure: a silent peer is noticed after
# KEEPALIVE_TIME + KEEPALIVE_TIMEOUT seconds, and a recv then waits as long
# again for the connection to come back before it fails (the reconnect
# window). BOUND adds what a busy 2-core machine needs on top.
KEEPALIVE_TIME, KEEPALIVE_TIMEOUT = 1.0, 1.0
BOUND = 2 * (KEEPALIVE_TIME + KEEPALIVE_TIMEOUT) + 3.0


@pytest.fixture(scope="module")
def net():
    why = netns.unavailable()
    if why:
        pytest.skip(f"no multi-host harness here: {why}")
    netns.sweep(r"rt(\d+)")  # what earlier runs that were killed left
    hosts = netns.Net(3, prefix=f"rt{os.getpid()}")
    hosts.up()
    yield hosts
    hosts.down()


@pytest.fixture
def hosts(net):
    """The module's hosts, handed back as they were: cables in, no shaping, no processes."""
    yield net
    for h in net.hosts:
        net.kill(h)
        net.shape(h, None)
        net.link(h, up=True)


def key(src: int, dst: int, name: str, step: int = 0) -> str:
    return (f"/job:node/replica:0/task:{src}/device:CPU:0;0000000000000000;"
            f"/job:node/replica:0/task:{dst}/device:CPU:0;{name};0:0")


class Agent:
    """A local client process in one host (tests/netns_agent.py), driven by commands."""

    def __init__(self, host: netns.Host, local: str, env: dict[str, str]) -> None:
        self.host = host
        self.p = host.popen([sys.executable, AGENT, "--local", local], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.results: dict[int, tuple[float, dict]] = {}
        self.cond = threading.Condition()
        self.next_id = 1
        threading.Thread(target=self._read, daemon=True).start()
        self.result(0, 60)  # connected to its daemon

    def _read(self) -> None:
        for line in self.p.stdout:  # type: ignore[union-attr]
            msg = json.loads(line)
            with self.cond:
                self.results[msg["id"]] = (time.monotonic(), msg)
                self.cond.notify_all()

    def call(self, **cmd) -> int:
        with self.cond:
            cmd["id"] = n = self.next_id
            self.next_id += 1
        self.p.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
        self.p.stdin.flush()  # type: ignore[union-attr]
        return n

    def result(self, n: int, timeout: float = 60) -> dict:
        return self.answer(n, timeout)[1]

    def answer(self, n: int, timeout: float = 60) -> tuple[float, dict]:
        """(when it came, the answer)."""
        with self.cond:
            ok = self.cond.wait_for(lambda: n in self.results or self.p.poll() is not None, timeout)
            if n in self.results:
                return self.results.pop(n)
        err = self.p.stderr.read() if self.p.poll() is not None else ""  # type: ignore[union-attr]
        raise AssertionError(f"{self.host.name}: no answer to {n} within {timeout}s "
                             f"({'exited' if ok else 'alive'}) {err[-2000:]}")

    def done(self, n: int) -> bool:
        with self.cond:
            return n in self.results

    def send(self, k: str, nbytes: int, seed: int) -> None:
        got = self.result(self.call(op="send", key=k, nbytes=nbytes, seed=seed))
        assert got["ok"], got

    def recv_ok(self, k: str, nbytes: int, seed: int, timeout: float = 60) -> None:
        got = self.result(self.call(op="recv", key=k, timeout=timeout), timeout + 30)
        assert got["ok"], got
        assert (got["nbytes"], got["digest"]) == (nbytes, digest(payload(nbytes, seed)))


class Node:
    """A host's rendezvousd and one local client of it."""

    def __init__(self, host: netns.Host, daemon: subprocess.Popen, ready: re.Match, agent: Agent) -> None:
        self.host, self.daemon, self.agent = host, daemon, agent
        self.target, self.local, self.metrics_url, self.pid = ready.group(2), ready.group(3), ready.group(4), \
            int(ready.group(5))

    def metrics(self) -> dict[str, float]:
        out = self.host.run([sys.executable, "-c", "import sys, urllib.request; "
                             "print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())",
                             self.metrics_url], capture_output=True, text=True, check=True).stdout
        values = {}
        for line in out.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values


def _env() -> dict[str, str]:
    return {**os.environ, "RENDEZVOUS_KEEPALIVE_TIME": str(KEEPALIVE_TIME),
            "RENDEZVOUS_KEEPALIVE_TIMEOUT": str(KEEPALIVE_TIMEOUT), "GRPC_VERBOSITY": "ERROR"}


def show_logs(*paths: Path) -> None:
    """The daemons' logs, printed as a fixture ends: pytest shows them with a
    failed test's report (what each daemon saw of the fault), and drops them
    for one that passed."""
    for path in paths:
        if path.exists():
            print(f"--- {path.name} (last 6000 characters) ---\n{path.read_text(errors='replace')[-6000:]}")


def start_node(host: netns.Host, index: int, cluster: str, sockdir: str) -> Node:
    env = _env()
    local = f"unix:{sockdir}/{host.name}.sock"
    with open(Path(sockdir) / f"{host.name}.log", "w") as log:  # the child holds its own descriptor
        d = host.popen([RENDEZVOUSD, "--cluster", cluster, "--job-name", "node", "--task-index", str(index),
                        "--local", local, "--metrics-port", "0"],
                       stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    line = d.stdout.readline()  # type: ignore[union-attr]
    ready = READY.match(line)
    assert ready, f"{host.name}: no ready line from rendezvousd: {line!r}"
    return Node(host, d, ready, Agent(host, ready.group(3), env))


@pytest.fixture
def nodes(hosts):
    """A rendezvousd (protocol grpc, port 50051 of its host) and a local client per host."""
    cluster = cluster_file(hosts)
    with tempfile.TemporaryDirectory(prefix="rdvmh", dir="/tmp") as sockdir:
        yield [start_node(h, i, cluster, sockdir) for i, h in enumerate(hosts.hosts)]
        show_logs(*(Path(sockdir) / f"{h.name}.log" for h in hosts.hosts))


def cluster_file(net: netns.Net) -> str:
    """The daemons' cluster: task i of job node on port 50051 of host i."""
    return json.dumps({"node": [f"{h.address}:50051" for h in net.hosts]})


def fails_in_bound(agent: Agent, n: int, since: float) -> dict:
    """Recv ``n`` failed with UNAVAILABLE within BOUND seconds of ``since``."""
    when, got = agent.answer(n, BOUND + 30)
    assert not got["ok"] and got["code"] == "UNAVAILABLE", got
    assert when - since < BOUND, (when - since, got)
    return got


def cut_mid_transfer(net: netns.Net, src: Agent, dst: Agent, size: int, seed: int) -> tuple[int, float]:
    """``src`` sends host 0's tensor ``big`` to host 1, whose link is held to
    200 Mbit/s (about 4 s for 96 MiB); ``dst`` asks for it, and its cable is
    pulled once 16 MiB crossed it. (The recv's id, when the cable went.)"""
    net.shape(net.hosts[1], 200)
    src.send(key(0, 1, "big"), size, seed=seed)
    before = net.hosts[1].counters()["rx_bytes"]
    n = dst.call(op="recv", key=key(0, 1, "big"))
    wait_for(lambda: net.hosts[1].counters()["rx_bytes"] - before > 16 << 20, "16 MiB of the transfer on b's cable")
    net.link(net.hosts[1], up=False)
    return n, time.monotonic()


def _cable_crossed(host: netns.Host, before: dict[str, int]) -> int:
    after = host.counters()
    return after["rx_bytes"] - before["rx_bytes"] + after["tx_bytes"] - before["tx_bytes"]


# --- the product across hosts ---------------------------------------------------------

def test_the_ps_demo_runs_across_hosts_with_grpc_only_and_with_mpi_on_its_network_path(hosts):
    env = hosts.env({**netns.mpi_network_env(), "GRPC_VERBOSITY": "ERROR",
                     "RENDEZVOUS_MPIEXEC": " ".join([str(BIN / "mpiexec"), *hosts.launcher()])})
    before = [h.counters() for h in hosts.hosts]
    run = hosts.hosts[0].run([sys.executable, str(ROOT / "examples" / "ps_training.py"),
                              "--hosts", ",".join(h.address for h in hosts.hosts), "--steps", "4",
                              "--timeout", "150"], env=env, capture_output=True, text=True, timeout=200)
    out = run.stdout
    assert run.returncode == 0, out[-4000:] + run.stderr[-4000:]
    # Every rank served on its own host's address, given by the launcher's host list.
    for i, h in enumerate(hosts.hosts):
        task = "/job:ps/replica:0/task:0" if i == 0 else f"/job:worker/replica:0/task:{i - 1}"
        assert f"{task} on {h.address}:50051" in run.stderr, run.stderr[-4000:]
    assert re.search(r"-> the same", out), out[-2000:]
    runs = out.split("=== run ")[1:]
    assert len(runs) == 2
    mpi = re.search(r"MPI\s+(\d+)\s+([\d,]+)", runs[0])
    assert mpi and int(mpi.group(1)) > 0, runs[0]  # run 1 moved tensors over MPI...
    mpi_bytes = int(mpi.group(2).replace(",", ""))
    grpc_bytes = int(re.search(r"gRPC inline\s+\d+\s+([\d,]+)", runs[1]).group(1).replace(",", ""))
    # ...and no rank shares a host with another: every byte either run moved
    # crossed the ps's cable (MPI did not take shared memory between hosts).
    ps_cable = _cable_crossed(hosts.hosts[0], before[0])
    assert ps_cable >= mpi_bytes + grpc_bytes, (ps_cable, mpi_bytes, grpc_bytes)


def test_a_daemon_per_host_serves_its_local_clients_across_hosts(nodes):
    for src in nodes:
        for dst in nodes:
            if dst is not src:
                i, j = nodes.index(src), nodes.index(dst)
                src.agent.send(key(i, j, "t"), 3 << 20, seed=10 * i + j)
    for dst in nodes:
        for src in nodes:
            if dst is not src:
                i, j = nodes.index(src), nodes.index(dst)
                dst.agent.recv_ok(key(i, j, "t"), 3 << 20, seed=10 * i + j)
    for n in nodes:
        m = n.metrics()
        assert m['rendezvous_transfers_total{path="grpc"}'] == 2  # from the other two hosts
        assert m["rendezvous_waiting_tensors"] == 0


@pytest.fixture
def mpi_nodes(hosts):
    """A rendezvousd per host, the three one MPI job (grpc+mpi, MPI on the network,
    ports from the OS published by the rank map's allgather), and a local client each."""
    env = hosts.env({**_env(), **netns.mpi_network_env()})
    with tempfile.TemporaryDirectory(prefix="rdvmh", dir="/tmp") as sockdir:
        cluster = json.dumps({"node": [f"{h.address}:0" for h in hosts.hosts]})
        log = Path(sockdir) / "job.log"
        with open(log, "w") as err:
            job = subprocess.Popen(
                hosts.mpiexec([RENDEZVOUSD, "--cluster", cluster, "--job-name", "node", "--protocol", "grpc+mpi",
                               "--local", f"unix:{sockdir}/d{{task_index}}.sock", "--metrics-port", "0"]),
                stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True)
        try:
            ready = {}
            while len(ready) < 3:
                line = job.stdout.readline()  # type: ignore[union-attr]
                assert line, "the MPI job ended before every daemon was ready"
                m = READY.match(line)
                if m:
                    ready[int(m.group(1).rsplit(":", 1)[1])] = m
            yield [Node(h, job, ready[i], Agent(h, ready[i].group(3), env)) for i, h in enumerate(hosts.hosts)]
        finally:
            os.killpg(job.pid, 9)
            job.wait()
            show_logs(log)


def test_daemons_in_one_mpi_job_across_hosts_move_tensors_over_mpi_on_the_network(hosts, mpi_nodes):
    nodes = mpi_nodes
    for i, n in enumerate(nodes):
        assert n.target.startswith(hosts.hosts[i].address + ":")  # the rank's own host
    before = nodes[1].host.counters()
    nodes[0].agent.send(key(0, 1, "big"), 8 << 20, seed=1)
    nodes[2].agent.send(key(2, 1, "big"), 8 << 20, seed=2)
    nodes[1].agent.recv_ok(key(0, 1, "big"), 8 << 20, seed=1)
    nodes[1].agent.recv_ok(key(2, 1, "big"), 8 << 20, seed=2)
    assert nodes[1].metrics()['rendezvous_transfers_total{path="mpi"}'] == 2
    assert nodes[1].host.counters()["rx_bytes"] - before["rx_bytes"] >= 16 << 20  # over the cable


@pytest.mark.timeout(90)
def test_the_step_bench_runs_its_ranks_on_two_hosts_and_every_contender_crosses_the_cable(hosts, tmp_path):
    """``tests/netns.py bench-steps``'s run, tiny: rank 0 in h0, rank 1 in h1
    (RENDEZVOUS_BENCH_HOSTS), raw MPI on its network path, rendezvous and raw
    gRPC on the hosts' addresses; every contender times its step, and every
    step's bytes crossed the producer's cable."""
    from rendezvous.bench.models import nbytes

    pair = hosts.hosts[:2]
    contenders = ["mpi", "optimal_many", "grpc"]
    before = pair[1].counters()
    run = pair[0].run([sys.executable, "-m", "rendezvous", "bench-steps", "--steps", "1", "--models", "many-small",
                       "--contenders", ",".join(contenders), "--out", str(tmp_path), "--timeout", "60"],
                      env=netns.bench_env(hosts, pair), capture_output=True, text=True, timeout=80)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads((tmp_path / "steps.json").read_text())
    assert doc["contenders"] == contenders
    seconds = doc["models"]["many-small"]["seconds"]
    assert {n: len(seconds[n]) for n in contenders} == dict.fromkeys(contenders, 1), seconds
    assert all(t > 0 for n in contenders for t in seconds[n]), seconds
    assert "| optimal_many |" in run.stdout  # the table, printed
    # Warm-up and timed step, each contender: all of it left h1 through eth0.
    assert pair[1].counters()["tx_bytes"] - before["tx_bytes"] >= 2 * len(contenders) * nbytes("many-small")


# --- partitions and lost hosts -----------------------------------------------------------

def test_a_pulled_cable_fails_waiting_recvs_within_the_keepalive_bound_and_loses_nothing(hosts, nodes):
    a, b, c = (n.agent for n in nodes)
    waiting = b.call(op="recv", key=key(0, 1, "w1"))                # no deadline
    with_deadline = b.call(op="recv", key=key(0, 1, "w2"), timeout=120)
    from_b = c.call(op="recv", key=key(1, 2, "w3"))                 # b is the producer
    # Each recv is waiting in its producer's daemon before the cable goes.
    wait_for(lambda: nodes[0].metrics()["rendezvous_waiting_receivers"] == 2, "both recvs of b to wait in a's daemon")
    wait_for(lambda: nodes[1].metrics()["rendezvous_waiting_receivers"] == 1, "c's recv to wait in b's daemon")

    hosts.link(hosts.hosts[1], up=False)
    pulled = time.monotonic()
    # Produced while the cable is out: the producers' streams to b are dead.
    a.send(key(0, 1, "w1"), 4096, seed=1)
    a.send(key(0, 1, "w2"), 1 << 20, seed=2)
    b.send(key(1, 2, "w3"), 4096, seed=3)
    for agent, n in ((b, waiting), (b, with_deadline), (c, from_b)):
        fails_in_bound(agent, n, pulled)
    # The rest of the job goes on meanwhile.
    a.send(key(0, 2, "side"), 4096, seed=4)
    c.recv_ok(key(0, 2, "side"), 4096, seed=4)

    hosts.link(hosts.hosts[1], up=True)
    # The same processes: each tensor arrives once, whole.
    b.recv_ok(key(0, 1, "w1"), 4096, seed=1)
    b.recv_ok(key(0, 1, "w2"), 1 << 20, seed=2)
    c.recv_ok(key(1, 2, "w3"), 4096, seed=3)
    again = b.result(b.call(op="recv", key=key(0, 1, "w1"), timeout=1.0))
    assert again["code"] == "DEADLINE_EXCEEDED", again  # not delivered twice
    for n in nodes:
        assert n.daemon.poll() is None
        assert n.metrics()["rendezvous_waiting_tensors"] == 0


def test_a_pulled_cable_during_a_large_transfer_fails_it_in_bound_and_the_tensor_stays(hosts, nodes):
    a, b = nodes[0].agent, nodes[1].agent
    size = 96 << 20
    n, pulled = cut_mid_transfer(hosts, a, b, size, seed=5)
    fails_in_bound(b, n, pulled)
    # The producer notices the dead consumer too and puts the cut-off reply back.
    wait_for(lambda: nodes[0].metrics()["rendezvous_waiting_tensors"] == 1,
             "a's daemon to put the cut-off reply back", BOUND + 10)

    hosts.shape(hosts.hosts[1], None)
    hosts.link(hosts.hosts[1], up=True)
    b.recv_ok(key(0, 1, "big"), size, seed=5)
    assert nodes[0].metrics()["rendezvous_waiting_tensors"] == 0


def test_a_lost_host_is_noticed_within_the_bound_and_the_others_go_on(hosts, nodes):
    a, b = nodes[0].agent, nodes[1].agent
    from_c = [a.call(op="recv", key=key(2, 0, "x")), b.call(op="recv", key=key(2, 1, "x"), timeout=120)]
    wait_for(lambda: nodes[2].metrics()["rendezvous_waiting_receivers"] == 2, "both recvs to wait in c's daemon")
    # Power gone: the cable first, so not a packet (FIN, RST) leaves the host.
    hosts.link(hosts.hosts[2], up=False)
    hosts.kill(hosts.hosts[2])
    lost = time.monotonic()
    for agent, n in zip((a, b), from_c):
        fails_in_bound(agent, n, lost)
    # A new recv from the lost host fails within the bound as well.
    fails_in_bound(a, a.call(op="recv", key=key(2, 0, "y")), time.monotonic())
    # The hosts that stayed up go on.
    a.send(key(0, 1, "z"), 1 << 20, seed=6)
    b.recv_ok(key(0, 1, "z"), 1 << 20, seed=6)
    # The host comes back (a new daemon on the same address): the others reach it
    # without being restarted.
    hosts.link(hosts.hosts[2], up=True)
    back = start_node(hosts.hosts[2], 2, cluster_file(hosts), str(Path(nodes[2].local[5:]).parent))
    back.agent.send(key(2, 0, "again"), 4096, seed=7)
    a.recv_ok(key(2, 0, "again"), 4096, seed=7)
    assert nodes[0].daemon.poll() is None and nodes[1].daemon.poll() is None


def test_a_pulled_cable_during_an_mpi_transfer_fails_the_recv_in_bound_and_the_tensor_lands_later(
        hosts, mpi_nodes):
    nodes = mpi_nodes
    a, b = nodes[0].agent, nodes[1].agent
    size = 96 << 20
    n, pulled = cut_mid_transfer(hosts, a, b, size, seed=8)
    # The descriptor came over gRPC, the bytes were coming over MPI: the recv
    # fails with the stream, within the bound, and says where the tensor is.
    got = fails_in_bound(b, n, pulled)
    assert "kept for the next recv" in got["message"], got
    hosts.shape(hosts.hosts[1], None)
    hosts.link(hosts.hosts[1], up=True)
    # MPI's transfer goes on once the cable is back; the next recv of the key
    # gets the tensor, once, and the job (the same processes) goes on.
    b.recv_ok(key(0, 1, "big"), size, seed=8, timeout=120)
    again = b.result(b.call(op="recv", key=key(0, 1, "big"), timeout=1.0))
    assert again["code"] == "DEADLINE_EXCEEDED", again
    a.send(key(0, 1, "after"), 4 << 20, seed=9)
    b.recv_ok(key(0, 1, "after"), 4 << 20, seed=9)
    assert nodes[0].daemon.poll() is None


def test_a_job_bootstrapped_from_rank_0s_address_forms_across_hosts(hosts, tmp_path):
    """No cluster file and no MPI: MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE as
    torchrun sets them; ranks 1 and 2 bind port 0 on their own host's address
    and join through rank 0 (README's torchrun example, run as written)."""
    from test_bootstrap import readme_example

    script = tmp_path / "ring.py"
    script.write_text(readme_example("# ring.py") + "print('cluster', rendezvous.__name__, server.target)\n")
    env = {**_env(), "MASTER_ADDR": hosts.hosts[0].address, "MASTER_PORT": "29500", "WORLD_SIZE": "3"}
    procs = [h.popen([sys.executable, str(script)], env={**env, "RANK": str(i)}, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True) for i, h in enumerate(hosts.hosts)]
    for i, (h, p) in enumerate(zip(hosts.hosts, procs)):
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err[-3000:]
        assert f"rank {i}: 3 steps exchanged" in out
        target = out.split("cluster rendezvous ")[1].strip()
        assert target.startswith(f"{h.address}:"), (target, h.address)  # its own host's address
        assert i == 0 or not target.endswith(":29500")


@pytest.mark.timeout(240)
def test_the_doctor_checks_the_way_to_a_peer_host(hosts, tmp_path):
    """``rendezvous doctor --peer`` in h0: its MPI probe job and the matrix run one
    rank on each host (mpiexec's launcher reaches the peer), MPI's ranks are on
    two hosts (no single copy to find), and every path is measured across the
    cable and judged."""
    pair = hosts.hosts[:2]
    env = netns.bench_env(hosts, pair)
    del env["RENDEZVOUS_BENCH_HOSTS"]  # the doctor sets it from --peer
    before = pair[1].counters()
    run = pair[0].run([sys.executable, "-m", "rendezvous", "doctor", "--peer", pair[1].address,
                       "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=220)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-3000:]
    assert f"MPI (this host and {pair[1].address})" in run.stdout
    assert "on two hosts" in run.stdout and "no two ranks share a node" in run.stdout
    assert f"can listen on {pair[0].address}" in run.stdout
    report = json.loads((tmp_path / "doctor.json").read_text())
    assert report["ok"] and report["peer"] == pair[1].address
    assert report["probe"]["remote_ranks"] == [1] and report["probe"]["single_copy"] is None
    cells = {f["facts"]["cell"] for f in report["findings"] if f["area"] == "matrix"}
    assert {"blocking_optimal", "optimal_mr", "local_socket", "grpc_only"} <= cells
    assert not any(c.startswith("raw ") for c in cells)  # raw MPI against a memcpy is judged on one node only
    assert pair[1].counters()["tx_bytes"] - before["tx_bytes"] >= 64 << 20  # the matrix crossed the cable
