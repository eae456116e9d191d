"""Running a server process until it is told to stop: ``rendezvous serve`` and
``rendezvousd`` share this.

The first SIGINT or SIGTERM starts a drain; the process exits 0 once it is
done. A second signal exits at once (status 1). A launcher that forwards a
signal the process also got directly (a whole process group signalled)
delivers the same signal twice at once: the same signal again within
``SAME_SIGNAL_S`` counts as one request.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from enum import Enum
from typing import Any

from .errors import RendezvousError

__all__ = ["run_until_signalled", "new_event_loop", "SAME_SIGNAL_S", "State"]

SAME_SIGNAL_S = 0.5


class State(Enum):
    """Where a server (a rank server, a daemon) is in its life; it only moves forward."""

    NEW = "new"
    STARTING = "starting"
    SERVING = "serving"
    STOPPING = "stopping"
    STOPPED = "stopped"

    @property
    def ending(self) -> bool:
        """Stopping or stopped: no new work is taken."""
        return self in (State.STOPPING, State.STOPPED)

    def __str__(self) -> str:
        return self.value


def new_event_loop(use_uvloop: bool = True) -> asyncio.AbstractEventLoop:
    """A uvloop loop when asked for and installed, else asyncio's default."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run_until_signalled(start: Callable[[], Awaitable[Any]], *, prog: str, announce: Callable[[Any], str],
                        stop: Callable[[Any], Coroutine[Any, Any, None]], uvloop: bool = True, out: Any = None,
                        before_exit: Callable[[Any], None] | None = None) -> int:
    """Run ``await start()`` (returns a started server with ``wait_for_termination``)
    on a fresh loop, print ``announce(server)`` once the signal handlers are in
    place (whoever reads that line may signal at once), drain with ``stop(server)``
    on the first signal. 0 after a clean drain; 1 on a start-up error (printed as
    ``prog: CODE: message``) or a second signal (after ``before_exit(server)``);
    a server with an ``exit_status`` (a daemon running a program) exits with it."""
    out = sys.stdout if out is None else out

    async def main() -> int:
        server = await start()
        loop = asyncio.get_running_loop()
        first: tuple[int, float] | None = None

        def on_signal(signum: int) -> None:
            nonlocal first
            if first is not None:
                if signum == first[0] and loop.time() - first[1] < SAME_SIGNAL_S:
                    return
                if before_exit is not None:
                    before_exit(server)
                sys.stderr.write(f"{prog}: second signal ({signal.Signals(signum).name}), exiting now\n")
                sys.stderr.flush()
                os._exit(1)
            first = (signum, loop.time())
            loop.create_task(stop(server))

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        out.write(announce(server) + "\n")
        out.flush()
        await server.wait_for_termination()
        return int(getattr(server, "exit_status", 0))

    loop = new_event_loop(uvloop)
    try:
        return loop.run_until_complete(main())
    except RendezvousError as exc:
        print(f"{prog}: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 1
    finally:
        loop.close()
