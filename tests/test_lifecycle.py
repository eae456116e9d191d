"""The signal-driven run loop shared by ``rendezvous serve`` and ``rendezvousd``
(rendezvous/lifecycle.py): announce, drain on the first signal, exit at once on
a second one, one request for the same signal delivered twice.

Signal tests run ``run_until_signalled`` in a child process whose ``stop`` blocks
until the test writes a line to its stdin, so nothing depends on timing. The
child is single-threaded (stdin is read on its event loop), so signals reach it
in the order they are sent; after a signal whose effect is silent the test sends
SIGWINCH, which the child answers with a line, to know the earlier signal was
handled. The child runs in a session of its own, so that a terminal's
SIGWINCH (a window resized while the suite runs) never adds a line: once in
CI the child answered one probe twice.
"""

from __future__ import annotations

import io
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rendezvous import lifecycle
from rendezvous.errors import Unavailable

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 20.0

CHILD = textwrap.dedent("""
    import asyncio, signal, sys
    from rendezvous import lifecycle
    from rendezvous.errors import Unavailable

    use_uvloop = sys.argv[1] == "1"
    if sys.argv[2] != "default":
        lifecycle.SAME_SIGNAL_S = float(sys.argv[2])
    fail = sys.argv[3] == "fail"

    def say(text):
        sys.stdout.write(text + "\\n")
        sys.stdout.flush()

    class FakeServer:
        def __init__(self, reader):
            self.done = asyncio.Event()
            self.reader = reader

        async def wait_for_termination(self):
            await self.done.wait()
            say("terminated")

    async def start():
        if fail:
            raise Unavailable("port 4321 is taken")
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        loop.add_signal_handler(signal.SIGWINCH, say, "winch")  # the test's probe
        return FakeServer(reader)

    async def stop(server):
        say("stop-begin")
        line = await server.reader.readline()  # blocks until the test says so
        say("stop-end " + line.decode().strip())
        server.done.set()

    def before_exit(server):
        say("before-exit")

    rc = lifecycle.run_until_signalled(start, prog="fakeprog", announce=lambda s: "ANNOUNCE ready",
                                       stop=stop, uvloop=use_uvloop, before_exit=before_exit)
    say(f"returned {rc}")
    sys.exit(rc)
""")


class Child:
    """The child process, its stdout read line by line with deadlines."""

    def __init__(self, *, uvloop: bool = True, same_signal_s: str = "default", fail: bool = False) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, "1" if uvloop else "0", same_signal_s, "fail" if fail else "ok"],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, bufsize=1,
            # a session of its own: no terminal's signals (a resize's SIGWINCH to the
            # foreground process group) reach it, only the test's
            start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self.stderr = ""
        self._out = threading.Thread(target=self._pump, daemon=True)
        self._out.start()
        self._err = threading.Thread(target=self._drain_stderr, daemon=True)
        self._err.start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _drain_stderr(self) -> None:
        self.stderr = self.proc.stderr.read()

    def expect(self, wanted: str, timeout: float = WAIT_S) -> None:
        """Wait for the next stdout line to be ``wanted`` (fail on anything else)."""
        deadline = time.monotonic() + timeout
        try:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no line {wanted!r} within {timeout}s; seen {self.seen}") from None
        if line is None:
            self.proc.wait(WAIT_S)
            self._err.join(WAIT_S)
            raise AssertionError(f"child exited ({self.proc.returncode}) before printing {wanted!r}; "
                                 f"seen {self.seen}; stderr: {self.stderr}")
        self.seen.append(line)
        assert line == wanted, f"expected {wanted!r}, got {line!r} (seen {self.seen})"

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def release_stop(self, word: str = "go") -> None:
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def finish(self) -> tuple[int, list[str], str]:
        """(exit status, the stdout lines not yet expected, stderr)."""
        rc = self.proc.wait(WAIT_S)
        self._out.join(WAIT_S)
        self._err.join(WAIT_S)
        rest = []
        while True:
            line = self.lines.get_nowait()
            if line is None:
                break
            rest.append(line)
        return rc, rest, self.stderr

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(WAIT_S)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                stream.close()
            except OSError:
                pass


@pytest.fixture
def child_factory():
    children: list[Child] = []

    def make(**kwargs) -> Child:
        c = Child(**kwargs)
        children.append(c)
        return c

    yield make
    for c in children:
        c.kill()


# --- in a child process -------------------------------------------------------------------

@pytest.mark.parametrize("uvloop", [True, False], ids=["uvloop", "asyncio"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_first_signal_drains_and_exits_zero(child_factory, uvloop, signum):
    child = child_factory(uvloop=uvloop)
    child.expect("ANNOUNCE ready")
    # the announce line comes after the handlers: signalling at once must not kill the process
    child.signal(signum)
    child.expect("stop-begin")
    child.signal(signal.SIGWINCH)
    child.expect("winch")  # the loop still runs; stop is awaiting the test
    assert child.proc.poll() is None
    child.release_stop("drained")
    child.expect("stop-end drained")
    child.expect("terminated")
    child.expect("returned 0")
    rc, rest, err = child.finish()
    assert rc == 0
    assert rest == []  # before_exit is not called after a clean drain
    assert "second signal" not in err


@pytest.mark.parametrize("first,second", [(signal.SIGTERM, signal.SIGINT), (signal.SIGINT, signal.SIGTERM)],
                         ids=["TERM-then-INT", "INT-then-TERM"])
@pytest.mark.parametrize("uvloop", [True, False], ids=["uvloop", "asyncio"])
def test_second_different_signal_exits_at_once(child_factory, uvloop, first, second):
    child = child_factory(uvloop=uvloop)
    child.expect("ANNOUNCE ready")
    child.signal(first)
    child.expect("stop-begin")
    child.signal(second)  # stop is still blocked: nothing but the second signal can end the process
    child.expect("before-exit")
    rc, rest, err = child.finish()
    assert rc == 1
    assert rest == []  # neither the rest of the drain nor run_until_signalled's return ran
    assert f"fakeprog: second signal ({second.name}), exiting now\n" in err


@pytest.mark.parametrize("uvloop", [True, False], ids=["uvloop", "asyncio"])
def test_same_signal_within_window_counts_as_one(child_factory, uvloop):
    # A window no machine can overrun, so the test does not depend on scheduling.
    child = child_factory(uvloop=uvloop, same_signal_s="600")
    child.expect("ANNOUNCE ready")
    child.signal(signal.SIGTERM)
    child.expect("stop-begin")
    child.signal(signal.SIGTERM)
    child.signal(signal.SIGWINCH)
    child.expect("winch")  # delivered after the second SIGTERM: that one was handled, and ignored
    assert child.proc.poll() is None
    child.release_stop()
    child.expect("stop-end go")
    child.expect("terminated")
    child.expect("returned 0")
    rc, rest, err = child.finish()
    assert rc == 0 and rest == []
    assert "second signal" not in err


def test_default_window_is_half_a_second():
    assert lifecycle.SAME_SIGNAL_S == 0.5


def test_same_signal_after_window_is_a_second_signal(child_factory):
    child = child_factory(same_signal_s="0")  # every repeat falls outside the window
    child.expect("ANNOUNCE ready")
    child.signal(signal.SIGTERM)
    child.expect("stop-begin")
    child.signal(signal.SIGTERM)
    child.expect("before-exit")
    rc, rest, err = child.finish()
    assert rc == 1 and rest == []
    assert "fakeprog: second signal (SIGTERM), exiting now" in err


def test_start_error_in_child_prints_code_and_exits_one(child_factory):
    child = child_factory(fail=True)
    child.expect("returned 1")
    rc, rest, err = child.finish()
    assert rc == 1 and rest == []
    assert err == "fakeprog: UNAVAILABLE: port 4321 is taken\n"


# --- in this process (no signals are sent) --------------------------------------------------

@pytest.fixture
def keep_signal_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


class _Server:
    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error
        self.waited = 0

    async def wait_for_termination(self) -> None:
        self.waited += 1
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize("uvloop", [True, False], ids=["uvloop", "asyncio"])
def test_start_error_returns_one_with_message(capsys, keep_signal_handlers, uvloop):
    stopped = []

    async def start():
        raise Unavailable("address 127.0.0.1:1 is in use")

    async def stop(server):
        stopped.append(server)

    out = io.StringIO()
    rc = lifecycle.run_until_signalled(start, prog="myprog", announce=lambda s: "never", stop=stop,
                                       uvloop=uvloop, out=out, before_exit=stopped.append)
    assert rc == 1
    assert capsys.readouterr().err == "myprog: UNAVAILABLE: address 127.0.0.1:1 is in use\n"
    assert out.getvalue() == ""  # no announce before a successful start
    assert stopped == []


def test_announce_goes_to_out_and_termination_returns_zero(capsys, keep_signal_handlers):
    server = _Server()
    stopped = []

    async def start():
        return server

    async def stop(s):
        stopped.append(s)

    out = io.StringIO()
    rc = lifecycle.run_until_signalled(start, prog="p", announce=lambda s: f"serving {s.waited}", stop=stop,
                                       uvloop=False, out=out)
    assert rc == 0
    assert out.getvalue() == "serving 0\n"  # announced before waiting
    assert server.waited == 1
    assert stopped == []  # no signal, no drain
    assert capsys.readouterr().err == ""


def test_error_while_serving_returns_one(capsys, keep_signal_handlers):
    server = _Server(error=Unavailable("lost the port"))

    async def start():
        return server

    async def stop(s):
        raise AssertionError("stop must not be called")

    out = io.StringIO()
    rc = lifecycle.run_until_signalled(start, prog="p", announce=lambda s: "up", stop=stop, uvloop=False, out=out)
    assert rc == 1
    assert out.getvalue() == "up\n"
    assert capsys.readouterr().err == "p: UNAVAILABLE: lost the port\n"


def test_other_errors_propagate(keep_signal_handlers):
    async def start():
        raise RuntimeError("not a RendezvousError")

    async def stop(s):
        pass

    with pytest.raises(RuntimeError, match="not a RendezvousError"):
        lifecycle.run_until_signalled(start, prog="p", announce=str, stop=stop, uvloop=False, out=io.StringIO())
