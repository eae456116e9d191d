"""Hand-encoded RecvTensor replies and stream frames (rendezvous/codec/replies.py, parsing.py, requests.py):
what the producer writes is what protobuf and the consumer read back."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from google.protobuf import any_pb2

from rendezvous import errors
from rendezvous.codec import allocator, replies, wire
from rendezvous.codec.allocator import prime_allocator
from rendezvous.codec.assembly import Assembly
from rendezvous.codec.parsing import decode_inline, iter_stream_frames, parse_response, parse_stream_frame
from rendezvous.codec.replies import batch_responses, descriptor_response, error_frame, payload_view, stream_frames, unary_response
from rendezvous.codec.requests import batch_requests, cancel_request, recv_request
from rendezvous.errors import InvalidArgument, RendezvousError, ResourceExhausted
from rendezvous.items import Received
from rendezvous.codec.tensors import TensorMeta, decode_meta, decode_tensor, encode_meta, encode_tensor
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import tensor_pb2

pytestmark = pytest.mark.timeout(30)


def _skipped_field(n: int) -> bytes:
    """``n`` bytes (2 or more) of a field no reader knows (field 15, length-delimited): skipped."""
    return bytes((15 << 3 | 2, n - 2)) + bytes(n - 2)


def _live(value) -> Received:
    return Received(value, False)


def _strings(items, shape=None) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = items
    return arr.reshape(shape if shape is not None else (len(items),))


def _reassemble(msgs: list[bytes], call_id: int):
    """What the peer client does with the frames of one reply: the dead flag and
    the value (a view for one frame, an Assembly's result for several)."""
    assembly = None
    value = None
    dead = None
    for i, buf in enumerate(msgs):
        frame = parse_stream_frame(buf)
        assert frame.call_id == call_id
        assert frame.error is None
        if i == 0:
            assert frame.head is not None and frame.chunk is None
            dead = frame.head.is_dead
            if dead:
                assert frame.head.tensor is None
                assert len(msgs) == 1
                return True, None
            got = decode_inline(buf, frame.head.tensor)
            if isinstance(got, Assembly):
                assembly = got
            else:
                value = got
                assert len(msgs) == 1, "a complete first frame must be the only one"
        else:
            assert frame.head is None and frame.chunk is not None
            assert assembly is not None
            a, b = frame.chunk
            done = assembly.add(memoryview(buf)[a:b])
            assert done == (i == len(msgs) - 1), f"frame {i} of {len(msgs)} completed={done}"
            if done:
                value = assembly.result()
    assert value is not None
    return dead, value


# --- unary replies ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "int64", "uint16", "bool", "complex64"])
def test_unary_response_parses_with_protobuf(dtype):
    arr = (np.arange(24) % 7).astype(dtype).reshape(2, 3, 4)
    data = unary_response(_live(arr), send_start_micros=123456)
    msg = pb.RecvTensorResponse.FromString(data)
    assert msg.is_dead is False
    assert msg.send_start_micros == 123456
    assert not msg.HasField("transport_options")
    assert [d.size for d in msg.tensor.tensor_shape.dim] == [2, 3, 4]
    assert msg.tensor.tensor_content == arr.tobytes()
    # and the tensor in it is the one our codec writes
    assert msg.tensor == tensor_pb2.TensorProto.FromString(encode_tensor(arr))

    head = parse_response(data)
    assert (head.is_dead, head.send_start_micros, head.transport_options) == (False, 123456, None)
    back = decode_tensor(data, *head.tensor)
    assert back.dtype == arr.dtype and back.shape == arr.shape
    np.testing.assert_array_equal(back, arr)


def test_unary_response_negative_send_start_micros():
    data = unary_response(_live(np.array([1.0], np.float32)), send_start_micros=-5)
    assert pb.RecvTensorResponse.FromString(data).send_start_micros == -5
    assert parse_response(data).send_start_micros == -5


def test_unary_response_dead():
    data = unary_response(Received(None, True), send_start_micros=7)
    msg = pb.RecvTensorResponse.FromString(data)
    assert msg.is_dead is True and msg.send_start_micros == 7
    assert not msg.HasField("tensor")
    head = parse_response(data)
    assert head.is_dead is True and head.tensor is None and head.send_start_micros == 7


def test_unary_response_empty_tensor():
    arr = np.zeros((0, 5), np.float32)
    data = unary_response(_live(arr))
    msg = pb.RecvTensorResponse.FromString(data)
    assert [d.size for d in msg.tensor.tensor_shape.dim] == [0, 5]
    assert msg.tensor.tensor_content == b""
    head = parse_response(data)
    back = decode_inline(data, head.tensor)
    assert isinstance(back, np.ndarray) and back.shape == (0, 5) and back.dtype == np.float32


def test_unary_response_scalar():
    arr = np.array(2.5, np.float64)
    data = unary_response(_live(arr))
    msg = pb.RecvTensorResponse.FromString(data)
    assert msg.tensor.HasField("tensor_shape") and len(msg.tensor.tensor_shape.dim) == 0
    back = decode_inline(data, parse_response(data).tensor)
    assert back.shape == () and back == 2.5


def test_unary_response_strings():
    arr = _strings([b"alpha", b"", b"\x00\xffz"], (3,))
    data = unary_response(_live(arr))
    msg = pb.RecvTensorResponse.FromString(data)
    assert list(msg.tensor.string_val) == [b"alpha", b"", b"\x00\xffz"]
    back = decode_inline(data, parse_response(data).tensor)
    assert back.dtype == object and back.tolist() == [b"alpha", b"", b"\x00\xffz"]


def test_unary_response_non_contiguous():
    base = np.arange(48, dtype=np.int32).reshape(6, 8)
    arr = base[::2, 1::3]
    assert not arr.flags.c_contiguous
    data = unary_response(_live(arr))
    msg = pb.RecvTensorResponse.FromString(data)
    assert msg.tensor.tensor_content == np.ascontiguousarray(arr).tobytes()
    back = decode_inline(data, parse_response(data).tensor)
    np.testing.assert_array_equal(back, arr)


def test_unary_response_big_endian_is_sent_little_endian():
    arr = np.arange(6, dtype=">i4").reshape(2, 3)
    data = unary_response(_live(arr))
    back = decode_inline(data, parse_response(data).tensor)
    np.testing.assert_array_equal(back, arr)
    assert back.dtype == np.dtype("<i4")


def test_unary_response_refuses_more_than_one_message(monkeypatch):
    arr = np.arange(64, dtype=np.uint8)
    monkeypatch.setattr(replies, "MAX_MESSAGE_BYTES", 63)
    with pytest.raises(ResourceExhausted, match="RecvTensorStream"):
        unary_response(_live(arr))
    # a dead reply carries no tensor and is never refused
    assert pb.RecvTensorResponse.FromString(unary_response(Received(None, True))).is_dead
    monkeypatch.setattr(replies, "MAX_MESSAGE_BYTES", 64 + 64)  # header included: fits
    data = unary_response(_live(arr))
    assert pb.RecvTensorResponse.FromString(data).tensor.tensor_content == arr.tobytes()


def test_unary_response_refuses_large_string_tensor(monkeypatch):
    monkeypatch.setattr(replies, "MAX_MESSAGE_BYTES", 10)
    with pytest.raises(ResourceExhausted):
        unary_response(_live(_strings([b"x" * 20])))


def test_stream_frames_refuses_large_string_tensor(monkeypatch):
    monkeypatch.setattr(replies, "MAX_MESSAGE_BYTES", 10)
    with pytest.raises(ResourceExhausted, match="string tensor"):
        list(stream_frames(1, _live(_strings([b"x" * 20])), chunk_bytes=1024))


# --- stream replies ---------------------------------------------------------------

def test_stream_frames_dead():
    msgs = list(stream_frames(9, Received(None, True), chunk_bytes=1024, send_start_micros=11))
    assert len(msgs) == 1
    msg = pb.StreamResponse.FromString(msgs[0])
    assert msg.call_id == 9 and msg.response.is_dead and msg.response.send_start_micros == 11
    assert not msg.response.HasField("tensor")
    assert _reassemble(msgs, 9) == (True, None)


def test_stream_frames_empty_tensor():
    arr = np.zeros((3, 0), np.int16)
    msgs = list(stream_frames(2, _live(arr), chunk_bytes=1024))
    assert len(msgs) == 1
    msg = pb.StreamResponse.FromString(msgs[0])
    assert [d.size for d in msg.response.tensor.tensor_shape.dim] == [3, 0]
    assert msg.response.tensor.tensor_content == b"" and msg.chunk == b""
    dead, back = _reassemble(msgs, 2)
    assert dead is False and back.shape == (3, 0) and back.dtype == np.int16


@pytest.mark.parametrize("nbytes_vs_chunk", ["smaller", "equal"])
def test_stream_frames_one_frame(nbytes_vs_chunk):
    arr = np.arange(256, dtype=np.float32).reshape(16, 16)  # 1024 bytes
    chunk = 4096 if nbytes_vs_chunk == "smaller" else arr.nbytes
    msgs = list(stream_frames(3, _live(arr), chunk_bytes=chunk, send_start_micros=99))
    assert len(msgs) == 1
    msg = pb.StreamResponse.FromString(msgs[0])
    assert msg.call_id == 3 and not msg.response.is_dead and msg.response.send_start_micros == 99
    assert msg.response.tensor.tensor_content == arr.tobytes()
    dead, back = _reassemble(msgs, 3)
    assert dead is False
    np.testing.assert_array_equal(back, arr)


@pytest.mark.parametrize("dtype,size,chunk", [
    ("int64", 125, 300),    # 1000 bytes: 3 full chunks and a short one, chunks not item-aligned
    ("float32", 256, 256),  # 1024 bytes: exactly 4 chunks
    ("int8", 4099, 1024),   # a last chunk of 3 bytes
    ("uint8", 7, 1),        # one byte per frame
])
def test_stream_frames_chunked(dtype, size, chunk):
    rng = np.random.default_rng(size)
    arr = rng.integers(-100, 100, size).astype(dtype).reshape(-1, 1)
    payload = arr.tobytes()
    msgs = list(stream_frames(77, _live(arr), chunk_bytes=chunk))
    expected_frames = -(-len(payload) // chunk)
    assert len(msgs) == expected_frames

    first = pb.StreamResponse.FromString(msgs[0])
    assert first.call_id == 77
    assert first.response.tensor.tensor_content == payload[:chunk]
    assert [d.size for d in first.response.tensor.tensor_shape.dim] == list(arr.shape)
    rest = [pb.StreamResponse.FromString(m) for m in msgs[1:]]
    assert all(r.call_id == 77 and not r.HasField("response") for r in rest)
    assert all(len(r.chunk) <= chunk for r in rest)
    assert first.response.tensor.tensor_content + b"".join(r.chunk for r in rest) == payload

    dead, back = _reassemble(msgs, 77)
    assert dead is False and back.dtype == arr.dtype and back.shape == arr.shape
    np.testing.assert_array_equal(back, arr)


def test_stream_frames_chunked_non_contiguous():
    base = np.arange(200, dtype=np.float64).reshape(10, 20)
    arr = base.T[::2]  # a strided view: Fortran-ish and sliced
    assert not arr.flags.c_contiguous
    msgs = list(stream_frames(5, _live(arr), chunk_bytes=96))
    assert len(msgs) == -(-arr.nbytes // 96)
    dead, back = _reassemble(msgs, 5)
    np.testing.assert_array_equal(back, arr)


def test_stream_frames_strings_are_one_frame():
    arr = _strings([b"a" * 50, b"bc", b"", b"d" * 300], (2, 2))
    msgs = list(stream_frames(4, _live(arr), chunk_bytes=16))  # chunk_bytes does not split strings
    assert len(msgs) == 1
    msg = pb.StreamResponse.FromString(msgs[0])
    assert msg.call_id == 4 and list(msg.response.tensor.string_val) == arr.reshape(-1).tolist()
    dead, back = _reassemble(msgs, 4)
    assert back.dtype == object and back.shape == (2, 2)
    assert back.tolist() == arr.tolist()


def test_stream_frames_call_id_zero_is_written():
    msgs = list(stream_frames(0, _live(np.array([1, 2], np.int32)), chunk_bytes=4))
    assert len(msgs) == 2
    for m in msgs:
        assert parse_stream_frame(m).call_id == 0
    np.testing.assert_array_equal(_reassemble(msgs, 0)[1], [1, 2])


def test_stream_frames_large_call_id():
    call_id = 2**64 - 1
    msgs = list(stream_frames(call_id, _live(np.arange(5, dtype=np.int8)), chunk_bytes=2))
    assert [pb.StreamResponse.FromString(m).call_id for m in msgs] == [call_id] * 3
    np.testing.assert_array_equal(_reassemble(msgs, call_id)[1], np.arange(5))


def test_stream_frames_are_lazy():
    arr = np.arange(1000, dtype=np.uint8)
    gen = stream_frames(1, _live(arr), chunk_bytes=100)
    first = next(gen)
    arr[100:200] = 7  # bytes are read from the array when their frame is produced
    second = next(gen)
    assert pb.StreamResponse.FromString(first).response.tensor.tensor_content == bytes(range(100))
    assert pb.StreamResponse.FromString(second).chunk == b"\x07" * 100


# --- descriptors -------------------------------------------------------------------

def test_descriptor_response():
    endpoint = pb.MpiTransfer(world_id=0xDEADBEEF, source_rank=3, tag=17, nbytes=4096, chunk_bytes=1024)
    options = any_pb2.Any()
    options.Pack(endpoint)
    opt_bytes = options.SerializeToString()
    meta = TensorMeta(np.float32, (32, 32))
    data = descriptor_response(meta, opt_bytes, send_start_micros=42)

    msg = pb.RecvTensorResponse.FromString(data)
    assert not msg.is_dead and msg.send_start_micros == 42
    assert msg.tensor.tensor_content == b""
    assert [d.size for d in msg.tensor.tensor_shape.dim] == [32, 32]
    got = pb.MpiTransfer()
    assert msg.transport_options.Unpack(got) and got == endpoint

    head = parse_response(data)
    assert head.is_dead is False and head.send_start_micros == 42
    a, b = head.transport_options
    assert data[a:b] == opt_bytes
    m, cs, ce = decode_meta(data, *head.tensor)
    assert m == meta and cs == ce


# --- requests ---------------------------------------------------------------------

@pytest.mark.parametrize("step_id", [0, 1, 2**40, -3])
def test_recv_request(step_id):
    key = "/job:w/replica:0/task:0/device:CPU:0;0000000000000000;/job:w/replica:0/task:1/device:CPU:0;t;0:0"
    data = recv_request(12, step_id, key.encode(), request_id=2**62 + 5)
    msg = pb.StreamRequest.FromString(data)
    assert msg.call_id == 12
    assert msg.WhichOneof("kind") == "recv"
    assert msg.recv.step_id == step_id
    assert msg.recv.rendezvous_key == key
    assert msg.recv.request_id == 2**62 + 5
    assert not msg.recv.HasField("transport_options")
    assert list(msg.batch) == []


def test_recv_request_with_transport_options():
    options = any_pb2.Any()
    options.Pack(pb.MpiEndpoint(world_id=7, rank=2, max_chunk_bytes=1 << 20))
    data = recv_request(1, 5, b"k", request_id=-9, transport_options=options.SerializeToString())
    msg = pb.StreamRequest.FromString(data)
    assert (msg.call_id, msg.recv.step_id, msg.recv.rendezvous_key, msg.recv.request_id) == (1, 5, "k", -9)
    endpoint = pb.MpiEndpoint()
    assert msg.recv.transport_options.Unpack(endpoint)
    assert (endpoint.world_id, endpoint.rank, endpoint.max_chunk_bytes) == (7, 2, 1 << 20)


def test_recv_request_matches_protobuf_serialization():
    data = recv_request(3, 4, b"key", request_id=5)
    expected = pb.StreamRequest(call_id=3, recv=pb.RecvTensorRequest(
        step_id=4, rendezvous_key="key", request_id=5)).SerializeToString()
    assert data == expected


def test_cancel_request():
    data = cancel_request(31)
    msg = pb.StreamRequest.FromString(data)
    assert msg.call_id == 31 and msg.WhichOneof("kind") == "cancel"
    assert data == pb.StreamRequest(call_id=31, cancel=pb.Cancel()).SerializeToString()


# --- batches ----------------------------------------------------------------------

def test_batch_of_requests_parses_in_order():
    reqs = [recv_request(i, 1, f"k{i}".encode(), i + 100) for i in range(1, 5)]
    reqs.append(cancel_request(2))
    msg = pb.StreamRequest.FromString(batch_requests(reqs))
    assert [m.call_id for m in msg.batch] == [1, 2, 3, 4, 2]
    assert [m.WhichOneof("kind") for m in msg.batch] == ["recv"] * 4 + ["cancel"]
    assert [m.recv.rendezvous_key for m in msg.batch[:4]] == ["k1", "k2", "k3", "k4"]


def test_batch_of_stream_frames_keeps_order():
    a = np.arange(10, dtype=np.int32)
    b = np.arange(6, dtype=np.float64) * 0.5
    msgs = list(stream_frames(1, _live(a), chunk_bytes=16))   # 3 frames
    msgs += list(stream_frames(2, _live(b), chunk_bytes=1024))  # 1 frame
    msgs.append(error_frame(3, errors.Aborted("step 9 aborted")))
    msgs += list(stream_frames(4, Received(None, True), chunk_bytes=16))
    buf = batch_responses(msgs)

    parsed = pb.StreamResponse.FromString(buf)
    assert [m.call_id for m in parsed.batch] == [1, 1, 1, 2, 3, 4]

    got = list(iter_stream_frames(buf))
    assert [f.call_id for f in got] == [1, 1, 1, 2, 3, 4]
    assert [f.head is not None for f in got] == [True, False, False, True, False, True]
    assert [f.chunk is not None for f in got] == [False, True, True, False, False, False]
    assert isinstance(got[4].error, errors.Aborted) and got[4].error.message == "step 9 aborted"
    assert got[5].head.is_dead

    # reassemble call 1 from offsets into the batch buffer
    first = decode_inline(buf, got[0].head.tensor)
    assert isinstance(first, Assembly)
    assert first.add(memoryview(buf)[slice(*got[1].chunk)]) is False
    assert first.add(memoryview(buf)[slice(*got[2].chunk)]) is True
    np.testing.assert_array_equal(first.result(), a)
    np.testing.assert_array_equal(decode_inline(buf, got[3].head.tensor), b)


def test_iter_stream_frames_single_message():
    msg = next(stream_frames(8, _live(np.array([3], np.int16)), chunk_bytes=64))
    got = list(iter_stream_frames(msg))
    assert len(got) == 1 and got[0].call_id == 8
    np.testing.assert_array_equal(decode_inline(msg, got[0].head.tensor), [3])


def test_batch_empty():
    assert batch_responses([]) == b""


# --- errors -----------------------------------------------------------------------

@pytest.mark.parametrize("error,cls,code", [
    (errors.Aborted("aborted step 3"), errors.Aborted, "ABORTED"),
    (errors.NotFound("gone"), errors.NotFound, "NOT_FOUND"),
    (errors.UnknownTask("no task 9"), errors.NotFound, "NOT_FOUND"),
    (errors.PeerUnavailable("peer down"), errors.Unavailable, "UNAVAILABLE"),
    (errors.InvalidKey("bad key", field="name"), errors.InvalidArgument, "INVALID_ARGUMENT"),
    (errors.ResourceExhausted("too big"), errors.ResourceExhausted, "RESOURCE_EXHAUSTED"),
    (errors.DeadlineExceeded("late"), errors.DeadlineExceeded, "DEADLINE_EXCEEDED"),
    (errors.Cancelled("cancelled"), errors.Cancelled, "CANCELLED"),
    (ValueError("boom"), errors.Internal, "INTERNAL"),
])
def test_error_frame_round_trip(error, cls, code):
    data = error_frame(6, error)
    msg = pb.StreamResponse.FromString(data)
    assert msg.call_id == 6 and msg.HasField("error")
    assert msg.error.code == getattr(grpc.StatusCode, code).value[0]

    frame = parse_stream_frame(data)
    assert frame.call_id == 6 and frame.head is None and frame.chunk is None
    assert type(frame.error) is cls
    assert frame.error.code.name == code
    expected = error.message if isinstance(error, RendezvousError) else "ValueError: boom"
    assert frame.error.message == expected


def test_error_frame_unknown_code_keeps_its_code():
    err = RendezvousError("odd")
    err.code = grpc.StatusCode.DATA_LOSS
    frame = parse_stream_frame(error_frame(1, err))
    assert type(frame.error) is RendezvousError
    assert frame.error.code.name == "DATA_LOSS" and frame.error.message == "odd"


def test_error_frame_call_id_zero_parses():
    """error_frame once built the frame with protobuf, which drops a zero call_id."""
    frame = parse_stream_frame(error_frame(0, errors.Aborted("x")))
    assert frame.call_id == 0 and isinstance(frame.error, errors.Aborted)


def test_parse_stream_frame_without_call_id():
    head = unary_response(Received(None, True))
    data = wire.len_field_header(2, len(head)) + head  # a response, but no field 1
    with pytest.raises(InvalidArgument, match="without call_id"):
        parse_stream_frame(data)
    with pytest.raises(InvalidArgument, match="without call_id"):
        parse_stream_frame(b"")
    with pytest.raises(InvalidArgument, match="without call_id"):
        list(iter_stream_frames(batch_responses([data])))


def test_parse_stream_frame_malformed_is_invalid_argument():
    with pytest.raises(InvalidArgument):
        parse_stream_frame(b"\x08")  # call_id tag with no value
    with pytest.raises(InvalidArgument):
        parse_stream_frame(wire.varint_field(1, 1) + wire.len_field_header(3, 10) + b"abc")


def test_parse_stream_frame_span():
    inner = next(stream_frames(12, Received(None, True), chunk_bytes=8))
    buf = b"garbage!" + inner + b"tail"
    frame = parse_stream_frame(buf, 8, 8 + len(inner))
    assert frame.call_id == 12 and frame.head.is_dead


# --- decode_inline and Assembly -----------------------------------------------------

@pytest.mark.parametrize("kind", [bytes, bytearray])
def test_decode_inline_one_frame_is_a_view(kind):
    arr = np.arange(100, dtype=np.float32).reshape(10, 10)
    buf = kind(next(stream_frames(1, _live(arr), chunk_bytes=1 << 20)))
    frame = parse_stream_frame(buf)
    value = decode_inline(buf, frame.head.tensor)
    assert isinstance(value, np.ndarray)
    np.testing.assert_array_equal(value, arr)
    whole = np.frombuffer(buf, dtype=np.uint8)
    assert np.shares_memory(value, whole)
    if kind is bytearray:  # a write through the view lands in the message: no copy was made
        value[0, 0] = 1234.0
        a, b = frame.head.tensor
        _, cs, _ = decode_meta(buf, a, b)
        assert np.frombuffer(bytes(buf[cs:cs + 4]), np.float32)[0] == 1234.0
    else:
        assert not value.flags.writeable


def test_decode_inline_accepts_decoded_meta():
    arr = np.arange(12, dtype=np.int16).reshape(3, 4)
    buf = unary_response(_live(arr))
    span = parse_response(buf).tensor
    decoded = decode_meta(buf, *span)
    np.testing.assert_array_equal(decode_inline(buf, span, decoded), arr)


def test_decode_inline_first_frame_is_an_assembly_with_its_bytes():
    arr = np.arange(64, dtype=np.uint8)
    msgs = list(stream_frames(1, _live(arr), chunk_bytes=24))
    frame = parse_stream_frame(msgs[0])
    asm = decode_inline(msgs[0], frame.head.tensor)
    assert isinstance(asm, Assembly)
    assert asm.meta == TensorMeta(np.uint8, (64,))
    assert asm.filled == 24
    np.testing.assert_array_equal(asm.dest[:24], arr[:24])
    assert not np.shares_memory(asm.dest, np.frombuffer(msgs[0], np.uint8))


def test_decode_inline_typed_fields_tensor():
    # a TensorFlow peer may send values in typed fields (float_val), not tensor_content
    t = tensor_pb2.TensorProto(dtype=tensor_pb2.DT_FLOAT, float_val=[1.5, 2.5],
                               tensor_shape=tensor_pb2.TensorShapeProto(
                                   dim=[tensor_pb2.TensorShapeProto.Dim(size=4)]))
    data = pb.RecvTensorResponse(tensor=t).SerializeToString()
    value = decode_inline(data, parse_response(data).tensor)
    assert isinstance(value, np.ndarray)
    np.testing.assert_array_equal(value, np.array([1.5, 2.5, 2.5, 2.5], np.float32))


def test_assembly_refuses_more_than_announced():
    meta = TensorMeta(np.int32, (4,))  # 16 bytes
    asm = Assembly(meta, memoryview(bytes(range(10))))
    assert asm.filled == 10
    with pytest.raises(InvalidArgument, match="more than the 16 bytes"):
        asm.add(memoryview(b"\x00" * 7))
    assert asm.filled == 10  # the refused part was not copied
    assert asm.add(memoryview(b"\x01" * 6)) is True
    assert asm.result().dtype == np.int32 and asm.result().shape == (4,)
    with pytest.raises(InvalidArgument):
        asm.add(memoryview(b"\x00"))


def test_assembly_refuses_oversized_first_part():
    with pytest.raises(InvalidArgument, match="more than the 8 bytes"):
        Assembly(TensorMeta(np.float64, (1,)), memoryview(b"\x00" * 9))


def test_decode_inline_refuses_first_frame_larger_than_meta():
    # dtype and shape announce 4 bytes, the first frame carries 8
    tensor = encode_meta(TensorMeta(np.uint8, (4,))) + wire.len_field_header(4, 8) + b"\x01" * 8
    data = wire.len_field_header(1, len(tensor)) + tensor
    with pytest.raises(InvalidArgument):
        decode_inline(data, parse_response(data).tensor)


def test_assembly_result_values():
    arr = (np.arange(30, dtype=np.float64) - 15.25).reshape(5, 6)
    raw = arr.tobytes()
    asm = Assembly(TensorMeta(arr.dtype, arr.shape), memoryview(raw)[:100])
    assert asm.add(memoryview(raw)[100:200]) is False
    assert asm.add(memoryview(raw)[200:]) is True
    np.testing.assert_array_equal(asm.result(), arr)


# --- helpers ----------------------------------------------------------------------

def test_payload_view():
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)
    view = payload_view(arr)
    assert view.format == "B" and view.nbytes == 12 and bytes(view) == arr.tobytes()
    assert np.shares_memory(np.frombuffer(view, np.uint8), arr)  # contiguous: no copy
    strided = arr[:, ::2]
    assert bytes(payload_view(strided)) == np.ascontiguousarray(strided).tobytes()


def test_prime_allocator_is_idempotent_per_size(monkeypatch):
    monkeypatch.setattr(allocator, "_primed", 0)
    prime_allocator(1024)
    assert allocator._primed == 8 * 1024
    prime_allocator(512)  # smaller: nothing to do
    assert allocator._primed == 8 * 1024
    prime_allocator(1 << 30)  # capped below glibc's adaptive threshold limit
    assert allocator._primed == (32 << 20) - (64 << 10)


def test_an_error_frame_whose_status_is_ok_is_malformed():
    """It once became an error whose code is OK."""
    raw = pb.StreamResponse(call_id=3, error=pb.Status(code=0, message="fine?")).SerializeToString()
    with pytest.raises(InvalidArgument, match="status is OK"):
        parse_stream_frame(raw)


def test_frames_with_large_content_are_pieces_joined_once_by_their_writer():
    """A frame carrying ``wire.GATHER_BYTES`` of tensor bytes or more is left in
    pieces (a view of the tensor's own memory among them, not a copy); joined,
    with or without an envelope in front, it is the same frame; smaller ones
    are bytes; a batch of frames takes pieces and bytes alike."""
    big = np.arange(wire.GATHER_BYTES // 4 + 10, dtype=np.float32)
    msgs = list(stream_frames(3, _live(big), chunk_bytes=wire.GATHER_BYTES))
    assert [type(m) for m in msgs] == [wire.Pieces, bytes]  # the rest (40 bytes) is a small chunk
    first = msgs[0]
    assert len(first) == sum(len(p) for p in first.parts)
    assert any(isinstance(p, memoryview) and np.shares_memory(np.frombuffer(p, np.uint8), big)
               for p in first.parts)
    joined = first.join()
    assert len(joined) == len(first) and first.join(b"HEAD") == b"HEAD" + joined
    head = parse_stream_frame(joined).head
    asm = decode_inline(joined, head.tensor)
    assert asm.add(memoryview(msgs[1])[slice(*parse_stream_frame(msgs[1]).chunk)]) is True
    np.testing.assert_array_equal(asm.result(), big)
    small = next(stream_frames(4, _live(np.arange(8, dtype=np.int8)), chunk_bytes=1 << 20))
    assert type(small) is bytes
    assert batch_responses([first, small]) == batch_responses([joined, small])


# --- alignment -------------------------------------------------------------------------

@pytest.mark.parametrize("call_id", [0, 1, 200, 70_000, 2**40])
@pytest.mark.parametrize("shape", [(1,), (3, 7), (1000,), (2, 2, 2, 2)])
@pytest.mark.parametrize("micros", [0, 5, 1_700_000_000_000_000])
def test_a_replys_content_starts_at_an_aligned_offset_of_its_frame(call_id, shape, micros):
    """Whatever the lengths of the fields before it, a reply's tensor bytes
    start at a multiple of 8 from its frame's start (a padding field every
    reader skips makes up the difference): a frame that arrives at an aligned
    address is read in place as float64."""
    arr = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
    first = next(stream_frames(call_id, _live(arr), chunk_bytes=4096, send_start_micros=micros))
    first = first.join() if isinstance(first, wire.Pieces) else first
    head = parse_stream_frame(first).head
    _, cs, ce = decode_meta(first, *head.tensor)
    assert cs % 8 == 0 and ce > cs
    msg = pb.StreamResponse.FromString(first)  # still a valid StreamResponse
    assert msg.call_id == call_id and msg.response.tensor.tensor_content == arr.tobytes()[:4096]
    value = decode_inline(first, head.tensor) if ce - cs == arr.nbytes else None
    if value is not None:  # read in place: a view on the frame, nothing copied
        assert value.base is not None and value.base.base is first


def test_frames_packed_in_one_message_keep_their_content_aligned():
    msgs = [error_frame(1, errors.Aborted("step 1 aborted"))]
    for call_id, arr in enumerate([np.arange(5, dtype=np.float64), np.arange(3, dtype=np.int32),
                                   np.arange(2, dtype=np.complex128), np.arange(9, dtype=np.int64)], start=2):
        msgs += list(stream_frames(call_id, _live(arr), chunk_bytes=1024, send_start_micros=call_id * 77))
    msgs += list(stream_frames(9, Received(None, True), chunk_bytes=16))
    buf = batch_responses(msgs)
    assert [m.call_id for m in pb.StreamResponse.FromString(buf).batch] == [1, 2, 3, 4, 5, 9]
    heads = [f.head for f in iter_stream_frames(buf) if f.head is not None and f.head.tensor is not None]
    assert len(heads) == 4
    for head in heads:
        _, cs, _ = decode_meta(buf, *head.tensor)
        assert cs % 8 == 0


@pytest.mark.parametrize("shift", [2, 3, 6, 9])
def test_a_reply_whose_content_lies_misaligned_is_decoded_aligned(shift):
    """A producer that does not align its frames (here: ``shift`` bytes of an
    unknown field in front): the tensor is copied out aligned, not handed out
    as a view its dtype cannot be read from in place."""
    arr = np.arange(6, dtype=np.float64) + 0.5
    first = _skipped_field(shift) + next(stream_frames(3, _live(arr), chunk_bytes=1024))
    head = parse_stream_frame(first).head
    got = decode_inline(first, head.tensor)
    assert got.ctypes.data % 8 == 0
    np.testing.assert_array_equal(got, arr)
    tensor = decode_tensor(first, *head.tensor)  # the same for the whole-tensor decoder
    assert tensor.ctypes.data % 8 == 0
    np.testing.assert_array_equal(tensor, arr)
