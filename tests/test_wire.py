"""The hand-rolled protobuf wire helpers agree with protobuf itself."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rendezvous.codec import wire
from rendezvous.errors import InvalidArgument
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import tensor_pb2

BUFFER_KINDS = [bytes, bytearray, memoryview]


def _pb_varint(value: int) -> bytes:
    """The varint protobuf writes for ``value`` (uint64 call_id, or int64 step_id)."""
    if value == 0:
        return b"\x00"
    if value < 0:
        data = pb.RecvTensorRequest(step_id=value).SerializeToString()
    else:
        data = pb.StreamResponse(call_id=value).SerializeToString()
    assert data[0] == 0x08  # field 1, VARINT
    return data[1:]


# --- varints -------------------------------------------------------------------

BOUNDARIES = [0, 1, 127, 128, 255, 256, 16383, 16384, 2**31 - 1, 2**32 - 1, 2**32,
              2**63 - 1, 2**63, 2**64 - 1]


@pytest.mark.parametrize("value", BOUNDARIES)
@pytest.mark.parametrize("kind", BUFFER_KINDS)
def test_varint_round_trip(value, kind):
    data = wire.encode_varint(value)
    assert data == _pb_varint(value)
    assert wire.decode_varint(kind(data), 0) == (value, len(data))


@pytest.mark.parametrize("value,length", [(0, 1), (127, 1), (128, 2), (2**63 - 1, 9), (2**64 - 1, 10)])
def test_varint_lengths(value, length):
    assert len(wire.encode_varint(value)) == length


@pytest.mark.parametrize("value", [-1, -2, -(2**31), -(2**63)])
def test_negative_int64_is_ten_byte_twos_complement(value):
    data = wire.encode_varint(value)
    assert len(data) == 10
    assert data == _pb_varint(value)
    raw, pos = wire.decode_varint(data, 0)
    assert pos == 10
    assert wire.to_signed64(raw) == value
    # protobuf reads the same value back from an int64 field
    msg = pb.RecvTensorRequest.FromString(wire.tag(1, wire.VARINT) + data)
    assert msg.step_id == value


def test_varint_out_of_range_is_a_programming_error():
    with pytest.raises(ValueError):
        wire.encode_varint(2**64)
    with pytest.raises(ValueError):
        wire.encode_varint(-(2**63) - 1)


def test_decode_at_offset():
    data = b"\xff\xff" + wire.encode_varint(300) + b"\x01"
    assert wire.decode_varint(data, 2) == (300, 4)
    assert wire.decode_varint(memoryview(data), 4) == (1, 5)


@pytest.mark.parametrize("kind", BUFFER_KINDS)
@pytest.mark.parametrize("data", [b"", b"\x80", b"\xff\xff", wire.encode_varint(2**64 - 1)[:-1]])
def test_truncated_varint(kind, data):
    with pytest.raises(InvalidArgument, match="truncated"):
        wire.decode_varint(kind(data), 0)


def test_varint_longer_than_ten_bytes():
    with pytest.raises(InvalidArgument, match="10 bytes"):
        wire.decode_varint(b"\x80" * 10 + b"\x01", 0)


def test_to_signed64():
    assert wire.to_signed64(0) == 0
    assert wire.to_signed64(2**63 - 1) == 2**63 - 1
    assert wire.to_signed64(2**63) == -(2**63)
    assert wire.to_signed64(2**64 - 1) == -1


@given(st.integers(min_value=0, max_value=2**64 - 1), st.binary(max_size=4), st.binary(max_size=4))
def test_varint_property(value, prefix, suffix):
    data = wire.encode_varint(value)
    assert data == _pb_varint(value)
    buf = prefix + data + suffix
    assert wire.decode_varint(buf, len(prefix)) == (value, len(prefix) + len(data))
    assert pb.StreamResponse.FromString(wire.tag(1, wire.VARINT) + data).call_id == value


@given(st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_signed_varint_property(value):
    raw, _ = wire.decode_varint(wire.encode_varint(value), 0)
    assert wire.to_signed64(raw) == value


# --- fields --------------------------------------------------------------------

def test_field_helpers():
    assert wire.tag(1, wire.VARINT) == b"\x08"
    assert wire.tag(4, wire.LEN) == b"\x22"
    assert wire.tag(16, wire.LEN) == b"\x82\x01"
    assert wire.varint_field(3, 0) == b""
    assert wire.varint_field(3, 5) == b"\x18\x05"
    assert wire.len_field_header(4, 300) == b"\x22\xac\x02"


def test_hand_encoded_fields_parse_with_protobuf():
    content = b"\x00" * 200
    data = (wire.varint_field(1, 7) + wire.len_field_header(2, 3) + b"abc"
            + wire.varint_field(7, -5))
    msg = pb.RecvTensorRequest.FromString(data)
    assert (msg.step_id, msg.rendezvous_key, msg.request_id) == (7, "abc", -5)
    t = tensor_pb2.TensorProto.FromString(wire.varint_field(1, 1) + wire.len_field_header(4, 200) + content)
    assert t.dtype == 1 and t.tensor_content == content


@pytest.mark.parametrize("kind", BUFFER_KINDS)
def test_iter_fields_finds_fields_of_a_protobuf_message(kind):
    content = bytes(range(256)) * 3
    tensor = tensor_pb2.TensorProto(
        dtype=tensor_pb2.DT_UINT8,
        tensor_shape=tensor_pb2.TensorShapeProto(dim=[tensor_pb2.TensorShapeProto.Dim(size=768)]),
        tensor_content=content,
    )
    resp = pb.RecvTensorResponse(tensor=tensor, is_dead=True, send_start_micros=-3)
    frame = pb.StreamResponse(call_id=2**40, response=resp, chunk=b"xyz")
    data = frame.SerializeToString()
    buf = kind(data)

    fields = list(wire.iter_fields(buf))
    assert [(f[0], f[1]) for f in fields] == [(1, wire.VARINT), (2, wire.LEN), (3, wire.LEN)]
    assert fields[0][2] == 2**40
    _, _, cs, ce = fields[2]
    assert data[cs:ce] == b"xyz"

    _, _, rs, re_ = fields[1]
    inner = {num: (wt, a, b) for num, wt, a, b in wire.iter_fields(buf, rs, re_)}
    assert inner[2] == (wire.VARINT, 1, inner[2][2])
    assert wire.to_signed64(inner[3][1]) == -3
    wt, ts, te = inner[1]
    assert wt == wire.LEN
    assert tensor_pb2.TensorProto.FromString(data[ts:te]) == tensor

    tfields = {num: (a, b) for num, _, a, b in wire.iter_fields(buf, ts, te)}
    assert tfields[1][0] == tensor_pb2.DT_UINT8
    s, e = tfields[4]
    assert data[s:e] == content and e - s == 768
    s, e = tfields[2]
    [(num, wt, ds, de)] = list(wire.iter_fields(buf, s, e))
    assert (num, wt) == (2, wire.LEN)
    assert list(wire.iter_fields(buf, ds, de))[0][:3] == (1, wire.VARINT, 768)


def test_iter_fields_fixed_width_and_packed():
    t = tensor_pb2.TensorProto(double_val=[1.5], float_val=[2.5, 3.5], int64_val=[-1, 2])
    data = t.SerializeToString()
    found = {num: (wt, a, b) for num, wt, a, b in wire.iter_fields(data)}
    # packed repeated fields are LEN
    assert found[6][0] == wire.LEN and found[6][2] - found[6][1] == 8
    assert found[5][0] == wire.LEN and found[5][2] - found[5][1] == 8
    # unpacked fixed-width values
    unpacked = wire.tag(6, wire.I64) + b"\x00" * 8 + wire.tag(5, wire.I32) + b"\x00" * 4
    assert [(n, wt, b - a) for n, wt, a, b in wire.iter_fields(unpacked)] == [(6, wire.I64, 8), (5, wire.I32, 4)]


def test_iter_fields_respects_span():
    data = b"junk" + wire.varint_field(1, 5) + wire.varint_field(2, 6) + b"junk"
    assert [(n, v) for n, _, v, _ in wire.iter_fields(data, 4, 8)] == [(1, 5), (2, 6)]
    assert [(n, v) for n, _, v, _ in wire.iter_fields(data, 4, 6)] == [(1, 5)]
    assert list(wire.iter_fields(data, 4, 4)) == []


def test_iter_fields_on_typed_memoryview():
    import array

    data = wire.varint_field(1, 9) + wire.varint_field(2, 10)
    arr = array.array("H", data)  # 2-byte items: offsets are still byte offsets
    assert [(n, v) for n, _, v, _ in wire.iter_fields(memoryview(arr))] == [(1, 9), (2, 10)]


@pytest.mark.parametrize("data,what", [
    (b"\x08", "truncated"),                        # varint field, no value
    (b"\x08\x80", "truncated"),                    # unterminated value
    (b"\x12\x05abc", "runs past"),                 # length beyond the end
    (b"\x12", "truncated"),                        # no length
    (b"\x12\x80", "truncated"),                    # truncated length
    (b"\x09\x00\x00", "truncated"),                # I64 short
    (b"\x0d\x00", "truncated"),                    # I32 short
    (b"\x0b", "wire type"),                        # start group
    (b"\x0c", "wire type"),                        # end group
    (b"\x0e", "wire type"),                        # wire type 6
    (b"\x0f", "wire type"),                        # wire type 7
    (b"\x00\x00", "field number 0"),
    (b"\x80", "truncated"),                        # truncated tag
])
@pytest.mark.parametrize("kind", BUFFER_KINDS)
def test_iter_fields_rejects_malformed(data, what, kind):
    with pytest.raises(InvalidArgument, match=what):
        list(wire.iter_fields(kind(data)))


def test_iter_fields_length_past_span_end():
    data = wire.len_field_header(3, 4) + b"abcd"
    with pytest.raises(InvalidArgument, match="runs past"):
        list(wire.iter_fields(data, 0, len(data) - 1))
    with pytest.raises(InvalidArgument):
        list(wire.iter_fields(data, 0, len(data) + 1))  # span outside the buffer
    # a varint that continues past the span end
    data = wire.tag(1, wire.VARINT) + wire.encode_varint(300)
    with pytest.raises(InvalidArgument, match="truncated"):
        list(wire.iter_fields(data, 0, 2))


@given(st.binary(max_size=64))
def test_iter_fields_random_bytes_only_invalid_argument(data):
    try:
        for num, wt, a, b in wire.iter_fields(data):
            assert num >= 1
            if wt != wire.VARINT:
                assert 0 <= a <= b <= len(data)
            else:
                assert b <= len(data)
    except InvalidArgument:
        pass


@given(st.lists(st.tuples(st.integers(1, 2**29 - 1), st.one_of(
    st.integers(0, 2**64 - 1), st.binary(max_size=20))), max_size=8))
def test_iter_fields_property(fields):
    parts = []
    for num, value in fields:
        if isinstance(value, int):
            parts.append(wire.tag(num, wire.VARINT) + wire.encode_varint(value))
        else:
            parts.append(wire.len_field_header(num, len(value)) + value)
    data = b"".join(parts)
    got = []
    for num, wt, a, b in wire.iter_fields(data):
        got.append((num, a if wt == wire.VARINT else data[a:b]))
    assert got == fields
