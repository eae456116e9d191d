"""Answers by request_id, so a retried RecvTensor never consumes a second tensor.

A request with a non-zero ``request_id`` takes its tensor from the waiting
table in a task of its own; every request carrying the same id (a retry after
a lost reply, or a duplicate in flight) awaits that same task and gets the same
answer, tensor or error. Answers are kept ``window`` seconds after they
complete, at most ``max_bytes`` of tensors and ``max_entries`` answers; after
that only the id is remembered (the last ``max_ids`` of them), and a late
retry gets FAILED_PRECONDITION instead of a second tensor. ``drop_step`` forgets a cleaned-up step's answers.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from collections.abc import Set as AbstractSet
from typing import Any, Protocol, TypeGuard, final

import numpy as np

from rendezvous.errors import Aborted, FailedPrecondition, InvalidArgument, RendezvousError
from rendezvous.items import Received

__all__ = ["RetryCache", "Handed", "Pending"]


@final
class _Ready:
    """An answer recorded as it was taken (or the error that answered it): an
    entry's task that is done already."""

    __slots__ = ("_item", "_error")

    def __init__(self, item: Received | None, error: BaseException | None = None) -> None:
        self._item = item
        self._error = error

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        return False

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> Received:
        if self._error is not None:
            raise copy.copy(self._error)
        return self._item  # type: ignore[return-value]


class Pending(Protocol):
    """The task of an entry whose tensor a table waiter awaits (a batch's key not
    produced yet, see :meth:`RetryCache.wait_for`): not done until the
    waiter's call answers it (:meth:`RetryCache.answered`, :meth:`~RetryCache.failed`).
    ``cancel`` withdraws the take (nobody wants it any more); a retry of the id
    that joins it awaits ``future()``, made only then, which ``settle`` ends;
    ``fail`` withdraws the take and answers its call and every joined retry
    with an error (a retry of the id was refused: see :meth:`RetryCache.withdraw`)."""

    def done(self) -> bool: ...
    def cancel(self) -> bool: ...
    def future(self) -> asyncio.Future[Received]: ...
    def settle(self, item: Received | None, error: BaseException | None) -> None: ...
    def fail(self, error: BaseException) -> None: ...


def _pending(task: Any) -> TypeGuard[Pending]:
    """Whether an entry's task is a waiter's :class:`Pending` (not a Task, not an answer)."""
    return type(task) is not _Ready and not isinstance(task, asyncio.Future)


class Handed:
    """A reply whose descriptor was handed to its stream, its transfer posted
    (an MPI send): if the connection died under it, its consumer never saw it,
    and the send waits for a receive nobody will post. A retry of one of its
    ``rids`` (by position: a group reply answers several) is answered with it
    again (``make(call_ids)``, one call id per position), so the consumer
    receives that very transfer: a second transfer would leave the first
    unmatched forever."""

    __slots__ = ("make", "rids")

    def __init__(self, make: Callable[[list[int]], Any], rids: list[int]) -> None:
        self.make = make
        self.rids = rids  # 0 where a position answers no retry any more


@final
class _Entry:
    __slots__ = ("step_id", "key", "task", "waiters", "handed", "done_at", "nbytes", "withdrawn", "owner")

    def __init__(self, step_id: int, key: str, task: asyncio.Future[Received] | _Ready | Pending,
                 handed: int = 0, done_at: float | None = None, nbytes: int = 0, owner: object = None) -> None:
        self.step_id = step_id
        self.key = key
        self.withdrawn: RendezvousError | None = None  # why a waiting take was withdrawn
        self.task = task
        self.waiters = 0
        self.handed = handed  # calls the answer was given to (a retry on another stream is one more)
        self.done_at = done_at
        self.nbytes = nbytes
        #: the stream the answer was last handed to (see cut_off); None: not said
        self.owner = owner


def _nbytes(value: Any) -> int:
    return value.nbytes if type(value) is np.ndarray else int(getattr(value, "nbytes", 0) or 0)


@final
class _Group:
    """Answers taken together and recorded at once (:meth:`RetryCache.record_many`):
    one object for a batch's ids, not an entry each (a step's thousands of
    small tensors). An id that needs an entry of its own (asked again, cut
    off, taken back) is split off into an :class:`_Entry`; released ids leave
    it too (``items[i]`` None)."""

    __slots__ = ("step_id", "rids", "items", "keys", "done_at", "nbytes", "owner", "left", "serial", "_at")

    def __init__(self, step_id: int, rids: list[int], items: list[Received], keys: list[str], done_at: float,
                 nbytes: int, owner: object, serial: int) -> None:
        self.step_id = step_id
        self.rids = rids
        self.items: list[Received | None] = items  # type: ignore[assignment]
        self.keys = keys
        self.done_at = done_at
        self.nbytes = nbytes  # of the answers still here
        self.owner = owner
        self.left = len(rids)  # answers still here
        self.serial = serial  # its key in RetryCache._done (negative: never a request_id)
        self._at: dict[int, int] | None = None

    def position(self, request_id: int) -> int:
        at = self._at
        if at is None:  # built the first time an id leaves on its own (rare)
            at = self._at = {rid: i for i, rid in enumerate(self.rids)}
        return at[request_id]

    def take(self, request_id: int) -> tuple[int, Received]:
        """Remove the answer of ``request_id``: its position and item."""
        i = self.position(request_id)
        item = self.items[i]
        assert item is not None, "an id left its group twice"
        self.items[i] = None
        self.left -= 1
        self.nbytes -= _nbytes(item.value)
        return i, item


class RetryCache:
    def __init__(self, window: float, max_bytes: int, max_entries: int = 1 << 16,
                 max_ids: int = 1 << 17) -> None:
        self.window = window
        self.max_bytes = max_bytes
        self.max_entries = max_entries  # answers held at once
        self.max_ids = max_ids          # released ids remembered (about 100 bytes each)
        #: request_id -> its entry, or the group it was recorded in
        self._entries: dict[int, _Entry | _Group] = {}
        #: completed, oldest first: entries by request_id, groups by their (negative) serial
        self._done: OrderedDict[int, _Entry | _Group] = OrderedDict()
        self._done_bytes = 0
        self._done_count = 0  # answers in _done (a group counts its answers)
        self._serial = 0  # the last group's serial
        self._answered: OrderedDict[int, None] = OrderedDict()  # ids whose answers were released
        #: ids whose answer went back to the table (cut_off): a reply on an older
        #: stream cut off later must not put it back a second time
        self._requeued: OrderedDict[int, None] = OrderedDict()
        #: held ids -> the descriptor handed over for them whose transfer was
        #: posted (see hand_over); an id leaves with its answer
        self._resends: dict[int, Handed] = {}
        self._timer: asyncio.TimerHandle | None = None  # releases answers when their window ends

    def __len__(self) -> int:
        return len(self._entries)

    async def run(self, step_id: int, request_id: int,
                  take: Callable[[], Awaitable[Received]], key: str = "", owner: object = None) -> Received:
        """The answer for ``request_id``, taking a tensor only the first time,
        for a reply on the stream ``owner`` (see :meth:`cut_off`). The same id
        for another step or key is INVALID_ARGUMENT (a retry asks for the same
        tensor)."""
        self._expire(time.monotonic())
        entry = self._entries.get(request_id)
        if type(entry) is _Group:
            entry = self._split(request_id, entry)
        if entry is None:
            if request_id in self._answered:
                raise FailedPrecondition(
                    f"request_id {request_id} was already answered and its reply is no longer held "
                    f"(retry window {self.window:g}s); not consuming another tensor")
            entry = _Entry(step_id, key, taking := asyncio.ensure_future(take()))
            taking.add_done_callback(lambda t: self._completed(request_id, t))
            self._entries[request_id] = entry
            if self._requeued:
                self._requeued.pop(request_id, None)
        elif entry.step_id != step_id:
            raise InvalidArgument(
                f"request_id {request_id} was first used for step {entry.step_id}, now for step {step_id}")
        elif entry.key != key:
            raise InvalidArgument(
                f"request_id {request_id} was first used for key {entry.key!r}, now for {key!r}")
        entry.waiters += 1
        try:
            task = entry.task  # a batch key's waiter (Pending) takes it: await its answer
            answer = (task.result() if type(task) is _Ready else
                      await asyncio.shield(task if isinstance(task, asyncio.Future) else task.future()))
            entry.handed += 1
            if owner is not None:
                entry.owner = owner
            return answer
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if entry.withdrawn is not None and current is not None and not current.cancelling():
                # Not this caller's cancel: its step was cleaned up (drop_step withdrew
                # the take). The caller gets the step's error, not a silent cancel.
                raise copy.copy(entry.withdrawn) from None
            # The last interested caller went away before the tensor was taken:
            # stop waiting, so nothing is consumed on its behalf.
            if entry.waiters == 1 and not entry.task.done():
                entry.task.cancel()
                self._entries.pop(request_id, None)
            raise
        finally:
            entry.waiters -= 1

    def wait_for(self, step_id: int, request_id: int, key: str, owner: object, pending: Pending) -> None:
        """``request_id``, new, waits for its tensor in a table waiter of the
        stream ``owner`` (no task: see ProducerStream), ``pending``: an entry
        that a retry of the id joins (:meth:`run`), answered by :meth:`answered`
        or :meth:`failed`; its take is cancelled (``pending.cancel()``) when every
        interested caller is gone, or the step is dropped."""
        entry = _Entry(step_id, key, pending, owner=owner)
        entry.waiters = 1  # the stream's call
        self._entries[request_id] = entry
        if self._requeued:
            self._requeued.pop(request_id, None)

    def answered(self, request_id: int, item: Received, owner: object, handed: bool = True) -> None:
        """The waiter of :meth:`wait_for` got ``item``, its call on ``owner``
        answered (``handed``; not when that call was cancelled and only a
        retry that joined gets it): held as :meth:`record` holds an answer
        taken at once."""
        entry = self._entries.get(request_id)
        if entry is None or type(entry) is _Group or not _pending(entry.task):
            return
        waiting = entry.task
        entry.task = _Ready(item)
        if handed:
            entry.waiters -= 1
            entry.handed += 1
            entry.owner = owner
        done_at = entry.done_at = time.monotonic()
        entry.nbytes = _nbytes(item.value)
        self._done[request_id] = entry
        self._done_bytes += entry.nbytes
        self._done_count += 1
        waiting.settle(item, None)  # a retry that joined gets it too
        self._expire(done_at)
        if self._timer is None:
            self._arm()

    def failed(self, request_id: int, error: BaseException, handed: bool = True) -> None:
        """The waiter of :meth:`wait_for` failed (its step aborted): a retry of
        the id gets the same error while the answer is held."""
        entry = self._entries.get(request_id)
        if entry is None or type(entry) is _Group or not _pending(entry.task):
            return
        waiting = entry.task
        entry.task = _Ready(None, error)
        if handed:
            entry.waiters -= 1
        entry.done_at = time.monotonic()
        self._done[request_id] = entry
        self._done_count += 1
        waiting.settle(None, error)
        self._expire(entry.done_at)
        if self._timer is None:
            self._arm()

    def stop_waiting(self, request_id: int) -> bool:
        """The stream's call of :meth:`wait_for` is cancelled before its answer.
        True when nobody else wants the answer (the take is cancelled: its
        waiter withdrawn, the id forgotten); False while a retry of the id
        still awaits it (the waiter stays and answers the retry)."""
        entry = self._entries.get(request_id)
        if entry is None or type(entry) is _Group or not _pending(entry.task):
            return True
        entry.waiters -= 1
        if entry.waiters > 0:
            return False
        del self._entries[request_id]
        entry.task.cancel()
        return True

    def held(self) -> int:
        """Answers held now (completed, kept for retries)."""
        return self._done_count

    def held_bytes(self) -> int:
        """Bytes of the answers held now."""
        return self._done_bytes

    def answers_at_once(self, request_id: int) -> bool:
        """Whether a retry of ``request_id`` is answered without waiting: its
        answer (a tensor or an error) is held, or it was released (the retry
        is refused with FAILED_PRECONDITION). Such a retry adds no waiting
        recv: the server's room for them never refuses it (a refusal would
        settle the id at its consumer and strand the answer held for it)."""
        entry = self._entries.get(request_id)
        if entry is None:
            return request_id in self._answered
        if type(entry) is _Group:
            return True
        task = entry.task
        return task.done() and not (isinstance(task, asyncio.Future) and task.cancelled())

    def withdraw(self, request_id: int, error: RendezvousError) -> None:
        """A retry of ``request_id`` whose take still waits is refused with
        ``error``: its consumer counts the id as settled and never asks with it
        again, so nothing may be taken for it any more. The take is
        withdrawn (a tensor the table handed over at that moment goes back,
        as for any cancelled take), the callers still awaiting it get
        ``error``, and the id is forgotten (a request that uses it later takes
        afresh). Nothing to do when its answer is held or it is unknown."""
        entry = self._entries.get(request_id)
        if entry is None or type(entry) is _Group or entry.task.done():
            return
        del self._entries[request_id]
        if self._resends:
            self._resends.pop(request_id, None)
        entry.withdrawn = error
        task = entry.task
        if _pending(task):
            task.fail(error)  # out of the table; its call and joined retries answered
        else:
            task.cancel()  # its awaiting callers raise ``withdrawn`` (see run)

    def has(self, request_id: int) -> bool:
        return request_id in self._entries

    def known(self, request_id: int) -> bool:
        """Held, in flight, or answered and released: a retry, not a new request."""
        return request_id in self._entries or request_id in self._answered

    def known_of(self, request_ids: AbstractSet[int]) -> AbstractSet[int]:
        """Those of ``request_ids`` that are :meth:`known` (a batch's retries),
        found with set operations (a dict's keys view against a set looks up
        the set's members, never walking the dict): usually none."""
        known = self._entries.keys() & request_ids
        if self._answered:
            known |= self._answered.keys() & request_ids
        return known

    def record(self, step_id: int, request_id: int, item: Received, key: str = "", owner: object = None) -> None:
        """Note an answer taken without waiting (the tensor was already there), for
        a reply on the stream ``owner``: no future, no callback (a batch records
        thousands)."""
        entry = self._entries[request_id] = _Entry(step_id, key, _Ready(item),
                                                   owner=owner)
        if self._requeued:
            self._requeued.pop(request_id, None)
        entry.handed = 1
        done_at = entry.done_at = time.monotonic()
        entry.nbytes = _nbytes(item.value)
        self._done[request_id] = entry
        self._done_bytes += entry.nbytes
        self._done_count += 1
        self._expire(done_at)
        if self._timer is None:
            self._arm()

    def record_many(self, step_id: int, request_ids: list[int], items: list[Received], keys: list[str],
                    owner: object = None) -> None:
        """:meth:`record` for a batch's answers (new request ids, each once), in
        one :class:`_Group`: one clock reading, one object and one release
        check for all of them. The lists are kept (the caller's fresh ones)."""
        if not request_ids:
            return
        done_at = time.monotonic()
        ndarray = np.ndarray
        nbytes = 0
        for item in items:
            value = item[0]
            nbytes += value.nbytes if type(value) is ndarray else _nbytes(value)
        self._serial -= 1
        group = _Group(step_id, request_ids, items, keys, done_at, nbytes, owner, self._serial)
        self._entries.update(dict.fromkeys(request_ids, group))
        self._done[group.serial] = group
        if self._requeued:
            for request_id in request_ids:
                self._requeued.pop(request_id, None)
        self._done_bytes += nbytes
        self._done_count += group.left
        self._expire(done_at)
        if self._timer is None:
            self._arm()

    def _split(self, request_id: int, group: _Group) -> _Entry:
        """``request_id``'s answer out of its group into an entry of its own,
        kept as long as its group would be at least (queued after the newer
        answers: released no earlier than its window)."""
        i, item = group.take(request_id)
        nbytes = _nbytes(item.value)
        entry = _Entry(group.step_id, group.keys[i], _Ready(item), 1, group.done_at, nbytes, group.owner)
        self._entries[request_id] = entry
        self._done[request_id] = entry  # its bytes and count move with it: the totals stay
        if not group.left:
            del self._done[group.serial]
        return entry

    def unclaimed(self, request_id: int) -> Received | None:
        """An answer that was taken for ``request_id`` but that no caller waits for
        any more (its only caller was cancelled just as the tensor arrived). The id
        is forgotten and the answer returned, for the caller to put back: nothing
        was delivered, so nothing may be consumed (and a reply of the id on an
        older stream cut off later puts nothing back, see :meth:`cut_off`).
        None when there is no such answer (still waiting, failed, or another
        caller still wants it)."""
        entry = self._entries.get(request_id)
        if type(entry) is _Group:
            entry = self._split(request_id, entry)
        task = entry.task if entry is not None and not entry.waiters else None
        if not isinstance(task, (asyncio.Future, _Ready)) or not task.done() or task.cancelled() or task.exception():
            return None
        self._put_back(request_id)
        return task.result()

    def delivered(self, request_id: int) -> None:
        """The answer's bytes are in its consumer's buffer (a completed MPI
        rendezvous-protocol send): no retry can come, so let it go now. Its id
        stays remembered (a late retry is refused, not answered with another
        tensor)."""
        entry = self._entries.get(request_id)
        if type(entry) is _Group or (entry is not None and request_id in self._done and not entry.waiters):
            self._release(request_id)

    def on_host(self, request_id: int, device: Received, host: Received) -> None:
        """The answer of ``request_id``, ``device`` (a GPU tensor), was copied to
        the host to be sent (``host``): that copy is held for a retry instead,
        so an answer kept for the retry window holds no device memory. A
        retry's reply is the same bytes: where they land is the consumer's
        placement, not the producer's."""
        entry = self._entries.get(request_id)
        if type(entry) is _Group:
            i = entry.position(request_id)
            if entry.items[i] is device:
                entry.items[i] = host
        elif entry is not None and request_id in self._done \
                and isinstance(task := entry.task, (asyncio.Future, _Ready)) and task.done() and not task.cancelled() \
                and task.exception() is None and task.result() is device:
            entry.task = _Ready(host)

    def hand_over(self, handed: Handed) -> None:
        """The descriptor ``handed`` left for its request ids: a retry of one of
        them is answered with it (:meth:`take_resend`) while the answer is held."""
        entries, resends = self._entries, self._resends
        for rid in handed.rids:
            if rid and rid in entries:
                resends[rid] = handed

    def take_resend(self, request_id: int) -> Handed | None:
        """The descriptor handed over for ``request_id`` (a retry: its consumer
        never got it), claimed for this retry: one reply carries a transfer to
        its end. The other ids it answers are no longer carried by it (their
        retries are answered afresh, from the answer held). None if there is
        none."""
        resends = self._resends
        handed = resends.get(request_id) if resends else None
        if handed is None:
            return None
        for rid in handed.rids:
            if rid and resends.get(rid) is handed:
                del resends[rid]
        return handed

    def restore(self, request_id: int, handed: Handed) -> None:
        """A reply re-sending ``handed`` for ``request_id`` was dropped unsent
        (its stream ended first): the next retry of the id gets it again."""
        if request_id in self._entries and request_id not in self._resends:
            self._resends[request_id] = handed

    def cut_off(self, request_id: int, owner: object = None) -> bool:
        """A reply carrying this id's answer, on the stream ``owner``, was not
        sent to its end (a cancel came first, or its stream broke). True when
        the caller puts the tensor back: the id is forgotten (a later retry
        takes afresh). False when another reply carries it.

        Only the newest reply decides. A retry reaches a producer on a new
        stream only once its consumer's old stream broke, so a reply on an
        older stream can no longer deliver, cut off or written: a reply on an
        older stream cut off after a retry was handed the answer puts nothing
        back (the retry's reply carries it), and once the newest reply is cut
        off and the tensor is back, an older one cut off later puts nothing
        back a second time. Streams not said (``owner`` None): the answer
        stays while another call was handed it."""
        entry = self._entries.get(request_id)
        if type(entry) is _Group:
            entry = self._split(request_id, entry)
        if entry is None:
            return request_id not in self._requeued
        if owner is not None and entry.owner is not None:
            if entry.owner is not owner:
                entry.handed -= 1
                return False
        elif entry.handed > 1:
            entry.handed -= 1
            return False
        self._put_back(request_id)
        return True

    def _put_back(self, request_id: int) -> None:
        """The id's answer goes back to the table: forgotten, and remembered as
        put back (once)."""
        self.forget(request_id)
        self._requeued[request_id] = None
        while len(self._requeued) > self.max_ids:
            self._requeued.popitem(last=False)

    def forget(self, request_id: int) -> None:
        """Drop an answer that was put back unsent, as if never asked."""
        entry = self._entries.pop(request_id, None)
        if self._resends:
            self._resends.pop(request_id, None)
        if type(entry) is _Group:
            self._leave_group(request_id, entry)
        elif entry is not None and self._done.pop(request_id, None) is not None:
            self._done_bytes -= entry.nbytes
            self._done_count -= 1

    def drop_step(self, step_id: int, error: RendezvousError | None = None) -> None:
        """Forget a step's answers; a take still waiting is withdrawn, and its
        callers get ``error`` (default ABORTED "step N cleaned up")."""
        for rid in [r for r, e in self._entries.items() if e.step_id == step_id]:
            entry = self._entries.get(rid)
            if entry is None:
                continue  # released with its group
            if type(entry) is _Group:
                self._release_group(entry)
                continue
            if not entry.task.done():
                entry.withdrawn = error if error is not None else Aborted(f"step {step_id} cleaned up")
                if _pending(entry.task):  # a waiter's: a retry that joined gets the step's error
                    self.failed(rid, entry.withdrawn, handed=False)
            self._release(rid)

    def _completed(self, request_id: int, task: asyncio.Future[Received]) -> None:
        entry = self._entries.get(request_id)
        if type(entry) is not _Entry or entry.task is not task:
            return
        if task.cancelled():
            self._entries.pop(request_id, None)
            return
        entry.done_at = time.monotonic()
        if task.exception() is None:
            value = task.result().value
            entry.nbytes = int(getattr(value, "nbytes", 0) or 0)
        self._done[request_id] = entry
        self._done_bytes += entry.nbytes
        self._done_count += 1
        self._expire(entry.done_at)
        self._arm()

    def _arm(self) -> None:
        """Release the oldest answer when its window ends, even if no request
        comes (an idle producer must not hold served tensors beyond the window)."""
        if self._timer is not None or not self._done:
            return
        oldest = next(iter(self._done.values()))
        delay = max(0.0, oldest.done_at + self.window - time.monotonic())  # type: ignore[operator]
        self._timer = asyncio.get_running_loop().call_later(delay, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._expire(time.monotonic())
        self._arm()

    def close(self) -> None:
        """Stop the release timer and let every answer go (the server has stopped:
        nobody can ask again; a daemon's pool segments go back at once)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for key, entry in list(self._done.items()):
            self._release_done(key, entry)

    def _expire(self, now: float) -> None:
        while self._done:
            rid, entry = next(iter(self._done.items()))
            if (now - entry.done_at < self.window  # type: ignore[operator]
                    and self._done_bytes <= self.max_bytes and self._done_count <= self.max_entries):
                break
            self._release_done(rid, entry)

    def _release(self, request_id: int) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        if self._resends:
            self._resends.pop(request_id, None)
        if type(entry) is _Group:
            self._leave_group(request_id, entry)
            self._answered[request_id] = None
            self._trim_answered()
        elif self._done.pop(request_id, None) is not None:
            self._done_bytes -= entry.nbytes
            self._done_count -= 1
            self._answered[request_id] = None
            self._trim_answered()
        elif not entry.task.done():
            entry.task.cancel()

    def _release_done(self, key: int, entry: _Entry | _Group) -> None:
        """Let a completed answer go: an entry (by request_id) or a group (by serial)."""
        if type(entry) is _Group:
            self._release_group(entry)
        else:
            self._release(key)

    def _trim_answered(self) -> None:
        while len(self._answered) > self.max_ids:
            self._answered.popitem(last=False)

    def _leave_group(self, request_id: int, group: _Group) -> None:
        """``request_id`` (no longer in _entries) leaves its group."""
        before = group.nbytes
        group.take(request_id)
        self._done_bytes -= before - group.nbytes
        self._done_count -= 1
        if not group.left:
            self._done.pop(group.serial, None)

    def _release_group(self, group: _Group) -> None:
        """Every answer still in ``group`` goes; its ids are remembered as answered."""
        entries = self._entries
        answered = self._answered
        resends = self._resends
        for rid, item in zip(group.rids, group.items):
            if item is not None and entries.get(rid) is group:
                del entries[rid]
                answered[rid] = None
                if resends:
                    resends.pop(rid, None)
        self._done.pop(group.serial, None)
        self._done_bytes -= group.nbytes
        self._done_count -= group.left
        group.items = [None] * len(group.rids)
        group.left = 0
        group.nbytes = 0
        self._trim_answered()
