"""The file a timeline writes (:mod:`rendezvous.timeline`): made safely, bounded,
and never an error for the sends and recvs that record into it; and reading
trace files back (:func:`read_trace`, :func:`merge`).

**Made safely.** The file is always a new one, created exclusively
(``O_CREAT | O_EXCL | O_NOFOLLOW``, mode ``0600``): what was at the path is
removed first, never opened for writing, so a symbolic link planted there is
replaced, not followed, and the file it points to is left as it was. What
cannot be removed (a directory, another user's file in a sticky folder such as
``/tmp``) is refused with the reason. While a timeline writes its file it
holds an exclusive ``flock`` on it; a timeline that finds the file at its path
held so (another rank, or another job, given the same file) is refused
instead of taking the file from under it.

**Bounded.** The file grows to ``max_bytes`` at most: the batch of events
that would pass it is written as far as whole events fit, then a last event,
``timeline cut``, saying so, and the closing bracket (the file is then plain
JSON). Later events are not written; they are counted (:attr:`TraceFile.lost`).

**Never an error for its callers.** A write that fails (a full disk, a file
size limit) ends the file there: that batch and every later event are not
written (counted in :attr:`TraceFile.lost`, the failed write in
:attr:`TraceFile.failures`) and one warning is logged. Nothing is raised: a
trace is never a reason for a send or a recv to fail.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .errors import InvalidArgument

__all__ = ["TraceFile", "CLOSING", "read_trace", "merge"]

log = logging.getLogger("rendezvous")

#: what ends the file: the array's closing bracket
CLOSING = b"\n]\n"
#: bytes kept below the cap for the last event and the closing bracket
RESERVE = 1024
_DUMPS = json.JSONEncoder(separators=(",", ":")).encode


class TraceFile:
    """One trace file, written in batches of events (JSON texts, ASCII)."""

    def __init__(self, path: str, head: str, max_bytes: int, cut_event: Callable[[int], str]) -> None:
        """Create ``path`` (see the module) and write ``head``; InvalidArgument if
        it cannot be made. ``cut_event(n)``: the text of the last event, when
        ``n`` events of a batch did not fit under ``max_bytes``."""
        self._fd: int | None = None
        #: whether events are still written (not closed, cut or failed)
        self.writing = False
        self.path = path
        self.max_bytes = max_bytes
        self._cut_event = cut_event
        #: bytes written so far
        self.written = 0
        #: events not written: past the cap, or after a write that failed
        self.lost = 0
        #: writes that failed (the first ends the file)
        self.failures = 0
        #: why the file ended before close (a message), or None
        self.ended: str | None = None
        data = head.encode()
        if len(data) + RESERVE > max_bytes:
            raise InvalidArgument(f"timeline_max_bytes ({max_bytes}) leaves no room for the timeline's first "
                                  f"events ({len(data)} bytes)")
        self._fd = _create(path)
        try:
            _write_all(self._fd, data)
        except OSError as exc:
            self._close_fd()
            raise InvalidArgument(f"cannot write the timeline to {path!r}: {exc.strerror or exc}") from None
        self.written = len(data)
        self.writing = True

    def write(self, events: list[str]) -> None:
        """Append ``events`` (each after a ``,`` and a new line), in one write.
        Never raises."""
        if not self.writing:
            self.lost += len(events)
            return
        data = (",\n" + ",\n".join(events)).encode()
        if self.written + len(data) + RESERVE > self.max_bytes:
            self._cut(events)
            return
        self._put(data, len(events))

    def close(self) -> None:
        """Write the closing bracket (unless the file already ended) and close.
        Idempotent; never raises."""
        if self._fd is None:
            return
        if self.ended is None:
            self._put(CLOSING, 0)
        self._close_fd()

    # -- inside ---------------------------------------------------------------------

    def _cut(self, events: list[str]) -> None:
        """The cap is reached: the events that fit, the last event, the bracket."""
        room = self.max_bytes - RESERVE - self.written
        fitting: list[bytes] = []
        for event in events:
            data = b",\n" + event.encode()
            if len(data) > room:
                break
            fitting.append(data)
            room -= len(data)
        left = len(events) - len(fitting)
        last = b",\n" + self._cut_event(left).encode()
        if len(last) + len(CLOSING) > RESERVE:  # not with the timeline's own events; the bracket still fits
            last = b""
        self.lost += left
        if self._put(b"".join(fitting) + last + CLOSING, len(fitting)):
            self.writing = False
            self.ended = f"it reached its cap of {self.max_bytes} bytes (timeline_max_bytes)"
            log.warning("timeline %s: %s; later events are not written", self.path, self.ended)

    def _put(self, data: bytes, count: int) -> bool:
        """Write ``data`` (``count`` events); on a failure, end the file there."""
        try:
            _write_all(self._fd, data)  # type: ignore[arg-type]
        except OSError as exc:
            self.failures += 1
            self.lost += count
            self.ended = f"a write failed: {exc.strerror or exc}"
            log.warning("timeline %s: %s; later events are not written (sends and recvs go on)",
                        self.path, self.ended)
            self._close_fd()
            return False
        self.written += len(data)
        return True

    def __del__(self) -> None:
        self._close_fd()  # a server built and never stopped: its lock goes with it

    def _close_fd(self) -> None:
        self.writing = False
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _create(path: str) -> int:
    """A new file at ``path``, made as the module says; its descriptor, locked."""
    folder = os.path.dirname(path)
    try:
        if folder:
            os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise InvalidArgument(f"cannot write the timeline to {path!r}: cannot make its folder: "
                              f"{exc.strerror or exc}") from None
    try:
        _refuse_if_held(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise InvalidArgument(f"cannot write the timeline to {path!r}: something else made that path while it "
                              "was being replaced") from None
    except OSError as exc:
        raise InvalidArgument(f"cannot write the timeline to {path!r}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise InvalidArgument(f"cannot write the timeline to {path!r}: another timeline took it as it was made") \
            from None
    except OSError:
        pass  # a file system without locks: the file is still this timeline's own
    return fd


def _refuse_if_held(path: str) -> None:
    """InvalidArgument if a live timeline (of this process or another) writes ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.EACCES):
            return  # nothing there, a link (removed, not followed), or not ours to read (its removal says)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise InvalidArgument(
            f"cannot write the timeline to {path!r}: another timeline is writing that file (give each rank, and "
            "each job, a file of its own: {task_index} and {job_name} in the template)") from None
    except OSError:
        pass  # no locks on this file system (or not a file): nothing to tell
    finally:
        os.close(fd)


# -- reading --------------------------------------------------------------------


def read_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of a trace file, read as Perfetto reads one: the object form,
    or the array form with or without its closing bracket (a process that died
    left it open), every complete event up to a partial last one."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    body = text.lstrip()
    if body.startswith("{"):
        return list(json.loads(body)["traceEvents"])
    if not body.startswith("["):
        raise ValueError(f"{os.fspath(path)} is not a trace: it starts with neither [ nor {{")
    return list(_array_events(body))


def _array_events(body: str) -> Iterator[dict[str, Any]]:
    decoder = json.JSONDecoder()
    i, n = 1, len(body)
    while True:
        while i < n and body[i] in " \t\r\n,":
            i += 1
        if i >= n or body[i] == "]":
            return
        try:
            event, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            if body.find("\n", i) == -1:
                return  # the partial last event of a file cut short
            raise
        yield event


def merge(paths: Iterable[str | os.PathLike[str]], out: str | os.PathLike[str]) -> int:
    """Write the events of ``paths`` (one rank each) as one trace file; the count."""
    events = [e for p in paths for e in read_trace(p)]
    with open(out, "w", encoding="utf-8") as fh:
        fh.write("[\n")
        fh.write(",\n".join(_DUMPS(e) for e in events))
        fh.write("\n]\n")
    return len(events)
