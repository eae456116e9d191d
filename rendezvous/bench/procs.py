"""The benchmarks' child processes: started, watched, timed out and stopped one way.

Every bench command measures in other processes: ``mpiexec`` jobs (the two
ranks of ``bench`` and ``bench-steps``, ``bench-daemon``'s daemon pair and
raw MPI ranks, ``bench-scale``'s ``grpc+mpi`` ranks), plain processes
(``rendezvousd``, ``bench-scale``'s ``grpc`` ranks) and spawned Python
workers (``bench-daemon``'s clients and echo server).

* :func:`mpiexec`: the launcher command;
* :class:`Child`: a process in a process group of its own (stopped as one,
  so mpiexec's ranks go with it), its stdout read line by line as it comes,
  the tail of its output kept for error messages;
* :func:`run`: a job to its end within a deadline, its lines handed over as
  they come; :func:`emit` and :func:`parse` are the result lines a child
  prints (a prefix, then JSON);
* :class:`ProcGroup`: every process of a run under one deadline: a wait fails
  at once when one of them dies, and :meth:`ProcGroup.close` stops them all;
* :class:`Worker` and :func:`serve`: a spawned Python process that runs
  commands sent over a pipe.

Children that no pipe reaches (mpiexec's ranks) talk to their parent over a
control socket: :mod:`rendezvous.bench.control`.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["mpiexec", "NO_MPIEXEC", "environ", "BenchError", "TimedOut", "Child", "Finished", "run", "emit", "parse",
           "ProcGroup", "Worker", "serve"]

NO_MPIEXEC = "no mpiexec found (pip install 'rendezvous[mpi]', or set RENDEZVOUS_MPIEXEC)"


def mpiexec() -> list[str] | None:
    """The launcher: ``RENDEZVOUS_MPIEXEC`` (split as a shell would), else the
    ``mpiexec`` next to this Python (the virtualenv's), else one on PATH."""
    custom = os.environ.get("RENDEZVOUS_MPIEXEC")
    if custom:
        return shlex.split(custom)
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    return [found] if found else None


def environ(drop: Iterable[str] = (), **values: str) -> dict[str, str]:
    """This process's environment for a child, less ``drop``, gRPC's core quiet
    (``GRPC_VERBOSITY=ERROR`` unless set), then ``values``."""
    env = {k: v for k, v in os.environ.items() if k not in set(drop)}
    env.setdefault("GRPC_VERBOSITY", "ERROR")
    env.update(values)
    return env


class BenchError(Exception):
    """The run cannot go on: a process failed, hung or answered wrongly."""


class TimedOut(BenchError):
    """A deadline passed."""


def emit(prefix: str, obj: Any) -> None:
    """Print one result line: ``prefix`` then ``obj`` as JSON (a child's side)."""
    sys.stdout.write(prefix + json.dumps(obj) + "\n")
    sys.stdout.flush()


def parse(line: str, prefix: str) -> Any:
    """What :func:`emit` printed on ``line``; None for any other line."""
    return json.loads(line[len(prefix):]) if line.startswith(prefix) else None


# -- one child --------------------------------------------------------------------------

class Child:
    """A child process, the leader of its own process group. Its stdout lines
    wait in a queue for :meth:`lines`, the tail of its stderr is kept; or, with
    ``log``, both go to that file (for a child that counts its own descriptors:
    they then point at a file, as a program's would, not at pipes)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None, *, log: Path | None = None,
                 service: bool = False) -> None:
        self.name = name
        #: a service must stay up until stopped: any exit is a failure (else only a non-zero one)
        self.service = service
        self.log = log
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._tail: collections.deque[str] = collections.deque()
        self._tail_chars = 0
        self._eof = log is not None
        self.p: subprocess.Popen[bytes] | subprocess.Popen[str]
        if log is not None:
            with open(log, "wb") as out:
                self.p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                                          start_new_session=True)
        else:
            self.p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, errors="replace", env=env, start_new_session=True)
            self._pump(self.p.stdout, self._queue.put, eof=True)
            self._pump(self.p.stderr, self._keep)
        self.pid = self.p.pid

    def _pump(self, stream: Any, put: Callable[[str], None], eof: bool = False) -> None:
        def pump() -> None:
            try:
                for line in stream:
                    put(line)
            except (OSError, ValueError):
                pass
            if eof:
                self._queue.put(None)

        threading.Thread(target=pump, name=f"{self.name} output", daemon=True).start()

    def _keep(self, line: str, limit: int = 1 << 16) -> None:
        self._tail.append(line)
        self._tail_chars += len(line)
        while self._tail_chars > limit and len(self._tail) > 1:
            self._tail_chars -= len(self._tail.popleft())

    def tail(self, n: int = 4000) -> str:
        """The last ``n`` characters of its stderr (of its log, with ``log``)."""
        if self.log is not None:
            try:
                return self.log.read_bytes()[-n:].decode(errors="replace")
            except OSError:
                return ""
        return "".join(list(self._tail))[-n:]

    def lines(self, deadline: float) -> Iterator[str]:
        """Its stdout lines as they come, until it closes its stdout (none with
        ``log``); :class:`TimedOut` once ``deadline`` (``time.monotonic()``) passes."""
        while not self._eof:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimedOut(f"{self.name}: no output within the deadline")
            try:
                line = self._queue.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                self._eof = True
                return
            yield line

    def line(self, prefix: str, timeout: float) -> str:
        """Its next stdout line that starts with ``prefix`` (the others are skipped)."""
        try:
            for line in self.lines(time.monotonic() + timeout):
                if line.startswith(prefix):
                    return line
        except TimedOut:
            raise BenchError(f"{self.name}: no {prefix!r} line within {timeout:g}s; stderr:\n{self.tail()}") from None
        raise BenchError(f"{self.name} exited with status {self.wait(5)} before printing {prefix!r}; "
                         f"stderr:\n{self.tail()}")

    def poll(self) -> int | None:
        return self.p.poll()

    def wait(self, timeout: float) -> int | None:
        """Its exit status, or None if it is still running after ``timeout`` seconds."""
        try:
            return self.p.wait(max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to its group, ``grace`` seconds to go, then :meth:`kill`."""
        if self.p.poll() is None:
            self._signal(signal.SIGTERM)
            self.wait(grace)
        self.kill()

    def kill(self) -> None:
        """SIGKILL to its whole group (mpiexec's ranks may outlive mpiexec), then reap it."""
        self._signal(signal.SIGKILL)
        self.wait(10)


@dataclass
class Finished:
    """How a job of :func:`run` ended."""

    code: int | None  # None: killed at the deadline
    timed_out: bool
    stdout: list[str] = field(default_factory=list)
    stderr: str = ""  # its tail


def run(name: str, argv: list[str], timeout: float, *, env: dict[str, str] | None = None,
        on_line: Callable[[str], None] | None = None) -> Finished:
    """Run a job to its end, handing each stdout line to ``on_line`` as it comes;
    its whole group is killed once ``timeout`` seconds have passed."""
    child = Child(name, argv, env)
    deadline = time.monotonic() + timeout
    out: list[str] = []
    try:
        for line in child.lines(deadline):
            out.append(line)
            if on_line is not None:
                on_line(line)
        code = child.wait(max(5.0, deadline - time.monotonic()))
    except TimedOut:
        code = None
    except BaseException:
        child.kill()
        raise
    if code is None:
        child.kill()
    return Finished(code, code is None, out, child.tail(1 << 16))


# -- every process of a run -------------------------------------------------------------

class ProcGroup:
    """The children and workers of one run, under one deadline; ``label``
    heads every error message about them."""

    def __init__(self, timeout: float, label: str = "") -> None:
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.label = label
        self.children: list[Child] = []
        self.workers: dict[str, Worker] = {}

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None, **kw: Any) -> Child:
        child = Child(name, argv, env, **kw)
        self.children.append(child)
        return child

    def worker(self, name: str, cls: type, title: str) -> Worker:
        """A spawned Python process running ``cls(conn, name)`` under :func:`serve`."""
        worker = self.workers[name] = Worker(self, name, cls, title)
        return worker

    def tails(self, n: int = 1500) -> str:
        return "".join(f"--- {c.name}:\n{c.tail(n)}" for c in self.children)

    def check(self) -> None:
        """Fail at once if a child is gone: a service at all, another with a non-zero status."""
        for child in self.children:
            code = child.poll()
            if code is not None and (child.service or code != 0):
                raise BenchError(f"{self.label}{child.name} exited with status {code}; output:\n{child.tail()}")

    def left(self, what: str, deadline: float | None = None) -> float:
        """Seconds left to wait for ``what``, within ``deadline`` and the run's own."""
        now = time.monotonic()
        if self.deadline <= now:
            raise TimedOut(f"{self.label}no {what} within --timeout {self.timeout:g}s\n{self.tails()}")
        if deadline is not None and deadline <= now:
            raise TimedOut(f"{self.label}no {what} in time\n{self.tails()}")
        return min(self.deadline, deadline if deadline is not None else self.deadline) - now

    def finish(self) -> None:
        """Wait for every child to exit on its own, with status 0, within the deadline."""
        for child in self.children:
            code = child.wait(max(1.0, self.deadline - time.monotonic()))
            if code is None:
                raise BenchError(f"{self.label}{child.name} did not exit\n{child.tail()}")
            if code != 0:
                raise BenchError(f"{self.label}{child.name} exited with status {code}\n{child.tail()}")

    def close(self) -> None:
        """Stop every worker, then every child (the last started first)."""
        for worker in self.workers.values():
            worker.ask_to_stop()
        for worker in self.workers.values():
            worker.end()
        for child in reversed(self.children):
            child.stop()


# -- spawned Python workers -------------------------------------------------------------

class Worker:
    """The parent's end of a spawned Python process that takes commands: tuples
    ``(op, *args)`` over a pipe, answered ``("ok", result)`` or ``("error", text)``."""

    def __init__(self, group: ProcGroup, name: str, cls: type, title: str) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.group = group
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, cls, name), name=title, daemon=True)
        quiet = "GRPC_VERBOSITY" not in os.environ  # read by gRPC in the child as it starts
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
        try:
            self.proc.start()
        finally:
            if quiet:
                os.environ.pop("GRPC_VERBOSITY", None)
        child.close()
        self.last = ""
        self.pid = self.call("pid", timeout=120)

    def post(self, *cmd: Any) -> None:
        self.last = str(cmd[0])
        try:
            self.conn.send(cmd)
        except (OSError, ValueError) as exc:
            raise BenchError(f"worker {self.name} is gone ({exc}); exit code {self.proc.exitcode}") from None

    def wait(self, timeout: float, expect: str = "ok") -> Any:
        """The answer to the command posted; fails if the run's processes fail meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            self.group.check()
            try:
                left = self.group.left(f"answer from worker {self.name} to {self.last!r}", deadline)
            except TimedOut:
                if time.monotonic() < self.group.deadline:
                    raise BenchError(f"worker {self.name} did not finish {self.last!r} within {timeout:.0f}s "
                                     "(a client or daemon hangs?)") from None
                raise
            try:
                ready = self.conn.poll(min(left, 0.5))
            except (OSError, EOFError):
                ready = True
            if ready:
                try:
                    kind, value = self.conn.recv()
                except (EOFError, OSError):
                    raise BenchError(f"worker {self.name} died during {self.last!r} "
                                     f"(exit code {self.proc.exitcode})") from None
                if kind == "error":
                    raise BenchError(f"worker {self.name}: {self.last} failed: {value}")
                if kind != expect:
                    raise BenchError(f"worker {self.name}: {self.last}: expected {expect!r}, got {kind!r}")
                return value
            if not self.proc.is_alive():
                raise BenchError(f"worker {self.name} died during {self.last!r} (exit code {self.proc.exitcode})")

    def call(self, *cmd: Any, timeout: float = 120.0) -> Any:
        self.post(*cmd)
        return self.wait(timeout)

    def ask_to_stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("stop",))
                if self.conn.poll(10):
                    self.conn.recv()
        except (OSError, EOFError, ValueError):
            pass

    def end(self) -> None:
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker_main(conn: Any, cls: type, name: str) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the workers
    worker = cls(conn, name)
    try:
        serve(conn, worker)
    finally:
        worker.close()


def serve(conn: Any, worker: Any) -> None:
    """A worker's loop: each command ``(op, *args)`` runs ``worker.op_<op>(*args)``;
    ``pid`` answers the process id, ``stop`` closes the worker and ends the loop."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        op, args = msg[0], msg[1:]
        if op == "stop":
            worker.close()
            conn.send(("ok", None))
            return
        try:
            result = os.getpid() if op == "pid" else getattr(worker, "op_" + op)(*args)
        except BaseException as exc:  # reported to the parent, which ends the run
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-4000:]}"))
        else:
            conn.send(("ok", result))
