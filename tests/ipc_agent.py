"""A rank of job "worker" in a process of its own, on the fake GPU with IPC
(:class:`rendezvous.testing.fakegpu_ipc.FakeIpcBackend`), driven by JSON lines
on stdin; one JSON answer per line on stdout (tests/test_ipc.py).

    python tests/ipc_agent.py NODE TASK_INDEX    (NODE "cupy": the real GPU, cupy's backend)

It prints ``{"target": ...}`` once serving. Commands (``op``):

* ``send``: ``key``, ``n`` float32 values ``seed + arange(n)`` on GPU 0 (with
  ``count``: that many, ``{i}`` in the key replaced by i, seeds ``seed + i``);
  ``gated``: written by a kernel held until ``open``; ``keep``: this process
  keeps its own reference (else only the server holds the tensor);
* ``open``: let the held kernel run;
* ``recv``: ``key``, ``timeout``, onto GPU 0 (answered when it is done:
  ``ok``, ``values`` or ``code``); ``hold``: the copy stream is held first
  (until ``open``), so the copy cannot run;
* ``cluster``: ``targets``, the job's addresses;
* ``state``: this rank's IPC exports, device bytes, counters;
* ``let_go``: the retry cache lets its answers go (as its window's end would);
* ``drop``: forget the tensors kept by ``send``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import threading
from typing import Any

import numpy as np

import rendezvous
from rendezvous.codec.tensors import TensorMeta
from rendezvous.devices import Devices
from rendezvous.errors import RendezvousError
from rendezvous.testing.fakegpu_ipc import FakeIpcBackend


def main() -> None:
    node, index = sys.argv[1], int(sys.argv[2])
    if node == "cupy":  # a real GPU (tests/test_gpu_cupy.py): no gates, memory from cupy's pool
        import cupy
        from rendezvous.devices.cupy_backend import CupyBackend
        backend: Any = CupyBackend()
        fake: Any = None
    else:
        backend = fake = FakeIpcBackend(node)
    server = rendezvous.Server({"worker": ["127.0.0.1:0", "127.0.0.1:0"]}, "worker", index,
                               devices=Devices([backend]))
    server.start()
    out = threading.Lock()
    kept: list = []
    gate = threading.Event()

    def answer(msg: dict) -> None:
        with out:
            sys.stdout.write(json.dumps(msg) + "\n")
            sys.stdout.flush()

    def recv(cmd: dict) -> None:
        try:
            got = server.recv(cmd["key"], timeout=cmd.get("timeout", 30), device="gpu:0")
            answer({"id": cmd["id"], "ok": True, "values": got.get().tolist()})
        except RendezvousError as exc:
            answer({"id": cmd["id"], "ok": False, "code": exc.code.name, "message": str(exc)})

    answer({"id": 0, "target": server.target, "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "send":  # with ``count``: keys KEY-0 .. KEY-(count-1), seeds seed + i
            count = cmd.get("count")
            for i in range(count or 1):
                values = cmd.get("seed", 0) + i + np.arange(cmd["n"], dtype=np.float32)
                if fake is None:
                    arr = cupy.asarray(values)
                else:
                    arr = fake.empty(TensorMeta(np.dtype(np.float32), (cmd["n"],)), 0)
                    fake.launch(lambda a, v=values: a.__setitem__(..., v), arr,
                                gate=gate if cmd.get("gated") else None)
                server.send(cmd["key"].replace("{i}", str(i)), arr)
                if cmd.get("keep"):
                    kept.append(arr)
                del arr
            gc.collect()
            answer({"id": cmd["id"], "ok": True})
        elif op == "open":
            gate.set()
            answer({"id": cmd["id"], "ok": True})
        elif op == "recv":
            if cmd.get("hold"):
                fake.copy_stream(0, "peer").hold(gate)
            threading.Thread(target=recv, args=(cmd,), daemon=True).start()
        elif op == "cluster":
            server.update_cluster({"worker": cmd["targets"]})
            answer({"id": cmd["id"], "ok": True})
        elif op == "state":
            gc.collect()
            ipc = [p for p in server.aio.planes.planes if p.path == "ipc"]
            stats = server.stats()
            if fake is None:
                device = {"device_bytes": cupy.get_default_memory_pool().used_bytes(), "violations": []}
            else:
                device = {"device_bytes": fake.device_bytes(0), "exported": fake.exported, "opened": fake.opened,
                          "violations": fake.violations, "peer_queued": fake.copy_stream(0, "peer").pending}
            answer({"id": cmd["id"], "ok": True, "exports": len(ipc[0].exports) if ipc else None,
                    "gpu": stats["gpu"], "ipc": stats["ipc"], **device})
        elif op == "let_go":  # the retry cache lets every answer go, as the end of its window would
            async def let_go() -> None:
                retry = server.aio._retry
                for request_id in list(retry._entries):
                    retry.delivered(request_id)
            asyncio.run_coroutine_threadsafe(let_go(), server._loop).result(10)
            answer({"id": cmd["id"], "ok": True})
        elif op == "drop":
            kept.clear()
            gc.collect()
            answer({"id": cmd["id"], "ok": True})
        elif op == "exit":
            break
    server.stop(0)


if __name__ == "__main__":
    main()
