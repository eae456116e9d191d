"""A timeline of what waited on what: every send and recv of a rank as trace events.

With the ``timeline`` setting (``RENDEZVOUS_TIMELINE=/tmp/tl/{job_name}-{task_index}.json``)
a rank server writes one file of Chrome trace events, which Perfetto
(ui.perfetto.dev) and chrome://tracing open. :func:`merge` joins the files of
a job into one, so that every rank shows in one view.

**The file.** The Trace Event Format's JSON array form: ``[`` then one event
per line, every line but the last ending in ``,``; a clean stop writes the
closing ``]``, so the file is then plain JSON. A process that dies
leaves the array open: Perfetto and chrome://tracing accept an array form
without its ``]`` (the format says the bracket is optional, for exactly
this), and :func:`read_trace` reads such a file the same way: every complete
event up to the end, a partial last line ignored. What such a process had
not written yet (at most a second's events, or ``flush_events``) is lost. The object form
(``{"traceEvents": [...], "displayTimeUnit": ...}``) is not used: cut short,
it is not a trace any viewer opens. Timestamps are therefore in the format's
own unit, microseconds.

**The clock.** ``time.perf_counter_ns`` (CLOCK_MONOTONIC on Linux), moved by
one reading of the wall clock at open so that every process counts from the
same origin, the Unix epoch: ranks on one machine line up to the
microsecond, ranks on different machines as well as their clocks agree
(NTP). Times are written as whole microseconds (a span's ``ts`` and ``dur``
rounded down from the same nanosecond readings, so that what nests in
nanoseconds still nests).

**Processes and lanes.** ``pid`` is the task's place in the cluster, from 1
(Perfetto treats pid 0 as the kernel's idle task), named after the task
(``/job:worker/replica:0/task:1``). Each ``tid`` is a lane: ``recv from
TASK`` (one per producer; ``recv (local)`` for this rank's own keys),
``serve to TASK`` (one per consumer), ``send``. Recvs that overlap in time
take further lanes of their group (``#2``, ``#3``, ...), so the spans of a
lane always nest. Lane ids are ``pid * 100000 + n``: unique in a merged
trace.

**Events.**

* ``recv NAME`` (``X``, category ``recv``): the whole call, with ``args``
  ``key``, ``step_id``, ``peer`` (the producing task), ``path`` (``local``,
  ``grpc``, ``mpi``), ``bytes``, ``outcome`` (``ok``, ``dead``, or the error's
  status code, with ``error``: its message; the name then ends with the code).
  Inside it, as ``X`` events of category ``phase`` on the same lane:
  ``wait`` (from the call until the producer's answer came: the request, the
  producer's wait for the tensor, and an inline reply's bytes; for a local
  recv, the wait in the table; the whole call when nothing came),
  ``transfer PATH`` (from the answer until the bytes were all here: chunks
  of a large reply, or the MPI receive of a descriptor's bytes), and
  ``place`` (a copy between host and GPU).
* ``serve NAME`` (``X``, category ``serve``, on the producer): from the
  consumer's request arriving until its reply was planned (the MPI send
  posted, or the frames ready to write), with ``key``, ``step_id``, ``peer``
  (the consuming task), ``path`` (the plane of the reply: ``grpc`` for a reply
  inside the frames, ``mpi`` for a descriptor), ``bytes``, ``outcome``; a
  ``wait`` phase inside it while the tensor was not produced yet.
* ``send NAME`` (``i``, an instant, category ``send``): a tensor produced, with
  ``key``, ``step_id``, ``peer`` (the consuming task), ``bytes``, ``dead``,
  ``outcome``.

**One file per rank, made safely, bounded.** :meth:`Timeline.for_task`
refuses a template that names one file for two tasks of the cluster (a
template without ``{task_index}``, or without ``{job_name}`` when several jobs
have a task of that index): ranks would take one file from each other. The
file is always made new, never opened through a link planted at its path,
held with a lock while written (a second timeline on a file in use, another
job's, is refused), and grows to ``max_bytes`` (the ``timeline_max_bytes``
setting) at most, ending then with a last event, ``timeline cut``, and its
closing bracket: see :mod:`rendezvous.trace_file`.

**Never an error for a send or a recv.** Recording is called after the state
changed (a tensor put into the table, a tensor taken for a recv): nothing in
it raises. A write that fails (a full disk) ends the file there and logs one
warning; what was not written is counted (:attr:`Timeline.lost`), and so are
failures (:attr:`Timeline.failures`).

**Cost.** Off, a server holds no timeline (``None``) and every place that
records checks that and nothing else (the traced forms of the table, the
planes, the servicer's ``take`` and the receiver's ``fetch`` are only put in
place when it is on). On, an event's JSON text is made when it ends and
appended to a list; the list is written in one ``write`` when it holds
``flush_events`` events, ``flush_interval`` seconds after the first event
buffered since the last write (a timer on the loop), and at ``close``. The
file is opened once. Everything runs on the server's event loop thread.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import os
import socket
import time
from typing import Any

from .cluster import ClusterSpec
from .errors import InvalidArgument, RendezvousError
from .keys import Key, TaskName, as_key
from .paths import Path
from .stats import payload_nbytes
from .table import WaitingTable
from .items import Received
from .trace_file import TraceFile, merge, read_trace
from .transport import Arrival, Fetched, Planes, Reply

__all__ = ["Timeline", "RecvSpan", "TracedTable", "TracedPlanes", "timeline_path", "read_trace", "merge",
           "CLOCK"]

now = time.perf_counter_ns
CLOCK = ("microseconds since the Unix epoch: time.perf_counter_ns (CLOCK_MONOTONIC) plus the wall clock "
         "read once when the file was opened; ranks on one machine line up to the microsecond, on different "
         "machines as well as their clocks agree")
#: lane ids: pid * LANES + n, so that every lane of a merged trace is its own
LANES = 100_000
#: keys whose names and JSON a timeline keeps, for the recvs and for the sends and serves
KEYS = 4096
#: the largest a file grows by default (the ``timeline_max_bytes`` setting)
MAX_BYTES = 1 << 30
log = logging.getLogger("rendezvous")
_dumps = json.JSONEncoder(separators=(",", ":")).encode
_string = json.encoder.encode_basestring_ascii


def timeline_path(template: str, task: TaskName) -> str:
    """The file ``template`` names for ``task`` (``{task_index}``, ``{job_name}`` replaced)."""
    return template.replace("{task_index}", str(task.task)).replace("{job_name}", task.job)


class RecvSpan:
    """What one recv saw, filled in as it goes (nanoseconds of :data:`now`)."""

    __slots__ = ("start", "answered", "moving", "got", "placing", "kept")

    def __init__(self, start: int) -> None:
        self.start = start
        self.answered: int | None = None  # the producer's answer (or the table's tensor) came
        self.moving = False  # the answer's bytes came after it (chunks, or another way: MPI)
        self.got: int | None = None  # the bytes were all here
        self.placing: tuple[int, int] | None = None  # a copy between host and GPU
        self.kept = False  # a tensor fetched before and kept for this recv


class _Serving:
    """A request whose tensor was taken and whose reply is not planned yet."""

    __slots__ = ("request", "key", "nbytes", "dead", "start", "taken")

    def __init__(self, request: Any, key: str, item: Received, start: int, taken: int) -> None:
        self.request = request
        self.key = key
        self.nbytes = payload_nbytes(item.value)
        self.dead = item.is_dead
        self.start = start
        self.taken = taken


class Timeline:
    """One rank's timeline file. Use on the server's event loop thread only."""

    def __init__(self, path: str, task: TaskName, pid: int, *, flush_events: int = 1024,
                 flush_interval: float = 1.0, max_bytes: int = MAX_BYTES) -> None:
        self.path = path
        self.task = task
        self.pid = pid
        self.flush_events = flush_events
        self.flush_interval = flush_interval
        self._closed = False
        #: events that could not be recorded (a bug's exception, logged once)
        self._unrecorded = 0
        #: added to now() to count from the Unix epoch
        self._offset = time.time_ns() - now()
        self._events: list[str] = []
        self._timer: asyncio.TimerHandle | None = None
        #: the lanes of each group (``recv from TASK``), as a heap of (last span's end, lane id)
        self._groups: dict[str, list[tuple[int, int]]] = {}
        self._next_lane = 1
        self._serving: _Serving | None = None
        self._watched: dict[int, tuple[Any, RecvSpan]] = {}
        self._recv_keys: dict[Key | str, tuple[str, str, str]] = {}
        self._produced_keys: dict[str, tuple[str, str, str]] = {}
        self._send_tid, lane = self._new_lane("send")
        started = (f',"args":{{"task":{_string(str(task))},"host":{_string(socket.gethostname())},'
                   f'"os_pid":{os.getpid()},"clock":{_string(CLOCK)}}}')
        head = [self._meta("process_name", pid * LANES, "name", str(task)),
                self._meta("process_sort_index", pid * LANES, "sort_index", pid),
                *lane, self._instant("timeline started", "timeline", self._send_tid, now(), started)]
        self._out = TraceFile(path, "[\n" + ",\n".join(head), max_bytes, self._cut_event)

    @classmethod
    def for_task(cls, template: str, cluster: ClusterSpec, task: TaskName, **kwargs: Any) -> "Timeline":
        """The timeline of ``task`` (in ``cluster``), in the file ``template`` names
        for it. InvalidArgument if that is the file of another task of the
        cluster too: each rank writes its own."""
        path = timeline_path(template, task)
        pid = 0
        sharing: list[TaskName] = []
        for i, t in enumerate(cluster.tasks(), 1):
            if t == task:
                pid = i
            elif timeline_path(template, t) == path:
                sharing.append(t)
        if sharing:
            more = f" (and {len(sharing) - 1} more)" if len(sharing) > 1 else ""
            raise InvalidArgument(
                f"the timeline template {template!r} names one file, {path!r}, for {task} and {sharing[0]}{more}: "
                "put {task_index} in it (and {job_name}, when the cluster has several jobs), so that each rank "
                "writes its own")
        if not pid:
            raise InvalidArgument(f"the timeline's task {task} is not in the cluster")
        return cls(path, task, pid, **kwargs)

    # -- writing ------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def lost(self) -> int:
        """Events not written: past the file's cap, after a write that failed, or
        that could not be recorded."""
        return self._out.lost + self._unrecorded

    @property
    def failures(self) -> int:
        """Writes that failed, and events that could not be recorded."""
        return self._out.failures + self._unrecorded

    @property
    def ended(self) -> str | None:
        """Why the file ended before the timeline closed (its cap, a failed write), or None."""
        return self._out.ended

    def _add(self, event: str) -> None:
        """Buffer one event (its JSON text)."""
        if not self._out.writing:
            if not self._closed:
                self._out.lost += 1  # the file ended (its cap, a failed write)
            return  # or closed: the server stopped; a late recv's end goes nowhere
        events = self._events
        events.append(event)
        if len(events) >= self.flush_events:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # no loop: written at the next flush
            self._timer = loop.call_later(self.flush_interval, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self.flush()

    def flush(self) -> None:
        """Write what is buffered, in one write."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        events, self._events = self._events, []
        if events:
            self._out.write(events)

    def close(self) -> None:
        """Write the rest and the closing bracket: the file is then plain JSON.
        Idempotent; never raises."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._out.close()
        self._watched.clear()
        self._serving = None

    def _cut_event(self, left: int) -> str:
        """The last event of a file that reached its cap (``left`` events of the
        batch did not fit)."""
        args = (f',"args":{{"max_bytes":{self._out.max_bytes},"events_not_written":{left},'
                '"why":"the file reached its cap (timeline_max_bytes): later events are not written"}')
        return self._instant("timeline cut", "timeline", self._send_tid, now(), args)

    def _unrecordable(self, what: str, exc: BaseException) -> None:
        """An event could not be recorded (a bug): counted, the first one logged."""
        self._unrecorded += 1
        if self._unrecorded == 1:
            log.warning("timeline %s: could not record %s (later failures are only counted)", self.path, what,
                        exc_info=exc)

    def _span(self, name: str, cat: str, tid: int, start: int, end: int, args: str = "") -> None:
        """A complete event (``X``) from ``start`` to ``end``; ``args``: its
        ``,"args":{...}`` text, if any."""
        offset = self._offset
        ts = (start + offset) // 1000
        self._add(f'{{"ph":"X","name":{_string(name)},"cat":"{cat}","pid":{self.pid},"tid":{tid},'
                  f'"ts":{ts},"dur":{(end + offset) // 1000 - ts}{args}}}')

    def _instant(self, name: str, cat: str, tid: int, at: int, args: str = "") -> str:
        return (f'{{"ph":"i","name":{_string(name)},"cat":"{cat}","pid":{self.pid},"tid":{tid},'
                f'"ts":{(at + self._offset) // 1000},"s":"t"{args}}}')

    def _meta(self, name: str, tid: int, key: str, value: Any) -> str:
        return f'{{"ph":"M","name":"{name}","pid":{self.pid},"tid":{tid},"args":{{"{key}":{_dumps(value)}}}}}'

    # -- lanes ----------------------------------------------------------------

    def _lane(self, group_name: str, start: int, end: int) -> int:
        """A lane of ``group_name`` free from ``start`` on, taken until ``end`` (now).
        Spans are written when they end, so every span already on a lane whose
        last one ended by ``start`` ended before this one began."""
        lanes = self._groups.get(group_name)
        if lanes is None:
            lanes = self._groups[group_name] = []
        if lanes and lanes[0][0] <= start:
            tid = lanes[0][1]
            heapq.heapreplace(lanes, (end, tid))
            return tid
        tid, named = self._new_lane(group_name if not lanes else f"{group_name} #{len(lanes) + 1}")
        heapq.heappush(lanes, (end, tid))
        for event in named:
            self._add(event)
        return tid

    def _new_lane(self, name: str) -> tuple[int, list[str]]:
        """A new lane's id and the events that name it."""
        tid = self.pid * LANES + self._next_lane
        self._next_lane += 1
        return tid, [self._meta("thread_name", tid, "name", name), self._meta("thread_sort_index", tid, "sort_index", tid)]

    # -- recv ---------------------------------------------------------------

    def watch(self, span: RecvSpan, placement: Any) -> None:
        """``span``'s remote recv asks for its tensor with ``placement``, an object
        of its own (a copy of the placement it resolved): when the data planes
        receive the producer's answer for that placement (:class:`TracedPlanes`),
        the span's ``answered`` is set. Until :meth:`unwatch`."""
        self._watched[id(placement)] = (placement, span)

    def unwatch(self, placement: Any) -> None:
        self._watched.pop(id(placement), None)

    def answered(self, placement: Any, at: int, moving: bool) -> None:
        """The producer's answer for the recv bound for ``placement`` came ``at``;
        ``moving``: its bytes come after it."""
        found = self._watched.get(id(placement))
        if found is not None and found[0] is placement:
            span = found[1]
            span.answered = at
            span.moving = moving

    def recv_done(self, span: RecvSpan, key: Key | str, step_id: int, fetched: Fetched | None = None,
                  error: BaseException | None = None) -> None:
        """The recv of ``span`` (of ``key``, as the caller gave it) ended: with
        ``fetched``, or with ``error``. Nothing is recorded if ``key`` is not one
        (no recv happened). Never raises."""
        try:
            self._recv_done(span, key, step_id, fetched, error)
        except RendezvousError:
            pass  # not a key
        except Exception as exc:
            self._unrecordable("a recv", exc)

    def _recv_done(self, span: RecvSpan, key: Key | str, step_id: int, fetched: Fetched | None,
                   error: BaseException | None) -> None:
        end = now()
        start = span.start
        group, name, head = self._recv_key(key)
        tid = self._lane(group, start, end)
        path = ""
        if fetched is not None:
            path = str(fetched.path)
            item = fetched.item
            kept = ',"kept":true' if span.kept else ""
            how = (f'"path":"{path}","bytes":{payload_nbytes(item.value)},'
                   f'"outcome":"{"dead" if item.is_dead else "ok"}"{kept}}}')
        else:
            name, how = _failed(name, error)
        self._span(name, "recv", tid, start, end, f'{head},"step_id":{step_id},{how}')
        answered = span.answered if span.answered is not None else span.got
        wait_end = end if answered is None else answered
        if wait_end > start:
            self._span("wait", "phase", tid, start, wait_end)
        if span.moving and span.answered is not None and span.got is not None and span.got > span.answered:
            self._span(f"transfer {path or 'remote'}", "phase", tid, span.answered, span.got)
        if span.placing is not None:
            self._span("place", "phase", tid, span.placing[0], span.placing[1])

    def _recv_key(self, key: Key | str) -> tuple[str, str, str]:
        """(lane group, span name, the args' start) of the recvs of ``key``: made
        once per key (keys repeat every step), at most :data:`KEYS` kept."""
        found = self._recv_keys.get(key)
        if found is None:
            k = as_key(key)
            src = k.src_task
            peer = str(src or self.task)
            group = "recv (local)" if src is None or src == self.task else f"recv from {peer}"
            found = (group, f"recv {k.name}", f',"args":{{"key":{_string(k.format())},"peer":{_string(peer)}')
            if len(self._recv_keys) >= KEYS:
                self._recv_keys.clear()
            self._recv_keys[key] = found
        return found

    def _produced_key(self, key: str) -> tuple[str, str, str]:
        """(tensor name, ``serve to`` lane group, the args' start) of sends and
        serves of the canonical ``key``, made once per key like :meth:`_recv_key`."""
        found = self._produced_keys.get(key)
        if found is None:
            name, consumer = _name_and_consumer(key)
            found = (name, f"serve to {consumer}", f',"args":{{"key":{_string(key)},"peer":{_string(consumer)}')
            if len(self._produced_keys) >= KEYS:
                self._produced_keys.clear()
            self._produced_keys[key] = found
        return found

    # -- serve --------------------------------------------------------------

    def taken(self, request: Any, key: str, item: Received, start: int | None) -> None:
        """The tensor for ``request`` (from a consumer) was taken from the table; its
        reply is planned next, in the same turn of the loop (:meth:`served`).
        ``start``: when the request began to wait (None: it did not)."""
        taken = now()
        try:
            self._serving = _Serving(request, key, item, taken if start is None else start, taken)
        except Exception as exc:
            self._serving = None
            self._unrecordable("a reply served", exc)

    def served(self, request: Any, path: Path | None, error: BaseException | None = None) -> None:
        """The reply to ``request`` was planned (on ``path``), or failed with ``error``."""
        serving, self._serving = self._serving, None
        if serving is None or serving.request is not request:
            return
        try:
            if error is None:
                how = f'"path":"{path}","bytes":{serving.nbytes},"outcome":"{"dead" if serving.dead else "ok"}"}}'
                self._serve_span(serving.start, serving.key, request.step_id, serving.taken, "", how)
            else:
                self._serve_span(serving.start, serving.key, request.step_id, serving.taken, *_failed("", error))
        except Exception as exc:
            self._unrecordable("a reply served", exc)

    def serve_failed(self, request: Any, start: int, error: BaseException) -> None:
        """``request`` ended without a tensor (cancelled, aborted, refused)."""
        try:
            self._serve_span(start, request.rendezvous_key, request.step_id, None, *_failed("", error))
        except Exception as exc:
            self._unrecordable("a reply served", exc)

    def _serve_span(self, start: int, key: str, step_id: int, taken: int | None, suffix: str, how: str) -> None:
        end = now()
        name, group, head = self._produced_key(key)
        tid = self._lane(group, start, end)
        self._span(f"serve {name}{suffix}", "serve", tid, start, end, f'{head},"step_id":{step_id},{how}')
        wait_end = end if taken is None else taken
        if wait_end > start:
            self._span("wait", "phase", tid, start, wait_end)

    # -- send ---------------------------------------------------------------

    def sent(self, key: Any, step_id: int, value: Any, is_dead: bool, error: BaseException | None = None) -> None:
        """A tensor was produced under ``key`` (or refused with ``error``). Never raises."""
        try:
            name, _, head = self._produced_key(str(key))
            if error is None:
                name, how = f"send {name}", '"outcome":"ok"}'
            else:
                name, how = _failed(f"send {name}", error)
            args = (f'{head},"step_id":{step_id},"bytes":{0 if is_dead else payload_nbytes(value)},'
                    f'"dead":{"true" if is_dead else "false"},{how}')
            self._add(self._instant(name, "send", self._send_tid, now(), args))
        except Exception as exc:
            self._unrecordable("a send", exc)


def _failed(name: str, error: BaseException | None) -> tuple[str, str]:
    """A failed event's name (``name: CODE``) and the end of its args (outcome, error),
    marked red for chrome://tracing."""
    code = _code(error)
    return f"{name}: {code}", f'"outcome":"{code}","error":{_string(_message(error))}}},"cname":"terrible"'


def _name_and_consumer(key: str) -> tuple[str, str]:
    """The tensor's name in the canonical ``key`` and the task of its
    ``dst_device`` ("?" where the key does not name one)."""
    parts = key.split(";")
    if len(parts) != 5:
        return key, "?"
    device = parts[2]
    cut = device.find("/device:")
    task = device[:cut] if cut >= 0 else device.rpartition("/")[0]
    return parts[3], task if task.startswith("/job:") else "?"


def _code(error: BaseException | None) -> str:
    if isinstance(error, RendezvousError):
        return error.code.name
    if isinstance(error, asyncio.CancelledError):
        return "CANCELLED"
    return type(error).__name__


def _message(error: BaseException | None) -> str:
    if isinstance(error, RendezvousError):
        return error.message[:500]
    if isinstance(error, asyncio.CancelledError):
        return "cancelled: the caller gave up, or its stream or server ended"
    return str(error)[:500]


class TracedTable(WaitingTable):
    """The waiting table of a server with a timeline: every send is recorded
    (the aio server's, the blocking server's through the loop, a daemon's)."""

    def __init__(self, timeline: Timeline, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.timeline = timeline

    def send(self, step_id: int, key: Any, value: Any, is_dead: bool = False) -> None:
        try:
            super().send(step_id, key, value, is_dead)
        except RendezvousError as exc:
            self.timeline.sent(key, step_id, value, is_dead, exc)
            raise
        self.timeline.sent(key, step_id, value, is_dead)


class TracedPlanes(Planes):
    """The data planes of a server with a timeline: a reply planned ends its serve
    span, and a reply's first frame received marks its recv answered."""

    def __init__(self, planes: Any, timeline: Timeline) -> None:
        super().__init__(planes)
        self.timeline = timeline

    def plan(self, request: Any, item: Received) -> Reply:
        try:
            reply = super().plan(request, item)
        except BaseException as exc:
            self.timeline.served(request, None, exc)
            raise
        self.timeline.served(request, reply.path)
        return reply

    traced = True

    def answered(self, placements: list[Any], moving: bool) -> None:
        at = now()
        for placement in placements:
            self.timeline.answered(placement, at, moving)

    def receive(self, reply: bytes, head: Any, placement: Any) -> Arrival:
        if placement is None:  # a reply nobody waits for any more
            return super().receive(reply, head, placement)
        at = now()
        arrival = super().receive(reply, head, placement)
        self.timeline.answered(placement, at, arrival.value is None)
        return arrival
