"""Many deadlines on one loop with one timer: :class:`Deadlines`.

A training step's recvs, gathered one task per key, each carry a deadline
and, on a rank server, a stall warning. With ``asyncio.timeout`` and
``loop.call_later`` every one of them arms and disarms a loop timer of its
own (uvloop: a libuv timer started, stopped and closed), and nearly all of
them are disarmed unfired: the tensor comes long before the deadline. Here
they are entries of one heap instead; the loop's single timer is armed for
the earliest, and an entry given up is only marked (the heap is compacted
when marked entries outnumber live ones). What fires keeps asyncio's
meaning:

* :meth:`Deadlines.timeout` / :meth:`Deadlines.timeout_at` are
  ``asyncio.timeout`` / ``asyncio.timeout_at``: at the deadline the task is
  cancelled, and the block raises :class:`TimeoutError` in place of the
  cancel it caused (a cancel from elsewhere stays a cancel, counted with
  ``Task.cancelling``/``uncancel`` as asyncio counts it);
* :meth:`Deadlines.call_later` is ``loop.call_later`` with a ``cancel()``.

A :class:`Deadlines` belongs to the loop it is first used on (an object of
a server, handed to its parts); a block entered on another loop while
entries of the first are live falls back to asyncio's own timer.

An entry never fires before its time: it fires once the loop's clock
(``loop.time()``) has reached it, as an ``asyncio.timeout`` block is never
cancelled before its deadline, and every entry whose time has come fires in
that same firing (a little late, never early). A loop timer that wakes before
the earliest entry's time (uvloop rounds a delay to the nearest millisecond)
is set again, :data:`_AGAIN` later than that time, and fires nothing.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["Deadlines", "Timeout", "Timer"]

#: given-up entries kept in the heap before it is rebuilt without them, at
#: least; beyond it, when they outnumber the live ones
_COMPACT_AT = 256
#: how much later than the earliest entry's time the loop timer is set again
#: after it woke too early: uvloop rounds a delay to the nearest millisecond, so
#: half of one more is never early there (asyncio wakes early by at most its
#: clock's resolution, a nanosecond)
_AGAIN = 5e-4

# states of a Timeout
_IDLE, _ENTERED, _EXPIRING, _EXPIRED, _EXITED = range(5)


class _Scheduled:
    """What the heap holds: given up (``_drop``) or fired (``_expire``) once."""

    __slots__ = ("_deadlines", "live", "due")

    def __init__(self, deadlines: Deadlines, live: bool) -> None:
        self._deadlines = deadlines
        #: in the heap and not given up
        self.live = live
        #: taken out of the heap by a firing that has not called it yet
        self.due = False

    def _drop(self) -> None:
        """It will not fire (nothing happens if it fired or was dropped)."""
        if self.live:
            self.live = False
            self._deadlines._gave_up()
        self.due = False

    def _expire(self) -> None:
        raise NotImplementedError


def _nothing(*_: Any) -> None:
    pass


class Timer(_Scheduled):
    """One callback at a time on the loop (:meth:`Deadlines.call_later`)."""

    __slots__ = ("_callback", "_args")

    def __init__(self, deadlines: Deadlines, callback: Callable[..., Any], args: tuple) -> None:
        super().__init__(deadlines, True)
        self._callback = callback
        self._args = args

    def cancel(self) -> None:
        """It will not run (nothing happens if it ran or was cancelled)."""
        self._drop()
        # the heap may hold this entry until it comes due: hold nothing of the caller's
        self._callback = _nothing
        self._args = ()

    def _expire(self) -> None:
        self._callback(*self._args)


class Timeout(_Scheduled):
    """``asyncio.timeout_at``'s async context manager on a shared timer."""

    __slots__ = ("_when", "_task", "_cancelling", "_state", "_fallback")

    def __init__(self, deadlines: Deadlines, when: float | None) -> None:
        super().__init__(deadlines, False)  # in the heap once entered
        self._when = when
        self._task: asyncio.Task | None = None
        self._cancelling = 0
        self._state = _IDLE
        self._fallback: Any = None

    def when(self) -> float | None:
        """The deadline in the loop's time (None: none)."""
        return self._when

    def expired(self) -> bool:
        """Whether the deadline passed and cancelled the block."""
        return self._state in (_EXPIRING, _EXPIRED)

    async def __aenter__(self) -> Timeout:
        if self._state != _IDLE:
            raise RuntimeError("a Timeout is entered once")
        self._state = _ENTERED
        if self._when is None:
            return self
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a Timeout must be used inside a task")
        if not self._deadlines._adopt():
            self._fallback = asyncio.timeout_at(self._when)  # another loop's block: asyncio's own timer
            await self._fallback.__aenter__()
            return self
        self._task = task
        self._cancelling = task.cancelling()
        self.live = True
        self._deadlines._push(self._when, self)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: Any) -> bool | None:
        if self._fallback is not None:
            return await self._fallback.__aexit__(exc_type, exc, tb)
        if self._state == _EXPIRING:
            self._state = _EXPIRED
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:  # type: ignore[union-attr]
                raise TimeoutError from exc
            return None
        self._state = _EXITED
        self._drop()
        # The heap may hold this entry until its deadline (or a compaction):
        # it must not keep the task, whose result (a received tensor) would
        # then outlive its caller's use of it, and its receive buffer with it.
        self._task = None
        return None

    def _expire(self) -> None:
        if self._state == _ENTERED:
            self._state = _EXPIRING
            self._task.cancel()  # type: ignore[union-attr]


class Deadlines:
    """The deadlines of one loop's recvs on one loop timer (see the module)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        #: (when, sequence, entry): the earliest first; entries given up stay
        #: until they come to the top or the heap is compacted
        self._heap: list[tuple[float, int, _Scheduled]] = []
        self._order = itertools.count()
        self._dead = 0  # given-up entries still in the heap
        self._handle: asyncio.TimerHandle | None = None
        self._armed = 0.0  # when _handle fires

    def __len__(self) -> int:
        """Entries that may still fire."""
        return len(self._heap) - self._dead

    def timeout(self, delay: float | None) -> Timeout:
        """``asyncio.timeout(delay)`` on this loop's shared timer (None: no deadline)."""
        if delay is None:
            return Timeout(self, None)
        return Timeout(self, asyncio.get_running_loop().time() + delay)

    def timeout_at(self, when: float | None) -> Timeout:
        """``asyncio.timeout_at(when)``, ``when`` in the loop's time (None: no deadline)."""
        return Timeout(self, when)

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> Timer | asyncio.TimerHandle:
        """``callback(*args)`` on the loop after ``delay`` seconds; ``.cancel()`` stops it."""
        loop = asyncio.get_running_loop()
        if not self._adopt():
            return loop.call_later(delay, callback, *args)
        timer = Timer(self, callback, args)
        self._push(loop.time() + delay, timer)
        return timer

    async def watched(self, waited: Awaitable[T], limit: float, on_stall: Callable[..., Any], *args: Any) -> T:
        """``await waited``; if it is still waiting after ``limit`` seconds,
        ``on_stall(*args)`` is called once (a stall warning), on the same timer."""
        warn = self.call_later(limit, on_stall, *args)
        try:
            return await waited
        finally:
            warn.cancel()

    # -- the heap and the loop's timer -----------------------------------------------

    def _adopt(self) -> bool:
        """Whether this object serves the running loop (taking it when it has no
        live entry of another loop)."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return True
        if len(self):
            return False
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._heap.clear()
        self._dead = 0
        self._loop = loop
        return True

    def _push(self, when: float, entry: _Scheduled) -> None:
        heapq.heappush(self._heap, (when, next(self._order), entry))
        if self._handle is None or when < self._armed:
            self._arm(when)

    def _arm(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed = when
        self._handle = self._loop.call_at(when, self._fire)  # type: ignore[union-attr]

    def _gave_up(self) -> None:
        self._dead += 1
        if self._dead > _COMPACT_AT and self._dead * 2 > len(self._heap):
            self._heap = [item for item in self._heap if item[2].live]
            heapq.heapify(self._heap)
            self._dead = 0
            if not self._heap and self._handle is not None:
                self._handle.cancel()
                self._handle = None

    def _fire(self) -> None:
        self._handle = None
        heap = self._heap
        now = self._loop.time()  # type: ignore[union-attr]
        fired: list[_Scheduled] = []
        while heap and (heap[0][0] <= now or not heap[0][2].live):
            _, _, entry = heapq.heappop(heap)
            if entry.live:
                entry.live = False
                entry.due = True
                fired.append(entry)
            else:
                self._dead -= 1
        if heap:
            when = heap[0][0]
            # not due yet though the timer was set for it: the timer woke early
            self._arm(when + _AGAIN if when <= self._armed else when)
        # after the heap is whole again: a callback may add entries, or cancel
        # one due in this same firing (which then does not run, as with asyncio)
        for entry in fired:
            if entry.due:
                entry.due = False
                entry._expire()
