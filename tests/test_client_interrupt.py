"""A Ctrl-C in a blocking local client's recv (rendezvous/client/blocking.py)
loses no tensor: the caller that reads the session socket for everyone may be
interrupted while it routes what it read; the answer it was routing is still
its caller's to give back (RETURN), and the frames after it still reach their
callers.

The interrupt is raised deterministically, from the point where an answer has
been taken off the waiting calls and is being marked answered."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import numpy as np
import pytest

from rendezvous import errors
from rendezvous.client import Client as BlockingClient
from rendezvous.client.blocking import _BlockingLink
from rendezvous.client.core import LocalOp
from rendezvous.client.link import InFlight
from rendezvous.local.frames import Kind

from conftest import run
from test_daemon import daemons, key, sockdir  # noqa: F401  (a fixture)

pytestmark = pytest.mark.timeout(60)


def interrupt_once_in_answered(monkeypatch, thread_name: str | None = None, op_kind: int | None = None) -> list[bool]:
    """``InFlight.answered`` raises KeyboardInterrupt once (on threads whose name
    starts with ``thread_name``; for an answer of ``op_kind``), as a Ctrl-C landing
    there would. Returns the arming flag."""
    answered = InFlight.answered
    armed = [True]

    def interrupted(self, kind, body):
        if armed[0] and (thread_name is None or threading.current_thread().name.startswith(thread_name)) \
                and (op_kind is None or self.op.kind == op_kind):
            armed[0] = False
            raise KeyboardInterrupt
        return answered(self, kind, body)
    monkeypatch.setattr(InFlight, "answered", interrupted)
    return armed


def test_a_ctrl_c_while_the_answer_is_routed_gives_the_tensor_back(sockdir, monkeypatch):  # noqa: F811
    k = key(0, 0, "k")

    async def main():
        async with daemons(sockdir, 1) as (d,):
            loop = asyncio.get_running_loop()
            with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="caller") as pool:
                client = await loop.run_in_executor(pool, BlockingClient, d.local_target)
                try:
                    await loop.run_in_executor(pool, client.send, k, np.full(4, 3.0), 1)
                    armed = interrupt_once_in_answered(monkeypatch, "caller", Kind.RECV)

                    def interrupted_recv() -> str:
                        try:
                            client.recv(k, 1, 10)
                        except KeyboardInterrupt:
                            return "interrupted"
                        return "returned"
                    assert await loop.run_in_executor(pool, interrupted_recv) == "interrupted"
                    assert not armed[0]
                    got = await loop.run_in_executor(pool, client.recv, k, 1, 10)
                    assert got.tolist() == [3.0] * 4
                    with pytest.raises(errors.DeadlineExceeded):  # exactly once
                        await loop.run_in_executor(pool, client.recv, k, 1, 0.05)
                finally:
                    await loop.run_in_executor(pool, client.close)
    run(main())


def test_frames_read_for_other_callers_are_routed_though_the_reader_was_interrupted(monkeypatch):
    """Three answers in one read; the interrupt lands in the second: all three
    are marked answered before the interrupt leaves the reader."""
    link = _BlockingLink.__new__(_BlockingLink)
    link._ops, link._cancelled = {}, {}
    link._cond = threading.Condition()
    link._routed, link._routing = -1, (-1, None)
    entries = {i: InFlight(LocalOp(Kind.RECV, b"", None, f"k{i}")) for i in (1, 2, 3)}
    link._ops.update(entries)
    frames = [(Kind.RECV_REPLY, i, memoryview(b"answer %d" % i)) for i in (1, 2, 3)]
    answered = InFlight.answered
    calls = []

    def interrupted(self, kind, body):
        calls.append(bytes(body))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return answered(self, kind, body)
    monkeypatch.setattr(InFlight, "answered", interrupted)
    with pytest.raises(KeyboardInterrupt):
        link._route_all(frames)
    assert all(e.done for e in entries.values()) and not link._ops
    assert [bytes(entries[i].body) for i in (1, 2, 3)] == [b"answer 1", b"answer 2", b"answer 3"]
