"""``rendezvous bench-daemon``: rendezvousd and its local clients, against the bounds.

Everything runs on this machine, in one run, contenders taking turns round
by round so the machine's noise falls on all of them alike; the results are
medians, and every comparison is a ratio between contenders of the same run.

1. **Local hop**: client A (one process) sends, rendezvousd holds, client B
   (another process) receives: the blocking client at every ``--sizes``, the
   asyncio client at ``--aio-sizes``; beside them one ``numpy.copyto``
   between two warm preallocated buffers (the memcpy a local hop can at best
   cost). Each sample sends a distinct tensor: A refills one of a set of
   preallocated arrays with the sample's own stamp before its clock starts,
   and B checks the stamp after its clock stops. Two kinds of sample:

   * *sequential*: A's send is timed (no consumer waits yet), then B's recv
     of the tensor, already in the daemon, is timed: **send** and **recv**;
   * *hop*: B's recv is posted first; A's send starts the clock and B
     holding the array stops it (both read ``CLOCK_MONOTONIC``, which every
     process on the machine shares): **hop**.

2. **Small tensors**: 1 KiB sends and recvs (of tensors already sent) over
   the session socket, one after another, against a bare ``grpc.aio`` unary
   call (a 1 KiB echo, generic handler, raw bytes) and a bare sync unary
   call over a Unix socket to another process. **Rate**: ``--outstanding``
   recvs of already-sent 1 KiB tensors gathered at once on the asyncio
   client, against as many bare ``grpc.aio`` unary calls at once.

3. **Cross-node**: two daemons under ``mpiexec -n 2`` (``grpc+mpi``):
   client A on daemon 0 sends, client B on daemon 1 receives (daemon 1
   fetches the tensor from daemon 0, its bytes over MPI); the same through
   two daemons on the gRPC path (``protocol grpc``); and raw MPI between two
   ranks (mpi4py ``Send``/``Recv`` of a preallocated buffer, timed from the
   send's start to the receive's end).

4. **Memory**: the peak RSS (``VmHWM``, reset at each scenario's start) of
   every daemon, client and helper process, and each daemon's pool (its
   Prometheus gauges) after the scenario, beside the pool's limit
   (``--pool-bytes``, given to the daemons as ``RENDEZVOUS_SHM_POOL_BYTES``).

Every wait has a deadline: a daemon, client or rank that fails or hangs ends
the run with an error naming it, and every process started is stopped and
the socket folder removed on the way out.

``--quick`` runs fewer sizes and samples (well under 2 minutes on 2 cores);
``--scenarios`` picks scenarios; ``--daemon-env NAME=VALUE`` passes a setting
to every daemon (e.g. ``RENDEZVOUS_RETRY_CACHE_BYTES=0``). The targets, with
the ratios measured and met or missed, head ``daemon.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import math
import os
import platform
import queue
import re
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
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from .stats import format_size, parse_size, summarize

__all__ = ["main", "CONTENDERS", "render", "targets"]

JSON_NAME = "daemon.json"
MARKDOWN_NAME = "daemon.md"
MiB = 1 << 20

#: every contender the run measures (the keys of the results document's "contenders")
CONTENDERS = {
    "local_blocking": "local hop, blocking rendezvous.client.Client (A -> rendezvousd -> B)",
    "local_aio": "local hop, rendezvous.client.aio.Client",
    "memcpy": "one numpy.copyto between two warm preallocated buffers",
    "send_blocking": "1 KiB send over the session socket, blocking client",
    "recv_blocking": "1 KiB recv of an already-sent tensor, blocking client",
    "send_aio": "1 KiB send over the session socket, asyncio client",
    "recv_aio": "1 KiB recv of an already-sent tensor, asyncio client",
    "grpc_aio_unary": "bare grpc.aio unary call, 1 KiB echo over a Unix socket",
    "grpc_sync_unary": "bare sync grpc unary call, 1 KiB echo over a Unix socket",
    "rate_aio_recv": "recvs of already-sent 1 KiB tensors, all outstanding at once (asyncio client)",
    "rate_grpc_aio": "bare grpc.aio unary 1 KiB echoes, all outstanding at once",
    "daemons_mpi": "A on rendezvousd 0 -> B on rendezvousd 1, two daemons under mpiexec -n 2, grpc+mpi",
    "daemons_grpc": "A on rendezvousd 0 -> B on rendezvousd 1, two daemons on the gRPC path",
    "raw_mpi": "raw mpi4py Send/Recv of a preallocated buffer between two ranks",
}

_QUICK = dict(sizes="1K,1M,64M", cross_sizes="1K,1M,64M", budget=64 * MiB, least=3, most=24, rounds=2,
              small_ops=200, rate_rounds=2)
_FULL = dict(sizes="1K,64K,1M,16M,64M,128M,512M", cross_sizes="1K,64K,1M,16M,64M,256M", budget=1 << 30,
             least=5, most=400, rounds=5, small_ops=1000, rate_rounds=7)
_ECHO = "/rendezvous.bench.Echo/Echo"
_WARMUP = 2  # untimed samples of each kind per contender and size


class BenchError(Exception):
    """The run cannot go on: a process failed, hung or answered wrongly."""


# -- tensors: distinct per sample, checked on arrival ---------------------------------

def _fill(arr: np.ndarray, stamp: int) -> None:
    """Make ``arr`` (uint8, 1-D) sample ``stamp``'s tensor."""
    arr.fill(stamp % 251 + 1)
    if arr.nbytes >= 16:
        arr[:8].view(np.uint64)[0] = stamp
        arr[-8:].view(np.uint64)[0] = stamp


def _verify(x: Any, size: int, stamp: int) -> None:
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or x.nbytes != size:
        raise AssertionError(f"wrong tensor for sample {stamp}: "
                             f"{getattr(x, 'dtype', type(x))} of {getattr(x, 'nbytes', '?')} bytes, "
                             f"expected uint8 of {size}")
    flat = x.reshape(-1)
    fill = stamp % 251 + 1
    if size >= 16:
        head, tail = int(flat[:8].view(np.uint64)[0]), int(flat[-8:].view(np.uint64)[0])
        if head != stamp or tail != stamp:
            raise AssertionError(f"wrong data: sample {stamp} arrived stamped {head} (first bytes) and "
                                 f"{tail} (last bytes)")
        probes = np.random.default_rng(stamp).integers(8, size - 8, 32) if size > 16 else np.array([], int)
        bad = [int(i) for i in probes if flat[i] != fill]
    else:
        bad = [int(i) for i in np.nonzero(flat != fill)[0][:4]]
    if bad:
        raise AssertionError(f"wrong data: sample {stamp} byte {bad[0]} is {int(flat[bad[0]])}, expected {fill}")


def _key(name: str, src: int = 0, dst: int = 0) -> str:
    return (f"/job:node/replica:0/task:{src}/device:CPU:0;0000000000000001;"
            f"/job:node/replica:0/task:{dst}/device:CPU:1;{name};0:0")


# -- the worker processes (clients, the echo server) ------------------------------------

def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker_entry(conn: Any, name: str) -> None:
    """A worker process: commands in, ("ok", result) or ("error", text) out."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the orchestrator's: it stops the workers
    worker = _Worker(conn, name)
    try:
        worker.serve()
    finally:
        worker.close()


class _Worker:
    def __init__(self, conn: Any, name: str) -> None:
        from rendezvous.config import Config
        from rendezvous.lifecycle import new_event_loop

        self.conn = conn
        self.name = name
        self.loop = new_event_loop(Config.load().uvloop)
        asyncio.set_event_loop(self.loop)
        self.clients: dict[str, tuple[str, Any]] = {}
        self.ring: list[np.ndarray] = []
        self.grpc_aio: Any = None
        self.grpc_sync: Any = None
        self.echo: Any = None
        self.echo_loop: asyncio.AbstractEventLoop | None = None

    def serve(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                return
            op, args = msg[0], msg[1:]
            if op == "stop":
                self.close()
                self.conn.send(("ok", None))
                return
            try:
                result = getattr(self, "op_" + op)(*args)
            except BaseException as exc:  # reported to the orchestrator, which ends the run
                self.conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-4000:]}"))
            else:
                self.conn.send(("ok", result))

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    # -- clients --------------------------------------------------------------------

    def op_pid(self) -> int:
        return os.getpid()

    def op_connect(self, name: str, address: str, kind: str) -> dict[str, Any]:
        if kind == "blocking":
            from rendezvous.client import Client

            client = Client(address, connect_timeout=30)
        else:
            from rendezvous.client.aio import Client as AioClient

            client = AioClient(address, connect_timeout=30)
            self.run(client.connect())
        if not client.session:
            raise RuntimeError(f"the {kind} client of {address} did not get the session socket")
        self.clients[name] = (kind, client)
        return {"task": client.task, "shm_threshold": client.shm_threshold}

    def op_stats(self) -> dict[str, dict[str, int]]:
        return {name: dict(c.stats()) for name, (_, c) in self.clients.items()}

    def op_ring(self, size: int, count: int) -> None:
        """Preallocate ``count`` arrays of ``size`` bytes (their pages touched), or drop them (count 0)."""
        from . import rss

        self.ring = []
        rss.release_free_memory()
        self.ring = [np.ones(size, np.uint8) for _ in range(count)]

    def op_send(self, name: str, key: str, slot: int, stamp: int) -> tuple[int, int]:
        arr = self.ring[slot]
        _fill(arr, stamp)  # produced before the clock starts
        kind, client = self.clients[name]
        if kind == "blocking":
            t0 = time.perf_counter_ns()
            client.send(key, arr)
            return t0, time.perf_counter_ns()

        async def go() -> tuple[int, int]:
            t0 = time.perf_counter_ns()
            await client.send(key, arr)
            return t0, time.perf_counter_ns()

        return self.run(go())

    def op_recv(self, name: str, key: str, size: int, stamp: int, ready: bool, timeout: float) -> tuple[int, int]:
        kind, client = self.clients[name]
        if kind == "blocking":
            if ready:
                self.conn.send(("ready", None))
            t0 = time.perf_counter_ns()
            x = client.recv(key, timeout=timeout)
            t1 = time.perf_counter_ns()
            _verify(x, size, stamp)
            del x  # the segment goes back to the pool
            return t0, t1

        async def go() -> tuple[int, int]:
            t0 = time.perf_counter_ns()
            task = asyncio.ensure_future(client.recv(key, timeout=timeout))
            if ready:
                for _ in range(3):
                    await asyncio.sleep(0)  # the RECV frame goes out
                self.conn.send(("ready", None))
            x = await task
            t1 = time.perf_counter_ns()
            _verify(x, size, stamp)
            del x
            await asyncio.sleep(0)  # the release goes out
            return t0, t1

        return self.run(go())

    def op_small_send(self, name: str, prefix: str, n: int, size: int) -> list[int]:
        """``n`` sends of distinct tensors, one after another, each timed."""
        arrs = [np.empty(size, np.uint8) for _ in range(n)]
        for i, a in enumerate(arrs):
            _fill(a, i)
        keys = [_key(f"{prefix}_{i}") for i in range(n)]
        kind, client = self.clients[name]
        out = []
        clock = time.perf_counter_ns
        if kind == "blocking":
            for k, a in zip(keys, arrs):
                t0 = clock()
                client.send(k, a)
                out.append(clock() - t0)
            return out

        async def go() -> None:
            for k, a in zip(keys, arrs):
                t0 = clock()
                await client.send(k, a)
                out.append(clock() - t0)

        self.run(go())
        return out

    def op_small_recv(self, name: str, prefix: str, n: int, size: int, timeout: float) -> list[int]:
        """``n`` recvs of tensors already sent, one after another, each timed."""
        keys = [_key(f"{prefix}_{i}") for i in range(n)]
        kind, client = self.clients[name]
        out: list[int] = []
        got: list[Any] = []
        clock = time.perf_counter_ns
        if kind == "blocking":
            for k in keys:
                t0 = clock()
                got.append(client.recv(k, timeout=timeout))
                out.append(clock() - t0)
        else:
            async def go() -> None:
                for k in keys:
                    t0 = clock()
                    got.append(await client.recv(k, timeout=timeout))
                    out.append(clock() - t0)

            self.run(go())
        for i, x in enumerate(got):
            _verify(x, size, i)
        return out

    def op_send_many(self, name: str, prefix: str, n: int, size: int) -> None:
        """Send ``n`` distinct tensors (untimed: the rate test's supply)."""
        kind, client = self.clients[name]
        arrs = [np.empty(size, np.uint8) for _ in range(n)]
        for i, a in enumerate(arrs):
            _fill(a, i)
        keys = [_key(f"{prefix}_{i}") for i in range(n)]
        if kind == "blocking":
            for k, a in zip(keys, arrs):
                client.send(k, a)
            return

        async def go() -> None:
            await asyncio.gather(*(client.send(k, a) for k, a in zip(keys, arrs)))

        self.run(go())

    def op_rate_recv(self, name: str, prefix: str, n: int, size: int, timeout: float) -> dict[str, Any]:
        """``n`` recvs at once on the asyncio client; elapsed ns and failures."""
        _, client = self.clients[name]
        keys = [_key(f"{prefix}_{i}") for i in range(n)]

        async def go() -> tuple[int, list[Any]]:
            t0 = time.perf_counter_ns()
            got = await asyncio.gather(*(client.recv(k, timeout=timeout) for k in keys), return_exceptions=True)
            return time.perf_counter_ns() - t0, got

        ns, got = self.run(go())
        errors = [g for g in got if isinstance(g, BaseException)]
        for i, x in enumerate(got):
            if not isinstance(x, BaseException):
                _verify(x, size, i)
        return {"ns": ns, "failures": len(errors), "error": repr(errors[0]) if errors else ""}

    # -- bare gRPC ----------------------------------------------------------------------

    def op_grpc_connect(self, path: str) -> None:
        import grpc

        opts = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]

        async def go() -> Any:
            channel = grpc.aio.insecure_channel(f"unix:{path}", options=opts)
            await asyncio.wait_for(channel.channel_ready(), 30)
            return channel

        self.grpc_aio_channel = self.run(go())
        self.grpc_aio = self.grpc_aio_channel.unary_unary(_ECHO)
        self.grpc_sync_channel = grpc.insecure_channel(f"unix:{path}", options=opts)
        grpc.channel_ready_future(self.grpc_sync_channel).result(timeout=30)
        self.grpc_sync = self.grpc_sync_channel.unary_unary(_ECHO)

    def op_grpc_ops(self, kind: str, n: int, size: int) -> list[int]:
        """``n`` bare unary echoes one after another, each timed."""
        payloads = [bytes([i % 251 + 1]) * size for i in range(n)]
        out: list[int] = []
        clock = time.perf_counter_ns
        if kind == "sync":
            call = self.grpc_sync
            for p in payloads:
                t0 = clock()
                r = call(p, timeout=60)
                out.append(clock() - t0)
                if r != p:
                    raise AssertionError("the echo server answered other bytes")
            return out
        call = self.grpc_aio

        async def go() -> None:
            for p in payloads:
                t0 = clock()
                r = await call(p, timeout=60)
                out.append(clock() - t0)
                if r != p:
                    raise AssertionError("the echo server answered other bytes")

        self.run(go())
        return out

    def op_grpc_rate(self, n: int, size: int) -> dict[str, Any]:
        payloads = [bytes([i % 251 + 1]) * size for i in range(n)]
        call = self.grpc_aio

        async def go() -> tuple[int, list[Any]]:
            t0 = time.perf_counter_ns()
            got = await asyncio.gather(*(call(p, timeout=120) for p in payloads), return_exceptions=True)
            return time.perf_counter_ns() - t0, got

        ns, got = self.run(go())
        errors = [g for g in got if isinstance(g, BaseException)]
        if any(g != p for g, p in zip(got, payloads) if not isinstance(g, BaseException)):
            raise AssertionError("the echo server answered other bytes")
        return {"ns": ns, "failures": len(errors), "error": repr(errors[0]) if errors else ""}

    def op_serve_echo(self, path: str) -> None:
        """Serve the bare echo (raw bytes, generic handler) on unix:``path``, on a loop
        thread of its own (this thread keeps answering commands)."""
        import grpc

        from rendezvous.config import Config
        from rendezvous.lifecycle import new_event_loop

        loop = self.echo_loop = new_event_loop(Config.load().uvloop)
        threading.Thread(target=loop.run_forever, name="echo-loop", daemon=True).start()

        async def echo(request: bytes, context: Any) -> bytes:
            return request

        async def start() -> Any:
            server = grpc.aio.server(options=[("grpc.max_receive_message_length", -1),
                                              ("grpc.max_send_message_length", -1)])
            server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
                "rendezvous.bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})])
            if not server.add_insecure_port(f"unix:{path}"):
                raise RuntimeError(f"cannot listen on unix:{path}")
            await server.start()
            return server

        self.echo = asyncio.run_coroutine_threadsafe(start(), loop).result(30)

    def close(self) -> None:
        """Close every client, channel and server (idempotent)."""
        clients, self.clients = self.clients, {}
        for kind, client in clients.values():
            try:
                if kind == "blocking":
                    client.close()
                else:
                    self.run(client.close())
            except Exception:
                pass
        channel, self.grpc_sync_channel = getattr(self, "grpc_sync_channel", None), None
        if channel is not None:
            channel.close()
        channel, self.grpc_aio_channel = getattr(self, "grpc_aio_channel", None), None
        if channel is not None:
            try:
                self.run(channel.close())
            except Exception:
                pass
        server, self.echo = self.echo, None
        if server is not None and self.echo_loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(server.stop(0), self.echo_loop).result(10)
            except Exception:
                pass


# -- raw MPI: two ranks under mpiexec, driven over a Unix socket ---------------------------

def _raw_mpi(path: str) -> int:
    """One rank of the raw MPI reference. Rank 0 takes commands (JSON lines) from the
    orchestrator's socket; rank 1 waits for them without spinning."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    pids = comm.gather(os.getpid(), root=0)
    stream = None
    if rank == 0:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(60)
        sock.connect(path)
        sock.settimeout(None)
        stream = sock.makefile("rw")
        hello = {"pids": pids, "library": " ".join(MPI.Get_library_version().splitlines()[0].split())}
        stream.write(json.dumps(hello) + "\n")
        stream.flush()
    buf: np.ndarray | None = None
    while True:
        if rank == 0:
            assert stream is not None
            line = stream.readline()
            cmd = json.loads(line) if line.strip() else {"op": "stop"}
            comm.send(cmd, dest=1, tag=9)
        else:
            req = comm.irecv(source=0, tag=9)
            while True:  # idle without spinning: the machine is shared with the contenders
                done, cmd = req.test()
                if done:
                    break
                time.sleep(0.001)
        if cmd["op"] == "stop":
            break
        size, n = int(cmd["size"]), int(cmd["samples"])
        if buf is None or buf.nbytes != size:
            buf = None
            buf = np.ones(size, np.uint8)
            n += 1  # the first transfer of a new buffer is a warm-up
            warm = True
        else:
            warm = False
        times = []
        for i in range(n):
            comm.Barrier()
            if rank == 0:
                t0 = time.perf_counter_ns()
                comm.Send([buf, MPI.BYTE], dest=1, tag=7)
                t1 = comm.recv(source=1, tag=8)
                if not (warm and i == 0):
                    times.append(t1 - t0)
            else:
                comm.Recv([buf, MPI.BYTE], source=0, tag=7)
                comm.send(time.perf_counter_ns(), dest=0, tag=8)
        if rank == 0:
            assert stream is not None
            stream.write(json.dumps({"ns": times}) + "\n")
            stream.flush()
    return 0


# -- child processes -------------------------------------------------------------------------

class _Child:
    """A child process (its own process group) whose output lines are collected."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.argv = argv
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                  text=True, env=env, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.err: collections.deque[str] = collections.deque(maxlen=200)
        threading.Thread(target=self._pump, args=(self.p.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.p.stderr, self.err.append), daemon=True).start()

    @staticmethod
    def _pump(stream: Any, put: Any) -> None:
        try:
            for line in stream:
                put(line)
        except (OSError, ValueError):
            pass

    def tail(self, n: int = 4000) -> str:
        return "".join(self.err)[-n:]

    def line(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"{self.name}: no {prefix!r} line within {timeout:g}s; stderr:\n{self.tail()}")
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.p.poll() is not None and self.lines.empty():
                    raise BenchError(f"{self.name} exited with status {self.p.returncode} before printing "
                                     f"{prefix!r}; stderr:\n{self.tail()}") from None
                continue
            if line.startswith(prefix):
                return line

    def stop(self, grace: float = 10.0) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.p.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.p.pid, signal.SIGKILL)  # whatever of its group is left (mpiexec's ranks)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            pass


class _Daemon:
    """One rendezvousd (its ready line parsed)."""

    def __init__(self, name: str, child: _Child, line: str) -> None:
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


class _Handle:
    """The orchestrator's end of a worker process."""

    def __init__(self, bench: "Bench", name: str, proc: Any, conn: Any) -> None:
        self.bench = bench
        self.name = name
        self.proc = proc
        self.conn = conn
        self.pid = 0
        self.last = ""

    def post(self, *cmd: Any) -> None:
        self.last = str(cmd[0])
        try:
            self.conn.send(cmd)
        except (OSError, ValueError) as exc:
            raise BenchError(f"worker {self.name} is gone ({exc}); exit code {self.proc.exitcode}") from None

    def wait(self, timeout: float, expect: str = "ok") -> Any:
        deadline = time.monotonic() + timeout
        while True:
            self.bench.check()
            left = min(deadline, self.bench.deadline) - time.monotonic()
            if left <= 0:
                if time.monotonic() >= self.bench.deadline:
                    raise BenchError(f"the run went past --timeout {self.bench.args.timeout:g}s "
                                     f"(waiting for worker {self.name}'s {self.last})")
                raise BenchError(f"worker {self.name} did not finish {self.last!r} within {timeout:.0f}s "
                                 "(a client or daemon hangs?)")
            try:
                ready = self.conn.poll(min(left, 0.5))
            except (OSError, EOFError):
                ready = True
            if ready:
                try:
                    kind, value = self.conn.recv()
                except (EOFError, OSError):
                    raise BenchError(f"worker {self.name} died during {self.last!r} "
                                     f"(exit code {self.proc.exitcode})") from None
                if kind == "error":
                    raise BenchError(f"worker {self.name}: {self.last} failed: {value}")
                if kind != expect:
                    raise BenchError(f"worker {self.name}: {self.last}: expected {expect!r}, got {kind!r}")
                return value
            if not self.proc.is_alive():
                raise BenchError(f"worker {self.name} died during {self.last!r} (exit code {self.proc.exitcode})")

    def call(self, *cmd: Any, timeout: float = 120.0) -> Any:
        self.post(*cmd)
        return self.wait(timeout)


# -- memory -------------------------------------------------------------------------------------

def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("VmHWM", "VmRSS", "RssAnon", "RssShmem", "RssFile"):
                    out[name] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _reset_peak(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# -- the run -------------------------------------------------------------------------------------

def _timeout_for(size: int) -> float:
    """Seconds one transfer of ``size`` bytes may take before the run calls it hung."""
    return 60.0 + size / 20e6


class Bench:
    def __init__(self, args: argparse.Namespace, progress: Any) -> None:
        self.args = args
        self.progress = progress
        self.deadline = time.monotonic() + args.timeout
        self.dir = tempfile.mkdtemp(prefix="rbd", dir="/tmp")  # short: Unix socket paths fit 107 bytes
        self.children: list[_Child] = []
        self.daemons: dict[str, _Daemon] = {}
        self.workers: dict[str, _Handle] = {}
        self.raw: Any = None
        self.raw_pids: list[int] = []
        self.counter = 0
        self.done = 0
        self.total = 1
        self.environment: dict[str, Any] = {}
        self.memory: dict[str, Any] = {}
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("MPI_DISABLED", "MPI_OPTIMAL_PATH", "RENDEZVOUS_LOCAL_ADDRESS")}
        self.env.setdefault("GRPC_VERBOSITY", "ERROR")
        self.env["RENDEZVOUS_SHM_POOL_BYTES"] = str(args.pool_bytes)
        self.env.update(args.daemon_env)

    # -- bookkeeping ---------------------------------------------------------------------

    def check(self) -> None:
        """Fail at once if a daemon or helper job is gone."""
        for child in self.children:
            code = child.p.poll()
            if code is not None:
                raise BenchError(f"{child.name} exited with status {code}; stderr:\n{child.tail()}")

    def step(self, label: str) -> None:
        self.done += 1
        self.progress(self.done, self.total, label)

    def stamp(self) -> int:
        self.counter += 1
        return self.counter

    # -- processes ---------------------------------------------------------------------------

    def _rendezvousd(self) -> str:
        found = Path(sys.executable).parent / "rendezvousd"
        return str(found) if found.exists() else (shutil.which("rendezvousd") or "rendezvousd")

    def _daemon_flags(self) -> list[str]:
        return ["--job-name", "node", "--metrics-port", "0", "--grace", "1", "--stall-warning", "0"]

    def start_local_daemon(self) -> None:
        cluster = Path(self.dir, "local.json")
        cluster.write_text(json.dumps({"node": ["127.0.0.1:0"]}))
        child = _Child("rendezvousd (local)", [self._rendezvousd(), "--cluster", str(cluster), "--task-index", "0",
                                               "--protocol", "grpc", "--local", f"unix:{self.dir}/l.sock",
                                               *self._daemon_flags()], self.env)
        self.children.append(child)
        self.daemons["local"] = _Daemon("local", child, child.line("rendezvousd: ", 60))

    def start_mpi_daemons(self, launcher: list[str]) -> None:
        cluster = Path(self.dir, "mpi.json")
        cluster.write_text(json.dumps({"node": ["127.0.0.1:0", "127.0.0.1:0"]}))
        child = _Child("rendezvousd pair (mpiexec, grpc+mpi)",
                       [*launcher, "-n", "2", self._rendezvousd(), "--cluster", str(cluster), "--protocol",
                        "grpc+mpi", "--local", f"unix:{self.dir}/m{{task_index}}.sock", *self._daemon_flags()],
                       self.env)
        self.children.append(child)
        for _ in range(2):
            d = _Daemon("", child, child.line("rendezvousd: ", 90))
            d.name = f"mpi{d.index}"
            self.daemons[d.name] = d
        if {"mpi0", "mpi1"} - set(self.daemons):
            raise BenchError("the mpiexec job did not start tasks 0 and 1")

    def start_grpc_daemons(self) -> None:
        ports = []
        holders = []
        for _ in range(2):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            holders.append(s)
            ports.append(s.getsockname()[1])
        for s in holders:
            s.close()
        cluster = Path(self.dir, "grpc.json")
        cluster.write_text(json.dumps({"node": [f"127.0.0.1:{p}" for p in ports]}))
        for i in range(2):
            child = _Child(f"rendezvousd grpc{i}", [self._rendezvousd(), "--cluster", str(cluster), "--task-index",
                                                    str(i), "--protocol", "grpc", "--local",
                                                    f"unix:{self.dir}/g{i}.sock", *self._daemon_flags()], self.env)
            self.children.append(child)
            self.daemons[f"grpc{i}"] = _Daemon(f"grpc{i}", child, child.line("rendezvousd: ", 60))

    def start_raw_mpi(self, launcher: list[str]) -> None:
        path = f"{self.dir}/raw.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        listener.settimeout(0.5)
        child = _Child("raw MPI ranks (mpiexec)",
                       [*launcher, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "rendezvous.bench.daemon",
                        "--raw-mpi", path], self.env)
        self.children.append(child)
        deadline = time.monotonic() + 90
        try:
            while True:
                self.check()
                if time.monotonic() > deadline:
                    raise BenchError(f"the raw MPI ranks did not connect within 90s; stderr:\n{child.tail()}")
                try:
                    conn, _ = listener.accept()
                    break
                except TimeoutError:
                    continue
        finally:
            listener.close()
        conn.settimeout(None)
        self.raw = conn
        self.raw_file = conn.makefile("rw")
        hello = self._raw_read(60)
        self.raw_pids = [int(p) for p in hello["pids"]]
        self.environment["mpi"] = hello["library"]

    def _raw_read(self, timeout: float) -> dict[str, Any]:
        import selectors

        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.raw, selectors.EVENT_READ)
            while True:
                self.check()
                left = min(deadline, self.deadline) - time.monotonic()
                if left <= 0:
                    raise BenchError(f"the raw MPI ranks did not answer within {timeout:g}s")
                if sel.select(min(left, 0.5)):
                    break
        line = self.raw_file.readline()
        if not line:
            raise BenchError(f"the raw MPI ranks closed their socket; stderr:\n{self.children[-1].tail()}")
        return json.loads(line)

    def raw_run(self, size: int, samples: int) -> list[int]:
        self.raw_file.write(json.dumps({"op": "run", "size": size, "samples": samples}) + "\n")
        self.raw_file.flush()
        return self._raw_read(_timeout_for(size) * (samples + 1))["ns"]

    def start_worker(self, name: str) -> _Handle:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_entry, args=(child, name), name=f"bench-daemon-{name}", daemon=True)
        old = {k: os.environ.get(k) for k in ("GRPC_VERBOSITY",)}
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
        try:
            proc.start()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
        child.close()
        handle = _Handle(self, name, proc, parent)
        self.workers[name] = handle
        handle.pid = handle.call("pid", timeout=120)
        return handle

    def close(self) -> None:
        """Stop everything this run started; remove the socket folder."""
        for handle in self.workers.values():
            try:
                if handle.proc.is_alive():
                    handle.conn.send(("stop",))
                    if handle.conn.poll(10):
                        handle.conn.recv()
            except (OSError, EOFError, ValueError):
                pass
        for handle in self.workers.values():
            handle.proc.join(5)
            if handle.proc.is_alive():
                handle.proc.kill()
                handle.proc.join(5)
        if self.raw is not None:
            try:
                self.raw_file.write(json.dumps({"op": "stop"}) + "\n")
                self.raw_file.flush()
            except OSError:
                pass
        for child in reversed(self.children):
            child.stop()
        if self.raw is not None:
            try:
                self.raw.close()
            except OSError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- measuring ---------------------------------------------------------------------------

    def per_round(self, size: int) -> int:
        """Timed samples of each kind per contender, size and round."""
        a = self.args
        wanted = a.samples if a.samples is not None else max(a.least, min(a.most, a.budget // size))
        return max(1, math.ceil(wanted / a.rounds))

    def samples(self, size: int) -> int:
        return self.per_round(size) * self.args.rounds

    def seq_sample(self, A: _Handle, B: _Handle, client: str, size: int, ring: int, src: int, dst: int
                   ) -> tuple[int, int]:
        """(send ns, recv ns): A sends, then B receives what is already there."""
        stamp = self.stamp()
        key = _key(f"t{stamp}", src, dst)
        t = _timeout_for(size)
        s0, s1 = A.call("send", client, key, stamp % ring, stamp, timeout=t)
        r0, r1 = B.call("recv", client, key, size, stamp, False, t, timeout=t + 15)
        return s1 - s0, r1 - r0

    def hop_sample(self, A: _Handle, B: _Handle, client: str, size: int, ring: int, src: int, dst: int) -> int:
        """Hop ns: B's recv is posted, A's send starts the clock, B holding the array stops it."""
        stamp = self.stamp()
        key = _key(f"t{stamp}", src, dst)
        t = _timeout_for(size)
        B.post("recv", client, key, size, stamp, True, t)
        B.wait(30, expect="ready")
        s0, _ = A.call("send", client, key, stamp % ring, stamp, timeout=t)
        _, r1 = B.wait(t + 15)
        return r1 - s0

    def snapshot_start(self, procs: dict[str, int]) -> dict[str, Any]:
        start = {}
        for label, pid in procs.items():
            reset = _reset_peak(pid)
            start[label] = {"pid": pid, "reset": reset, "start_rss": _status(pid).get("VmRSS", 0),
                            "start_cpu": _cpu_seconds(pid), "start_time": time.monotonic()}
        return start

    def snapshot_end(self, scenario: str, start: dict[str, Any], daemons: list[str],
                     workers: list[str]) -> None:
        procs = {}
        for label, info in start.items():
            st = _status(info["pid"])
            procs[label] = {**{k: v for k, v in info.items() if k not in ("start_cpu", "start_time")},
                            "peak_rss": st.get("VmHWM", 0), "end_rss": st.get("VmRSS", 0),
                            "end_anon": st.get("RssAnon", 0), "end_shmem": st.get("RssShmem", 0),
                            "cpu_s": round(_cpu_seconds(info["pid"]) - info["start_cpu"], 2),
                            "wall_s": round(time.monotonic() - info["start_time"], 2)}
        pools = {}
        for name in daemons:
            try:
                pools[name] = self.daemons[name].pool()
            except OSError as exc:
                pools[name] = {"error": str(exc)}
        stats = {}
        for name in workers:
            stats[name] = self.workers[name].call("stats")
        self.memory[scenario] = {"processes": procs, "pools": pools, "client_stats": stats}

    # -- 1. the local hop ------------------------------------------------------------------------

    def local_hop(self) -> dict[str, Any]:
        a = self.args
        A, B = self.workers["A"], self.workers["B"]
        cells: dict[str, dict[str, dict[str, list[int]]]] = {"local_blocking": {}, "local_aio": {},
                                                              "memcpy": {}}
        for size in a.sizes:
            per_round = self.per_round(size)
            ring = int(min(64, max(2, (256 * MiB) // size)))
            A.call("ring", size, ring, timeout=120)
            src = np.ones(size, np.uint8)
            dst = np.empty(size, np.uint8)
            np.copyto(dst, src)  # both warm
            names = ["local_blocking"] + (["local_aio"] if size in a.aio_sizes else []) + ["memcpy"]
            for name in names:
                cells[name][str(size)] = {"send": [], "recv": [], "hop": []} if name != "memcpy" else {"copy": []}
            for name in names:  # warm-up: segments made and mapped on both sides
                if name == "memcpy":
                    continue
                client = name.split("_")[1]
                for _ in range(_WARMUP):
                    self.seq_sample(A, B, client, size, ring, 0, 0)
                    self.hop_sample(A, B, client, size, ring, 0, 0)
            order = list(names)
            for _ in range(a.rounds):
                for name in order:
                    cell = cells[name][str(size)]
                    for _ in range(per_round):
                        if name == "memcpy":
                            t0 = time.perf_counter_ns()
                            np.copyto(dst, src)
                            cell["copy"].append(time.perf_counter_ns() - t0)
                            continue
                        client = name.split("_")[1]
                        s, r = self.seq_sample(A, B, client, size, ring, 0, 0)
                        cell["send"].append(s)
                        cell["recv"].append(r)
                        cell["hop"].append(self.hop_sample(A, B, client, size, ring, 0, 0))
                    self.step(f"local hop {format_size(size)} {name}")
                order = order[1:] + order[:1]
            del src, dst
            A.call("ring", 0, 0)
        return cells

    # -- 2. small tensors ------------------------------------------------------------------------

    def small(self) -> dict[str, Any]:
        a = self.args
        A, B = self.workers["A"], self.workers["B"]
        size = 1024
        n = a.small_ops
        ops: dict[str, list[int]] = {k: [] for k in ("send_blocking", "recv_blocking", "send_aio", "recv_aio",
                                                      "grpc_aio_unary", "grpc_sync_unary")}
        t = 60 + n * 0.05

        def group(name: str, record: bool) -> None:
            if name in ("blocking", "aio"):
                prefix = f"s{self.stamp()}"
                sent = A.call("small_send", name, prefix, n if record else min(n, 50), size, timeout=t)
                got = B.call("small_recv", name, prefix, n if record else min(n, 50), size, 30.0, timeout=t)
                if record:
                    ops[f"send_{name}"] += sent
                    ops[f"recv_{name}"] += got
            else:
                kind = name.split("_")[1]
                took = B.call("grpc_ops", kind, n if record else min(n, 50), size, timeout=t)
                if record:
                    ops[f"{name}_unary"] += took

        order = ["blocking", "aio", "grpc_aio", "grpc_sync"]
        for name in order:
            group(name, record=False)  # warm-up
        for _ in range(a.rounds):
            for name in order:
                group(name, record=True)
                self.step(f"small tensors {name}")
            order = order[1:] + order[:1]

        m = a.outstanding
        rate: dict[str, dict[str, Any]] = {"rate_aio_recv": {"ns": [], "failures": 0, "errors": []},
                                           "rate_grpc_aio": {"ns": [], "failures": 0, "errors": []}}
        order = list(rate)
        tr = 120 + m * 0.05
        for r in range(a.rate_rounds + 1):  # round 0: warm-up
            for name in order:
                if name == "rate_aio_recv":
                    prefix = f"r{self.stamp()}"
                    A.call("send_many", "aio", prefix, m, size, timeout=tr)
                    res = B.call("rate_recv", "aio", prefix, m, size, 60.0, timeout=tr)
                else:
                    res = B.call("grpc_rate", m, size, timeout=tr)
                if r:
                    cell = rate[name]
                    cell["ns"].append(res["ns"])
                    cell["failures"] += res["failures"]
                    if res["error"]:
                        cell["errors"].append(res["error"])
                    self.step(f"rate {name}")
            order = order[1:] + order[:1]
        return {"size": size, "ops": ops, "rate": rate, "outstanding": m}

    # -- 3. cross-node ---------------------------------------------------------------------------

    def cross(self) -> dict[str, Any]:
        a = self.args
        pairs = {"daemons_mpi": (self.workers["C0"], self.workers["C1"]),
                 "daemons_grpc": (self.workers["H0"], self.workers["H1"])}
        cells: dict[str, dict[str, dict[str, list[int]]]] = {"daemons_mpi": {}, "daemons_grpc": {}, "raw_mpi": {}}
        for size in a.cross_sizes:
            per_round = self.per_round(size)
            ring = int(min(64, max(2, (256 * MiB) // size)))
            for A, _ in pairs.values():
                A.call("ring", size, ring, timeout=120)
            for name, (A, B) in pairs.items():
                cells[name][str(size)] = {"send": [], "recv": [], "hop": []}
                for _ in range(_WARMUP):
                    self.seq_sample(A, B, "blocking", size, ring, 0, 1)
                    self.hop_sample(A, B, "blocking", size, ring, 0, 1)
            cells["raw_mpi"][str(size)] = {"oneway": []}
            self.raw_run(size, 1)  # warm-up
            order = ["daemons_mpi", "daemons_grpc", "raw_mpi"]
            for _ in range(a.rounds):
                for name in order:
                    cell = cells[name][str(size)]
                    if name == "raw_mpi":
                        cell["oneway"] += self.raw_run(size, per_round)
                    else:
                        A, B = pairs[name]
                        for _ in range(per_round):
                            s, r = self.seq_sample(A, B, "blocking", size, ring, 0, 1)
                            cell["send"].append(s)
                            cell["recv"].append(r)
                            cell["hop"].append(self.hop_sample(A, B, "blocking", size, ring, 0, 1))
                    self.step(f"cross-node {format_size(size)} {name}")
                order = order[1:] + order[:1]
            for A, _ in pairs.values():
                A.call("ring", 0, 0)
        return cells

    # -- the whole run ---------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from .cli import _mpiexec

        a = self.args
        want = a.scenarios
        launcher = _mpiexec() if "cross" in want else None
        if "cross" in want and launcher is None:
            raise BenchError("no mpiexec found (pip install 'rendezvous[mpi]', or set RENDEZVOUS_MPIEXEC); "
                             "--scenarios local,small skips the cross-node scenario")
        self.total = ((len(a.sizes) * a.rounds * 2 + sum(1 for s in a.sizes if s in a.aio_sizes) * a.rounds
                       if "local" in want else 0) + (4 * a.rounds + 2 * a.rate_rounds if "small" in want else 0)
                      + (3 * a.rounds * len(a.cross_sizes) if "cross" in want else 0))
        started = time.monotonic()
        local_cells = small = cross_cells = None
        if want & {"local", "small"}:
            self.progress(0, self.total, "starting the daemon and its clients")
            self.start_local_daemon()
            local = self.daemons["local"].local
            for name in ("A", "B"):
                self.start_worker(name)
                self.workers[name].call("connect", "blocking", local, "blocking", timeout=60)
                self.workers[name].call("connect", "aio", local, "aio", timeout=60)
            procs = {"rendezvousd": self.daemons["local"].pid, "client A (sender)": self.workers["A"].pid,
                     "client B (receiver)": self.workers["B"].pid}
            if "local" in want:
                start = self.snapshot_start(procs)
                local_cells = self.local_hop()
                self.snapshot_end("local_hop", start, ["local"], ["A", "B"])
            if "small" in want:
                echo = f"{self.dir}/echo.sock"
                self.start_worker("E").call("serve_echo", echo, timeout=60)
                self.workers["B"].call("grpc_connect", echo, timeout=60)
                procs = {**procs, "grpc echo server": self.workers["E"].pid}
                start = self.snapshot_start(procs)
                small = self.small()
                self.snapshot_end("small", start, ["local"], ["A", "B"])
        if "cross" in want:
            self.progress(self.done, self.total, "starting the daemon pairs and raw MPI ranks")
            self.start_mpi_daemons(launcher)
            self.start_grpc_daemons()
            self.start_raw_mpi(launcher)
            for name, daemon in (("C0", "mpi0"), ("C1", "mpi1"), ("H0", "grpc0"), ("H1", "grpc1")):
                self.start_worker(name).call("connect", "blocking", self.daemons[daemon].local, "blocking",
                                             timeout=60)
            procs = {"rendezvousd 0 (grpc+mpi)": self.daemons["mpi0"].pid,
                     "rendezvousd 1 (grpc+mpi)": self.daemons["mpi1"].pid,
                     "rendezvousd 0 (grpc)": self.daemons["grpc0"].pid,
                     "rendezvousd 1 (grpc)": self.daemons["grpc1"].pid,
                     "client A on daemon 0 (grpc+mpi)": self.workers["C0"].pid,
                     "client B on daemon 1 (grpc+mpi)": self.workers["C1"].pid,
                     "client A on daemon 0 (grpc)": self.workers["H0"].pid,
                     "client B on daemon 1 (grpc)": self.workers["H1"].pid,
                     **{f"raw MPI rank {i}": pid for i, pid in enumerate(self.raw_pids)}}
            start = self.snapshot_start(procs)
            cross_cells = self.cross()
            self.snapshot_end("cross", start, ["mpi0", "mpi1", "grpc0", "grpc1"], ["C0", "C1", "H0", "H1"])
        return self.document(local_cells, small, cross_cells, time.monotonic() - started)

    # -- the results document ------------------------------------------------------------------

    def document(self, local_cells: dict | None, small: dict | None, cross_cells: dict | None,
                 seconds: float) -> dict[str, Any]:
        import grpc

        a = self.args

        def summ(cells: dict) -> dict:
            return {name: {size: {metric: _summary(ns, int(size)) for metric, ns in m.items() if ns}
                           for size, m in by_size.items()} for name, by_size in cells.items()}

        small_doc = None
        if small is not None:
            rate = {}
            for name, cell in small["rate"].items():
                per_s = [small["outstanding"] / (ns / 1e9) for ns in cell["ns"]]
                rate[name] = {"ops_per_s": per_s, "median_ops_per_s": statistics.median(per_s),
                              "failures": cell["failures"], "errors": cell["errors"][:3]}
            small_doc = {"size": small["size"], "outstanding": small["outstanding"], "rate": rate,
                         "ops": {name: _summary(ns, small["size"]) for name, ns in small["ops"].items()}}
        env = {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "numpy": np.__version__,
            "grpcio": grpc.__version__,
            **self.environment,
        }
        measured = set()
        for section in (local_cells, cross_cells):
            measured |= set(section or {})
        if small is not None:
            measured |= set(small["ops"]) | set(small["rate"])
        contenders = {k: v for k, v in CONTENDERS.items() if k in measured}
        sizes = set(a.sizes if local_cells is not None else []) | set(a.cross_sizes if cross_cells is not None else [])
        doc = {
            "kind": "rendezvous bench-daemon",
            "version": 1,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(seconds, 1),
            "quick": a.quick,
            "args": {"scenarios": sorted(a.scenarios),
                     "sizes": a.sizes if local_cells is not None else [],
                     "aio_sizes": [s for s in a.sizes if s in a.aio_sizes] if local_cells is not None else [],
                     "cross_sizes": a.cross_sizes if cross_cells is not None else [], "rounds": a.rounds,
                     "samples": {str(s): self.samples(s) for s in sorted(sizes)},
                     "small_ops": a.small_ops, "outstanding": a.outstanding, "rate_rounds": a.rate_rounds,
                     "pool_bytes": a.pool_bytes, "daemon_env": a.daemon_env},
            "environment": env,
            "contenders": contenders,
            "local_hop": summ(local_cells) if local_cells is not None else None,
            "small": small_doc,
            "cross": summ(cross_cells) if cross_cells is not None else None,
            "memory": {"pool_limit": a.pool_bytes, "scenarios": self.memory},
        }
        doc["targets"] = targets(doc)
        return doc


def _summary(samples_ns: list[int], nbytes: int) -> dict[str, Any]:
    s = summarize(samples_ns, nbytes)
    return {**s, "ms": s["median_us"] / 1e3}


# -- targets and the Markdown -----------------------------------------------------------------

def _gbps(doc: dict, section: str, name: str, size: int, metric: str) -> float | None:
    cells = doc.get(section) or {}
    cell = cells.get(name, {}).get(str(size), {}).get(metric)
    return cell["gbps"] if cell else None


def _target(tid: str, what: str, measured: float | None, op: str, goal: float) -> dict[str, Any]:
    met = None if measured is None else (measured >= goal if op == ">=" else measured <= goal)
    return {"id": tid, "what": what, "measured": measured, "op": op, "goal": goal, "met": met}


def targets(doc: dict) -> list[dict[str, Any]]:
    """Each target with the ratio measured in this run and whether it is met (None: not measured)."""
    out = []
    hop_cells = doc.get("local_hop") or {}
    sizes = doc["args"]["sizes"]

    def local(tid: str, what: str, name: str, size: int, goal: float) -> None:
        hop, ref = _gbps(doc, "local_hop", name, size, "hop"), _gbps(doc, "local_hop", "memcpy", size, "copy")
        out.append(_target(tid, what, hop / ref if hop and ref else None, ">=", goal))

    for client in ("blocking", "aio"):
        name = f"local_{client}"
        big = [s for s in sizes if s >= 64 * MiB and str(s) in hop_cells.get(name, {})]
        if client == "blocking" and not big:
            out.append(_target("local_hop_large_blocking", "local hop >= 64 MiB (blocking): hop GB/s / memcpy GB/s",
                               None, ">=", 0.5))
        for s in big:
            local(f"local_hop_{s}_{client}", f"local hop {format_size(s)} ({client}): hop GB/s / memcpy GB/s",
                  name, s, 0.5)
        if client == "blocking" or str(MiB) in hop_cells.get(name, {}):
            local(f"local_hop_1MiB_{client}", f"local hop 1 MiB ({client}): hop GB/s / memcpy GB/s", name, MiB, 0.25)
    small = doc.get("small") or {"ops": {}, "rate": {}, "outstanding": 0}
    ops = small["ops"]
    ref = ops.get("grpc_aio_unary", {}).get("median_us")
    for name in ("send_blocking", "recv_blocking", "send_aio", "recv_aio"):
        value = ops.get(name, {}).get("median_us")
        op, client = name.split("_")
        out.append(_target(f"small_{name}", f"1 KiB {op} ({client}) latency / bare grpc.aio unary latency",
                           value / ref if value and ref else None, "<=", 1.0))
    rate = small["rate"]
    mine, theirs = (rate.get(k, {}).get("median_ops_per_s") for k in ("rate_aio_recv", "rate_grpc_aio"))
    out.append(_target("rate", f"{small['outstanding'] or doc['args']['outstanding']} recvs outstanding (aio) / "
                               "as many bare grpc.aio unary calls, ops/s",
                       mine / theirs if mine and theirs else None, ">=", 3.0))
    hop, ref = _gbps(doc, "cross", "daemons_mpi", 64 * MiB, "hop"), _gbps(doc, "cross", "raw_mpi", 64 * MiB, "oneway")
    out.append(_target("cross_mpi_64MiB", "cross-node 64 MiB through two daemons on the MPI path: hop GB/s / raw "
                                          "MPI GB/s", hop / ref if hop and ref else None, ">=", 0.6))
    return out


def _f(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}f}"


def _md(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _mib(n: float) -> str:
    return f"{n / MiB:.0f}"


def render(doc: dict) -> str:
    """The results as Markdown."""
    env = doc["environment"]
    lines = ["# rendezvousd: local hop, small tensors, cross-node", "",
             f"{doc['created']}; {doc['seconds']:.0f} s; {'quick run; ' if doc['quick'] else ''}"
             + ", ".join(f"{k} {v}" for k, v in env.items()), "",
             "Every process runs on this machine; contenders take turns round by round "
             f"({doc['args']['rounds']} rounds); times are medians; every ratio is between contenders of this "
             "run. GB/s = 10^9 bytes/s."
             + (" Daemons' environment: " + ", ".join(f"{k}={v}" for k, v in doc["args"]["daemon_env"].items())
                + "." if doc["args"].get("daemon_env") else ""), "", "## Targets", ""]
    rows = []
    for t in doc["targets"]:
        result = "not measured" if t["met"] is None else ("**met**" if t["met"] else "**missed**")
        rows.append([t["what"], _f(t["measured"]), f"{'≥' if t['op'] == '>=' else '≤'} {t['goal']:g}", result])
    lines += _md(["target", "measured", "goal", "result"], rows)

    hop_cells = doc.get("local_hop")
    if hop_cells:
        lines += ["", "## 1. Local hop: client A → rendezvousd → client B (separate processes)", "",
                  "send: A's send, nobody waiting yet; recv: B's recv of the tensor already in the daemon; hop: "
                  "B's recv posted first, from A's send starting to B holding the array. A distinct tensor every "
                  "sample (B checks it). memcpy: one `numpy.copyto` between two warm preallocated buffers.", ""]
        rows = []
        for size in doc["args"]["sizes"]:
            copy = hop_cells["memcpy"].get(str(size), {}).get("copy")
            for name in ("local_blocking", "local_aio"):
                c = hop_cells.get(name, {}).get(str(size))
                if not c:
                    continue
                ratio = c["hop"]["gbps"] / copy["gbps"] if copy else None
                rows.append([format_size(size), name.split("_")[1], _f(c["send"]["ms"], 3), _f(c["send"]["gbps"]),
                             _f(c["recv"]["ms"], 3), _f(c["recv"]["gbps"]), _f(c["hop"]["ms"], 3),
                             _f(c["hop"]["gbps"]), _f(copy["ms"], 3) if copy else "-",
                             _f(copy["gbps"]) if copy else "-", _f(ratio), str(c["hop"]["samples"])])
        lines += _md(["size", "client", "send ms", "send GB/s", "recv ms", "recv GB/s", "hop ms", "hop GB/s",
                      "memcpy ms", "memcpy GB/s", "hop ÷ memcpy", "samples"], rows)

    small = doc.get("small")
    if small:
        ops = small["ops"]
        lines += ["", f"## 2. Small tensors ({format_size(small['size'])})", "",
                  "One operation after another from a client process (recv: of a tensor already sent); bare gRPC: "
                  "a 1 KiB echo (generic handler, raw bytes) over a Unix socket to another process.", ""]
        ref_aio = ops.get("grpc_aio_unary", {}).get("median_us")
        ref_sync = ops.get("grpc_sync_unary", {}).get("median_us")
        rows = []
        for name in ("send_blocking", "recv_blocking", "send_aio", "recv_aio", "grpc_aio_unary", "grpc_sync_unary"):
            s = ops.get(name)
            if not s:
                continue
            rows.append([name, _f(s["median_us"], 1), _f(s["p99_us"], 1),
                         _f(s["median_us"] / ref_aio if ref_aio else None),
                         _f(s["median_us"] / ref_sync if ref_sync else None), str(s["samples"])])
        lines += _md(["operation", "median µs", "p99 µs", "× grpc.aio unary", "× sync unary", "samples"], rows)
        rate = small["rate"]
        ref = rate.get("rate_grpc_aio", {}).get("median_ops_per_s")
        lines += ["", f"**Rate**: {small['outstanding']} operations outstanding at once (asyncio.gather), "
                      "median of the rounds:", ""]
        rows = []
        for name, r in rate.items():
            rows.append([name, f"{r['median_ops_per_s']:.0f}", _f(r["median_ops_per_s"] / ref if ref else None),
                         str(r["failures"]) + (f" ({r['errors'][0]})" if r["errors"] else ""),
                         str(len(r["ops_per_s"]))])
        lines += _md(["contender", "ops/s", "× grpc.aio", "failed calls", "rounds"], rows)

    cross = doc.get("cross")
    if cross:
        lines += ["", "## 3. Cross-node: A on rendezvousd 0 → B on rendezvousd 1 (both daemons on this machine)", "",
                  "daemons_mpi: two daemons under `mpiexec -n 2`, protocol grpc+mpi (the tensor's bytes over MPI); "
                  "daemons_grpc: two daemons, protocol grpc. send/recv/hop as above; recv and hop include daemon "
                  "1's fetch from daemon 0. raw_mpi: mpi4py Send/Recv of a preallocated buffer between two ranks, "
                  "from the send's start to the receive's end.", ""]
        rows = []
        for size in doc["args"]["cross_sizes"]:
            raw = cross.get("raw_mpi", {}).get(str(size), {}).get("oneway")
            for name in ("daemons_mpi", "daemons_grpc"):
                c = cross.get(name, {}).get(str(size))
                if not c:
                    continue
                rows.append([format_size(size), name, _f(c["send"]["ms"], 3), _f(c["recv"]["ms"], 3),
                             _f(c["recv"]["gbps"]), _f(c["recv"]["gbps"] / raw["gbps"] if raw else None),
                             _f(c["hop"]["ms"], 3), _f(c["hop"]["gbps"]),
                             _f(c["hop"]["gbps"] / raw["gbps"] if raw else None), str(c["hop"]["samples"])])
            if raw:
                rows.append([format_size(size), "raw_mpi", "-", "-", "-", "-", _f(raw["ms"], 3), _f(raw["gbps"]),
                             "1.00", str(raw["samples"])])
        lines += _md(["size", "contender", "send ms", "recv ms", "recv GB/s", "recv ÷ raw MPI", "hop ms",
                      "hop GB/s", "hop ÷ raw MPI", "samples"], rows)

    mem = doc["memory"]
    lines += ["", "## 4. Memory and CPU", "",
              "Peak RSS (VmHWM, reset at the scenario's start; it counts the shared-memory pages a process has "
              "touched, which the daemon and its clients share), RSS at the end, and CPU seconds used during the "
              f"scenario; then each daemon's pool after it. Pool limit {format_size(mem['pool_limit'])} per daemon "
              "(RENDEZVOUS_SHM_POOL_BYTES).", ""]
    rows = []
    for scenario, s in mem["scenarios"].items():
        for label, p in s["processes"].items():
            rows.append([scenario, label, _mib(p["start_rss"]), _mib(p["peak_rss"]) + ("" if p["reset"] else " *"),
                         _mib(p["end_rss"]), _mib(p["end_shmem"]), f"{p['cpu_s']:.1f} of {p['wall_s']:.0f}"])
    lines += _md(["scenario", "process", "RSS at start MiB", "peak RSS MiB", "RSS at end MiB",
                  "of which shared memory MiB", "CPU s (of wall s)"], rows)
    lines += ["", "Local hop counts of each client since it connected (how its tensors crossed the local hop):", ""]
    rows = []
    for scenario, s in mem["scenarios"].items():
        for worker, clients in s.get("client_stats", {}).items():
            for client, counts in clients.items():
                rows.append([scenario, f"{worker} ({client})",
                             ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))])
    lines += _md(["after scenario", "client", "counts"], rows)
    if any(not p["reset"] for s in mem["scenarios"].values() for p in s["processes"].values()):
        lines += ["", "\\* peak since the process started (its peak could not be reset)."]
    lines += [""]
    rows = []
    for scenario, s in mem["scenarios"].items():
        for name, pool in s["pools"].items():
            if "error" in pool:
                rows.append([scenario, name, pool["error"], "", "", "", ""])
                continue
            rows.append([scenario, name, _mib(pool.get("shm_pool_bytes", 0)),
                         _mib(pool.get("shm_pool_free_bytes", 0)), f"{pool.get('shm_pool_segments', 0):.0f}",
                         f"{pool.get('shm_pool_held', 0):.0f}",
                         "yes" if pool.get("shm_pool_bytes", 0) <= mem["pool_limit"] else "NO"])
    lines += _md(["scenario", "daemon", "pool MiB", "free MiB", "segments", "held by clients", "within limit"], rows)
    return "\n".join(lines) + "\n"


# -- the command ------------------------------------------------------------------------------

def _sizes(text: str, flag: str) -> list[int]:
    try:
        sizes = sorted({parse_size(s) for s in text.split(",") if s.strip()})
    except ValueError as exc:
        raise SystemExit(f"rendezvous bench-daemon: {flag}: {exc}") from None
    if not sizes:
        raise SystemExit(f"rendezvous bench-daemon: {flag} names no size")
    return sizes


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rendezvous bench-daemon", description=__doc__.split("\n\n")[0],
                                epilog="Writes daemon.json and daemon.md into --out.")
    p.add_argument("--quick", action="store_true",
                   help=f"sizes {_QUICK['sizes']} (cross-node {_QUICK['cross_sizes']}), fewer samples: "
                        "about 2 minutes on 2 cores")
    p.add_argument("--sizes", help=f"local-hop sizes (default {_FULL['sizes']})")
    p.add_argument("--aio-sizes", default="1K,1M,64M",
                   help="sizes (of --sizes) at which the asyncio client runs the local hop too (default 1K,1M,64M)")
    p.add_argument("--cross-sizes", help=f"cross-node sizes (default {_FULL['cross_sizes']})")
    p.add_argument("--scenarios", default="local,small,cross",
                   help="which scenarios to run: any of local (the local hop), small (1 KiB tensors and the "
                        "rate), cross (two daemons and raw MPI); default all")
    p.add_argument("--samples", type=int, metavar="N",
                   help="timed samples of each kind per contender and size (default: enough to move "
                        "--budget bytes, within [5, 400]; quick [3, 24]; rounded up to whole rounds)")
    p.add_argument("--budget", metavar="SIZE", help="bytes each contender moves per size (default 1G, quick 64M)")
    p.add_argument("--rounds", type=int, metavar="N", help="interleaved rounds (default 5, quick 2)")
    p.add_argument("--small-ops", type=int, metavar="N",
                   help="1 KiB operations per contender and round (default 1000, quick 200)")
    p.add_argument("--outstanding", type=int, default=1000, metavar="N",
                   help="operations outstanding at once in the rate test (default 1000)")
    p.add_argument("--rate-rounds", type=int, metavar="N", help="rounds of the rate test (default 7, quick 2)")
    p.add_argument("--pool-bytes", default="2G", metavar="SIZE",
                   help="each daemon's shared-memory pool limit (RENDEZVOUS_SHM_POOL_BYTES; default 2G)")
    p.add_argument("--daemon-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment setting for every daemon started (repeatable), e.g. "
                        "RENDEZVOUS_RETRY_CACHE_BYTES=0")
    p.add_argument("--out", default="bench-results", metavar="DIR", help="where daemon.json and daemon.md go")
    p.add_argument("--timeout", type=float, default=1500.0, metavar="S",
                   help="seconds the whole run may take (default 1500)")
    return p


def options(argv: list[str] | None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    base = _QUICK if args.quick else _FULL
    args.sizes = _sizes(args.sizes or base["sizes"], "--sizes")
    args.cross_sizes = _sizes(args.cross_sizes or base["cross_sizes"], "--cross-sizes")
    aio = set(_sizes(args.aio_sizes, "--aio-sizes")) & set(args.sizes)
    args.aio_sizes = aio or {args.sizes[0]}
    try:
        args.budget = parse_size(args.budget) if args.budget else base["budget"]
        args.pool_bytes = parse_size(args.pool_bytes)
    except ValueError as exc:
        raise SystemExit(f"rendezvous bench-daemon: {exc}") from None
    args.least, args.most = base["least"], base["most"]
    for name in ("rounds", "small_ops", "rate_rounds"):
        if getattr(args, name) is None:
            setattr(args, name, base[name])
    for name in ("samples", "rounds", "small_ops", "rate_rounds", "outstanding"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"rendezvous bench-daemon: --{name.replace('_', '-')} must be >= 1")
    env = {}
    for item in args.daemon_env:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise SystemExit(f"rendezvous bench-daemon: --daemon-env {item!r} is not NAME=VALUE")
        env[name] = value
    args.daemon_env = env
    args.scenarios = {w.strip() for w in args.scenarios.split(",") if w.strip()}
    unknown = args.scenarios - {"local", "small", "cross"}
    if unknown or not args.scenarios:
        raise SystemExit(f"rendezvous bench-daemon: --scenarios: unknown {', '.join(sorted(unknown)) or 'none'}; "
                         "known: local, small, cross")
    biggest = max([*args.sizes, *(args.cross_sizes if "cross" in args.scenarios else [])])
    if args.pool_bytes < 3 * biggest:
        raise SystemExit(f"rendezvous bench-daemon: --pool-bytes {format_size(args.pool_bytes)} cannot hold three "
                         f"{format_size(biggest)} segments (a send's, its replacement's, a receiver's)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--raw-mpi"] and len(argv) == 2:
        return _raw_mpi(argv[1])
    args = options(argv)
    from .cli import Progress

    bar = Progress(sys.stderr)
    bench = Bench(args, bar.update)

    def terminated(signum: int, frame: Any) -> None:
        raise BenchError(f"stopped by signal {signal.Signals(signum).name}")

    old = signal.signal(signal.SIGTERM, terminated)
    try:
        doc = bench.run()
    except (BenchError, KeyboardInterrupt) as exc:
        bar.close()
        print(f"rendezvous bench-daemon: {exc if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old)
        bench.close()
    bar.close()
    from .report import save

    save(args.out, doc, render(doc), JSON_NAME, MARKDOWN_NAME)
    return 0


if __name__ == "__main__":
    sys.exit(main())
