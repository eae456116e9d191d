"""``rendezvousd [flags] -- COMMAND [ARGS...]``: a daemon that lives as long as one program.

The daemon starts, and once it serves, runs COMMAND with
``RENDEZVOUS_LOCAL_ADDRESS`` set to its local address (so a
``rendezvous.client.Client()`` there finds it). When COMMAND exits, the
daemon drains (its produced tensors still served for the grace, as on
SIGTERM) and exits with COMMAND's status. COMMAND gets none of the
launcher's MPI variables (it is not a rank of the daemons' job), and dies
with the daemon if the daemon is killed. Under ``mpiexec -n N -ppn 1
rendezvousd ... -- python train.py`` every node runs one daemon and its
trainer, and the launcher returns when all trainers are done, which is what a
batch job (an MPIJob, a Slurm step) needs to complete. A SIGINT or SIGTERM
to the daemon is passed on to COMMAND as SIGTERM, and the daemon drains once
COMMAND has exited; a second signal kills COMMAND and exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Sequence
from typing import Any

__all__ = ["WithChild"]

log = logging.getLogger("rendezvous.daemon")
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "MV2_", "HYDI_", "HYDRA_")


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the daemon dies (Linux), so that
    a killed daemon leaves no program behind that waits for it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class WithChild:
    """A started daemon and the program it runs; what ``run_until_signalled`` drives."""

    def __init__(self, daemon: Any, argv: Sequence[str]) -> None:
        self.daemon = daemon
        self.argv = list(argv)
        self.proc: asyncio.subprocess.Process | None = None
        #: the process's exit status: COMMAND's (128 + N if a signal N ended it)
        self.exit_status = 0
        self._watch: asyncio.Task | None = None
        self._done = asyncio.Event()

    def describe(self) -> str:
        return self.daemon.describe()

    async def start(self) -> "WithChild":
        """Run the program once the daemon serves; drain when it exits."""
        # The launcher's variables are the daemon's: an MPI library in the program
        # must not take itself for this rank (PMI_FD is the daemon's own socket).
        env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
        env["RENDEZVOUS_LOCAL_ADDRESS"] = self.daemon.local_target
        try:
            self.proc = await asyncio.create_subprocess_exec(*self.argv, env=env, preexec_fn=_die_with_parent)
        except OSError as exc:
            from rendezvous.errors import FailedPrecondition

            await self.daemon.stop(0)
            raise FailedPrecondition(f"cannot run {self.argv[0]!r}: {exc.strerror or exc}") from None
        log.info("rendezvousd runs %s (pid %d); it exits when that does", " ".join(self.argv), self.proc.pid)
        self._watch = asyncio.create_task(self._wait_child(), name="rendezvousd-child")
        return self

    async def _wait_child(self) -> None:
        assert self.proc is not None
        code = await self.proc.wait()
        self.exit_status = code if code >= 0 else 128 - code
        log.info("%s exited with status %d: rendezvousd drains and exits", self.argv[0], self.exit_status)
        await self.daemon.stop()
        self._done.set()

    async def stop(self) -> None:
        """A signal to the daemon: pass it on; the drain follows the program's exit."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """A second signal: the program goes with the daemon."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()

    async def wait_for_termination(self) -> None:
        await self._done.wait()
        await self.daemon.wait_for_termination()
