"""Local client processes for the daemon tests (run by test_daemon*.py).

    python tests/daemon_clients.py exchange NODE CLIENT ADDRESS
    python tests/daemon_clients.py waiter ADDRESS KEY
    python tests/daemon_clients.py hold ADDRESS
    python tests/daemon_clients.py hold_lent ADDRESS
    python tests/daemon_clients.py ask_many_and_hang SESSION_SOCKET KEYS_FILE

Each prints `RESULT <json>` lines on stdout and exits 0 when its checks pass.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from rendezvous.client.core import LocalOp
from rendezvous.local import segments as shm
from rendezvous.client import Client
from rendezvous.errors import RendezvousError

NODES = 2
CLIENTS = 2
#: name -> size in bytes: inline on both hops; inline locally and MPI between
#: nodes; shared memory locally and MPI between nodes.
SIZES = {"small": 100, "medium": 32 << 10, "large": 1 << 20}


def result(**fields) -> None:
    sys.stdout.write("RESULT " + json.dumps(fields) + "\n")
    sys.stdout.flush()


def device(node: int, client: int) -> str:
    return f"/job:node/replica:0/task:{node}/device:CPU:{client}"


def key(src: tuple[int, int], dst: tuple[int, int], name: str) -> str:
    return f"{device(*src)};0000000000000000;{device(*dst)};{name};0:0"


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return ((np.arange(nbytes, dtype=np.uint64) * 2654435761 + seed * 40503) % 251).astype(np.uint8)


def seed(src: tuple[int, int], dst: tuple[int, int], size: int) -> int:
    return src[0] * 1000 + src[1] * 100 + dst[0] * 10 + dst[1] + size


def exchange(node: str, client: str, address: str) -> None:
    """Send every size to both clients of the other node and a large tensor to the
    sibling on this node; receive the same from them; check every byte."""
    me = (int(node), int(client))
    other_node = 1 - me[0]
    sibling = (me[0], 1 - me[1])
    step = 7
    with Client(address) as c:
        assert c.task == f"/job:node/replica:0/task:{me[0]}", c.task
        for dst_client in range(CLIENTS):
            dst = (other_node, dst_client)
            for name, size in SIZES.items():
                c.send(key(me, dst, name), pattern(size, seed(me, dst, size)), step_id=step)
            c.send(key(me, dst, "strings"), np.array([b"x" * 3000, b"node%d" % me[0]], dtype=object), step_id=step)
        c.send(key(me, sibling, "sibling"), pattern(SIZES["large"], seed(me, sibling, 1)), step_id=step)
        for src_client in range(CLIENTS):
            src = (other_node, src_client)
            for name, size in SIZES.items():
                got = c.recv(key(src, me, name), step_id=step, timeout=60)
                assert got.dtype == np.uint8 and got.shape == (size,), (name, got.dtype, got.shape)
                assert np.array_equal(got, pattern(size, seed(src, me, size))), f"{name} from {src}: bytes differ"
            strings = c.recv(key(src, me, "strings"), step_id=step, timeout=60)
            assert strings.tolist() == [b"x" * 3000, b"node%d" % other_node], strings
        got = c.recv(key(sibling, me, "sibling"), step_id=step, timeout=60)
        assert np.array_equal(got, pattern(SIZES["large"], seed(sibling, me, 1)))
        del got
        result(node=me[0], client=me[1], stats=c.stats(), shm_live=shm.live_mappings())


def waiter(address: str, wanted: str) -> None:
    """Wait for a tensor that never comes; report how the wait ended."""
    with Client(address) as c:
        sys.stdout.write("WAITING\n")
        sys.stdout.flush()
        try:
            c.recv(wanted, step_id=1, timeout=120)
            result(error=None)
        except RendezvousError as exc:
            result(error=exc.code.name, message=exc.message)


def hold(address: str, key: str) -> None:
    """Receive ``key`` (a pool segment held) and get a segment lent for a send,
    then wait to be killed holding both."""
    import struct

    from rendezvous.local.frames import Kind

    with Client(address) as c:
        value = c.recv(key, step_id=1, timeout=30)
        c._link.call(LocalOp(Kind.LEND, struct.pack("<Q", 1 << 16)))
        sys.stdout.write(f"HOLDING {value.nbytes}\n")
        sys.stdout.flush()
        sys.stdin.read()  # until killed (or stdin closes)


def hold_lent(address: str) -> None:
    """Lend three arrays (Client.empty) and wait to be killed holding them."""
    with Client(address) as c:
        held = [c.empty(1 << 16, np.uint8) for _ in range(3)]
        assert c.stats()["empty_lent"] == 3, c.stats()
        sys.stdout.write(f"LENT {len(held)}\n")
        sys.stdout.flush()
        sys.stdin.read()  # until killed (or stdin closes)


def ask_many_and_hang(path: str, keys_file: str) -> None:
    """A raw session that asks for the keys in ``keys_file`` (one a line) in one
    RECV_MANY and then reads nothing, until it is killed: the daemon's answer
    fills the socket and waits there."""
    import os
    import socket

    from rendezvous.local import messages
    from rendezvous.local.frames import Kind, frame
    from rendezvous.v1 import local_pb2 as lpb

    with open(keys_file) as f:
        keys = f.read().split()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    hello = lpb.AttachRequest(client_id="0123456789ab", pid=os.getpid()).SerializeToString()
    sock.sendall(frame(Kind.HELLO, 1, hello) + frame(Kind.RECV_MANY, 2, messages.recv_many_request(keys, 1, 60.0)))
    sys.stdout.write("ASKED\n")
    sys.stdout.flush()
    sys.stdin.read()  # until killed


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    globals()[command](*args)
