"""The data-plane contract (rendezvous/transport/), checked against every plane.

:func:`check_data_plane` is what any :class:`~rendezvous.transport.DataPlane`
must do, as trio's ``check_one_way_stream`` is what any stream must: run
here against the inline plane and against the MPI plane (a real one: MPI
in this process, a rank sending to itself through its progress engine).

The contract: a plane either declines a tensor (``plan`` returns None) or
gives a reply counted under its own path, committed exactly when its bytes
are already on their way; its first frame names the plane (by descriptor
type, or none for inline); ``receive`` gives exactly one of a value, an
assembly the later frames complete, or an awaitable for bytes that come
another way; every tensor arrives whole with its dtype and shape, however
many replies are in flight and in whatever order they are received; a
reply nobody waits for any more can be drained, and its bytes never reach
a later transfer; ``close`` may be called twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from rendezvous.codec import wire
from rendezvous.codec.parsing import iter_stream_frames
from rendezvous.buffers import RecvBuffers
from rendezvous.config import Config
from rendezvous.devices import Devices
from rendezvous.keys import TaskName
from rendezvous.stats import Stats
from rendezvous.items import Received
from rendezvous.transport import DataPlane, Planes
from rendezvous.transport.inline import InlinePlane
from rendezvous.v1 import rendezvous_pb2 as pb

from conftest import run

pytestmark = pytest.mark.timeout(60)


@dataclass
class PlaneUnderTest:
    """A plane wired to itself: it produces replies and receives them."""

    plane: DataPlane
    planes: Planes  # how a server holds it (the inline plane last)
    #: whether the plane is meant to carry a tensor (else it must decline it)
    carries: Callable[[np.ndarray], bool]


TENSORS = [
    np.arange(6, dtype=np.float32).reshape(2, 3),
    np.array(3.5, dtype=np.float64),  # 0-d
    np.zeros((0, 4), np.int16),  # no elements
    np.arange(700, dtype=np.int64),  # above a kilobyte
    (np.arange(1 << 20, dtype=np.uint32) * 2654435761).astype(np.uint32),  # 4 MiB: chunked, or one transfer
    np.array([[True, False], [False, True]]),
    (np.arange(300) + 1j * np.arange(300)).astype(np.complex64),
    np.array([b"strings", b"", b"\x00too"], dtype=object),
]


def _request(put: PlaneUnderTest, request_id: int = 0) -> pb.RecvTensorRequest:
    req = pb.RecvTensorRequest(step_id=1, rendezvous_key="k", request_id=request_id)
    offer = put.planes.offer(None)
    if offer is not None:
        req.transport_options.ParseFromString(offer)
    return req


def _written(frames_out: list) -> list[bytes]:
    """A reply's frames as a stream writes them: a large one is made as pieces
    (``wire.Pieces``) and joined by the writer."""
    return [f.join() if isinstance(f, wire.Pieces) else f for f in frames_out]


async def _arrive(put: PlaneUnderTest, frames_out: list, call_id: int) -> tuple[Any, Any]:
    """Receive one reply's frames as a consumer's stream reader does: (the value, the Arrival)."""
    frames_out = _written(frames_out)
    first = frames_out[0]
    [head_frame] = list(iter_stream_frames(first))
    assert head_frame.call_id == call_id and head_frame.head is not None
    head = head_frame.head
    plane = put.planes.for_reply(first, head)
    arrival = plane.receive(first, head, None)
    given = [arrival.value is not None, arrival.assembly is not None, arrival.pending is not None]
    assert sum(given) == 1 or (head.tensor is not None and sum(given) == 0 and arrival.value is None), arrival
    if arrival.pending is not None:
        assert len(frames_out) == 1, "a reply whose bytes come another way has one frame"
        return await arrival.pending, arrival
    if arrival.assembly is not None:
        done = False
        for more in frames_out[1:]:
            [chunk] = list(iter_stream_frames(more))
            assert chunk.call_id == call_id and chunk.chunk is not None
            a, b = chunk.chunk
            done = arrival.assembly.add(memoryview(more)[a:b])
        assert done, "the chunks did not complete the tensor"
        return arrival.assembly.result(), arrival
    assert len(frames_out) == 1
    return arrival.value, arrival


def _handed(reply: Any, call_id: int) -> list:
    """A reply's frames as its stream hands them over: a descriptor's transfer
    (``carry``) starts as its first frame leaves."""
    out = list(reply.stream_frames(call_id))
    if reply.carry is not None:
        reply.carry.start()
    return out


def _same(got: Any, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape, (got, want)
    if want.dtype == object:
        assert list(got.ravel()) == list(want.ravel())
    else:
        assert got.tobytes() == want.tobytes()


async def check_data_plane(put: PlaneUnderTest) -> None:
    """The contract (see the module's notes), against one plane."""
    plane = put.plane
    assert isinstance(plane.path, str) and plane.path
    # 1. each tensor: declined, or carried whole under the plane's path
    for i, value in enumerate(TENSORS):
        item = Received(value, False)
        reply = plane.plan(_request(put, 100 + i), item)
        if not put.carries(value):
            assert reply is None, f"{plane.path} took a tensor it cannot carry: {value.dtype} {value.shape}"
            continue
        assert reply is not None, f"{plane.path} declined {value.dtype} {value.shape}"
        assert reply.path == plane.path
        assert reply.committed == (reply.item is None)
        if reply.item is not None:
            assert reply.item is item  # what goes back to the table if the reply is never started
        out = _handed(reply, 7 + i)
        got, arrival = await _arrive(put, out, 7 + i)
        assert arrival.path == plane.path
        _same(got, value)
    # 2. many replies in flight, received in the reverse order: none gets another's bytes
    carried = [v for v in TENSORS if put.carries(v)]
    batch = [np.full(int(v.size), n, v.dtype).reshape(v.shape) if v.dtype != object else v
             for n, v in enumerate(carried, 1)]
    pending = [(call_id, _handed(plane.plan(_request(put), Received(v, False)), call_id), v)
               for call_id, v in enumerate(batch, 50)]
    for call_id, out, v in reversed(pending):
        got, _ = await _arrive(put, out, call_id)
        _same(got, v)
    # 3. a reply nobody waits for is drained; the next transfer gets its own bytes
    big = next(v for v in carried if v.nbytes >= 4 << 20)
    first = plane.plan(_request(put), Received(np.full(big.shape, 0xAB, big.dtype), False))
    out = _written(_handed(first, 90))
    [head_frame] = list(iter_stream_frames(out[0]))
    put.planes.drain(out[0], head_frame.head)
    second = np.full(big.shape, 0x11, big.dtype)
    got, _ = await _arrive(put, _handed(plane.plan(_request(put), Received(second, False)), 91), 91)
    _same(got, second)
    # 4. closing twice is fine
    plane.close()
    plane.close()


# -- the planes ------------------------------------------------------------------------


def _inline(chunk_bytes: int = 256 << 10) -> InlinePlane:
    return InlinePlane(chunk_bytes=chunk_bytes, buffers=RecvBuffers(), devices=Devices([]),
                       staging=(4096, 2), stats=Stats())


def test_the_inline_plane_keeps_the_contract():
    async def main():
        plane = _inline()
        await check_data_plane(PlaneUnderTest(plane, Planes([plane]), carries=lambda v: True))
    run(main())


@contextlib.asynccontextmanager
async def _mpi_plane(**overrides: Any) -> AsyncIterator[Any]:
    pytest.importorskip("mpi4py")
    from rendezvous.mpi.engine import ProgressEngine
    from rendezvous.mpi.plane import MpiPlane
    from rendezvous.mpi.world import MpiWorld

    config = Config.load({"mpi_optimal_path": True, **overrides}, env={})
    world = MpiWorld.join()
    engine = ProgressEngine(poll_min_us=5, poll_max_us=200)
    engine.start()
    try:
        await engine.call(lambda: world.exchange(TaskName("worker", 0, 0), "127.0.0.1:1"))
        engine.attach(world.comm)
        yield MpiPlane(world, engine, config, Stats(), buffers=RecvBuffers(), devices=Devices([]))
    finally:
        engine.stop()


def test_the_mpi_plane_keeps_the_contract():
    """A rank sending to itself: descriptors, then the bytes by MPI. It carries
    memcpy-able tensors of at least the threshold; the rest go inline."""
    async def main():
        async with _mpi_plane() as plane:
            threshold = plane.config.mpi_threshold
            put = PlaneUnderTest(plane, Planes([plane, _inline()]),
                                 carries=lambda v: v.dtype != object and v.nbytes >= threshold)
            await check_data_plane(put)
    run(main())


def test_the_suite_catches_a_plane_that_breaks_the_contract():
    """The suite can fail: a plane whose replies flip a bit, and a plane that takes
    what it is meant to decline."""
    class Corrupting(InlinePlane):
        def receive(self, reply, head, placement):
            arrival = super().receive(reply, head, placement)
            if arrival.value is not None and arrival.value.nbytes > 1 and arrival.value.dtype != object:
                value = arrival.value.copy()
                value.reshape(-1).view(np.uint8)[0] ^= 1
                return arrival._replace(value=value)
            return arrival

    async def main():
        bad = Corrupting(chunk_bytes=256 << 10, buffers=RecvBuffers(), devices=Devices([]), staging=(4096, 2),
                         stats=Stats())
        with pytest.raises(AssertionError):
            await check_data_plane(PlaneUnderTest(bad, Planes([bad]), carries=lambda v: True))
        plane = _inline()
        with pytest.raises(AssertionError, match="took a tensor it cannot carry"):
            await check_data_plane(PlaneUnderTest(plane, Planes([plane]), carries=lambda v: v.dtype != object))
    run(main())
