"""Node-local GPU->GPU by CUDA IPC against a device-to-device copy in one
process: ``python -m rendezvous.bench.gpu_ipc``.

A producer rank in a process of its own sends ``--count`` tensors of each
size from GPU 0 (produced first); this process's rank receives them onto
GPU 0 by the IPC plane, one recv at a time and all at once (``recv_many``),
each timed from the call to the tensors in hand. The reference is the same
bytes copied device to device in this process (one copy, waited for). It
prints GB/s of each and the ratio; the target is IPC (all at once) >= 0.8 x
the copy from 16 MiB up. ``--fake``: the fake GPU (host memory shared
between the processes): it checks the harness where there is no GPU, and
its figures say nothing about a GPU.

    python -m rendezvous.bench.gpu_ipc [--sizes 16M,64M,256M] [--count 8] [--fake] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

__all__ = ["main"]

TARGET = 0.8


def _key(src: int, dst: int, name: str) -> str:
    return (f"/job:worker/replica:0/task:{src}/device:GPU:0;0000000000000000;"
            f"/job:worker/replica:0/task:{dst}/device:GPU:0;{name};0:0")


def _rank(index: int, fake: bool) -> tuple[Any, Any]:
    """A started rank of a two-task job and its GPU backend."""
    import rendezvous
    from rendezvous.devices import Devices
    if fake:
        from rendezvous.testing.fakegpu_ipc import FakeIpcBackend
        backend: Any = FakeIpcBackend("gpu-ipc-bench")
    else:
        from rendezvous.devices.cupy_backend import CupyBackend
        backend = CupyBackend()
    server = rendezvous.Server({"worker": ["127.0.0.1:0", "127.0.0.1:0"]}, "worker", index,
                               devices=Devices([backend]))
    server.start()
    return server, backend


def _array(backend: Any, nbytes: int) -> Any:
    from rendezvous.codec.tensors import TensorMeta
    return backend.empty(TensorMeta(np.dtype(np.uint8), (nbytes,)), 0)


def _serve(fake: bool) -> None:
    """The producer: ``SIZE COUNT`` on stdin sends COUNT tensors of SIZE bytes
    (keys ``s{SIZE}-{i}``), then answers ``sent``; ``exit`` stops."""
    server, backend = _rank(1, fake)
    print(server.target, flush=True)
    for line in sys.stdin:
        if line.strip() == "exit":
            break
        size, count = (int(x) for x in line.split())
        for i in range(count):
            server.send(_key(1, 0, f"s{size}-{i}"), _array(backend, size))
        print("sent", flush=True)
    server.stop(0)


def _copy_seconds(backend: Any, nbytes: int, fake: bool, rounds: int) -> float:
    """The fastest of ``rounds`` device-to-device copies of ``nbytes`` in this process."""
    src, dst = _array(backend, nbytes), _array(backend, nbytes)
    times = []
    for _ in range(rounds):
        if fake:
            s, d = backend.raw(src), backend.raw(dst)
            t0 = time.perf_counter()
            d[...] = s
        else:
            import cupy
            stream = cupy.cuda.get_current_stream()
            t0 = time.perf_counter()
            cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes,
                                          cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
            stream.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def _produce(producer: subprocess.Popen, size: int, count: int) -> list[str]:
    """The producer sends ``count`` tensors of ``size`` bytes: their keys."""
    assert producer.stdin is not None and producer.stdout is not None
    producer.stdin.write(f"{size} {count}\n")
    producer.stdin.flush()
    if producer.stdout.readline().strip() != "sent":
        raise RuntimeError("the producer process did not send")
    return [_key(1, 0, f"s{size}-{i}") for i in range(count)]


def _measure(server: Any, backend: Any, producer: subprocess.Popen, size: int, count: int,
             fake: bool) -> dict[str, Any]:
    """One size: recvs one at a time (median), then all at once, and the copy."""
    one = []
    for k in _produce(producer, size, count):
        t0 = time.perf_counter()
        server.recv(k, timeout=120, device="gpu:0")
        one.append(time.perf_counter() - t0)
    keys = _produce(producer, size, count)
    t0 = time.perf_counter()
    server.recv_many(keys, timeout=120, device="gpu:0")
    many = time.perf_counter() - t0
    copy = _copy_seconds(backend, size, fake, max(3, count))
    row: dict[str, Any] = {"size": size, "ipc_one_gbps": size / statistics.median(one) / 1e9,
                           "ipc_many_gbps": size * count / many / 1e9, "d2d_gbps": size / copy / 1e9}
    row["ratio"] = row["ipc_many_gbps"] / row["d2d_gbps"]
    row["ok"] = size < 16 << 20 or row["ratio"] >= TARGET
    return row


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_ipc", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16M,64M,256M")
    p.add_argument("--count", type=int, default=8, help="tensors per size (each way of receiving)")
    p.add_argument("--fake", action="store_true", help="the fake GPU: checks the harness, measures nothing real")
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        _serve(args.fake)
        return 0
    producer = subprocess.Popen([sys.executable, "-m", "rendezvous.bench.gpu_ipc", "--serve",
                                 *(["--fake"] if args.fake else [])],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert producer.stdin is not None and producer.stdout is not None
    rows: list[dict[str, Any]] = []
    try:
        target = producer.stdout.readline().strip()
        server, backend = _rank(0, args.fake)
        server.update_cluster({"worker": [server.target, target]})
        server.recv_many(_produce(producer, 1 << 20, args.count), timeout=120, device="gpu:0")  # warm
        for size in [parse_size(s) for s in args.sizes.split(",")]:
            rows.append(_measure(server, backend, producer, size, args.count, args.fake))
            row = rows[-1]
            print(f"{_size(size):>8}: IPC one at a time {row['ipc_one_gbps']:.2f} GB/s, all at once "
                  f"{row['ipc_many_gbps']:.2f} GB/s; device-to-device copy {row['d2d_gbps']:.2f} GB/s; "
                  f"ratio {row['ratio']:.2f} (target >= {TARGET} from 16 MiB) {'ok' if row['ok'] else 'MISSED'}",
                  flush=True)
        stats = server.stats()
        print(f"ipc transfers {stats['ipc']['transfers']}, handles opened {stats['gpu']['ipc_opens']}, "
              f"by other paths {stats['grpc']['transfers'] + stats['mpi']['transfers']}", flush=True)
        all_ipc = stats["ipc"]["transfers"] == (1 + 2 * len(rows)) * args.count
        server.stop(0)
    finally:
        if producer.poll() is None:
            producer.stdin.write("exit\n")
            producer.stdin.flush()
            producer.wait(60)
    ok = all_ipc and all(row["ok"] for row in rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"fake": args.fake, "rows": rows, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
