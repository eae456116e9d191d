"""A local client in a process of its own, on the fake GPU with IPC
(:class:`rendezvous.testing.fakegpu_ipc.FakeIpcBackend`), driven by JSON lines
on stdin; one JSON answer per line on stdout (tests/test_client_ipc.py).

    python tests/client_ipc_agent.py NODE ADDRESS [aio]

(``aio``: the asyncio client, on a loop thread of its own; else the blocking one.)

It prints ``{"pid": ...}`` once connected. Commands (``op``):

* ``send``: ``key``, ``n`` float32 values ``seed + arange(n)`` on GPU 0
  (``gated``: written by a kernel held until ``open``, the send on a thread);
* ``recv``: ``key``, ``timeout``, ``device`` (default: the key's), answered
  when it is done (``values``, ``gpu``: whether it came as a device array;
  or ``code``); runs on a thread, so other commands go on meanwhile;
* ``hold``: this process's IPC copies wait (its peer copy stream is held)
  until ``open``;
* ``fail_open``: the next handle this process opens fails;
* ``state``: the client's counts, device bytes, handles opened, violations.
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

from rendezvous.client import Client
from rendezvous.client.aio import Client as AioClient
from rendezvous.codec.tensors import TensorMeta
from rendezvous.devices import Devices
from rendezvous.errors import RendezvousError
from rendezvous.testing.fakegpu import FakeCudaError, FakeDeviceArray
from rendezvous.testing.fakegpu_ipc import FakeIpcBackend


class AioClientThread:
    """The asyncio client's calls, made blocking: they run on a loop thread."""

    def __init__(self, address: str, devices: Devices) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.client = AioClient(address, devices=devices)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def send(self, *args: Any, **kw: Any) -> None:
        self._run(self.client.send(*args, **kw))

    def recv(self, *args: Any, **kw: Any) -> Any:
        return self._run(self.client.recv(*args, **kw))

    def stats(self) -> dict:
        return self.client.stats()

    def close(self) -> None:
        self._run(self.client.close())


def main() -> None:
    node, address = sys.argv[1], sys.argv[2]
    fake = FakeIpcBackend(node)
    client: Any = (AioClientThread if sys.argv[3:] == ["aio"] else Client)(address, devices=Devices([fake]))
    out = threading.Lock()
    gate = threading.Event()

    def answer(msg: dict) -> None:
        with out:
            sys.stdout.write(json.dumps(msg) + "\n")
            sys.stdout.flush()

    def recv(cmd: dict) -> None:
        try:
            got = client.recv(cmd["key"], timeout=cmd.get("timeout", 30), device=cmd.get("device"))
            on_gpu = isinstance(got, FakeDeviceArray)
            values = fake.raw(got) if on_gpu else got
            answer({"id": cmd["id"], "ok": True, "gpu": on_gpu, "values": np.asarray(values).tolist()})
        except RendezvousError as exc:
            answer({"id": cmd["id"], "ok": False, "code": exc.code.name, "message": str(exc)})

    def send(cmd: dict, arr: FakeDeviceArray) -> None:
        try:
            client.send(cmd["key"], arr, step_id=cmd.get("step", 0))
            answer({"id": cmd["id"], "ok": True})
        except RendezvousError as exc:
            answer({"id": cmd["id"], "ok": False, "code": exc.code.name, "message": str(exc)})

    answer({"id": 0, "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "send":
            values = cmd.get("seed", 0) + np.arange(cmd["n"], dtype=np.float32)
            arr = None
            if cmd.get("gated"):  # written by a kernel held until ``open``; the send waits on a thread
                arr = fake.empty(TensorMeta(np.dtype(np.float32), (cmd["n"],)), 0)
                fake.launch(lambda a, v=values: a.__setitem__(..., v), arr, gate=gate)
                threading.Thread(target=send, args=(cmd, arr), daemon=True).start()
            else:
                send(cmd, fake.array(values, 0))
            arr = None  # the thread's send holds it, as long as it runs: no longer
        elif op == "recv":
            threading.Thread(target=recv, args=(cmd,), daemon=True).start()
        elif op == "hold":
            fake.copy_stream(0, "peer").hold(gate)
            answer({"id": cmd["id"], "ok": True})
        elif op == "open":
            gate.set()
            answer({"id": cmd["id"], "ok": True})
        elif op == "fail_open":
            fake.open_faults.append(FakeCudaError("cudaErrorMapBufferObjectFailed: cannot open"))
            answer({"id": cmd["id"], "ok": True})
        elif op == "state":
            gc.collect()
            answer({"id": cmd["id"], "ok": True, "stats": client.stats(), "device_bytes": fake.device_bytes(0),
                    "opened": fake.opened, "exported": fake.exported, "violations": fake.violations,
                    "peer_queued": fake.copy_stream(0, "peer").pending})
        elif op == "exit":
            break
    client.close()


if __name__ == "__main__":
    main()
