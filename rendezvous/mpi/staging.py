"""GPU tensors over MPI: pipelines the progress engine drives on its thread.

Without CUDA-aware MPI (the PyPI wheels never are), a device buffer must not
reach MPI. A :class:`StagedSend` copies the tensor device -> pinned host in
chunks on the backend's copy stream and posts a non-blocking send for each
chunk as soon as its copy is done, so the copy of chunk i+1 overlaps the send
of chunk i. A :class:`StagedRecv` posts receives into pinned chunks and
copies each one host -> device as soon as it has arrived, overlapping the
next receive. Each keeps at most ``depth`` chunks in flight; buffers come
from a :class:`~rendezvous.devices.PinnedPool` and go back to it.

With CUDA-aware MPI, :class:`DirectSend` and :class:`DirectRecv` hand device
memory to MPI directly; the send first waits for the tensor's ready event
(mpi4py does not synchronize streams).

Ordering on the receiving side: the destination was allocated on the
consumer's current stream, whose pool may have handed back a block that work
queued there still reads. Host-to-device copies wait (on the copy stream) for
the allocation's event, and :class:`DirectRecv` posts its receives only once
that event is done.

A pinned buffer goes back to its pool only after its copy event completed:
a failed or cancelled transfer gives its buffers back with that event
(:meth:`~rendezvous.devices.PinnedPool.give` ``after=``), and the pool holds
them, and the device array the copy reads or writes, until it is done. The
MPI thread never blocks on a copy.

The wire contract is the same as for host buffers: ``nbytes`` split into
messages of ``chunk`` bytes (one empty message for an empty tensor), in
order, on one tag. Either side may stage or not; they only agree on the
chunk size, which the descriptor carries.

A sender that fails partway (a copy's event reports an error, a copy cannot
be queued) still sends one message for every chunk not sent, each shorter
than its chunk, the first saying why (:mod:`rendezvous.mpi.aborts`): its
receiver's receives all complete, a receiver here checks every message's
length and fails the transfer with ABORTED at the first short one, and
nothing is left on the tag for a later transfer to match. The sender's own
error is then :class:`~rendezvous.mpi.aborts.SendAborted`: its receiver
cannot have the tensor. A copy whose event reports an error (the backend's
``event_done`` raises it) fails its transfer; it is never taken as done.

Every method here runs on the MPI thread. ``step()`` advances without
blocking and says whether anything moved (the engine backs off when nothing
does); ``done`` and ``error`` tell the outcome.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from rendezvous.devices import DeviceBackend, DeviceTensor, PinnedPool
from rendezvous.errors import Internal, RendezvousError, Unavailable

from . import aborts

__all__ = ["Pipeline", "StagedSend", "StagedRecv", "DirectSend", "DirectRecv"]


def _drop(items: list, item: Any) -> None:
    """Remove ``item`` itself from ``items``. Never ``list.remove``: it tests
    equality, and here neither kind of entry has a usable one. A completed
    mpi4py request equals every other completed one (a null handle), so an
    earlier entry could be removed in its place; and a staging buffer compares
    element by element, so an entry holding one raises when its
    ``(buffer, ...)`` tuple is compared with another's (same-sized buffers)."""
    for i, entry in enumerate(items):
        if entry is item:
            del items[i]
            return
    raise Internal(f"{item!r} is not in flight")  # pragma: no cover - a bug of ours


_EMPTY = np.empty(0, np.uint8)


def _spans(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    if nbytes == 0:
        return [(0, 0)]
    return [(s, min(nbytes, s + chunk)) for s in range(0, nbytes, chunk)]


class Pipeline:
    """One transfer the engine advances with :meth:`step` until ``done``."""

    kind = "?"

    def __init__(self, comm: Any, MPI: Any, peer: int, tag: int, nbytes: int, chunk: int) -> None:
        self.comm = comm
        self.MPI = MPI
        self.peer = peer
        self.tag = tag
        self.nbytes = nbytes
        self.spans = _spans(nbytes, chunk)
        self.error: BaseException | None = None
        self.done = False
        self._reqs: list[Any] = []  # every request posted and not complete
        self._status = MPI.Status()  # a completed receive's (its length is checked)
        self._aborting: list[tuple[Any, Any]] = []  # (message, request): abort messages posted

    def step(self) -> bool:
        try:
            return self._step()
        except self.MPI.Exception as exc:
            self._fail(Internal(f"MPI {self.kind} of {self.nbytes} bytes with rank {self.peer} tag {self.tag} "
                                f"failed: {exc.Get_error_string()}"))
        except Exception as exc:  # a CUDA error: fail this transfer, never the thread
            self._fail(Internal(f"{self.kind} of {self.nbytes} bytes with rank {self.peer} failed: {exc}"),
                       mpi_works=True)
        return True

    def _fail(self, error: BaseException, mpi_works: bool = False) -> None:
        """Stop posting; the requests already posted still finish (their peer
        is matching them), and only then is the transfer done. ``mpi_works``:
        the failure was not MPI's (a receive then still takes every message,
        so the producer's sends complete)."""
        raise NotImplementedError  # pragma: no cover - every pipeline says how

    def _test(self, req: Any, status: Any = None) -> bool:
        if req.Test(status):
            _drop(self._reqs, req)
            return True
        return False

    def _short(self, index: int, expected: int, data: Any) -> bool:
        """Whether the message just received for chunk ``index`` (its status in
        ``self._status``) is short: its sender gave up (see aborts). The first
        such message fails the transfer; the receive goes on, so every message
        the sender still sends is taken."""
        count = self._status.Get_count(self.MPI.BYTE)
        if count == expected:
            return False
        if self.error is None:
            self.error = aborts.short_message(self.peer, self.tag, index, len(self.spans), count, expected, data)
        return True

    def _abort(self, sent: int, error: BaseException) -> BaseException:
        """Stand for chunks ``sent`` onwards with abort messages (see aborts).
        The transfer's error: SendAborted once they are all posted, else (MPI
        refused one, and its receiver is not told) Internal."""
        why = error.message if isinstance(error, RendezvousError) else str(error)
        total = len(self.spans)
        told = True
        for i in range(sent, total):
            start, stop = self.spans[i]
            data = aborts.message(stop - start, why, first=i == sent)
            try:
                req = self.comm.Isend([data, self.MPI.BYTE], self.peer, self.tag)
            except self.MPI.Exception:
                told = False
                break
            self._reqs.append(req)
            self._aborting.append((data, req))  # kept until MPI is done with it
        what = "its receiver was told" if told else "its receiver could not be told"
        return (aborts.SendAborted if told else Internal)(f"{why} (after {sent} of {total} messages; {what})")

    def cancel(self) -> None:
        """Engine stopping: cancel what is posted and finish with UNAVAILABLE."""
        self._cancel_requests()
        self._aborting.clear()
        self._give_back_all()
        self.error = self.error or Unavailable("MPI engine stopped before the transfer finished")
        self.done = True

    def _give_back_all(self) -> None:
        """Cancelled: every buffer back to its pool, after its copy."""

    def _cancel_requests(self) -> None:
        for req in self._reqs:
            try:
                req.Cancel()
                req.Wait()
            except self.MPI.Exception:
                pass
        self._reqs.clear()

    def _step(self) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError


class StagedSend(Pipeline):
    kind = "staged send"

    def __init__(self, comm: Any, MPI: Any, src: DeviceTensor, dest: int, tag: int, chunk: int,
                 pool: PinnedPool) -> None:
        super().__init__(comm, MPI, dest, tag, src.nbytes, chunk)
        self.src = src
        self.backend: DeviceBackend = src.backend
        self.pool = pool
        self._next = 0  # chunks whose copy was queued
        self._sent = 0  # chunks whose message was posted
        # (buf, size, event), in chunk order; buf None: the empty tensor's message (no copy)
        self._copying: collections.deque = collections.deque()
        self._sending: list[tuple[Any, Any]] = []  # (buf or None, request)

    def _step(self) -> bool:
        moved = self._step_aborting() if self._aborting else False
        for entry in tuple(self._sending):  # a later message may be done before an earlier one
            if self._test(entry[1]):
                _drop(self._sending, entry)
                if entry[0] is not None:
                    self.pool.give(entry[0])
                moved = True
        # Sends are posted in chunk order: MPI matches messages on one tag in order.
        # A copy whose event reports an error raises here: the transfer fails (_fail).
        while self._copying and (self._copying[0][2] is None or self.backend.event_done(self._copying[0][2])):
            buf, size, _ = self._copying[0]
            data = _EMPTY if buf is None else buf[:size]
            req = self.comm.Isend([data, self.MPI.BYTE], self.peer, self.tag)
            self._copying.popleft()  # only once posted: a failed post leaves it for _fail to give back
            self._reqs.append(req)
            self._sending.append((buf, req))
            self._sent += 1
            moved = True
        while self._next < len(self.spans) and len(self._copying) + len(self._sending) < self.pool.depth:
            start, stop = self.spans[self._next]
            if stop == start:  # the empty tensor: nothing to read from the device
                self._copying.append((None, 0, None))
                self._next += 1
                moved = True
                continue
            buf = self.pool.take()
            try:
                event = self.backend.d2h_async(self.src, start, buf[:stop - start])
            except BaseException:
                self.pool.give(buf)
                raise
            self._copying.append((buf, stop - start, event))
            self._next += 1
            moved = True
        if self._next >= len(self.spans) and not self._copying and not self._sending and not self._aborting:
            self.done = True
        return moved

    def _step_aborting(self) -> bool:
        moved = False
        for entry in tuple(self._aborting):
            if self._test(entry[1]):
                _drop(self._aborting, entry)
                moved = True
        return moved

    def _fail(self, error: BaseException, mpi_works: bool = False) -> None:
        """No new copies; the messages posted finish, and every chunk not sent is
        stood for by an abort message, so the receiver knows at once."""
        if self.error is not None:
            return
        self._next = len(self.spans)
        for buf, _, event in self._copying:
            if buf is not None:
                self.pool.give(buf, after=event, hold=self.src)  # the copy may still be writing it
        self._copying.clear()
        if self._sent >= len(self.spans):
            self.error = error  # every message is out: the receiver's side decides
            return
        self.error = self._abort(self._sent, error)
        self._sent = len(self.spans)

    def _give_back_all(self) -> None:
        for buf, _, event in self._copying:
            if buf is not None:
                self.pool.give(buf, after=event, hold=self.src)
        self._copying.clear()
        for buf, _ in self._sending:
            if buf is not None:
                self.pool.give(buf)  # its request is cancelled and waited for
        self._sending.clear()


class StagedRecv(Pipeline):
    kind = "staged receive"

    def __init__(self, comm: Any, MPI: Any, backend: DeviceBackend, dst: Any, device: int, nbytes: int,
                 source: int, tag: int, chunk: int, pool: PinnedPool, allocated: Any = None) -> None:
        super().__init__(comm, MPI, source, tag, nbytes, chunk)
        self.backend = backend
        self.dst = dst
        self.device = device
        self.pool = pool
        self.allocated = allocated  # the destination's allocation event: copies wait for it
        self._next = 0
        self._receiving: list[tuple[int, int, Any, Any]] = []  # (index, size, buf, request)
        self._copying: list[tuple[Any, Any]] = []  # (buf, event)

    def _step(self) -> bool:
        moved = False
        for done in tuple(self._copying):
            try:
                finished = self.backend.event_done(done[1])
            except Exception as exc:  # the copy failed: it is over, and so is the transfer
                finished = True
                if self.error is None:
                    self.error = Internal(f"staged receive of {self.nbytes} bytes from rank {self.peer}: "
                                          f"the copy to GPU:{self.device} failed: {exc}")
            if finished:
                _drop(self._copying, done)
                self.pool.give(done[0])
                moved = True
        for entry in tuple(self._receiving):
            index, size, buf, req = entry
            if self._test(req, self._status):
                _drop(self._receiving, entry)
                if not self._short(index, size, buf) and self.error is None:
                    start = self.spans[index][0]
                    self._copying.append((buf, self.backend.h2d_async(buf[:size], self.dst, self.device, start,
                                                                      after=self.allocated)))
                else:
                    self.pool.give(buf)
                moved = True
        while self._next < len(self.spans) and len(self._receiving) + len(self._copying) < self.pool.depth:
            start, stop = self.spans[self._next]
            buf = self.pool.take()
            try:
                req = self.comm.Irecv([buf[:stop - start], self.MPI.BYTE], self.peer, self.tag)
            except BaseException:
                self.pool.give(buf)
                raise
            self._reqs.append(req)
            self._receiving.append((self._next, stop - start, buf, req))
            self._next += 1
            moved = True
        if self._next >= len(self.spans) and not self._receiving and not self._copying:
            self.done = True
        return moved

    def _fail(self, error: BaseException, mpi_works: bool = False) -> None:
        self.error = self.error or error
        if not mpi_works:
            self.spans = self.spans[:self._next]
        # else: keep receiving (into pinned buffers, dropped) until the producer's
        # last message, so its sends complete and the tag is free again

    def _give_back_all(self) -> None:
        for _, _, buf, _ in self._receiving:
            self.pool.give(buf)  # its request is cancelled and waited for
        self._receiving.clear()
        for buf, event in self._copying:
            self.pool.give(buf, after=event, hold=self.dst)  # the copy may still read it and write dst
        self._copying.clear()


class DirectSend(Pipeline):
    """CUDA-aware MPI: wait for the tensor's ready event, then send device memory."""

    kind = "device send"

    def __init__(self, comm: Any, MPI: Any, src: DeviceTensor, dest: int, tag: int, chunk: int) -> None:
        super().__init__(comm, MPI, dest, tag, src.nbytes, chunk)
        self.src = src
        self._sent = 0  # chunks whose message was posted
        self._posted = False

    def _step(self) -> bool:
        if not self._posted:
            if self.error is not None:
                self.done = True
                return True
            # the empty tensor reads nothing; a failed producer raises here (_fail)
            if self.nbytes and not self.src.backend.event_done(self.src.ready):
                return False
            for start, stop in self.spans:
                buf = self.src.backend.mpi_buffer(self.src.array, start, stop)
                self._reqs.append(self.comm.Isend([buf, self.MPI.BYTE], self.peer, self.tag))
                self._sent += 1
            self._posted = True
            return True
        moved = any([self._test(r) for r in list(self._reqs)])  # abort messages among them
        if not self._reqs:
            self._aborting.clear()
            self.done = True
        return moved

    def _fail(self, error: BaseException, mpi_works: bool = False) -> None:
        if self.error is not None:
            return
        self.error = error
        if self._sent < len(self.spans):  # stand for the chunks not sent (see aborts)
            self.error = self._abort(self._sent, error)
            self._sent = len(self.spans)
        self._posted = True  # what was posted finishes; nothing more is posted
        if not self._reqs:
            self.done = True


class DirectRecv(Pipeline):
    """CUDA-aware MPI: receive straight into device memory."""

    kind = "device receive"

    def __init__(self, comm: Any, MPI: Any, backend: DeviceBackend, dst: Any, nbytes: int, source: int,
                 tag: int, chunk: int, allocated: Any = None) -> None:
        super().__init__(comm, MPI, source, tag, nbytes, chunk)
        self.backend = backend
        self.dst = dst
        self.allocated = allocated  # MPI writes the destination only once its allocation event is done
        self._posted = False
        self._receiving: list[tuple[int, int, Any, Any]] = []  # (index, size, host buffer or None, request)

    def _post(self, into_host: bool = False) -> None:
        for i, (start, stop) in enumerate(self.spans):
            host = np.empty(stop - start, np.uint8) if into_host else None
            buf = host if into_host else self.backend.mpi_buffer(self.dst, start, stop)
            req = self.comm.Irecv([buf, self.MPI.BYTE], self.peer, self.tag)
            self._reqs.append(req)
            self._receiving.append((i, stop - start, host, req))
        self._posted = True

    def _step(self) -> bool:
        if not self._posted:
            if self.allocated is not None and not self.backend.event_done(self.allocated):
                return False
            self._post()
            return True
        moved = False
        for entry in tuple(self._receiving):
            index, size, host, req = entry
            if self._test(req, self._status):
                _drop(self._receiving, entry)
                self._short(index, size, host)
                moved = True
        if not self._reqs:
            self.done = True
        return moved

    def _fail(self, error: BaseException, mpi_works: bool = False) -> None:
        self.error = self.error or error
        if not self._posted and mpi_works:
            self._post(into_host=True)  # take the producer's messages anyway, so its sends complete
        self._posted = True
        if not self._reqs:
            self.done = True
