"""The waiting table: TensorFlow's local rendezvous, on one asyncio loop.

Per step id the table keeps a dict from rendezvous key (any hashable; callers
pass canonical key strings) to a FIFO queue. A queue holds either produced
tensors waiting for a consumer, or consumers waiting for a tensor, never both:

* :meth:`WaitingTable.send` hands the item to the oldest waiting receiver, or
  queues it when none waits;
* :meth:`WaitingTable.recv` takes the oldest queued item, or queues itself and
  waits.

An emptied queue is deleted, and so is an emptied step, so a table that has
moved millions of distinct keys holds nothing.

:meth:`~WaitingTable.abort` fails the step's waiters, drops its queued items
and leaves a tombstone: every later send or recv of that step fails with the
same error until :meth:`~WaitingTable.cleanup` forgets the step (tombstones
are bounded; the oldest are evicted first). :meth:`~WaitingTable.close` does
the same for every step, for good.

Threads: the table belongs to one event loop (the first one that uses it) and
takes no locks. Other threads produce with :meth:`~WaitingTable.send_threadsafe`.

Cancellation: a cancelled :meth:`~WaitingTable.recv` (``asyncio.wait_for``
timeouts included) never loses an item. A waiter still queued is removed; an
item already handed to it but not yet seen by the cancelled task goes back to
the front of its queue (or to the next waiter), unless its step was aborted,
cleaned up or the table closed meanwhile.

One class of about 460 lines: the queues, the tombstones, the items in
flight to cancelled waiters and the step-end generations are one invariant,
kept without locks by one loop; split up, each part would reach into the
others' state.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import concurrent.futures
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, final

from .errors import Aborted, InvalidArgument, RendezvousError
from .items import PendingEntry, Received

__all__ = ["WaitingTable", "Waiter", "send_items"]


def send_items(items: Iterable[tuple[Any, ...]] | Mapping[Any, Any]) -> list[tuple[Any, Any, bool]]:
    """``send_many``'s items as ``(key, tensor, is_dead)``: ``(key, tensor)`` or
    ``(key, tensor, is_dead)`` tuples, or a mapping of key to tensor;
    InvalidArgument for anything else."""
    if isinstance(items, Mapping):
        return [(k, v, False) for k, v in items.items()]
    out = []
    for entry in items:
        if not isinstance(entry, tuple) or not 2 <= len(entry) <= 3:
            raise InvalidArgument(f"send_many takes (key, tensor) or (key, tensor, is_dead) items, got {entry!r}")
        out.append((entry[0], entry[1], bool(entry[2]) if len(entry) == 3 else False))
    return out

# Module level so tests can substitute a fake clock.
_now = time.monotonic


@final  # as _Waiters: a `type(q) is _Tensors` test then tells a type checker that q is otherwise _Waiters
class _Tensors(collections.deque[tuple[Received, float]]):
    """A key's queue of produced items: (item, enqueue time)."""
    __slots__ = ()


@final
class _Waiters(collections.deque["tuple[asyncio.Future[Received] | Waiter, float]"]):
    """A key's queue of waiting receivers: (future or Waiter, enqueue time)."""
    __slots__ = ()


class Waiter:
    """A receiver answered by a call instead of an awaited future
    (:meth:`WaitingTable.wait`): no task, no future, no turn of the loop. The
    send (or the abort, cleanup, drain or close) that settles it calls its
    ``set_result(item)`` or ``set_exception(error)``, once, on the loop thread,
    inside its own call and after the table is consistent again (the call may
    use the table). A waiter withdrawn first (:meth:`WaitingTable.withdraw`)
    is never called. Subclasses say what the calls do."""

    __slots__ = ("settled",)

    def __init__(self) -> None:
        self.settled = False  # delivered, failed or withdrawn

    def done(self) -> bool:
        return self.settled

    def set_result(self, item: Received) -> None:
        raise NotImplementedError

    def set_exception(self, error: BaseException) -> None:
        raise NotImplementedError


class WaitingTable:
    """Produced tensors and waiting receivers, per step id and key.

    Confined to one event loop thread; see the module docstring.
    """

    def __init__(self, *, tombstone_limit: int = 65536) -> None:
        if tombstone_limit < 0:
            raise ValueError(f"tombstone_limit must be >= 0, got {tombstone_limit}")
        self._tombstone_limit = tombstone_limit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._steps: dict[int, dict[Hashable, _Tensors | _Waiters]] = {}
        self._tombstones: collections.OrderedDict[int, RendezvousError] = collections.OrderedDict()
        self._closed: RendezvousError | None = None
        #: called after every send (on the loop thread): a transport that idles
        #: between steps wakes up, a request for the tensor being likely soon
        self.on_send: Callable[[], None] | None = None
        # Bookkeeping for the cancel-after-handoff race: _inflight counts items
        # handed to a waiter future whose task has not resumed yet; while any
        # are, _ended records the generation at which a step was aborted or
        # cleaned up, so a cancelled receiver knows not to put its item back
        # into a step that ended after it started waiting.
        self._gen = 0
        self._inflight = 0
        self._ended: collections.OrderedDict[int, int] = collections.OrderedDict()

    # ------------------------------------------------------------------ loop

    def _check_loop(self, running: asyncio.AbstractEventLoop | None) -> None:
        """Slow path of the loop check: bind, or refuse a wrong thread/loop."""
        loop = self._loop
        if running is None:
            if loop is not None and loop.is_running():
                raise RuntimeError(
                    "WaitingTable used off its event loop thread; use send_threadsafe"
                )
            return  # no loop anywhere is running: nothing can race with us
        if loop is None:
            self._loop = running
            return
        raise RuntimeError("WaitingTable is bound to a different event loop")

    def _enter(self) -> None:
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._loop:
            self._check_loop(running)

    def _dead(self, step_id: int) -> RendezvousError | None:
        if self._closed is not None:
            return self._closed
        return self._tombstones.get(step_id)

    # ------------------------------------------------------------- hot path

    def send(self, step_id: int, key: Hashable, value: Any, is_dead: bool = False) -> None:
        """Hand ``value`` to the oldest receiver waiting for ``key``, or queue it.

        Loop thread only. Raises the step's error if the step was aborted, or
        the close error if the table is closed.
        """
        self._enter()
        if self._closed is not None or self._tombstones:
            err = self._dead(step_id)
            if err is not None:
                # A copy: raising the stored error itself would hang this frame
                # (and the refused tensor) on it until the step is cleaned up.
                raise copy.copy(err)
        self._put(step_id, key, Received(None if is_dead else value, is_dead), False)
        if self.on_send is not None:
            self.on_send()

    def requeue(self, step_id: int, key: Hashable, item: Received) -> None:
        """Give back an item taken by ``recv`` but never delivered (its consumer
        cancelled before the reply started): it goes to the oldest waiter or the
        FRONT of the queue, so FIFO order holds. Raises the step's error if the
        step ended meanwhile (the item is then dropped, as abort drops items)."""
        self._enter()
        if self._closed is not None or self._tombstones:
            err = self._dead(step_id)
            if err is not None:
                raise copy.copy(err)
        self._put(step_id, key, item, True)

    def has_waiter(self, step_id: int, key: Hashable) -> bool:
        """Whether a receiver (not one cancelled and still queued) waits for
        ``key``: then :meth:`requeue` hands an item to it."""
        keys = self._steps.get(step_id)
        q = keys.get(key) if keys is not None else None
        return type(q) is _Waiters and any(not entry[0].done() for entry in q)

    def _put(self, step_id: int, key: Hashable, item: Received, front: bool) -> None:
        steps = self._steps
        keys = steps.get(step_id)
        if keys is None:
            steps[step_id] = {key: _Tensors(((item, _now()),))}
            return
        q = keys.get(key)
        if q is None:
            keys[key] = _Tensors(((item, _now()),))
            return
        if type(q) is _Tensors:
            if front:
                q.appendleft((item, _now()))
            else:
                q.append((item, _now()))
            return
        while q:
            fut = q.popleft()[0]
            if not fut.done():  # skip waiters cancelled but not yet removed
                if not q:  # consistent before the hand-over: a Waiter's call may use the table
                    del keys[key]
                    if not keys:
                        del steps[step_id]
                fut.set_result(item)  # a Waiter's is delivered in this call: nothing in flight
                if not isinstance(fut, Waiter):
                    self._inflight += 1
                return
        keys[key] = _Tensors(((item, _now()),))

    async def recv(self, step_id: int, key: Hashable) -> Received:
        """Take the oldest item queued for ``key``, waiting for one if none is.

        Raises the step's error if the step is (or gets) aborted, or the close
        error. Cancellation (``asyncio.wait_for`` timeouts too) loses nothing.
        """
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._check_loop(loop)
        if self._closed is not None or self._tombstones:
            err = self._dead(step_id)
            if err is not None:
                raise err.with_traceback(None)
        steps = self._steps
        keys = steps.get(step_id)
        if keys is None:
            keys = steps[step_id] = {}
            q = None
        else:
            q = keys.get(key)
        if q is None:
            q = keys[key] = _Waiters()
        elif type(q) is _Tensors:
            item: Received = q.popleft()[0]
            if not q:
                del keys[key]
                if not keys:
                    del steps[step_id]
            return item
        fut: asyncio.Future[Received] = loop.create_future()
        gen = self._gen
        q.append((fut, _now()))
        try:
            item = await fut
        except asyncio.CancelledError:
            self._cancelled(step_id, key, fut, gen)
            raise
        except BaseException:
            # The step's error is stored (a tombstone) and this frame joins its
            # traceback: it must not keep the step's queues, and their tensors, alive.
            keys = q = None  # noqa: F841
            raise
        self._inflight -= 1
        if self._ended and not self._inflight:
            self._ended.clear()
        return item

    def wait(self, step_id: int, key: Hashable, waiter: Waiter) -> None:
        """Queue ``waiter`` for ``key`` as :meth:`recv` queues itself; only when no
        item is queued (take one first with :meth:`try_take`). Raises the step's
        error like :meth:`recv`. The send that comes for it delivers the item
        within its own call (see :class:`Waiter`)."""
        self._enter()
        if self._closed is not None or self._tombstones:
            err = self._dead(step_id)
            if err is not None:
                raise err.with_traceback(None)
        keys = self._steps.get(step_id)
        if keys is None:
            keys = self._steps[step_id] = {}
        q = keys.get(key)
        if q is None:
            q = keys[key] = _Waiters()
        elif type(q) is _Tensors:
            raise RuntimeError("WaitingTable.wait with an item queued: take it first")
        q.append((waiter, _now()))

    def withdraw(self, step_id: int, key: Hashable, waiter: Waiter) -> bool:
        """Take ``waiter`` out of its queue unsettled (it will never be called).
        False if it was already settled (delivered or failed)."""
        if waiter.settled:
            return False
        waiter.settled = True
        keys = self._steps.get(step_id)
        q = keys.get(key) if keys is not None else None
        if type(q) is _Waiters:
            for i, entry in enumerate(q):
                if entry[0] is waiter:
                    del q[i]
                    break
            if not q:
                del keys[key]  # type: ignore[union-attr]
                if not keys:
                    del self._steps[step_id]
        return True

    def _cancelled(
        self, step_id: int, key: Hashable, fut: asyncio.Future[Received], gen: int
    ) -> None:
        """A receiver's task was cancelled: withdraw it, or return its item."""
        if fut.done():
            if fut.cancelled() or fut.exception() is not None:
                handed = None
            else:
                handed = fut.result()
        else:  # the task was cancelled some other way than through its future
            fut.cancel()
            handed = None
        if handed is not None:
            self._inflight -= 1
            ended = self._closed is not None or step_id in self._tombstones
            if not ended and self._ended:
                ended = self._ended.get(step_id, gen) > gen
            if self._ended and not self._inflight:
                self._ended.clear()
            if not ended:
                self._put(step_id, key, handed, True)
            return
        keys = self._steps.get(step_id)
        if keys is None:
            return
        q = keys.get(key)
        if type(q) is not _Waiters:
            return
        for i, entry in enumerate(q):
            if entry[0] is fut:
                del q[i]
                break
        if not q:
            del keys[key]
            if not keys:
                del self._steps[step_id]

    # -------------------------------------------------------------- threads

    def send_threadsafe(
        self,
        loop: asyncio.AbstractEventLoop,
        step_id: int,
        key: Hashable,
        value: Any,
        is_dead: bool = False,
    ) -> concurrent.futures.Future[None]:
        """:meth:`send` from any thread, run on ``loop`` (the table's loop).

        The returned future resolves to None once the item is queued or handed
        to a waiter, or fails with the step's error (or RuntimeError when the
        loop is closed). Cancelling it before the loop ran the send withdraws
        the send. Do not block on it from the loop thread itself.
        """
        result: concurrent.futures.Future[None] = concurrent.futures.Future()

        def run() -> None:
            if not result.set_running_or_notify_cancel():
                return
            try:
                self.send(step_id, key, value, is_dead)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                result.set_exception(exc)
            else:
                result.set_result(None)

        try:
            loop.call_soon_threadsafe(run)
        except RuntimeError as exc:  # the loop is closed
            if result.set_running_or_notify_cancel():
                result.set_exception(exc)
        return result

    # ---------------------------------------------------------- step ending

    def _note_end(self, step_id: int) -> None:
        self._gen += 1
        if self._inflight:
            ended = self._ended
            ended[step_id] = self._gen
            ended.move_to_end(step_id)
            while len(ended) > max(self._tombstone_limit, 1):
                ended.popitem(last=False)

    @staticmethod
    def _fail(keys: dict[Hashable, _Tensors | _Waiters], error: RendezvousError) -> None:
        for q in keys.values():
            if type(q) is _Waiters:
                for fut, _ in q:
                    if not fut.done():
                        fut.set_exception(error)

    def abort(self, step_id: int, error: RendezvousError) -> None:
        """Fail the step's waiters with ``error``, drop its queued items, and
        fail every later send/recv of the step with it until :meth:`cleanup`.

        A second abort of the same step keeps the first error.
        """
        self._enter()
        if self._closed is not None or step_id in self._tombstones:
            return
        tombstones = self._tombstones
        tombstones[step_id] = error
        while len(tombstones) > self._tombstone_limit:
            tombstones.popitem(last=False)
        self._note_end(step_id)
        keys = self._steps.pop(step_id, None)
        if keys:
            self._fail(keys, error)

    def cleanup(self, step_id: int) -> None:
        """Forget the step: its waiters fail with ``Aborted("step <id> cleaned
        up")``, its items and tombstone are dropped; a later use starts fresh."""
        self._enter()
        if self._closed is not None:
            return
        self._tombstones.pop(step_id, None)
        keys = self._steps.pop(step_id, None)
        # Noted even for a step this table holds nothing of: an item of it may
        # be in flight to a receiver whose task is being cancelled.
        self._note_end(step_id)
        if keys:
            self._fail(keys, Aborted(f"step {step_id} cleaned up"))

    def _queued(self, step_id: int) -> dict[Hashable, _Tensors | _Waiters] | None:
        """The keys of ``step_id`` (None if none), after checking the loop; the
        step's error if it ended (as :meth:`recv` raises it)."""
        self._enter()
        if self._closed is not None or self._tombstones:
            err = self._dead(step_id)
            if err is not None:
                raise err.with_traceback(None)
        return self._steps.get(step_id)

    def try_take(self, step_id: int, key: Hashable) -> Received | None:
        """The oldest item queued for ``key`` if there is one, else None; never waits.

        Raises the step's error like :meth:`recv`."""
        keys = self._queued(step_id)
        q = keys.get(key) if keys is not None else None
        if type(q) is not _Tensors:
            return None
        item: Received = q.popleft()[0]
        if not q:
            del keys[key]  # type: ignore[union-attr]
            if not keys:
                del self._steps[step_id]
        return item

    def try_take_many(self, step_id: int, keys: Sequence[Hashable | None]) -> list[Received | None]:
        """:meth:`try_take` for each of ``keys`` in order (None keys are skipped):
        one check of the loop and the step for a whole batch."""
        queued = self._queued(step_id)
        if queued is None:
            return [None] * len(keys)
        out: list[Received | None] = []
        for key in keys:
            q = queued.get(key) if key is not None else None
            if type(q) is not _Tensors:
                out.append(None)
                continue
            out.append(q.popleft()[0])
            if not q:
                del queued[key]
        if not queued and self._steps.get(step_id) is queued:
            del self._steps[step_id]
        return out

    def fail_waiters(self, error: RendezvousError) -> int:
        """Fail every waiting receiver with ``error`` (draining), keeping queued
        items and leaving later send/recv allowed. Returns how many failed."""
        self._enter()
        failed = 0
        for step_id in list(self._steps):
            keys = self._steps[step_id]
            for key, q in [(k, q) for k, q in keys.items() if type(q) is _Waiters]:
                del keys[key]
                for fut, _ in q:
                    if not fut.done():
                        fut.set_exception(error)
                        failed += 1
            if not keys:
                del self._steps[step_id]
        return failed

    def close(self, error: RendezvousError) -> None:
        """Shut down: fail every waiter with ``error``, drop everything, and
        fail every later send/recv with it. Idempotent: the first error stays."""
        self._enter()
        if self._closed is not None:
            return
        self._closed = error
        steps, self._steps = self._steps, {}
        self._tombstones.clear()
        self._ended.clear()
        self._gen += 1
        for keys in steps.values():
            self._fail(keys, error)

    # ------------------------------------------------------------ inspection

    def aborted(self, step_id: int) -> RendezvousError | None:
        """The step's abort error (or the close error), else None."""
        return self._dead(step_id)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed is not None

    def pending(self) -> list[PendingEntry]:
        """Every non-empty queue: what it holds, how many, and the oldest's age."""
        return list(self.iter_pending())

    def iter_pending(self) -> Iterator[PendingEntry]:
        """:meth:`pending`'s rows, made as they are taken (a caller that wants a
        few does the work of those only); take them without awaiting in between."""
        now = _now()
        for step_id, keys in self._steps.items():
            for key, q in keys.items():
                if type(q) is _Tensors:
                    if q:
                        yield PendingEntry(step_id, key, "tensor", len(q), now - q[0][1])
                else:
                    live = [t for fut, t in q if not fut.done()]
                    if live:
                        yield PendingEntry(step_id, key, "waiter", len(live), now - live[0])

    def queue_count(self) -> int:
        """How many queues the table holds (at most as many rows as :meth:`pending`
        gives; one may hold only recvs cancelled a moment ago), without walking them."""
        return sum(len(keys) for keys in self._steps.values())

    def stats(self) -> dict[str, int]:
        """Sizes: steps and keys held, queued tensors and waiters, tombstones."""
        n_keys = tensors = waiters = 0
        for keys in self._steps.values():
            n_keys += len(keys)
            for q in keys.values():
                if type(q) is _Tensors:
                    tensors += len(q)
                else:
                    waiters += len(q)
        return {
            "steps": len(self._steps),
            "keys": n_keys,
            "tensors": tensors,
            "waiters": waiters,
            "tombstones": len(self._tombstones),
        }

    def __len__(self) -> int:
        """Queued tensors plus waiting receivers."""
        s = self.stats()
        return s["tensors"] + s["waiters"]

    def __repr__(self) -> str:
        s = self.stats()
        state = "closed" if self._closed is not None else "open"
        return (
            f"<WaitingTable {state} steps={s['steps']} tensors={s['tensors']} "
            f"waiters={s['waiters']} tombstones={s['tombstones']}>"
        )
