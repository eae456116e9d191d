"""``rendezvous bench-steps``: one training step's gradient exchange, as users run it.

For each model (:mod:`rendezvous.bench.models`) and each contender, rank 1
produces a fresh array per parameter tensor (outside the timed window, as a
backward pass would), then rank 0 receives all of them: the time from its
first request to the last array in hand is one step. Contenders take turns
step by step, so the machine's noise falls on all of them alike; each gets
``--steps`` timed steps after one untimed warm-up.

Contenders:

* ``mpi``: raw mpi4py ``Isend``/``Irecv`` of every tensor into new arrays,
  then ``Waitall`` (the bound: nothing but the bytes);
* ``optimal``: ``rendezvous.aio.Server`` under ``grpc+mpi``, optimal path, a
  ``recv`` per key gathered concurrently;
* ``default``: the same with ``MPI_OPTIMAL_PATH=0`` (every tensor inside its
  gRPC reply);
* ``optimal_mr``, ``default_mr``: the same two with requests over MPI
  (``RENDEZVOUS_MPI_REQUESTS=1``);
* ``optimal_many``, ``optimal_mr_many``, ``default_many``: ``optimal``,
  ``optimal_mr`` and ``default`` with the whole step in one ``recv_many``;
* ``daemon_many``: through two daemons (``rendezvousd``, optimal path), one
  per rank: the producer's local client ``send_many`` to its daemon, the
  consumer's ``recv_many`` from its own (client and daemon share each
  rank's process and loop here; the CPU figures count both);
* ``blocking``: the blocking ``rendezvous.Server`` (optimal path), one
  ``recv`` after another, as a plain script does; ``blocking_many``: the
  same server's ``recv_many`` of the whole step; ``blocking_mr_many``: that
  with requests over MPI (a server of its own, after the other two);
* ``grpc``: raw grpc.aio, one unary call per tensor gathered concurrently
  (raw bytes in, raw bytes out);
* ``gloo``: ``torch.distributed`` gloo ``isend``/``irecv`` when torch imports.

The contenders above time tensors produced before the consumer asks. In
training the consumer usually asks first (the ps waits for the gradients)
and the producer sends as its backward pass makes them; the ``_waiting``
contenders time that order: the consumer's clock starts, it posts its
receives (``recv_many``; raw MPI's ``Irecv``s, gloo's ``irecv``s), then
both ranks meet and the producer sends (``send_many``, or one ``send`` per
tensor for ``_waiting_each``; raw MPI's ``Isend``s), and the clock stops
with the last tensor in hand: the sends are inside the clock. Their ratios
are to ``mpi_waiting`` and ``gloo_waiting``, measured the same way:

* ``mpi_waiting``, ``gloo_waiting``: the bounds, as above;
* ``optimal_many_waiting``, ``optimal_many_waiting_each``,
  ``optimal_mr_many_waiting``: ``rendezvous.aio.Server``'s ``recv_many``;
* ``blocking_many_waiting``: the blocking ``rendezvous.Server``'s
  ``recv_many`` (from a thread of its own: it waits) and ``send_many``.

Beside the time, each asyncio contender's CPU per tensor on each rank: the
consumer's process while it receives, the producer's loop thread until the
step is over (MPICH's barrier spins; it runs on a thread not counted).

Run outside MPI it launches itself under ``mpiexec -n 2``, both ranks on
this host, every server on 127.0.0.1. Across hosts, ``RENDEZVOUS_BENCH_HOSTS``
names two (``A,B``): the launch places rank 0 on A and rank 1 on B
(``mpiexec -hosts A,B -ppn 1``), each rank binds its servers (rendezvous's,
raw gRPC's) to its own host's address, and gloo meets at rank 0's
(``tests/netns.py bench-steps`` runs it across two namespace hosts).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from .models import MODELS, nbytes, shapes

if TYPE_CHECKING:
    import numpy as np

__all__ = ["add_arguments", "run", "main", "parser", "options", "HELP", "DESCRIPTION", "EPILOG", "CONTENDERS",
           "HOSTS_ENV"]

CONTENDERS = ("mpi", "optimal", "default", "optimal_mr", "default_mr", "optimal_many", "optimal_mr_many",
              "default_many", "daemon_many", "blocking",
              "blocking_many", "blocking_mr_many", "grpc", "gloo",
              "mpi_waiting", "optimal_many_waiting", "optimal_many_waiting_each", "optimal_mr_many_waiting",
              "blocking_many_waiting", "gloo_waiting")
#: the contenders the blocking Server runs (after the others, on a loop thread of its own):
#: name -> requests over MPI
_BLOCKING = {"blocking": False, "blocking_many": False, "blocking_mr_many": True, "blocking_many_waiting": False}
#: rendezvous contenders: (job, optimal path, requests over MPI)
_SERVERS = {"optimal": ("opt", True, False), "default": ("dflt", False, False),
            "optimal_mr": ("optmr", True, True), "default_mr": ("dfltmr", False, True),
            "optimal_many": ("optm", True, False), "optimal_mr_many": ("optmrm", True, True),
            "default_many": ("dfltm", False, False), "optimal_many_waiting": ("optmw", True, False),
            "optimal_many_waiting_each": ("optmwe", True, False), "optimal_mr_many_waiting": ("optmrmw", True, True)}
#: contenders whose consumer asks before the producer sends (see the module docstring)
WAITING = frozenset(n for n in CONTENDERS if "_waiting" in n)
_RESULT = "@steps-result "
#: the two ranks' hosts, ``A,B`` (rank 0 on A); unset: both on 127.0.0.1
HOSTS_ENV = "RENDEZVOUS_BENCH_HOSTS"
_LOOPBACK = "127.0.0.1"
_RAW_METHOD = "/rendezvous.bench.Steps/Get"
#: ``rendezvous --help``'s line for the command, its own --help's description and epilog
HELP = ("one training step's gradient exchange (ResNet-50, BERT-base, many small tensors) against raw MPI, "
        "gloo and raw gRPC")
DESCRIPTION = ("Exchange whole training steps' gradients (ResNet-50, BERT-base, 2,000 small tensors) between two "
               "ranks under mpiexec -n 2 (launched for you), the contenders taking turns step by step: raw MPI, "
               "rendezvous's paths, the blocking Server, raw gRPC, gloo. See BENCHMARKS.md.")
EPILOG = "Writes steps.json and steps.md into --out."


def _key(job: str, model: str, i: int) -> str:
    return (f"/job:{job}/replica:0/task:1/device:CPU:0;0000000000000000;"
            f"/job:{job}/replica:0/task:0/device:CPU:0;{model}_{i};0:0")


def _address(host: str, port: int) -> str:
    """``host:port`` (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _hosts() -> list[str] | None:
    """The ranks' hosts from ``RENDEZVOUS_BENCH_HOSTS`` (None: unset, both on loopback)."""
    listed = [h.strip() for h in os.environ.get(HOSTS_ENV, "").split(",") if h.strip()]
    if not listed:
        return None
    if len(listed) != 2:
        raise SystemExit(f"rendezvous bench-steps: {HOSTS_ENV} must name 2 hosts (rank 0's first), "
                         f"not {len(listed)}")
    return listed


def _produce(tensors: list[tuple[int, ...]], step: int) -> list[np.ndarray]:
    """A fresh float32 array per parameter, its first element the step (checked)."""
    import numpy as np

    out = []
    for shape in tensors:
        arr = np.empty(shape, np.float32)
        arr.reshape(-1)[:1] = step
        arr.reshape(-1)[1:] = 1.0
        out.append(arr)
    return out


def _check(arrays: list[Any], tensors: list[tuple[int, ...]], step: int) -> None:
    import numpy as np

    if len(arrays) != len(tensors):
        raise AssertionError(f"{len(arrays)} tensors received, {len(tensors)} sent")
    for arr, shape in zip(arrays, tensors):
        a = np.asarray(arr)
        if a.shape != shape or float(a.reshape(-1)[0]) != step:
            raise AssertionError(f"a received tensor is {a.shape} with first element {a.reshape(-1)[0]}, "
                                 f"expected {shape} from step {step}")


class _Rank:
    def __init__(self, opts: argparse.Namespace, meet: _Meet) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.world = MPI.COMM_WORLD
        self.rank = self.world.Get_rank()
        self.meet = meet
        self.comm = self.world.Dup()  # raw MPI's own traffic
        self.opts = opts
        #: each rank's host: its servers bind there, peers reach them there
        self.hosts: list[str] = opts.hosts or [_LOOPBACK] * 2
        self.servers: dict[str, Any] = {}
        #: CPU seconds of the last step on this rank (see _step)
        self.cpu = 0.0
        self.grpc: Any = None
        self.gloo = False
        self.daemon: Any = None  # daemon_many's daemon and its local client (client)

    # -- set-up -----------------------------------------------------------------

    async def setup(self, names: list[str]) -> list[str]:
        from rendezvous import aio

        cluster = {job: [_address(h, 0) for h in self.hosts] for job, _, _ in _SERVERS.values()}
        for name, (job, optimal, requests) in _SERVERS.items():
            if name in names:
                self.servers[name] = aio.Server(cluster, job, self.rank, "grpc+mpi", mpi_optimal_path=optimal,
                                                mpi_requests=requests, mpi_disabled=False)
        for server in self.servers.values():
            await server.start()  # collective: both ranks, same order
        if "daemon_many" in names:
            await self._start_daemon()
        if "grpc" in names:
            await self._start_raw_grpc()
        if "gloo" in names or "gloo_waiting" in names:
            self.gloo = self._start_gloo()
            if not self.gloo:
                names = [n for n in names if n not in ("gloo", "gloo_waiting")]
        return names

    async def _start_daemon(self) -> None:
        """A daemon on this rank (its own job, ``dmn``) and a local client of it."""
        import json
        import tempfile

        from rendezvous.client.aio import Client
        from rendezvous.config import Config
        from rendezvous.daemon.daemon import Daemon

        self.daemon_dir = tempfile.TemporaryDirectory(prefix="rdv-steps-")
        config = Config.load({"cluster": json.dumps({"dmn": [_address(h, 0) for h in self.hosts]}),
                              "job_name": "dmn", "task_index": self.rank, "protocol": "grpc+mpi",
                              "mpi_optimal_path": True, "mpi_disabled": False, "stall_warning": 0.0,
                              "local_address": f"unix:{self.daemon_dir.name}/d.sock"}, env={})
        self.daemon = Daemon(config)
        await self.daemon.start()  # collective, as the servers' starts
        self.client = Client(self.daemon.local_target)
        await self.client.connect()

    async def _start_raw_grpc(self) -> None:
        import grpc

        self.raw_store: dict[int, np.ndarray] = {}
        if self.rank == 1:
            async def get(request: bytes, context: Any) -> bytes:
                return self.raw_store.pop(int.from_bytes(request, "little")).data.cast("B").tobytes()

            server = grpc.aio.server(options=[("grpc.max_send_message_length", -1),
                                              ("grpc.max_receive_message_length", -1)])
            server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
                "rendezvous.bench.Steps", {"Get": grpc.unary_unary_rpc_method_handler(get)})])
            port = server.add_insecure_port(_address(self.hosts[1], 0))
            await server.start()
            self.grpc = server
            self.world.bcast(port, root=1)
        else:
            port = self.world.bcast(None, root=1)
            self.grpc = grpc.aio.insecure_channel(_address(self.hosts[1], port), options=[
                ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
            self.raw_call = self.grpc.unary_unary(_RAW_METHOD)

    def _start_gloo(self) -> bool:
        try:
            import torch.distributed as dist
        except ImportError:
            return False
        # Rank 0's host is the master (MASTER_ADDR/MASTER_PORT's tcp:// form). Which
        # interface gloo itself listens on is its own choice: GLOO_SOCKET_IFNAME.
        port = self.world.bcast(_free_port(self.hosts[0]) if self.rank == 0 else None, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://{_address(self.hosts[0], port)}", rank=self.rank,
                                world_size=2)
        return True

    async def close(self) -> None:
        for server in self.servers.values():
            await server.stop(1.0)
        if self.daemon is not None:
            await self.client.close()
            await self.daemon.stop(1.0)
            self.daemon_dir.cleanup()
        if self.grpc is not None:
            await (self.grpc.stop(0) if self.rank == 1 else self.grpc.close())
        if self.gloo:
            import torch.distributed as dist

            dist.destroy_process_group()

    # -- one step ------------------------------------------------------------------

    async def _offer(self, name: str, model: str, produced: list[np.ndarray], step: int) -> None:
        if name == "daemon_many":
            await self.client.send_many([(_key("dmn", model, i), a) for i, a in enumerate(produced)], step_id=step)
        elif name in self.servers:
            job = self.servers[name].task.job
            for i, arr in enumerate(produced):
                self.servers[name].send(_key(job, model, i), arr, step_id=step)
        elif name == "grpc":
            self.raw_store.update(enumerate(produced))
        else:
            self._pending_sends = produced  # raw MPI and gloo send inside the step

    async def _mpi(self, model: str, tensors: list, step: int) -> float | None:
        import numpy as np

        MPI = self.MPI
        if self.rank == 1:
            reqs = [self.comm.Isend([a, MPI.FLOAT], 0, i) for i, a in enumerate(self._pending_sends)]
            MPI.Request.Waitall(reqs)
            self._pending_sends = []
            return None
        t0 = time.perf_counter()
        out = [np.empty(s, np.float32) for s in tensors]
        MPI.Request.Waitall([self.comm.Irecv([a, MPI.FLOAT], 1, i) for i, a in enumerate(out)])
        took = time.perf_counter() - t0
        _check(out, tensors, step)
        return took

    async def _gloo(self, model: str, tensors: list, step: int) -> float | None:
        import torch
        import torch.distributed as dist

        if self.rank == 1:
            works = [dist.isend(torch.from_numpy(a), 0, tag=i) for i, a in enumerate(self._pending_sends)]
            for w in works:
                w.wait()
            self._pending_sends = []
            return None
        t0 = time.perf_counter()
        out = [torch.empty(s, dtype=torch.float32) for s in tensors]
        for w in [dist.irecv(a, 1, tag=i) for i, a in enumerate(out)]:
            w.wait()
        took = time.perf_counter() - t0
        _check([a.numpy() for a in out], tensors, step)
        return took

    async def _rendezvous(self, name: str, model: str, tensors: list, step: int) -> float | None:
        if self.rank == 1:
            return None
        server = self.servers[name]
        keys = [_key(server.task.job, model, i) for i in range(len(tensors))]
        t0 = time.perf_counter()
        if name.endswith("_many"):
            out = await server.recv_many(keys, step, 300)
        else:
            out = await asyncio.gather(*(server.recv(k, step, 300) for k in keys))
        took = time.perf_counter() - t0
        _check(out, tensors, step)
        return took

    async def _daemon_many(self, model: str, tensors: list, step: int) -> float | None:
        if self.rank == 1:
            return None
        keys = [_key("dmn", model, i) for i in range(len(tensors))]
        t0 = time.perf_counter()
        out = await self.client.recv_many(keys, step_id=step, timeout=300)
        took = time.perf_counter() - t0
        _check(out, tensors, step)
        return took

    async def _optimal(self, model: str, tensors: list, step: int) -> float | None:
        return await self._rendezvous("optimal", model, tensors, step)

    async def _default(self, model: str, tensors: list, step: int) -> float | None:
        return await self._rendezvous("default", model, tensors, step)

    async def _optimal_mr(self, model: str, tensors: list, step: int) -> float | None:
        return await self._rendezvous("optimal_mr", model, tensors, step)

    async def _default_mr(self, model: str, tensors: list, step: int) -> float | None:
        return await self._rendezvous("default_mr", model, tensors, step)

    async def _optimal_many(self, model: str, tensors: list, step: int) -> float | None:
        return await self._rendezvous("optimal_many", model, tensors, step)

    async def _optimal_mr_many(self, model: str, tensors: list, step: int) -> float | None:
        return await self._rendezvous("optimal_mr_many", model, tensors, step)

    async def _default_many(self, model: str, tensors: list, step: int) -> float | None:
        return await self._rendezvous("default_many", model, tensors, step)

    # -- the consumer first ------------------------------------------------------

    def _receiving(self, name: str, model: str, tensors: list, step: int) -> Any:
        """Consumer: post ``name``'s receives of the step now; an awaitable of
        what arrived."""
        import numpy as np

        if name == "mpi_waiting":
            MPI = self.MPI
            out = [np.empty(s, np.float32) for s in tensors]
            reqs = [self.comm.Irecv([a, MPI.FLOAT], 1, i) for i, a in enumerate(out)]
            # Waitall on a worker thread (MPI is at MULTIPLE): the loop stays free
            return _after(asyncio.get_running_loop().run_in_executor(None, MPI.Request.Waitall, reqs), out)
        if name == "gloo_waiting":
            import torch
            import torch.distributed as dist

            into = [torch.empty(s, dtype=torch.float32) for s in tensors]
            works = [dist.irecv(a, 1, tag=i) for i, a in enumerate(into)]

            def wait() -> list:
                for w in works:
                    w.wait()
                return [a.numpy() for a in into]
            return asyncio.get_running_loop().run_in_executor(None, wait)
        server = self.servers[name]
        keys = [_key(server.task.job, model, i) for i in range(len(tensors))]
        return asyncio.ensure_future(server.recv_many(keys, step, 300))

    def _sending(self, name: str, model: str, produced: list, step: int) -> Any:
        """Producer: send the step's tensors now (inside the consumer's clock); an
        awaitable of the sends' end, or None once they are handed over."""
        if name == "mpi_waiting":
            MPI = self.MPI
            reqs = [self.comm.Isend([a, MPI.FLOAT], 0, i) for i, a in enumerate(produced)]
            return asyncio.get_running_loop().run_in_executor(None, MPI.Request.Waitall, reqs)
        if name == "gloo_waiting":
            import torch
            import torch.distributed as dist

            works = [dist.isend(torch.from_numpy(a), 0, tag=i) for i, a in enumerate(produced)]

            def wait() -> None:
                for w in works:
                    w.wait()
            return asyncio.get_running_loop().run_in_executor(None, wait)
        server = self.servers[name]
        job = server.task.job
        if name.endswith("_each"):  # one send per tensor, as a backward pass hands them over
            for i, arr in enumerate(produced):
                server.send(_key(job, model, i), arr, step_id=step)
        else:
            server.send_many([(_key(job, model, i), a) for i, a in enumerate(produced)], step_id=step)
        return None

    async def _grpc(self, model: str, tensors: list, step: int) -> float | None:
        import numpy as np

        if self.rank == 1:
            return None  # the server answers on this loop until the barrier
        # At most 64 calls in flight: with thousands at once grpc.aio cancels some
        # of them (seen here: about 10% at 2,000), so a user would bound them too.
        window = asyncio.Semaphore(64)

        async def get(i: int) -> bytes:
            async with window:
                return await self.raw_call(i.to_bytes(8, "little"), timeout=300)

        t0 = time.perf_counter()
        raw = await asyncio.gather(*(get(i) for i in range(len(tensors))))
        out = [np.frombuffer(r, np.float32).reshape(s) for r, s in zip(raw, tensors)]
        took = time.perf_counter() - t0
        _check(out, tensors, step)
        return took


async def _after(done: Any, value: Any) -> Any:
    await done
    return value


def _free_port(host: str) -> int:
    """A port free on ``host`` now (this process's own address)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _Meet:
    """Where the two ranks meet ("produced: go", "step over") without MPI: one TCP
    connection between them (rank 1 listens on its host). A rank waiting here
    sleeps in the kernel, and its event loop stays free to serve; an MPI
    barrier spins a core while it waits (MPICH polls, in a worker thread or
    not), taken from the transfers being measured on a machine with as many
    cores as ranks (measured: the barrier thread had 30 % of the consumer's
    samples during a consumer-first step of 2,000 small tensors)."""

    def __init__(self, world: Any, hosts: list[str]) -> None:
        import socket

        family = socket.AF_INET6 if ":" in hosts[1] else socket.AF_INET
        if world.Get_rank() == 1:
            with socket.create_server((hosts[1], 0), family=family) as listener:
                listener.settimeout(120)
                world.bcast(listener.getsockname()[1], root=1)
                self.sock, _ = listener.accept()
        else:
            port = world.bcast(None, root=1)
            self.sock = socket.create_connection((hosts[1], port), timeout=120)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def wait(self) -> None:
        """Both ranks here (blocking)."""
        self.sock.setblocking(True)
        self.sock.sendall(b"m")
        if self.sock.recv(1) != b"m":
            raise ConnectionError("the other rank left")

    async def wait_async(self) -> None:
        """Both ranks here, this rank's loop free meanwhile."""
        loop = asyncio.get_running_loop()
        self.sock.setblocking(False)
        await loop.sock_sendall(self.sock, b"m")
        if await loop.sock_recv(self.sock, 1) != b"m":
            raise ConnectionError("the other rank left")

    def close(self) -> None:
        self.sock.close()


async def _barrier_async(rank: _Rank) -> None:
    """Both ranks meet, this rank's event loop free (its servers answer from it)
    and idle (see _Meet)."""
    await rank.meet.wait_async()


def _run_blocking(opts: argparse.Namespace, meet: _Meet) -> dict[str, dict[str, list[float]]]:
    """The blocking ``rendezvous.Server``'s contenders: those with gRPC requests
    on one server, then those with requests over MPI on another (one at a
    time: each has the process to itself)."""
    out: dict[str, dict[str, list[float]]] = {}
    for mpi_requests in (False, True):
        names = [n for n, mr in _BLOCKING.items() if mr is mpi_requests and n in opts.contenders]
        if names:
            out.update(_run_blocking_server(opts, names, mpi_requests, meet))
    return out


def _run_blocking_server(opts: argparse.Namespace, names: list[str], mpi_requests: bool,
                         meet: _Meet) -> dict[str, dict[str, list[float]]]:
    """One blocking ``rendezvous.Server``: its own loop thread (gRPC's asyncio runs
    one loop per process at a time, so it has the process to itself); ``blocking``
    receives one key after another from this thread, the ``_many`` contenders
    the whole step in one ``recv_many``, taking turns step by step."""
    from mpi4py import MPI

    import rendezvous

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    hosts = opts.hosts or [_LOOPBACK] * 2
    job = "blkmr" if mpi_requests else "blk"
    server = rendezvous.Server({job: [_address(h, 0) for h in hosts]}, job, rank, "grpc+mpi",
                               mpi_optimal_path=True, mpi_disabled=False, mpi_requests=mpi_requests)
    server.start()
    out: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    try:
        for model in opts.models:
            tensors = shapes(model)
            keys = [_key(job, model, i) for i in range(len(tensors))]
            for n in names:
                out[n][model] = []
            step = 0
            for turn in range(opts.steps + 1):
                for name in names:
                    step += 1
                    if name in WAITING:
                        took = _blocking_waiting(server, meet, rank, keys, tensors, step)
                        if rank == 0 and turn > 0:
                            out[name][model].append(took)  # type: ignore[arg-type]
                        meet.wait()
                        server.cleanup(step)
                        continue
                    if rank == 1:
                        server.send_many(list(zip(keys, _produce(tensors, step))), step_id=step)
                    meet.wait()
                    if rank == 0:
                        t0 = time.perf_counter()
                        if name != "blocking":
                            got = server.recv_many(keys, step, timeout=300)
                        else:
                            got = [server.recv(k, step, timeout=300) for k in keys]
                        took = time.perf_counter() - t0
                        _check(got, tensors, step)
                        if turn > 0:
                            out[name][model].append(took)
                        del got
                    meet.wait()
                    server.cleanup(step)
    finally:
        server.stop(1.0)
    return out


def _blocking_waiting(server: Any, meet: _Meet, rank: int, keys: list[str], tensors: list,
                      step: int) -> float | None:
    """The blocking Server's step with the consumer first: its ``recv_many`` waits
    on a thread of its own (a training script's consumer would simply block),
    the ranks meet, the producer's ``send_many``; rank 0's time, else None."""
    import concurrent.futures

    if rank == 1:
        produced = _produce(tensors, step)
        meet.wait()
        server.send_many(list(zip(keys, produced)), step_id=step)
        return None
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        t0 = time.perf_counter()
        receiving = pool.submit(server.recv_many, keys, step, 300)
        meet.wait()
        got = receiving.result()
        took = time.perf_counter() - t0
    _check(got, tensors, step)
    return took


async def run_rank(opts: argparse.Namespace, meet: _Meet) -> dict[str, Any] | None:
    rank = _Rank(opts, meet)
    names = await rank.setup([n for n in opts.contenders if n not in _BLOCKING])
    results: dict[str, dict[str, list[float]]] = {}
    cpu: dict[str, dict[str, list[float]]] = {}
    for model in opts.models:
        tensors = shapes(model)
        order = list(names)
        times: dict[str, list[float]] = {n: [] for n in names}
        cpu[model] = {n: [] for n in names}
        for step in range(opts.steps + 1):  # step 0: warm-up, not timed
            for name in order:
                took = await _step(rank, name, model, tensors, step + 1)
                if step and took is not None:
                    times[name].append(took)
                if step:
                    cpu[model][name].append(rank.cpu)
            order = order[1:] + order[:1]  # nobody always goes first
        results[model] = times
    await rank.close()
    producer_cpu = rank.world.gather(cpu, root=0)
    if producer_cpu is None:  # not rank 0
        return None
    return {"models": {m: {"tensors": len(shapes(m)), "bytes": nbytes(m), "seconds": results[m],
                           "cpu_us_per_tensor": _cpu_per_tensor(cpu[m], producer_cpu[1][m], len(shapes(m)))}
                       for m in opts.models}, "contenders": names}


def _cpu_per_tensor(consumer: dict[str, list[float]], producer: dict[str, list[float]],
                    tensors: int) -> dict[str, dict[str, float]]:
    """Median CPU microseconds per tensor of each contender on each rank."""
    import statistics

    return {n: {"consumer": statistics.median(consumer[n]) * 1e6 / tensors,
                "producer": statistics.median(producer[n]) * 1e6 / tensors}
            for n in consumer if consumer[n] and producer.get(n)}


def _merge_blocking(doc: dict[str, Any] | None, blocking: dict[str, dict[str, list[float]]]) -> dict[str, Any] | None:
    if doc is None:
        return None
    for name, by_model in blocking.items():
        for model, times in by_model.items():
            doc["models"][model]["seconds"][name] = times
        doc["contenders"].append(name)
    return doc


async def _step_waiting(rank: _Rank, name: str, model: str, tensors: list, step: int) -> float | None:
    """One step with the consumer first: its clock starts, it posts its receives,
    the ranks meet, the producer sends what it made (the sends inside the
    clock), and the clock stops with the last tensor in hand."""
    produced = _produce(tensors, step) if rank.rank == 1 else None  # the backward pass: not timed
    took = None
    if rank.rank == 0:
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        receiving = rank._receiving(name, model, tensors, step)
        await _barrier_async(rank)  # the receives are posted (their requests on their way): go
        out = await receiving
        took = time.perf_counter() - t0
        rank.cpu = time.process_time() - cpu0
        _check(out, tensors, step)
        del out
    else:
        await _barrier_async(rank)
        cpu0 = time.thread_time()
        sending = rank._sending(name, model, produced, step)  # type: ignore[arg-type]
        if sending is not None:
            await sending
    del produced
    await _barrier_async(rank)
    if rank.rank == 1:
        rank.cpu = time.thread_time() - cpu0
    if name in rank.servers:
        rank.servers[name].cleanup(step)
    return took


async def _step(rank: _Rank, name: str, model: str, tensors: list, step: int) -> float | None:
    if name in WAITING:
        return await _step_waiting(rank, name, model, tensors, step)
    produced = _produce(tensors, step) if rank.rank == 1 else None
    if produced is not None:  # rank 1
        await rank._offer(name, model, produced, step)
    del produced
    await _barrier_async(rank)  # the tensors are produced; the consumer starts its clock
    # CPU spent on this step: the consumer's whole process while it receives (its
    # barrier is behind it), the producer's loop thread until the step is over
    # (its barrier waits on a worker thread, where MPI's spinning is not counted)
    cpu0 = time.process_time() if rank.rank == 0 else time.thread_time()
    took = await getattr(rank, f"_{name}")(model, tensors, step)
    if rank.rank == 0:
        rank.cpu = time.process_time() - cpu0
    await _barrier_async(rank)
    if rank.rank == 1:
        rank.cpu = time.thread_time() - cpu0
    if name in rank.servers:
        rank.servers[name].cleanup(step)  # the producer forgets the step's retry answers
    elif name == "daemon_many":
        rank.daemon.server.cleanup(step)
    return took


# -- the command ---------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``rendezvous bench-steps``."""
    p.add_argument("--steps", type=int, default=7, metavar="N",
                   help="timed steps per model and contender, after one untimed warm-up (default 7)")
    p.add_argument("--models", default=",".join(MODELS), metavar="LIST",
                   help=f"comma-separated, any of {', '.join(MODELS)} (default all)")
    p.add_argument("--contenders", default=",".join(CONTENDERS), metavar="LIST",
                   help=f"comma-separated, any of {', '.join(CONTENDERS)} (default all; gloo only if torch "
                        "is installed)")
    p.add_argument("--out", default="bench-results", metavar="DIR",
                   help="where steps.json and steps.md go (default bench-results)")
    p.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                   help="seconds the whole run may take (default 1800)")


def parser() -> argparse.ArgumentParser:
    """``rendezvous bench-steps``'s parser on its own (:func:`main`, and the ranks
    this command launches)."""
    p = argparse.ArgumentParser(prog="rendezvous bench-steps", description=DESCRIPTION, epilog=EPILOG)
    add_arguments(p)
    return p


def options(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` checked, with ``models`` and ``contenders`` as lists (a copy), and
    ``hosts`` the ranks' hosts from ``RENDEZVOUS_BENCH_HOSTS`` (None: loopback)."""
    opts = argparse.Namespace(**vars(args))
    opts.models = [m.strip() for m in args.models.split(",") if m.strip()]
    opts.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    bad = [m for m in opts.models if m not in MODELS] + [c for c in opts.contenders if c not in CONTENDERS]
    if bad:
        raise SystemExit(f"rendezvous bench-steps: unknown {', '.join(bad)}")
    if not opts.models or not opts.contenders:
        raise SystemExit("rendezvous bench-steps: --models and --contenders must name at least one each")
    if args.steps < 1:
        raise SystemExit("rendezvous bench-steps: --steps must be >= 1")
    if args.timeout <= 0:
        raise SystemExit("rendezvous bench-steps: --timeout must be positive")
    opts.hosts = _hosts()
    return opts


def _argv(args: argparse.Namespace) -> list[str]:
    """The flags that reproduce ``args`` (handed to the ranks)."""
    return ["--steps", str(args.steps), "--models", args.models, "--contenders", args.contenders,
            "--out", str(args.out), "--timeout", repr(float(args.timeout))]


def run(args: argparse.Namespace) -> int:
    """Run ``rendezvous bench-steps`` with ``args`` (from :func:`add_arguments`):
    outside MPI, launch the two ranks and write the results; as a rank, measure."""
    opts = options(args)
    from rendezvous.rank.launch import launcher_rank

    if launcher_rank() is None:
        return _launch(opts, _argv(args))
    from rendezvous.config import Config
    from rendezvous.lifecycle import new_event_loop

    from mpi4py import MPI

    meet = _Meet(MPI.COMM_WORLD, opts.hosts or [_LOOPBACK] * 2)
    loop = new_event_loop(Config.load().uvloop)
    try:
        doc = loop.run_until_complete(run_rank(opts, meet))
    finally:
        loop.close()
    try:
        if any(n in opts.contenders for n in _BLOCKING):
            doc = _merge_blocking(doc, _run_blocking(opts, meet))
    finally:
        meet.close()
    if doc is not None:
        from .procs import emit

        emit(_RESULT, doc)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``rendezvous bench-steps`` from a command line (also how the ranks start)."""
    return run(parser().parse_args(argv))


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    from . import procs

    launcher = procs.mpiexec()
    if launcher is None:
        print(f"rendezvous bench-steps: {procs.NO_MPIEXEC}", file=sys.stderr)
        return 2
    # Across hosts: one rank on each, in order (rank 0 on the first).
    placement = ["-hosts", ",".join(args.hosts), "-ppn", "1"] if args.hosts else []
    cmd = [*launcher, *placement, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "rendezvous.bench.steps", *argv]
    done = procs.run("the bench-steps job", cmd, args.timeout)
    if done.timed_out:
        print(f"rendezvous bench-steps: the job ran past {args.timeout:g}s", file=sys.stderr)
        return 1
    docs = [procs.parse(line, _RESULT) for line in done.stdout if line.startswith(_RESULT)]
    if done.code != 0 or not docs:
        sys.stderr.write("".join(done.stdout)[-3000:] + done.stderr[-5000:])
        return done.code or 1
    doc = docs[0]
    from .report import save, steps_markdown

    save(args.out, doc, steps_markdown(doc), "steps.json", "steps.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
