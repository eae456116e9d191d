"""``rendezvous doctor``: is this node (and the path to a peer) fit to move tensors?

Run it before blaming the network. It looks at what the transports stand on,
then measures every way to move a tensor against its raw transport and says,
for each, whether it runs at its usual fraction of raw and, where it does
not, the likely cause:

1. **This machine**: cores, memory, shared memory (``/dev/shm``, memfd), the
   descriptor limit, a port to listen on, proxy settings that gRPC would
   follow, the GPU stack where one is present.
2. **MPI**, in a two-rank job (``mpiexec -n 2``, or one rank here and one on
   ``--peer``): the library, the thread level it grants, whether the ranks
   share a node, and, found by trying, whether a large message between two
   ranks of a node moves in a single copy (CMA and the like) or only as both
   ranks poll (:meth:`rendezvous.mpi.world.MpiWorld.probe_single_copy`), with
   the settings that decide it (``MPIR_CVAR_CH4_CMA_ENABLE``,
   ``kernel.yama.ptrace_scope``).
3. **The matrix**: ``rendezvous bench --guard`` with the floors this package
   ships (``rendezvous/bench/floors.json``): every cell's fraction of its raw
   transport, judged against its floor (set well below the usual figures:
   a cell below it is several times slower than it should be).

It prints each finding with a plain verdict (``ok``, ``warn``, ``SLOW``,
``FAILED``), then the causes it found for the slow cells, and exits 1 when a
check failed or a cell is below its floor, 0 otherwise (2: it could not run).
The last run's documents stay in ``--out`` (``doctor.json``, ``bench.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run", "Finding", "causes", "system_findings", "mpi_findings", "matrix_findings",
           "HELP", "DESCRIPTION"]

HELP = "check this node (and the way to a peer) and measure every path against its raw transport"
DESCRIPTION = ("Check what rendezvous stands on here (cores, shared memory, descriptors, ports, proxies, the GPU "
               "stack, MPI's thread level and whether it moves large messages in a single copy), then run the "
               "quick benchmark matrix and say, for every way to move a tensor, whether it runs at its usual "
               "fraction of the raw transport and, if not, the likely cause. Exits 1 when a path is far below "
               "its floor. With --peer, one rank runs on this host and one on the peer.")
_PROBE = "@doctor-probe "
GiB, MiB = 1 << 30, 1 << 20
#: /dev/shm below this is called small (the daemon's pool and MPI's shared-memory queues live there)
_SHM_LOW = 1 * GiB
#: a descriptor limit below this is called low (a connection per peer, a segment per pooled tensor)
_FDS_LOW = 4096


@dataclass
class Finding:
    """One thing the doctor found: an area, a verdict, what it saw."""

    area: str
    verdict: str  # "ok", "warn", "SLOW", "FAILED", "info"
    text: str
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def bad(self) -> bool:
        return self.verdict in ("SLOW", "FAILED")


# -- this machine --------------------------------------------------------------------

def system_findings(env: dict[str, str] | None = None, peer: str | None = None) -> list[Finding]:
    """What this host offers the transports (no MPI, no server started)."""
    env = dict(os.environ) if env is None else env
    out = []
    cpus = os.cpu_count() or 1
    out.append(Finding("cpu", "ok" if cpus >= 2 else "warn",
                       f"{cpus} core{'s' if cpus != 1 else ''}" + (
                           "" if cpus >= 2 else ": every rank's threads share one core; MPI's polling will "
                                                "take turns with gRPC's"), {"cpus": cpus}))
    try:
        st = os.statvfs("/dev/shm")
        shm = st.f_frsize * st.f_blocks
        free = st.f_frsize * st.f_bavail
        verdict = "ok" if shm >= _SHM_LOW else "warn"
        text = f"/dev/shm {shm / GiB:.1f} GiB ({free / GiB:.1f} free)"
        if verdict == "warn":
            text += ": small for MPI's shared-memory queues and a daemon's pool (tensors then cross in frames)"
        out.append(Finding("shared memory", verdict, text, {"shm_bytes": shm, "shm_free": free}))
    except OSError as exc:
        out.append(Finding("shared memory", "warn", f"/dev/shm cannot be read ({exc.strerror}): MPI within a "
                                                     "node and the daemon's pool need it"))
    from rendezvous.local.segments import available as memfd_available

    out.append(Finding("shared memory", "ok" if memfd_available() else "warn",
                       "memfd segments available (the daemon's zero-copy pool)" if memfd_available() else
                       "memfd_create is not available: a daemon's local clients move tensors inside frames"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    out.append(Finding("descriptors", "ok" if soft >= _FDS_LOW else "warn",
                       f"open files limit {soft} (hard {hard})" + (
                           "" if soft >= _FDS_LOW else f": low; a connection per peer and a descriptor per "
                                                       f"pooled tensor count against it (ulimit -n {_FDS_LOW})"),
                       {"nofile": soft, "nofile_hard": hard}))
    out.append(_port_finding(_own_address(peer)))
    proxies = {k: env[k] for k in ("grpc_proxy", "https_proxy", "http_proxy", "GRPC_PROXY", "HTTPS_PROXY",
                                   "HTTP_PROXY") if env.get(k)}
    if proxies:
        bypass = env.get("no_grpc_proxy") or env.get("no_proxy") or env.get("NO_PROXY") or ""
        hosts = ["127.0.0.1", "localhost"] + ([peer] if peer else [])
        unlisted = [h for h in hosts if h not in bypass and "*" not in bypass]
        out.append(Finding("proxy", "warn" if unlisted else "ok",
                           f"{', '.join(sorted(proxies))} set" + (
                               f": gRPC channels to {', '.join(unlisted)} go through the proxy unless no_proxy "
                               "lists them" if unlisted else ", every host of the job is in no_proxy"),
                           {"proxies": sorted(proxies), "unlisted": unlisted}))
    out.append(_gpu_finding())
    return out


def _own_address(peer: str | None) -> str:
    """The address this host reaches ``peer`` from (no packet sent), else loopback."""
    if not peer:
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 9))
        except OSError:
            return "127.0.0.1"
        return s.getsockname()[0]


def _port_finding(host: str) -> Finding:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family) as s:
            s.bind((host, 0))
            s.listen()
            port = s.getsockname()[1]
        return Finding("ports", "ok", f"a server can listen on {host} (port {port} was free)", {"host": host})
    except OSError as exc:
        return Finding("ports", "FAILED", f"cannot listen on {host}: {exc.strerror}", {"host": host})


def _gpu_finding() -> Finding:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return Finding("gpu", "info", "no NVIDIA GPU here (no nvidia-smi): GPU tensors are not checked")
    try:
        import cupy  # noqa: F401
    except ImportError:
        return Finding("gpu", "warn", "nvidia-smi runs but cupy is not installed: GPU tensors cannot be sent "
                                      "(pip install 'rendezvous[gpu]')")
    from rendezvous.devices.cupy_backend import CupyBackend

    backend = CupyBackend()
    if not backend.available():
        return Finding("gpu", "warn", "cupy is installed but no CUDA device is usable from it")
    return Finding("gpu", "ok", "cupy sees a CUDA device: GPU tensors are staged through pinned host memory "
                                "(make gpu-check measures them)")


# -- MPI ---------------------------------------------------------------------------------

def probe_rank() -> int:
    """One rank of the MPI probe job (``python -m mpi4py -m rendezvous.doctor --probe``):
    rank 0 prints what both found, as one line."""
    from rendezvous.mpi.world import MpiWorld

    world = MpiWorld.join()
    MPI = world.MPI
    world.comm = MPI.COMM_WORLD.Dup()
    remote, single = world._node()
    ptrace = _read("/proc/sys/kernel/yama/ptrace_scope")
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "thread_level": world.thread_level}
    ranks = world.comm.gather(mine, root=0)
    if world.rank == 0:
        print(_PROBE + json.dumps({
            "library": world.library, "thread_level": world.thread_level, "size": world.size,
            "remote_ranks": sorted(remote), "single_copy": single, "ptrace_scope": ptrace,
            "cma_setting": os.environ.get("MPIR_CVAR_CH4_CMA_ENABLE"), "ranks": ranks}), flush=True)
    world.comm.Free()
    return 0


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def mpi_findings(probe: dict[str, Any] | None, why: str = "") -> list[Finding]:
    """What the MPI probe job found (``probe`` None: it did not run, ``why``)."""
    if probe is None:
        return [Finding("mpi", "FAILED", f"the MPI probe job failed: {why}")]
    out = [Finding("mpi", "info", f"{probe['library']}, {probe['size']} ranks"
                                  + (", on two hosts" if probe["remote_ranks"] else ", on this node"),
                   {"library": probe["library"]})]
    level = probe["thread_level"]
    out.append(Finding("mpi", {"MULTIPLE": "ok", "SERIALIZED": "warn"}.get(level, "FAILED"),
                       f"thread level {level}" + {
                           "MULTIPLE": "", "SERIALIZED": ": transfers are posted by the progress thread only "
                                                         "(a hop more per transfer)"}.get(
                           level, ": grpc+mpi needs SERIALIZED or MULTIPLE"), {"thread_level": level}))
    single = probe["single_copy"]
    if single is None:
        out.append(Finding("mpi", "info", "no two ranks share a node: large messages cross the network",
                           {"single_copy": None}))
    elif single:
        out.append(Finding("mpi", "ok", "large messages within a node move in one copy by the receiver "
                                        "(a single-copy path such as CMA works here)", {"single_copy": True}))
    else:
        why = _cma_why(probe)
        out.append(Finding("mpi", "warn", "large messages within a node move only as both ranks poll: no "
                                          f"single-copy path ({why})", {"single_copy": False,
                                                                        "single_copy_why": why}))
    return out


def _cma_why(probe: dict[str, Any]) -> str:
    """Why MPI has no single copy here, as far as the settings say."""
    if probe.get("cma_setting") == "0":
        return "CMA unavailable: MPIR_CVAR_CH4_CMA_ENABLE=0 is set"
    scope = probe.get("ptrace_scope")
    if scope not in (None, "0"):
        return (f"CMA unavailable: kernel.yama.ptrace_scope={scope} forbids process_vm_readv between the ranks "
                "(sysctl kernel.yama.ptrace_scope=0)")
    return ("CMA unavailable: the kernel refused process_vm_readv (a container's seccomp profile, or a missing "
            "CAP_SYS_PTRACE), or the MPI library has no such path")


# -- the matrix --------------------------------------------------------------------------

def matrix_findings(doc: dict[str, Any], floors: Any) -> list[Finding]:
    """Every cell of the guard's run with its verdict against its floor."""
    from .bench.matrix import cells, rates, raw_ratios, reference
    from .bench.stats import format_size

    got, rate = cells(doc), rates(doc)
    out = []
    for (name, size), value in sorted(raw_ratios(doc).items()):
        floor = floors.raw.get(name, {}).get(size)
        slow = floor is not None and (value is None or value < floor)
        out.append(Finding("matrix", "SLOW" if slow else "ok",
                           f"raw {name} at {format_size(size)}: " + ("-" if value is None else f"{value:.3g}")
                           + " x a memcpy" + (f" (floor {floor:g})" if floor is not None else ""),
                           {"cell": f"raw {name}", "size": size, "ratio": value, "floor": floor,
                            "reference": "memcpy"}))
    for (name, size), value in sorted(got.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        floor = floors.cells.get(name, {}).get(size)
        ref = reference(name, size)
        slow = floor is not None and (value is None or value < floor)
        text = (f"{name} at {format_size(size)}: " + ("-" if value is None else f"{value:.3g}")
                + f" x raw {ref}" + (f" (floor {floor:g})" if floor is not None else ""))
        out.append(Finding("matrix", "SLOW" if slow else "ok", text,
                           {"cell": name, "size": size, "ratio": value, "floor": floor, "reference": ref}))
    for name, value in rate.items():
        floor = floors.rate.get(name)
        slow = floor is not None and (value is None or value < floor)
        ref = reference(name, doc["rate"]["bytes"])
        out.append(Finding("matrix", "SLOW" if slow else "ok",
                           f"{name}, many recvs in flight: " + ("-" if value is None else f"{value:.3g}")
                           + f" x raw {ref}" + (f" (floor {floor:g})" if floor is not None else ""),
                           {"cell": name, "size": 0, "ratio": value, "floor": floor, "reference": ref}))
    return out


def causes(findings: list[Finding]) -> list[str]:
    """The likely cause of each group of slow cells, from what the other checks found."""
    from .bench.matrix import MiB as _MiB

    slow = [f.facts for f in findings if f.area == "matrix" and f.verdict == "SLOW"]
    if not slow:
        return []
    facts: dict[str, Any] = {}
    for f in findings:
        if f.area != "matrix":
            facts.update(f.facts)
    out = []
    mpi_large = [c for c in slow if c.get("reference") in ("mpi", "memcpy") and c["size"] >= _MiB]
    grpc = [c for c in slow if c.get("reference") == "grpc"]
    local = [c for c in slow if str(c["cell"]).startswith("local_")]
    named: set[int] = set()
    if mpi_large and facts.get("single_copy") is False:
        out.append(f"MPI moves large messages only as it is polled here: {facts.get('single_copy_why')}; "
                   + _cells(mpi_large))
        named.update(id(c) for c in mpi_large)
    if grpc and facts.get("unlisted"):
        out.append(f"gRPC goes through the proxy in {', '.join(facts['proxies'])}: add the job's hosts to "
                   f"no_proxy; {_cells(grpc)}")
        named.update(id(c) for c in grpc)
    if local and facts.get("shm_bytes", _SHM_LOW) < _SHM_LOW:
        out.append(f"/dev/shm is small ({facts['shm_bytes'] / GiB:.1f} GiB): the daemon's pool cannot hold "
                   f"tensors; {_cells(local)}")
        named.update(id(c) for c in local)
    if facts.get("cpus", 2) < 2:
        out.append("one core: the ranks' event loops, gRPC's and MPI's threads take turns on it")
    rest = [c for c in slow if id(c) not in named]
    if rest:
        out.append("no cause found among the checks for " + _cells(rest) + ": the machine may have been busy "
                   "(run it again), or a path got slower (rendezvous bench --quick, and BENCHMARKS.md's figures)")
    return out


def _cells(cells: list[dict[str, Any]]) -> str:
    from .bench.stats import format_size

    return ", ".join(f"{c['cell']}" + (f" at {format_size(c['size'])}" if c["size"] else " in flight")
                     for c in cells)


# -- the command -------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peer", metavar="HOST",
                   help="run the second rank on HOST (through mpiexec's launcher: ssh, or RENDEZVOUS_MPIEXEC): "
                        "the path between two nodes; default both ranks here")
    p.add_argument("--floors", metavar="FILE", help="the floors to judge the matrix by (default the package's, "
                                                    "rendezvous/bench/floors.json)")
    p.add_argument("--out", default="bench-results/doctor", metavar="DIR",
                   help="where doctor.json and bench.json go (default bench-results/doctor)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="seconds the MPI jobs may take in all (default 600)")
    p.add_argument("--no-matrix", action="store_true", help="only the checks, not the benchmark matrix")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # a rank of the MPI probe job


def run(args: argparse.Namespace) -> int:
    if args.probe:
        return probe_rank()
    from .bench import procs
    from .bench.matrix import FLOORS_FILE, load_floors

    launcher = procs.mpiexec()
    if launcher is None:
        print(f"rendezvous doctor: {procs.NO_MPIEXEC}", file=sys.stderr)
        return 2
    try:
        floors = load_floors(args.floors or FLOORS_FILE)
    except (OSError, ValueError) as exc:
        print(f"rendezvous doctor: --floors {args.floors or FLOORS_FILE}: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hosts = [_own_address(args.peer), args.peer] if args.peer else None
    env = dict(os.environ)
    placement: list[str] = []
    if hosts:
        env["RENDEZVOUS_BENCH_HOSTS"] = ",".join(hosts)
        placement = ["-hosts", ",".join(hosts), "-ppn", "1"]

    findings = system_findings(env, args.peer)
    _print_section("this machine", findings)
    probe_cmd = [*launcher, *placement, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "rendezvous", "doctor",
                 "--probe"]
    done = procs.run("the MPI probe job", probe_cmd, min(args.timeout, 120), env=env)
    probe = next((procs.parse(line, _PROBE) for line in done.stdout if line.startswith(_PROBE)), None)
    why = "it ran past its time" if done.timed_out else f"exit status {done.code}: {done.stderr[-800:].strip()}"
    mpi = mpi_findings(probe if done.code == 0 else None, why)
    _print_section("MPI" + (f" (this host and {args.peer})" if args.peer else " (two ranks on this node)"), mpi)
    findings += mpi
    doc: dict[str, Any] = {"peer": args.peer, "probe": probe}
    if not args.no_matrix and probe is not None:
        bench_out = out / "matrix"
        cmd = [sys.executable, "-m", "rendezvous", "bench", "--guard", str(args.floors or FLOORS_FILE), "--out",
               str(bench_out)]
        print("the matrix: every way to move a tensor against its raw transport (about half a minute) ...",
              flush=True)
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        path = bench_out / "bench.json"
        if not path.exists():
            findings.append(Finding("matrix", "FAILED", f"the benchmark matrix did not run (exit status "
                                                        f"{result.returncode}): {result.stderr[-1500:].strip()}"))
        else:
            bench = json.loads(path.read_text())
            matrix = matrix_findings(bench, floors)
            _print_matrix(matrix)
            findings += matrix
            doc["bench"] = str(path)
    found = causes(findings)
    if found:
        print("\nlikely causes:")
        for c in found:
            print(f"  - {c}")
    bad = [f for f in findings if f.bad]
    slow = [f for f in bad if f.verdict == "SLOW"]
    failed = [f for f in bad if f.verdict == "FAILED"]
    if not bad:
        print(f"\ndoctor: every check passed and every path runs at its usual fraction of raw "
              f"({sum(1 for f in findings if f.area == 'matrix')} measured)")
    else:
        parts = ([f"{len(failed)} check(s) failed"] if failed else []) + \
                ([f"{len(slow)} path(s) far below their floor"] if slow else [])
        print(f"\ndoctor: {' and '.join(parts)}")
    doc.update(findings=[asdict(f) for f in findings], causes=found, ok=not bad)
    (out / "doctor.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"details: {out / 'doctor.json'}")
    return 1 if bad else 0


def _print_section(title: str, findings: list[Finding]) -> None:
    print(f"\n{title}:")
    for f in findings:
        print(f"  {f.verdict:<6} {f.area:<14} {f.text}")


def _print_matrix(findings: list[Finding]) -> None:
    from .bench.matrix import CELLS
    from .bench.stats import format_size

    print("\nevery path as a fraction of its raw transport (m raw MPI, g raw gRPC, c a memcpy), against its "
          "floor:")
    cells: dict[str, list[Finding]] = {}
    for f in findings:
        cells.setdefault(f.facts["cell"], []).append(f)
    order = [name for name in cells if name.startswith("raw ")] + [name for name, _ in CELLS if name in cells]
    for name in order:
        parts = []
        for f in sorted(cells[name], key=lambda f: f.facts["size"] or 1 << 62):
            size = format_size(f.facts["size"]) if f.facts["size"] else "in flight"
            value = f.facts["ratio"]
            ref = (f.facts.get("reference") or "")[:1]
            parts.append(f"{size} {'-' if value is None else format(value, '.3g')}{(' ' + ref) if ref else ''}"
                         + (" SLOW" if f.verdict == "SLOW" else ""))
        verdict = "SLOW" if any(f.verdict == "SLOW" for f in cells[name]) else "ok"
        print(f"  {verdict:<6} {name:<20} " + ", ".join(parts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rendezvous doctor", description=DESCRIPTION)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
