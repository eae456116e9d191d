"""GPU scenarios under `mpiexec -n 2 python tests/gpu_scenarios.py NAME` (test_gpu.py).

Each rank registers a FakeBackend (host memory and threads standing in for a
GPU and its streams), so the staging pipelines, the stream synchronization
before MPI and the device-aware receive run over real MPI on any machine.
A failing rank aborts the job (mpi_scenarios' excepthook).
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np

import rendezvous

from mpi_scenarios import finish, pattern, result, start, wait_for, worker

from rendezvous.devices import Devices
from rendezvous.testing.fakegpu import FakeBackend, FakeCudaError


def gkey(src: int, dst: int, name: str, dst_kind: str = "GPU") -> str:
    return (f"{worker(src)}/device:GPU:0;0000000000000000;"
            f"{worker(dst)}/device:{dst_kind}:0;{name};0:0")


SIZES = [1024, (3 << 20) + 5, (1 << 20)]  # one chunk, several chunks (1 MiB staging), exactly one


class _Cupy:
    """The real thing, for GPU machines: same calls as FakeBackend's helpers."""

    def __init__(self) -> None:
        import cupy

        self.cp = cupy
        self.pinned_allocs = 0
        self.copies = {}

    def array(self, data):
        return self.cp.asarray(data)


def _host(arr) -> np.ndarray:
    return arr.get()


def transfers(backend: str = "fake") -> None:
    """GPU->GPU, GPU->CPU and CPU->GPU with content checked; the producer's
    stream is synchronized before MPI reads the buffer; pinned buffers reused."""
    if backend == "fake":
        fake = FakeBackend()
        gpus = Devices([fake])
    else:
        fake = _Cupy()
        gpus = Devices()
    gpu_type = type(fake.array(np.zeros(1))).__name__
    server = start(2, devices=gpus, gpu_staging_chunk_bytes=1 << 20, gpu_staging_depth=3)
    me = server.task.task
    other = 1 - me
    for i, n in enumerate(SIZES):
        server.send(gkey(me, other, f"g2g{i}"), fake.array(pattern(n, me)), step_id=1)
        server.send(gkey(me, other, f"g2c{i}", "CPU"), fake.array(pattern(n, 10 + me)), step_id=1)
        # a host tensor bound for the peer's GPU
        server.send(gkey(me, other, f"c2g{i}").replace("device:GPU:0;0000", "device:CPU:0;0000", 1),
                    pattern(n, 20 + me), step_id=1)
    for rnd in range(3):  # pinned buffers are reused across transfers
        for i, n in enumerate(SIZES):
            if rnd:
                server.send(gkey(me, other, f"again{rnd}_{i}"), fake.array(pattern(n, rnd)), step_id=2)
        for i, n in enumerate(SIZES):
            if rnd == 0:
                got = server.recv(gkey(other, me, f"g2g{i}"), step_id=1, timeout=60)
                assert type(got).__name__ == gpu_type, type(got)
                assert np.array_equal(_host(got), pattern(n, other)), f"g2g {n}"
                got = server.recv(gkey(other, me, f"g2c{i}", "CPU"), step_id=1, timeout=60)
                assert isinstance(got, np.ndarray) and np.array_equal(got, pattern(n, 10 + other)), f"g2c {n}"
                got = server.recv(gkey(other, me, f"c2g{i}").replace("device:GPU:0;0000", "device:CPU:0;0000", 1),
                                  step_id=1, timeout=60)
                assert type(got).__name__ == gpu_type, type(got)
                assert np.array_equal(_host(got), pattern(n, 20 + other)), f"c2g {n}"
            else:
                got = server.recv(gkey(other, me, f"again{rnd}_{i}"), step_id=2, timeout=60)
                assert np.array_equal(_host(got), pattern(n, rnd))

    # Stream synchronization: the producer's kernel writing the tensor is still
    # running (held by a gate) when the descriptor goes out; MPI must not read
    # the buffer before the kernel is done.
    n = 2 << 20
    if backend != "fake":  # a real kernel cannot be held at a gate; the rest is the same
        server.send(gkey(me, other, "late"), fake.array(pattern(n, 77)), step_id=3)
        assert np.array_equal(_host(server.recv(gkey(other, me, "late"), step_id=3, timeout=60)), pattern(n, 77))
        finish(server)
        stats = server.stats()
        server.stop(5)
        result(rank=me, stats=stats, pinned_allocs=0, copies={"d2h": 0, "h2d": 0})
        return
    late = fake.array(np.zeros(n, np.uint8))
    gate = threading.Event()
    fake.stream(0).enqueue(lambda: (gate.wait(60), late._data.__setitem__(slice(None), pattern(n, 77))))
    before = server.stats()["mpi"]["served"]
    server.send(gkey(me, other, "late"), late, step_id=3)

    def release_after_descriptor() -> None:
        wait_for(lambda: server.stats()["mpi"]["served"] != before, "the descriptor to be served")
        gate.set()

    releaser = threading.Thread(target=release_after_descriptor, daemon=True)
    releaser.start()
    got = server.recv(gkey(other, me, "late"), step_id=3, timeout=60)
    assert np.array_equal(_host(got), pattern(n, 77)), "MPI read the device buffer before its stream was done"
    releaser.join(60)

    # Device memory runs out at the consumer: the bytes still arrive (so the
    # tag is freed), the recv fails, and the next recv of the key gets them.
    server.send(gkey(me, other, "oom"), fake.array(pattern(3 << 20, 5)), step_id=4)
    real_empty = fake.empty

    def full(meta, device):
        raise MemoryError("out of device memory")
    fake.empty = full
    try:
        server.recv(gkey(other, me, "oom"), step_id=4, timeout=60)
        raise AssertionError("a recv onto a full device returned")
    except rendezvous.ResourceExhausted as exc:
        assert "kept on the host" in exc.message, exc.message
    finally:
        fake.empty = real_empty
    got = server.recv(gkey(other, me, "oom"), step_id=4, timeout=60)
    assert np.array_equal(_host(got), pattern(3 << 20, 5)), "the tensor of the failed recv was lost"
    finish(server)
    stats = server.stats()
    server.stop(5)
    result(rank=me, stats=stats, pinned_allocs=fake.pinned_allocs, copies=fake.copies)


#: the recv of a transfer its producer gave up must fail long before this
ABORT_DEADLINE = 40.0


class _Refusing(FakeBackend):
    """A fake GPU whose ``refuse_at``-th device-to-host copy cannot be queued."""

    def __init__(self, refuse_at: int, rank: int) -> None:
        super().__init__()
        self.refuse_at = refuse_at
        self.rank = rank
        self.d2h_calls = 0

    def d2h_async(self, src, start, host):
        self.d2h_calls += 1
        if self.d2h_calls == self.refuse_at:
            raise FakeCudaError(f"cudaErrorLaunchFailure on rank {self.rank}")
        return super().d2h_async(src, start, host)


def aborted(dst_kind: str = "GPU", how: str = "event") -> None:
    """A staged send that fails partway, at chunk 3 of 6: its copy from the GPU
    fails on the copy stream (``how`` event: the copy's event completes with
    the error) or cannot be queued (refused). The consumer's recv (onto its
    GPU, or ``dst_kind`` CPU) fails with ABORTED at once, naming the
    producer's error, not at its deadline; the next transfer between the two
    ranks arrives whole, and every pinned buffer is back in its pool."""
    from rendezvous.rank.launch import launcher_rank

    me = (launcher_rank() or (0, 1))[0]
    if how == "event":
        fake = FakeBackend()
        fake.copy_faults["d2h"] = [None, None, FakeCudaError(f"cudaErrorIllegalAddress on rank {me}")]
        want = "cudaErrorIllegalAddress on rank {}"
    else:
        fake = _Refusing(3, me)
        want = "cudaErrorLaunchFailure on rank {}"
    gpus = Devices([fake])
    server = start(2, devices=gpus, gpu_staging_chunk_bytes=1 << 20, gpu_staging_depth=2)
    assert server.task.task == me
    other = 1 - me
    n = (5 << 20) + 3
    server.send(gkey(me, other, "broken", dst_kind), fake.array(pattern(n, me)), step_id=1)
    server.send(gkey(me, other, "after", dst_kind), fake.array(pattern(n, 30 + me)), step_id=1)
    began = time.monotonic()
    try:
        server.recv(gkey(other, me, "broken", dst_kind), step_id=1, timeout=ABORT_DEADLINE)
        raise AssertionError("the recv of a transfer its producer gave up returned")
    except rendezvous.Aborted as exc:
        took = time.monotonic() - began
        assert want.format(other) in exc.message and f"rank {other} gave up" in exc.message, exc.message
    assert took < ABORT_DEADLINE / 4, f"the consumer learnt of the failure after {took:.1f}s"
    got = server.recv(gkey(other, me, "after", dst_kind), step_id=1, timeout=60)
    assert np.array_equal(_host(got) if dst_kind == "GPU" else got, pattern(n, 30 + other)), \
        "the transfer after the aborted one is wrong"
    # the tensor whose transfer gave up went back to its producer's table: the
    # next recv of its key gets it whole, once
    again = server.recv(gkey(other, me, "broken", dst_kind), step_id=1, timeout=60)
    assert np.array_equal(_host(again) if dst_kind == "GPU" else again, pattern(n, other)), \
        "the tensor whose transfer gave up was not sent again whole"
    finish(server)
    left = [p for p in server.pending() if "finished" not in p.key]
    stats = server.stats()
    server.stop(5)
    fake.settle()
    pool = gpus.pool(fake, 1 << 20, 2)  # the staging pool both transfers used (reaped)
    result(rank=me, took=took, stats=stats, violations=fake.violations, pinned_held=pool.pending,
           pinned_out=pool.allocated - pool.free - pool.released, left=[str(p) for p in left])


def late(backend: str = "cupy") -> None:
    """On a real GPU: tensors whose producer kernel is still running (~200 ms, on a
    side stream) when they are sent, over staged MPI, with contents checked;
    cupy, and torch where it imports (its tensors go through DLPack)."""
    import cupy

    from gpu_kernels import fill_late

    server = start(2, gpu_staging_chunk_bytes=1 << 20, gpu_staging_depth=3)
    me = server.task.task
    other = 1 - me
    n = 16 << 20
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        x = cupy.empty(n, dtype=cupy.uint8)
        fill_late(x, 50 + me)
        server.send(gkey(me, other, "late-cupy"), x, step_id=5)
    names = ["late-cupy"]
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        ts = torch.cuda.Stream()
        with torch.cuda.stream(ts):
            t = torch.empty(n, dtype=torch.uint8, device="cuda")
            fill_late(t, 60 + me, stream=cupy.cuda.ExternalStream(ts.cuda_stream))
            server.send(gkey(me, other, "late-torch"), t, step_id=5)
        names.append("late-torch")
    checked = 0
    for name in ("late-cupy", "late-torch"):
        if name not in names:
            continue
        got = server.recv(gkey(other, me, name), step_id=5, timeout=120)
        want = (50 if name == "late-cupy" else 60) + other
        assert bool((got == want).all()), f"{name}: MPI read the device buffer before its producer finished"
        checked += 1
    finish(server)
    stats = server.stats()
    server.stop(5)
    result(rank=me, checked=checked, torch=torch is not None, stats=stats)


def ipc() -> None:
    """Two ranks of one node on the fake GPU with IPC: a GPU tensor goes by
    CUDA IPC, a host tensor bound for a GPU still by MPI (the IPC offer
    carries MPI's inside it), both checked; every export released."""
    from rendezvous.ipc import IpcPlane
    from rendezvous.testing.fakegpu_ipc import FakeIpcBackend

    fake = FakeIpcBackend("mpi-node")
    server = start(2, devices=Devices([fake]), gpu_staging_chunk_bytes=1 << 20)
    me = server.task.task
    other = 1 - me
    n = (3 << 20) + 5
    server.send(gkey(me, other, "dev"), fake.array(pattern(n, me)), step_id=1)
    def host_key(src: int, dst: int) -> str:  # produced on the host, bound for the consumer's GPU
        return gkey(src, dst, "host").replace("device:GPU:0;0000", "device:CPU:0;0000", 1)

    server.send(host_key(me, other), pattern(n, 10 + me), step_id=1)
    got = server.recv(gkey(other, me, "dev"), step_id=1, timeout=60)
    assert type(got).__name__ == "FakeDeviceArray" and np.array_equal(got.get(), pattern(n, other))
    got = server.recv(host_key(other, me), step_id=1, timeout=60)
    assert type(got).__name__ == "FakeDeviceArray" and np.array_equal(got.get(), pattern(n, 10 + other))
    finish(server)  # the peer has copied what we exported and released it
    (plane,) = [p for p in server.aio.planes.planes if isinstance(p, IpcPlane)]
    wait_for(lambda: not plane.exports, "every export released")
    stats = server.stats()
    server.stop(5)
    result(rank=me, stats=stats, violations=fake.violations)


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    globals()[name](*args)
