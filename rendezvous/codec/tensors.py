"""numpy arrays to and from TensorFlow-compatible ``TensorProto`` bytes.

Fixed-size dtypes travel as ``tensor_content``: raw little-endian, row-major
bytes. :func:`encode_header` writes the protobuf fields in front of that
content by hand, so the array's bytes are copied once at most, when they are
joined into the message (:func:`encode_tensor`). :func:`decode_tensor` returns
a numpy view on the received buffer: no copy at all.

Strings (``DT_STRING``) are numpy object arrays of ``bytes`` (or ``'S'``
arrays on the way in) and travel as ``string_val``.

Bytes written by TensorFlow decode too: its typed fields (``float_val``,
``int_val``, ``half_val``, ...), including the "splat" encoding where fewer
values than elements are given and the last one repeats, and its
length-prefixed ``tensor_content`` encoding of string tensors (what
TensorFlow's own RecvTensor sends for DT_STRING).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from . import fields as F
from . import wire
from .dtypes import (
    DT_BFLOAT16,
    DT_BOOL,
    DT_COMPLEX64,
    DT_COMPLEX128,
    DT_DOUBLE,
    DT_FLOAT,
    DT_HALF,
    DT_INT8,
    DT_INT16,
    DT_INT32,
    DT_INT64,
    DT_STRING,
    DT_UINT8,
    DT_UINT16,
    DT_UINT32,
    DT_UINT64,
    OBJECT,
    as_array,
    dt_name,
    dtype_to_proto,
    proto_to_dtype,
)
from ..errors import InvalidArgument, ResourceExhausted, UnsupportedDType

__all__ = ["MAX_TYPED_FIELD_BYTES", "TensorMeta", "encode_meta", "check_sendable", "encode_header", "encode_tensor", "decode_tensor",
           "decode_meta", "empty_like_meta", "announced_bytes", "check_announced"]

# Decoding TensorFlow's typed fields expands them (a splat of one value fills
# the whole shape). Refuse to expand a message into more than this.
MAX_TYPED_FIELD_BYTES = 1 << 31


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """A tensor's dtype and shape: what a receiver needs to allocate for it."""

    dtype: np.dtype
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def nbytes(self) -> int:
        """Bytes of content: elements x itemsize; 0 for strings (not known up front)."""
        if self.dtype == OBJECT or self.dtype.kind == "S":
            return 0
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def proto_dtype(self) -> int:
        return dtype_to_proto(self.dtype)


def _encode_shape(shape: tuple[int, ...]) -> bytes:
    parts = []
    for d in shape:
        dim = wire.varint_field(F.DIM_SIZE, d)
        parts.append(wire.len_field_header(F.SHAPE_DIM, len(dim)))
        parts.append(dim)
    body = b"".join(parts)
    # Always present, even for a scalar (as TensorFlow writes it): rank 0 is known.
    return wire.len_field_header(F.TENSOR_SHAPE, len(body)) + body


def _encode_meta(proto_dtype: int, shape: tuple[int, ...]) -> bytes:
    return wire.varint_field(F.TENSOR_DTYPE, proto_dtype) + _encode_shape(shape)


def encode_meta(meta: TensorMeta) -> bytes:
    """A TensorProto with dtype and tensor_shape only (the descriptor of a tensor)."""
    return _encode_meta(meta.proto_dtype, meta.shape)


def _string_items(arr: np.ndarray) -> list[bytes]:
    items = arr.reshape(-1).tolist()
    if arr.dtype == OBJECT:
        for x in items:
            if not isinstance(x, bytes):
                raise UnsupportedDType(
                    f"object array holds a {type(x).__name__}; only bytes objects can be sent (as DT_STRING)")
    return items


def check_sendable(arr: np.ndarray) -> None:
    """Raise UnsupportedDType, naming what is wrong, for an array that cannot be
    encoded: a dtype with no TensorFlow DataType (numpy unicode, structured,
    datetime), or an object array holding anything but bytes. Called by
    ``send`` so that the producer, not the consumer, hears of it."""
    dtype = arr.dtype
    if dtype in _FIXED_SENDABLE:  # a dtype seen sendable before: nothing else to check
        return
    if dtype_to_proto(dtype) == DT_STRING:
        if dtype == OBJECT:
            _string_items(arr)
    elif len(_FIXED_SENDABLE) < 256:  # bounded: dtypes are few
        _FIXED_SENDABLE.add(dtype)


#: fixed-size dtypes found sendable by check_sendable (what is checked per send)
_FIXED_SENDABLE: set[np.dtype] = set()


def encode_header(arr: np.ndarray) -> tuple[bytes, memoryview | None]:
    """(header, payload) whose concatenation is a whole TensorProto.

    Fixed-size dtypes: the header holds dtype, shape and the tensor_content
    tag and length (no content field when there are no bytes); the payload is
    a flat byte memoryview of the array's data, copied only if the array is
    not C-contiguous. Strings: (the whole serialization, None).
    """
    arr = as_array(arr)
    proto_dtype = dtype_to_proto(arr.dtype)
    shape = arr.shape
    if proto_dtype == DT_STRING:
        parts = [_encode_meta(DT_STRING, shape)]
        for s in _string_items(arr):
            parts.append(wire.len_field_header(F.TENSOR_STRING_VAL, len(s)))
            parts.append(s)
        return b"".join(parts), None
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    payload = flat.data
    header = _encode_meta(proto_dtype, shape)
    if flat.size:
        header += wire.len_field_header(F.TENSOR_CONTENT, flat.size)
    return header, payload


def encode_tensor(obj) -> bytes:
    """The TensorProto bytes of ``obj`` (one copy of a contiguous array's data)."""
    header, payload = encode_header(as_array(obj))
    if payload is None or not len(payload):
        return header
    return b"".join((header, payload))


# --- decoding ------------------------------------------------------------------

def _max_ndim() -> int:
    for n in (64, 32):
        try:
            np.empty((1,) * n, dtype=np.uint8)
        except ValueError:
            continue
        return n
    return 32


_MAX_NDIM = _max_ndim()
_INT64_MAX = (1 << 63) - 1


def _parse(buf, start: int, end: int | None):
    """(buf, dtype value, dims, unknown_rank, content span or None, end) of a TensorProto."""
    buf = wire.byte_buffer(buf)
    if end is None:
        end = len(buf)
    dtype_value = 0
    shapes: list[tuple[int, int]] = []
    content = None
    for num, wt, a, b in wire.iter_fields(buf, start, end):
        if num == F.TENSOR_CONTENT:
            if wt == wire.LEN:
                content = (a, b)
        elif num == F.TENSOR_DTYPE:
            if wt == wire.VARINT:
                # An enum is an int32: protobuf keeps the low 32 bits, signed.
                v = a & 0xFFFFFFFF
                dtype_value = v - (1 << 32) if v >= (1 << 31) else v
        elif num == F.TENSOR_SHAPE:
            if wt == wire.LEN:
                shapes.append((a, b))
    # Repeated occurrences of a message field merge, as protobuf does.
    dims: list[int] = []
    unknown_rank = False
    for s, e in shapes:
        raw = bytes(buf[s:e])
        shape_dims, shape_unknown = _shape(raw) if len(raw) <= _CACHED_SHAPE_BYTES else _shape.__wrapped__(raw)
        dims += shape_dims
        unknown_rank = unknown_rank or shape_unknown
    return buf, dtype_value, dims, unknown_rank, content, end


#: shapes up to this many bytes (any numpy shape) are parsed once and remembered
_CACHED_SHAPE_BYTES = 512


@functools.lru_cache(maxsize=4096)
def _shape(raw: bytes) -> tuple[tuple[int, ...], bool]:
    """(dims, unknown_rank) of one TensorShapeProto's bytes: a job receives the
    same few shapes over and over, so each is parsed once (a larger one, which
    no valid tensor has, is parsed uncached, to be refused)."""
    dims: list[int] = []
    unknown_rank = False
    for num, wt, a, b in wire.iter_fields(raw, 0, len(raw)):
        if num == F.SHAPE_DIM and wt == wire.LEN:
            size = 0
            for dnum, dwt, da, _ in wire.iter_fields(raw, a, b):
                if dnum == F.DIM_SIZE and dwt == wire.VARINT:
                    size = wire.to_signed64(da)
            dims.append(size)
        elif num == F.SHAPE_UNKNOWN_RANK and wt == wire.VARINT:
            unknown_rank = a != 0
    return tuple(dims), unknown_rank


def _checked_meta(dtype_value: int, dims: list[int], unknown_rank: bool) -> TensorMeta:
    """:func:`_valid_meta`, cached on what it is made from (an invalid one raises
    each time; more dimensions than numpy has are refused uncached)."""
    check = _valid_meta if len(dims) <= _MAX_NDIM else _valid_meta.__wrapped__
    return check(dtype_value, tuple(dims), unknown_rank)


@functools.lru_cache(maxsize=4096)
def _valid_meta(dtype_value: int, dims: tuple[int, ...], unknown_rank: bool) -> TensorMeta:
    dtype = proto_to_dtype(dtype_value)
    if unknown_rank:
        raise InvalidArgument("tensor_shape has unknown_rank set; a tensor needs a known shape")
    if len(dims) > _MAX_NDIM:
        raise InvalidArgument(f"tensor has {len(dims)} dimensions; numpy supports at most {_MAX_NDIM}")
    n = 1
    for d in dims:
        if d < 0:
            raise InvalidArgument(f"tensor_shape {list(dims)} has a negative (unknown) dimension")
        n *= d
    if n > _INT64_MAX:
        raise InvalidArgument(f"tensor_shape {list(dims)} has more than 2**63-1 elements")
    # numpy refuses a shape whose non-zero dimensions multiply past its index
    # range even when another dimension is 0 (an empty tensor)
    extent = dtype.itemsize or 1
    for d in dims:
        extent *= d or 1
    if extent > _INT64_MAX:
        raise InvalidArgument(f"tensor_shape {list(dims)} of {dtype} is larger than any array can be")
    return TensorMeta(dtype, dims)


def decode_meta(buf, start: int = 0, end: int | None = None) -> tuple[TensorMeta, int, int]:
    """(meta, content_start, content_end) of the TensorProto in ``buf[start:end]``.

    The span is where tensor_content lies in ``buf`` (empty, at the message
    end, when there is none). Its length is not checked against the meta: the
    first frame of a chunked reply carries only part of it.
    """
    buf, dtype_value, dims, unknown_rank, content, end = _parse(buf, start, end)
    meta = _checked_meta(dtype_value, dims, unknown_rank)
    cs, ce = content if content is not None else (end, end)
    return meta, cs, ce


def empty_like_meta(meta: TensorMeta) -> np.ndarray:
    return np.empty(meta.shape, dtype=meta.dtype)


def _decode_string_list(buf, cs: int, ce: int, n: int) -> list[bytes]:
    """TensorFlow's tensor_content for DT_STRING: n varint32 lengths, then the bytes."""
    sizes = []
    pos = cs
    for _ in range(n):
        if pos >= ce:
            raise InvalidArgument("DT_STRING tensor_content is truncated in its length list")
        size, pos = wire.decode_varint(buf, pos)
        if pos > ce or size > 0xFFFFFFFF:
            raise InvalidArgument("DT_STRING tensor_content has a malformed length list")
        sizes.append(size)
    if sum(sizes) != ce - pos:
        raise InvalidArgument(
            f"DT_STRING tensor_content announces {sum(sizes)} bytes of strings but holds {ce - pos}")
    out = []
    for size in sizes:
        out.append(bytes(buf[pos:pos + size]))
        pos += size
    return out


def _object_array(items: list, shape: tuple[int, ...]) -> np.ndarray:
    arr = np.empty(len(items), dtype=OBJECT)
    arr[:] = items
    return arr.reshape(shape)


def _typed_values(msg, proto_dtype: int, dtype: np.dtype) -> np.ndarray | list:
    """The values in TensorFlow's typed field for this dtype, as a flat array."""
    if proto_dtype == DT_STRING:
        return list(msg.string_val)
    if proto_dtype in (DT_HALF, DT_BFLOAT16):
        bits = np.array(msg.half_val, dtype=np.int64) & 0xFFFF
        return bits.astype(np.uint16).view(dtype)
    if proto_dtype == DT_FLOAT:
        return np.array(msg.float_val, dtype=np.float32)
    if proto_dtype == DT_DOUBLE:
        return np.array(msg.double_val, dtype=np.float64)
    if proto_dtype in (DT_INT32, DT_INT16, DT_INT8, DT_UINT8):
        return np.array(msg.int_val, dtype=np.int32).astype(dtype)
    if proto_dtype == DT_UINT16:
        # TensorFlow writes uint16 to int_val; accept uint32_val as well.
        if len(msg.int_val):
            return np.array(msg.int_val, dtype=np.int32).astype(dtype)
        return np.array(msg.uint32_val, dtype=np.uint32).astype(dtype)
    if proto_dtype == DT_UINT32:
        return np.array(msg.uint32_val, dtype=np.uint32)
    if proto_dtype == DT_INT64:
        return np.array(msg.int64_val, dtype=np.int64)
    if proto_dtype == DT_UINT64:
        return np.array(msg.uint64_val, dtype=np.uint64)
    if proto_dtype == DT_BOOL:
        return np.array(msg.bool_val, dtype=np.bool_)
    if proto_dtype == DT_COMPLEX64:
        parts = np.array(msg.scomplex_val, dtype=np.float32)
        return parts[: len(parts) // 2 * 2].view(np.complex64)
    if proto_dtype == DT_COMPLEX128:
        parts = np.array(msg.dcomplex_val, dtype=np.float64)
        return parts[: len(parts) // 2 * 2].view(np.complex128)
    raise UnsupportedDType(f"{dt_name(proto_dtype)} has no typed field")  # pragma: no cover


def _from_typed_fields(buf, start: int, end: int, meta: TensorMeta, proto_dtype: int) -> np.ndarray:
    """TensorFlow's FromProtoField: copy up to n values, repeat the last to fill,
    zeros (empty strings) when there are none."""
    from google.protobuf.message import DecodeError

    from ..v1 import tensor_pb2

    n = math.prod(meta.shape)
    is_string = proto_dtype == DT_STRING
    itemsize = 8 if is_string else meta.dtype.itemsize
    if n * itemsize > MAX_TYPED_FIELD_BYTES:
        raise InvalidArgument(
            f"tensor of {n} elements from typed fields exceeds {MAX_TYPED_FIELD_BYTES} bytes")
    if n == 0:
        return np.empty(meta.shape, dtype=meta.dtype)
    try:
        msg = tensor_pb2.TensorProto.FromString(bytes(buf[start:end]))
    except DecodeError as e:
        raise InvalidArgument(f"malformed TensorProto: {e}") from None
    values = _typed_values(msg, proto_dtype, meta.dtype)
    in_n = len(values)
    if isinstance(values, list):  # strings
        if in_n >= n:
            items = values[:n]
        else:
            items = values + [values[-1] if in_n else b""] * (n - in_n)
        return _object_array(items, meta.shape)
    if in_n == 0:
        return np.zeros(meta.shape, dtype=meta.dtype)
    if in_n >= n:
        flat = values[:n]
    else:
        flat = np.empty(n, dtype=meta.dtype)
        flat[:in_n] = values
        flat[in_n:] = values[-1]
    return flat.reshape(meta.shape)


def announced_bytes(meta: TensorMeta) -> int:
    """Bytes an array of ``meta`` takes once decoded (a string tensor: its
    object array's pointers, before any string)."""
    return math.prod(meta.shape) * meta.dtype.itemsize


def check_announced(meta: TensorMeta, limit: int | None, who: str = "tensor") -> None:
    """ResourceExhausted if decoding ``meta`` would take more than ``limit`` bytes;
    checked before anything is allocated or expanded."""
    if limit is not None and announced_bytes(meta) > limit:
        raise ResourceExhausted(f"{who} announces {announced_bytes(meta)} bytes (dtype {meta.dtype}, shape "
                                f"{list(meta.shape)}); the limit is {limit} (max_tensor_bytes)")


def decode_tensor(buf, start: int = 0, end: int | None = None, max_bytes: int | None = None) -> np.ndarray:
    """The array in the TensorProto bytes ``buf[start:end]``.

    tensor_content decodes to a view on ``buf`` (no copy; read-only when
    ``buf`` is bytes), or to a copy where the content is not aligned to the
    dtype. Without it, TensorFlow's typed fields are read (one value
    may fill a whole shape). Unknown fields are skipped. Malformed bytes raise
    InvalidArgument, dtypes without a numpy equivalent UnsupportedDType, and a
    tensor announcing more than ``max_bytes`` ResourceExhausted before anything
    is expanded.
    """
    buf, dtype_value, dims, unknown_rank, content, end = _parse(buf, start, end)
    meta = _checked_meta(dtype_value, dims, unknown_rank)
    check_announced(meta, max_bytes)
    dtype = meta.dtype
    n = math.prod(meta.shape)
    # TensorFlow reads tensor_content only when it is non-empty.
    if content is not None and content[1] > content[0]:
        cs, ce = content
        if dtype_value == DT_STRING:
            if n == 0:
                raise InvalidArgument(f"tensor of shape {meta.shape} has no elements but carries tensor_content")
            return _object_array(_decode_string_list(buf, cs, ce, n), meta.shape)
        need = n * dtype.itemsize
        if ce - cs != need:
            raise InvalidArgument(
                f"tensor_content holds {ce - cs} bytes but dtype {dtype} and shape {meta.shape} "
                f"need {need}")
        value = np.frombuffer(buf, dtype=dtype, count=n, offset=cs)
        if not value.flags.aligned:  # the bytes lie where the dtype cannot be read in place
            value = value.copy()
        return value.reshape(meta.shape)
    return _from_typed_fields(buf, start, end, meta, dtype_value)
