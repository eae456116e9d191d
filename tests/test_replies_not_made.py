"""A reply the producer takes a tensor for and then cannot make (a GPU
tensor's copy to the host that fails, a plane that cannot plan it: all MPI
tags to the consumer in flight) sends nothing: the call is answered with the
error, and the tensor goes back to the table, so the next recv (or a retry
of the same request_id) gets it, once. Every way a reply is made: a tensor
there when asked, one that came while the recv waited, a batch's key (taken
at once, or answered inside the send that produced it), and a unary call."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from google.protobuf import any_pb2

from rendezvous import errors
from rendezvous.codec.replies import descriptor_response, with_call_id
from rendezvous.devices import Devices
from rendezvous.errors import Internal
from rendezvous.testing.fakegpu import FakeBackend
from rendezvous.codec.tensors import TensorMeta
from rendezvous.transport import Carry, DataPlane, Path, Planes, Reply
from rendezvous.v1 import rendezvous_pb2 as pb

from conftest import run, until
from test_servicer import K, _tensors, _waiters, recv, recv_many, serving

pytestmark = pytest.mark.timeout(60)

#: how the call asks: a recv whose tensor is there, one that waits for it, a
#: batch's key there or waited for (small: it would travel in a group reply,
#: but a GPU tensor never does; a host one is planned alone when too large)
WAYS = ["ready", "waited", "batch-ready", "batch-waited"]


async def _ask(h, way: str, name: str, request_id: int, produce) -> object:
    """Ask for ``K(name)`` the ``way`` given (``produce()`` sends the tensor: before
    the request, or once it waits); the call's outcome."""
    s = h.stream()
    request = (recv_many(1, [K(name)], request_ids=[request_id]) if way.startswith("batch")
               else recv(1, K(name), request_id=request_id))
    if way.endswith("ready"):
        produce()
        await s.send(request)
    else:
        await s.send(request)
        await until(lambda: _waiters(h.table) == {K(name): 1}, what="the recv to wait")
        produce()
    return await s.result(1)


async def _once_more(h, name: str, request_id: int) -> object:
    """The tensor of ``K(name)`` for ``request_id`` (a retry of the failed id, or a
    new recv), asked on a new stream; nothing is left in the table after it."""
    s = h.stream()
    await s.send(recv(1, K(name), request_id=request_id))
    got = await s.result(1)
    assert _tensors(h.table) == {}, "the tensor was in the table twice"
    return got


def _failing_copy(fake: FakeBackend) -> list[BaseException]:
    """Make the fake's next device-to-host copies fail, one per error in the list returned."""
    real = fake.to_host
    errors_: list[BaseException] = []

    def to_host(src, pool):
        if errors_:
            raise errors_.pop(0)
        return real(src, pool)

    fake.to_host = to_host  # type: ignore[method-assign]
    return errors_


@pytest.mark.parametrize("way", WAYS)
def test_a_gpu_tensor_whose_copy_to_the_host_fails_goes_back_to_the_table(way):
    async def main():
        fake = FakeBackend()
        async with serving(devices=Devices([fake])) as h:
            host = np.arange(64, dtype=np.float32)
            fails = _failing_copy(fake)
            fails.append(RuntimeError("cudaErrorLaunchFailure: unspecified launch failure"))
            got = await _ask(h, way, "g", 61, lambda: h.table.send(1, K("g"), fake.wrap(fake.array(host))))
            assert isinstance(got, errors.Internal) and "launch failure" in got.message, got
            await until(lambda: _tensors(h.table) == {K("g"): 1}, timeout=5,
                        what="the tensor whose reply failed to go back to the table")
            assert not h.servicer.retry.has(61)
            # the retry of the failed id (the consumer counts it settled, but may
            # ask with it) takes it afresh; then it is gone
            np.testing.assert_array_equal(await _once_more(h, "g", 61), host)
    run(main(), 30)


def test_a_unary_reply_whose_gpu_copy_fails_leaves_the_tensor_for_the_next_recv():
    async def main():
        fake = FakeBackend()
        async with serving(devices=Devices([fake])) as h:
            host = np.arange(10, dtype=np.float32)
            _failing_copy(fake).append(RuntimeError("cudaErrorIllegalAddress"))
            h.table.send(1, K("u"), fake.wrap(fake.array(host)))
            request = pb.RecvTensorRequest(step_id=1, rendezvous_key=K("u"), request_id=62).SerializeToString()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.unary()(request)
            assert info.value.code() == grpc.StatusCode.INTERNAL
            assert _tensors(h.table) == {K("u"): 1}, "the unary reply's tensor was lost"
            response = pb.RecvTensorResponse.FromString(await h.unary()(request))
            assert response.tensor.tensor_content == host.tobytes()
            assert _tensors(h.table) == {}
    run(main(), 30)


class _RefusingPlane(DataPlane):
    """A plane that carries every host tensor, as the MPI plane does on its
    optimal path, and fails to plan the next ``refusals`` replies: all MPI tags
    to the consumer in flight (Internal), or (``broken_frames``) a descriptor
    planned, its transfer's tag taken, whose frames cannot be made."""

    path = Path.MPI
    descriptor_url = "type.googleapis.com/test.Refusing"

    def __init__(self, refusals: int, broken_frames: bool = False) -> None:
        self.refusals = refusals
        self.broken_frames = broken_frames
        self.released = 0
        self.started = 0

    def plan(self, request, item):
        options = any_pb2.Any(type_url=self.descriptor_url, value=b"\x08\x01").SerializeToString()
        if self.refusals and not self.broken_frames:
            self.refusals -= 1
            raise Internal("all 32767 MPI tags to rank 1 are in flight")
        carry = Carry(options, self._start, self._release)
        response = descriptor_response(TensorMeta(item.value.dtype, item.value.shape), options)
        if self.refusals:
            self.refusals -= 1

            def broken(call_id):
                raise Internal("descriptor frame cannot be made")
            return Reply(Path.MPI, broken, lambda: response, item, carry=carry)
        return Reply(Path.MPI, lambda call_id: iter((with_call_id(call_id, response),)),
                     lambda: response, item, carry=carry)

    def _start(self):
        self.started += 1

    def _release(self):
        self.released += 1

    def receive(self, reply, head, placement):
        raise AssertionError("the producer never receives")


@pytest.mark.parametrize("broken_frames", [False, True], ids=["plan-fails", "frames-fail"])
@pytest.mark.parametrize("way", WAYS)
def test_a_reply_whose_planning_fails_puts_its_tensor_back(way, broken_frames):
    async def main():
        async with serving(fusion=(0, 0)) as h:
            plane = _RefusingPlane(1, broken_frames)
            h.servicer.planes = Planes([plane, *h.servicer.planes.planes])
            value = np.arange(32, dtype=np.float32)
            got = await _ask(h, way, "m", 71, lambda: h.table.send(1, K("m"), value))
            assert isinstance(got, errors.Internal), got
            await until(lambda: _tensors(h.table) == {K("m"): 1}, timeout=5,
                        what="the tensor whose reply failed to go back to the table")
            assert plane.released == (1 if broken_frames else 0) and plane.started == 0
            assert not h.servicer.retry.has(71)
            got = await _once_more(h, "m", 72)
            assert isinstance(got, tuple) and got[0] == "descriptor" and plane.started == 1, got
    run(main(), 30)
