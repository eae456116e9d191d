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

``--daemon``: the same between two local clients of a daemon, each process
its own (the producer's sends and this process's recvs go by CUDA IPC to
and from the daemon, so every tensor is copied twice, device to device);
recvs one at a time, against the copy in one process.

    python -m rendezvous.bench.gpu_ipc [--sizes 16M,64M,256M] [--count 8] [--fake] [--daemon] [--json FILE]
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


def _backend(fake: bool) -> Any:
    if fake:
        from rendezvous.testing.fakegpu_ipc import FakeIpcBackend
        return FakeIpcBackend("gpu-ipc-bench")
    from rendezvous.devices.cupy_backend import CupyBackend
    return CupyBackend()


def _local_key(name: str) -> str:
    return (f"/job:node/replica:0/task:0/device:GPU:0;0000000000000000;"
            f"/job:node/replica:0/task:0/device:GPU:0;{name};0:0")


def _serve_daemon(sockdir: str, fake: bool) -> None:
    """A daemon of a one-task job "node" on this GPU; prints its local address, stops at stdin's end."""
    import asyncio

    from rendezvous.config import Config
    from rendezvous.daemon.daemon import Daemon
    from rendezvous.devices import Devices

    async def run() -> None:
        cfg = Config.load({"cluster": json.dumps({"node": ["127.0.0.1:0"]}), "job_name": "node", "task_index": 0,
                           "local_address": f"unix:{sockdir}/d.sock", "grace": 0.5}, env={})
        daemon = Daemon(cfg, devices=Devices([_backend(fake)]))
        await daemon.start()
        print(daemon.local_target, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await daemon.stop(0.5)
    asyncio.run(run())


def _serve_client(address: str, fake: bool) -> None:
    """A producing local client: ``SIZE COUNT`` on stdin sends COUNT tensors of
    SIZE bytes (keys ``s{SIZE}-{i}``) from GPU 0, then answers ``sent``;
    ``stats`` answers how many it sent by IPC."""
    from rendezvous.client import Client
    from rendezvous.devices import Devices

    backend = _backend(fake)
    with Client(address, devices=Devices([backend])) as client:
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() == "stats":
                print(client.stats().get("send_ipc", 0), flush=True)
                continue
            size, count = (int(x) for x in line.split())
            for i in range(count):
                client.send(_local_key(f"s{size}-{i}"), _array(backend, size))
            print("sent", flush=True)


def _rank(index: int, fake: bool) -> tuple[Any, Any]:
    """A started rank of a two-task job and its GPU backend."""
    import rendezvous
    from rendezvous.devices import Devices
    backend = _backend(fake)
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


def _produce(producer: subprocess.Popen, size: int, count: int, local: bool = False) -> list[str]:
    """The producer sends ``count`` tensors of ``size`` bytes: their keys."""
    assert producer.stdin is not None and producer.stdout is not None
    producer.stdin.write(f"{size} {count}\n")
    producer.stdin.flush()
    if producer.stdout.readline().strip() != "sent":
        raise RuntimeError("the producer process did not send")
    return [_local_key(f"s{size}-{i}") if local else _key(1, 0, f"s{size}-{i}") for i in range(count)]


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


def _measure_local(client: Any, backend: Any, producer: subprocess.Popen, size: int, count: int,
                   fake: bool) -> dict[str, Any]:
    """One size through a daemon: recvs one at a time (median), and the copy."""
    one = []
    for k in _produce(producer, size, count, local=True):
        t0 = time.perf_counter()
        client.recv(k, timeout=120, device="gpu:0")
        one.append(time.perf_counter() - t0)
    copy = _copy_seconds(backend, size, fake, max(3, count))
    row: dict[str, Any] = {"size": size, "ipc_one_gbps": size / statistics.median(one) / 1e9,
                           "d2d_gbps": size / copy / 1e9}
    row["ratio"] = row["ipc_one_gbps"] / row["d2d_gbps"]
    row["ok"] = size < 16 << 20 or row["ratio"] >= TARGET
    return row


def _local(args: argparse.Namespace, sizes: list[int]) -> tuple[list[dict[str, Any]], bool]:
    """``--daemon``: a daemon and a producing client in processes of their own,
    this process the consuming client. (rows, every tensor came by IPC)."""
    import tempfile

    from rendezvous.client import Client
    from rendezvous.devices import Devices

    fake = ["--fake"] if args.fake else []
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rdv", dir="/tmp") as d:
        daemon = subprocess.Popen([sys.executable, "-m", "rendezvous.bench.gpu_ipc", "--serve-daemon", d, *fake],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        producer = None
        try:
            assert daemon.stdout is not None
            address = daemon.stdout.readline().strip()
            producer = subprocess.Popen([sys.executable, "-m", "rendezvous.bench.gpu_ipc", "--serve-client", address,
                                         *fake], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert producer.stdout is not None and producer.stdin is not None
            if producer.stdout.readline().strip() != "ready":
                raise RuntimeError("the producing client did not start")
            backend = _backend(args.fake)
            with Client(address, devices=Devices([backend])) as client:
                for k in _produce(producer, 1 << 20, args.count, local=True):  # warm
                    client.recv(k, timeout=120, device="gpu:0")
                for size in sizes:
                    rows.append(_measure_local(client, backend, producer, size, args.count, args.fake))
                    row = rows[-1]
                    print(f"{_size(size):>8}: IPC through a daemon, one at a time {row['ipc_one_gbps']:.2f} GB/s; "
                          f"device-to-device copy {row['d2d_gbps']:.2f} GB/s; ratio {row['ratio']:.2f} "
                          f"(target >= {TARGET} from 16 MiB) {'ok' if row['ok'] else 'MISSED'}", flush=True)
                stats = client.stats()
            producer.stdin.write("stats\n")
            producer.stdin.flush()
            sent = int(producer.stdout.readline())
            print(f"sends by IPC {sent}; recvs by IPC {stats.get('recv_ipc', 0)}, through the host "
                  f"{stats.get('recv_to_gpu', 0)}")
            all_ipc = stats.get("recv_ipc", 0) == sent == (1 + len(rows)) * args.count
        finally:
            for p in (producer, daemon):
                if p is not None and p.poll() is None:
                    assert p.stdin is not None
                    p.stdin.close()
                    p.wait(60)
    return rows, all_ipc


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
    p.add_argument("--daemon", action="store_true", help="between two local clients of a daemon")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--serve-daemon", default=None, help=argparse.SUPPRESS)
    p.add_argument("--serve-client", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        _serve(args.fake)
        return 0
    if args.serve_daemon:
        _serve_daemon(args.serve_daemon, args.fake)
        return 0
    if args.serve_client:
        _serve_client(args.serve_client, args.fake)
        return 0
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.daemon:
        return _done(args, *_local(args, sizes))
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
        for size in sizes:
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
    return _done(args, rows, all_ipc)


def _done(args: argparse.Namespace, rows: list[dict[str, Any]], all_ipc: bool) -> int:
    ok = all_ipc and all(row["ok"] for row in rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"fake": args.fake, "daemon": args.daemon, "rows": rows, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
