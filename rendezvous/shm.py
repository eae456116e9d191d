"""POSIX shared-memory segments for the local hop (client <-> rendezvousd).

A writer creates a segment, copies a tensor's bytes into it once and hands
its name to the reader (:func:`write`). The reader maps the segment, unlinks
its name at once and wraps the mapping in a numpy array (:func:`take`): no
copy, and from then on no name is left in ``/dev/shm`` to leak. The memory is
freed when the last mapping goes (the array is garbage collected).

Names are ``rdv-<pid>-<session>-<n>``. A session is one local client; if it
dies between creating a segment and the reader taking it, the daemon unlinks
whatever is left under the session's prefix (:func:`sweep`) when it sees the
client's connection end.

Payload copies: the writer 1 (into the segment), the reader 0.
"""

from __future__ import annotations

import itertools
import mmap
import os
import re
import secrets
import threading
import weakref
from typing import Any

import numpy as np

from .errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

__all__ = ["available", "new_prefix", "write", "take", "read", "discard", "sweep", "sweep_dead", "listed", "live_mappings", "NAME_RE", "SHM_DIR"]

try:
    import _posixshmem  # CPython's own binding of shm_open/shm_unlink (POSIX only)
except ImportError:  # pragma: no cover - Windows
    _posixshmem = None

SHM_DIR = "/dev/shm"  # where Linux shows the names (tmpfs); used only to sweep and list
NAME_RE = re.compile(r"rdv-[0-9]+-[0-9a-f]{12}-[0-9]+\Z")
_counter = itertools.count(1)
_live = 0
_live_lock = threading.Lock()


def available() -> bool:
    """Whether this platform has POSIX shared memory."""
    return _posixshmem is not None


def new_prefix() -> str:
    """A fresh session prefix: ``rdv-<pid>-<12 hex>-``."""
    return f"rdv-{os.getpid()}-{secrets.token_hex(6)}-"


def _unlink(name: str) -> bool:
    try:
        _posixshmem.shm_unlink("/" + name)
        return True
    except FileNotFoundError:
        return False


def _mapped(mm: mmap.mmap) -> None:
    global _live
    with _live_lock:
        _live += 1

    def gone() -> None:
        global _live
        with _live_lock:
            _live -= 1

    weakref.finalize(mm, gone)


def live_mappings() -> int:
    """Segments this process maps right now (taken and not yet freed)."""
    return _live


def write(prefix: str, arr: np.ndarray) -> tuple[str, int]:
    """Copy ``arr``'s bytes into a new segment named ``prefix<n>``; (name, nbytes).

    The writer keeps no mapping: the bytes live in the segment until the
    reader takes it (or a sweep unlinks it)."""
    if _posixshmem is None:
        raise FailedPrecondition("this platform has no POSIX shared memory")
    src = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)  # no copy when C-contiguous
    nbytes = int(src.nbytes)
    if nbytes == 0:
        raise InvalidArgument("an empty tensor does not need shared memory")
    name = f"{prefix}{next(_counter)}"
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        try:
            dst = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
            np.copyto(dst, src)  # the one copy
            del dst
        finally:
            mm.close()
    except BaseException as exc:
        _unlink(name)
        if isinstance(exc, OSError):
            raise ResourceExhausted(f"cannot fill a shared-memory segment of {nbytes} bytes: {exc}") from None
        raise
    return name, nbytes


def take(name: str, nbytes: int, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Map segment ``name``, unlink its name, and return the tensor on it (writable, no copy).

    NotFound if there is no such segment; InvalidArgument if the name is not
    one of ours or the segment is smaller than ``dtype`` x ``shape`` needs."""
    if _posixshmem is None:
        raise FailedPrecondition("this platform has no POSIX shared memory")
    if not NAME_RE.match(name):
        raise InvalidArgument(f"{name!r} is not a rendezvous shared-memory segment name")
    dt = np.dtype(dtype)
    count = 1
    for d in shape:
        count *= int(d)
    need = count * dt.itemsize
    if need != nbytes or nbytes <= 0:
        raise InvalidArgument(f"segment {name}: {nbytes} bytes announced, dtype {dt} and shape {tuple(shape)} "
                              f"need {need}")
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0)
    except FileNotFoundError:
        raise NotFound(f"shared-memory segment {name} does not exist (already taken, or swept)") from None
    try:
        _unlink(name)  # from here on nothing can leak: the mapping is all there is
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise InvalidArgument(f"segment {name} holds {size} bytes, {nbytes} announced")
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    _mapped(mm)
    return np.frombuffer(mm, dtype=dt, count=count).reshape(shape)


def read(name: str, nbytes: int, dest: np.ndarray) -> np.ndarray:
    """Copy segment ``name`` into ``dest`` (``nbytes`` bytes, C-contiguous) with
    read calls, unlink its name, and return ``dest``.

    What a daemon uses for a client's segment: the client can still truncate a
    segment after handing it over, and a mapping of it would then fault (SIGBUS
    kills the whole process) on the next access. A read of a truncated file is
    only short: that send fails with InvalidArgument and nothing else happens.
    NotFound and InvalidArgument as for :func:`take`."""
    if _posixshmem is None:
        raise FailedPrecondition("this platform has no POSIX shared memory")
    if not NAME_RE.match(name):
        raise InvalidArgument(f"{name!r} is not a rendezvous shared-memory segment name")
    if nbytes <= 0 or dest.nbytes != nbytes:
        raise InvalidArgument(f"segment {name}: {nbytes} bytes announced for a {dest.nbytes}-byte tensor")
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, 0)
    except FileNotFoundError:
        raise NotFound(f"shared-memory segment {name} does not exist (already taken, or swept)") from None
    try:
        _unlink(name)
        view = memoryview(dest.reshape(-1).view(np.uint8))
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [view[done:]], done)
            if n <= 0:
                raise InvalidArgument(f"segment {name} holds {done} bytes, {nbytes} announced "
                                      "(it was truncated)")
            done += n
    finally:
        os.close(fd)
    return dest


def discard(name: str) -> bool:
    """Unlink a segment that will not be taken (its send failed). True if it existed."""
    if _posixshmem is None or not NAME_RE.match(name):
        return False
    return _unlink(name)


def listed(prefix: str = "rdv-") -> list[str]:
    """Names under ``prefix`` now in /dev/shm (empty where the system has no such folder)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except OSError:
        return []


def sweep(prefix: str) -> int:
    """Unlink every segment name starting with ``prefix`` (a dead session's); how many."""
    if _posixshmem is None or not prefix.startswith("rdv-"):
        return 0
    return sum(_unlink(n) for n in listed(prefix) if NAME_RE.match(n))


def _alive(pid: int) -> bool:
    if not 0 < pid < 1 << 22:  # Linux's pid_max is at most 2**22; 0 would signal our own group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, belongs to someone else
    return True


def sweep_dead(prefix: str = "rdv-") -> int:
    """Unlink segments whose creating process (the pid in the name) no longer exists."""
    if _posixshmem is None:
        return 0
    n = 0
    for name in listed(prefix):
        if NAME_RE.match(name) and not _alive(int(name.split("-")[1])):
            n += _unlink(name)
    return n
