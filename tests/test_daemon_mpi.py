"""Two rendezvousd daemons under `mpiexec -n 2` (the "nodes"), each with two
local client processes exchanging tensors across nodes through the daemons:
inline, shared memory and MPI paths; health and metrics scraped over real
gRPC and HTTP; a stall warning; SIGTERM to the launcher drains a recv in
flight and every process exits 0, leaving no socket and no segment."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import urllib.request

import grpc
import numpy as np
import pytest

from rendezvous.client import Client

from test_daemon_cli import HERE, RENDEZVOUSD, Proc, procs, sockdir  # noqa: F401  (fixtures)
from daemon_clients import SIZES
from test_mpi import mpiexec

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(180)]
READY = re.compile(r"rendezvousd: (\S+) serving on (\S+) .*; local (\S+); metrics (\S+); pid (\d+)")


def metrics(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def health(target: str) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_two_daemons_under_mpiexec_with_local_clients(procs, sockdir):  # noqa: F811
    from grpc_health.v1 import health_pb2

    cluster = sockdir / "cluster.json"
    cluster.write_text(json.dumps({"node": ["127.0.0.1:0", "127.0.0.1:0"]}))
    env = {k: v for k, v in os.environ.items() if k not in ("MPI_DISABLED", "MPI_OPTIMAL_PATH")}
    daemons = Proc([*mpiexec(), "-n", "2", RENDEZVOUSD, "--cluster", str(cluster), "--job-name", "node",
                    "--protocol", "grpc+mpi", "--local", f"unix:{sockdir}/node-{{task_index}}.sock",
                    "--metrics-port", "0", "--grace", "1", "--stall-warning", "0.5", "--log-format", "json"], env=env)
    procs.append(daemons)
    nodes = {}
    for _ in range(2):
        task, target, local, url, pid = READY.match(daemons.line("rendezvousd: ")).groups()
        nodes[int(task.rsplit(":", 1)[1])] = dict(target=target, local=local, url=url, pid=int(pid))
    assert sorted(nodes) == [0, 1]
    assert nodes[0]["local"] == f"unix:{sockdir}/node-0.sock"

    clients = [Proc([sys.executable, str(HERE / "daemon_clients.py"), "exchange", str(n), str(c), nodes[n]["local"]])
               for n in range(2) for c in range(2)]
    procs.extend(clients)
    for proc in clients:
        result = json.loads(proc.line("RESULT ", timeout=120)[7:])
        assert proc.p.wait(30) == 0, "".join(proc.err)
        s = result["stats"]
        # per client: from the other node 2 x small (inline, gRPC; or, asked together with
        # another client's recv and packed with a tensor ready with it, in one MPI message),
        # 2 x medium (inline, MPI), 2 x large (shared memory, MPI), 2 x strings (inline,
        # gRPC); the sibling's large (local)
        assert s["grpc"] + s["mpi"] == 8 and 2 <= s["grpc"] <= 4 and s["local"] == 1, s
        assert (s["send_shm"], s["recv_shm"], s["send_inline"], s["recv_inline"]) == (3, 3, 6, 6), s

    for n, node in nodes.items():
        assert health(node["target"]) == health_pb2.HealthCheckResponse.SERVING
        m = metrics(node["url"])
        path = lambda name, p: m[(f"rendezvous_{name}_total", (("path", p),))]  # noqa: E731
        mpi = path("transfers", "mpi")  # 8, and the small tensors that went packed (see above)
        assert 8 <= mpi <= 12 and (mpi + path("transfers", "grpc"), path("transfers", "local")) == (16, 2)
        assert path("served", "mpi") + path("served", "grpc") == 16
        assert path("bytes", "mpi") == 4 * ((32 << 10) + (1 << 20)) + (mpi - 8) * SIZES["small"]
        assert path("fallbacks", "grpc") == 4  # the string tensors, too big for inline by size alone
        ops = lambda op, p: m[("rendezvous_local_ops_total", (("op", op), ("path", p)))]  # noqa: E731
        assert (ops("send", "shm"), ops("recv", "shm"), ops("send", "inline"), ops("recv", "inline")) == (6, 6, 12, 12)
        assert m[("rendezvous_recv_seconds_count", (("path", "mpi"),))] == mpi
        assert m[("rendezvous_mpi_in_flight", ())] == 0

    # a recv in flight on node 0 for a tensor node 1 never produces, and a tensor
    # on node 1 nobody takes
    never = ("/job:node/replica:0/task:1/device:CPU:0;0000000000000000;"
             "/job:node/replica:0/task:0/device:CPU:0;never;0:0")
    waiter = Proc([sys.executable, str(HERE / "daemon_clients.py"), "waiter", nodes[0]["local"], never])
    procs.append(waiter)
    waiter.line("WAITING")
    with Client(nodes[1]["local"]) as c:
        c.send(never.replace(";never;", ";left;"), np.ones(8), step_id=1)
    stall = json.loads(daemons.wait_err('has waited', timeout=30))
    assert stall["key"] == never and stall["producer"] == "/job:node/replica:0/task:1" and stall["step_id"] == 1

    daemons.p.send_signal(signal.SIGTERM)  # to mpiexec, which forwards it to both daemons
    outcome = json.loads(waiter.line("RESULT ")[7:])
    assert outcome["error"] == "UNAVAILABLE", outcome
    assert waiter.p.wait(30) == 0
    assert daemons.p.wait(60) == 0, "".join(daemons.err)[-4000:]
    assert any("1 produced tensor(s) never consumed" in e for e in daemons.err)
    assert not list(sockdir.glob("*.sock"))
    for node in nodes.values():
        with pytest.raises(ProcessLookupError):
            os.kill(node["pid"], 0)
