"""What one process holds, read from Linux's ``/proc``: its TCP connections, threads,
descriptors and memory (``bench-scale``'s ranks measure themselves with it).

Connections are the TCP sockets among the process's descriptors, matched by
inode against ``/proc/net/tcp`` and ``tcp6``, and split into connections to
peers' servers (outgoing), connections peers opened to this process's server
(incoming) and any other; threads are counted by name (``/proc/self/task``),
descriptors by kind; memory is the RSS, its high-water mark and its parts
(:mod:`rendezvous.bench.rss`).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from typing import Any

__all__ = ["snapshot"]

def _address(hex_addr: str) -> tuple[str, int]:
    """``0100007F:1F90`` (as /proc/net/tcp writes it) -> ("127.0.0.1", 8080)."""
    host, _, port = hex_addr.partition(":")
    raw = bytes.fromhex(host)
    # each 32-bit word is printed in host byte order (little-endian here)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    if len(words) == 4:
        ip = socket.inet_ntop(socket.AF_INET, words)
    else:
        ip = socket.inet_ntop(socket.AF_INET6, words)
        if ip.startswith("::ffff:") and "." in ip:
            ip = ip[len("::ffff:"):]
    return ip, int(port, 16)


def _tcp_table() -> dict[int, tuple[tuple[str, int], tuple[str, int], str]]:
    """inode -> (local, remote, state) for every TCP socket of this network namespace."""
    table = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if len(parts) < 10:
                        continue
                    inode = int(parts[9])
                    if inode:
                        table[inode] = (_address(parts[1]), _address(parts[2]), parts[3])
        except OSError:
            pass
    return table


def _unix_inodes() -> set[int]:
    try:
        with open("/proc/net/unix") as f:
            next(f)
            return {int(p[6]) for p in (line.split() for line in f) if len(p) > 6}
    except OSError:
        return set()


def _fd_kind(target: str, tcp: dict, unix: set[int]) -> str:
    if target.startswith("socket:["):
        inode = int(target[8:-1])
        return "socket tcp" if inode in tcp else "socket unix" if inode in unix else "socket other"
    if target.startswith("pipe:"):
        return "pipe"
    if target.startswith("anon_inode:"):
        return target[len("anon_inode:"):].strip("[]") or "anon_inode"
    if target.startswith("/dev/shm/"):
        return "/dev/shm file"
    if target.startswith("/dev/"):
        return target
    if target.startswith("/memfd:"):
        return "memfd"
    return "file"


def _thread_names() -> dict[str, int]:
    """Threads by name: Python threads by their ``threading`` name (``py:...``),
    the others (gRPC's, OpenBLAS's, MPI's) by their kernel name."""
    python = {t.native_id: t.name for t in threading.enumerate()}
    names: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        if int(tid) in python:
            name = "py:" + python[int(tid)]
        else:
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
            except OSError:
                continue  # the thread ended meanwhile
        names[name] = names.get(name, 0) + 1
    return dict(sorted(names.items()))


def snapshot(own_port: int | None = None, peers: set[tuple[str, int]] | frozenset = frozenset(),
             exclude_fds: set[int] | frozenset = frozenset()) -> dict[str, Any]:
    """This process now (Linux ``/proc``): TCP connections (established, split into
    to peers' servers, from peers into ``own_port``, and other), listening sockets,
    threads, open fds (less ``exclude_fds``), RSS and its high-water mark."""
    from .rss import current, parts, peak

    tcp = _tcp_table()
    unix = _unix_inodes()
    kinds: dict[str, int] = {}
    counts = {"tcp_established": 0, "tcp_peer_out": 0, "tcp_peer_in": 0, "tcp_other": 0, "tcp_listen": 0}
    fds = 0
    fd_dir = "/proc/self/fd"
    for entry in os.listdir(fd_dir):
        fd = int(entry)
        if fd in exclude_fds:
            continue
        try:
            target = os.readlink(f"{fd_dir}/{entry}")
        except OSError:
            continue  # the listing's own descriptor, closed by now
        fds += 1
        kind = _fd_kind(target, tcp, unix)
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind != "socket tcp":
            continue
        local, remote, state = tcp[int(target[8:-1])]
        if state == "0A":
            counts["tcp_listen"] += 1
        elif state == "01":
            counts["tcp_established"] += 1
            if own_port is not None and local[1] == own_port:
                counts["tcp_peer_in"] += 1
            elif remote in peers:
                counts["tcp_peer_out"] += 1
            else:
                counts["tcp_other"] += 1
    names = _thread_names()
    return {**counts, "tcp_peer": counts["tcp_peer_in"] + counts["tcp_peer_out"],
            "threads": sum(names.values()), "thread_names": names, "fds": fds,
            "fds_less_pipes": fds - kinds.get("pipe", 0), "fd_kinds": dict(sorted(kinds.items())),
            "rss_bytes": current(), "peak_rss_bytes": peak(), **parts()}
