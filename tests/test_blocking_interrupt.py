"""A Ctrl-C in a blocking Server's recv (rendezvous/rank/blocking.py) loses no
tensor, wherever it lands: the next recv of the key gets it, exactly once.

Each test lands a KeyboardInterrupt, deterministically, at one point of the
caller's wait: the caller's wait on its future is patched to raise it at the
moment the test arranges (the loop held, with a hook, right after the loop's
task ended and before anything set the caller's future; or after the result
was set; or in the conversion that follows)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import numpy as np
import pytest

import rendezvous
from rendezvous import interop
from rendezvous.rank import blocking

from conftest import key, two_servers

pytestmark = pytest.mark.timeout(60)



class LoopHold:
    """Holds the loop's thread in a callback queued by the fetching coroutine as
    its last act: the loop's task has then ended, and nothing that follows its
    end (its done callbacks: what sets the caller's future) has run. The
    caller's wait, patched, raises KeyboardInterrupt once the hold began; the
    test releases the loop after the interrupt has left the recv."""

    def __init__(self) -> None:
        self.began = threading.Event()
        self.release = threading.Event()
        self.armed = False

    def hook(self, fetch):
        async def fetching(*args, **kwargs):
            got = await fetch(*args, **kwargs)
            if self.armed and not self.began.is_set():
                asyncio.get_running_loop().call_soon(self._hold)
            return got
        return fetching

    def _hold(self) -> None:
        self.began.set()
        assert self.release.wait(20), "the test never released the loop"

    def interrupt_wait(self, monkeypatch) -> None:
        caller = threading.current_thread()
        result = concurrent.futures.Future.result

        def interrupted(fut, timeout=None):
            if threading.current_thread() is caller and self.armed:
                assert self.began.wait(20), "the loop's task never ended"
                self.armed = False
                raise KeyboardInterrupt
            return result(fut, timeout)
        monkeypatch.setattr(concurrent.futures.Future, "result", interrupted)


def assert_exactly_once(a: rendezvous.Server, b: rendezvous.Server, keys: list[str], want: list[float]) -> None:
    """The next recv of each key gets its tensor; asked again, nothing answers,
    and nothing is left waiting or kept anywhere."""
    got = [float(a.recv(k, step_id=1, timeout=10)[0]) for k in keys]
    assert got == want
    for k in keys:
        with pytest.raises(rendezvous.DeadlineExceeded):
            a.recv(k, step_id=1, timeout=0.05)
    assert not a.aio.kept and not b.aio.kept


def test_a_ctrl_c_after_the_recvs_task_ended_and_before_its_future_was_set_keeps_the_tensor(monkeypatch):
    hold = LoopHold()
    monkeypatch.setattr(blocking, "_recv_one", hold.hook(blocking._recv_one))
    with two_servers() as (a, b):
        k = key(1, 0, "t")
        b.send(k, np.full(3, 7.0), step_id=1)
        hold.interrupt_wait(monkeypatch)
        hold.armed = True
        try:
            with pytest.raises(KeyboardInterrupt):
                a.recv(k, step_id=1, timeout=10)
        finally:
            hold.release.set()
        assert_exactly_once(a, b, [k], [7.0])


def test_a_ctrl_c_in_the_same_window_of_a_batch_keeps_every_tensor(monkeypatch):
    hold = LoopHold()
    with two_servers() as (a, b):
        monkeypatch.setattr(a.aio, "recv_many_items", hold.hook(a.aio.recv_many_items))
        keys = [key(1, 0, f"t{i}") for i in range(5)]
        b.send_many({k: np.full(2, float(i)) for i, k in enumerate(keys)}, step_id=1)
        hold.interrupt_wait(monkeypatch)
        hold.armed = True
        try:
            with pytest.raises(KeyboardInterrupt):
                a.recv_many(keys, step_id=1, timeout=10)
        finally:
            hold.release.set()
        assert_exactly_once(a, b, keys, [float(i) for i in range(5)])


def test_a_ctrl_c_after_the_result_came_keeps_the_tensor(monkeypatch):
    """The interrupt lands as the wait returns with the result in it."""
    caller = threading.current_thread()
    result = concurrent.futures.Future.result
    armed = [False]

    def interrupted(fut, timeout=None):
        value = result(fut, timeout)
        if threading.current_thread() is caller and armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
        return value
    with two_servers() as (a, b):
        k = key(1, 0, "t")
        b.send(k, np.full(3, 5.0), step_id=1)
        monkeypatch.setattr(concurrent.futures.Future, "result", interrupted)
        armed[0] = True
        with pytest.raises(KeyboardInterrupt):
            a.recv_item(k, step_id=1, timeout=10)
        assert_exactly_once(a, b, [k], [5.0])


def test_a_ctrl_c_while_the_result_is_handed_over_keeps_the_tensor(monkeypatch):
    """The interrupt lands after the wait, while the recv turns its result
    into the framework's form it asked for (numpy: the arrays as they are)."""
    hand_over = interop.hand_over
    caller = threading.current_thread()
    armed = [True]

    def interrupted(*args, **kwargs):
        if armed[0] and threading.current_thread() is caller:
            armed[0] = False
            raise KeyboardInterrupt
        return hand_over(*args, **kwargs)
    monkeypatch.setattr(interop, "hand_over", interrupted)
    with two_servers() as (a, b):
        keys = [key(1, 0, f"t{i}") for i in range(3)]
        b.send_many({k: np.full(2, float(i)) for i, k in enumerate(keys)}, step_id=1)
        with pytest.raises(KeyboardInterrupt):
            a.recv_many_items(keys, step_id=1, timeout=10, framework="numpy")
        assert_exactly_once(a, b, keys, [0.0, 1.0, 2.0])


def test_a_batch_with_no_form_in_the_framework_asked_is_kept_whole(monkeypatch):
    """A tensor that has no form in the framework asked for fails the recv with
    the reason, and every tensor of it stays for the next recv (torch stands in:
    its string check is made to refuse every tensor, and torch itself is not
    needed)."""
    monkeypatch.setattr(interop, "_torch", lambda: None)

    def refuse(value, framework):
        raise rendezvous.InvalidArgument(f"no {framework} form")
    monkeypatch.setattr(interop, "convertible", refuse)
    with two_servers() as (a, b):
        keys = [key(1, 0, f"t{i}") for i in range(3)]
        b.send_many({k: np.full(2, float(i)) for i, k in enumerate(keys)}, step_id=1)
        with pytest.raises(rendezvous.InvalidArgument, match="no torch form"):
            a.recv_many(keys, step_id=1, timeout=10, framework="torch")
        assert_exactly_once(a, b, keys, [0.0, 1.0, 2.0])
