"""The blocking ``rendezvous.Server``: an :class:`rendezvous.aio.Server` on a loop thread.

For plain training scripts. ``start()`` returns once the server is serving.
Every method may be called from any thread; each hands its work to the loop
thread and waits for the answer, so errors (Aborted, DeadlineExceeded, ...)
are raised in the caller.

A caller interrupted while it waits (Ctrl-C) loses nothing, wherever the
interrupt lands: the loop's task is cancelled if it still runs, and what a
recv received and its caller did not get, because the task had ended before
the interrupt or ends with its tensors after it, is kept for the next recv of
each key (:class:`_LoopCall`). The tensors count as the caller's only once the
method returns them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar, TypeVarTuple


from .bootstrap import Bootstrap
from .server import Server as AsyncServer
from rendezvous import interop
from rendezvous.cluster import ClusterLike, ClusterSpec
from rendezvous.config import Config
from rendezvous.errors import FailedPrecondition, Unavailable
from rendezvous.keys import Key, TaskName
from rendezvous.devices import Devices
from rendezvous.lifecycle import new_event_loop
from rendezvous.items import PendingEntry, Received

__all__ = ["Server", "new_event_loop"]
T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class _LoopCall(Generic[T]):
    """One blocking method's coroutine, run as a task on the loop, and its outcome.

    The caller's thread waits on :attr:`future`. A caller that stops before the
    result is in its hands (Ctrl-C, a timeout, an error while converting it)
    has :meth:`abandon` run on the loop: the task is cancelled if it still
    runs, and a result it ended with, before or after, goes to ``orphaned``
    (on the loop) unless the caller marked it :attr:`delivered`. Every step
    but ``delivered`` runs on the loop's thread, so none races another: a
    result goes to the caller or to ``orphaned``, never to neither."""

    __slots__ = ("future", "delivered", "why", "launched", "_coro", "_orphaned", "_task", "_finished",
                 "_abandoned")

    def __init__(self) -> None:
        self.future: concurrent.futures.Future[T] = concurrent.futures.Future()
        #: set on the caller's thread, last thing before the result is returned to its caller
        self.delivered = False
        #: why a result goes to ``orphaned`` (for its log; None: the caller's error says it)
        self.why: str | None = "was received after its caller was interrupted"
        #: handed to a loop (set before, so that a caller stopped at once still gives it up)
        self.launched = False
        self._coro: Coroutine[Any, Any, T] | None = None
        self._orphaned: Callable[[T, str | None], None] | None = None
        self._task: asyncio.Task[T] | None = None
        self._finished = False
        self._abandoned = False

    def launch(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T],
               orphaned: Callable[[T, str | None], None] | None) -> None:
        """Run ``coro`` on ``loop`` (from any thread); RuntimeError if the loop is closed."""
        self._coro = coro
        self._orphaned = orphaned
        self.launched = True
        loop.call_soon_threadsafe(self._start, loop)

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        coro, self._coro = self._coro, None
        if coro is None:
            return
        if self._abandoned:
            coro.close()
            return
        self._task = loop.create_task(coro)
        self._task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[T]) -> None:
        self._finished = True
        if self._abandoned:
            self._orphan()
        elif task.cancelled():
            self.future.cancel()
        elif (error := task.exception()) is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(task.result())

    def abandon(self) -> None:
        """The caller stopped waiting without the result (on the loop's thread)."""
        if self._abandoned:
            return
        self._abandoned = True
        if self._coro is not None:  # never started
            self._coro.close()
            self._coro = None
        elif self._finished:
            self._orphan()  # ended before the caller stopped: its result is still nobody's
        elif self._task is not None:
            self._task.cancel()  # a result it still ends with goes to _orphan (_done)

    def _orphan(self) -> None:
        task = self._task
        if self.delivered or self._orphaned is None or task is None or task.cancelled() \
                or task.exception() is not None:
            return
        self._orphaned(task.result(), self.why)


class Server:
    """Blocking rank server; same arguments as :class:`rendezvous.aio.Server`."""

    def __init__(self, cluster: ClusterLike, job_name: str, task_index: int,
                 protocol: str = "grpc", *, config: Config | None = None, devices: Devices | None = None,
                 **overrides: Any) -> None:
        self._aio = AsyncServer(cluster, job_name, task_index, protocol, config=config, devices=devices,
                               **overrides)
        # the caller's threads need the GIL while they compute (see aio.Server.poll_on_loop)
        self._aio.poll_on_loop = "attended"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls, job_name: str = "worker", protocol: str = "grpc", *,
                 env: Mapping[str, str] | None = None, **kwargs: Any) -> "Server":
        """A server for a job launched as ``torchrun`` launches one (``MASTER_ADDR``,
        ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``): see
        :meth:`rendezvous.aio.Server.from_env`. ``start()`` returns once every
        rank has joined."""
        boot = Bootstrap.from_env(env)
        return cls(boot.cluster(job_name), job_name, boot.rank, protocol, bootstrap=boot, **kwargs)

    # -- plumbing -----------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None,
              orphaned: Callable[[T, str | None], None] | None = None, attended: bool = False,
              call: _LoopCall[T] | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result. Interrupted here
        (Ctrl-C, ``timeout``), the coroutine is cancelled, and a result it had
        or still ends with goes to ``orphaned(result, why)`` on the loop (a
        recv's tensors are kept for the next recv of their keys, never
        dropped): see :class:`_LoopCall`. ``call``: the caller's own, when it must
        still be able to give the result up after this returns (it then marks
        it delivered itself). ``attended``: the loop polls MPI while this
        caller waits (see RankLink.attending)."""
        loop = self._check_running(coro)
        if threading.current_thread() is self._thread:
            coro.close()
            raise FailedPrecondition("blocking Server methods cannot run on its own loop thread")
        runs = self._aio.link.attending(coro) if attended and self._aio.link.attends else coro
        if call is None:
            call = _LoopCall()
        try:
            call.launch(loop, runs, orphaned)
        except RuntimeError:  # the loop closed in between: the server stopped
            runs.close()
            coro.close()
            raise self._stopped_error() from None
        try:
            return call.future.result(timeout)
        except BaseException:
            self._abandon(call)  # KeyboardInterrupt or a timeout here: stop the remote wait too
            raise

    def _abandon(self, call: _LoopCall[Any]) -> None:
        """``call``'s caller stopped without its result (see :class:`_LoopCall`)."""
        if call.launched and not call.delivered and self._loop is not None:  # (launched: it has one)
            try:
                self._loop.call_soon_threadsafe(call.abandon)
            except RuntimeError:
                pass  # the loop is closed: the server stopped, and its tensors with it

    def _check_running(self, coro: Coroutine[Any, Any, Any] | None = None) -> asyncio.AbstractEventLoop:
        """The server's loop; FailedPrecondition before start() and Unavailable after stop()."""
        if self._loop is None or self._loop.is_closed():
            if coro is not None:
                coro.close()
            if self._loop is None:
                raise FailedPrecondition("server is not started; call start() first")
            raise self._stopped_error()
        return self._loop

    def _stopped_error(self) -> Unavailable:
        return Unavailable(f"server {self._aio.task} is stopped")

    @property
    def aio(self) -> AsyncServer:
        """The asyncio server this drives (use only on :attr:`loop`)."""
        return self._aio

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the server runs on (its own thread), once started."""
        return self._loop

    @property
    def target(self) -> str:
        """``host:port`` this server listens on (the real port once started)."""
        return self._aio.target

    @property
    def task(self) -> TaskName:
        """This rank's task: ``/job:J/replica:0/task:T``."""
        return self._aio.task

    @property
    def config(self) -> Config:
        """The effective settings (see :class:`rendezvous.Config`)."""
        return self._aio.config

    @property
    def cluster(self) -> ClusterSpec:
        """Every task's address as this rank knows it (real ports once started)."""
        return self._aio.cluster

    @property
    def incarnation(self) -> int:
        """This server's incarnation (see :attr:`rendezvous.aio.Server.incarnation`)."""
        return self._aio.incarnation

    def incarnation_of(self, task: TaskName | str) -> int:
        """``task``'s incarnation as this server knows it; 0 if unknown (see
        :meth:`rendezvous.aio.Server.incarnation_of`)."""
        return self._aio.incarnation_of(task)

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        """Start the loop thread and the server; returns once serving."""
        if self._thread is not None:
            raise FailedPrecondition("start() is allowed once")
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._loop = new_event_loop(self._aio.config.uvloop)
        self._thread = threading.Thread(target=self._run, args=(ready,), name="rendezvous-loop", daemon=True)
        self._thread.start()
        ready.result()

    def _run(self, ready: concurrent.futures.Future[None]) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)

        async def main() -> None:
            try:
                await self._aio.start()
            except BaseException as exc:
                ready.set_exception(exc)
                return
            ready.set_result(None)
            await self._aio.wait_for_termination()

        try:
            loop.run_until_complete(main())
            # let closing channels and cancelled tasks finish
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        finally:
            loop.close()

    def stop(self, grace: float | None = None) -> None:
        """Drain and stop (see :meth:`rendezvous.aio.Server.stop`): by default,
        wait up to the ``grace`` setting (10 s) for this rank's produced
        tensors to be consumed. Idempotent."""
        if self._loop is None or self._thread is None:
            return
        if self._thread.is_alive():
            try:
                self._call(self._aio.stop(grace))
            except RuntimeError:
                pass  # loop already closed
        self._thread.join()

    def join(self, timeout: float | None = None) -> None:
        """Block until the server has stopped."""
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> "Server":
        self.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop(None if exc_type is None else 0)  # as aio.Server.__aexit__

    def update_cluster(self, cluster: ClusterLike) -> None:
        """Replace peer addresses (see :meth:`rendezvous.aio.Server.update_cluster`)."""
        self._call(_as_coro(self._aio.update_cluster, cluster))

    # -- data ---------------------------------------------------------------

    def send(self, key: Key | str, tensor: Any, step_id: int = 0, is_dead: bool = False) -> None:
        """Produce ``tensor`` under ``key``; returns once it is queued or handed over.

        The array is not copied: do not modify it until it has been received."""
        loop = self._check_running()
        canonical, arr = self._aio.prepare_send(key, tensor, is_dead)
        try:
            done = self._aio.table.send_threadsafe(loop, step_id, canonical, arr, is_dead)
        except RuntimeError:  # the loop closed in between: the server stopped
            raise self._stopped_error() from None
        done.result()

    # Each recv method marks its call delivered as the last thing before it
    # returns (no call in between, so no interrupt lands in between); stopped
    # anywhere before, it gives the call up and the tensors are kept.

    def recv(self, key: Key | str, step_id: int = 0, timeout: float | None = None,
             device: str | None = None, framework: str | None = None) -> Any:
        """Block until the tensor is here (None if dead): numpy, or a cupy array when
        the key's dst_device (or ``device="gpu:N"``) is a GPU, or a torch tensor
        sharing that memory with ``framework="torch"``; errors as in the aio form."""
        call: _LoopCall[list[Received]] = _LoopCall()
        try:
            value = self._received(call, [key], step_id, timeout, device, framework, one=True)[0].value
            call.delivered = True
            return value
        except BaseException:
            self._abandon(call)
            raise

    def recv_item(self, key: Key | str, step_id: int = 0, timeout: float | None = None,
                  device: str | None = None, framework: str | None = None) -> Received:
        """:meth:`recv` as ``Received(value, is_dead)``."""
        call: _LoopCall[list[Received]] = _LoopCall()
        try:
            item = self._received(call, [key], step_id, timeout, device, framework, one=True)[0]
            call.delivered = True
            return item
        except BaseException:
            self._abandon(call)
            raise

    def send_many(self, items: Iterable[tuple[Any, ...]] | Mapping[Key | str, Any], step_id: int = 0) -> None:
        """Produce many tensors at once (see :meth:`rendezvous.aio.Server.send_many`):
        every one checked here (arrays, and GPU tensors' ready events, are taken
        on the caller's thread), then all handed over in one trip to the loop."""
        self._check_running()
        prepared = self._aio.prepare_many(items)
        self._call(_as_coro(self._aio.send_prepared, prepared, step_id))

    def recv_many(self, keys: Sequence[Key | str], step_id: int = 0, timeout: float | None = None,
                  device: str | None = None, framework: str | None = None) -> list[Any]:
        """Many tensors in one call, under one deadline, all or none (see
        :meth:`rendezvous.aio.Server.recv_many`): one trip to the loop for the batch."""
        call: _LoopCall[list[Received]] = _LoopCall()
        try:
            values = [item.value for item in self._received(call, keys, step_id, timeout, device, framework,
                                                            one=False)]
            call.delivered = True
            return values
        except BaseException:
            self._abandon(call)
            raise

    def recv_many_items(self, keys: Sequence[Key | str], step_id: int = 0, timeout: float | None = None,
                        device: str | None = None, framework: str | None = None) -> list[Received]:
        """:meth:`recv_many` as ``Received(value, is_dead)`` items."""
        call: _LoopCall[list[Received]] = _LoopCall()
        try:
            items = self._received(call, keys, step_id, timeout, device, framework, one=False)
            call.delivered = True
            return items
        except BaseException:
            self._abandon(call)
            raise

    def _received(self, call: _LoopCall[list[Received]], keys: Sequence[Key | str], step_id: int,
                  timeout: float | None, device: str | None, framework: str | None, one: bool) -> list[Received]:
        """The items of ``keys`` (``one``: a single key, received as :meth:`recv`
        does), converted to ``framework`` here, on the caller's thread, by
        ``call``: what was received and is not handed over (the caller
        interrupted, or no such form) is kept for the next recv of its key
        once the caller gives ``call`` up."""
        if framework is not None:
            interop.check_framework(framework)  # before anything is taken
        def give_back(items: list[Received], why: str | None) -> None:
            self._aio.give_back(step_id, keys, items, why)

        def not_convertible(_: list[Received]) -> None:
            call.why = None  # given back when the caller gives call up; its error says why

        fetching = (_recv_one(self._aio, keys[0], step_id, timeout, device) if one
                    else self._aio.recv_many_items(keys, step_id, timeout, device))
        items = self._call(fetching, orphaned=give_back, attended=True, call=call)
        return items if framework is None else interop.hand_over(items, framework, not_convertible)

    def abort(self, step_id: int, message: str = "aborted") -> None:
        """Fail every waiter and every later send/recv of ``step_id`` with ABORTED."""
        self._call(_as_coro(self._aio.abort, step_id, message))

    def cleanup(self, step_id: int) -> None:
        """Abort the step's waiters and forget the step."""
        self._call(_as_coro(self._aio.cleanup, step_id))

    def stats(self) -> dict[str, dict[str, int]]:
        """Transfers, bytes and errors by path (see :meth:`rendezvous.aio.Server.stats`)."""
        return self._aio.stats()

    def pending(self) -> list[PendingEntry]:
        """What waits in this rank's table: produced tensors and waiting recvs, with ages."""
        return self._call(_as_coro(self._aio.pending))


async def _as_coro(fn: Callable[[*Ts], T], *args: *Ts) -> T:
    return fn(*args)



async def _recv_one(server: AsyncServer, key: Key | str, step_id: int, timeout: float | None,
                    device: str | None) -> list[Received]:
    return [(await server.receiver.fetching(key, step_id, timeout, device)).item]
