"""Parameter-server training over rendezvous: the product's main job (`make demo`).

One ps task and two worker tasks train a softmax (multinomial logistic)
regression, 1024 features x 512 classes: 2 MiB of parameters, so the
parameters and gradients take the MPI optimal path while the per-step losses
(4 bytes) go inline. Each step every worker sends its gradients to the ps,
keyed by step; the ps averages them in a fixed order, applies SGD and sends
the new parameters back. The ps reports each step's time split into compute
(the workers' gradients and its own update, measured) and communication (the
rest: moving tensors and waiting for them).

    python examples/ps_training.py            # launches both runs below
    python examples/ps_training.py --hosts node1,node2,node3   # the same, one rank per host
    mpiexec -n 3 python examples/ps_training.py --cluster cluster.json
    MPI_DISABLED=1 mpiexec -n 3 python examples/ps_training.py --cluster cluster.json

Launched without --cluster, it picks three free loopback ports (or, with
--hosts A,B,C, takes port --port on each of three hosts: ps on A, workers
on B and C), writes a cluster file, and runs the job twice under
`mpiexec -n 3` (`mpiexec -hosts A,B,C -ppn 1 -n 3` with --hosts): protocol grpc+mpi
with MPI on, in the fastest setting measured for this job (the optimal path,
requests over gRPC: see BENCHMARKS.md), then with MPI_DISABLED=1 (gRPC only).
The two runs must reach the same loss (the transport never changes a byte),
and it says so, with each run's communication time per step. Each rank's
numpy computes on one thread unless OMP_NUM_THREADS or OPENBLAS_NUM_THREADS
is set: three ranks on a small machine would otherwise fight over its cores.

With --timeline DIR every rank of each run writes a timeline of its sends
and recvs (RENDEZVOUS_TIMELINE: DIR/mpi/ps-0.json, ... for run 1, DIR/grpc/
for run 2), and each run's ranks are merged into one file, DIR/mpi.json and
DIR/grpc.json, to open at ui.perfetto.dev or in chrome://tracing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FEATURES, CLASSES = 1024, 512
SAMPLES_PER_WORKER, BATCH = 2048, 256
LEARNING_RATE = 300.0  # large because the features are scaled by 1/sqrt(FEATURES)
WORKERS = 2


# --- the model -----------------------------------------------------------------

def make_shard(worker: int) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic data: labels from a hidden linear model shared by all workers."""
    truth = np.random.default_rng(1234).standard_normal((FEATURES, CLASSES)).astype(np.float32)
    rng = np.random.default_rng(100 + worker)
    x = rng.standard_normal((SAMPLES_PER_WORKER, FEATURES)).astype(np.float32) / np.sqrt(FEATURES)
    noise = rng.standard_normal((SAMPLES_PER_WORKER, CLASSES)).astype(np.float32) * 0.1
    y = np.argmax(x @ truth + noise, axis=1)
    return x, y


def loss_and_grads(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray):
    logits = x @ w + b
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    n = len(y)
    loss = -np.log(p[np.arange(n), y] + 1e-12).mean()
    p[np.arange(n), y] -= 1.0
    p /= n
    return np.float32(loss), (x.T @ p).astype(np.float32), p.sum(axis=0).astype(np.float32)


# --- one rank ------------------------------------------------------------------

PS = "/job:ps/replica:0/task:0"


def worker_task(i: int) -> str:
    return f"/job:worker/replica:0/task:{i}"


def key(src: str, dst: str, name: str) -> str:
    return f"{src}/device:CPU:0;0000000000000000;{dst}/device:CPU:0;{name};0:0"


def run_ps(server, steps: int) -> None:
    w = np.zeros((FEATURES, CLASSES), np.float32)
    b = np.zeros(CLASSES, np.float32)
    toggles = ", ".join(f"{v}={os.environ[v]!r}" if v in os.environ else f"{v} unset"
                        for v in ("MPI_DISABLED", "MPI_OPTIMAL_PATH", "RENDEZVOUS_MPI_REQUESTS"))
    print(f"parameter-server training: 1 ps + {WORKERS} workers, softmax regression "
          f"{FEATURES}x{CLASSES} ({(w.nbytes + b.nbytes) / 2**20:.1f} MiB of parameters), "
          f"{steps} steps; protocol {server.aio.protocol} ({toggles})", flush=True)
    print(f"{'step':>6} {'loss':>10}", flush=True)
    start = time.perf_counter()
    loss = float("nan")
    update = 0.0  # seconds the ps spent computing its updates
    for step in range(steps):
        # the whole step from every worker in one call, in a fixed order (the sum is
        # the same in every run): grad_w, grad_b, loss of worker 0, then worker 1
        got = server.recv_many([key(worker_task(i), PS, name) for i in range(WORKERS)
                                for name in ("grad_w", "grad_b", "loss")], step_id=step, timeout=120)
        grads_w, grads_b, losses = got[0::3], got[1::3], [float(v) for v in got[2::3]]
        t0 = time.perf_counter()
        w = w - LEARNING_RATE * (grads_w[0] + grads_w[1]) / WORKERS
        b = b - LEARNING_RATE * (grads_b[0] + grads_b[1]) / WORKERS
        loss = sum(losses) / WORKERS
        update += time.perf_counter() - t0
        if step % 10 == 0 or step == steps - 1:
            print(f"{step:>6} {loss:>10.6f}", flush=True)
        server.send_many([(key(PS, worker_task(i), name), value) for i in range(WORKERS)
                          for name, value in (("w", w), ("b", b))], step_id=step + 1)
    elapsed = time.perf_counter() - start
    totals = _counters(server.stats())
    for i in range(WORKERS):
        totals += server.recv(key(worker_task(i), PS, "stats"), step_id=steps + 1, timeout=120)
    for i in range(WORKERS):
        server.send(key(PS, worker_task(i), "bye"), np.ones(1, np.int8), step_id=steps + 2)
    _report(totals, elapsed, update, steps)
    print(f"final loss: {loss:.6f}", flush=True)


def run_worker(server, index: int, steps: int) -> None:
    me = worker_task(index)
    x, y = make_shard(index)
    w = np.zeros((FEATURES, CLASSES), np.float32)
    b = np.zeros(CLASSES, np.float32)
    compute = 0.0
    for step in range(steps):
        lo = (step * BATCH) % SAMPLES_PER_WORKER
        t0 = time.perf_counter()
        loss, gw, gb = loss_and_grads(w, b, x[lo:lo + BATCH], y[lo:lo + BATCH])
        compute += time.perf_counter() - t0
        server.send_many([(key(me, PS, "grad_w"), gw), (key(me, PS, "grad_b"), gb),
                          (key(me, PS, "loss"), np.array(loss, np.float32))], step_id=step)
        w, b = server.recv_many([key(PS, me, "w"), key(PS, me, "b")], step_id=step + 1, timeout=120)
    counters = _counters(server.stats())
    counters[COUNTERS.index(("worker", "compute_us"))] = int(compute * 1e6)
    server.send(key(me, PS, "stats"), counters, step_id=steps + 1)
    server.recv(key(PS, me, "bye"), step_id=steps + 2, timeout=120)


COUNTERS = [("grpc", "transfers"), ("grpc", "bytes"), ("mpi", "transfers"), ("mpi", "bytes"),
            ("grpc", "fallbacks"), ("local", "transfers"), ("worker", "compute_us")]


def _counters(stats: dict) -> np.ndarray:
    return np.array([stats[path][name] if path in stats else 0 for path, name in COUNTERS], np.int64)


def _report(totals: np.ndarray, elapsed: float, update: float, steps: int) -> None:
    t = dict(zip(COUNTERS, (int(v) for v in totals)))
    moved = t[("grpc", "bytes")] + t[("mpi", "bytes")]
    print("\nwhat moved (all ranks, received side):")
    print(f"  {'path':<12} {'transfers':>10} {'bytes':>14}")
    print(f"  {'gRPC inline':<12} {t[('grpc', 'transfers')]:>10} {t[('grpc', 'bytes')]:>14,}")
    print(f"  {'MPI':<12} {t[('mpi', 'transfers')]:>10} {t[('mpi', 'bytes')]:>14,}")
    print(f"  fallbacks to gRPC: {t[('grpc', 'fallbacks')]}")
    print(f"training took {elapsed:.2f} s; {moved / 2**20:,.1f} MiB moved, "
          f"{moved / elapsed / 1e9:.2f} GB/s of tensor traffic while training")
    # The workers compute their gradients at the same time, the ps its update
    # after them: compute on the step's path is one worker's share plus the update.
    step = elapsed / steps
    compute = (t[("worker", "compute_us")] / 1e6 / WORKERS + update) / steps
    comm = max(0.0, step - compute)
    print(f"per step: {step * 1e3:.1f} ms = compute {compute * 1e3:.1f} ms + communication "
          f"{comm * 1e3:.1f} ms")
    print(f"communication per step: {comm * 1e3:.2f} ms", flush=True)


def rank_main(args: argparse.Namespace) -> int:
    import rendezvous
    from rendezvous.rank.launch import launcher_rank

    found = launcher_rank()
    if found is None:
        print("run me under mpiexec -n 3 (or without --cluster to launch everything)", file=sys.stderr)
        return 2
    rank, size = found
    if size != 1 + WORKERS:
        print(f"this job needs exactly {1 + WORKERS} ranks, got {size}", file=sys.stderr)
        return 2
    job, index = ("ps", 0) if rank == 0 else ("worker", rank - 1)
    overrides = {"timeline": os.path.join(args.timeline, TIMELINE_FILE)} if args.timeline else {}
    server = rendezvous.Server(args.cluster, job, index, protocol=args.protocol, **overrides)
    server.start()
    try:
        if job == "ps":
            run_ps(server, args.steps)
        else:
            run_worker(server, index, args.steps)
    finally:
        server.stop(10)
    return 0


# --- launcher ------------------------------------------------------------------

def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _mpiexec() -> list[str]:
    custom = os.environ.get("RENDEZVOUS_MPIEXEC")
    if custom:
        return shlex.split(custom)
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if found is None:
        raise SystemExit("no mpiexec found: pip install 'rendezvous[mpi]' or set RENDEZVOUS_MPIEXEC")
    return [found]


def _run(title: str, cluster: str, steps: int, env: dict[str, str],
         timeout: float, placement: list[str]) -> tuple[float, float | None] | None:
    """Run the job once; its final loss and communication time per step (ms)."""
    print(f"\n=== {title} ===", flush=True)
    launch = [*_mpiexec(), *placement, "-n", str(1 + WORKERS), sys.executable]
    cmd = [*launch, "-m", "mpi4py", __file__, "--cluster", cluster, "--steps", str(steps)]
    if env.get("MPI_DISABLED") == "1":  # this launcher sets it itself, as "1"
        # no MPI at all in the ranks: plain python, not python -m mpi4py
        cmd = [*launch, __file__, "--cluster", cluster, "--steps", str(steps)]
    # the run's own toggles only: a MPI_DISABLED from the caller's shell must not leak into run 1
    full_env = {**{k: v for k, v in os.environ.items() if k != "MPI_DISABLED"}, **env}
    if "OMP_NUM_THREADS" not in full_env and "OPENBLAS_NUM_THREADS" not in full_env:
        full_env["OPENBLAS_NUM_THREADS"] = full_env["OMP_NUM_THREADS"] = "1"  # one core per rank's numpy
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=full_env, start_new_session=True)
    final = comm = None
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            print(line, end="", flush=True)
            m = re.match(r"final loss: ([0-9.eE+-]+)", line)
            if m:
                final = float(m.group(1))
            m = re.match(r"communication per step: ([0-9.]+) ms", line)
            if m:
                comm = float(m.group(1))
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(cmd, timeout)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        print(f"{title}: timed out after {timeout:g}s", file=sys.stderr)
        return None
    if code != 0 or final is None:
        print(f"{title}: exited with {code}", file=sys.stderr)
        return None
    return final, comm


#: each rank's timeline file in a run's folder
TIMELINE_FILE = "{job_name}-{task_index}.json"


def _timeline_env(folder: str | None, run: str) -> dict[str, str]:
    """The setting that makes each rank of ``run`` write its timeline under ``folder``."""
    if folder is None:
        return {}
    return {"RENDEZVOUS_TIMELINE": os.path.join(folder, run, TIMELINE_FILE)}


def _merge_timelines(folder: str, runs: dict[str, str]) -> None:
    """Each run's rank files as one trace (all ranks in one view), and how to open it."""
    from rendezvous.timeline import merge

    print(f"\ntimelines of every send and recv, in {os.path.abspath(folder)}:")
    for run, title in runs.items():
        ranks = sorted(Path(folder, run).glob("*.json"))
        if not ranks:
            print(f"  {title}: no rank wrote a timeline", file=sys.stderr)
            continue
        merged = Path(folder, f"{run}.json")
        merge(ranks, merged)
        print(f"  {title}: {merged} (one file per rank in {Path(folder, run)}/: "
              f"{', '.join(r.name for r in ranks)})")
    print("open one at https://ui.perfetto.dev (\"Open trace file\") or in chrome://tracing", flush=True)


def launcher_main(args: argparse.Namespace) -> int:
    if args.hosts:
        # One rank per host, in the order given: mpiexec places rank i on host i,
        # and rank 0 is the ps. Every host serves on the same port.
        hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
        if len(hosts) != 1 + WORKERS:
            print(f"--hosts needs {1 + WORKERS} hosts (ps first), got {len(hosts)}", file=sys.stderr)
            return 2
        ps_host, *worker_hosts = (f"[{h}]" if ":" in h else h for h in hosts)
        cluster = {"ps": [f"{ps_host}:{args.port}"], "worker": [f"{h}:{args.port}" for h in worker_hosts]}
        placement = ["-hosts", ",".join(hosts), "-ppn", "1"]
    else:
        ps_port, *worker_ports = _free_ports(1 + WORKERS)
        cluster = {"ps": [f"127.0.0.1:{ps_port}"], "worker": [f"127.0.0.1:{p}" for p in worker_ports]}
        placement = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cluster.json")
        with open(path, "w") as f:
            json.dump(cluster, f)
        # The fastest correct setting measured for this job (BENCHMARKS.md, "Whole
        # steps, in both orders"): the optimal path with requests over gRPC. Requests over MPI
        # measured slower here: the ranks use the blocking Server, whose MPI
        # thread, not its loop, polls for them.
        fastest = {"MPI_OPTIMAL_PATH": "1", "RENDEZVOUS_MPI_REQUESTS": "0", **_timeline_env(args.timeline, "mpi")}
        with_mpi = _run("run 1: protocol grpc+mpi, MPI on, in its fastest setting for this job: "
                        "optimal path (MPI_OPTIMAL_PATH=1), requests over gRPC (RENDEZVOUS_MPI_REQUESTS=0)",
                        path, args.steps, fastest, args.timeout, placement)
        without = _run("run 2: protocol grpc+mpi with MPI_DISABLED=1 (gRPC only)", path, args.steps,
                       {"MPI_DISABLED": "1", **_timeline_env(args.timeline, "grpc")}, args.timeout, placement)
    if args.timeline:
        _merge_timelines(args.timeline, {"mpi": "run 1 (MPI)", "grpc": "run 2 (gRPC only)"})
    print()
    if with_mpi is None or without is None:
        print("a run failed", file=sys.stderr)
        return 1
    (loss_mpi, comm_mpi), (loss_grpc, comm_grpc) = with_mpi, without
    same = abs(loss_mpi - loss_grpc) <= 1e-6 * max(1.0, abs(loss_mpi))
    print(f"final loss with MPI: {loss_mpi:.6f}; with MPI_DISABLED=1: {loss_grpc:.6f} -> "
          f"{'the same' if same else 'DIFFERENT'}")
    if comm_mpi is not None and comm_grpc is not None:
        faster = ""
        if comm_mpi > 0 and comm_grpc >= comm_mpi:
            faster = f" ({comm_grpc / comm_mpi:.1f}x less with MPI)"
        elif comm_grpc > 0:
            faster = f" ({comm_mpi / comm_grpc:.1f}x more with MPI)"
        print(f"communication per step: {comm_mpi:.2f} ms with MPI (optimal path), "
              f"{comm_grpc:.2f} ms with gRPC only{faster}")
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", help="cluster JSON file: run as one rank under mpiexec")
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--protocol", default="grpc+mpi", choices=["grpc", "grpc+mpi"])
    p.add_argument("--timeout", type=float, default=300, help="seconds each launched run may take")
    p.add_argument("--hosts", help="launch one rank per host: ps,worker0,worker1 (passed to mpiexec -hosts)")
    p.add_argument("--port", type=int, default=50051, help="the port each rank serves on with --hosts")
    p.add_argument("--timeline", metavar="DIR",
                   help="write each rank's timeline of sends and recvs under DIR (RENDEZVOUS_TIMELINE), "
                        "and each run's ranks merged: DIR/mpi.json, DIR/grpc.json (open at ui.perfetto.dev)")
    args = p.parse_args(argv)
    return rank_main(args) if args.cluster else launcher_main(args)


if __name__ == "__main__":
    sys.exit(main())
