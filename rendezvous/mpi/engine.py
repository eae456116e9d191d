"""The MPI progress engine: one thread completes every MPI operation.

The event loop submits operations (non-blocking send, non-blocking receive,
or a function to run on the MPI thread) and gets an asyncio future back.
With the library at thread level MULTIPLE a send or receive is posted right
there, on the caller's thread, so its message leaves at once; only its
completion is the engine thread's job (at SERIALIZED the engine thread posts
it too). The engine thread polls every request in flight with
``Request.Testsome`` (no request blocks another: no head-of-line blocking),
and resolves futures on their loop with ``call_soon_threadsafe``, one wake-up
per loop for everything that completed in one pass.

Polling: while a transfer is in flight and for ``hot_ms`` after the last
message came or went, the server's event loop itself polls, every turn,
without pausing (:meth:`ProgressEngine._loop_poll`): every transfer, or
only those with ``loop_peers`` (and every one while a caller attends, see
:meth:`ProgressEngine.attend`).
Otherwise the MPI thread polls, each empty poll doubling its pause from
``poll_min_us`` up to ``poll_max_us``, and a new submission or an arrival
wakes it (an arrival hands polling back to the loop); while a large send or
receive is in flight and nothing has moved for half a millisecond, it polls
without pausing (:meth:`ProgressEngine._pause_after`: without a single-copy
path such a message moves only as it is polled). With nothing in flight
and nobody listening it still calls into MPI (a burst of ``Iprobe``,
:meth:`ProgressEngine._progress`), every ``idle_poll_ms`` just after
traffic and ever less often as the rank stays quiet, at least once a
second (:meth:`ProgressEngine._quiet_pause`): MPI's progress is weak, and a
peer's send to this rank completes only once this rank's MPI has told it
that the bytes were received; that message may still be queued here when
the receive completes (the peer's queue was full), and a rank that stopped
calling MPI left its peer's sends waiting forever. With
a listener (requests over MPI) it probes every ``poll_max_us``, and once
nothing has moved for ``idle_after_s`` and no reply is awaited
(:meth:`ProgressEngine.expect_while`) every ``idle_poll_ms``, then a
32nd of the time since traffic, at most every 50 ms
(:meth:`ProgressEngine._listen_pause`): a rank idle that long (say,
computing) notices a new request that much later, unless it produced a
tensor since (:meth:`ProgressEngine.touch`: its server's table
calls it on every send, and the engine probes at once and stays attentive
for ``idle_after_s``: the request for that tensor is likely on its way).

Buffers are referenced by their operation until MPI is done with them, so a
producer's tensor stays alive until its send completes without parking any
thread. A cancelled receive stays posted until it matches (its message is
already on the way), so its tag can never catch a later transfer's bytes.

One class of about 530 lines (the operations and listeners it works on are
:mod:`rendezvous.mpi.ops`): the MPI thread's loop, the home loop's polls,
the requests in flight, pipelines and listeners are one state under one
lock, and the polling rules above only read as a whole.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rendezvous.errors import Internal, Unavailable

from .ops import Listener, Op, OpKind, check_part, mpi_error, resolve, resolve_all

__all__ = ["ProgressEngine", "OpKind"]

log = logging.getLogger("rendezvous.mpi")

#: bytes from which a send or receive counts as large: past MPICH's eager
#: size within a node, such a message moves in pieces, each poll moving a few
_LARGE = 64 << 10
#: seconds with nothing moving, a large message in flight, after which the MPI
#: thread polls without pausing (see _pause_after)
_STALLED = 0.0005
#: longest pause between the MPI thread's progress calls with nothing in
#: flight and nobody listening (see ProgressEngine._quiet_pause)
_QUIET_MAX = 1.0
#: MPI calls the MPI thread makes at a time then (each may send one message a
#: peer waits for; see ProgressEngine._progress): about 50 us
_PROGRESS_BURST = 128
#: longest pause between an idle engine's probes for its listeners (requests
#: over MPI; see ProgressEngine._listen_pause)
_LISTEN_MAX = 0.05
#: an idle listening engine's pause: this fraction of the time since traffic
_LISTEN_SHARE = 1 / 32


class ProgressEngine:
    """Owns ``comm`` (an mpi4py communicator) on a thread of its own. ``comm``
    may be None at first, while start-up collectives (:meth:`call`) make the
    communicator; :meth:`attach` then gives it before any transfer."""

    def __init__(self, comm: Any = None, *, poll_min_us: int = 10, poll_max_us: int = 50,
                 hot_ms: float = 2.0, idle_poll_ms: float = 10.0, idle_after_s: float = 0.25) -> None:
        from mpi4py import MPI  # only reached with MPI enabled

        self._MPI = MPI
        self.comm = comm
        self.poll_min = poll_min_us / 1e6
        self.poll_max = poll_max_us / 1e6
        self._large = 0  # large sends and receives in flight that move only as polled (under _plock)
        #: ranks whose large messages move in one copy made by the receiver, with
        #: no polling (this node's, when MPI has a single-copy path: see
        #: MpiWorld.probe_single_copy); a transfer with any other rank moves only
        #: as it is polled once it is large (see _pause_after)
        self.copied_peers: frozenset[int] = frozenset()
        self.hot = hot_ms / 1e3
        self.idle_poll = max(idle_poll_ms / 1e3, self.poll_max)
        self.idle_after = idle_after_s
        #: probes made: matched probes for listeners, and the idle progress
        #: calls (the idle test reads this)
        self.probes = 0
        # Posting from the caller's thread needs MPI_THREAD_MULTIPLE.
        self.direct = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self._waiting: list[Callable[[], bool]] = []  # see expect_while
        self.home: asyncio.AbstractEventLoop | None = None  # the loop that polls while hot (start)
        self.loop_peers: frozenset[int] | None = None  # ranks whose transfers it polls (None: all)
        #: callers waiting on the home loop (see attend); None: not counted, the
        #: loop polls as ``loop_peers`` says whoever waits
        self.attended: int | None = None
        self._loop_polling = False  # a _loop_poll is scheduled on the home loop
        # Requests in flight and their operations, and everything else one poll
        # touches: one poller at a time (the MPI thread or the home loop).
        self._plock = threading.Lock()
        self._reqs: list = []
        self._owners: list[Op] = []
        self._last_activity = 0.0  # monotonic time of the last message in or out
        self._idle = False  # the MPI thread probes at the idle pace (see touch)
        self._resting = False  # told no requests come soon (see rest)
        self._cv = threading.Condition()
        self._inbox: list[Op] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._pipes: list[Op] = []  # PIPELINE ops being advanced, MPI thread only
        self._finished: dict[asyncio.AbstractEventLoop, list] = {}  # completions not yet handed over
        self.in_flight = 0  # operations posted and not complete (read by stats)
        self.polls = 0      # Testsome calls made (the idle-CPU test reads this)
        self._listeners: list[Listener] = []  # control messages taken as they come (see listen)
        self._statuses: list = []  # Testsome's, reused: a receive's message length is checked

    # -- loop side ----------------------------------------------------------

    def attach(self, comm: Any) -> None:
        """The communicator every later transfer uses (made by a start-up collective)."""
        self.comm = comm

    def start(self, loop_polls: bool = False, loop_peers: frozenset[int] | None = None) -> None:
        """Start the MPI thread. With ``loop_polls``, the running loop is the
        engine's home: while traffic is expected it polls there (see
        :meth:`_loop_poll`); else the MPI thread polls, with its backoff.
        ``loop_peers``: only transfers with these ranks make the home loop poll
        (None: all; it may be set later, as ``loop_peers``, once the ranks are
        known); the MPI thread polls the others."""
        self.home = asyncio.get_running_loop() if loop_polls else None
        self.loop_peers = loop_peers
        self._thread = threading.Thread(target=self._run, name="rendezvous-mpi", daemon=True)
        self._thread.start()

    def _submit(self, op: Op) -> asyncio.Future:
        with self._cv:
            if self._stopping:
                raise Unavailable("MPI progress engine is stopped")
            self._inbox.append(op)
            self._cv.notify()
        return op.awaited()

    def expect_while(self, waiting: Callable[[], bool]) -> None:
        """While ``waiting()`` is true (called on the MPI thread, under the GIL:
        keep it to a few attribute reads) a reply is awaited, and the MPI
        thread's pause stays at most ``poll_max_us``, however long the wait."""
        self._waiting.append(waiting)

    def touch(self) -> None:
        """Traffic is likely soon (this rank produced a tensor: a request for it
        may come, or have come already). The idle pace ends now: the MPI thread
        probes at once, then every ``poll_max_us`` for ``idle_after_s``. Any
        thread; a few attribute reads unless the engine was idle."""
        self._last_activity = time.monotonic()
        self._resting = False
        if self._idle:
            self._idle = False
            with self._cv:
                self._cv.notify()

    def rest(self) -> None:
        """No requests are expected soon (the caller knows: say, its step is
        done): a listening engine probes at the idle pace from now on, not
        ``idle_after_s`` after the last message, until traffic or a
        :meth:`touch` (the progress calls a quiet rank makes for its peers keep
        their pace). Any thread. ``rendezvous bench`` rests each contender's
        servers between its batches, as a process running only that server
        would be idle then."""
        self._resting = True

    def attend(self, delta: int) -> None:
        """A caller starts (+1) or stops (-1) waiting on a result (home loop
        thread only; counted once ``attended`` is set). While one waits, the
        home loop polls every transfer, as with ``loop_peers=None``; once none
        does, only those of ``loop_peers`` again, and the MPI thread the rest.
        The blocking Server counts its callers so: a caller blocked on its
        answer leaves the GIL free, and a lone small recv completes at the
        loop's pace, not at the MPI thread's hand-over; a caller computing
        between calls keeps its GIL from a spinning loop."""
        self.attended += delta  # type: ignore[operator]
        if delta > 0 and self.attended == 1:
            self._poll_on_loop()

    def _loop_polls(self, peer: int) -> bool:
        """Whether the home loop polls transfers with ``peer`` now."""
        return self.loop_peers is None or bool(self.attended) or peer in self.loop_peers

    def _transfer(self, op: Op) -> asyncio.Future:
        """Post a send or receive here when MPI allows it (MULTIPLE), so its
        message leaves now. On the home loop its requests join those in flight
        at once and the loop polls them; elsewhere the MPI thread takes them."""
        if self.direct and not self._stopping:
            reqs: list = []
            self._post_transfer(op, reqs)
            if not reqs:  # posting failed: nothing to complete
                resolve(op.awaited(), op.error, None)
                return op.awaited()
            if op.loop is self.home and self._loop_polls(op.peer):
                with self._plock:
                    self._reqs.extend(reqs)
                    self._owners.extend([op] * len(reqs))
                    op.remaining = len(reqs)
                    self.in_flight += 1
                    self._large += op.large
                self._poll_on_loop()
                return op.awaited()
            op.posted = reqs
        return self._submit(op)

    def _poll_on_loop(self) -> None:
        """Traffic is expected: poll on the home loop (its thread), every turn,
        until none is (home loop thread only)."""
        if not self._loop_polling and not self._stopping:
            self._loop_polling = True
            self.home.call_soon(self._loop_poll)  # type: ignore[union-attr]

    def _loop_poll(self) -> None:
        """One poll on the home loop; again next turn while traffic is expected,
        else the MPI thread takes over (backing off, or sleeping).

        Polling here, not on the MPI thread, is what makes small transfers
        fast: a completion resolves its future and a control message reaches
        its listener in the same call, without waking another thread and
        without handing the GIL back and forth; and a process busy with
        transfers keeps one thread running, not two, on a machine that may
        have as few cores as ranks."""
        if self._stopping:
            self._loop_polling = False
            return
        with self._plock:
            moved = self._poll(True)
            collected = self._collect()
        self._hand_over(collected, True)
        now = time.monotonic()
        if moved:
            self._last_activity = now
        if self._hot(now):
            self.home.call_soon(self._loop_poll)  # type: ignore[union-attr]
        else:
            self._loop_polling = False
            with self._cv:
                self._cv.notify()  # the MPI thread polls (backing off) or sleeps

    def isend(self, buf: Any, dest: int, tag: int, chunk: int, comm: Any = None) -> asyncio.Future:
        """Send ``buf`` (bytes-like, C-contiguous) to ``dest`` on ``tag``; in ``chunk``-byte
        messages; on ``comm`` (default: the engine's)."""
        loop = asyncio.get_running_loop()
        return self._transfer(Op(OpKind.SEND, loop, loop.create_future(), buf, dest, tag, chunk, comm=comm))

    def listen(self, comm: Any, tag: int, deliver: Callable[[list[tuple[int, Any]]], None],
               alloc: Callable[[int], Any] = bytearray) -> None:
        """Take every message that arrives on ``comm`` with ``tag`` (from any rank)
        and hand them, as (source rank, the buffer it was received into: ``alloc(n)``
        for a message of n bytes, a bytearray unless said otherwise), to ``deliver`` on the calling
        loop, all that arrived in one turn together. Matched probes
        (``Improbe`` + ``Imrecv``): a message is received by exactly this
        listener, into a buffer of its own size. While a listener exists the
        engine polls (with its backoff) instead of sleeping."""
        loop = asyncio.get_running_loop()
        with self._cv:
            self._listeners.append(Listener(comm, tag, loop, deliver, alloc))
            self._cv.notify()


    def irecv(self, buf: Any, source: int, tag: int, chunk: int) -> asyncio.Future:
        """Receive into ``buf`` from ``source`` on ``tag``, in ``chunk``-byte messages."""
        loop = asyncio.get_running_loop()
        return self._transfer(Op(OpKind.RECV, loop, loop.create_future(), buf, source, tag, chunk))

    def call(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Run ``fn()`` on the MPI thread (collectives at start-up)."""
        loop = asyncio.get_running_loop()
        return self._submit(Op(OpKind.CALL, loop, loop.create_future(), fn=fn))

    def pipeline(self, make: Callable[[Any, Any], Any]) -> asyncio.Future:
        """Build a transfer pipeline on the MPI thread with ``make(comm, MPI)`` (see
        :mod:`rendezvous.mpi.staging`) and advance it there until it is done."""
        loop = asyncio.get_running_loop()
        return self._submit(Op(OpKind.PIPELINE, loop, loop.create_future(), fn=make))

    def stop(self, timeout: float = 10.0) -> None:
        """Finish what is in flight (up to ``timeout``), then cancel the rest and join.

        Must run before MPI is finalized; idempotent."""
        with self._cv:
            self._stopping = True
            self._stop_deadline = time.monotonic() + timeout
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
            self._thread = None

    # -- MPI thread -----------------------------------------------------------

    def _post(self, op: Op, reqs: list, owners: list) -> None:
        MPI = self._MPI
        if op.kind is OpKind.PIPELINE:
            try:
                op.pipeline = op.fn(self.comm, MPI)
            except BaseException as exc:
                op.loop.call_soon_threadsafe(resolve, op.awaited(), mpi_error(MPI, exc, "posting a transfer"), None)
                return
            self._pipes.append(op)
            self.in_flight += 1
            return
        if op.kind is OpKind.CALL:
            try:
                value, error = op.fn(), None
            except BaseException as exc:  # handed to the caller, never fatal here
                value, error = None, exc
            op.loop.call_soon_threadsafe(resolve, op.awaited(), error, value)
            return
        posted = op.posted
        if posted is None:  # not posted by the submitting thread: post it here
            posted = []
            self._post_transfer(op, posted)
        op.posted = None
        reqs.extend(posted)
        owners.extend([op] * len(posted))
        op.remaining = len(posted)
        if posted:
            self.in_flight += 1
            self._large += op.large
        else:
            op.loop.call_soon_threadsafe(resolve, op.awaited(), op.error, None)

    def _post_transfer(self, op: Op, reqs: list) -> None:
        """Post the chunk messages of a send or receive into ``reqs`` (any thread
        at MULTIPLE); an error is left in ``op.error`` and stops posting."""
        MPI = self._MPI
        view = memoryview(op.buf).cast("B")
        n = len(view)
        op.large = n >= _LARGE and op.peer not in self.copied_peers
        starts = range(0, n, op.chunk) if n else [0]
        comm = op.comm if op.comm is not None else self.comm
        if op.kind is OpKind.RECV:
            op.parts = reqs  # this receive's own requests (see check_part)
        try:
            for start in starts:
                part = view[start:start + op.chunk]
                if op.kind is OpKind.SEND:
                    reqs.append(comm.Isend([part, MPI.BYTE], op.peer, op.tag))
                else:
                    reqs.append(comm.Irecv([part, MPI.BYTE], op.peer, op.tag))
        except MPI.Exception as exc:
            op.error = Internal(f"MPI {op.kind} of {n} bytes with rank {op.peer} tag {op.tag} failed: "
                                f"{exc.Get_error_string()}")
        self._last_activity = time.monotonic()

    def _complete(self, op: Op, on_loop: bool = False) -> None:
        op.remaining -= 1
        if op.remaining == 0:
            self.in_flight -= 1
            self._large -= op.large
            if op.kind is OpKind.TAKE:
                listener: Listener = op.fn
                listener.received(op.peer)
                return
            op.buf = None
            if on_loop and op.loop is self.home:
                resolve(op.awaited(), op.error, None)
            else:
                self._finished.setdefault(op.loop, []).append((op.future, op.error))

    def _take_arrivals(self, reqs: list, owners: list) -> bool:
        """Post a receive for every message a listener is waiting for that has
        arrived (matched probe: nobody else can receive it). True if any did."""
        MPI = self._MPI
        status = MPI.Status()
        found = False
        for listener in tuple(self._listeners):
            while True:
                try:
                    self.probes += 1
                    msg = listener.comm.Improbe(MPI.ANY_SOURCE, listener.tag, status)
                except MPI.Exception as exc:
                    log.warning("MPI probe for control messages failed: %s", exc.Get_error_string())
                    break
                if msg is None:
                    break
                n = status.Get_count(MPI.BYTE)
                buf = listener.alloc(n)
                op = Op(OpKind.TAKE, listener.loop, None, buf, status.Get_source(), listener.tag,
                         fn=listener)
                try:
                    reqs.append(msg.Irecv([buf, MPI.BYTE]))
                except MPI.Exception as exc:
                    log.warning("MPI receive of a control message failed: %s", exc.Get_error_string())
                    continue
                owners.append(op)
                op.remaining = 1
                listener.matched(op)
                self.in_flight += 1
                found = True
        return found

    def _collect(self) -> tuple[dict, list]:
        """What completed since the last call and the control messages taken
        (under ``_plock``), for :meth:`_hand_over` outside it."""
        finished, self._finished = self._finished, {}
        taken = []
        for listener in self._listeners:
            if listener.taken:
                listener.ready.append(listener.taken)
                listener.taken = []
                taken.append(listener)
        return finished, taken

    def _hand_over(self, collected: tuple[dict, list], on_loop: bool = False) -> None:
        """Resolve what completed: one wake-up of each loop for all of them, not
        one per operation (and one per listener for the control messages it
        took). On the home loop its own are handed over directly."""
        finished, taken = collected
        for loop, done in finished.items():
            loop.call_soon_threadsafe(resolve_all, done)
        for listener in taken:
            if on_loop and listener.loop is self.home:
                listener.flush()
            else:
                listener.loop.call_soon_threadsafe(listener.flush)
        if taken and not on_loop and self.home is not None and (self.loop_peers is None or self.attended):
            # requests came in: their replies (and likely more requests) follow
            # (a loop that polls only some peers' transfers leaves this to the thread)
            self.home.call_soon_threadsafe(self._poll_on_loop)

    def _hot(self, now: float) -> bool:
        """Whether traffic is expected now: something in flight, or a message in
        or out within the last ``hot`` seconds. A reply awaited longer than that
        (its tensor not produced yet) is polled for by the MPI thread, backing
        off: spinning through another rank's compute would take its core on a
        machine with as many cores as ranks. With callers counted (see
        :meth:`attend`) and none waiting, only a loop with peers of its own
        polls on."""
        if self.attended == 0 and not self.loop_peers:
            return False
        return bool(self._reqs or self._pipes or now - self._last_activity < self.hot)

    def _poll(self, on_loop: bool) -> bool:
        """Take arrived control messages and test every request in flight; True
        if anything moved. Under ``_plock``; then :meth:`_collect`."""
        MPI = self._MPI
        reqs, owners = self._reqs, self._owners
        moved = False
        if self._listeners and not self._stopping:
            moved = self._take_arrivals(reqs, owners)
            if not moved and self._idle and not on_loop:
                # Woken from an idle pause: the first probe after a while
                # without MPI calls misses a message that arrived meanwhile
                # (it is pulled in by that probe's progress, matched by the
                # next one: MPICH), and a request would wait one more pause.
                moved = self._take_arrivals(reqs, owners)
        elif not reqs and not on_loop and self.comm is not None:
            self._progress(_PROGRESS_BURST)
        if reqs:
            statuses: list | None = self._statuses
            try:
                self.polls += 1
                done = MPI.Request.Testsome(reqs, statuses)
            except MPI.Exception as exc:
                done = self._fail_one(reqs, owners, exc)
                statuses = None
            if done:
                moved = True
                for j, i in enumerate(done):
                    op = owners[i]
                    if op.kind is OpKind.RECV and statuses is not None:
                        check_part(op, reqs[i], statuses[j].Get_count(MPI.BYTE))  # a short message: ABORTED
                    self._complete(op, on_loop)
                if len(done) == 1:
                    del owners[done[0]], reqs[done[0]]
                else:  # one pass, not one list shift per completion
                    gone = set(done)
                    owners[:] = [o for i, o in enumerate(owners) if i not in gone]
                    reqs[:] = [r for i, r in enumerate(reqs) if i not in gone]
        return moved

    def _progress(self, calls: int) -> None:
        """Call into MPI ``calls`` times with nothing of this rank's own in
        flight (under ``_plock``). MPI's progress is weak: when a receive here
        completes, the message telling its sender so may still be queued in
        this process (the sender's shared-memory queue was full: it was not
        polling just then), and it leaves only when this rank calls MPI
        again, one such message per call (MPICH). A rank that went quiet
        then left its peer's sends waiting forever (the peer's tensors held,
        its transfers never done). A call costs well under a microsecond,
        the thread's wake-up far more: the thread makes many at a time."""
        self.probes += 1
        iprobe, source, tag = self.comm.Iprobe, self._MPI.ANY_SOURCE, self._MPI.ANY_TAG
        try:
            for _ in range(calls):
                iprobe(source, tag)
        except self._MPI.Exception as exc:
            log.warning("MPI progress call failed: %s", exc.Get_error_string())

    def _last_calls(self) -> None:
        """The MPI thread's last MPI calls as it ends: what a peer still waits
        for leaves now (see _progress)."""
        if self.comm is not None:
            with self._plock:
                self._progress(_PROGRESS_BURST)

    def _quiet_pause(self, now: float) -> float:
        """The MPI thread's pause between progress calls with nothing in flight
        and nobody listening: ``idle_poll`` just after traffic (what a peer
        waits for is owed then), then a quarter of the time since, at most
        ``_QUIET_MAX``: a rank quiet for long calls MPI about once a second,
        and a message owed to a peer waits at most a quarter longer than the
        peer took to make room for it."""
        return min(_QUIET_MAX, max(self.idle_poll, (now - self._last_activity) / 4))

    def _listen_pause(self, now: float) -> float:
        """The MPI thread's pause between probes for its listeners once idle
        (nothing in flight, nothing moved for ``idle_after``, no reply
        awaited): ``idle_poll`` at first, then a 32nd of the time since
        traffic, at most ``_LISTEN_MAX`` (or ``idle_poll``, if longer). A
        request reaching a rank quiet for a while waits at most a 32nd
        longer than that quiet lasted (a tensor produced meanwhile ends the
        pace at once: :meth:`touch`); each wake-up costs the thread 100-200
        µs of CPU on a virtual machine (the sleep's timer alone about 70), so
        an idle pace of 10 ms held a listening rank at about 2 % of a core."""
        longest = max(_LISTEN_MAX, self.idle_poll)
        if self._resting:
            return longest
        return min(longest, max(self.idle_poll, (now - self._last_activity) * _LISTEN_SHARE))

    def _run(self) -> None:
        pause = 0.0
        while True:
            with self._cv:
                if not self._inbox:
                    loop_polls = self._loop_polling and not self._stopping
                    if (loop_polls or not (self._reqs or self._listeners)) and not self._pipes:
                        if self._stopping and not self._reqs:
                            self._last_calls()
                            return
                        if loop_polls:  # the home loop polls: nothing to do here until work arrives
                            self._cv.wait()
                        else:
                            # Nothing in flight, nobody listening: MPI is still called (see
                            # _progress), ever less often; new work wakes the thread at once.
                            self._cv.wait(self._quiet_pause(time.monotonic()))
                    elif pause and (pause <= self.poll_max or self._idle):
                        # backing off (or idle), but woken by new work; an idle
                        # pause that a touch ended before it began is skipped
                        # (read under the lock touch notifies under)
                        self._cv.wait(pause)
                inbox, self._inbox = self._inbox, []
                stopping = self._stopping
                loop_polls = self._loop_polling and not stopping
            with self._plock:
                for op in inbox:
                    self._post(op, self._reqs, self._owners)
            moved = self._advance_pipes()
            with self._plock:
                if not loop_polls:
                    moved = self._poll(False) or moved
                collected = self._collect()
            self._hand_over(collected)
            now = time.monotonic()
            if moved or inbox:
                self._last_activity = now
            if moved:
                pause = 0.0  # poll again at once: more is likely to follow
                self._idle = self._resting = False
            else:
                # Listening with nothing in flight for a while (or told to rest): probe less often.
                idle = (not self._reqs and not self._pipes
                        and (self._resting or now - self._last_activity > self.idle_after)
                        and not any(w() for w in self._waiting))
                self._idle = idle
                pause = self._pause_after(pause, idle, now)
            if stopping:
                if self._listeners and not self._reqs and not self._pipes:
                    self._last_calls()
                    return
                if (self._reqs or self._pipes) and now > self._stop_deadline:
                    with self._plock:
                        self._cancel_all(self._reqs, self._owners)
                        collected = self._collect()
                    self._hand_over(collected)

    def _pause_after(self, pause: float, idle: bool, now: float) -> float:
        """The MPI thread's next pause after a poll that moved nothing.

        A large message in flight and nothing moved for ``_STALLED``: without
        a single-copy path (CMA), MPICH moves such a message through
        shared-memory cells, a few per poll on each side, so it moves only as
        fast as it is polled (an 8 MiB tensor took 190 ms at the usual pauses
        against 10-14 ms polled without them). No pause then (any sleep lasts
        at least the timer's slack, about 50 µs) until something moves. With a
        single copy (a peer in ``copied_peers``) the receiver moves such a
        message in one call and the sender only waits for it: neither counts
        it as large, and spinning here would take a core from the copy (on a
        machine with as many cores as ranks, the sender's spin made the
        ``make demo`` job's MPI steps slower than its gRPC ones).
        Otherwise each empty poll doubles the pause up to ``poll_max``, or
        the idle pace (:meth:`_listen_pause`)."""
        if self._large and not idle and now - self._last_activity > _STALLED:
            return 0.0
        return self._listen_pause(now) if idle else min(self.poll_max, max(self.poll_min, pause * 2))

    def _fail_one(self, reqs: list, owners: list[Op], exc: Any) -> list[int]:
        """Testsome reported an error: find the failing requests, fail only their ops."""
        MPI = self._MPI
        failed = []
        for i, req in enumerate(reqs):
            try:
                if req.Test():
                    failed.append(i)
            except MPI.Exception as one:
                owners[i].error = Internal(f"MPI {owners[i].kind} with rank {owners[i].peer} failed: "
                                           f"{one.Get_error_string()}")
                failed.append(i)
        log.warning("MPI error in progress engine: %s", exc.Get_error_string())
        return failed

    def _advance_pipes(self) -> bool:
        moved = False
        for op in list(self._pipes):
            pipe = op.pipeline
            moved = pipe.step() or moved
            if pipe.done:
                self._pipes.remove(op)
                self.in_flight -= 1
                op.pipeline = None
                op.loop.call_soon_threadsafe(resolve, op.awaited(), pipe.error, None)
        return moved

    def _cancel_all(self, reqs: list, owners: list[Op]) -> None:
        MPI = self._MPI
        for op in self._pipes:
            op.pipeline.cancel()
            self.in_flight -= 1
            op.loop.call_soon_threadsafe(resolve, op.awaited(), op.pipeline.error, None)
            op.pipeline = None
        self._pipes.clear()
        if not reqs:
            return
        log.warning("stopping MPI engine with %d transfers unfinished; cancelling them", len(reqs))
        for req, op in zip(reqs, owners):
            try:
                req.Cancel()
                req.Wait()
            except MPI.Exception:
                pass
            op.error = Unavailable("MPI engine stopped before the transfer finished")
            self._complete(op)
        reqs.clear()
        owners.clear()
