"""What runs in ``bench-daemon``'s worker processes.

* :class:`ClientsWorker`: a spawned process (:class:`rendezvous.bench.procs.Worker`)
  holding rendezvous clients of a daemon (:class:`Clients`: send, recv, the
  small-tensor runs and the rate test, each timed in the process that makes
  the call) and bare gRPC (:class:`BareGrpc`: the 1 KiB echo calls the small
  tensors are compared with, and the echo server itself);
* :func:`raw_mpi_rank`: one of two ranks under ``mpiexec`` timing mpi4py
  ``Send``/``Recv``, the cross-node bound (``python -m mpi4py -m
  rendezvous.bench.daemon_workers --raw-mpi PATH``);
* :func:`fill` and :func:`verify`: a distinct tensor per sample, made before
  the clock starts and checked after it stops.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from typing import Any

import numpy as np

from .control import Link
from .samples import fill, key, stamp_only, verify

__all__ = ["ClientsWorker", "Clients", "BareGrpc", "raw_mpi_rank"]

_ECHO = "/rendezvous.bench.Echo/Echo"


# -- the worker processes ----------------------------------------------------------------

class _OnLoop:
    """A worker process's own event loop (the asyncio client and grpc.aio run on it)."""

    def __init__(self, conn: Any, name: str) -> None:
        from rendezvous.config import Config
        from rendezvous.lifecycle import new_event_loop

        self.conn = conn
        self.name = name
        self.loop = new_event_loop(Config.load().uvloop)
        asyncio.set_event_loop(self.loop)

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        """Close what the worker opened (idempotent)."""


class Clients(_OnLoop):
    """Rendezvous clients of a daemon's local address, by name; every timed call is
    timed here, in the process that makes it."""

    def __init__(self, conn: Any, name: str) -> None:
        super().__init__(conn, name)
        self.clients: dict[str, tuple[str, Any]] = {}
        self.ring: list[np.ndarray] = []

    def op_connect(self, name: str, address: str, kind: str, session: bool = True) -> dict[str, Any]:
        """A client of ``address``: ``kind`` blocking or aio; with ``session`` it
        must have the session socket, else it must not (the local gRPC service)."""
        from rendezvous.client import Client
        from rendezvous.client.aio import Client as AioClient

        client: Client | AioClient
        if kind == "blocking":
            client = Client(address, connect_timeout=30)
        else:
            client = self.run(AioClient(address, connect_timeout=30).connect())
        if bool(client.session) != session:
            raise RuntimeError(f"the {kind} client of {address} {'did not get' if session else 'got'} "
                               "the session socket")
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
        fill(arr, stamp)  # produced before the clock starts
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

    def op_send_lent(self, name: str, key: str, size: int, stamp: int) -> tuple[int, int]:
        """A send of an array made by ``Client.empty`` (written in pool memory in
        the first place, then handed over with no copy)."""
        kind, client = self.clients[name]
        assert kind == "blocking"
        arr = client.empty(size, np.uint8)
        stamp_only(arr, stamp)  # produced before the clock starts (see op_recv's stamps_only)
        t0 = time.perf_counter_ns()
        client.send(key, arr)
        t1 = time.perf_counter_ns()
        del arr
        return t0, t1

    def op_recv(self, name: str, key: str, size: int, stamp: int, ready: bool, timeout: float,
                stamps_only: bool = False) -> tuple[int, int]:
        kind, client = self.clients[name]
        if kind == "blocking":
            if ready:
                self.conn.send(("ready", None))
            t0 = time.perf_counter_ns()
            x = client.recv(key, timeout=timeout)
            t1 = time.perf_counter_ns()
            verify(x, size, stamp, stamps_only)
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
            verify(x, size, stamp)
            del x
            await asyncio.sleep(0)  # the release goes out
            return t0, t1

        return self.run(go())

    def op_send_run(self, name: str, key: str, size: int, count: int, step: int) -> None:
        """``count`` sends of ``size`` bytes under ``key`` in ``step`` (``rendezvous
        bench``'s producer): each a distinct array, made here beforehand."""
        arrays = [np.full(size, i % 251, np.uint8) for i in range(count)]
        kind, client = self.clients[name]
        if kind == "blocking":
            for a in arrays:
                client.send(key, a, step_id=step)
            return

        async def go() -> None:
            for a in arrays:
                await client.send(key, a, step_id=step)

        self.run(go())

    def op_recv_run(self, name: str, key: str, size: int, count: int, step: int, timeout: float) -> list[int]:
        """``count`` recvs of ``key`` in ``step``, one after another, each timed (ns)
        and its size checked after its clock stopped (``rendezvous bench``'s consumer)."""
        kind, client = self.clients[name]
        out: list[int] = []
        clock = time.perf_counter_ns
        if kind == "blocking":
            for _ in range(count):
                t0 = clock()
                x = client.recv(key, step_id=step, timeout=timeout)
                out.append(clock() - t0)
                if x.nbytes != size:
                    raise AssertionError(f"received {x.nbytes} bytes, expected {size}")
                del x
            return out

        async def go() -> None:
            for _ in range(count):
                t0 = clock()
                x = await client.recv(key, step_id=step, timeout=timeout)
                out.append(clock() - t0)
                if x.nbytes != size:
                    raise AssertionError(f"received {x.nbytes} bytes, expected {size}")
                del x

        self.run(go())
        return out

    def op_small_send(self, name: str, prefix: str, n: int, size: int) -> list[int]:
        """``n`` sends of distinct tensors, one after another, each timed."""
        arrs = [np.empty(size, np.uint8) for _ in range(n)]
        for i, a in enumerate(arrs):
            fill(a, i)
        keys = [key(f"{prefix}_{i}") for i in range(n)]
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
        keys = [key(f"{prefix}_{i}") for i in range(n)]
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
            verify(x, size, i)
        return out

    def op_send_many(self, name: str, prefix: str, n: int, size: int) -> None:
        """Send ``n`` distinct tensors (untimed: the rate test's supply)."""
        kind, client = self.clients[name]
        arrs = [np.empty(size, np.uint8) for _ in range(n)]
        for i, a in enumerate(arrs):
            fill(a, i)
        keys = [key(f"{prefix}_{i}") for i in range(n)]
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
        keys = [key(f"{prefix}_{i}") for i in range(n)]

        async def go() -> tuple[int, list[Any]]:
            t0 = time.perf_counter_ns()
            got = await asyncio.gather(*(client.recv(k, timeout=timeout) for k in keys), return_exceptions=True)
            return time.perf_counter_ns() - t0, got

        ns, got = self.run(go())
        errors = [g for g in got if isinstance(g, BaseException)]
        for i, x in enumerate(got):
            if not isinstance(x, BaseException):
                verify(x, size, i)
        return {"ns": ns, "failures": len(errors), "error": repr(errors[0]) if errors else ""}

    def close(self) -> None:
        clients, self.clients = self.clients, {}
        for kind, client in clients.values():
            try:
                if kind == "blocking":
                    client.close()
                else:
                    self.run(client.close())
            except Exception:
                pass
        super().close()


class BareGrpc(_OnLoop):
    """Bare gRPC: a 1 KiB echo (generic handler, raw bytes) over a Unix socket, its
    calls from this process (sync and grpc.aio) or its server in this process."""

    def __init__(self, conn: Any, name: str) -> None:
        super().__init__(conn, name)
        self.grpc_aio: Any = None
        self.grpc_sync: Any = None
        self.grpc_aio_channel: Any = None
        self.grpc_sync_channel: Any = None
        self.echo: Any = None
        self.echo_loop: asyncio.AbstractEventLoop | None = None

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
        channel, self.grpc_sync_channel = self.grpc_sync_channel, None
        if channel is not None:
            channel.close()
        channel, self.grpc_aio_channel = self.grpc_aio_channel, None
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
        super().close()


class ClientsWorker(Clients, BareGrpc):
    """A ``bench-daemon`` worker process: its clients, then its bare gRPC, closed in that order."""


# -- raw MPI: two ranks under mpiexec, driven over a Unix socket ---------------------------

def raw_mpi_rank(path: str) -> int:
    """One rank of the raw MPI reference. Rank 0 takes commands (JSON lines) from the
    orchestrator's socket; rank 1 waits for them without spinning."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    pids = comm.gather(os.getpid(), root=0)
    link = None
    if rank == 0:
        link = Link(path, timeout=60)
        link.send({"pids": pids, "library": " ".join(MPI.Get_library_version().splitlines()[0].split())})
    buf: np.ndarray | None = None
    while True:
        if rank == 0:
            assert link is not None
            cmd = link.recv() or {"op": "stop"}
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
            assert link is not None
            link.send({"ns": times})
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--raw-mpi"] and len(sys.argv) == 3:
        sys.exit(raw_mpi_rank(sys.argv[2]))
    sys.exit("usage: python -m mpi4py -m rendezvous.bench.daemon_workers --raw-mpi PATH")
