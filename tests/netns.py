#!/usr/bin/env python3
"""Hosts as Linux network namespaces: N "hosts" on one bridge, for multi-host runs on one machine.

Each host is a network namespace with its own loopback and one interface,
``eth0``, holding its own address (10.77.0.1, 10.77.0.2, ... by default). Its
eth0 is one end of a veth pair; the other end is a port of a bridge that lives
in a namespace of its own (the "switch"), so the machine's own network is
never touched. Processes in a host see only that host's interfaces: gRPC and
MPI between hosts cross the veth pairs and the bridge, as they would cross a
real network. Taking a switch port down is a pulled cable: the host's packets
vanish and nobody is told.

What the namespaces do not separate: the file system (and /dev/shm), process
ids and the hostname. MPI must therefore be told to treat every rank as
remote (:func:`mpi_network_env`), and each host's daemon needs its own socket
folder.

Command line (as root):

    tests/netns.py up --hosts 3           # build them; prints each host's name and address
    tests/netns.py exec h1 -- CMD ...     # run CMD in host h1
    tests/netns.py link h1 down           # pull h1's cable (and `up` to plug it back)
    tests/netns.py kill h1                # SIGKILL every process in h1
    tests/netns.py shape h1 200           # hold h1's cable to 200 Mbit/s (`shape h1 off`)
    tests/netns.py status                 # hosts, addresses, links, processes
    tests/netns.py down                   # remove everything `up` built
    tests/netns.py demo                   # the parameter-server demo across 3 hosts
    tests/netns.py bench-steps --steps 5  # rendezvous bench-steps, one rank on each of 2 hosts

mpiexec reaches the hosts the way it reaches real ones, through its ssh
launcher: ``mpiexec -hosts 10.77.0.1,10.77.0.2 -launcher ssh -launcher-exec
tests/netns-ssh ...``, run inside the first host (see :meth:`Net.mpiexec`).
Several harnesses can be up at once: each has its own prefix (``--prefix``,
default ``rdv``), and addresses only need to be unique within one.

As a library (the tests' fixtures use it):

    with Net(3) as net:
        proc = net.hosts[0].popen([...])
        net.link(net.hosts[1], up=False)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from proc_wait import wait_gone

ROOT = Path(__file__).resolve().parent.parent
SSH_SHIM = Path(__file__).resolve().parent / "netns-ssh"
IFACE = "eth0"

__all__ = ["Host", "Net", "unavailable", "sweep", "mpi_network_env", "bench_env", "IFACE", "SSH_SHIM"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _tool(name: str) -> str:
    """``name`` from the project's .venv, the running interpreter's folder, or PATH."""
    for folder in (ROOT / ".venv" / "bin", Path(sys.executable).parent):
        if (folder / name).exists():
            return str(folder / name)
    return shutil.which(name) or name


def unavailable() -> str | None:
    """Why hosts cannot be built here (None when they can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "building network namespaces needs root (run as root, or in a container with CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"rdvprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip() or made.returncode}"
    try:
        veth = _ip("link", "add", "name", "va", "netns", probe, "type", "veth", "peer", "name", "vb", "netns", probe,
                   check=False)
        if veth.returncode != 0:
            return f"cannot create a veth pair: {veth.stderr.strip()}"
        bridge = _ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if bridge.returncode != 0:
            return f"cannot create a bridge: {bridge.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def sweep(pattern: str = r"rt(\d+)") -> list[str]:
    """Remove the hosts of harnesses whose creator is gone: namespaces named
    ``<prefix>-sw`` or ``<prefix>-h<N>`` whose prefix matches ``pattern`` with
    the creating process's pid as its group (what a killed test run leaves)."""
    gone = []
    listed = _ip("netns", "list", check=False).stdout.splitlines()
    for ns in (line.split()[0] for line in listed if line.strip()):
        m = re.fullmatch(pattern + r"-(sw|h\d+)", ns)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", ns, check=False)
            gone.append(ns)
    return gone


def mpi_network_env(iface: str = IFACE) -> dict[str, str]:
    """Environment that puts MPICH on its network path between namespaces.

    The ranks share one kernel, one hostname and one /dev/shm, so MPICH would
    see them as one node and move bytes through shared memory. NOLOCAL makes
    every rank remote to MPICH; UCX (the ch4 netmod of the pip wheel) is held
    to TCP on the host's interface; for the ofi netmod the libfabric settings
    do the same."""
    return {
        "MPIR_CVAR_NOLOCAL": "1",
        "UCX_TLS": "tcp",
        "UCX_NET_DEVICES": iface,
        "FI_PROVIDER": "tcp",
        "FI_TCP_IFACE": iface,
    }


@dataclass(frozen=True)
class Host:
    """One host: a namespace with ``eth0`` at ``address``."""

    name: str      # short name: h0, h1, ...
    netns: str     # the namespace's name
    address: str   # eth0's IPv4 address
    port: str      # its switch port (in the switch namespace)

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` in this host (Popen's keyword arguments apply)."""
        return subprocess.Popen(self.argv(argv), **kwargs)

    def run(self, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("timeout", 60)
        return subprocess.run(self.argv(argv), **kwargs)

    def pids(self) -> list[int]:
        """Processes living in this host's namespace."""
        out = _ip("netns", "pids", self.netns, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]

    def counters(self) -> dict[str, int]:
        """eth0's byte and packet counters (what crossed this host's cable)."""
        base = f"/sys/class/net/{IFACE}/statistics"
        names = ("rx_bytes", "tx_bytes", "rx_packets", "tx_packets")
        out = self.run(["cat", *(f"{base}/{n}" for n in names)], capture_output=True, text=True,
                       check=True).stdout.split()
        return dict(zip(names, (int(v) for v in out)))


class Net:
    """``n`` hosts on one bridge; ``up()`` builds them, ``down()`` removes them."""

    def __init__(self, n: int = 3, prefix: str = "rdv", subnet: str = "10.77.0") -> None:
        if not 1 <= n <= 250:
            raise ValueError(f"between 1 and 250 hosts, not {n}")
        self.prefix = prefix
        self.switch = f"{prefix}-sw"
        self.hosts = [Host(f"h{i}", f"{prefix}-h{i}", f"{subnet}.{i + 1}", f"p{i}") for i in range(n)]

    # -- building -----------------------------------------------------------

    def up(self) -> "Net":
        self.down()  # whatever a killed run with the same prefix left
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for h in self.hosts:
                _ip("netns", "add", h.netns)
                _ip("link", "add", "name", IFACE, "netns", h.netns, "type", "veth",
                    "peer", "name", h.port, "netns", self.switch)
                _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", IFACE)
                _ip("-n", h.netns, "link", "set", "lo", "up")
                _ip("-n", h.netns, "link", "set", IFACE, "up")
                _ip("-n", self.switch, "link", "set", h.port, "master", "br0")
                _ip("-n", self.switch, "link", "set", h.port, "up")
        except subprocess.CalledProcessError as exc:
            self.down()
            raise RuntimeError(f"building hosts failed: {' '.join(exc.cmd)}: {exc.stderr.strip()}") from None
        return self

    def down(self) -> None:
        """Kill what runs in the hosts and remove them (and the switch). Idempotent."""
        present = {line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line}
        mine = {h.netns: h for h in self.hosts}
        for ns in sorted(present):
            if ns.startswith(f"{self.prefix}-h") and ns[len(self.prefix) + 2:].isdigit():
                self.kill(mine.get(ns) or Host(ns, ns, "", ""))
                _ip("netns", "del", ns, check=False)
        if self.switch in present:
            _ip("netns", "del", self.switch, check=False)

    def __enter__(self) -> "Net":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- faults -------------------------------------------------------------

    def host(self, name_or_address: str) -> Host:
        for h in self.hosts:
            if name_or_address in (h.name, h.netns, h.address):
                return h
        raise KeyError(f"no host {name_or_address!r} (hosts: {', '.join(h.name for h in self.hosts)})")

    def link(self, host: Host, up: bool) -> None:
        """Plug (``up``) or pull ``host``'s cable at the switch."""
        _ip("-n", self.switch, "link", "set", host.port, "up" if up else "down")

    def shape(self, host: Host, mbit: float | None) -> None:
        """Hold ``host``'s cable to ``mbit`` megabits per second each way (a token
        bucket at both ends), so that a transfer takes long enough to be cut in
        the middle; None: full speed again."""
        for ns, dev in ((self.switch, host.port), (host.netns, IFACE)):
            _ip("netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if mbit is not None:
                _ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                    "rate", f"{mbit:g}mbit", "burst", "256kb", "latency", "500ms")

    def link_up(self, host: Host) -> bool:
        out = _ip("-n", self.switch, "-o", "link", "show", host.port).stdout
        return "state UP" in out or ",UP" in out.split(">")[0]

    def kill(self, host: Host, sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
        """Send ``sig`` to every process in ``host``; with SIGKILL, wait until none is left."""
        deadline = time.monotonic() + timeout
        while True:  # again while the killed ones' children appear (a fork racing the kill)
            pids = host.pids()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            if sig != signal.SIGKILL or not pids:
                return
            left = wait_gone(pids, deadline - time.monotonic())  # on their exits
            if left:
                raise RuntimeError(f"processes {left} in {host.name} outlived SIGKILL for {timeout:g}s")

    # -- running ------------------------------------------------------------

    def launcher(self) -> list[str]:
        """mpiexec options that start each host's processes inside it (through ssh's seat)."""
        return ["-launcher", "ssh", "-launcher-exec", str(SSH_SHIM)]

    def mpiexec(self, argv: Sequence[str], hosts: Sequence[Host] | None = None, ppn: int = 1,
                mpiexec: str | None = None) -> list[str]:
        """A command line running ``argv`` on ``hosts`` (default all), ``ppn`` ranks each,
        with mpiexec itself in the first host, as it would run on a job's first node."""
        hosts = list(hosts or self.hosts)
        exe = mpiexec or _tool("mpiexec")
        return hosts[0].argv([exe, "-hosts", ",".join(h.address for h in hosts), "-ppn", str(ppn),
                              "-n", str(ppn * len(hosts)), *self.launcher(), *argv])

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for commands run through :meth:`mpiexec` (the shim finds hosts by it)."""
        return {**os.environ, "RENDEZVOUS_NETNS_PREFIX": self.prefix, **(extra or {})}

    def status(self) -> Iterator[str]:
        for h in self.hosts:
            try:
                link = "up" if self.link_up(h) else "DOWN"
                yield f"{h.name}  {h.netns:<12} {h.address:<15} link {link:<4}  processes {len(h.pids())}"
            except subprocess.CalledProcessError:
                yield f"{h.name}  {h.netns:<12} not built"


def _demo(net: Net, steps: int) -> int:
    """The parameter-server demo with one rank per host, gRPC only and grpc+mpi (MPI on the network)."""
    demo = ROOT / "examples" / "ps_training.py"
    hosts = ",".join(h.address for h in net.hosts[:3])
    env = net.env(mpi_network_env())
    env["RENDEZVOUS_MPIEXEC"] = " ".join([_tool("mpiexec"), *net.launcher()])
    before = [h.counters() for h in net.hosts[:3]]
    code = net.hosts[0].run([_tool("python"), str(demo), "--hosts", hosts, "--steps", str(steps)],
                            env=env, timeout=900).returncode
    after = [h.counters() for h in net.hosts[:3]]
    for h, b, a in zip(net.hosts, before, after):
        print(f"{h.name} ({h.address}) eth0: sent {(a['tx_bytes'] - b['tx_bytes']) / 2**20:,.1f} MiB, "
              f"received {(a['rx_bytes'] - b['rx_bytes']) / 2**20:,.1f} MiB")
    return code


def bench_env(net: Net, hosts: Sequence[Host]) -> dict[str, str]:
    """The environment for ``rendezvous bench-steps`` run in ``hosts[0]`` with one
    rank on each of ``hosts``: its mpiexec reaches them through ssh's seat, MPI
    and gloo on the network path (gloo on eth0: the shared hostname resolves to
    no address of a namespace host)."""
    return net.env({**mpi_network_env(), "GLOO_SOCKET_IFNAME": IFACE, "GRPC_VERBOSITY": "ERROR",
                    "RENDEZVOUS_MPIEXEC": " ".join([_tool("mpiexec"), *net.launcher()]),
                    "RENDEZVOUS_BENCH_HOSTS": ",".join(h.address for h in hosts)})


def _bench_steps(net: Net, flags: Sequence[str]) -> int:
    """``rendezvous bench-steps FLAGS`` with rank 0 in h0 and rank 1 in h1 (it prints its tables)."""
    hosts = net.hosts[:2]
    before = [h.counters() for h in hosts]
    code = hosts[0].run([_tool("python"), "-m", "rendezvous", "bench-steps", *flags], env=bench_env(net, hosts),
                        timeout=None).returncode
    after = [h.counters() for h in hosts]
    for h, b, a in zip(hosts, before, after):
        print(f"{h.name} ({h.address}) eth0: sent {(a['tx_bytes'] - b['tx_bytes']) / 2**20:,.1f} MiB, "
              f"received {(a['rx_bytes'] - b['rx_bytes']) / 2**20:,.1f} MiB")
    return code


def main(argv: list[str] | None = None) -> int:
    naming = argparse.ArgumentParser(add_help=False)
    naming.add_argument("--prefix", default="rdv", help="namespace name prefix (default rdv)")
    naming.add_argument("--subnet", default="10.77.0", help="first three octets of the hosts' /24 (default 10.77.0)")
    common = argparse.ArgumentParser(add_help=False, parents=[naming])
    common.add_argument("--hosts", type=int, default=3, help="number of hosts (default 3)")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up", parents=[common], help="build the hosts")
    sub.add_parser("down", parents=[common], help="remove the hosts")
    sub.add_parser("status", parents=[common], help="hosts, addresses, links")
    ex = sub.add_parser("exec", parents=[common], help="run a command in a host")
    ex.add_argument("host")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    lk = sub.add_parser("link", parents=[common], help="pull (down) or plug (up) a host's cable")
    lk.add_argument("host")
    lk.add_argument("state", choices=["up", "down"])
    kl = sub.add_parser("kill", parents=[common], help="SIGKILL every process in a host")
    kl.add_argument("host")
    sh = sub.add_parser("shape", parents=[common], help="hold a host's cable to MBIT megabits/s (or off)")
    sh.add_argument("host")
    sh.add_argument("mbit")
    dm = sub.add_parser("demo", parents=[common], help="build 3 hosts, run the PS demo across them, remove them")
    dm.add_argument("--steps", type=int, default=20)
    bench = ("build 2 hosts, run rendezvous bench-steps with a rank on each, remove them; every other flag is "
             "bench-steps' own (rendezvous bench-steps --help)")
    sub.add_parser("bench-steps", parents=[naming], allow_abbrev=False, help=bench, description=bench)
    args, rest = p.parse_known_args(argv)
    if args.cmd != "bench-steps" and rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    args.bench = rest
    try:
        return _command(p, args)
    except (subprocess.CalledProcessError, KeyError, RuntimeError) as exc:
        detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else exc
        print(f"netns: {detail}", file=sys.stderr)
        return 1


def _command(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:

    why = unavailable() if args.cmd in ("up", "demo", "bench-steps") else None
    if why:
        print(f"netns: {why}", file=sys.stderr)
        return 2
    n = 2 if args.cmd == "bench-steps" else max(args.hosts, 3) if args.cmd == "demo" else args.hosts
    net = Net(n, args.prefix, args.subnet)
    if args.cmd == "up":
        net.up()
        for line in net.status():
            print(line)
        print(f"mpiexec: RENDEZVOUS_NETNS_PREFIX={net.prefix} {' '.join(net.mpiexec(['CMD']))}")
    elif args.cmd == "down":
        net.down()
    elif args.cmd == "status":
        for line in net.status():
            print(line)
    elif args.cmd == "exec":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            p.error("exec needs a command")
        return net.host(args.host).run(command, timeout=None).returncode
    elif args.cmd == "link":
        net.link(net.host(args.host), args.state == "up")
    elif args.cmd == "kill":
        net.kill(net.host(args.host))
    elif args.cmd == "shape":
        net.shape(net.host(args.host), None if args.mbit == "off" else float(args.mbit))
    elif args.cmd == "demo":
        with net:
            return _demo(net, args.steps)
    elif args.cmd == "bench-steps":
        with net:
            return _bench_steps(net, args.bench)
    return 0


if __name__ == "__main__":
    sys.exit(main())
