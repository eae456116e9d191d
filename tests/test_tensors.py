"""The tensor codec: round trips, and byte compatibility with TensorFlow's TensorProto."""

from __future__ import annotations

import array
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensorboard.compat.proto import tensor_pb2 as tf_tensor_pb2
from tensorboard.compat.proto import tensor_shape_pb2 as tf_shape_pb2
from tensorboard.compat.proto import types_pb2 as tf_types_pb2
from tensorboard.util import tensor_util as tf_tensor_util

from rendezvous.codec import dtypes, wire
from rendezvous.codec.dtypes import as_array, dtype_to_proto, is_memcpyable, proto_to_dtype
from rendezvous.errors import InvalidArgument, UnsupportedDType
from rendezvous.codec.tensors import (
    TensorMeta,
    decode_meta,
    decode_tensor,
    empty_like_meta,
    encode_header,
    encode_meta,
    encode_tensor,
)
from rendezvous.v1 import rendezvous_pb2
from rendezvous.v1 import tensor_pb2

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None

needs_bf16 = pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")

FIXED = [
    ("float16", tf_types_pb2.DT_HALF),
    ("float32", tf_types_pb2.DT_FLOAT),
    ("float64", tf_types_pb2.DT_DOUBLE),
    ("int8", tf_types_pb2.DT_INT8),
    ("int16", tf_types_pb2.DT_INT16),
    ("int32", tf_types_pb2.DT_INT32),
    ("int64", tf_types_pb2.DT_INT64),
    ("uint8", tf_types_pb2.DT_UINT8),
    ("uint16", tf_types_pb2.DT_UINT16),
    ("uint32", tf_types_pb2.DT_UINT32),
    ("uint64", tf_types_pb2.DT_UINT64),
    ("bool", tf_types_pb2.DT_BOOL),
    ("complex64", tf_types_pb2.DT_COMPLEX64),
    ("complex128", tf_types_pb2.DT_COMPLEX128),
]
# tensorboard's TensorFlow stub has no bfloat16, so its encoder is tested without it.
FIXED_NO_BF16 = list(FIXED)
FIXED.append(pytest.param("bfloat16", tf_types_pb2.DT_BFLOAT16, marks=needs_bf16))


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def sample(dtype: np.dtype, shape=(3, 4), seed: int = 0) -> np.ndarray:
    """Deterministic values covering the dtype's range (extremes included)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dtype == np.bool_:
        flat = rng.integers(0, 2, n).astype(bool)
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        flat = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        if n >= 2:
            flat[0], flat[1] = info.min, info.max
    elif dtype.kind == "c":
        flat = (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype)
    else:
        flat = (rng.standard_normal(n) * 100).astype(dtype)
        if n >= 3:
            flat[0], flat[1], flat[2] = np.inf, -np.inf, -0.0
    return flat.reshape(shape)


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    if want.dtype == object:
        assert got.tolist() == want.tolist()
    else:
        assert got.tobytes() == np.ascontiguousarray(want).tobytes()


def tf_parse(data: bytes) -> tf_tensor_pb2.TensorProto:
    return tf_tensor_pb2.TensorProto.FromString(data)


def tf_proto(dtype: int, shape, **fields) -> bytes:
    """A TensorProto serialized by TensorFlow's own generated classes."""
    msg = tf_tensor_pb2.TensorProto(
        dtype=dtype,
        tensor_shape=tf_shape_pb2.TensorShapeProto(
            dim=[tf_shape_pb2.TensorShapeProto.Dim(size=d) for d in shape]),
        **fields,
    )
    return msg.SerializeToString()


# --- dtypes --------------------------------------------------------------------

@pytest.mark.parametrize("name,enum", FIXED)
def test_dtype_mapping(name, enum):
    dt = _dtype(name)
    assert dtype_to_proto(dt) == enum
    assert proto_to_dtype(enum) == dt
    assert dtypes.SUPPORTED_DTYPES[dt] == enum
    assert dt in dtypes.SUPPORTED_DTYPES


def test_string_dtype_mapping():
    assert dtype_to_proto(np.dtype(object)) == tf_types_pb2.DT_STRING
    assert dtype_to_proto(np.dtype("S7")) == tf_types_pb2.DT_STRING
    assert proto_to_dtype(tf_types_pb2.DT_STRING) == np.dtype(object)
    assert dtypes.SUPPORTED_DTYPES[np.dtype(object)] == tf_types_pb2.DT_STRING


def test_dtype_aliases_and_byte_order():
    assert dtype_to_proto(np.longlong) == tf_types_pb2.DT_INT64
    assert dtype_to_proto(np.intc) == tf_types_pb2.DT_INT32
    assert dtype_to_proto(">f4") == tf_types_pb2.DT_FLOAT
    assert dtype_to_proto("<u2") == tf_types_pb2.DT_UINT16
    assert dtype_to_proto(bool) == tf_types_pb2.DT_BOOL


def test_enum_values_match_tensorflow():
    for name in tensor_pb2.DataType.keys():
        if name == "DT_INVALID":
            continue
        value = tf_types_pb2.DataType.Value(name)
        assert getattr(dtypes, name) == value
        assert dtype_to_proto(proto_to_dtype(value)) == value


@pytest.mark.parametrize("dtype,shown", [
    (np.dtype("datetime64[ns]"), "datetime64[ns]"),
    (np.dtype("U5"), "U5"),
    (np.dtype("timedelta64[s]"), "timedelta64[s]"),
    (np.dtype([("a", "i4"), ("b", "f4")]), "dtype"),
    (np.dtype(np.longdouble), str(np.dtype(np.longdouble))),
    (np.dtype(np.clongdouble), str(np.dtype(np.clongdouble))),
])
def test_unsupported_dtype_is_named(dtype, shown):
    if dtype in (np.dtype(np.float64), np.dtype(np.complex128)):
        pytest.skip("long double is double on this platform")
    with pytest.raises(UnsupportedDType, match="has no TensorFlow DataType") as info:
        dtype_to_proto(dtype)
    assert shown in str(info.value)
    assert "supported: float16" in str(info.value)
    with pytest.raises(UnsupportedDType):
        encode_tensor(np.zeros(2, dtype=dtype))
    assert isinstance(info.value, InvalidArgument)


def test_unsupported_values():
    with pytest.raises(UnsupportedDType, match="U"):
        encode_tensor(np.array(["abc", "d"]))
    with pytest.raises(UnsupportedDType, match="str"):
        encode_tensor(np.array(["abc", "d"], dtype=object))
    with pytest.raises(UnsupportedDType, match="int"):
        encode_tensor(np.array([b"x", 3], dtype=object))
    with pytest.raises(UnsupportedDType):
        encode_tensor("text")
    with pytest.raises(UnsupportedDType):
        dtype_to_proto("not a dtype")


@pytest.mark.parametrize("value", [0, 20, 21, 99, -1, 101])
def test_unknown_proto_dtype(value):
    with pytest.raises(UnsupportedDType):
        proto_to_dtype(value)
    data = tf_proto(value, [2]) if value >= 0 else wire.varint_field(1, value)
    with pytest.raises(UnsupportedDType):
        decode_tensor(data)
    with pytest.raises(UnsupportedDType):
        decode_meta(data)


def test_is_memcpyable():
    assert is_memcpyable(np.zeros(3, np.float32))
    assert is_memcpyable(np.zeros(3, bool))
    assert is_memcpyable(np.dtype(np.int64))
    assert not is_memcpyable(np.array([b"a"], dtype=object))
    assert not is_memcpyable(np.array([b"a"]))
    assert not is_memcpyable(np.zeros(3, "U2"))
    assert not is_memcpyable(np.zeros(3, "datetime64[ns]"))
    assert not is_memcpyable(np.zeros(3, ">f4"))  # its bytes are not the wire bytes


@needs_bf16
def test_bfloat16_is_memcpyable():
    assert is_memcpyable(np.zeros(3, ml_dtypes.bfloat16))


# --- as_array ------------------------------------------------------------------

def test_as_array_passes_arrays_through():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert as_array(a) is a
    t = a.T
    assert as_array(t) is t


@pytest.mark.parametrize("obj,dtype,shape", [
    (3, np.int64, ()),
    (2.5, np.float64, ()),
    (True, np.bool_, ()),
    (1 + 2j, np.complex128, ()),
    (np.float32(1.5), np.float32, ()),
    ([[1, 2], [3, 4]], np.int64, (2, 2)),
    (bytearray(b"abc"), np.uint8, (3,)),
    (memoryview(array.array("d", [1.0, 2.0])), np.float64, (2,)),
])
def test_as_array_converts(obj, dtype, shape):
    arr = as_array(obj)
    assert arr.dtype == np.dtype(dtype) and arr.shape == shape


def test_as_array_bytes_is_a_string_scalar():
    arr = as_array(b"abc")
    assert arr.shape == () and arr.dtype.kind == "S"
    assert_same(decode_tensor(encode_tensor(b"abc")), np.array(b"abc", dtype=object))


def test_as_array_byteswaps_big_endian():
    big = np.arange(5, dtype=">i4")
    arr = as_array(big)
    assert arr.dtype == np.dtype("<i4")
    assert arr.tolist() == big.tolist()


# --- round trips ---------------------------------------------------------------

@pytest.mark.parametrize("name,enum", FIXED)
@pytest.mark.parametrize("shape", [(3, 4), (), (0, 3), (7,), (2, 1, 3, 1)])
def test_round_trip_fixed(name, enum, shape):
    arr = sample(_dtype(name), shape)
    data = encode_tensor(arr)
    assert_same(decode_tensor(data), arr)
    assert_same(decode_tensor(bytearray(data)), arr)
    assert_same(decode_tensor(memoryview(data)), arr)


@pytest.mark.parametrize("name,enum", FIXED)
def test_encoding_parses_with_tensorflow_and_ours(name, enum):
    arr = sample(_dtype(name), (3, 4))
    data = encode_tensor(arr)
    for parsed in (tf_parse(data), tensor_pb2.TensorProto.FromString(data)):
        assert parsed.dtype == enum
        assert [d.size for d in parsed.tensor_shape.dim] == [3, 4]
        assert not parsed.tensor_shape.unknown_rank
        assert parsed.tensor_content == arr.tobytes()
    # and it is exactly what protobuf itself would write
    assert tf_parse(data).SerializeToString() == data


@pytest.mark.parametrize("name,enum", FIXED_NO_BF16)
def test_tensorboard_make_ndarray_reads_our_bytes(name, enum):
    arr = sample(_dtype(name), (2, 5))
    got = tf_tensor_util.make_ndarray(tf_parse(encode_tensor(arr)))
    assert_same(got.astype(arr.dtype), arr)


@pytest.mark.parametrize("name,enum", FIXED_NO_BF16)
@pytest.mark.parametrize("shape", [(2, 5), (), (1,)])
def test_tensorflow_make_tensor_proto_decodes(name, enum, shape):
    """TensorFlow's own Python encoder (tensor_content, or typed fields for small tensors)."""
    arr = sample(_dtype(name), shape, seed=3)
    data = tf_tensor_util.make_tensor_proto(arr).SerializeToString()
    assert_same(decode_tensor(data), arr)


def test_scalar_is_zero_d():
    out = decode_tensor(encode_tensor(np.float64(2.5)))
    assert out.shape == () and out.ndim == 0 and out[()] == 2.5
    parsed = tf_parse(encode_tensor(np.int32(7)))
    assert parsed.HasField("tensor_shape") and len(parsed.tensor_shape.dim) == 0
    assert parsed.tensor_content == np.int32(7).tobytes()


def test_zero_size_has_no_content_field():
    arr = np.zeros((0, 3), np.float32)
    data = encode_tensor(arr)
    assert 4 not in {num for num, *_ in wire.iter_fields(data)}
    parsed = tf_parse(data)
    assert [d.size for d in parsed.tensor_shape.dim] == [0, 3]
    out = decode_tensor(data)
    assert out.shape == (0, 3) and out.dtype == np.float32


@pytest.mark.parametrize("make", [
    lambda: np.arange(20, dtype=np.float32)[::2],
    lambda: np.arange(12, dtype=np.int64).reshape(3, 4).T,
    lambda: np.arange(24, dtype=np.complex64).reshape(2, 3, 4)[:, ::2, 1:],
    lambda: np.asfortranarray(np.arange(6, dtype=np.uint16).reshape(2, 3)),
    lambda: np.arange(10, dtype=np.int8)[::-1],
    lambda: np.array([[True, False], [False, True]])[:, 0],
])
def test_non_contiguous_round_trip(make):
    arr = make()
    data = encode_tensor(arr)
    assert tf_parse(data).tensor_content == arr.tobytes()
    assert_same(decode_tensor(data), arr)


@pytest.mark.parametrize("big", [
    np.arange(6, dtype=">i4").reshape(2, 3),
    np.linspace(0, 1, 5).astype(">f8"),
    np.arange(4, dtype=">u2"),
    (np.arange(3) + 1j).astype(">c16"),
])
def test_big_endian_input(big):
    data = encode_tensor(big)
    little = big.astype(big.dtype.newbyteorder("<"))
    assert tf_parse(data).tensor_content == little.tobytes()
    out = decode_tensor(data)
    assert out.dtype == little.dtype
    assert out.tolist() == big.tolist()


def test_bool_is_one_byte_per_element():
    arr = np.array([True, False, True])
    assert tf_parse(encode_tensor(arr)).tensor_content == b"\x01\x00\x01"


@pytest.mark.parametrize("value", [
    np.array([b"a", b"", b"\x00bin\xff", b"x" * 300], dtype=object),
    np.array([[b"ab", b"c"], [b"d", b"ef"]], dtype=object),
    np.array(b"scalar", dtype=object),
    np.empty((0, 2), dtype=object),
    np.array([b"ab", b"cde"]),                      # 'S' dtype
    np.array([[b"ab", b"c"], [b"d", b"ef"]], dtype=object).T,
])
def test_strings_round_trip(value):
    data = encode_tensor(value)
    want = np.empty(value.size, dtype=object)
    want[:] = value.reshape(-1).tolist()
    want = want.reshape(value.shape)
    for parsed in (tf_parse(data), tensor_pb2.TensorProto.FromString(data)):
        assert parsed.dtype == tf_types_pb2.DT_STRING
        assert [d.size for d in parsed.tensor_shape.dim] == list(value.shape)
        assert list(parsed.string_val) == want.reshape(-1).tolist()
    out = decode_tensor(data)
    assert_same(out, want)
    if value.size:
        assert_same(tf_tensor_util.make_ndarray(tf_parse(data)).astype(object), want)


def test_python_values_round_trip():
    assert_same(decode_tensor(encode_tensor([[1, 2], [3, 4]])), np.array([[1, 2], [3, 4]]))
    assert_same(decode_tensor(encode_tensor(1.5)), np.array(1.5))
    assert_same(decode_tensor(encode_tensor([b"a", b"bc"])), np.array([b"a", b"bc"], dtype=object))
    assert_same(decode_tensor(encode_tensor(True)), np.array(True))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["float32", "int16", "uint64", "bool", "complex128", "float16"]),
       st.lists(st.integers(0, 4), max_size=4), st.integers(0, 2**16))
def test_round_trip_property(name, shape, seed):
    arr = sample(np.dtype(name), tuple(shape), seed=seed)
    assert_same(decode_tensor(encode_tensor(arr)), arr)


# --- encode_header ---------------------------------------------------------------

def test_encode_header_payload_is_the_array_memory():
    arr = np.arange(1000, dtype=np.float64).reshape(10, 100)
    header, payload = encode_header(arr)
    assert isinstance(payload, memoryview)
    assert payload.format == "B" and payload.ndim == 1 and len(payload) == arr.nbytes
    assert np.shares_memory(np.frombuffer(payload, dtype=np.uint8), arr)
    assert header + bytes(payload) == encode_tensor(arr)
    parsed = tf_parse(header + bytes(payload))
    assert parsed.tensor_content == arr.tobytes()
    # the header ends with the content field's tag and length
    assert header.endswith(wire.len_field_header(4, arr.nbytes))


def test_encode_header_non_contiguous_copies_once():
    arr = np.arange(100, dtype=np.int32)[::3]
    header, payload = encode_header(arr)
    assert bytes(payload) == arr.tobytes()
    assert not np.shares_memory(np.frombuffer(payload, dtype=np.uint8), arr)


def test_encode_header_zero_size_and_strings():
    header, payload = encode_header(np.zeros((2, 0), np.int32))
    assert payload is not None and len(payload) == 0
    assert decode_tensor(header).shape == (2, 0)
    header, payload = encode_header(np.array([b"a"], dtype=object))
    assert payload is None
    assert list(tf_parse(header).string_val) == [b"a"]


def test_encode_tensor_makes_one_copy():
    arr = np.ones(64 << 20, dtype=np.uint8).view(np.float32)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        data = encode_tensor(arr)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(data) > arr.nbytes
    # the joined message itself is traced, so the peak shows every copy
    assert arr.nbytes <= peak < 1.2 * arr.nbytes


def test_decode_tensor_copies_nothing():
    data = encode_tensor(np.ones(16 << 20, dtype=np.uint8))
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        out = decode_tensor(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.nbytes == 16 << 20
    assert peak < 1 << 20


# --- views -----------------------------------------------------------------------

def _aligned_in(buf_type, data: bytes, nbytes: int):
    """``data`` (an encoded tensor) placed in a new ``buf_type`` after as many
    bytes as put its content at a multiple of 8 (a fresh buffer's own start is):
    (the buffer, its span)."""
    pad = -(len(data) - nbytes) % 8
    buf = buf_type(bytes(pad) + data)
    assert np.frombuffer(buf, np.uint8).ctypes.data % 8 == 0
    return buf, pad, pad + len(data)


def test_decode_is_a_view_on_a_bytearray():
    arr = np.arange(8, dtype=np.int32)
    buf, start, end = _aligned_in(bytearray, encode_tensor(arr), arr.nbytes)
    out = decode_tensor(buf, start, end)
    assert np.shares_memory(out, np.frombuffer(buf, dtype=np.uint8))
    assert out.flags.writeable
    buf[-4:] = np.int32(-5).tobytes()
    assert out[-1] == -5
    base = out
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    assert base is buf or (isinstance(base, memoryview) and base.obj is buf)


def test_decode_is_a_read_only_view_on_bytes():
    arr = np.arange(8, dtype=np.float32)
    data, start, end = _aligned_in(bytes, encode_tensor(arr), arr.nbytes)
    out = decode_tensor(data, start, end)
    assert not out.flags.writeable
    assert not out.flags.owndata


@pytest.mark.parametrize("shift", range(1, 8))
def test_decode_copies_content_that_lies_misaligned_for_its_dtype(shift):
    arr = sample(np.dtype(np.float64), (3, 5))
    data, start, end = _aligned_in(bytearray, encode_tensor(arr), arr.nbytes)
    buf = bytearray(shift) + data  # the content now lies `shift` bytes past a multiple of 8
    out = decode_tensor(buf, start + shift, end + shift)
    assert_same(out, arr)
    assert out.ctypes.data % out.dtype.alignment == 0
    assert not np.shares_memory(out, np.frombuffer(buf, dtype=np.uint8))


def test_decode_inside_a_larger_message():
    """A tensor nested in a RecvTensorResponse decodes in place, from its span."""
    arr = sample(np.dtype(np.float64), (4, 5))
    tensor = encode_tensor(arr)
    resp = rendezvous_pb2.RecvTensorResponse.FromString(
        wire.varint_field(2, 0) + wire.varint_field(3, 99) + wire.len_field_header(1, len(tensor)) + tensor)
    data = resp.SerializeToString()
    [(s, e)] = [(a, b) for num, _, a, b in wire.iter_fields(data) if num == 1]
    content = data.find(arr.tobytes())
    buf, pad, _ = _aligned_in(bytearray, data, len(data) - content)
    out = decode_tensor(buf, s + pad, e + pad)
    assert_same(out, arr)
    assert np.shares_memory(out, np.frombuffer(buf, dtype=np.uint8))
    assert_same(decode_tensor(memoryview(data), s, e), arr)


# --- TensorFlow-written bytes ----------------------------------------------------

def test_tf_tensor_content():
    arr = sample(np.dtype(np.int64), (2, 3))
    data = tf_proto(tf_types_pb2.DT_INT64, [2, 3], tensor_content=arr.tobytes())
    assert_same(decode_tensor(data), arr)


def test_tf_float_val_splat():
    out = decode_tensor(tf_proto(tf_types_pb2.DT_FLOAT, [2, 3], float_val=[7.0]))
    assert_same(out, np.full((2, 3), 7.0, np.float32))


def test_tf_partial_values_repeat_the_last():
    out = decode_tensor(tf_proto(tf_types_pb2.DT_DOUBLE, [5], double_val=[1.0, 2.0]))
    assert_same(out, np.array([1, 2, 2, 2, 2], np.float64))


def test_tf_extra_values_are_ignored():
    out = decode_tensor(tf_proto(tf_types_pb2.DT_INT32, [2], int_val=[1, 2, 3]))
    assert_same(out, np.array([1, 2], np.int32))


def test_tf_no_values_mean_zeros():
    """TensorFlow's FromProtoField fills with T() when a non-empty shape has no values."""
    assert_same(decode_tensor(tf_proto(tf_types_pb2.DT_FLOAT, [2, 2])), np.zeros((2, 2), np.float32))
    out = decode_tensor(tf_proto(tf_types_pb2.DT_STRING, [2]))
    assert_same(out, np.array([b"", b""], dtype=object))


def test_tf_scalar_typed():
    out = decode_tensor(tf_proto(tf_types_pb2.DT_FLOAT, [], float_val=[3.5]))
    assert out.shape == () and out[()] == np.float32(3.5)


@pytest.mark.parametrize("enum,dtype,values", [
    (tf_types_pb2.DT_INT32, np.int32, [-(2**31), 2**31 - 1, 0, 5]),
    (tf_types_pb2.DT_INT16, np.int16, [-(2**15), 2**15 - 1, 0, 5]),
    (tf_types_pb2.DT_INT8, np.int8, [-128, 127, 0, -1]),
    (tf_types_pb2.DT_UINT8, np.uint8, [0, 255, 1, 128]),
    (tf_types_pb2.DT_UINT16, np.uint16, [0, 65535, 1, 32768]),  # TensorFlow writes uint16 here
])
def test_tf_int_val(enum, dtype, values):
    out = decode_tensor(tf_proto(enum, [2, 2], int_val=values))
    assert_same(out, np.array(values, dtype=dtype).reshape(2, 2))


def test_tf_int_val_splat():
    out = decode_tensor(tf_proto(tf_types_pb2.DT_INT8, [3], int_val=[-3]))
    assert_same(out, np.full(3, -3, np.int8))


@pytest.mark.parametrize("enum,dtype,values", [
    (tf_types_pb2.DT_UINT32, np.uint32, [0, 2**32 - 1, 7]),
    (tf_types_pb2.DT_UINT16, np.uint16, [0, 65535, 7]),  # our proto's documented field
])
def test_tf_uint32_val(enum, dtype, values):
    out = decode_tensor(tf_proto(enum, [3], uint32_val=values))
    assert_same(out, np.array(values, dtype=dtype))


def test_tf_int64_and_uint64_val():
    vals = [-(2**63), 2**63 - 1, -1]
    assert_same(decode_tensor(tf_proto(tf_types_pb2.DT_INT64, [3], int64_val=vals)), np.array(vals, np.int64))
    uvals = [0, 2**64 - 1, 2**63]
    assert_same(decode_tensor(tf_proto(tf_types_pb2.DT_UINT64, [3], uint64_val=uvals)),
                np.array(uvals, np.uint64))
    assert_same(decode_tensor(tf_proto(tf_types_pb2.DT_UINT64, [2, 2], uint64_val=[2**64 - 1])),
                np.full((2, 2), 2**64 - 1, np.uint64))


def test_tf_half_val():
    want = np.array([1.0, -2.5, np.inf, 65504.0], np.float16)
    bits = want.view(np.uint16).tolist()
    assert_same(decode_tensor(tf_proto(tf_types_pb2.DT_HALF, [4], half_val=bits)), want)
    assert_same(decode_tensor(tf_proto(tf_types_pb2.DT_HALF, [2], half_val=[bits[1]])),
                np.full(2, -2.5, np.float16))


@needs_bf16
def test_tf_half_val_bfloat16():
    bf = np.dtype(ml_dtypes.bfloat16)
    want = np.array([1.0, -2.5, 3.0e38, 0.0], bf)
    bits = want.view(np.uint16).tolist()
    assert_same(decode_tensor(tf_proto(tf_types_pb2.DT_BFLOAT16, [2, 2], half_val=bits)), want.reshape(2, 2))


def test_tf_bool_val():
    assert_same(decode_tensor(tf_proto(tf_types_pb2.DT_BOOL, [3], bool_val=[True, False, True])),
                np.array([True, False, True]))
    assert_same(decode_tensor(tf_proto(tf_types_pb2.DT_BOOL, [2, 2], bool_val=[True])),
                np.ones((2, 2), bool))


def test_tf_string_val():
    out = decode_tensor(tf_proto(tf_types_pb2.DT_STRING, [2], string_val=[b"a", b"\xffbc"]))
    assert_same(out, np.array([b"a", b"\xffbc"], dtype=object))
    out = decode_tensor(tf_proto(tf_types_pb2.DT_STRING, [2, 2], string_val=[b"z"]))
    assert_same(out, np.full((2, 2), b"z", dtype=object))
    out = decode_tensor(tf_proto(tf_types_pb2.DT_STRING, [], string_val=[b"one"]))
    assert out.shape == () and out[()] == b"one"


def test_tf_string_tensor_content():
    """TensorFlow's RecvTensor sends DT_STRING as varint32 lengths then the bytes."""
    strings = [b"ab", b"", b"x" * 200]
    content = b"".join(wire.encode_varint(len(s)) for s in strings) + b"".join(strings)
    out = decode_tensor(tf_proto(tf_types_pb2.DT_STRING, [3], tensor_content=content))
    assert_same(out, np.array(strings, dtype=object))
    with pytest.raises(InvalidArgument):
        decode_tensor(tf_proto(tf_types_pb2.DT_STRING, [3], tensor_content=content[:-1]))
    with pytest.raises(InvalidArgument):
        decode_tensor(tf_proto(tf_types_pb2.DT_STRING, [4], tensor_content=content))


def test_tf_complex_val():
    out = decode_tensor(tf_proto(tf_types_pb2.DT_COMPLEX128, [2], dcomplex_val=[1.0, 2.0, 3.0, -4.0]))
    assert_same(out, np.array([1 + 2j, 3 - 4j], np.complex128))
    out = decode_tensor(tf_proto(tf_types_pb2.DT_COMPLEX128, [3], dcomplex_val=[1.0, 2.0]))
    assert_same(out, np.full(3, 1 + 2j, np.complex128))
    out = decode_tensor(tf_proto(tf_types_pb2.DT_COMPLEX64, [2], scomplex_val=[0.5, -1.0, 2.0, 0.0]))
    assert_same(out, np.array([0.5 - 1j, 2 + 0j], np.complex64))


def test_tf_typed_fields_for_another_dtype_are_ignored():
    """As in TensorFlow: only the dtype's own field counts."""
    out = decode_tensor(tf_proto(tf_types_pb2.DT_FLOAT, [2], int_val=[5, 6]))
    assert_same(out, np.zeros(2, np.float32))


def test_content_wins_over_typed_fields():
    arr = np.array([1.0, 2.0], np.float32)
    data = tf_proto(tf_types_pb2.DT_FLOAT, [2], tensor_content=arr.tobytes(), float_val=[9.0])
    assert_same(decode_tensor(data), arr)


def test_unknown_fields_are_skipped():
    arr = sample(np.dtype(np.float32), (2, 2))
    data = encode_tensor(arr)
    extra = (wire.varint_field(3, 1)                                 # version_number
             + wire.tag(1000, wire.VARINT) + wire.encode_varint(2**40)
             + wire.len_field_header(15, 3) + b"abc"                  # TensorFlow's variant_val
             + wire.tag(99, wire.I64) + b"\x00" * 8
             + wire.tag(98, wire.I32) + b"\x00" * 4)
    assert_same(decode_tensor(extra + data), arr)
    assert_same(decode_tensor(data + extra), arr)
    # an unknown field inside the shape, and a dim name
    shape = (wire.len_field_header(2, 2) + wire.varint_field(1, 2)
             + wire.len_field_header(2, 5) + wire.varint_field(1, 2) + wire.len_field_header(2, 1) + b"n"
             + wire.varint_field(77, 3))
    msg = wire.varint_field(1, 1) + wire.len_field_header(2, len(shape)) + shape \
        + wire.len_field_header(4, 16) + arr.tobytes()
    assert_same(decode_tensor(msg), arr)


# --- decode_meta -------------------------------------------------------------------

def test_decode_meta_spans_the_content():
    arr = sample(np.dtype(np.int16), (3, 5))
    data = b"prefix" + encode_tensor(arr)
    meta, cs, ce = decode_meta(data, 6)
    assert meta == TensorMeta(np.dtype(np.int16), (3, 5))
    assert meta.nbytes == arr.nbytes == ce - cs
    assert data[cs:ce] == arr.tobytes()


def test_decode_meta_of_a_descriptor_and_a_partial_first_chunk():
    meta = TensorMeta(np.dtype(np.float32), (4, 4))
    desc = encode_meta(meta)
    got, cs, ce = decode_meta(desc)
    assert got == meta and cs == ce
    parsed = tf_parse(desc)
    assert parsed.dtype == tf_types_pb2.DT_FLOAT and [d.size for d in parsed.tensor_shape.dim] == [4, 4]
    assert not parsed.tensor_content
    # a first frame with only part of the content: decode_meta does not object
    part = np.arange(16, dtype=np.float32).tobytes()[:20]
    first = desc + wire.len_field_header(4, len(part)) + part
    got, cs, ce = decode_meta(first)
    assert got == meta and first[cs:ce] == part
    with pytest.raises(InvalidArgument, match="tensor_content holds 20 bytes"):
        decode_tensor(first)
    # reassembly as a receiver does it
    dest = empty_like_meta(meta)
    assert dest.shape == (4, 4) and dest.dtype == np.float32
    dest.reshape(-1).view(np.uint8)[:20] = np.frombuffer(part, np.uint8)


def test_decode_meta_strings():
    data = encode_tensor(np.array([b"a", b"b"], dtype=object))
    meta, cs, ce = decode_meta(data)
    assert meta.dtype == np.dtype(object) and meta.shape == (2,) and meta.nbytes == 0 and cs == ce


def test_tensor_meta():
    meta = TensorMeta(np.float64, [2, 3])
    assert meta.dtype == np.dtype(np.float64) and meta.shape == (2, 3)
    assert meta.nbytes == 48 and meta.proto_dtype == tf_types_pb2.DT_DOUBLE
    assert TensorMeta(np.dtype(np.int8), ()).nbytes == 1
    assert TensorMeta(np.dtype(np.int8), (0, 5)).nbytes == 0
    with pytest.raises(AttributeError):
        meta.shape = (1,)  # frozen
    assert hash(meta) == hash(TensorMeta(np.dtype(np.float64), (2, 3)))
    assert decode_meta(encode_meta(meta))[0] == meta
    scalar = TensorMeta(np.dtype(np.bool_), ())
    assert decode_meta(encode_meta(scalar))[0] == scalar


# --- malformed input ----------------------------------------------------------------

def test_truncated_encoding():
    data = encode_tensor(np.arange(10, dtype=np.float32))
    for cut in (1, 4, 39):
        with pytest.raises(InvalidArgument):
            decode_tensor(data[:-cut])
    with pytest.raises(InvalidArgument):
        decode_tensor(data[:3])  # inside the shape


def test_content_length_mismatch():
    data = tf_proto(tf_types_pb2.DT_FLOAT, [3], tensor_content=b"\x00" * 8)
    with pytest.raises(InvalidArgument, match="tensor_content holds 8 bytes .* need 12"):
        decode_tensor(data)
    data = tf_proto(tf_types_pb2.DT_FLOAT, [0], tensor_content=b"\x00" * 4)
    with pytest.raises(InvalidArgument):
        decode_tensor(data)


def test_unknown_rank_and_negative_dims():
    msg = tf_tensor_pb2.TensorProto(dtype=tf_types_pb2.DT_FLOAT)
    msg.tensor_shape.unknown_rank = True
    with pytest.raises(InvalidArgument, match="unknown_rank"):
        decode_tensor(msg.SerializeToString())
    with pytest.raises(InvalidArgument, match="unknown_rank"):
        decode_meta(msg.SerializeToString())
    with pytest.raises(InvalidArgument, match="negative"):
        decode_tensor(tf_proto(tf_types_pb2.DT_FLOAT, [2, -1], float_val=[1.0]))
    with pytest.raises(InvalidArgument, match="negative"):
        decode_meta(tf_proto(tf_types_pb2.DT_FLOAT, [-5]))


def test_a_shape_seen_before_is_parsed_once_and_a_bad_one_is_refused_every_time():
    """A job receives the same shapes again and again: each is parsed once and
    the same meta comes back; an invalid one raises each time it comes, with
    the shape in its message; one with more dimensions than numpy has is
    refused without being remembered."""
    from rendezvous.codec import tensors

    tensors._shape.cache_clear()
    tensors._valid_meta.cache_clear()
    good = tf_proto(tf_types_pb2.DT_FLOAT, [3, 4], tensor_content=b"\x00" * 48)
    metas = [decode_meta(good)[0] for _ in range(3)]
    assert metas[0] == TensorMeta(np.float32, (3, 4)) and all(m is metas[0] for m in metas)
    assert tensors._shape.cache_info().misses == 1 and tensors._shape.cache_info().hits == 2
    for _ in range(2):
        with pytest.raises(InvalidArgument, match=r"tensor_shape \[2, -1\] has a negative"):
            decode_meta(tf_proto(tf_types_pb2.DT_FLOAT, [2, -1]))
    remembered = tensors._valid_meta.cache_info().currsize
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="100 dimensions"):
            decode_meta(tf_proto(tf_types_pb2.DT_FLOAT, [1] * 100))
    assert tensors._valid_meta.cache_info().currsize == remembered


def test_shape_overflow_and_huge_splat():
    with pytest.raises(InvalidArgument):
        decode_tensor(tf_proto(tf_types_pb2.DT_FLOAT, [2**62, 2**62]))
    with pytest.raises(InvalidArgument):
        decode_tensor(tf_proto(tf_types_pb2.DT_FLOAT, [2**40], float_val=[1.0]))
    with pytest.raises(InvalidArgument):
        decode_tensor(tf_proto(tf_types_pb2.DT_FLOAT, [1] * 100, float_val=[1.0]))


def test_malformed_typed_fields():
    # a packed float_val whose length is not a multiple of 4
    data = tf_proto(tf_types_pb2.DT_FLOAT, [2]) + wire.len_field_header(5, 3) + b"\x00\x00\x00"
    with pytest.raises(InvalidArgument):
        decode_tensor(data)


def _check_decode_never_crashes(data: bytes) -> None:
    try:
        out = decode_tensor(data)
    except InvalidArgument:  # UnsupportedDType is one
        return
    assert isinstance(out, np.ndarray)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=96))
def test_random_bytes_raise_only_invalid_argument(data):
    _check_decode_never_crashes(data)
    try:
        decode_meta(data)
    except InvalidArgument:
        pass


_FIELD = st.one_of(
    st.tuples(st.just(1), st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 14, 17, 18, 19, 22, 23, 20, 0])),
    st.tuples(st.integers(1, 20), st.integers(0, 2**64 - 1)),
    st.tuples(st.integers(2, 17), st.binary(max_size=24)),
    st.tuples(st.just(2), st.lists(st.integers(-2, 6), max_size=4)),
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_FIELD, max_size=8))
def test_structured_garbage_raises_only_invalid_argument(fields):
    """Well-formed protobuf with arbitrary values reaches the typed-field paths."""
    parts = []
    for num, value in fields:
        if isinstance(value, int):
            parts.append(wire.tag(num, wire.VARINT) + wire.encode_varint(value))
        elif isinstance(value, bytes):
            parts.append(wire.len_field_header(num, len(value)) + value)
        else:
            shape = b"".join(
                wire.len_field_header(2, len(d)) + d for d in (wire.tag(1, 0) + wire.encode_varint(v) for v in value))
            parts.append(wire.len_field_header(2, len(shape)) + shape)
    _check_decode_never_crashes(b"".join(parts))
