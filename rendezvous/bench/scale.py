"""``rendezvous bench-scale``: what one rank costs as the number of peers grows.

For every N of ``--ranks`` and every setup of ``--setups``, N ranks run on
this machine, each one blocking :class:`rendezvous.Server` (job ``worker``,
task = rank), in two setups:

* ``grpc``: protocol ``grpc``; N plain processes, each binds
  ``127.0.0.1:0`` and reports its address, and the parent hands the whole
  cluster back (what :func:`rendezvous.launch.run_local` does);
* ``grpc+mpi``: protocol ``grpc+mpi`` under ``mpiexec -n N``; cluster entries
  ``127.0.0.1:0``, resolved by the MPI allgather in ``Server.start()``.

Each rank times its server's construction (under ``grpc+mpi`` that is
``MPI_Init``, in ``MpiWorld.join``) and ``start()`` (bind and serve; under
``grpc+mpi`` also the allgather that builds the rank map, timed on its own
too), then measures its own process twice: before any traffic, and after a
full-mesh exchange (every rank sends one 64-byte and one 1 MiB tensor to
every other rank and receives both from every other rank) once every rank
is done with it. A measurement is read from ``/proc/self``: established
TCP connections owned by the process (its socket fds matched against the
inodes of ``/proc/net/tcp`` and ``tcp6``), split into connections to peers'
servers (outgoing: one per gRPC channel), connections peers opened to this
rank's server (incoming) and any other; threads (``/proc/self/task``, by
name); open file descriptors (by kind); RSS and its high-water mark
(``VmHWM``). Received arrays are dropped and free heap handed back
(``malloc_trim``) before each measurement, so what stays is what the
connections, channels and tables hold, not the payload.

The parent talks to the ranks over a Unix socket of its own (not TCP; its fd
is left out of the counts), which is also the barrier between phases: no
rank measures "before" while another already sends, and no rank measures
"after" while a peer may still fetch from it. Every job has a deadline
(``--timeout``); on expiry, on a rank's error or on a rank dying, every
process of the job is killed (its process group) and the run fails.

Writes ``scale.json`` and ``scale.md`` into ``--out`` (default
``benchmarks``): per setup and N, the per-rank medians before and after;
the increments per peer between the smallest and the largest N; start-up.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["main", "SETUPS", "run_job", "snapshot", "build", "render"]

SETUPS = ("grpc", "grpc+mpi")
JSON_NAME = "scale.json"
MARKDOWN_NAME = "scale.md"
JOB = "worker"
SMALL_BYTES = 64       # inline on both setups (below the MPI threshold)
BIG_BYTES = 1 << 20    # the MPI optimal path under grpc+mpi
STEP = 1
KiB, MiB = 1 << 10, 1 << 20


# -- measuring one process --------------------------------------------------------------------

_TCP_STATES = {"01": "ESTABLISHED", "0A": "LISTEN"}


def _address(hex_addr: str) -> tuple[str, int]:
    """``0100007F:1F90`` (as /proc/net/tcp writes it) -> ("127.0.0.1", 8080)."""
    host, _, port = hex_addr.partition(":")
    raw = bytes.fromhex(host)
    # each 32-bit word is printed in host byte order (little-endian here)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    if len(words) == 4:
        ip = socket.inet_ntop(socket.AF_INET, words)
    else:
        ip = socket.inet_ntop(socket.AF_INET6, words)
        if ip.startswith("::ffff:") and "." in ip:
            ip = ip[len("::ffff:"):]
    return ip, int(port, 16)


def _tcp_table() -> dict[int, tuple[tuple[str, int], tuple[str, int], str]]:
    """inode -> (local, remote, state) for every TCP socket of this network namespace."""
    table = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if len(parts) < 10:
                        continue
                    inode = int(parts[9])
                    if inode:
                        table[inode] = (_address(parts[1]), _address(parts[2]), parts[3])
        except OSError:
            pass
    return table


def _unix_inodes() -> set[int]:
    try:
        with open("/proc/net/unix") as f:
            next(f)
            return {int(p[6]) for p in (line.split() for line in f) if len(p) > 6}
    except OSError:
        return set()


def _fd_kind(target: str, tcp: dict, unix: set[int]) -> str:
    if target.startswith("socket:["):
        inode = int(target[8:-1])
        return "socket tcp" if inode in tcp else "socket unix" if inode in unix else "socket other"
    if target.startswith("pipe:"):
        return "pipe"
    if target.startswith("anon_inode:"):
        return target[len("anon_inode:"):].strip("[]") or "anon_inode"
    if target.startswith("/dev/shm/"):
        return "/dev/shm file"
    if target.startswith("/dev/"):
        return target
    if target.startswith("/memfd:"):
        return "memfd"
    return "file"


def _thread_names() -> dict[str, int]:
    """Threads by name: Python threads by their ``threading`` name (``py:...``),
    the others (gRPC's, OpenBLAS's, MPI's) by their kernel name."""
    python = {t.native_id: t.name for t in threading.enumerate()}
    names: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        if int(tid) in python:
            name = "py:" + python[int(tid)]
        else:
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
            except OSError:
                continue  # the thread ended meanwhile
        names[name] = names.get(name, 0) + 1
    return dict(sorted(names.items()))


def snapshot(own_port: int | None = None, peers: set[tuple[str, int]] | frozenset = frozenset(),
             exclude_fds: set[int] | frozenset = frozenset()) -> dict[str, Any]:
    """This process now (Linux ``/proc``): TCP connections (established, split into
    to peers' servers, from peers into ``own_port``, and other), listening sockets,
    threads, open fds (less ``exclude_fds``), RSS and its high-water mark."""
    from .rss import current, peak

    tcp = _tcp_table()
    unix = _unix_inodes()
    kinds: dict[str, int] = {}
    counts = {"tcp_established": 0, "tcp_peer_out": 0, "tcp_peer_in": 0, "tcp_other": 0, "tcp_listen": 0}
    fds = 0
    fd_dir = "/proc/self/fd"
    for entry in os.listdir(fd_dir):
        fd = int(entry)
        if fd in exclude_fds:
            continue
        try:
            target = os.readlink(f"{fd_dir}/{entry}")
        except OSError:
            continue  # the listing's own descriptor, closed by now
        fds += 1
        kind = _fd_kind(target, tcp, unix)
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind != "socket tcp":
            continue
        local, remote, state = tcp[int(target[8:-1])]
        if state == "0A":
            counts["tcp_listen"] += 1
        elif state == "01":
            counts["tcp_established"] += 1
            if own_port is not None and local[1] == own_port:
                counts["tcp_peer_in"] += 1
            elif remote in peers:
                counts["tcp_peer_out"] += 1
            else:
                counts["tcp_other"] += 1
    names = _thread_names()
    return {**counts, "tcp_peer": counts["tcp_peer_in"] + counts["tcp_peer_out"],
            "threads": sum(names.values()), "thread_names": names, "fds": fds,
            "fds_less_pipes": fds - kinds.get("pipe", 0), "fd_kinds": dict(sorted(kinds.items())),
            "rss_bytes": current(), "peak_rss_bytes": peak(), **_rss_parts()}


def _rss_parts() -> dict[str, int]:
    """RSS by kind of page: anonymous (heap, stacks), file-backed, shared memory."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("RssAnon", "RssFile", "RssShmem"):
                out[f"rss_{name[3:].lower()}_bytes"] = int(rest.split()[0]) * 1024
    # file-backed pages (the shared libraries' text) come and go with the page
    # cache; what the process itself holds is the rest
    out["rss_less_file_bytes"] = out.get("rss_anon_bytes", 0) + out.get("rss_shmem_bytes", 0)
    return out


# -- one rank ----------------------------------------------------------------------------------

class _Control:
    """A rank's end of the parent's Unix socket: one JSON object per line."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.reader = self.sock.makefile("rb")  # shares the socket's descriptor

    def send(self, kind: str, **fields: Any) -> None:
        self.sock.sendall(json.dumps({"kind": kind, **fields}).encode() + b"\n")

    def expect(self, kind: str) -> dict[str, Any]:
        line = self.reader.readline()
        if not line:
            raise ConnectionError(f"the parent went away while this rank waited for {kind!r}")
        msg = json.loads(line)
        if msg.get("kind") != kind:
            raise RuntimeError(f"expected {kind!r} from the parent, got {msg.get('kind')!r}")
        return msg


def _key(src: int, dst: int, name: str) -> str:
    from rendezvous.keys import make_key

    dev = "/job:{}/replica:0/task:{}/device:CPU:0"
    return make_key(dev.format(JOB, src), dev.format(JOB, dst), name).format()


def _peer_addresses(cluster: Any, me: Any) -> set[tuple[str, int]]:
    from rendezvous.cluster import parse_address

    out = set()
    for task in cluster.tasks():
        if task != me:
            host, port = parse_address(cluster.address(task))
            out.add((host, int(port)))
    return out


def _rank_main(path: str, setup: str, n: int, index: int, big_bytes: int) -> int:
    ctl = _Control(path)
    try:
        _rank(ctl, setup, n, index, big_bytes)
    except BaseException:
        try:
            ctl.send("error", traceback=traceback.format_exc())
        except OSError:
            pass
        # Never wait in MPI_Finalize for ranks that will not come: the parent
        # kills the job on this message anyway.
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    return 0


def _rank(ctl: _Control, setup: str, n: int, index: int, big_bytes: int) -> None:
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    import numpy as np

    from rendezvous import sync
    from rendezvous.cluster import parse_address
    from rendezvous.launch import launcher_rank

    from .rss import release_free_memory

    exclude = {ctl.sock.fileno()}
    overrides: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    if setup == "grpc+mpi":
        where = launcher_rank()
        if where is None:
            raise RuntimeError("grpc+mpi ranks must run under mpiexec")
        index = where[0]
        overrides["mpi_disabled"] = False
        from rendezvous.mpi.world import MpiWorld

        # Time the allgather that builds the rank map, from inside start(): the
        # clock is CLOCK_MONOTONIC, shared by every process of this machine, so
        # the parent can tell the collective's own cost from ranks arriving late.
        exchange = MpiWorld.exchange

        def timed_exchange(world: Any, task: Any, address: str) -> Any:
            from mpi4py import MPI

            timings["exchange_entered"] = time.monotonic()
            table = exchange(world, task, address)
            timings["exchange_left"] = time.monotonic()
            # what each rank contributes, as world.exchange builds and mpi4py pickles it
            timings["entry_bytes"] = len(MPI.pickle.dumps((task.job, task.replica, task.task, address)))
            timings["entries"] = len(table)
            return table

        MpiWorld.exchange = timed_exchange  # type: ignore[method-assign]
    cluster = {JOB: ["127.0.0.1:0"] * n}
    t0 = time.monotonic()
    server = sync.Server(cluster, JOB, index, setup, **overrides)
    t1 = time.monotonic()
    server.start()
    t2 = time.monotonic()
    try:
        ctl.send("started", rank=index, pid=os.getpid(), address=server.target,
                 construct_s=t1 - t0, construct_entered=t0, construct_left=t1, start_s=t2 - t1,
                 start_entered=t1, start_left=t2, **timings)
        full = ctl.expect("cluster").get("cluster")
        if full:
            server.update_cluster(full)
        own_port = int(parse_address(server.target)[1])
        peers = _peer_addresses(server.aio.cluster, server.task)
        release_free_memory()
        before = snapshot(own_port, peers, exclude)
        ctl.send("before", snapshot=before)
        ctl.expect("go")

        others = [p for p in range(n) if p != index]
        small = np.arange(SMALL_BYTES // 4, dtype=np.float32) + index
        big = np.full(big_bytes // 4, index, dtype=np.float32)  # one array, sent to every peer
        t3 = time.monotonic()
        for p in others:
            server.send(_key(index, p, "small"), small, step_id=STEP)
            server.send(_key(index, p, "big"), big, step_id=STEP)
        received = 0
        for p in others:
            a = server.recv(_key(p, index, "small"), STEP, timeout=120)
            b = server.recv(_key(p, index, "big"), STEP, timeout=120)
            if a.nbytes != SMALL_BYTES or b.nbytes != big.nbytes or a[1] != 1 + p or b[0] != p or b[-1] != p:
                raise AssertionError(f"rank {index}: wrong tensors from rank {p}")
            received += a.nbytes + b.nbytes
            del a, b
        exchange_s = time.monotonic() - t3
        stats = {path: {"transfers": s.get("transfers", 0), "bytes": s.get("bytes", 0),
                        "served": s.get("served", 0)}
                 for path, s in server.stats().items() if path in ("local", "grpc", "mpi")}
        ctl.send("exchanged", exchange_s=exchange_s, received_bytes=received, stats=stats)
        ctl.expect("measure")
        release_free_memory()
        after = snapshot(own_port, peers, exclude)
        extra: dict[str, Any] = {"nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
                                 "event_loop": f"{type(server.loop).__module__}.{type(server.loop).__name__}"}
        if setup == "grpc+mpi":
            from mpi4py import MPI

            extra["mpi"] = " ".join(MPI.Get_library_version().splitlines()[0].split())
        ctl.send("after", snapshot=after, **extra)
        if setup == "grpc+mpi":
            # A second allgather of the same entries, all ranks lined up by a
            # barrier first: the collective alone, its endpoints already made.
            from mpi4py import MPI

            world = MPI.COMM_WORLD
            entry = (JOB, 0, index, server.target)
            world.Barrier()
            t4 = time.monotonic()
            world.allgather(entry)
            ctl.send("warm", allgather_s=time.monotonic() - t4)
        ctl.expect("exit")
    finally:
        server.stop(1.0)


# -- the parent: one job -------------------------------------------------------------------------

class JobFailed(Exception):
    """A job of the run failed, hung or answered wrongly."""


class _Job:
    """N ranks of one setup, their control connections, and their processes."""

    def __init__(self, setup: str, n: int, timeout: float, big_bytes: int) -> None:
        self.setup, self.n, self.big_bytes = setup, n, big_bytes
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.dir = tempfile.mkdtemp(prefix="rdv-scale-")
        self.path = os.path.join(self.dir, "ctl")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(n)
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []
        self.conns: dict[socket.socket, bytearray] = {}
        self.rank_of: dict[socket.socket, int] = {}

    def _spawn(self, name: str, argv: list[str]) -> None:
        err = Path(self.dir) / f"{name}.err"
        env = {**os.environ}
        env.setdefault("GRPC_VERBOSITY", "ERROR")
        with open(err, "wb") as stderr:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr, env=env,
                                    start_new_session=True)  # its own process group, killed as one
        self.procs.append((name, proc, err))

    def launch(self) -> None:
        child = [sys.executable, "-m", "rendezvous.bench.scale", "--child", self.path, self.setup, str(self.n)]
        if self.setup == "grpc":
            for i in range(self.n):
                self._spawn(f"rank{i}", [*child, str(i), str(self.big_bytes)])
        else:
            from .cli import _mpiexec

            launcher = _mpiexec()
            if launcher is None:
                raise JobFailed("no mpiexec found (pip install 'rendezvous[mpi]', or set RENDEZVOUS_MPIEXEC)")
            self._spawn("mpiexec", [*launcher, "-n", str(self.n), *child, "-1", str(self.big_bytes)])

    def _check_procs(self) -> None:
        for name, proc, err in self.procs:
            code = proc.poll()
            if code is not None and code != 0:
                raise JobFailed(f"{self.setup} N={self.n}: {name} exited with status {code}\n{self._tail(err)}")

    @staticmethod
    def _tail(err: Path, n: int = 4000) -> str:
        try:
            return err.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def _left(self, what: str) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            tails = "".join(f"--- {name}:\n{self._tail(err, 1500)}" for name, _, err in self.procs)
            raise JobFailed(f"{self.setup} N={self.n}: no {what} within --timeout {self.timeout:g}s\n{tails}")
        return left

    def accept(self) -> None:
        self.listener.setblocking(False)
        with selectors.DefaultSelector() as sel:
            sel.register(self.listener, selectors.EVENT_READ)
            while len(self.conns) < self.n:
                sel.select(min(self._left("connection from every rank"), 0.5))
                self._check_procs()
                try:
                    conn, _ = self.listener.accept()
                except BlockingIOError:
                    continue
                conn.setblocking(False)
                self.conns[conn] = bytearray()

    def gather(self, kind: str) -> dict[int, dict[str, Any]]:
        """One ``kind`` message from every rank, by rank."""
        got: dict[socket.socket, dict[str, Any]] = {}
        with selectors.DefaultSelector() as sel:
            for conn in self.conns:
                sel.register(conn, selectors.EVENT_READ)
            while len(got) < len(self.conns):
                for conn, buf in self.conns.items():
                    if conn not in got and b"\n" in buf:
                        line, _, rest = bytes(buf).partition(b"\n")
                        self.conns[conn] = bytearray(rest)
                        msg = json.loads(line)
                        if msg.get("kind") == "error":
                            raise JobFailed(f"{self.setup} N={self.n}: rank {self.rank_of.get(conn, '?')} "
                                            f"failed:\n{msg.get('traceback')}")
                        if msg.get("kind") != kind:
                            raise JobFailed(f"{self.setup} N={self.n}: expected {kind!r}, got {msg.get('kind')!r}")
                        if kind == "started":
                            self.rank_of[conn] = int(msg["rank"])
                        got[conn] = msg
                if len(got) == len(self.conns):
                    break
                for key, _ in sel.select(min(self._left(f"{kind!r} from every rank"), 0.5)):
                    conn = key.fileobj
                    data = conn.recv(1 << 20)  # type: ignore[union-attr]
                    if not data:
                        raise JobFailed(f"{self.setup} N={self.n}: rank {self.rank_of.get(conn, '?')} closed its "
                                        f"control connection before {kind!r}\n"
                                        + "".join(self._tail(err, 1500) for _, _, err in self.procs))
                    self.conns[conn] += data  # type: ignore[index]
                self._check_procs()
        by_rank = {self.rank_of[c]: m for c, m in got.items()}
        if sorted(by_rank) != list(range(self.n)):
            raise JobFailed(f"{self.setup} N={self.n}: ranks {sorted(by_rank)} answered, expected 0..{self.n - 1}")
        return by_rank

    def broadcast(self, kind: str, **fields: Any) -> None:
        data = json.dumps({"kind": kind, **fields}).encode() + b"\n"
        for conn in self.conns:
            conn.setblocking(True)
            conn.settimeout(max(1.0, self._left(f"sending {kind!r}")))
            conn.sendall(data)
            conn.setblocking(False)

    def finish(self) -> None:
        """Wait for every process to exit on its own (within the deadline)."""
        for name, proc, err in self.procs:
            try:
                code = proc.wait(max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise JobFailed(f"{self.setup} N={self.n}: {name} did not exit\n{self._tail(err)}") from None
            if code != 0:
                raise JobFailed(f"{self.setup} N={self.n}: {name} exited with status {code}\n{self._tail(err)}")

    def close(self) -> None:
        for _, proc, _ in self.procs:
            try:  # the whole group: mpiexec's ranks may outlive mpiexec
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for conn in self.conns:
            conn.close()
        self.listener.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def run_job(setup: str, n: int, timeout: float, big_bytes: int = BIG_BYTES) -> dict[str, Any]:
    """Run one job (``setup`` with ``n`` ranks, each sending every peer a 64-byte and
    a ``big_bytes`` tensor) and return its raw per-rank results."""
    if setup not in SETUPS:
        raise ValueError(f"unknown setup {setup!r}; known: {', '.join(SETUPS)}")
    if n < 2:
        raise ValueError("a job needs at least 2 ranks")
    if big_bytes < 4 or big_bytes % 4:
        raise ValueError("big_bytes must be a positive multiple of 4")
    job = _Job(setup, n, timeout, big_bytes)
    t0 = time.monotonic()
    try:
        job.launch()
        job.accept()
        started = job.gather("started")
        cluster = {JOB: [started[i]["address"] for i in range(n)]} if setup == "grpc" else None
        job.broadcast("cluster", cluster=cluster)
        before = job.gather("before")
        job.broadcast("go")
        exchanged = job.gather("exchanged")
        job.broadcast("measure")
        after = job.gather("after")
        warm = job.gather("warm") if setup == "grpc+mpi" else {}
        job.broadcast("exit")
        job.finish()
    finally:
        job.close()
    ranks = []
    for i in range(n):
        s = started[i]
        rank = {k: v for k, v in s.items() if k != "kind"}
        rank.update(before=before[i]["snapshot"], after=after[i]["snapshot"],
                    exchange_s=exchanged[i]["exchange_s"], received_bytes=exchanged[i]["received_bytes"],
                    stats=exchanged[i]["stats"], nofile=after[i]["nofile"], event_loop=after[i]["event_loop"])
        if "mpi" in after[i]:
            rank["mpi"] = after[i]["mpi"]
        if i in warm:
            rank["warm_allgather_s"] = warm[i]["allgather_s"]
        ranks.append(rank)
    return {"setup": setup, "ranks": n, "big_bytes": big_bytes, "wall_s": time.monotonic() - t0, "per_rank": ranks}


# -- the results document ------------------------------------------------------------------------

#: measured numbers summarized per N (median over ranks), before and after
_FIELDS = ("tcp_established", "tcp_peer", "tcp_peer_out", "tcp_peer_in", "tcp_other", "tcp_listen", "threads",
           "fds", "fds_less_pipes", "rss_bytes", "peak_rss_bytes", "rss_anon_bytes", "rss_file_bytes",
           "rss_shmem_bytes", "rss_less_file_bytes")
#: the per-peer increments: (name in the document, field, phase, scale)
_PER_PEER = (("connections", "tcp_established", "after", 1), ("peer_connections", "tcp_peer", "after", 1),
             ("threads", "threads", "after", 1), ("fds", "fds", "after", 1),
             ("fds_less_pipes", "fds_less_pipes", "after", 1),
             ("rss_kib", "rss_bytes", "after", 1 / KiB), ("rss_anon_kib", "rss_anon_bytes", "after", 1 / KiB),
             ("rss_shmem_kib", "rss_shmem_bytes", "after", 1 / KiB),
             ("rss_less_file_kib_before", "rss_less_file_bytes", "before", 1 / KiB))


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _summarize(raw: dict[str, Any]) -> dict[str, Any]:
    ranks = raw["per_rank"]
    med = {phase: {f: _median([r[phase][f] for r in ranks]) for f in _FIELDS} for phase in ("before", "after")}
    start = {"construct_s": _median([r["construct_s"] for r in ranks]),
             "start_s": _median([r["start_s"] for r in ranks]),
             "exchange_s": _median([r["exchange_s"] for r in ranks])}
    # A collective's own cost: from the last rank entering it to the last leaving.
    start["construct_after_last_s"] = (max(r["construct_left"] for r in ranks)
                                       - max(r["construct_entered"] for r in ranks))
    if all("exchange_entered" in r for r in ranks):
        start["allgather_after_last_s"] = (max(r["exchange_left"] for r in ranks)
                                           - max(r["exchange_entered"] for r in ranks))
        start["allgather_s"] = _median([r["exchange_left"] - r["exchange_entered"] for r in ranks])
        start["entry_bytes"] = _median([r["entry_bytes"] for r in ranks])
        start["rank_map_bytes"] = sum(r["entry_bytes"] for r in ranks)  # what every rank receives
    if all("warm_allgather_s" in r for r in ranks):
        start["warm_allgather_s"] = _median([r["warm_allgather_s"] for r in ranks])
    paths: dict[str, int] = {}
    for r in ranks:
        for path, s in r["stats"].items():
            paths[path] = paths.get(path, 0) + s["transfers"]
    return {**raw, "median": med, "startup": start, "transfers_by_path": paths}


def _per_peer(runs: list[dict[str, Any]], setup: str) -> dict[str, Any] | None:
    mine = sorted((r for r in runs if r["setup"] == setup), key=lambda r: r["ranks"])
    if len(mine) < 2 or mine[0]["ranks"] == mine[-1]["ranks"]:
        return None
    lo, hi = mine[0], mine[-1]
    peers = hi["ranks"] - lo["ranks"]
    out: dict[str, Any] = {"from_ranks": lo["ranks"], "to_ranks": hi["ranks"]}
    for name, field, phase, scale in _PER_PEER:
        out[name] = (hi["median"][phase][field] - lo["median"][phase][field]) * scale / peers
    return out


def _environment(runs: list[dict[str, Any]]) -> dict[str, Any]:
    import grpc
    import numpy as np

    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "numpy": np.__version__,
        "grpcio": grpc.__version__,
    }
    for run in runs:
        first = run["per_rank"][0]
        if "mpi" in first:
            env["mpi"] = first["mpi"]
        env["event_loop"] = first["event_loop"]
        env["nofile"] = "/".join(str(x) for x in first["nofile"])
    return env


def build(runs: list[dict[str, Any]], args: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The results document from :func:`run_job`'s results."""
    from rendezvous.config import Config

    cfg = Config.load()
    summarized = [_summarize(r) for r in runs]
    setups = [s for s in SETUPS if any(r["setup"] == s for r in runs)]
    return {
        "kind": "rendezvous bench-scale",
        "version": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
        "args": args,
        "environment": _environment(runs),
        "config": {name: getattr(cfg, name) for name in
                   ("keepalive_time", "keepalive_timeout", "chunk_bytes", "mpi_threshold", "max_waiting_calls",
                    "retry_window", "retry_cache_bytes", "recv_cache_bytes")},
        "tensors": {"small_bytes": SMALL_BYTES, "big_bytes": args["big_bytes"]},
        "runs": summarized,
        "per_peer": {s: _per_peer(summarized, s) for s in setups},
    }


def render(doc: dict[str, Any]) -> str:
    """The results as Markdown."""
    from .report import _f, _md
    from .stats import format_size

    env = doc["environment"]
    cfg = doc["config"]
    lines = ["# Per-rank cost as peers grow", "",
             f"{doc['created']}; {doc['seconds']:.0f} s; " + ", ".join(f"{k} {v}" for k, v in env.items()) + ".",
             "", "Every rank is one process on this machine running one blocking `rendezvous.Server`; all ranks of "
             "a job share its cores. Before: right after `start()` (and the cluster), no traffic yet. After: "
             f"every rank has sent a {doc['tensors']['small_bytes']}-byte and a "
             f"{format_size(doc['tensors']['big_bytes'])} tensor to every other rank and received both from every "
             "other rank, and every rank is done (received arrays dropped, free heap trimmed). Figures are "
             "medians over the ranks of one job. TCP: established connections owned by the process; *to peers* "
             "= to other ranks' servers (one per gRPC channel) plus peers' connections into this rank's server. "
             "fds exclude the benchmark's own control socket.", "",
             "## Per rank, before and after the full-mesh exchange", ""]
    rows = []
    for r in doc["runs"]:
        b, a = r["median"]["before"], r["median"]["after"]
        rows.append([r["setup"], str(r["ranks"]),
                     f"{_i(b['tcp_established'])} / {_i(a['tcp_established'])}",
                     f"{_i(a['tcp_peer_out'])} + {_i(a['tcp_peer_in'])}", _i(a["tcp_other"]), _i(a["tcp_listen"]),
                     f"{_i(b['threads'])} / {_i(a['threads'])}", f"{_i(b['fds'])} / {_i(a['fds'])}",
                     f"{_i(b['fds_less_pipes'])} / {_i(a['fds_less_pipes'])}",
                     f"{_f(b['rss_bytes'] / MiB, 1)} / {_f(a['rss_bytes'] / MiB, 1)}",
                     _f(a["rss_shmem_bytes"] / MiB, 1), _f(a["peak_rss_bytes"] / MiB, 1)])
    lines += _md(["setup", "ranks", "TCP est. before / after", "after: to peers out + in", "after: other est. TCP",
                  "listening TCP", "threads before / after", "fds before / after", "fds less pipes before / after",
                  "RSS MiB before / after", "of which shared memory after", "peak RSS MiB"], rows)

    lines += ["", "## Per peer", "",
              "Increments per added peer, between the smallest and the largest job: (median of the larger job − "
              "median of the smaller) ÷ (difference in peers), after the exchange unless said. RSS counts "
              "file-backed pages too (shared libraries, which the page cache moves by a MiB between runs); the "
              "anonymous and shared-memory parts are what the process holds itself.", ""]
    rows = []
    for setup, p in doc["per_peer"].items():
        if p is None:
            continue
        rows.append([setup, f"N={p['from_ranks']} → N={p['to_ranks']}", _f(p["connections"]),
                     _f(p["peer_connections"]), _f(p["threads"]), _f(p["fds"]), _f(p["fds_less_pipes"]),
                     _f(p["rss_kib"], 0), _f(p["rss_anon_kib"], 0), _f(p["rss_shmem_kib"], 0),
                     _f(p["rss_less_file_kib_before"], 0)])
    lines += _md(["setup", "between", "TCP connections / peer", "of which to or from peers", "threads / peer",
                  "fds / peer", "fds less pipes / peer", "KiB RSS / peer", "of which anonymous",
                  "of which shared memory", "KiB anonymous + shared / peer before traffic"], rows)
    lines += ["", "Pipes: every rank started by mpiexec's one local proxy inherits two pipe ends per rank started "
                  "before it, so under grpc+mpi the pipe count grows with the rank's index on this machine; that is "
                  "the launcher's, not a per-peer cost, hence the column without pipes."]
    keep = cfg["keepalive_time"]
    if keep:
        lines += ["", f"Keepalive (computed, not measured): every channel pings every keepalive_time = {keep:g} s, "
                      f"so a rank with C outgoing channels sends C / {keep:g} pings per second and answers as many "
                      "from its peers' channels."]

    lines += ["", "## Start-up", "",
              "construct: `Server(...)` (under grpc+mpi it initializes MPI: `MPI_Init_thread`, collective); "
              "start: `start()` (bind, serve; under grpc+mpi also the rank map's allgather). "
              "After the last rank: from the last rank entering the collective to the last leaving it (every "
              "process reads one CLOCK_MONOTONIC), so ranks that started late do not count. Warm allgather: the "
              "same entries gathered again after a barrier, once the job's traffic is done.", ""]
    rows = []
    for r in doc["runs"]:
        s = r["startup"]
        mpi = "allgather_s" in s
        rows.append([r["setup"], str(r["ranks"]), _f(s["construct_s"] * 1e3, 1),
                     _f(s["construct_after_last_s"] * 1e3, 1) if r["setup"] == "grpc+mpi" else "-",
                     _f(s["start_s"] * 1e3, 1),
                     _f(s["allgather_s"] * 1e3, 2) if mpi else "-",
                     _f(s["allgather_after_last_s"] * 1e3, 2) if mpi else "-",
                     _f(s["warm_allgather_s"] * 1e3, 2) if "warm_allgather_s" in s else "-",
                     f"{_i(s['entry_bytes'])} / {_i(s['rank_map_bytes'])}" if mpi else "-",
                     _f(s["exchange_s"] * 1e3, 1), _f(r["wall_s"], 1)])
    lines += _md(["setup", "ranks", "construct ms", "MPI_Init after the last rank ms", "start() ms",
                  "allgather in start() ms", "allgather after the last rank ms", "warm allgather ms",
                  "rank map bytes: per rank sent / received", "full-mesh exchange ms", "job wall s"], rows)
    lines += ["", "Transfers by path over the whole job (consumer side): "
              + "; ".join(f"{r['setup']} N={r['ranks']}: " + ", ".join(f"{k} {v}" for k, v in
                                                                       sorted(r["transfers_by_path"].items()) if v)
                          for r in doc["runs"]) + "."]

    lines += ["", "## What the threads and descriptors are (rank 0 of the largest job, after)", ""]
    rows = []
    for setup in doc["per_peer"]:
        runs = [r for r in doc["runs"] if r["setup"] == setup]
        if not runs:
            continue
        big = max(runs, key=lambda r: r["ranks"])
        a = big["per_rank"][0]["after"]
        rows.append([setup, str(big["ranks"]), ", ".join(f"{k} {v}" for k, v in a["thread_names"].items()),
                     ", ".join(f"{k} {v}" for k, v in a["fd_kinds"].items())])
    lines += _md(["setup", "ranks", "threads by name (py: a Python thread)", "fds by kind"], rows)
    return "\n".join(lines) + "\n"


def _i(value: float) -> str:
    return f"{value:g}" if value != int(value) else str(int(value))


# -- the command -----------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rendezvous bench-scale", description=__doc__.split("\n\n")[0],
                                epilog=f"Writes {JSON_NAME} and {MARKDOWN_NAME} into --out.")
    p.add_argument("--ranks", default="2,4,8", metavar="LIST", help="job sizes, comma-separated (default 2,4,8)")
    p.add_argument("--setups", default=",".join(SETUPS), metavar="LIST",
                   help=f"any of {', '.join(SETUPS)} (default both)")
    p.add_argument("--big", default="1M", metavar="SIZE",
                   help="size of the large tensor each rank sends every peer (default 1M; the small one is "
                        f"{SMALL_BYTES} bytes)")
    p.add_argument("--out", default="benchmarks", metavar="DIR",
                   help=f"where {JSON_NAME} and {MARKDOWN_NAME} go (default benchmarks)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="seconds each job (one setup, one N) may take before all its processes are killed "
                        "(default 300)")
    return p


def options(argv: list[str] | None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    try:
        args.ranks = sorted({int(x) for x in args.ranks.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"rendezvous bench-scale: --ranks {args.ranks!r} is not a list of numbers") from None
    if not args.ranks or min(args.ranks) < 2:
        raise SystemExit("rendezvous bench-scale: --ranks needs sizes of at least 2")
    args.setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = [s for s in args.setups if s not in SETUPS]
    if unknown or not args.setups:
        raise SystemExit(f"rendezvous bench-scale: --setups: unknown {', '.join(unknown) or 'none'}; "
                         f"known: {', '.join(SETUPS)}")
    if args.timeout <= 0:
        raise SystemExit("rendezvous bench-scale: --timeout must be positive")
    from .stats import parse_size

    try:
        args.big = parse_size(args.big)
    except ValueError as exc:
        raise SystemExit(f"rendezvous bench-scale: --big: {exc}") from None
    if args.big % 4:
        raise SystemExit("rendezvous bench-scale: --big must be a multiple of 4 bytes (a float32 tensor)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child"] and len(argv) == 6:
        return _rank_main(argv[1], argv[2], int(argv[3]), int(argv[4]), int(argv[5]))
    args = options(argv)
    t0 = time.monotonic()
    runs = []
    try:
        for setup in args.setups:
            for n in args.ranks:
                print(f"bench-scale: {setup}, {n} ranks ...", file=sys.stderr, flush=True)
                run = run_job(setup, n, args.timeout, args.big)
                print(f"bench-scale: {setup}, {n} ranks: {run['wall_s']:.1f} s", file=sys.stderr, flush=True)
                runs.append(run)
    except (JobFailed, KeyboardInterrupt) as exc:
        print(f"rendezvous bench-scale: {exc if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 1
    doc = build(runs, {"ranks": args.ranks, "setups": args.setups, "big_bytes": args.big, "timeout": args.timeout},
                time.monotonic() - t0)
    from .report import save

    save(args.out, doc, render(doc), JSON_NAME, MARKDOWN_NAME)
    return 0


if __name__ == "__main__":
    sys.exit(main())
