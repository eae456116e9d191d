"""Where a rank's recvs get their tensors, and where the tensors land: :class:`Receiver`.

A recv of a key takes, in this order: a tensor fetched for that key and
step before and not delivered (:class:`~rendezvous.rank.kept.Kept`); for a
key this rank produces, its own table; otherwise the producing task's
server, through the peer clients. The tensor then lands where the recv
wants it (the key's ``dst_device``, or the caller's ``device``), copied off
the loop when it must move between host and GPU. Whatever was fetched and
could not be delivered is kept, never lost, or handed at once to a recv of
its key and step already waiting.

With a timeline (:mod:`rendezvous.timeline`) each recv is a span: from the
call until the producer's answer (or the table's tensor) came, until the
bytes were all here, and the copy to its device, if any.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from rendezvous.deadlines import Deadlines
from rendezvous.devices import CPU, Devices, DeviceTensor, Placement, parse_placement, placement_for_device
from rendezvous.errors import (DeadlineExceeded, NotPlaced, RendezvousError, ResourceExhausted, Unavailable,
                               batch_failure)
from rendezvous.keys import _CACHEABLE, DeviceName, Key, TaskName, as_key, canonical_key, parse_key
from rendezvous.lifecycle import State
from rendezvous.paths import Path
from rendezvous.stats import Stats, payload_nbytes
from rendezvous.table import WaitingTable
from rendezvous.items import Received
from rendezvous.timeline import RecvSpan, Timeline, now
from rendezvous.rpc.peer import BatchFailed
from rendezvous.transport import Fetched

from .kept import Kept, to_stream, to_table
from .peers import Peers

__all__ = ["Receiver"]


def _never(*_: Any) -> bool:
    return False


#: key lists whose routing is remembered (a training step asks the same list every step)
_PLANS = 32
#: single keys whose routing is remembered (forgotten all at once beyond it)
_ROUTES = 1 << 14


class _Plan:
    """What a batch of keys needs that no step changes: the canonical keys, and
    which are this rank's own and which each producer is asked for, with the
    destination device of each producer's first key."""

    __slots__ = ("canonical", "srcs", "local", "groups", "one_producer")

    def __init__(self, keys: Sequence[Key | str], task: TaskName) -> None:
        self.canonical = [canonical_key(k) for k in keys]  # malformed keys: refused before anything is asked
        self.srcs = [parse_key(k).src_task for k in self.canonical]
        self.local: list[int] = []
        by_src: dict[TaskName, list[int]] = {}
        for i, src in enumerate(self.srcs):
            if src is not None and src != task:
                by_src.setdefault(src, []).append(i)
            else:
                self.local.append(i)
        canonical = self.canonical
        #: per producer: its task, the key positions, the keys, the first key's dst device
        # the keys as a tuple: a peer remembers how it encoded them by identity
        self.groups = [(src, idx, tuple(canonical[i] for i in idx), parse_key(canonical[idx[0]]).dst)
                       for src, idx in by_src.items()]
        #: every key from one producer: its batch's tensors come back in key order as they are
        self.one_producer = not self.local and len(self.groups) == 1


def _in_order(units: list[tuple[list[int], asyncio.Task]], n: int, ready: dict[int, Fetched]) -> list[Fetched]:
    """The results of ``units`` (key positions, and a task returning their
    tensors in that order) and the ``ready`` ones, in key order."""
    out: list[Any] = [None] * n
    for i, fetched in ready.items():
        out[i] = fetched
    for idx, task in units:
        for i, fetched in zip(idx, task.result()):
            out[i] = fetched
    return out


class Receiver:
    """The recvs of one rank server (``state`` says what the server is now)."""

    def __init__(self, task: TaskName, table: WaitingTable, peers: Peers, kept: Kept, devices: Devices,
                 stats: Stats, staging: tuple[int, int],
                 timeline: Timeline | None = None, deadlines: Deadlines | None = None) -> None:
        self.task = task
        self.table = table
        self.peers = peers
        self.kept = kept
        self.devices = devices
        self._stats = stats
        self._staging = staging
        #: the server's state (it keeps it here): recvs from peers only while SERVING
        self.state = State.NEW
        #: seconds after which a recv still waiting is told to ``on_stall(key, step_id, waited, timeout)``
        self.stall_warning = 0.0  # (0: never)
        self.on_stall: Callable[[Key | str, int, float, float | None], None] | None = None
        #: the routing of key lists asked recently (see _Plan), newest last
        self._plans: collections.OrderedDict[tuple, _Plan] = collections.OrderedDict()
        #: key string -> (canonical key, producing task if it is another task (None:
        #: this one's own), the placement its dst_device asks for): a recv of one
        #: key parses it once, not every step
        self._routes: dict[str, tuple[str, TaskName | None, Placement]] = {}
        #: the recvs' deadlines on one loop timer (the server's)
        self._deadlines = deadlines if deadlines is not None else Deadlines()
        #: the server's timeline, or None (off)
        self.timeline = timeline
        if timeline is not None:
            self.fetch = self._fetch_traced  # type: ignore[method-assign]  # off, fetch is all there is
        kept.offer = self._offer_kept  # a tensor kept goes to a recv of its key already waiting

    def fetch(self, key: Key | str, step_id: int, timeout: float | None,
              device: str | Placement | None, span: RecvSpan | None = None) -> Awaitable[Fetched]:
        """The tensor of ``key`` in ``step_id``, on its device, with the path it took (what it
        saw on the way in ``span``, when given): what to await, at once. The checks run in the
        call (a malformed key, an aborted step raise there), the wait in the awaitable, with no
        coroutine of this method's own in between (a step's gathered recvs pay for every frame)."""
        canonical, src, wanted = self._route(key)
        target = wanted if device is None and wanted is CPU else \
            self.devices.resolve(parse_placement(device) or wanted, device is not None)[0]  # a host key: nothing to resolve
        err = self.table.aborted(step_id)
        if err is not None:
            raise err
        if (step_id, canonical) in self.kept.held:
            return self._recv_kept(step_id, canonical, target, span)
        if src is None:
            return self._recv_local(step_id, canonical, timeout, target, span)
        return self._recv_remote(src, step_id, canonical, timeout, target, span)

    def fetching(self, key: Key | str, step_id: int, timeout: float | None,
                 device: str | Placement | None) -> Awaitable[Fetched]:
        """:meth:`fetch`, watched for a stall when it may wait longer than ``stall_warning``
        (a program that seems to hang is told what it waits for). What to await, at once."""
        limit, watch = self.stall_warning, self.on_stall
        fetching = self.fetch(key, step_id, timeout, device)
        if limit <= 0 or watch is None or self._deadlines is None or (timeout is not None and timeout <= limit):
            return fetching
        return self._deadlines.watched(fetching, limit, watch, key, step_id, limit, timeout)

    def _route(self, key: Key | str) -> tuple[str, TaskName | None, Placement]:
        """``key``'s canonical string, producing task (None: this task) and wanted
        placement, remembered for a key string (a malformed key raises
        InvalidKey, every time)."""
        route = self._routes.get(key) if type(key) is str else None
        if route is None:
            k = as_key(key)
            src = k.src_task
            route = (k.format(), None if src == self.task else src, placement_for_device(k.dst))
            if type(key) is str and len(key) <= _CACHEABLE:
                if len(self._routes) >= _ROUTES:
                    self._routes.clear()
                self._routes[key] = route
        return route

    async def _fetch_traced(self, key: Key | str, step_id: int, timeout: float | None,
                            device: str | Placement | None, span: RecvSpan | None = None) -> Fetched:
        """:meth:`fetch`, written to the timeline as a span of its own (``span`` is not used)."""
        span = RecvSpan(now())
        try:
            fetched = await Receiver.fetch(self, key, step_id, timeout, device, span)
        except BaseException as exc:
            self._recv_done(span, key, step_id, error=exc)
            raise
        self._recv_done(span, key, step_id, fetched)
        return fetched

    def _recv_done(self, span: RecvSpan, key: Key | str, step_id: int, fetched: Fetched | None = None,
                   error: BaseException | None = None) -> None:
        with contextlib.suppress(RendezvousError):  # not a key: no recv happened
            self.timeline.recv_done(span, key, step_id, fetched, error)  # type: ignore[union-attr]

    async def _recv_kept(self, step_id: int, key: str, target: Placement, span: RecvSpan | None) -> Fetched:
        """A tensor fetched before and not delivered: it goes first."""
        item = self.kept.take(step_id, key)
        if span is not None:
            span.kept = True
            span.answered = span.start
        try:
            return Fetched(Received(await self._place(item.value, target, span), item.is_dead), Path.LOCAL, True)
        except BaseException:
            self.kept.keep(step_id, key, item, front=True)
            raise

    async def _recv_local(self, step_id: int, key: str, timeout: float | None, target: Placement,
                          span: RecvSpan | None) -> Fetched:
        """From this rank's own table: the object that was sent, unless it must move device."""
        if self.kept.held and (step_id, key) in self.kept.held:  # kept since the call: nobody waited yet
            return await self._recv_kept(step_id, key, target, span)
        try:
            async with self._deadlines.timeout(timeout):
                item = await self.table.recv(step_id, key)
        except TimeoutError:
            raise DeadlineExceeded(f"recv of {key!r} (step {step_id}) timed out after {timeout:g}s") from None
        if span is not None:
            span.answered = now()
        try:
            placed = await self._place(item.value, target, span)
        except BaseException:
            self._requeue(step_id, key, item)  # not delivered: it stays for a later recv
            raise
        self._stats.received(Path.LOCAL, payload_nbytes(item.value))
        return Fetched(Received(placed, item.is_dead), Path.LOCAL, True)

    async def _recv_remote(self, src: TaskName, step_id: int, key: str, timeout: float | None,
                           target: Placement, span: RecvSpan | None) -> Fetched:
        """From the producing task, through its peer client (an abort of the step
        raises the step's error)."""
        if self.state is not State.SERVING:
            raise Unavailable(f"server {self.task} is {self.state}")
        asked = target
        if span is not None:  # a placement object of its own, for the timeline to tell its answer
            asked = Placement(target.kind, target.index)
            self.timeline.watch(span, asked)  # type: ignore[union-attr]
        try:
            fetched = await self.peers.recv(src, key, step_id, timeout, asked)
        except NotPlaced as exc:  # moved, but the device could not take it
            self._stats.error(self.peers[src].path)
            self.kept.keep(step_id, key, Received(exc.value, False))
            raise
        except RendezvousError:
            self._stats.error(self.peers.get(src).path)
            raise
        finally:
            if span is not None:
                span.got = now()
                self.timeline.unwatch(asked)  # type: ignore[union-attr]
        item = fetched.item
        self._stats.received(fetched.path, payload_nbytes(item.value))
        if not fetched.placed and (target is not CPU or isinstance(item.value, DeviceTensor)):
            try:
                item = Received(await self._place(item.value, target, span), item.is_dead)
            except BaseException:
                self.kept.keep(step_id, key, item)
                raise
        return Fetched(item, fetched.path, True)

    async def fetch_many(self, keys: Sequence[Key | str], step_id: int, timeout: float | None,
                         device: str | Placement | None) -> list[Fetched]:
        """The tensors of ``keys`` in ``step_id``, in key order, under one deadline.

        All arrive or none is consumed: if any key fails (its error, or the
        deadline), the others are cancelled, whatever had arrived is kept for the
        next recv of its key (in order, in front), and the error (the first
        failure's class) names every key that failed and why."""
        plan = self._plan(keys)
        canonical = plan.canonical
        if not canonical:
            return []
        loop = asyncio.get_running_loop()
        # One task per producer for the keys it is asked for at once (no timeline:
        # a traced recv is a span of its own); the rest, a task per key.
        groups: Sequence[tuple[TaskName, list[int], Sequence[str], DeviceName]] = []
        singles: list[int] = []
        #: this rank's own tensors that were there and need no placing: taken now, with no task
        ready: dict[int, Fetched] = {}
        targets: dict[DeviceName, Placement] = {}
        explicit = parse_placement(device)
        kept = self.kept
        if self.timeline is None and not kept:  # the usual step: routed as last time
            groups = plan.groups
            for i in plan.local:
                if not self._take_ready(canonical[i], step_id, explicit, i, ready, targets):
                    singles.append(i)
        elif self.timeline is None:  # some tensor is kept: its key is a recv of its own
            by_src: dict[TaskName, list[int]] = {}
            for i, k in enumerate(canonical):
                src = plan.srcs[i]
                if kept.has(step_id, k):
                    singles.append(i)
                elif src is not None and src != self.task:
                    by_src.setdefault(src, []).append(i)
                elif not self._take_ready(k, step_id, explicit, i, ready, targets):
                    singles.append(i)
            groups = [(src, idx, [canonical[i] for i in idx], parse_key(canonical[idx[0]]).dst)
                      for src, idx in by_src.items()]
        else:
            singles = list(range(len(canonical)))
        if not singles and not groups:
            return [ready[i] for i in range(len(canonical))]
        units: list[tuple[list[int], asyncio.Task]] = [
            ([i], loop.create_task(self._fetch_one(canonical[i], step_id, device))) for i in singles]
        #: per group task, the positions (in the group) whose tensors had arrived when it gave up
        gave_up: dict[asyncio.Task, set[int]] = {}
        for src, idx, group_keys, dst in groups:
            target, _ = self.devices.resolve(explicit or placement_for_device(dst), explicit is not None)
            seen: set[int] = set()
            task = loop.create_task(self._fetch_group(src, group_keys, step_id, target, seen))
            units.append((idx, task))
            gave_up[task] = seen
        tasks = [t for _, t in units]
        interrupted: BaseException | None = None
        timed_out = False
        try:
            async with asyncio.timeout(timeout):
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except TimeoutError:
            timed_out = True
        except BaseException as exc:  # the caller cancelled (or the loop is going)
            interrupted = exc
        if interrupted is None and not timed_out and all(t.done() and t.exception() is None for t in tasks):
            if plan.one_producer and len(units) == 1 and not ready:
                return units[0][1].result()  # one producer's keys in key order: already in order
            return _in_order(units, len(canonical), ready)
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)  # a cancelled recv settles what it was sent
        failures: dict[int, BaseException] = {}
        arrived: list[tuple[int, Fetched]] = list(ready.items())
        for idx, t in units:
            if t.cancelled():
                if timed_out:  # a group kept what had arrived itself
                    had = gave_up.get(t, set())
                    failures.update((i, DeadlineExceeded(f"timed out after {timeout:g}s"))
                                    for j, i in enumerate(idx) if j not in had)
            elif isinstance(t.exception(), BatchFailed):  # the group kept what had arrived itself
                failed = t.exception().failures  # type: ignore[union-attr]
                failures.update((idx[j], e) for j, e in failed.items())
            elif t.exception() is not None:
                failures.update((i, t.exception()) for i in idx)  # type: ignore[misc]
            else:
                arrived.extend(zip(idx, t.result()))
        got: dict[int, Fetched] = {}
        if not failures and interrupted is None:
            # The deadline came in the turn the last tensors arrived: all are here.
            # A group that gave up kept its tensors: they are taken back (the oldest
            # kept for each key first, as any recv of it would).
            got = dict(arrived)
            for idx, t in units:
                for i in (idx if t.cancelled() else ()):
                    if self.kept.has(step_id, canonical[i]):
                        got[i] = Fetched(self.kept.take(step_id, canonical[i]), Path.LOCAL, True)
                    else:  # dropped meanwhile (the server is stopping), or a recv of it took it
                        failures[i] = DeadlineExceeded(f"timed out after {timeout:g}s")
            if not failures:
                return [got[i] for i in range(len(canonical))]
            arrived = [(i, f) for i, f in got.items() if i not in failures]
        arrived.sort(key=lambda x: x[0])
        # in front, in order, then to recvs of their keys already waiting; the error says so
        self.give_back(step_id, [canonical[i] for i, _ in arrived], [f.item for _, f in arrived], why=None)
        # All of it is kept now. The error raised next carries this frame in its
        # traceback (a cancelled task keeps its error), so the frame lets go of
        # every tensor: a tensor delivered later must not stay alive through it
        # (a daemon's pool segment under it stayed "in the table").
        for held in (ready, arrived, got, units, tasks, gave_up):
            held.clear()
        del t  # the loops' last task (they ran: there is a unit)
        if interrupted is not None:
            try:
                raise interrupted
            finally:
                # no cycle (this frame -> the error -> its traceback -> this frame)
                # for the collector to find: the frame goes with the error
                interrupted = None
        raise batch_failure(canonical, step_id, failures)

    def _plan(self, keys: Sequence[Key | str]) -> _Plan:
        """The routing of ``keys``, remembered for the next steps' batches."""
        try:
            known = tuple(keys)
            plan = self._plans.get(known)
        except TypeError:  # a key that does not hash: routed afresh each time
            return _Plan(keys, self.task)
        if plan is None:
            plan = self._plans[known] = _Plan(known, self.task)
            if len(self._plans) > _PLANS:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(known)
        return plan

    def _take_ready(self, key: str, step_id: int, explicit: Placement | None, i: int,
                    ready: dict[int, Fetched], targets: dict[DeviceName, Placement]) -> bool:
        """Take this rank's own tensor of ``key`` now if it is in the table and
        needs no placing (into ``ready[i]``); False if the key is left for a
        recv of its own (nothing there yet, it must move device, the step ended).
        ``targets``: the placements resolved so far in this batch, by device."""
        try:
            item = self.table.try_take(step_id, key)
        except RendezvousError:
            return False  # the step's error: its recv raises it
        if item is None:
            return False
        value = item.value
        if value is not None:
            dst = parse_key(key).dst
            target = targets.get(dst)
            if target is None:
                target = targets[dst] = self.devices.resolve(explicit or placement_for_device(dst),
                                                             explicit is not None)[0]
            if isinstance(value, DeviceTensor) or self.devices.needs_copy(value, target, True):
                self._requeue(step_id, key, item)  # first again, as it was: its own recv places it
                return False
        self._stats.received(Path.LOCAL, payload_nbytes(value))
        ready[i] = Fetched(item, Path.LOCAL, True)
        return True

    async def _fetch_one(self, key: str, step_id: int, device: str | Placement | None) -> list[Fetched]:
        return [await self.fetch(key, step_id, None, device)]

    async def _fetch_group(self, src: TaskName, keys: Sequence[str], step_id: int, target: Placement,
                           arrived: set[int]) -> list[Fetched]:
        """``keys`` from producer ``src``, asked at once; landed where ``target``
        says. On a failure what had arrived is kept, and BatchFailed says which."""
        if self.state is not State.SERVING:
            raise Unavailable(f"server {self.task} is {self.state}")
        path = self.peers.get(src).path
        try:
            got = await self.peers.recv_batch(src, keys, step_id, target, arrived)
        except BatchFailed as exc:
            for _ in exc.failures:
                self._stats.error(path)
            raise
        except RendezvousError:
            for _ in keys:
                self._stats.error(path)
            raise
        received = self._stats.received
        if not target.is_gpu:
            # A host array received for the host stays as it is: nothing to place,
            # and the counters move once per run of one path (a batch's tensors
            # mostly came one way).
            tally: list[tuple[Path, int, int]] = []
            last: Path | None = None
            n = nbytes = 0
            ndarray = np.ndarray
            for (value, _), fetched_path, placed in got:
                if type(value) is not ndarray and not placed and value is not None:
                    break  # a GPU tensor (or one that landed for a recv before) for the host: placed below
                size = payload_nbytes(value)
                if fetched_path is not last:
                    if last is not None:
                        tally.append((last, n, nbytes))
                    last, n, nbytes = fetched_path, 0, 0
                n += 1
                nbytes += size
            else:
                if last is not None:
                    tally.append((last, n, nbytes))
                for p, count, total in tally:
                    received(p, total, count)
                return got
        out: list[Fetched] = []
        needs_copy = self.devices.needs_copy if target.is_gpu else _never
        for j, fetched in enumerate(got):
            item = fetched.item
            value = item.value
            received(fetched.path, payload_nbytes(value))
            if not fetched.placed and (type(value) is not np.ndarray or needs_copy(value, target, True)):
                try:
                    item = Received(await self._place(item.value, target), item.is_dead)
                except BaseException as exc:
                    # nothing of the group is delivered: all of it is kept, in order
                    for k, held in zip(keys, [*(o.item for o in out), *(g.item for g in got[j:])]):
                        self.kept.keep(step_id, k, held, why=None)
                    if isinstance(exc, RendezvousError):
                        raise BatchFailed({j: exc}, len(keys) - 1) from None
                    raise
            out.append(Fetched(item, fetched.path, True))
        return out

    def keep(self, step_id: int, key: str, item: Received, why: str | None, offer: bool = True) -> None:
        """Hold ``item``, fetched by a recv but never delivered (a daemon's local
        client went away), for the next recv of ``key`` in ``step_id``, in front:
        it was the oldest. A recv of it already waiting takes it (unless not
        ``offer``, see Kept.keep). Dropped if the step is over."""
        if self.state.ending or self.table.aborted(step_id) is not None:
            return
        self.kept.keep(step_id, key, item, front=True, why=why, offer=offer)

    def give_back(self, step_id: int, keys: Sequence[str], items: Sequence[Received], why: str | None) -> None:
        """:meth:`keep` for ``items``, received for ``keys`` (canonical) in that
        order: all kept first, in their order, then handed to recvs of their
        keys already waiting (the oldest tensor of a key to its oldest recv)."""
        for key, item in reversed(list(zip(keys, items))):
            self.keep(step_id, key, item, why, offer=False)
        for key in dict.fromkeys(keys):
            self.kept.hand_over(step_id, key)

    def unclaimed(self, step_id: int, key: str, fetched: Fetched) -> None:
        """A tensor that arrived after its recv gave up (deadline, cancel)."""
        if self.state.ending or self.table.aborted(step_id) is not None:
            return  # the step (or the server) is over: its tensors are dropped anyway
        self.kept.keep(step_id, key, fetched.item, why="timed out or was cancelled while it was on its way")

    def _offer_kept(self, step_id: int, key: str, queue: collections.deque[Received]) -> None:
        """Tensors kept for ``key`` in ``step_id`` (``queue``, oldest first) to the recvs of it already
        waiting (see Kept.offer): in this rank's own table for its own key, else on the producer's stream."""
        try:
            _, src, _ = self._route(key)
        except RendezvousError:
            return
        if src is None:
            to_table(self.table, step_id, key, queue)
            return
        try:
            peer = self.peers[src]
        except KeyError:
            return  # never asked: nothing waits for it
        to_stream(peer.live_stream(), step_id, key, queue)

    def _requeue(self, step_id: int, key: str, item: Received) -> None:
        try:
            self.table.requeue(step_id, key, item)
        except RendezvousError:
            pass  # the step ended meanwhile: its tensors are dropped anyway

    async def _place(self, value: Any, target: Placement, span: RecvSpan | None = None) -> Any:
        """``value`` on ``target`` (already resolved); copies run off the loop."""
        if value is None:
            return None
        if type(value) is not np.ndarray and not isinstance(value, DeviceTensor) \
                and (backend := self.devices.backend_for(value)) is not None:
            value = backend.wrap(value)  # a GPU array that landed for a recv before (kept): typed again
        if not isinstance(value, DeviceTensor) and not self.devices.needs_copy(value, target, True):
            return value  # host data staying on the host (strings too): the object as it is
        started = now() if span is not None else 0
        try:
            placed = await asyncio.get_running_loop().run_in_executor(
                None, self.devices.place, value, target, True, self._staging)
        except RendezvousError:
            raise
        except Exception as exc:  # out of device memory, a CUDA error: the caller keeps the tensor
            raise ResourceExhausted(f"cannot put the tensor on {target}: {type(exc).__name__}: {exc}; "
                                    "it is kept for the next recv of this key") from exc
        if span is not None:
            span.placing = (started, now())
        if isinstance(value, DeviceTensor) and not target.is_gpu:
            self._stats.gpu("to_host")
        elif not isinstance(value, DeviceTensor) or value.device != target.index:
            self._stats.gpu("to_device")
        return placed
