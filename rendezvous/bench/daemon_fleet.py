"""The processes of a ``bench-daemon`` run, and what they hold.

:class:`Fleet` starts them, all in one :class:`rendezvous.bench.procs.ProcGroup`
(the run's deadline; a wait fails at once when one of them dies):
``rendezvousd`` processes (one local daemon, a ``grpc+mpi`` pair under
``mpiexec``, a ``grpc`` pair), the worker processes that hold their clients
(:mod:`rendezvous.bench.daemon_workers`), and the raw MPI ranks, driven over
a control socket. It snapshots every process's memory and CPU around a
scenario, with each daemon's pool (:class:`FleetDaemon`, from its ``/metrics``),
and stops everything and removes its socket folder at the end.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from . import rss
from .control import ControlListener
from .procs import BenchError, Child, ProcGroup, Worker, environ

__all__ = ["FleetDaemon", "Fleet", "transfer_timeout", "daemon_env"]


def transfer_timeout(size: int) -> float:
    """Seconds one transfer of ``size`` bytes may take before the run calls it hung."""
    return 60.0 + size / 20e6


def daemon_env(pool_bytes: int, extra: dict[str, str]) -> dict[str, str]:
    """The daemons' environment: this one's, less settings that would change their
    paths, with the pool's limit and ``--daemon-env``'s settings."""
    return environ(drop=("MPI_DISABLED", "MPI_OPTIMAL_PATH", "RENDEZVOUS_LOCAL_ADDRESS"),
                   RENDEZVOUS_SHM_POOL_BYTES=str(pool_bytes), **extra)


class FleetDaemon:
    """One rendezvousd (its ready line parsed)."""

    def __init__(self, name: str, child: Child, line: str) -> None:
        self.name = name
        self.child = child
        m = re.search(r"rendezvousd: (\S+) serving on (\S+)", line)
        local = re.search(r"; local (\S+?);", line)
        pid = re.search(r"; pid (\d+)", line)
        metrics = re.search(r"; metrics (\S+?);", line)
        if not (m and local and pid):
            raise BenchError(f"{name}: cannot read its ready line: {line!r}")
        self.task, self.target = m.group(1), m.group(2)
        self.local = local.group(1)
        self.pid = int(pid.group(1))
        self.metrics = metrics.group(1) if metrics else ""
        self.index = int(self.task.rsplit(":", 1)[1])

    def pool(self) -> dict[str, float]:
        """The pool's gauges (and a few others) from its /metrics."""
        if not self.metrics:
            return {}
        with urllib.request.urlopen(self.metrics, timeout=10) as resp:
            text = resp.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith(("rendezvous_shm_pool_", "rendezvous_local_clients ", "rendezvous_waiting_tensors ")):
                name, _, value = line.partition(" ")
                out[name[len("rendezvous_"):]] = float(value)
        return out


class Fleet:
    """Every process of one run, started on demand; ``env`` is the daemons' environment."""

    def __init__(self, timeout: float, env: dict[str, str]) -> None:
        self.group = ProcGroup(timeout)
        self.env = env
        self.dir = tempfile.mkdtemp(prefix="rbd", dir="/tmp")  # short: Unix socket paths fit 107 bytes
        self.daemons: dict[str, FleetDaemon] = {}
        self.raw: ControlListener | None = None
        self.raw_pids: list[int] = []
        self.mpi_library = ""
        #: per scenario: its processes' memory and CPU, the daemons' pools, the clients' counts
        self.memory: dict[str, Any] = {}

    @property
    def workers(self) -> dict[str, Worker]:
        return self.group.workers

    # -- starting ---------------------------------------------------------------------------

    @staticmethod
    def _rendezvousd() -> str:
        found = Path(sys.executable).parent / "rendezvousd"
        return str(found) if found.exists() else (shutil.which("rendezvousd") or "rendezvousd")

    def _daemon(self, name: str, argv: list[str]) -> Child:
        flags = ["--job-name", "node", "--metrics-port", "0", "--grace", "1", "--stall-warning", "0"]
        return self.group.spawn(name, [*argv, *flags], self.env, service=True)

    def _cluster(self, name: str, addresses: list[str]) -> str:
        path = Path(self.dir, name)
        path.write_text(json.dumps({"node": addresses}))
        return str(path)

    def start_local_daemon(self) -> None:
        cluster = self._cluster("local.json", ["127.0.0.1:0"])
        child = self._daemon("rendezvousd (local)", [self._rendezvousd(), "--cluster", cluster, "--task-index", "0",
                                                     "--protocol", "grpc", "--local", f"unix:{self.dir}/l.sock"])
        self.daemons["local"] = FleetDaemon("local", child, child.line("rendezvousd: ", 60))

    def start_mpi_daemons(self, launcher: list[str]) -> None:
        cluster = self._cluster("mpi.json", ["127.0.0.1:0", "127.0.0.1:0"])
        child = self._daemon("rendezvousd pair (mpiexec, grpc+mpi)",
                             [*launcher, "-n", "2", self._rendezvousd(), "--cluster", cluster, "--protocol",
                              "grpc+mpi", "--local", f"unix:{self.dir}/m{{task_index}}.sock"])
        for _ in range(2):
            d = FleetDaemon("", child, child.line("rendezvousd: ", 90))
            d.name = f"mpi{d.index}"
            self.daemons[d.name] = d
        if {"mpi0", "mpi1"} - set(self.daemons):
            raise BenchError("the mpiexec job did not start tasks 0 and 1")

    def start_grpc_daemons(self) -> None:
        holders = []
        for _ in range(2):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            holders.append(s)
        ports = [s.getsockname()[1] for s in holders]
        for s in holders:
            s.close()
        cluster = self._cluster("grpc.json", [f"127.0.0.1:{p}" for p in ports])
        for i in range(2):
            child = self._daemon(f"rendezvousd grpc{i}", [self._rendezvousd(), "--cluster", cluster, "--task-index",
                                                          str(i), "--protocol", "grpc", "--local",
                                                          f"unix:{self.dir}/g{i}.sock"])
            self.daemons[f"grpc{i}"] = FleetDaemon(f"grpc{i}", child, child.line("rendezvousd: ", 60))

    def start_raw_mpi(self, launcher: list[str]) -> None:
        path = f"{self.dir}/raw.sock"
        self.raw = ControlListener(self.group, path)
        self.group.spawn("raw MPI ranks (mpiexec)",
                         [*launcher, "-n", "2", sys.executable, "-m", "mpi4py", "-m",
                          "rendezvous.bench.daemon_workers", "--raw-mpi", path], self.env, service=True)
        self.raw.accept(1, "connection from the raw MPI ranks", timeout=90)
        (hello,) = self.raw.gather("hello from the raw MPI ranks", timeout=60)
        self.raw_pids = [int(p) for p in hello["pids"]]
        self.mpi_library = hello["library"]

    def raw_run(self, size: int, samples: int) -> list[int]:
        """``samples`` timed raw MPI transfers of ``size`` bytes (ns each)."""
        assert self.raw is not None
        self.raw.send({"op": "run", "size": size, "samples": samples})
        (got,) = self.raw.gather("answer from the raw MPI ranks", timeout=transfer_timeout(size) * (samples + 1))
        return got["ns"]

    def start_worker(self, name: str) -> Worker:
        from .daemon_workers import ClientsWorker

        return self.group.worker(name, ClientsWorker, f"bench-daemon-{name}")

    def start_local(self) -> dict[str, int]:
        """The local daemon and workers A and B, each with a blocking and an asyncio
        client of it; their pids by label."""
        self.start_local_daemon()
        local = self.daemons["local"].local
        for name in ("A", "B"):
            self.start_worker(name)
            self.workers[name].call("connect", "blocking", local, "blocking", timeout=60)
            self.workers[name].call("connect", "aio", local, "aio", timeout=60)
        return {"rendezvousd": self.daemons["local"].pid, "client A (sender)": self.workers["A"].pid,
                "client B (receiver)": self.workers["B"].pid}

    def start_echo(self) -> dict[str, int]:
        """Worker E serving the bare gRPC echo, worker B its client; E's pid by label."""
        path = f"{self.dir}/echo.sock"
        self.start_worker("E").call("serve_echo", path, timeout=60)
        self.workers["B"].call("grpc_connect", path, timeout=60)
        return {"grpc echo server": self.workers["E"].pid}

    def start_cross(self, launcher: list[str]) -> dict[str, int]:
        """The two daemon pairs, the raw MPI ranks, and workers C0, C1 (clients of the
        grpc+mpi pair) and H0, H1 (of the grpc pair). Their pids by label."""
        self.start_mpi_daemons(launcher)
        self.start_grpc_daemons()
        self.start_raw_mpi(launcher)
        for name, daemon in (("C0", "mpi0"), ("C1", "mpi1"), ("H0", "grpc0"), ("H1", "grpc1")):
            self.start_worker(name).call("connect", "blocking", self.daemons[daemon].local, "blocking", timeout=60)
        return {"rendezvousd 0 (grpc+mpi)": self.daemons["mpi0"].pid,
                "rendezvousd 1 (grpc+mpi)": self.daemons["mpi1"].pid,
                "rendezvousd 0 (grpc)": self.daemons["grpc0"].pid,
                "rendezvousd 1 (grpc)": self.daemons["grpc1"].pid,
                "client A on daemon 0 (grpc+mpi)": self.workers["C0"].pid,
                "client B on daemon 1 (grpc+mpi)": self.workers["C1"].pid,
                "client A on daemon 0 (grpc)": self.workers["H0"].pid,
                "client B on daemon 1 (grpc)": self.workers["H1"].pid,
                **{f"raw MPI rank {i}": pid for i, pid in enumerate(self.raw_pids)}}

    def close(self) -> None:
        """Stop everything this run started; remove the socket folder."""
        if self.raw is not None:
            try:
                self.raw.send({"op": "stop"})
            except (OSError, BenchError):
                pass
        self.group.close()
        if self.raw is not None:
            self.raw.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- memory and CPU around a scenario -----------------------------------------------------

    @staticmethod
    def snapshot_start(procs: dict[str, int]) -> dict[str, Any]:
        """Reset each process's peak; note its RSS, CPU time and the time now."""
        start = {}
        for label, pid in procs.items():
            reset = rss.reset_peak_of(pid)
            start[label] = {"pid": pid, "reset": reset, "start_rss": rss.status_of(pid).get("VmRSS", 0),
                            "start_cpu": rss.cpu_seconds_of(pid), "start_time": time.monotonic()}
        return start

    def snapshot_end(self, scenario: str, start: dict[str, Any], daemons: list[str], workers: list[str]) -> None:
        """Record ``scenario``'s memory: each process's peak, RSS and CPU since
        :meth:`snapshot_start`, the ``daemons``' pools, the ``workers``' client counts."""
        procs = {}
        for label, info in start.items():
            st = rss.status_of(info["pid"])
            procs[label] = {**{k: v for k, v in info.items() if k not in ("start_cpu", "start_time")},
                            "peak_rss": st.get("VmHWM", 0), "end_rss": st.get("VmRSS", 0),
                            "end_anon": st.get("RssAnon", 0), "end_shmem": st.get("RssShmem", 0),
                            "cpu_s": round(rss.cpu_seconds_of(info["pid"]) - info["start_cpu"], 2),
                            "wall_s": round(time.monotonic() - info["start_time"], 2)}
        pools: dict[str, dict[str, Any]] = {}
        for name in daemons:
            try:
                pools[name] = self.daemons[name].pool()
            except OSError as exc:
                pools[name] = {"error": str(exc)}
        stats = {}
        for name in workers:
            stats[name] = self.workers[name].call("stats")
        self.memory[scenario] = {"processes": procs, "pools": pools, "client_stats": stats}

