"""What both session links (the blocking client's and the asyncio client's)
share: an operation waiting for its answer (:class:`InFlight`), and what is
done with a frame from the daemon that answers no waiting caller (:class:`Router`)."""

from __future__ import annotations

from typing import Any

from rendezvous.local import ipc, messages
from rendezvous.local.frames import Kind, frame

from .core import LocalOp
from .segments import Segments

__all__ = ["InFlight", "Router"]

_NO_BODY = memoryview(b"")


class InFlight:
    """An operation sent on the session socket and not answered yet: its answer
    (kind and body) once ``done``."""

    __slots__ = ("op", "kind", "body", "done", "waiter")

    def __init__(self, op: LocalOp, waiter: Any = None) -> None:
        self.op = op
        self.kind = 0
        self.body = _NO_BODY
        self.done = False
        self.waiter = waiter  # what the caller waits on (a future, for the asyncio client)

    def answered(self, kind: int, body: memoryview) -> None:
        """Its answer came (the link's reader calls this)."""
        self.kind, self.body, self.done = kind, body, True


class Router:
    """What both session links do with a frame from the daemon that is not an
    answer for a waiting caller: map and retire segments, take lent grants,
    and give back a tensor whose recv gave up. Subclasses hold ``segments``,
    ``_ops`` (operation id -> :class:`InFlight`), ``_cancelled`` (operation id
    -> the :class:`LocalOp` of a recv that gave up) and ``_write(data)``."""

    segments: Segments
    _ops: dict[int, InFlight]
    _cancelled: dict[int, LocalOp]

    def _write(self, data: bytes) -> None:
        raise NotImplementedError

    def _give_up(self, op_id: int, entry: InFlight) -> None:
        """The caller of RECV (RECV_MANY) ``op_id`` stopped waiting (a deadline of
        its own, a cancel, Ctrl-C). Its answer is given back, never dropped: if
        it already came, the tensors go back now (RETURN); if not, the daemon's
        wait is cancelled and tensors that still come are given back when they
        do. (The blocking link calls this under the lock its reader routes under.)"""
        if self._ops.pop(op_id, None) is not None:
            self._cancelled[op_id] = entry.op
            self._write(frame(Kind.CANCEL, op_id))
        elif entry.done:
            self._return(entry.op, entry.kind, entry.body)

    def _return(self, op: LocalOp, kind: int, body: memoryview) -> None:
        """Give back the tensors of ``op``'s answer, which nobody takes (RETURN frames;
        an export's release as failed: the daemon keeps it)."""
        if kind == Kind.RECV_REPLY:
            exported = ipc.replied(body)
            if exported is not None:
                self._write(frame(Kind.IPC_RELEASE, 0, ipc.release_body([exported[0].export_id], True)))
            else:
                self._write(frame(Kind.RETURN, 0, messages.returned(op.key, op.step_id, body)))
        elif kind == Kind.RECV_MANY_REPLY:
            back = messages.returned_many(op.keys, op.step_id, body)
            if back:
                self._write(b"".join(frame(Kind.RETURN, 0, one) for one in back))

    def _route(self, kind: int, op_id: int, body: memoryview) -> InFlight | None:
        """The pending entry this frame answers, or None (handled here)."""
        if kind == Kind.SEGMENTS:
            self.segments.introduce(body)
            return None
        if kind == Kind.RETIRE:
            self.segments.retire(body)
            return None
        entry = self._ops.pop(op_id, None)
        if entry is None:
            late = self._cancelled.pop(op_id, None)
            if late is not None:
                self._return(late, kind, body)
            return None
        if kind == Kind.OK:
            self.segments.lent(body)
        return entry

