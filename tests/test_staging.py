"""The GPU staging pipelines, stepped by hand against a scripted communicator:
chunk order, overlap of copies with messages, pipeline depth, buffer reuse,
failures, and a sender that fails partway telling its receiver (a sender and
a receiver joined by a scripted wire that matches messages as MPI does).
(test_gpu.py runs them over real MPI.)"""

from __future__ import annotations

import itertools
import os
import re
import threading
import time

import numpy as np
import pytest

from rendezvous import errors
from rendezvous.devices import DeviceTensor, PinnedPool
from rendezvous.testing.fakegpu import FakeBackend, FakeCudaError
from rendezvous.mpi import aborts
from rendezvous.mpi.aborts import SendAborted
from rendezvous.mpi.ops import Op, OpKind, check_part
from rendezvous.mpi.staging import DirectRecv, DirectSend, StagedRecv, StagedSend
from rendezvous.codec.tensors import TensorMeta


class FakeMPIError(Exception):
    def Get_error_string(self):
        return "scripted failure"


class Status:
    def __init__(self):
        self.count = -1

    def Get_count(self, datatype):
        return self.count


class FakeMPI:
    BYTE = "byte"
    Exception = FakeMPIError
    Status = Status


class Req:
    """Compares as mpi4py's requests do: by handle, and a completed request's
    handle is null, so every completed request equals every other."""

    _handles = itertools.count(1)

    def __init__(self, kind, buf, done=False):
        self.kind, self.buf, self.done = kind, buf, done
        self.count = len(buf) if kind == "send" else -1  # a receive's: what its message brought
        self.handle = next(Req._handles)

    def Test(self, status=None):
        if self.done:
            self.handle = 0  # MPI_REQUEST_NULL
            if status is not None:
                status.count = self.count
        return self.done

    def __eq__(self, other):
        return isinstance(other, Req) and self.handle == other.handle

    __hash__ = None

    def Cancel(self):
        pass

    def Wait(self):
        pass


class Comm:
    """Records posted messages; a test completes them when it wants."""

    def __init__(self, incoming=None, fail_at=None):
        self.sent: list[Req] = []
        self.recvs: list[Req] = []
        self.incoming = list(incoming or [])
        self.fail_at = fail_at

    def Isend(self, spec, dest, tag):
        if self.fail_at is not None and len(self.sent) == self.fail_at:
            raise FakeMPIError()
        req = Req("send", bytes(np.asarray(spec[0])))  # what MPI would read now
        self.sent.append(req)
        return req

    def Irecv(self, spec, source, tag):
        req = Req("recv", spec[0])
        self.recvs.append(req)
        return req

    def deliver(self):
        """Complete the oldest posted receive with the next incoming message."""
        req = next(r for r in self.recvs if not r.done)
        data = self.incoming.pop(0)
        req.buf[:len(data)] = np.frombuffer(data, np.uint8)
        req.count = len(data)
        req.done = True


def run_until(pipe, cond, timeout=20.0):
    """Step ``pipe`` until ``cond()`` holds; the fake's copies finish on their own
    threads, so this is a condition wait with a deadline, not a step count."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("pipeline made no progress")
        if not pipe.step():
            os.sched_yield()  # the copy threads run (it releases the GIL); the deadline bounds the wait


@pytest.fixture
def fake():
    return FakeBackend()


@pytest.mark.timeout(30)
def test_staged_send_overlaps_copies_with_messages_and_keeps_order(fake):
    data = (np.arange(10_000) % 251).astype(np.uint8)
    gate = threading.Event()
    arr = fake.array(np.zeros_like(data))
    fake.stream(0).enqueue(lambda: (gate.wait(30), arr._data.__setitem__(slice(None), data)))
    src = fake.wrap(arr)
    pool = PinnedPool(fake, 1024, depth=3)
    comm = Comm()
    pipe = StagedSend(comm, FakeMPI, src, 1, 7, 1024, pool)
    pipe.step()
    # three copies queued behind the producer's kernel; nothing reaches MPI before it is done
    assert len(pipe._copying) == 3 and not comm.sent
    gate.set()
    run_until(pipe, lambda: len(comm.sent) == 3)
    # depth reached: three messages in flight, no fourth copy yet
    assert len(pipe._copying) == 0 and pipe._next == 3
    comm.sent[0].done = True
    run_until(pipe, lambda: pipe._next == 4)  # a finished message frees a buffer for the next copy
    def finish_messages():
        for r in comm.sent:
            r.done = True
        return pipe.done
    run_until(pipe, finish_messages)
    assert pipe.error is None
    assert b"".join(r.buf for r in comm.sent) == data.tobytes()  # ten chunks, in order
    assert [len(r.buf) for r in comm.sent] == [1024] * 9 + [784]
    assert pool.allocated == 3 and pool.free == 3  # three buffers, reused, all back


@pytest.mark.timeout(30)
def test_staged_recv_copies_each_chunk_to_the_device_as_it_lands(fake):
    data = (np.arange(5000) * 7 % 253).astype(np.uint8)
    chunks = [data[i:i + 2048].tobytes() for i in range(0, data.size, 2048)]
    comm = Comm(incoming=chunks)
    pool = PinnedPool(fake, 2048, depth=2)
    dst = fake.empty(TensorMeta(np.uint8, (data.size,)), 0)
    pipe = StagedRecv(comm, FakeMPI, fake, dst, 0, data.size, 0, 7, 2048, pool)
    pipe.step()
    assert len(comm.recvs) == 2  # receives posted ahead, up to the depth
    comm.deliver()
    run_until(pipe, lambda: len(comm.recvs) == 3)  # chunk 0 copied to the device; chunk 2 posted
    comm.deliver()
    comm.deliver()
    run_until(pipe, lambda: pipe.done)
    assert pipe.error is None and np.array_equal(dst.get(), data)
    assert pool.allocated == 2


@pytest.mark.timeout(30)
def test_staged_send_finishes_when_a_later_message_completes_first(fake):
    # Messages of one transfer may be seen complete out of order. The send
    # once took the entry of a later one out of its list by equality, which
    # compared two same-sized staging buffers element by element and raised:
    # the transfer failed and never finished, and its consumer waited forever.
    data = (np.arange(3072) % 249).astype(np.uint8)
    pool = PinnedPool(fake, 1024, depth=3)
    comm = Comm()
    pipe = StagedSend(comm, FakeMPI, fake.wrap(fake.array(data)), 1, 7, 1024, pool)
    run_until(pipe, lambda: len(comm.sent) == 3)
    for i in (1, 2, 0):  # the first message completes last
        comm.sent[i].done = True
        pipe.step()
    run_until(pipe, lambda: pipe.done)
    assert pipe.error is None, pipe.error
    assert b"".join(r.buf for r in comm.sent) == data.tobytes()
    assert pool.free == pool.allocated == 3


class Glimpse(FakeBackend):
    """Reports the event in ``hidden`` as not done yet: a poll that saw an
    earlier copy still running, and the one after it finished, in one pass."""

    hidden = None

    def event_done(self, event):
        return event is not self.hidden and super().event_done(event)


@pytest.mark.timeout(30)
def test_staged_recv_finishes_when_a_later_copy_is_seen_done_first():
    fake = Glimpse()
    data = (np.arange(2048) * 3 % 251).astype(np.uint8)
    comm = Comm(incoming=[data[:1024].tobytes(), data[1024:].tobytes()])
    pool = PinnedPool(fake, 1024, depth=2)
    dst = fake.empty(TensorMeta(np.uint8, (data.size,)), 0)
    pipe = StagedRecv(comm, FakeMPI, fake, dst, 0, data.size, 0, 7, 1024, pool)
    pipe.step()
    comm.deliver()
    comm.deliver()
    run_until(pipe, lambda: len(pipe._copying) == 2)  # both chunks on their way to the device
    fake.hidden = pipe._copying[0][1]
    fake.settle()
    pipe.step()  # the second copy is done, the first seen still running
    assert pipe.error is None, pipe.error
    fake.hidden = None
    run_until(pipe, lambda: pipe.done)
    assert pipe.error is None and np.array_equal(dst.get(), data)
    assert pool.free == pool.allocated == 2


@pytest.mark.timeout(30)
def test_empty_tensor_is_one_empty_message(fake):
    src = fake.wrap(fake.array(np.zeros(0, np.float32)))
    comm = Comm()
    pipe = StagedSend(comm, FakeMPI, src, 1, 3, 1024, PinnedPool(fake, 1024, depth=2))
    run_until(pipe, lambda: len(comm.sent) == 1)
    comm.sent[0].done = True
    run_until(pipe, lambda: pipe.done)
    assert comm.sent[0].buf == b"" and pipe.error is None


@pytest.mark.timeout(30)
def test_an_mpi_error_fails_the_transfer_after_what_was_posted(fake):
    src = fake.wrap(fake.array(np.ones(4096, np.uint8)))
    comm = Comm(fail_at=1)
    pool = PinnedPool(fake, 1024, depth=2)
    pipe = StagedSend(comm, FakeMPI, src, 1, 3, 1024, pool)
    run_until(pipe, lambda: pipe.error is not None)
    assert "scripted failure" in str(pipe.error) and not pipe.done  # the first message is still out
    comm.sent[0].done = True
    run_until(pipe, lambda: pipe.done)
    assert len(comm.sent) == 1 and pool.free == pool.allocated


@pytest.mark.timeout(30)
def test_direct_send_waits_for_the_producers_stream(fake):
    gate = threading.Event()
    arr = fake.array(np.zeros(100, np.uint8))
    fake.stream(0).enqueue(lambda: (gate.wait(30), arr._data.__setitem__(slice(None), 5)))
    comm = Comm()
    pipe = DirectSend(comm, FakeMPI, fake.wrap(arr), 1, 3, 64)
    for _ in range(100):
        pipe.step()
    assert not comm.sent  # device memory is not handed to MPI before its kernel is done
    gate.set()
    run_until(pipe, lambda: len(comm.sent) == 2)
    assert b"".join(r.buf for r in comm.sent) == b"\x05" * 100


@pytest.mark.timeout(30)
def test_a_failed_receive_post_gives_its_buffer_back(fake):
    class Refusing(Comm):
        def Irecv(self, spec, source, tag):
            if self.recvs:
                raise FakeMPIError()
            return super().Irecv(spec, source, tag)

    comm = Refusing(incoming=[b"\x01" * 1024])
    pool = PinnedPool(fake, 1024, depth=3)
    dst = fake.empty(TensorMeta(np.uint8, (4096,)), 0)
    pipe = StagedRecv(comm, FakeMPI, fake, dst, 0, 4096, 0, 7, 1024, pool)
    pipe.step()
    assert pipe.error is not None and not pipe.done  # the first receive is still posted
    comm.deliver()
    run_until(pipe, lambda: pipe.done)
    assert pool.free == pool.allocated == 2


# -- a sender that fails partway: its receiver is told at once ----------------


class Wire:
    """Two ranks joined on one communicator: sends and receives on a tag are
    matched in the order each side posted them, as MPI does; a send completes
    once its message is received. ``queued`` and ``waiting`` are what is left
    unmatched."""

    def __init__(self):
        self.queued: list[tuple[int, Req]] = []  # (tag, send)
        self.waiting: list[tuple[int, Req]] = []  # (tag, receive)

    def Isend(self, spec, dest, tag):
        req = Req("send", bytes(np.asarray(spec[0])))
        self.queued.append((tag, req))
        self._match()
        return req

    def Irecv(self, spec, source, tag):
        req = Req("recv", spec[0])
        self.waiting.append((tag, req))
        self._match()
        return req

    def _match(self):
        for tag in {t for t, _ in self.queued} & {t for t, _ in self.waiting}:
            sends = [e for e in self.queued if e[0] == tag]
            recvs = [e for e in self.waiting if e[0] == tag]
            for (_, send), (_, recv) in zip(sends, recvs):
                n = len(send.buf)
                assert n <= len(np.asarray(recv.buf).reshape(-1)), "a message longer than its receive"
                view = np.asarray(recv.buf).reshape(-1).view(np.uint8)
                view[:n] = np.frombuffer(send.buf, np.uint8)
                recv.count, recv.done, send.done = n, True, True
                self.queued.remove((tag, send))
                self.waiting.remove((tag, recv))


def run_pair(send, recv, timeout=10.0):
    """Step both ends until both are done (the copies run on the fake's threads)."""
    end = time.monotonic() + timeout
    while not (send.done and recv.done):
        if time.monotonic() > end:
            raise AssertionError(f"no progress: sender done={send.done}, receiver done={recv.done} "
                                 f"(the receiver waits for messages that never come)")
        moved = send.step() if not send.done else False
        moved = (recv.step() if not recv.done else False) or moved
        if not moved:
            os.sched_yield()  # as run_until: the fake's copy threads run meanwhile


def staged_pair(fake, wire, data, chunk=1024, depth=2, tag=7):
    src = fake.wrap(fake.array(data))
    send_pool, recv_pool = PinnedPool(fake, chunk, depth=depth), PinnedPool(fake, chunk, depth=depth)
    dst = fake.empty(TensorMeta(np.uint8, (data.size,)), 1)
    send = StagedSend(wire, FakeMPI, src, 1, tag, chunk, send_pool)
    recv = StagedRecv(wire, FakeMPI, fake, dst, 1, data.size, 0, tag, chunk, recv_pool)
    return send, recv, dst, (send_pool, recv_pool)


def all_back(*pools):
    """Every buffer of ``pools`` free again (those held for a copy, once it is over)."""
    for p in pools:
        p.reap()
    return all(p.pending == 0 and p.free == p.allocated for p in pools)


@pytest.mark.timeout(30)
def test_a_copy_that_fails_partway_tells_the_receiver_at_once(fake):
    # chunk 3 of 5 fails on the copy stream: its event completes with the error
    data = (np.arange(5 * 1024) % 251).astype(np.uint8)
    wire = Wire()
    fake.copy_faults["d2h"] = [None, None, FakeCudaError("cudaErrorIllegalAddress: an illegal memory access")]
    send, recv, _, pools = staged_pair(fake, wire, data)
    run_pair(send, recv)
    assert isinstance(recv.error, errors.Aborted), recv.error
    assert "cudaErrorIllegalAddress" in recv.error.message and "at message 3 of 5" in recv.error.message
    assert isinstance(send.error, SendAborted) and "after 2 of 5 messages" in send.error.message, send.error
    # every message was taken and nothing is posted: the tag is free
    assert not wire.queued and not wire.waiting and not send._reqs and not recv._reqs
    fake.settle()
    assert all_back(*pools) and not fake.violations, fake.violations

    # the next transfer on the same tag gets its own bytes, whole
    again = (np.arange(5 * 1024) * 3 % 241).astype(np.uint8)
    send, recv, dst, pools = staged_pair(fake, wire, again)
    run_pair(send, recv)
    assert send.error is None and recv.error is None, (send.error, recv.error)
    assert np.array_equal(dst.get(), again)
    fake.settle()
    assert all_back(*pools) and not wire.queued and not wire.waiting


class Refusing(FakeBackend):
    """A device whose ``refuse_at``-th device-to-host copy cannot be queued."""

    refuse_at = None

    def __init__(self):
        super().__init__()
        self.d2h_calls = 0

    def d2h_async(self, src, start, host):
        self.d2h_calls += 1
        if self.d2h_calls == self.refuse_at:
            raise FakeCudaError("cudaErrorLaunchFailure: unspecified launch failure")
        return super().d2h_async(src, start, host)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("at", [1, 4])
def test_a_copy_that_cannot_be_queued_tells_the_receiver(at):
    fake = Refusing()
    fake.refuse_at = at
    data = np.ones(4 * 1024 + 10, np.uint8)
    wire = Wire()
    send, recv, _, pools = staged_pair(fake, wire, data)
    run_pair(send, recv)
    assert isinstance(recv.error, errors.Aborted) and "cudaErrorLaunchFailure" in recv.error.message, recv.error
    short = int(re.search(r"at message (\d+) of 5", recv.error.message).group(1))
    assert short <= at, recv.error.message  # copies done but not sent yet are not sent either
    assert isinstance(send.error, SendAborted), send.error
    assert not wire.queued and not wire.waiting
    fake.settle()
    assert all_back(*pools) and not fake.violations


@pytest.mark.timeout(30)
def test_a_short_message_fails_the_receive_and_every_later_one_is_still_taken(fake):
    # A sender's messages: chunk 0 whole, chunk 1 empty (no reason), chunks 2-3.
    data = (np.arange(4096) % 199).astype(np.uint8)
    comm = Comm(incoming=[data[:1024].tobytes(), b"", data[2048:3072].tobytes(), data[3072:].tobytes()])
    pool = PinnedPool(fake, 1024, depth=2)
    dst = fake.empty(TensorMeta(np.uint8, (4096,)), 0)
    pipe = StagedRecv(comm, FakeMPI, fake, dst, 0, 4096, 3, 9, 1024, pool)
    pipe.step()
    while comm.incoming:
        comm.deliver()
        run_until(pipe, lambda: pipe.done or any(not r.done for r in comm.recvs))
    run_until(pipe, lambda: pipe.done)
    assert isinstance(pipe.error, errors.Aborted), pipe.error
    assert pipe.error.message == ("rank 3 gave up its transfer on MPI tag 9 at message 2 of 4: "
                                  "a message of 0 bytes came where 1024 were due")
    assert len(comm.recvs) == 4 and all(r.done for r in comm.recvs)  # the tag is left clean
    assert fake.copies["h2d"] == 1  # nothing after the short message went to the device
    fake.settle()
    assert pool.free == pool.allocated and pool.pending == 0


@pytest.mark.timeout(30)
def test_a_copy_to_the_device_that_fails_fails_the_receive_and_takes_every_message(fake):
    data = (np.arange(3 * 1024) % 13).astype(np.uint8)
    wire = Wire()
    fake.copy_faults["h2d"] = [FakeCudaError("cudaErrorECCUncorrectable")]
    send, recv, _, pools = staged_pair(fake, wire, data)
    run_pair(send, recv)
    assert send.error is None  # every message went: the sender's side is fine
    assert isinstance(recv.error, errors.Internal) and "cudaErrorECCUncorrectable" in recv.error.message
    assert not wire.queued and not wire.waiting
    fake.settle()
    assert all_back(*pools) and not fake.violations


def test_a_failed_copy_event_reports_its_error_and_frees_its_buffer(fake):
    src = fake.wrap(fake.array(np.arange(64, dtype=np.uint8)))
    pool = PinnedPool(fake, 64, depth=1)
    buf = pool.take()
    fake.copy_faults["d2h"] = [FakeCudaError("cudaErrorIllegalAddress")]
    event = fake.d2h_async(src, 0, buf)
    fake.settle()
    with pytest.raises(FakeCudaError, match="cudaErrorIllegalAddress"):
        fake.event_done(event)  # done, but not succeeded: never taken for a completed copy
    pool.give(buf, after=event)  # the copy is over: the buffer is free again, not held for ever
    assert pool.pending == 0 and pool.free == 1


@pytest.mark.timeout(30)
def test_a_direct_send_whose_producer_failed_tells_the_receiver(fake):
    # CUDA-aware MPI (the fake's device memory is host memory, so MPI can be
    # scripted on it). The producer's kernel fails: the tensor's ready event
    # completes with its error.
    arr = fake.array(np.zeros(3000, np.uint8))

    def kernel(out):
        raise FakeCudaError("cudaErrorIllegalInstruction")
    src = DeviceTensor(arr, fake, 0, fake.launch(kernel, arr))
    fake.settle()
    wire = Wire()
    dst = fake.empty(TensorMeta(np.uint8, (3000,)), 1)
    send = DirectSend(wire, FakeMPI, src, 1, 4, 1024)
    recv = DirectRecv(wire, FakeMPI, fake, dst, 3000, 0, 4, 1024)
    run_pair(send, recv)
    assert isinstance(send.error, SendAborted) and "cudaErrorIllegalInstruction" in send.error.message
    assert isinstance(recv.error, errors.Aborted) and "at message 1 of 3" in recv.error.message, recv.error
    assert not wire.queued and not wire.waiting


@pytest.mark.timeout(30)
def test_an_empty_tensor_reads_nothing_from_the_device(fake):
    fake.copy_faults["d2h"] = [FakeCudaError("cudaErrorIllegalAddress")]  # would fail any copy
    wire = Wire()
    send, recv, _, _ = staged_pair(fake, wire, np.zeros(0, np.uint8))
    run_pair(send, recv)
    assert send.error is None and recv.error is None
    assert fake.copies["d2h"] == 0 and fake.copy_faults["d2h"]  # no copy was even queued


def test_a_host_receive_fails_at_a_short_message_and_names_the_senders_error():
    # what the progress engine checks for each completed part of a receive
    buf = np.zeros(2500, np.uint8)
    op = Op(OpKind.RECV, None, None, buf, peer=2, tag=5, chunk=1024)
    op.parts = parts = [object(), object(), object()]  # its requests, in the order posted
    check_part(op, parts[2], 2500 - 2048)  # the last part is shorter by design
    check_part(op, parts[0], 1024)
    assert op.error is None
    first = aborts.message(1024, "staged send failed: cudaErrorIllegalAddress", first=True)
    buf[1024:1024 + first.size] = first
    check_part(op, parts[1], first.size)
    assert isinstance(op.error, errors.Aborted)
    assert op.error.message == ("rank 2 gave up its transfer on MPI tag 5 at message 2 of 3: "
                                "staged send failed: cudaErrorIllegalAddress")
    check_part(op, parts[2], 0)  # a later abort message keeps the first error
    assert "at message 2 of 3" in op.error.message


def test_abort_messages_are_always_shorter_than_their_chunk():
    for size in (1, 2, len(aborts.MAGIC), len(aborts.MAGIC) + 1, 4096):
        first = aborts.message(size, "x" * 5000, first=True)
        assert first.size < size and aborts.message(size, "why", first=False).size == 0
    assert aborts.message(1 << 20, "x" * 5000, first=True).size == len(aborts.MAGIC) + aborts.REASON_BYTES
