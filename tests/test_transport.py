"""The data-plane contract (rendezvous/transport): how Planes picks a plane for
each reply, and the inline plane that carries any tensor inside the gRPC reply."""

from __future__ import annotations


import numpy as np
import pytest
from google.protobuf import any_pb2

from rendezvous.codec.assembly import Assembly
from rendezvous.codec.parsing import ReplyHead, decode_inline, parse_response, parse_stream_frame
from rendezvous.codec.replies import descriptor_response, unary_response
from rendezvous.buffers import RecvBuffers
from rendezvous.devices import Devices, DeviceTensor
from rendezvous.errors import Internal
from rendezvous.testing.fakegpu import FakeBackend
from rendezvous.stats import Stats
from rendezvous.items import Received
from rendezvous.codec.tensors import TensorMeta
from rendezvous.transport import Arrival, DataPlane, Path, Planes, Reply, descriptor_type
from rendezvous.transport.inline import InlinePlane
from rendezvous.v1 import rendezvous_pb2 as pb

from conftest import run

pytestmark = pytest.mark.timeout(60)

URL_A = "type.googleapis.com/test.PlaneA"
URL_B = "type.googleapis.com/test.PlaneB"


def _inline(chunk_bytes: int = 1 << 20, devices: Devices | None = None, stats: Stats | None = None) -> InlinePlane:
    return InlinePlane(chunk_bytes=chunk_bytes, buffers=RecvBuffers(), devices=devices or Devices([]),
                       staging=(4096, 2), stats=stats or Stats())


def _committed_reply(tag: str) -> Reply:
    body = tag.encode()
    return Reply(Path.MPI, lambda call_id: iter((body,)), lambda: body, None)


class ScriptedPlane(DataPlane):
    """A descriptor plane whose answers the test sets; it records every call."""

    path = Path.MPI

    def __init__(self, url: str, answer: Reply | None = None, offered: bytes | None = None) -> None:
        self.descriptor_url = url  # per instance: two scripted planes must differ
        self.answer = answer
        self.offered = offered
        self.planned: list[Received] = []
        self.offers: list[object] = []
        self.received: list[tuple[bytes, object]] = []
        self.drained: list[bytes] = []
        self.closed = 0

    def offer(self, placement):
        self.offers.append(placement)
        return self.offered

    def plan(self, request, item):
        self.planned.append(item)
        return self.answer

    def receive(self, reply, head, placement):
        self.received.append((reply, placement))
        return Arrival(Path.MPI, value=self.descriptor_url, placed=True)

    def drain(self, reply, head):
        self.drained.append(reply)

    def close(self):
        self.closed += 1


def _descriptor(url: str, payload: bytes = b"\x08\x01") -> tuple[bytes, ReplyHead]:
    """A descriptor reply naming ``url`` in its transport_options, and its parsed head."""
    options = any_pb2.Any(type_url=url, value=payload).SerializeToString()
    buf = descriptor_response(TensorMeta(np.dtype(np.float32), (4,)), options)
    head = parse_response(buf)
    assert head.transport_options is not None
    return buf, head


def _inline_head(value: np.ndarray) -> tuple[bytes, ReplyHead]:
    buf = unary_response(Received(value, False))
    return buf, parse_response(buf)


# --- Planes ---------------------------------------------------------------------

def test_planes_requires_the_inline_plane_last():
    inline = _inline()
    with pytest.raises(ValueError, match="inline"):
        Planes([])
    with pytest.raises(ValueError, match="inline"):
        Planes([inline, ScriptedPlane(URL_A)])
    planes = Planes([ScriptedPlane(URL_A), inline])
    assert planes.inline is inline and planes.planes[-1] is inline
    with pytest.raises(ValueError, match="inline"):
        planes.register(_inline())  # a second inline plane is refused
    assert planes.planes[-1] is inline and len(planes.planes) == 2


def test_plan_asks_planes_in_order_and_falls_back_to_inline():
    first, second = ScriptedPlane(URL_A), ScriptedPlane(URL_B)
    planes = Planes([first, second, _inline()])
    value = np.arange(6, dtype=np.int32)
    item = Received(value, False)

    # nobody takes it: every plane was asked, in order, then the inline reply
    reply = planes.plan(pb.RecvTensorRequest(), item)
    assert [len(first.planned), len(second.planned)] == [1, 1]
    assert reply.path is Path.GRPC and reply.item is item and not reply.committed
    assert pb.RecvTensorResponse.FromString(reply.unary()).tensor.tensor_content == value.tobytes()

    # the second takes it; the first is still asked first
    second.answer = _committed_reply("second")
    reply = planes.plan(pb.RecvTensorRequest(), item)
    assert reply.unary() == b"second" and reply.committed
    assert [len(first.planned), len(second.planned)] == [2, 2]

    # the first takes it: the second is not asked at all
    first.answer = _committed_reply("first")
    assert planes.plan(pb.RecvTensorRequest(), item).unary() == b"first"
    assert [len(first.planned), len(second.planned)] == [3, 2]


def test_dead_tensors_always_go_inline():
    eager = ScriptedPlane(URL_A, answer=_committed_reply("descriptor"))
    planes = Planes([eager, _inline()])
    dead = Received(None, True)
    reply = planes.plan(pb.RecvTensorRequest(), dead)
    assert eager.planned == []  # not even asked
    assert reply.path is Path.GRPC and reply.item is dead
    assert pb.RecvTensorResponse.FromString(reply.unary()).is_dead
    frame = parse_stream_frame(next(reply.stream_frames(9)))
    assert frame.call_id == 9 and frame.head.is_dead and frame.head.tensor is None


def test_register_puts_a_plane_first_and_inline_stays_last():
    inline = _inline()
    old, new = ScriptedPlane(URL_A, answer=_committed_reply("old")), ScriptedPlane(URL_B,
                                                                                   answer=_committed_reply("new"))
    planes = Planes([old, inline])
    planes.register(new)
    assert planes.planes == (new, old, inline)
    assert planes.plan(pb.RecvTensorRequest(), Received(np.ones(2), False)).unary() == b"new"
    assert old.planned == []
    # the new plane's descriptors are recognized from now on
    buf, head = _descriptor(URL_B)
    assert planes.for_reply(buf, head) is new


def test_for_reply_picks_by_descriptor_type_and_refuses_unknown_ones():
    a, b, inline = ScriptedPlane(URL_A), ScriptedPlane(URL_B), _inline()
    planes = Planes([a, b, inline])
    buf_a, head_a = _descriptor(URL_A)
    buf_b, head_b = _descriptor(URL_B)
    assert planes.for_reply(buf_a, head_a) is a
    assert planes.for_reply(buf_b, head_b) is b
    buf, head = _inline_head(np.ones(3))
    assert head.transport_options is None
    assert planes.for_reply(buf, head) is inline
    unknown, head_u = _descriptor("type.googleapis.com/test.Nobody")
    with pytest.raises(Internal, match="test.Nobody"):
        planes.for_reply(unknown, head_u)
    # receive goes to the plane the descriptor names, with the placement
    arrival = planes.receive(buf_b, head_b, "GPU:0")
    assert arrival.value == URL_B and b.received == [(buf_b, "GPU:0")] and a.received == []
    with pytest.raises(Internal):
        planes.receive(unknown, head_u, None)


def test_drain_goes_to_the_named_plane_and_ignores_unknown_transports():
    a = ScriptedPlane(URL_A)
    planes = Planes([a, _inline()])
    buf_a, head_a = _descriptor(URL_A)
    planes.drain(buf_a, head_a)
    assert a.drained == [buf_a]
    unknown, head_u = _descriptor("type.googleapis.com/test.Nobody")
    planes.drain(unknown, head_u)  # no error: nothing of ours is in flight for it
    buf, head = _inline_head(np.ones(3))
    planes.drain(buf, head)  # the inline plane has nothing to drain
    assert a.drained == [buf_a]


def test_offer_returns_the_first_offer_that_is_not_none():
    silent, first, second = ScriptedPlane(URL_A), ScriptedPlane(URL_B, offered=b"b"), \
        ScriptedPlane("type.googleapis.com/test.C", offered=b"c")
    planes = Planes([silent, first, second, _inline()])
    assert planes.offer("GPU:1") == b"b"
    assert silent.offers == ["GPU:1"] and first.offers == ["GPU:1"]
    assert second.offers == []  # a request carries one Any: the rest are not asked
    assert Planes([silent, _inline()]).offer(None) is None


def test_close_closes_every_plane():
    a, b = ScriptedPlane(URL_A), ScriptedPlane(URL_B)
    Planes([a, b, _inline()]).close()
    assert (a.closed, b.closed) == (1, 1)


def test_descriptor_type_reads_field_one_of_the_any():
    buf, head = _descriptor(URL_A, payload=b"\x01\x02\x03")
    assert descriptor_type(buf, head.transport_options) == URL_A
    # value before type_url: the order of fields does not matter
    options = any_pb2.Any(value=b"xyz").SerializeToString() + any_pb2.Any(type_url=URL_B).SerializeToString()
    buf = descriptor_response(TensorMeta(np.dtype(np.int8), (1,)), options)
    assert descriptor_type(buf, parse_response(buf).transport_options) == URL_B
    # no type_url at all
    options = any_pb2.Any(value=b"xyz").SerializeToString()
    buf = descriptor_response(TensorMeta(np.dtype(np.int8), (1,)), options)
    assert descriptor_type(buf, parse_response(buf).transport_options) == ""


def test_reply_committed_is_item_is_none():
    assert _committed_reply("x").committed
    assert not Reply(Path.GRPC, lambda c: iter(()), lambda: b"", Received(1, False)).committed


# --- InlinePlane: producer ----------------------------------------------------

def _decode_frames(msgs: list[bytes], call_id: int, buffers: RecvBuffers | None = None) -> np.ndarray:
    """What a consumer makes of a reply's frames: a view or an assembled array."""
    first = parse_stream_frame(msgs[0])
    assert first.call_id == call_id and first.head is not None and first.chunk is None
    got = decode_inline(msgs[0], first.head.tensor, None, buffers)
    if not isinstance(got, Assembly):
        assert len(msgs) == 1
        return got
    for i, buf in enumerate(msgs[1:], 1):
        frame = parse_stream_frame(buf)
        assert frame.call_id == call_id and frame.head is None and frame.chunk is not None
        a, b = frame.chunk
        assert got.add(memoryview(buf)[a:b]) == (i == len(msgs) - 1)
    return got.result()


@pytest.mark.parametrize("value", [
    np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    np.arange(1000, dtype=np.int64),
    np.arange(20, dtype=np.complex64)[::2],  # not contiguous
    np.array(7.25),
    np.zeros((0, 3), np.int16),
    np.array([b"a", b"", b"\x00\xff"], dtype=object),
])
def test_inline_plan_frames_decode_back(value):
    plane = _inline(chunk_bytes=64)
    item = Received(value, False)
    reply = plane.plan(pb.RecvTensorRequest(), item)
    assert reply.path is Path.GRPC and reply.item is item and reply.prepare is None and not reply.committed
    msgs = list(reply.stream_frames(5))
    if value.dtype != object:
        assert len(msgs) == max(1, -(-value.nbytes // 64))  # chunked by chunk_bytes
    got = _decode_frames(msgs, 5)
    assert got.dtype == value.dtype and got.shape == value.shape
    assert got.tolist() == value.tolist()
    unary = pb.RecvTensorResponse.FromString(reply.unary())
    assert not unary.is_dead and [d.size for d in unary.tensor.tensor_shape.dim] == list(value.shape)


def test_inline_plan_of_a_gpu_tensor_prepares_a_host_copy():
    async def main():
        fake = FakeBackend()
        stats = Stats()
        plane = _inline(chunk_bytes=100, devices=Devices([fake]), stats=stats)
        host = np.arange(300, dtype=np.float32).reshape(10, 30)
        tensor = fake.wrap(fake.array(host))
        assert isinstance(tensor, DeviceTensor)
        item = Received(tensor, False)
        reply = plane.plan(pb.RecvTensorRequest(), item)
        assert reply.prepare is not None and reply.item is item
        with pytest.raises(AssertionError, match="prepared"):
            reply.unary()  # unusable before prepare
        assert stats.gpu_snapshot()["to_host"] == 0
        ready = await reply.prepare()
        assert stats.gpu_snapshot()["to_host"] == 1
        assert fake.copies["d2h"] == -(-host.nbytes // 4096)  # through staging chunks of 4096 bytes
        assert ready.prepare is None and ready.path is Path.GRPC
        assert ready.item is item  # what goes back to the table is the device tensor, not the copy
        msgs = list(ready.stream_frames(3))
        assert len(msgs) == -(-host.nbytes // 100)
        np.testing.assert_array_equal(_decode_frames(msgs, 3), host)
        unary = pb.RecvTensorResponse.FromString(ready.unary())
        assert unary.tensor.tensor_content == host.tobytes()
    run(main())


# --- InlinePlane: consumer ----------------------------------------------------

def test_inline_receive_one_frame_is_a_view():
    plane = _inline(chunk_bytes=1 << 20)
    value = np.arange(12, dtype=np.float64).reshape(3, 4)
    (msg,) = list(plane.plan(pb.RecvTensorRequest(), Received(value, False)).stream_frames(1))
    frame = parse_stream_frame(msg)
    arrival = plane.receive(msg, frame.head, None)
    assert arrival.path is Path.GRPC and arrival.assembly is None and arrival.pending is None
    assert not arrival.placed
    np.testing.assert_array_equal(arrival.value, value)
    assert np.shares_memory(arrival.value, np.frombuffer(msg, np.uint8))  # a view, no copy


def test_inline_receive_chunked_reply_is_an_assembly():
    plane = _inline(chunk_bytes=40)
    value = np.arange(25, dtype=np.int32)  # 100 bytes: 3 frames
    msgs = list(plane.plan(pb.RecvTensorRequest(), Received(value, False)).stream_frames(2))
    assert len(msgs) == 3
    frame = parse_stream_frame(msgs[0])
    arrival = plane.receive(msgs[0], frame.head, None)
    assert arrival.value is None and isinstance(arrival.assembly, Assembly)
    done = []
    for msg in msgs[1:]:
        a, b = parse_stream_frame(msg).chunk
        done.append(arrival.assembly.add(memoryview(msg)[a:b]))
    assert done == [False, True]
    np.testing.assert_array_equal(arrival.assembly.result(), value)


def test_inline_receive_without_a_tensor_is_internal():
    plane = _inline()
    buf = unary_response(Received(None, True))
    head = parse_response(buf)
    with pytest.raises(Internal, match="neither"):
        plane.receive(buf, head, None)
