"""The GPU staging pipelines, stepped by hand against a scripted communicator:
chunk order, overlap of copies with messages, pipeline depth, buffer reuse,
failures. (test_gpu.py runs them over real MPI.)"""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest

from rendezvous.devices import PinnedPool
from rendezvous.fakegpu import FakeBackend
from rendezvous.mpi.staging import DirectSend, StagedRecv, StagedSend
from rendezvous.tensors import TensorMeta


class FakeMPIError(Exception):
    def Get_error_string(self):
        return "scripted failure"


class FakeMPI:
    BYTE = "byte"
    Exception = FakeMPIError


class Req:
    """Compares as mpi4py's requests do: by handle, and a completed request's
    handle is null, so every completed request equals every other."""

    _handles = itertools.count(1)

    def __init__(self, kind, buf, done=False):
        self.kind, self.buf, self.done = kind, buf, done
        self.handle = next(Req._handles)

    def Test(self):
        if self.done:
            self.handle = 0  # MPI_REQUEST_NULL
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
        req.done = True


def run_until(pipe, cond, timeout=20.0):
    """Step ``pipe`` until ``cond()`` holds; the fake's copies finish on their own
    threads, so this is a condition wait with a deadline, not a step count."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("pipeline made no progress")
        if not pipe.step():
            time.sleep(0)  # let the copy threads run


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
