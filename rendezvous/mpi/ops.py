"""What the MPI progress engine works on: operations and listeners.

An :class:`Op` is one thing asked of the engine (a send or receive of a
buffer in chunk-sized messages, a function to run on the MPI thread, a
transfer pipeline, or a control message being received for a listener);
its future is resolved on the loop that asked. A :class:`Listener` takes
every message on one (communicator, tag) and hands them over in the order
each rank sent them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from enum import Enum
from typing import Any

from rendezvous.errors import Internal, RendezvousError

from . import aborts

__all__ = ["OpKind", "Op", "Listener", "check_part", "mpi_error", "resolve", "resolve_all"]

log = logging.getLogger("rendezvous.mpi")


class OpKind(Enum):
    """What the MPI thread is asked to do."""

    SEND = "send"          # Isend of a buffer, in chunk-sized messages
    RECV = "recv"          # Irecv into a buffer, in chunk-sized messages
    CALL = "call"          # run a function there (start-up collectives)
    PIPELINE = "pipeline"  # build a transfer pipeline there and advance it until done
    TAKE = "take"          # a listened-for message being received (matched probe, then Imrecv)

    def __str__(self) -> str:
        return self.value


class Op:
    __slots__ = ("kind", "buf", "pipeline", "peer", "tag", "chunk", "future", "loop", "fn", "remaining",
                 "error", "comm", "posted", "large", "parts")

    def __init__(self, kind: OpKind, loop: asyncio.AbstractEventLoop, future: asyncio.Future | None,
                 buf: Any = None, peer: int = -1, tag: int = -1, chunk: int = 1 << 30,
                 fn: Callable[..., Any] | Listener | None = None, comm: Any = None) -> None:
        self.comm = comm  # None: the engine's communicator
        self.kind = kind
        self.loop = loop
        self.future = future
        self.buf = buf  # kept until MPI is done with it
        self.pipeline: Any = None  # a PIPELINE op's pipeline, once built on the MPI thread
        self.peer = peer
        self.tag = tag
        self.chunk = chunk
        self.fn: Any = fn  # by kind: CALL fn(); PIPELINE fn(comm, MPI), the pipeline; TAKE its Listener
        self.remaining = 0
        self.error: BaseException | None = None
        self.posted: list | None = None  # requests already posted by the submitting thread
        #: a send or receive past MPI's eager size: it moves while both sides poll
        #: (see ProgressEngine._run)
        self.large = False
        #: a receive's requests, one per chunk, in the order posted (see check_part)
        self.parts: list | None = None

    def awaited(self) -> asyncio.Future:
        """The future of an op that has one (every kind but TAKE, which nobody awaits)."""
        assert self.future is not None
        return self.future


class Listener:
    """Messages on (comm, tag) from any rank, for one deliver callback on one loop."""

    __slots__ = ("comm", "tag", "loop", "deliver", "alloc", "taken", "order", "ready")

    def __init__(self, comm: Any, tag: int, loop: asyncio.AbstractEventLoop,
                 deliver: Callable[[list[tuple[int, Any]]], None],
                 alloc: Callable[[int], Any] = bytearray) -> None:
        self.comm = comm
        self.tag = tag
        self.loop = loop
        self.deliver = deliver
        #: a writable buffer of n bytes for a message of n bytes (any thread)
        self.alloc = alloc
        self.taken: list[tuple[int, Any]] = []  # received this turn, handed over at its end
        #: by source rank, messages matched and being received, in the order they
        #: were matched. Their receives may complete in another order (a large
        #: message after a small one); they are handed over in this one, which is
        #: the order the rank sent them in (MPI does not let one pair's messages on
        #: a tag overtake each other when they are matched): a stream's cancel
        #: never reaches the producer before the request it cancels.
        self.order: dict[int, collections.deque[Op]] = {}
        #: batches taken and not handed over yet, in the order they were taken:
        #: the MPI thread and the home loop both take messages, and hand them over
        #: differently (a callback scheduled on the loop, or at once), so a later
        #: batch could otherwise overtake an earlier one
        self.ready: collections.deque[list[tuple[int, Any]]] = collections.deque()

    def flush(self) -> None:
        """Deliver every batch ready, in order (on the listener's loop)."""
        ready = self.ready
        while ready:
            self.deliver(ready.popleft())

    def matched(self, op: Op) -> None:
        self.order.setdefault(op.peer, collections.deque()).append(op)

    def received(self, source: int) -> None:
        """Hand ``source``'s messages fully received at the head of its order to ``taken``."""
        order = self.order.get(source)
        while order and order[0].remaining == 0:
            op = order.popleft()
            if op.error is None:
                self.taken.append((op.peer, op.buf))  # its own buffer: handed over, not copied
            else:
                log.warning("MPI control message from rank %d lost: %s", op.peer, op.error)
            op.buf = None
        if order is not None and not order:
            del self.order[source]


def check_part(op: Op, req: Any, count: int) -> None:
    """A receive's request ``req`` (one of ``op.parts``) completed with a message
    of ``count`` bytes: one shorter than its chunk means that its sender gave
    up partway (see :mod:`rendezvous.mpi.aborts`), and ``op`` fails with
    ABORTED; its other parts still complete (the sender sends one message for
    each). An integer compare unless the message is short."""
    parts = op.parts
    if op.error is not None or parts is None:
        return
    last = req is parts[-1]
    expected = memoryview(op.buf).nbytes - (len(parts) - 1) * op.chunk if last else op.chunk
    if count == expected:
        return
    index = next(i for i, r in enumerate(parts) if r is req)
    start = index * op.chunk
    data = memoryview(op.buf).cast("B")[start:start + count]
    op.error = aborts.short_message(op.peer, op.tag, index, len(parts), count, expected, data)


def mpi_error(MPI: Any, exc: BaseException, what: str) -> BaseException:
    if isinstance(exc, MPI.Exception):
        return Internal(f"MPI error {what}: {exc.Get_error_string()}")
    if isinstance(exc, Exception) and not isinstance(exc, RendezvousError):
        return Internal(f"error {what}: {exc}")
    return exc


def resolve(future: asyncio.Future, error: BaseException | None, value: Any) -> None:
    if future.done():
        return  # the waiter gave up (cancelled, deadline); MPI finished anyway
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def resolve_all(done: list[tuple[asyncio.Future, BaseException | None]]) -> None:
    for future, error in done:
        resolve(future, error, None)
