"""Resident memory (and CPU time) of this process or another, read from ``/proc``.

Linux keeps a process's peak (``VmHWM`` in ``/proc/<pid>/status``) and lets
it be reset to the current RSS by writing ``5`` to ``/proc/<pid>/clear_refs``,
so the peak of one transfer can be read without sampling. Elsewhere the RSS
tests are skipped (``supported()`` is False).

This process: :func:`supported`, :func:`current`, :func:`peak`,
:func:`reset_peak`, :func:`parts`, :func:`release_free_memory`. Another one
(``bench-daemon``'s daemons and clients): :func:`status_of`,
:func:`reset_peak_of`, :func:`cpu_seconds_of`. Per thread of this process:
:func:`thread_cpu_seconds`.
"""

from __future__ import annotations

import os
import re

__all__ = ["supported", "current", "peak", "reset_peak", "parts", "release_free_memory", "status_of",
           "reset_peak_of", "cpu_seconds_of", "thread_cpu_seconds"]

_STATUS = "/proc/self/status"
_CLEAR = "/proc/self/clear_refs"


def _field(name: str) -> int:
    with open(_STATUS) as f:
        text = f.read()
    m = re.search(rf"^{name}:\s+(\d+) kB", text, re.MULTILINE)
    if m is None:
        raise OSError(f"{_STATUS} has no {name}")
    return int(m.group(1)) * 1024


def supported() -> bool:
    try:
        _field("VmHWM")
        with open(_CLEAR, "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def current() -> int:
    """Resident set size now, in bytes."""
    return _field("VmRSS")


def peak() -> int:
    """Highest resident set size since the last :func:`reset_peak` (or start), in bytes."""
    return _field("VmHWM")


def release_free_memory() -> None:
    """Hand memory that malloc keeps for reuse back to the system (glibc's
    ``malloc_trim``), so a baseline is not inflated by earlier transfers."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak() -> int:
    """Reset the high-water mark to the current RSS; returns that RSS in bytes."""
    with open(_CLEAR, "w") as f:
        f.write("5")
    return current()


def parts() -> dict[str, int]:
    """This process's RSS by kind of page: anonymous (heap, stacks), file-backed,
    shared memory, and anonymous + shared (``rss_less_file_bytes``)."""
    out = {}
    with open(_STATUS) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("RssAnon", "RssFile", "RssShmem"):
                out[f"rss_{name[3:].lower()}_bytes"] = int(rest.split()[0]) * 1024
    # file-backed pages (the shared libraries' text) come and go with the page
    # cache; what the process itself holds is the rest
    out["rss_less_file_bytes"] = out.get("rss_anon_bytes", 0) + out.get("rss_shmem_bytes", 0)
    return out


def status_of(pid: int) -> dict[str, int]:
    """``VmHWM``, ``VmRSS``, ``RssAnon``, ``RssShmem``, ``RssFile`` of process ``pid``
    in bytes (those it has; none once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("VmHWM", "VmRSS", "RssAnon", "RssShmem", "RssFile"):
                    out[name] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def reset_peak_of(pid: int) -> bool:
    """Reset process ``pid``'s high-water mark; False if that is not allowed here."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_seconds_of(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads) so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def thread_cpu_seconds() -> dict[str, float]:
    """User + system CPU time of each thread of this process so far, by name:
    a Python thread's name where it is one (``threading``), else the name the
    kernel has for it (gRPC's and MPI's own threads), with its id."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended
        comm, fields = stat.split("(", 1)[1].rsplit(")", 1)
        rest = fields.split()
        name = names.get(int(tid)) or f"{comm} {tid}"
        out[name] = out.get(name, 0.0) + (int(rest[11]) + int(rest[12])) / tick
    return out
