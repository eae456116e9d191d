"""Many small tensors in one reply: the ``ReplyGroup`` frame, written and read as arrays.

A producer answering a batched request (``RecvMany``) packs the small tensors
that are ready together into one group: their call ids, dtypes, ranks, dims
and byte offsets as packed fixed-width arrays, and their bytes one after the
other (each at an 8-byte aligned offset) in one payload. The payload travels
inside the frame, or, on the MPI optimal path, as one MPI message (the fusion
buffer) that the frame announces. Either way the consumer parses one frame
with a handful of fields, reads the arrays with ``numpy.frombuffer``, and
hands out each tensor as a view on the one buffer: no protobuf object, no
frame, no MPI message and no copy per tensor.

Copies of the payload: producer 1 (into the frame, or into the fusion
buffer), consumer 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import fields as F
from . import wire
from .dtypes import dtype_to_proto, proto_to_dtype
from ..errors import InvalidArgument, ResourceExhausted, UnsupportedDType
from .tensors import _MAX_NDIM

__all__ = ["ALIGN", "NO_CALL", "Layout", "layout", "group_frame", "group_parts", "fill", "Group", "parse_group", "fusable"]

#: every tensor's bytes start at a multiple of this within the payload (the
#: largest alignment of a dtype that packs), and the payload at a multiple of
#: it within its frame (see group_parts)
ALIGN = wire.ALIGN
_U64 = np.dtype("<u8")
_U32 = np.dtype("<u4")
_INT64_MAX = (1 << 63) - 1
_CODES: dict[np.dtype, int] = {}  # dtype -> DataType value, filled as dtypes are met
_DTYPES: dict[int, np.dtype] = {}  # and back


def _code(dtype: np.dtype) -> int:
    code = _CODES.get(dtype)
    if code is None:
        code = dtype_to_proto(dtype)
        if not 0 < code < 256:
            raise UnsupportedDType(f"dtype {dtype} cannot travel in a group")
        _CODES[dtype] = code
    return code


def _dtype(code: int) -> np.dtype:
    dt = _DTYPES.get(code)
    if dt is None:
        dt = proto_to_dtype(code)
        if dt.hasobject or dt.kind in "SUV":
            raise InvalidArgument(f"group carries a tensor of dtype {dt}, which cannot be packed")
        _DTYPES[code] = dt
    return dt


_FIXED: dict[np.dtype, bool] = {}  # dtype -> whether it is fixed-size (packs), as met


def fusable(value: object, limit: int) -> bool:
    """Whether ``value`` (a produced tensor) may travel packed in a group: a
    host array of a fixed-size dtype with at most ``limit`` bytes."""
    if type(value) is not np.ndarray or value.nbytes > limit:
        return False
    dtype = value.dtype
    fixed = _FIXED.get(dtype)
    if fixed is None:
        fixed = _FIXED[dtype] = not dtype.hasobject and dtype.kind not in "SUV"
    return fixed


@dataclass(slots=True)
class Layout:
    """Where each tensor of a group lies in its payload, and the group's arrays."""

    dtypes: bytes
    ranks: bytes
    dims: bytes
    #: each tensor's start (a multiple of ALIGN), then the payload's size
    offsets: list[int]
    #: each tensor's bytes (a byte view of its memory; a copy only if it was not
    #: contiguous), taken in the same pass: the frame and the fusion buffer use them
    raws: list

    @property
    def nbytes(self) -> int:
        return self.offsets[-1]


def layout(arrays: Sequence[np.ndarray]) -> Layout:
    """The layout of ``arrays`` packed one after the other, each aligned: one
    pass over the arrays."""
    codes = bytearray()
    ranks: list[int] = []
    dims: list[int] = []
    offsets: list[int] = []
    raws: list = []
    codes_of = _CODES.get
    add_code, add_rank, add_offset, add_raw = codes.append, ranks.append, offsets.append, raws.append
    end = 0
    for a in arrays:
        dtype = a.dtype
        code = codes_of(dtype)
        add_code(code if code is not None else _code(dtype))
        shape = a.shape
        add_rank(len(shape))
        dims += shape
        start = (end + ALIGN - 1) & ~(ALIGN - 1)
        add_offset(start)
        try:  # _raw(a), inlined for the usual contiguous array
            raw = a.data.cast("B")
        except (TypeError, ValueError):
            raw = _raw(a)
        add_raw(raw)
        end = start + len(raw)
    offsets.append(end)
    return Layout(bytes(codes), np.array(ranks, _U32).tobytes(), np.array(dims, _U64).tobytes(), offsets, raws)


def _raw(a: np.ndarray) -> memoryview:
    """The bytes of ``a`` (a copy only if it is not contiguous)."""
    try:
        return a.data.cast("B")
    except (TypeError, ValueError):  # not C-contiguous, or a dtype buffers cannot carry
        return np.ascontiguousarray(a).reshape(-1).view(np.uint8).data


#: zero bytes to pad a tensor's end to the next ALIGN
_PAD = tuple(bytes(i) for i in range(ALIGN))


def _parts(lay: Layout) -> list:
    """The payload's pieces: each array's bytes, and the padding before the next."""
    parts: list = []
    end = 0
    for raw, start in zip(lay.raws, lay.offsets):
        if start > end:
            parts.append(_PAD[start - end])
        n = len(raw)
        if n:
            parts.append(raw)
        end = start + n
    return parts


def fill(buffer: np.ndarray, lay: Layout) -> None:
    """Copy the arrays of ``lay`` into ``buffer`` (uint8, ``lay.nbytes`` long) at their offsets."""
    target = buffer.data.cast("B")
    for raw, pos in zip(lay.raws, lay.offsets):
        n = len(raw)
        if n:
            target[pos:pos + n] = raw


#: Call ids from here up answer no call: a group re-sent for one retried
#: member names its other members so (see rpc/producer_stream.py, Handed).
#: A consumer numbers its calls from 1 and never reaches them.
NO_CALL = 1 << 63


def group_frame(call_ids: Sequence[int], arrays: Sequence[np.ndarray] | None, lay: Layout,
                send_start_micros: int = 0, transport_options: bytes | None = None) -> bytes:
    """A ``StreamResponse`` whose ``group`` answers ``call_ids``: with the arrays'
    bytes inside (``arrays`` given) or announced by ``transport_options`` (the
    payload travels another way)."""
    return b"".join(group_parts(call_ids, arrays, lay, send_start_micros, transport_options))


def group_parts(call_ids: Sequence[int], arrays: Sequence[np.ndarray] | None, lay: Layout,
                send_start_micros: int = 0, transport_options: bytes | None = None,
                field: int = F.STREAM_RESPONSE_GROUP) -> list:
    """:func:`group_frame`'s bytes as pieces (the arrays' own memory among them,
    not copied), for a writer that gathers them; ``field``: the group's field
    number in the message it is part of (a daemon's ``LocalRecvManyResponse.group``)."""
    ids = np.array(call_ids, _U64).tobytes()
    offsets = np.array(lay.offsets, _U64).tobytes()
    head = [
        wire.len_field_header(F.GROUP_CALL_IDS, len(ids)), ids,
        wire.len_field_header(F.GROUP_DTYPES, len(lay.dtypes)), lay.dtypes,
        wire.len_field_header(F.GROUP_RANKS, len(lay.ranks)), lay.ranks,
        wire.len_field_header(F.GROUP_DIMS, len(lay.dims)), lay.dims,
        wire.len_field_header(F.GROUP_OFFSETS, len(offsets)), offsets,
        wire.varint_field(F.GROUP_SEND_START_MICROS, send_start_micros),
    ]
    if transport_options:
        head += [wire.len_field_header(F.GROUP_TRANSPORT_OPTIONS, len(transport_options)), transport_options]
    body: list = []
    if arrays is not None:
        payload_header = wire.len_field_header(F.GROUP_PAYLOAD, lay.nbytes)
        inner = sum(map(len, head)) + len(payload_header)
        # the payload starts at an aligned offset of what is returned: a frame
        # that arrives at an aligned address is read in place
        body = [_pad_before_payload(field, inner, lay.nbytes), payload_header, *_parts(lay)]
    size = sum(map(len, head)) + sum(map(len, body))
    return [wire.len_field_header(field, size), *head, *body]


#: padding lengths to try, smallest first: one of them aligns the payload
#: whatever the group's own header grows to with it
_PAD_LENGTHS = (0, *range(2, 2 * ALIGN + 2))


def _pad_before_payload(field: int, inner: int, nbytes: int) -> bytes:
    """The padding field that puts a group's payload at an aligned offset from
    the start of the group's field (``inner``: the group's bytes before the
    payload, its header included)."""
    for n in _PAD_LENGTHS:
        if (len(wire.len_field_header(field, inner + n + nbytes)) + inner + n) % ALIGN == 0:
            return wire.padding(n)
    raise AssertionError("no padding aligns the payload")  # cannot happen: see _PAD_LENGTHS


# --- consumer side -----------------------------------------------------------

@dataclass(slots=True)
class Group:
    """A parsed ``ReplyGroup``: its arrays, and spans into the message bytes."""

    call_ids: list[int]
    dtypes: list[np.dtype]
    shapes: list[tuple[int, ...]]
    offsets: list[int]
    nbytes: int  # the payload's size
    payload: tuple[int, int] | None = None  # span of the bytes inside the frame
    transport_options: tuple[int, int] | None = None  # span of the Any announcing them
    send_start_micros: int = 0


def _array(buf, span: tuple[int, int] | None, dtype: np.dtype, what: str) -> np.ndarray:
    if span is None:
        return np.empty(0, dtype)
    a, b = span
    if (b - a) % dtype.itemsize:
        raise InvalidArgument(f"group's {what} is not a whole number of {dtype.itemsize}-byte entries")
    return np.frombuffer(buf, dtype, (b - a) // dtype.itemsize, a)


def parse_group(buf, start: int, end: int, max_bytes: int | None = None) -> Group:
    """Read and check the ``ReplyGroup`` in ``buf[start:end]``: every array as
    long as the group, each tensor's bytes inside the payload, and a payload
    announced another way no larger than ``max_bytes``. InvalidArgument (or
    ResourceExhausted) for a group that breaks them; nothing is allocated."""
    spans: dict[int, tuple[int, int]] = {}
    send_start = 0
    for num, wt, a, b in wire.iter_fields(buf, start, end):
        if wt == wire.LEN:
            spans[num] = (a, b)
        elif num == F.GROUP_SEND_START_MICROS and wt == wire.VARINT:
            send_start = wire.to_signed64(a)
    call_ids = _array(buf, spans.get(F.GROUP_CALL_IDS), _U64, "call_ids")
    n = len(call_ids)
    codes = _array(buf, spans.get(F.GROUP_DTYPES), np.dtype(np.uint8), "dtypes")
    ranks = _array(buf, spans.get(F.GROUP_RANKS), _U32, "ranks")
    dims = _array(buf, spans.get(F.GROUP_DIMS), _U64, "dims")
    offsets = _array(buf, spans.get(F.GROUP_OFFSETS), _U64, "offsets")
    if n == 0:
        raise InvalidArgument("group answers no call")
    if len(codes) != n or len(ranks) != n or len(offsets) != n + 1:
        raise InvalidArgument(f"group of {n} calls has {len(codes)} dtypes, {len(ranks)} ranks and "
                              f"{len(offsets)} offsets (needs {n}, {n} and {n + 1})")
    if int(ranks.max()) > _MAX_NDIM:
        raise InvalidArgument(f"group carries a tensor of {int(ranks.max())} dimensions; at most {_MAX_NDIM}")
    if int(ranks.sum()) != len(dims):
        raise InvalidArgument(f"group's ranks add up to {int(ranks.sum())}, but it has {len(dims)} dims")
    payload = spans.get(F.GROUP_PAYLOAD)
    options = spans.get(F.GROUP_TRANSPORT_OPTIONS)
    if (payload is None) == (options is None):
        raise InvalidArgument("group needs exactly one of payload and transport_options")
    offs = offsets.tolist()
    total = offs[-1]
    if payload is not None and payload[1] - payload[0] != total:
        raise InvalidArgument(f"group's payload has {payload[1] - payload[0]} bytes; its offsets say {total}")
    if payload is None and max_bytes is not None and total > max_bytes:
        raise ResourceExhausted(f"group announces {total} bytes; the limit is {max_bytes} (max_tensor_bytes)")
    ids = call_ids.tolist()
    if len(set(ids)) != n:
        raise InvalidArgument("group answers a call twice")
    known = _DTYPES.get
    dts = [known(c) or _dtype(c) for c in codes.tolist()]
    dim_list = dims.tolist()
    shapes: list[tuple[int, ...]] = []
    prod = math.prod
    pos = 0
    prev = 0
    for i, r in enumerate(ranks.tolist()):
        if r == 1:  # the usual case, spelled out
            d = dim_list[pos]
            shape: tuple[int, ...] = (d,)
            nbytes = d * dts[i].itemsize
            if nbytes > _INT64_MAX:
                raise InvalidArgument(f"group's tensor {i} has shape {list(shape)} of {dts[i]}, larger than any "
                                      "array can be")
        else:
            shape = tuple(dim_list[pos:pos + r])
            itemsize = dts[i].itemsize
            nbytes = prod(shape) * itemsize
            # numpy refuses a shape whose non-zero dimensions multiply past its
            # index range, even with another dimension 0 (no bytes at all)
            extent = itemsize
            for d in shape:
                extent *= d or 1
            if extent > _INT64_MAX:
                raise InvalidArgument(f"group's tensor {i} has shape {list(shape)} of {dts[i]}, larger than any "
                                      "array can be")
        pos += r
        o = offs[i]
        if o < prev or o % ALIGN or o + nbytes > offs[i + 1]:
            raise InvalidArgument(f"group's tensor {i} ({nbytes} bytes at offset {o}) does not fit its payload")
        prev = o + nbytes
        shapes.append(shape)
    return Group(ids, dts, shapes, offs, total, payload, options, send_start)


def views(group: Group, base, start: int = 0) -> list[np.ndarray]:
    """Each tensor of ``group`` as a view on ``base`` (the frame's bytes, with
    the payload at ``start``; or the fusion buffer, at 0). Made by the array
    constructor on the buffer directly (half the cost of a flat view reshaped).
    Every view is aligned to its dtype: a payload that lies at an address
    that is not a multiple of ALIGN (the frame began elsewhere) is copied
    once, and the views are made on the copy."""
    if group.nbytes:
        payload = np.frombuffer(base, np.uint8, group.nbytes, start)
        if payload.__array_interface__["data"][0] % ALIGN:
            base, start = payload.copy(), 0
    ndarray = np.ndarray
    return [ndarray(shape, dt, base, start + offset)
            for dt, offset, shape in zip(group.dtypes, group.offsets, group.shapes)]
