"""A training process on one host of the netns harness, driven line by line.

It connects to its host's rendezvousd (``--local``) as a local client, then
reads JSON commands from stdin, one per line, runs each on a thread of its
own (so recvs can wait while sends go on), and writes one JSON answer per
command to stdout:

    {"id": 1, "op": "send", "key": K, "step": 0, "nbytes": 4096, "seed": 7}
    {"id": 2, "op": "recv", "key": K, "step": 0, "timeout": 30}
    -> {"id": 2, "ok": true, "nbytes": 4096, "digest": "...", "elapsed": 0.01}
    -> {"id": 2, "ok": false, "code": "UNAVAILABLE", "message": "...", "elapsed": 3.1}

A sent tensor is ``nbytes`` bytes drawn from ``seed``; its digest is what the
receiver reports, so the test can tell that each tensor arrived whole, once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import time

import numpy as np

from rendezvous.client import Client
from rendezvous.errors import RendezvousError


def payload(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def digest(arr: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(arr).view(np.uint8).data, digest_size=16).hexdigest()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--local", required=True)
    args = p.parse_args()
    client = Client(args.local, connect_timeout=60)
    out_lock = threading.Lock()

    def answer(msg: dict) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(msg) + "\n")
            sys.stdout.flush()

    def run(cmd: dict) -> None:
        start = time.monotonic()
        reply: dict = {"id": cmd["id"]}
        try:
            if cmd["op"] == "send":
                client.send(cmd["key"], payload(cmd["nbytes"], cmd["seed"]), step_id=cmd.get("step", 0))
                reply["ok"] = True
            elif cmd["op"] == "recv":
                arr = client.recv(cmd["key"], step_id=cmd.get("step", 0), timeout=cmd.get("timeout"))
                reply.update(ok=True, nbytes=int(arr.nbytes), digest=digest(arr))
            else:
                reply.update(ok=False, code="INVALID_ARGUMENT", message=f"unknown op {cmd['op']!r}")
        except RendezvousError as exc:
            reply.update(ok=False, code=exc.code.name, message=exc.message)
        except Exception as exc:  # reported, not fatal: the test decides
            reply.update(ok=False, code=type(exc).__name__, message=str(exc))
        reply["elapsed"] = time.monotonic() - start
        answer(reply)

    answer({"id": 0, "ok": True, "ready": True})
    for line in sys.stdin:
        if line.strip():
            threading.Thread(target=run, args=(json.loads(line),), daemon=True).start()
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
