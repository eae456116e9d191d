"""Property-based fuzzing of everything that reads bytes or text from outside.

Surfaces: rendezvous keys, TensorProto decoding, stream frames and their
reassembly, the producer's RecvTensor methods through a live rank server,
the daemon's local service through a live daemon (its gRPC service and its
session socket: messages, pooled sends, raw frames), and TOML config files.

Every property accepts exactly two outcomes: a well-formed result (checked,
sizes included), or a RendezvousError of a sensible kind (for a server: a
status with a sensible code, never UNKNOWN or INTERNAL for bad input). A
server or daemon must go on serving afterwards and hold nothing the fuzzing
left behind.

Defects it found are fixed; each one's minimal input stays as a plain test
(look for "DEFECT"), which fails if the defect comes back.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import fcntl
import json
import math
import os
import socket
import struct
import tempfile
import threading
import tomllib
from pathlib import Path
from typing import NamedTuple

import grpc
import ml_dtypes
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import assume, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rendezvous.client.core import GRPC_METHODS, LocalOp
from rendezvous.codec import fields as F
from rendezvous import keys
from rendezvous.codec import dtypes, groups, tensors, wire
from rendezvous.codec.assembly import Assembly
from rendezvous.codec.parsing import StreamFrame, decode_inline, iter_stream_frames, parse_response, parse_stream_frame
from rendezvous.codec.replies import batch_responses, error_frame, stream_frames, unary_response
from rendezvous.local import frames as localwire
from rendezvous.local import segments as shm
from rendezvous.local import messages as local_messages
from rendezvous.buffers import RecvBuffers
from rendezvous.client.aio import Client
from rendezvous.local.messages import parse_reply
from rendezvous.config import _FIELDS as CONFIG_FIELDS
from rendezvous.config import Config
from rendezvous.daemon.daemon import Daemon
from rendezvous.daemon.sessions import FRAME_SLACK
from rendezvous.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    InvalidKey,
    NotFound,
    RendezvousError,
    ResourceExhausted,
    Unavailable,
    UnsupportedDType,
    from_status,
)
from rendezvous.keys import TaskName
from rendezvous.local.frames import Kind
from rendezvous.rpc import servicer as servicer_module
from rendezvous.items import Received
from rendezvous.v1 import local_pb2 as lpb
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import tensor_pb2 as tpb

from conftest import cluster, dev, until
from conftest import key as worker_key

pytestmark = pytest.mark.timeout(120)

LIMIT = 1 << 20  # max_bytes of the decoding properties, max_tensor_bytes of the fuzzed daemon
KEY_FIELDS = frozenset({"key", "src_device", "src_incarnation", "dst_device", "name", "frame_iter"})
# a key error quotes at most _QUOTE_LIMIT characters of text, each at most 10 once repr'd (\U0001xxxx)
QUOTED = 10 * keys._QUOTE_LIMIT + 100
W0 = "/job:worker/replica:0/task:0/device:CPU:0"
W1 = "/job:worker/replica:0/task:1/device:CPU:0"
VALID_KEY = f"{W1};0000000000000000;{W0};edge_1;0:0"
Code = grpc.StatusCode


# -- mutation of valid inputs ---------------------------------------------------------------

_INTERESTING = st.sampled_from([0, 1, 2, 7, 127, 128, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62,
                                2**63 - 1, 2**63, 2**64 - 1])


def _position(draw: st.DrawFn, n: int) -> int:
    """A position in ``[0, n]``, drawn the same way whatever ``n`` is (inputs built
    around a shared-memory segment's name vary in length from run to run)."""
    return draw(st.integers(0, 1 << 16)) % (n + 1)


@st.composite
def _mutated_bytes(draw: st.DrawFn, base: bytes) -> bytes:
    """``base`` with 1 to 4 byte-level edits: overwrite, insert, delete, truncate,
    duplicate a slice, insert a varint of an interesting value or a random field tag."""
    buf = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        i = _position(draw, len(buf))
        op = draw(st.sampled_from(("set", "insert", "delete", "truncate", "duplicate", "varint", "tag")))
        if op == "set":
            if buf:
                buf[min(i, len(buf) - 1)] = draw(st.integers(0, 255))
        elif op == "insert":
            buf[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del buf[i:i + draw(st.integers(1, 8))]
        elif op == "truncate":
            del buf[i:]
        elif op == "duplicate":
            j = i + _position(draw, len(buf) - i)
            buf[j:j] = buf[i:j]
        elif op == "varint":
            buf[i:i] = wire.encode_varint(draw(_INTERESTING))
        else:
            tag = (draw(st.integers(0, 40)) << 3) | draw(st.integers(0, 7))
            buf[i:i] = wire.encode_varint(tag) + draw(st.binary(max_size=4))
    return bytes(buf)


def mutated(base: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    return base.flatmap(_mutated_bytes)


_KEYISH = "/:;0123456789abcdefxABCDEF -_jobreplicatskdvicepugCPUGPU\u0661\n\x00\u00e9"


@st.composite
def _mutated_text(draw: st.DrawFn, base: str) -> str:
    s = base
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(s)))
        j = draw(st.integers(i, min(len(s), i + 6)))
        s = s[:i] + draw(st.text(_KEYISH, max_size=3)) + s[j:]
    return s


# -- 1. keys -----------------------------------------------------------------------------------

_NUMBERS = st.one_of(
    st.integers(0, 3).map(str),
    st.sampled_from(["00", "01", "-1", "+1", "1 ", "0x1", "1_0", "\u0661", "", "2147483647", "2147483648",
                     "9223372036854775807", "9223372036854775808", "18446744073709551615",
                     "18446744073709551616"]),
    st.integers(0, 2**70).map(str),
)
_WORDS = st.one_of(
    st.sampled_from(["worker", "ps", "w_1", "CPU", "GPU", "cpu", "gpu", "job", "Job", "task", "replica",
                     "device", "DEVICE", "1a", "_a", "", "a b", "\u00e9", "a:b"]),
    st.text("abcXYZ019_", min_size=1, max_size=6),
)


@st.composite
def _device_texts(draw: st.DrawFn) -> str:
    """Device-name-like text: components from the grammar, in canonical order or
    any order, with valid and invalid words and numbers."""
    if draw(st.booleans()):
        comps = [c for c in ("job", "replica", "task") if draw(st.booleans())]
        comps.append(draw(st.sampled_from(("device", "legacy"))))
    else:
        comps = draw(st.lists(st.sampled_from(("job", "replica", "task", "device", "legacy", "junk")), max_size=5))
    parts = []
    for comp in comps:
        if comp == "job":
            parts.append(f"job:{draw(_WORDS)}")
        elif comp in ("replica", "task"):
            parts.append(f"{comp}:{draw(_NUMBERS)}")
        elif comp == "device":
            parts.append(f"device:{draw(_WORDS)}:{draw(_NUMBERS)}")
        elif comp == "legacy":
            parts.append(f"{draw(_WORDS)}:{draw(_NUMBERS)}")
        else:
            parts.append(draw(st.text(_KEYISH, max_size=6)))
    return draw(st.sampled_from(("/", "/", "/", "", "//"))) + "/".join(parts)


@st.composite
def _key_texts(draw: st.DrawFn) -> str:
    frame_iter = f"{draw(_NUMBERS)}{draw(st.sampled_from([':', ':', '', '::', ';']))}{draw(_NUMBERS)}"
    return ";".join([draw(_device_texts()), draw(st.text("0123456789abcdefABCDEFg-", max_size=18)),
                     draw(_device_texts()), draw(st.text(max_size=10)), frame_iter])


_IDENTS = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,6}", fullmatch=True)
_DEVICE_INTS = st.integers(0, keys.MAX_DEVICE_INT)


@st.composite
def _valid_devices(draw: st.DrawFn) -> str:
    out = ""
    if draw(st.booleans()):
        out += f"/job:{draw(_IDENTS)}"
    if draw(st.booleans()):
        out += f"/replica:{draw(_DEVICE_INTS)}"
    if draw(st.booleans()):
        out += f"/task:{draw(_DEVICE_INTS)}"
    if draw(st.booleans()):
        return out + f"/device:{draw(_IDENTS)}:{draw(_DEVICE_INTS)}"
    legacy = draw(_IDENTS.filter(lambda t: t.lower() not in {"job", "replica", "task", "device"}))
    return out + f"/{legacy}:{draw(_DEVICE_INTS)}"


_valid_keys = st.builds(
    lambda src, inc, dst, name, frame, it: f"{src};{inc:016x};{dst};{name};{frame}:{it}",
    _valid_devices(), st.integers(0, keys.MAX_INCARNATION), _valid_devices(),
    st.text(min_size=1, max_size=12).map(lambda s: s.replace(";", "")).filter(bool),
    st.integers(0, keys.MAX_FRAME_ID), st.integers(0, keys.MAX_ITER_ID),
)


def _check_key(s: str) -> keys.Key | None:
    """parse_key(s) is a Key that formats to a string parsing back to it, or InvalidKey."""
    try:
        k = keys.parse_key(s)
    except InvalidKey as exc:
        assert exc.field in KEY_FIELDS, exc.field
        assert exc.message.startswith("invalid rendezvous key"), exc.message
        assert len(exc.message) < 2 * QUOTED + 400, "quoted text in a key error is not shortened"
        with pytest.raises(InvalidKey):
            keys.Key.parse(s)  # the uncached parse agrees
        return None
    assert isinstance(k, keys.Key)
    assert len(s) <= keys.MAX_KEY_LENGTH
    text = k.format()
    again = keys.parse_key(text)
    assert again == k and again.format() == text
    assert keys.Key.parse(text) == k and keys.Key.parse(s) == k
    # device names are kept as written, and their parse prints them back
    assert str(k.src) == k.src_device and str(k.dst) == k.dst_device
    return k


@settings(deadline=None, max_examples=800)
@given(st.one_of(
    st.text(max_size=60),
    st.text(_KEYISH, max_size=60),
    _key_texts(),
    _mutated_text(VALID_KEY),
    _valid_keys.flatmap(_mutated_text),
))
def test_fuzz_parse_key_round_trips_or_raises_invalid_key(s):
    _check_key(s)


@settings(deadline=None, max_examples=200)
@given(_valid_keys)
def test_fuzz_canonical_keys_parse_and_format_back_to_themselves(s):
    k = _check_key(s)
    assert k is not None and k.format() == s


@settings(deadline=None, max_examples=60)
@given(st.one_of(st.integers(keys.MAX_KEY_LENGTH - 4, keys.MAX_KEY_LENGTH + 4),
                 st.integers(keys.MAX_KEY_LENGTH + 1, 4 * keys.MAX_KEY_LENGTH)),
       st.booleans(),
       st.characters(exclude_characters=";", exclude_categories=("Cs",)),
       st.text(min_size=1, max_size=12))
def test_fuzz_keys_longer_than_the_limit_always_raise(length, as_name, ch, junk):
    if as_name:  # a valid key but for its length: the name makes it long
        head, tail = f"{W1};0000000000000000;{W0};", ";0:0"
        s = head + ch * (length - len(head) - len(tail)) + tail
    else:
        s = (junk * (length // len(junk) + 1))[:length]
    assert len(s) == length
    if length <= keys.MAX_KEY_LENGTH:
        k = _check_key(s)
        assert k is not None or not as_name
        return
    for parse in (keys.parse_key, keys.Key.parse):
        with pytest.raises(InvalidKey) as info:
            parse(s)
        assert info.value.field == "key"
        assert f"more than the {keys.MAX_KEY_LENGTH}" in info.value.message
        assert len(info.value.message) < QUOTED + 200


# -- 2. tensors ---------------------------------------------------------------------------------

_FIXED = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
          np.uint32, np.uint64, np.bool_, np.complex64, np.complex128]
_SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)
_DTYPE_VALUES = st.one_of(st.sampled_from(sorted(dtypes._DT_NAMES)),
                          st.sampled_from([11, 12, 13, 15, 16, 20, 21, 24, 101, 119]),
                          st.integers(-2**31, 2**31 - 1))
_DIMS = st.one_of(st.integers(-2, 6), st.sampled_from([2**10, 2**17, 2**20, 2**31, 2**40, 2**62, 2**63 - 1, -2**63]))
_I32 = st.integers(-2**31, 2**31 - 1)
_TYPED = {
    "half_val": _I32, "int_val": _I32,
    "float_val": st.floats(width=32), "double_val": st.floats(),
    "int64_val": st.integers(-2**63, 2**63 - 1), "uint32_val": st.integers(0, 2**32 - 1),
    "uint64_val": st.integers(0, 2**64 - 1), "bool_val": st.booleans(), "string_val": st.binary(max_size=8),
    "scomplex_val": st.floats(width=32), "dcomplex_val": st.floats(),
}


@st.composite
def _tensor_protos(draw: st.DrawFn) -> bytes:
    """TensorProtos written by protobuf: any dtype value, odd shapes (negative,
    huge, too many dims, unknown rank), typed fields, content of any length."""
    t = tpb.TensorProto(dtype=draw(_DTYPE_VALUES))
    dims = draw(st.one_of(st.lists(_DIMS, max_size=6), st.integers(30, 70).map(lambda n: [1] * n)))
    for d in dims:
        dim = t.tensor_shape.dim.add(size=d)
        if draw(st.integers(0, 7)) == 0:
            dim.name = draw(st.text(max_size=4))
    if draw(st.integers(0, 9)) == 0:
        t.tensor_shape.unknown_rank = True
    if draw(st.integers(0, 9)) == 0:
        t.version_number = draw(_I32)
    for name in draw(st.lists(st.sampled_from(["tensor_content", *_TYPED]), max_size=3, unique=True)):
        if name == "tensor_content":
            t.tensor_content = draw(st.binary(max_size=64))
        else:
            getattr(t, name).extend(draw(st.lists(_TYPED[name], max_size=8)))
    return t.SerializeToString()


@st.composite
def _small_arrays(draw: st.DrawFn) -> np.ndarray:
    if draw(st.integers(0, 5)) == 0:
        return draw(hnp.arrays(object, _SHAPES, elements=st.binary(max_size=12)))
    return draw(hnp.arrays(st.sampled_from(_FIXED), _SHAPES))


_encodings = _small_arrays().map(tensors.encode_tensor)
_tensor_inputs = st.one_of(
    st.binary(max_size=256),
    _tensor_protos(),
    mutated(_tensor_protos()),
    _encodings,
    mutated(_encodings),
)


_NPY_MAX_INTP = (1 << 63) - 1


def _beyond_numpy(meta: tensors.TensorMeta) -> bool:
    """A shape with no elements whose other dimensions, times the itemsize, are more
    than numpy can index. Decoding one once raised ValueError (the DEFECT of
    test_a_zero_element_tensor_numpy_cannot_shape_is_invalid_argument); now
    decode_meta refuses it with InvalidArgument, so no decoded meta is one."""
    return 0 in meta.shape and math.prod(d for d in meta.shape if d) * meta.dtype.itemsize > _NPY_MAX_INTP


def _check_decode(buf, start: int = 0, end: int | None = None) -> np.ndarray | None:
    """decode_meta and decode_tensor(max_bytes=LIMIT) of buf[start:end]: a bounded,
    well-formed array, or InvalidArgument / UnsupportedDType / ResourceExhausted."""
    try:
        meta, cs, ce = tensors.decode_meta(buf, start, end)
    except RendezvousError as exc:
        assert type(exc) in (InvalidArgument, UnsupportedDType) and exc.message, repr(exc)
        with pytest.raises(InvalidArgument):  # decoding checks the same meta first
            tensors.decode_tensor(buf, start, end, max_bytes=LIMIT)
        return None
    assert isinstance(meta, tensors.TensorMeta) and all(d >= 0 for d in meta.shape)
    assert start <= cs <= ce <= (len(buf) if end is None else end)
    assert not _beyond_numpy(meta)  # refused by decode_meta (see _beyond_numpy)
    try:
        out = tensors.decode_tensor(buf, start, end, max_bytes=LIMIT)
    except ResourceExhausted as exc:
        assert tensors.announced_bytes(meta) > LIMIT, exc.message
        return None
    except InvalidArgument as exc:
        assert type(exc) in (InvalidArgument, UnsupportedDType) and exc.message, repr(exc)
        assert tensors.announced_bytes(meta) <= LIMIT, "a size over max_bytes must be refused as such"
        return None
    assert tensors.announced_bytes(meta) <= LIMIT, "a tensor over max_bytes was decoded"
    assert isinstance(out, np.ndarray) and out.shape == meta.shape and out.dtype == meta.dtype
    if out.dtype == object:
        assert out.size * 8 <= LIMIT
        assert all(type(x) is bytes for x in out.reshape(-1))
    else:
        assert out.nbytes <= LIMIT
        assert dtypes.is_memcpyable(out)
    return out


@settings(deadline=None, max_examples=800)
@given(_tensor_inputs)
def test_fuzz_decode_tensor_is_bounded_or_refuses(buf):
    _check_decode(buf)


def _outcome(buf, start: int = 0, end: int | None = None):
    try:
        out = tensors.decode_tensor(buf, start, end, max_bytes=LIMIT)
    except RendezvousError as exc:
        return type(exc)
    if out.dtype == object:
        return out.dtype, out.shape, out.reshape(-1).tolist()
    return out.dtype, out.shape, out.tobytes()


@settings(deadline=None, max_examples=300)
@given(_tensor_inputs, st.binary(max_size=8), st.binary(max_size=8), st.sampled_from([bytes, bytearray, memoryview]))
def test_fuzz_decode_tensor_reads_only_its_span(buf, head, tail, kind):
    """The same message inside a larger buffer (any buffer type) decodes the same."""
    framed = kind(head + buf + tail)
    _check_decode(framed, len(head), len(head) + len(buf))
    assert _outcome(framed, len(head), len(head) + len(buf)) == _outcome(buf)


@settings(deadline=None, max_examples=200)
@given(_tensor_inputs, st.integers(-4, 300), st.integers(-4, 300))
def test_fuzz_decode_tensor_spans_anywhere(buf, start, end):
    """Any (start, end), in range or not: only InvalidArgument for a bad span."""
    _check_decode(buf, start, end)


def _native(dt: np.dtype) -> np.dtype:
    return dt.newbyteorder("=") if dt.byteorder == ">" else dt


def _views(a: np.ndarray, how: str) -> np.ndarray:
    """``a`` as a non-contiguous view, when it has an axis to make one on."""
    if how == "transpose":
        return a.T
    if how == "step" and a.ndim:
        return a[::2]
    if how == "reverse" and a.ndim:
        return a[::-1]
    return a


_byte_orders = st.sampled_from(_FIXED).flatmap(
    lambda t: st.sampled_from([np.dtype(t), np.dtype(t).newbyteorder(">"), np.dtype(t).newbyteorder("<")]))
_round_trip_arrays = st.one_of(
    hnp.arrays(_byte_orders, _SHAPES),
    hnp.arrays(np.uint16, _SHAPES).map(lambda a: a.view(ml_dtypes.bfloat16)),
)


@settings(deadline=None, max_examples=300)
@given(_round_trip_arrays, st.sampled_from(["none", "transpose", "step", "reverse"]))
def test_fuzz_fixed_dtype_round_trip(a, how):
    a = _views(a, how)
    data = tensors.encode_tensor(a)
    out = tensors.decode_tensor(data)
    assert out.dtype == _native(a.dtype) and out.shape == a.shape
    # bitwise: NaN payloads, signed zeros and subnormals survive
    assert out.tobytes() == np.ascontiguousarray(a, dtype=_native(a.dtype)).tobytes()
    # the announced size is exactly the decoded one: max_bytes refuses one byte less
    assert tensors.decode_tensor(data, max_bytes=out.nbytes).tobytes() == out.tobytes()
    if out.nbytes:
        with pytest.raises(ResourceExhausted):
            tensors.decode_tensor(data, max_bytes=out.nbytes - 1)
    meta, cs, ce = tensors.decode_meta(data)
    assert (meta.dtype, meta.shape, ce - cs) == (out.dtype, out.shape, out.nbytes)


@settings(deadline=None, max_examples=200)
@given(st.one_of(hnp.arrays(object, _SHAPES, elements=st.binary(max_size=16)),
                 hnp.arrays(st.sampled_from([np.dtype("S1"), np.dtype("S5")]), _SHAPES)),
       st.sampled_from(["none", "transpose", "step"]))
def test_fuzz_string_round_trip(a, how):
    a = _views(a, how)
    out = tensors.decode_tensor(tensors.encode_tensor(a))
    assert out.dtype == object and out.shape == a.shape
    assert out.reshape(-1).tolist() == np.ascontiguousarray(a).reshape(-1).tolist()
    assert all(type(x) is bytes for x in out.reshape(-1))


# -- 3. frames ------------------------------------------------------------------------------------

_CALL_IDS = st.one_of(st.integers(0, 5), st.integers(0, 2**64 - 1))
_ERRORS = st.sampled_from([InvalidArgument("bad"), Aborted("step 3 aborted"), NotFound("nope"),
                           FailedPrecondition("not mine"), ResourceExhausted("full"), Unavailable("gone"),
                           ValueError("a bug"), RendezvousError("plain")])


@st.composite
def _frame_messages(draw: st.DrawFn) -> bytes:
    """Valid StreamResponse frames (data, dead, error), batches of them, and
    whole RecvTensorResponses."""
    kind = draw(st.sampled_from(("data", "data", "dead", "error", "batch", "unary", "group")))
    cid = draw(_CALL_IDS)
    if kind == "group":  # a group reply of fixed-size arrays, its payload inside or announced
        arrays = [a for a in draw(st.lists(_small_arrays(), min_size=1, max_size=4))
                  if not a.dtype.hasobject and a.dtype.kind not in "SUV"] or [np.zeros(2)]
        ids = draw(st.lists(_CALL_IDS, min_size=len(arrays), max_size=len(arrays), unique=True))
        inside = draw(st.booleans())
        return groups.group_frame(ids, arrays if inside else None, groups.layout(arrays),
                                 draw(st.integers(0, 2**63 - 1)), None if inside else b"\x0a\x01x")
    if kind == "error":
        return error_frame(cid, draw(_ERRORS))
    if kind == "dead":
        return next(stream_frames(cid, Received(None, True), 1024))
    if kind == "unary":
        return unary_response(Received(draw(_small_arrays()), False), draw(st.integers(-2**63, 2**63 - 1)))
    if kind == "batch":
        return batch_responses(draw(st.lists(_frame_messages(), min_size=1, max_size=3)))
    msgs = list(stream_frames(cid, Received(draw(_small_arrays()), False), draw(st.integers(1, 64)),
                                     draw(st.integers(0, 2**63 - 1))))
    return msgs[draw(st.integers(0, len(msgs) - 1))]


_frame_inputs = st.one_of(st.binary(max_size=200), _frame_messages(), mutated(_frame_messages()))


def _check_inline(buf: bytes, span: tuple[int, int]) -> None:
    """decode_inline(buf, span) with no decoded meta: an array of the announced
    dtype and shape, or an Assembly holding what is here of it, or a RendezvousError."""
    try:
        meta, cs, ce = tensors.decode_meta(buf, *span)
    except RendezvousError as exc:
        assert isinstance(exc, InvalidArgument), repr(exc)
        with pytest.raises(InvalidArgument):
            decode_inline(buf, span)
        return
    assert not _beyond_numpy(meta)  # refused by decode_meta (see _beyond_numpy)
    if tensors.announced_bytes(meta) > LIMIT:
        # bounded by the caller's max_bytes before anything is allocated (once it
        # was not: the DEFECT test_decode_inline_without_decoded_meta_refuses_an_impossible_size)
        with pytest.raises(ResourceExhausted):
            decode_inline(buf, span, max_bytes=LIMIT)
        return
    try:
        out = decode_inline(buf, span, max_bytes=LIMIT)
    except RendezvousError as exc:
        assert isinstance(exc, InvalidArgument), repr(exc)
        return
    if isinstance(out, Assembly):
        assert out.meta == meta and dtypes.is_memcpyable(meta.dtype)
        assert out.dest.nbytes == meta.nbytes and out.filled == ce - cs < meta.nbytes
        assert out.dest[:out.filled].tobytes() == bytes(buf[cs:ce])
    else:
        assert isinstance(out, np.ndarray) and out.shape == meta.shape and out.dtype == meta.dtype
        assert (out.size * 8 if out.dtype == object else out.nbytes) <= LIMIT


def _check_stream_frame(buf: bytes, fr: StreamFrame) -> None:
    # a frame names its call, or is a group (which names its calls inside)
    assert isinstance(fr, StreamFrame) and (0 <= fr.call_id < 2**64 or fr.group is not None)
    head = fr.head
    for span in (fr.chunk, head and head.tensor, head and head.transport_options):
        if span:
            assert 0 <= span[0] <= span[1] <= len(buf)
    if fr.error is not None:
        assert isinstance(fr.error, RendezvousError) and fr.error.code != Code.OK
    if fr.group is not None:
        _check_group(buf, fr.group)
    if head is not None and head.tensor is not None:
        _check_inline(buf, head.tensor)


def _check_group(buf: bytes, span: tuple[int, int]) -> None:
    """A group parses to arrays that fit what it says, or is refused with
    InvalidArgument; its views never reach past its payload."""
    assert 0 <= span[0] <= span[1] <= len(buf)
    try:
        group = groups.parse_group(buf, *span, max_bytes=1 << 20)
    except RendezvousError as exc:
        assert isinstance(exc, (InvalidArgument, ResourceExhausted)), repr(exc)
        return
    assert len(group.call_ids) == len(set(group.call_ids)) == len(group.dtypes) == len(group.shapes)
    if group.payload is None:
        assert group.transport_options is not None and group.nbytes <= 1 << 20
        return
    a, b = group.payload
    assert span[0] <= a <= b <= span[1] and b - a == group.nbytes
    for v, o in zip(groups.views(group, buf, a), group.offsets):
        assert o + v.nbytes <= group.nbytes


@settings(deadline=None, max_examples=600)
@given(_frame_inputs, st.integers(-2, 210), st.integers(-2, 210))
def test_fuzz_frames_parse_or_raise_invalid_argument(buf, start, end):
    try:
        fr = parse_stream_frame(buf)
    except RendezvousError as exc:
        assert isinstance(exc, InvalidArgument), repr(exc)
    else:
        _check_stream_frame(buf, fr)
    try:
        got = list(iter_stream_frames(buf))
    except RendezvousError as exc:
        assert isinstance(exc, InvalidArgument), repr(exc)
    else:
        assert got
        for fr in got:
            _check_stream_frame(buf, fr)
    try:
        head = parse_response(buf)
    except RendezvousError as exc:
        assert isinstance(exc, InvalidArgument), repr(exc)
    else:
        if head.tensor is not None:
            _check_inline(buf, head.tensor)
    # any span: parsed as a frame, and as a tensor
    try:
        fr = parse_stream_frame(buf, start, end)
    except RendezvousError as exc:
        assert isinstance(exc, InvalidArgument), repr(exc)
    else:
        _check_stream_frame(buf, fr)
    _check_inline(buf, (start, end))


@settings(deadline=None, max_examples=200)
@given(st.one_of(_small_arrays(), _round_trip_arrays), _CALL_IDS, st.integers(1, 64), st.booleans())
def test_fuzz_stream_frames_reassemble_to_the_tensor(a, call_id, chunk, batched):
    msgs = list(stream_frames(call_id, Received(a, False), chunk))
    if batched:
        msgs = [batch_responses(msgs)]
    result = assembly = None
    for buf in msgs:
        for fr in iter_stream_frames(buf):
            assert fr.call_id == call_id and fr.error is None and result is None
            if fr.head is not None:
                assert assembly is None and not fr.head.is_dead
                out = decode_inline(buf, fr.head.tensor)
                if isinstance(out, Assembly):
                    assembly = out
                else:
                    result = out
            else:
                assert assembly is not None and fr.chunk is not None
                if assembly.add(memoryview(buf)[fr.chunk[0]:fr.chunk[1]]):
                    result = assembly.result()
    assert result is not None
    assert result.shape == a.shape
    if a.dtype == object:
        assert result.reshape(-1).tolist() == a.reshape(-1).tolist()
    else:
        assert result.dtype == _native(a.dtype)
        assert result.tobytes() == np.ascontiguousarray(a, dtype=_native(a.dtype)).tobytes()


@settings(deadline=None, max_examples=300)
@given(st.sampled_from(_FIXED), st.lists(st.integers(0, 6), max_size=3), st.integers(0, 48),
       st.lists(st.integers(0, 40), max_size=8), st.booleans())
def test_fuzz_assembly_never_writes_past_the_announced_size(dtype, shape, first, parts, cached):
    meta = tensors.TensorMeta(dtype, tuple(shape))
    counter = iter(range(1, 1 << 30))

    def piece(n: int) -> bytes:
        return bytes(next(counter) % 251 + 1 for _ in range(n))  # never 0: unwritten bytes show

    buffers = RecvBuffers(limit=1 << 16, min_bytes=0) if cached else None
    head = piece(first)
    if first > meta.nbytes:
        with pytest.raises(InvalidArgument):
            Assembly(meta, memoryview(head), buffers)
        return
    asm = Assembly(meta, memoryview(head), buffers)
    dest, expected = asm.dest, bytearray(head)
    for n in parts:
        part, before = piece(n), asm.filled
        if before + n > meta.nbytes:
            with pytest.raises(InvalidArgument):
                asm.add(memoryview(part))
            assert asm.filled == before
        else:
            assert asm.add(memoryview(part)) == (before + n == meta.nbytes)
            expected += part
        assert asm.dest is dest and dest.nbytes == meta.nbytes
        assert asm.filled == len(expected) <= meta.nbytes
        assert dest[:asm.filled].tobytes() == bytes(expected)
    if asm.filled == meta.nbytes:
        out = asm.result()
        assert out.shape == meta.shape and out.dtype == meta.dtype and out.tobytes() == bytes(expected)


def _proto(dtype: int, dims: list[int], content: bytes) -> bytes:
    t = tpb.TensorProto(dtype=dtype, tensor_content=content)
    for d in dims:
        t.tensor_shape.dim.add(size=d)
    return t.SerializeToString()


# DT_FLOAT, shape [2**61], 4 bytes of tensor_content: a first frame announcing 2**63 bytes
_ANNOUNCES_2_63 = b'\x08\x01\x12\x0c\x12\n\x08\x80\x80\x80\x80\x80\x80\x80\x80 "\x04\x00\x00\x00\x00'
# DT_FLOAT, shape [2**53], 4 bytes of tensor_content: 32 PiB, more than any address space
_ANNOUNCES_32_PIB = b'\x08\x01\x12\x0b\x12\t\x08\x80\x80\x80\x80\x80\x80\x80\x10"\x04\x00\x00\x00\x00'


@pytest.mark.parametrize("buf", [_ANNOUNCES_2_63, _ANNOUNCES_32_PIB], ids=["2**63 bytes", "32 PiB"])
def test_decode_inline_without_decoded_meta_refuses_an_impossible_size(buf):
    assert buf in (_proto(dtypes.DT_FLOAT, [1 << 61], bytes(4)), _proto(dtypes.DT_FLOAT, [1 << 53], bytes(4)))
    with pytest.raises(RendezvousError):
        decode_inline(buf, (0, len(buf)))


# DT_FLOAT, shape [0, 2**61]: no elements, so nothing announced, but numpy cannot shape it
_ZERO_BUT_HUGE = b"\x08\x01\x12\x0e\x12\x00\x12\n\x08\x80\x80\x80\x80\x80\x80\x80\x80 "


def test_a_zero_element_tensor_numpy_cannot_shape_is_invalid_argument():
    assert _ZERO_BUT_HUGE == _proto(dtypes.DT_FLOAT, [0, 1 << 61], b"")
    with pytest.raises(InvalidArgument):
        tensors.decode_tensor(_ZERO_BUT_HUGE, max_bytes=LIMIT)


# -- shared: an event loop on a thread, so one cluster or daemon serves every example ---------

class _LoopThread:
    """An asyncio loop running on its own thread. ``run`` runs a coroutine on it
    from the test's thread; ``enter`` enters an async context for the module."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self.thread.start()
        self.stack = contextlib.AsyncExitStack()

    def run(self, coro, timeout: float = 30.0):
        async def guarded():
            return await asyncio.wait_for(coro, timeout)
        return asyncio.run_coroutine_threadsafe(guarded(), self.loop).result(timeout + 10)

    def enter(self, cm):
        return self.run(self.stack.enter_async_context(cm))

    def close(self) -> None:
        try:
            self.run(self.stack.aclose(), 30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


_STEPS = st.one_of(st.sampled_from([0, 1, 1, 2]), st.integers(-3, 3), st.sampled_from([2**31, 2**63 - 1, -2**63]))
CHECK_STEP = 7  # the step of the after-fuzzing checks; never aborted by a fuzzed request
_NAMES = st.sampled_from(["a", "b", "edge_1", "a", "b", "x;y", ""])  # mostly valid, so that sends meet recvs


# -- 4. the producer's RecvTensor through a real server --------------------------------------

RECV_UNARY = "/rendezvous.v1.Rendezvous/RecvTensor"
TF_UNARY = "/tensorflow.WorkerService/RecvTensor"
RECV_STREAM = "/rendezvous.v1.Rendezvous/RecvTensorStream"
PRODUCER = TaskName("worker", 0, 1)  # b, the server fuzzed
WAIT_S = 0.1  # deadline of a call whose recv may wait (for a tensor no fuzzed request produces)
INPUT_CODES = frozenset({Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION, Code.NOT_FOUND,
                         Code.RESOURCE_EXHAUSTED, Code.CANCELLED, Code.OK})



def _key_text(src: int, dst: int, name: str, job: str = "worker") -> str:
    """conftest's key, written out: the name may be one no key can have."""
    return f"{dev(job, src)};0000000000000000;{dev(job, dst)};{name};0:0"


_request_keys = st.one_of(
    _NAMES.map(lambda n: _key_text(1, 0, n)),             # b's own: would wait
    _NAMES.map(lambda n: _key_text(1, 0, n)),
    _NAMES.map(lambda n: _key_text(0, 1, n)),             # a's: not this server's
    _NAMES.map(lambda n: f"/cpu:0;0;/cpu:0;{n};0:0"),     # no task: this server's, would wait
    _NAMES.map(lambda n: _key_text(1, 0, n, job="ps")),   # not in the cluster
    _key_texts(), st.text(max_size=30), _mutated_text(VALID_KEY),
    st.just(VALID_KEY + "x" * keys.MAX_KEY_LENGTH),
)


@st.composite
def _recv_requests(draw: st.DrawFn) -> pb.RecvTensorRequest:
    req = pb.RecvTensorRequest(step_id=draw(_STEPS), rendezvous_key=draw(_request_keys), dma_ok=draw(st.booleans()),
                               request_id=draw(st.one_of(st.just(0), st.integers(-2**63, 2**63 - 1))))
    if draw(st.booleans()):
        req.transport_options.type_url = draw(st.text(max_size=20))
        req.transport_options.value = draw(st.binary(max_size=16))
    return req


@st.composite
def _stream_requests(draw: st.DrawFn, nested: bool = True) -> pb.StreamRequest:
    msg = pb.StreamRequest(call_id=draw(_CALL_IDS))
    kind = draw(st.sampled_from(("recv", "recv", "recv_many", "cancel", "none")))
    if kind == "recv":
        msg.recv.CopyFrom(draw(_recv_requests()))
    elif kind == "recv_many":
        many = [draw(_recv_requests()) for _ in range(draw(st.integers(0, 4)))]
        msg.recv_many.step_id = draw(_STEPS)
        msg.recv_many.rendezvous_keys.extend(r.rendezvous_key for r in many)
        ids = [r.request_id % 2**64 for r in many]
        msg.recv_many.request_ids.extend(ids[:len(ids) - draw(st.integers(0, 1))] if ids else ids)
        msg.recv_many.SetInParent()
    elif kind == "cancel":
        msg.cancel.SetInParent()
    if nested and draw(st.integers(0, 2)) == 0:
        msg.batch.extend(draw(st.lists(_stream_requests(nested=draw(st.booleans())), max_size=4)))
    return msg


def _serialized(s: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    return s.map(lambda m: m.SerializeToString())


# half intact requests (most mutated ones no longer parse), a quarter mutated, a quarter garbage
_unary_inputs = st.one_of(_serialized(_recv_requests()), _serialized(_recv_requests()),
                          mutated(_serialized(_recv_requests())), st.binary(max_size=100))
_stream_inputs = st.lists(st.one_of(_serialized(_stream_requests()), _serialized(_stream_requests()),
                                    mutated(_serialized(_stream_requests())), st.binary(max_size=100)),
                          min_size=1, max_size=3)


def _would_wait(req: pb.RecvTensorRequest) -> bool:
    """Whether the server would hold ``req`` waiting (its key is this server's)."""
    try:
        k = keys.parse_key(req.rendezvous_key)
    except InvalidKey:
        return False
    return k.src_task is None or k.src_task == PRODUCER


def _names_an_incarnation(key: str) -> bool:
    """Whether ``key`` parses and names an incarnation of its producer (a mutated
    key often does): one that is not the producer's is ABORTED, by design."""
    try:
        return keys.parse_key(key).src_incarnation != 0
    except InvalidKey:
        return False


def _stream_keys(messages: list[bytes]) -> list[str]:
    """Every key the stream's messages ask for, up to the first that does not parse."""
    out: list[str] = []
    for raw in messages:
        try:
            msg = pb.StreamRequest.FromString(raw)
        except DecodeError:
            break
        for one in (msg, *msg.batch):
            if one.WhichOneof("kind") == "recv":
                out.append(one.recv.rendezvous_key)
            elif one.WhichOneof("kind") == "recv_many":
                out += one.recv_many.rendezvous_keys
    return out


def _unary_aborts(raw: bytes) -> set:
    try:
        stale = _names_an_incarnation(pb.RecvTensorRequest.FromString(raw).rendezvous_key)
    except DecodeError:
        stale = False
    return {Code.ABORTED} if stale else set()


def _unary_may_wait(raw: bytes) -> bool:
    try:
        return _would_wait(pb.RecvTensorRequest.FromString(raw))
    except DecodeError:
        return False


def _stream_may_wait(messages: list[bytes]) -> bool:
    for raw in messages:
        try:
            msg = pb.StreamRequest.FromString(raw)
        except DecodeError:
            return False  # the stream ends here
        for one in (msg, *msg.batch):
            if one.WhichOneof("kind") == "recv" and _would_wait(one.recv):
                return True
            if one.WhichOneof("kind") == "recv_many" and any(
                    _would_wait(pb.RecvTensorRequest(rendezvous_key=k)) for k in one.recv_many.rendezvous_keys):
                return True
    return False


@pytest.fixture(scope="module")
def ranks():
    lt = _LoopThread()
    try:
        a, b = lt.enter(cluster(2))

        async def open_channel():
            return grpc.aio.insecure_channel(b.target)

        channel = lt.run(open_channel())
        lt.stack.push_async_callback(channel.close)
        yield lt, a, b, channel
    finally:
        lt.close()


async def _unary_call(channel, method: str, raw: bytes) -> str:
    """One fuzzed unary call; the status it got."""
    may_wait = _unary_may_wait(raw)
    try:
        reply = await channel.unary_unary(method)(raw, timeout=WAIT_S if may_wait else 5.0)
    except grpc.aio.AioRpcError as exc:
        allowed = INPUT_CODES | ({Code.DEADLINE_EXCEEDED} if may_wait else set()) | _unary_aborts(raw)
        assert exc.code() in allowed, (exc.code(), exc.details(), method, raw)
        return exc.code().name
    pb.RecvTensorResponse.FromString(reply)  # nothing is ever produced, but a reply must parse
    return "OK"


# grpc.aio's own status (not the server's) when a write fails because the call has
# ended at the transport (the server answered a malformed message while we wrote on)
CORE_WRITE_FAILED = "Internal error from Core"


async def _stream_once(channel, messages: list[bytes], timeout: float):
    """(status code, details, replies, messages written) of one stream."""
    call = channel.stream_stream(RECV_STREAM)(timeout=timeout)
    written = 0
    try:
        for raw in messages:
            await call.write(raw)
            written += 1
        await call.done_writing()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.InternalError):
        pass  # the server ended the call already (a malformed request): its status says why
    replies = []
    with contextlib.suppress(grpc.aio.AioRpcError):
        while (reply := await call.read()) is not grpc.aio.EOF:
            replies.append(reply)
    return await call.code(), await call.details(), replies, written


async def _stream_call(channel, messages: list[bytes]) -> str:
    """One fuzzed stream; the status it ended with."""
    may_wait = _stream_may_wait(messages)
    timeout = WAIT_S if may_wait else 5.0
    code, details, replies, written = await _stream_once(channel, messages, timeout)
    for _ in range(5):
        if not (code == Code.INTERNAL and details == CORE_WRITE_FAILED and written < len(messages)):
            break
        # The client library's status, not the server's: replay what was written
        # before the call ended (at least the first message: a short deadline can
        # run out before it under load), to read the server's own status.
        messages = messages[:max(written, 1)]
        code, details, more, written = await _stream_once(channel, messages, timeout)
        replies += more
    aborts = {Code.ABORTED} if any(_names_an_incarnation(k) for k in _stream_keys(messages)) else set()
    allowed = INPUT_CODES | ({Code.DEADLINE_EXCEEDED} if may_wait else set()) | aborts
    assert code in allowed, (code, details, messages)
    for reply in replies:  # every reply the server wrote is a well-formed frame of an error
        for fr in iter_stream_frames(reply):
            assert fr.head is None and fr.chunk is None, "a tensor that was never produced was sent"
            assert fr.error is not None
            assert fr.error.code in (INPUT_CODES | aborts) - {Code.OK}, (fr.error.code, fr.error.message)
    return code.name


async def _rank_still_serves(a, b, streams_before: int, tag: str) -> None:
    await until(lambda: b.servicer.waiting_calls() == 0 and b.table.stats()["waiters"] == 0
                and b.servicer.open_streams() <= streams_before, 10, "the fuzzed calls to be gone")
    assert b.table.stats()["tensors"] == 0 and b.table.stats()["keys"] == 0
    assert len(b.servicer._canonical) <= servicer_module._CACHED_KEYS
    assert all(len(raw) <= servicer_module._CACHED_KEY_CHARS for raw in b.servicer._canonical)
    k = worker_key(1, 0, f"fuzz-check-{tag}")
    b.send(k, np.array([1]), step_id=CHECK_STEP)
    assert (await a.recv(k, step_id=CHECK_STEP, timeout=10)).tolist() == [1]


def test_fuzz_recv_tensor_unary_answers_with_a_status(ranks):
    lt, a, b, channel = ranks
    streams_before = b.servicer.open_streams()

    @settings(deadline=None, max_examples=150)
    @given(st.sampled_from([RECV_UNARY, TF_UNARY]), _unary_inputs)
    def one(method, raw):
        event(f"unary: {lt.run(_unary_call(channel, method, raw))}")

    one()
    lt.run(_rank_still_serves(a, b, streams_before, "unary"))


def test_fuzz_recv_tensor_stream_answers_with_a_status(ranks):
    lt, a, b, channel = ranks
    streams_before = b.servicer.open_streams()

    @settings(deadline=None, max_examples=120)
    @given(_stream_inputs)
    def one(messages):
        event(f"stream: {lt.run(_stream_call(channel, messages))}")

    one()
    lt.run(_rank_still_serves(a, b, streams_before, "stream"))


# -- 5. the daemon's local service ------------------------------------------------------------
#
# A local client reaches rendezvousd two ways: the session socket (frames; a tensor of at
# least the shared-memory threshold travels in a segment of the daemon's pool, lent to the
# client's session) and the gRPC service (every tensor inside its messages). Fuzzed here:
# the local messages over both, pooled sends naming right and wrong segments and sizes from
# the right and the wrong session, and raw bytes on a session socket. After every example
# the daemon still serves, its sessions are alive, and its pool holds nothing the example
# did not leave waiting.

NODE0 = "/job:node/replica:0/task:0/device:CPU:0"
NODE1 = "/job:node/replica:0/task:1/device:CPU:0"
LOCAL_CODES = frozenset({Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION, Code.NOT_FOUND, Code.RESOURCE_EXHAUSTED,
                         Code.ABORTED, Code.CANCELLED})
SHM_THRESHOLD = 256  # low, so that daemon replies go through shared memory too
POOL_BYTES = 64 << 20  # shm_pool_bytes of the fuzzed daemon
FRAME_LIMIT = LIMIT + FRAME_SLACK  # the largest frame body its session socket takes
# deadline of a local recv that may wait with no timeout of its own; not shorter, so that
# a reply written just as the deadline passes stays unlikely
LOCAL_WAIT_S = 0.5
POOL_STEP = 5  # the step of the pooled-send examples
RAW_STEP = 6  # the step of the raw-frame examples
# never aborted by a fuzzed request: 0 and 1 so that sends meet recvs, the others are the tests' own
LIVE_STEPS = frozenset({0, 1, POOL_STEP, RAW_STEP, CHECK_STEP})
# every size class a lend of at most LIMIT bytes gets
LEND_CLASSES = sorted({shm.size_class(n) for n in range(1, LIMIT + 1, 4096)} | {shm.size_class(LIMIT)})


def _node_key(name: str, src: str = NODE0) -> str:
    return f"{src};0000000000000000;{NODE0};{name};0:0"


_local_keys = st.one_of(
    _NAMES.map(_node_key),                                # the daemon's own
    _NAMES.map(_node_key),
    _NAMES.map(_node_key),
    _NAMES.map(lambda n: _node_key(n, NODE1)),            # a task not in its cluster
    _NAMES.map(lambda n: f"/cpu:0;0;/cpu:0;{n};0:0"),     # no task: the daemon's
    _NAMES.map(lambda n: _key_text(0, 1, n)),             # another job
    _key_texts(), st.text(max_size=20), _mutated_text(_node_key("edge_1")),
)
_dtypes_for_shm = st.sampled_from([np.uint8, np.float32, np.int64, np.complex128])
# aborts hit step 2 and steps far off, so that the live steps stay live
_ABORT_STEPS = st.one_of(st.just(2), st.integers(-2**63, 2**63 - 1).filter(lambda s: s not in LIVE_STEPS))


class _Node(NamedTuple):
    lt: _LoopThread
    d: Daemon
    client: Client  # the fuzzing client, on the session socket
    other: Client  # a second session: the "wrong client" of pooled sends
    rpc: Client  # on the gRPC service (shm_ok=False): tensors inline only
    sid: str  # the daemon's session ids of client and other
    other_sid: str


def _session_of(d: Daemon, c: Client) -> str:
    [sid] = [s.id for s in d.sessions.sessions.values() if s.client_id == c.client_id]
    return sid


@pytest.fixture(scope="module")
def node():
    lt = _LoopThread()
    try:
        sockdir = lt.stack.enter_context(tempfile.TemporaryDirectory(prefix="rdv", dir="/tmp"))
        cfg = Config.load(dict(cluster=json.dumps({"node": ["127.0.0.1:0"]}), job_name="node", task_index=0,
                               local_address=f"unix:{sockdir}/d.sock", grace=0.5, connect_timeout=5.0,
                               stall_warning=0.0, max_tensor_bytes=LIMIT, shm_threshold=SHM_THRESHOLD,
                               shm_pool_bytes=POOL_BYTES), env={})

        async def start() -> Daemon:
            d = Daemon(cfg)
            await d.start()
            lt.stack.push_async_callback(d.stop, 0.5)
            d.server.update_cluster({"node": [d.target]})
            return d

        d = lt.run(start())
        assert d.pool is not None and d.sessions is not None, "the fuzzed daemon must have a session socket"
        assert d.sessions.frame_limit == FRAME_LIMIT
        client = lt.enter(Client(d.local_target))
        other = lt.enter(Client(d.local_target))
        rpc = lt.enter(Client(d.local_target, shm_ok=False))
        assert client.session and other.session and client.shm_threshold == SHM_THRESHOLD
        assert not rpc.session
        yield _Node(lt, d, client, other, rpc, _session_of(d, client), _session_of(d, other))
    finally:
        lt.close()


async def _session_call(c: Client, kind: int, raw: bytes, timeout: float) -> bytes | RendezvousError:
    """One frame on ``c``'s session: its reply's body, or the error of its ERROR frame
    (DeadlineExceeded if none came within ``timeout``: a recv is cancelled then)."""
    try:
        return bytes(await c._link.call(LocalOp(kind, raw, timeout)))
    except RendezvousError as exc:
        return exc
    except TimeoutError:
        return DeadlineExceeded(f"no reply within {timeout}s")


async def _rpc_call(c: Client, method: str, raw: bytes, timeout: float) -> bytes | RendezvousError:
    kind = next(k for k, name in GRPC_METHODS.items() if name == method)
    try:
        return await c._do(LocalOp(kind, raw, timeout))
    except RendezvousError as exc:
        return exc


def _local_recv_may_wait(raw: bytes) -> tuple[bool, bool]:
    """(whether the daemon may hold this recv waiting, whether its own timeout of at
    most a second ends that wait)."""
    try:
        req = lpb.LocalRecvRequest.FromString(raw)
        k = keys.parse_key(req.rendezvous_key)
    except (DecodeError, InvalidKey):
        return False, False
    return k.src_task is None or k.src_task == TaskName("node", 0, 0), 0 < req.timeout <= 1


def _check_local_outcome(what: str, out, may_wait: bool = False) -> None:
    event(f"{what}: {out.code.name if isinstance(out, RendezvousError) else 'OK'}")
    if isinstance(out, RendezvousError):
        allowed = LOCAL_CODES | ({Code.DEADLINE_EXCEEDED} if may_wait else set())
        assert out.code in allowed, (what, out.code, out.message)
    else:
        assert isinstance(out, bytes)


def _send_must_fail(raw: bytes) -> bool:
    """Whether the daemon, walking a SendRequest's fields, meets a PoolSlot (or cannot
    walk them: that send fails too)."""
    try:
        return any(num == F.SEND_POOLED and wt == wire.LEN for num, wt, _, _ in wire.iter_fields(raw))
    except RendezvousError:
        return True


def _waiting(d: Daemon) -> collections.Counter:
    """What waits for a recv in the daemon, by (step, key): tensors in its table and
    items kept for the next recv of their key."""
    out: collections.Counter = collections.Counter()
    for e in d.server.pending():
        if e.kind == "tensor":
            out[(e.step_id, str(e.key))] += e.count
    for (step_id, k), kept in d.server.kept.items():
        out[(step_id, k)] += len(kept)
    return out


async def _snapshot(d: Daemon) -> collections.Counter:
    return _waiting(d)


async def _drain(n: _Node, before: collections.Counter) -> None:
    """Receive (and drop) whatever waits beyond ``before``, as a client would."""
    d = n.d
    await until(lambda: not d.local.waits and d.server.table.stats()["waiters"] == 0, 10,
                "the fuzzed recvs to be gone")
    for (step_id, k), count in (_waiting(d) - before).items():
        for _ in range(count):
            await n.client.recv(k, step_id=step_id, timeout=5)
    assert _waiting(d) == before


async def _give_back_lent(n: _Node, taken: tuple[int, ...] = ()) -> None:
    """Release every segment lent to the fixture's sessions: those in their clients'
    stock (the replacements successful pooled sends are answered with) and those of
    ``taken`` (taken from the stock by an example) the daemon still lends them."""
    for c, sid in ((n.client, n.sid), (n.other, n.other_sid)):
        ids = [seg_id for size in LEND_CLASSES for seg_id in iter(lambda: c._link.segments.take(size), None)]
        ids += [seg_id for seg_id in taken if getattr(n.d.pool.get(seg_id), "lent_to", None) == sid]
        if ids:
            c._link.conn.write(localwire.frame(Kind.RELEASE, 0, localwire.pack_ids(ids)))
    await until(lambda: n.d.pool.stats()["lent"] == 0, 5, "the lent segments to be given back")


async def _settled(n: _Node, lent: int = 0) -> None:
    """The fixture's sessions are alive and the pool holds nothing: no segment lent
    (beyond ``lent``), held by a client or under a tensor of the daemon."""
    d = n.d
    await until(lambda: d.pool.stats()["held"] == 0, 5, "the received segments to be released")
    s = d.pool.stats()
    assert s["lent"] == lent and s["in_table"] == 0, s
    if lent == 0:
        assert s["free_bytes"] == s["bytes"] <= POOL_BYTES, s
    assert n.sid in d.sessions.sessions and n.other_sid in d.sessions.sessions, "a fixture session ended"
    assert not n.client._link.conn.closed and not n.other._link.conn.closed
    assert n.rpc.client_id in d.local.attached


def test_fuzz_daemon_local_service(node):
    n = node
    lt, d = n.lt, n.d
    lt.run(_settled(n))

    async def call(via: str, kind: int, method: str, raw: bytes, timeout: float):
        if via == "session":
            return await _session_call(n.client, kind, raw, timeout)
        return await _rpc_call(n.rpc, method, raw, timeout)

    def transport(data) -> str:
        return data.draw(st.sampled_from(["session", "session", "grpc"]), "via")

    def send(data) -> None:
        via, what, intact = transport(data), "raw", False
        # the simplest draws are the intact, valid requests (Hypothesis favours them)
        if data.draw(st.integers(0, 4)) == 4:
            raw = data.draw(st.binary(max_size=120), "raw")
        else:
            req = lpb.SendRequest(step_id=data.draw(_STEPS), rendezvous_key=data.draw(_local_keys),
                                  is_dead=data.draw(st.integers(0, 5)) == 5)
            what = data.draw(st.sampled_from(["array", "array", "proto", "pooled", "named"]), "tensor")
            if what == "array":
                req.tensor.ParseFromString(tensors.encode_tensor(data.draw(_small_arrays())))
            elif what == "proto":
                with contextlib.suppress(DecodeError):  # a proto that protobuf itself refuses stays out
                    req.tensor.ParseFromString(data.draw(_tensor_protos()))
            else:
                value = np.arange(data.draw(st.integers(1, 600)), dtype=data.draw(_dtypes_for_shm))
                meta = tensors.encode_meta(tensors.TensorMeta(value.dtype, value.shape))
                req.tensor.ParseFromString(data.draw(_tensor_protos()) if data.draw(st.booleans())
                                           else data.draw(st.sampled_from([meta, meta, b""])))
                if what == "pooled":  # no segment is lent to this session: none can be right
                    req.pooled.segment = data.draw(st.one_of(st.integers(0, 64), _INTERESTING), "segment")
                    req.pooled.nbytes = data.draw(st.one_of(
                        st.sampled_from([value.nbytes, value.nbytes, 0, -1, value.nbytes + 1, 2**62]),
                        st.integers(-2**63, 2**63 - 1)), "nbytes")
            raw = req.SerializeToString()
            if what == "named":  # a named POSIX segment (field 5, reserved), as clients sent them before
                name = data.draw(st.sampled_from([b"rdv-1-0123456789ab-1", b"", b"/dev/shm/x"]))
                segment = wire.len_field_header(1, len(name)) + name + wire.varint_field(2, value.nbytes)
                raw += wire.len_field_header(F.SEND_NAMED_SHM, len(segment)) + segment
            intact = data.draw(st.integers(0, 2), "mutate") != 2
            if not intact:
                raw = data.draw(_mutated_bytes(raw))
        out = lt.run(call(via, Kind.SEND, "Send", raw, 5.0))
        _check_local_outcome(f"Send/{via}/{what}", out)
        if _send_must_fail(raw):
            # a PoolSlot: no segment is lent to the session, and the gRPC service takes none
            assert isinstance(out, RendezvousError), "a pooled send naming no lent segment was accepted"
            if via == "grpc":
                assert out.code == Code.INVALID_ARGUMENT, (out.code, out.message)
        if intact and what == "named":
            assert isinstance(out, InvalidArgument) and "no longer accepted" in out.message, out

    def recv(data) -> None:
        via = transport(data)
        if data.draw(st.integers(0, 4)) == 4:
            raw = data.draw(st.binary(max_size=80), "raw")
        else:
            req = lpb.LocalRecvRequest(
                step_id=data.draw(_STEPS), rendezvous_key=data.draw(_local_keys),
                timeout=data.draw(st.one_of(st.sampled_from([0.05, 1e-9, 0.0, 1e308]), st.floats())))
            raw = req.SerializeToString()
            if data.draw(st.booleans(), "client_id"):  # field 4, reserved: a client id as clients sent it before
                raw += wire.len_field_header(4, 12) + b"0123456789ab"
            if data.draw(st.integers(0, 2), "mutate") == 2:
                raw = data.draw(_mutated_bytes(raw))
        may_wait, own_deadline = _local_recv_may_wait(raw)
        # a recv with a short timeout of its own is answered by the daemon; one without
        # would wait for good (nothing is sent meanwhile): the call's deadline ends it
        out = lt.run(call(via, Kind.RECV, "Recv", raw, 5.0 if own_deadline or not may_wait else LOCAL_WAIT_S))
        _check_local_outcome(f"Recv/{via}", out, may_wait)
        if isinstance(out, bytes):  # a tensor some fuzzed send left: take it as the client would
            item, _, hop = parse_reply(out, n.client._link.segments.view if via == "session" else None)
            assert item.is_dead or isinstance(item.value, np.ndarray)
            if hop == "shm":  # a view on a pool segment, held by the session until it is dropped
                assert via == "session" and item.value.nbytes >= SHM_THRESHOLD
                assert d.pool.stats()["held"] == 1
            event(f"Recv/{via}: {hop}")

    def recv_many(data) -> None:
        via = transport(data)
        if data.draw(st.integers(0, 4)) == 4:
            raw = data.draw(st.binary(max_size=80), "raw")
        else:
            raw = lpb.LocalRecvManyRequest(
                step_id=data.draw(_STEPS), rendezvous_keys=data.draw(st.lists(_local_keys, max_size=3)),
                timeout=data.draw(st.sampled_from([0.05, 1e-9, 0.0, -1.0]))).SerializeToString()
            if data.draw(st.integers(0, 2), "mutate") == 2:
                raw = data.draw(_mutated_bytes(raw))
        # a batch may wait for good (no timeout of its own): the call's deadline ends it
        out = lt.run(call(via, Kind.RECV_MANY, "RecvMany", raw, LOCAL_WAIT_S))
        _check_local_outcome(f"RecvMany/{via}", out, may_wait=True)
        if isinstance(out, bytes):
            many = lpb.LocalRecvManyResponse.FromString(out)
            assert not (many.replies and many.failures), many
            for failure in many.failures:
                assert from_status(failure.code, "").code in LOCAL_CODES | {Code.DEADLINE_EXCEEDED}, failure
            for reply in many.replies:  # taken as the client would (a pooled one is released when dropped)
                item, _, hop = parse_reply(reply.SerializeToString(),
                                           n.client._link.segments.view if via == "session" else None)
                assert item.is_dead or isinstance(item.value, np.ndarray)
                assert hop == "inline" or via == "session"
            event(f"RecvMany/{via}: {'failed' if many.failures else len(many.replies)}")

    def abort(data) -> None:
        via = transport(data)
        if data.draw(st.integers(0, 3)) == 3:
            raw = data.draw(st.binary(max_size=60), "raw")
        else:
            raw = lpb.AbortRequest(step_id=data.draw(_ABORT_STEPS), message=data.draw(st.text(max_size=20))
                                   ).SerializeToString()
            if data.draw(st.integers(0, 2), "mutate") == 2:
                raw = data.draw(_mutated_bytes(raw))
        with contextlib.suppress(DecodeError):
            assume(lpb.AbortRequest.FromString(raw).step_id not in LIVE_STEPS)
        _check_local_outcome(f"Abort/{via}", lt.run(call(via, Kind.ABORT, "Abort", raw, 5.0)))

    @settings(deadline=None, max_examples=150)
    @given(st.data())
    def one(data):
        op = data.draw(st.sampled_from(["Send", "Send", "Recv", "Recv", "RecvMany", "Abort"]))
        {"Send": send, "Recv": recv, "RecvMany": recv_many, "Abort": abort}[op](data)
        # the sessions live on, and what a session received is released once dropped
        lt.run(_settled(n))

    one()
    lt.run(_drain(n, collections.Counter()))
    lt.run(_node_still_serves(n))


def test_daemon_send_of_a_zero_element_tensor_numpy_cannot_shape_is_invalid_argument(node):
    n = node
    raw = lpb.SendRequest(step_id=1, rendezvous_key=_node_key("zero_but_huge"),
                          tensor=tpb.TensorProto.FromString(_ZERO_BUT_HUGE)).SerializeToString()
    for out in (n.lt.run(_session_call(n.client, Kind.SEND, raw, 5.0)), n.lt.run(_rpc_call(n.rpc, "Send", raw, 5.0))):
        assert isinstance(out, InvalidArgument), (out.code, out.message)


# -- 5b. pooled sends: the right segment, or a wrong one, from the right session or another ---------

def _names_a_segment(raw: bytes) -> bool:
    """Whether a SEND body parses with its ``pooled`` field (else it is a plain send)."""
    try:
        return lpb.SendRequest.FromString(raw).HasField("pooled")
    except DecodeError:
        return True  # refused anyway: never accepted as a plain send


def _pooled_verdict(meta_raw: bytes | None, dead: bool, segment: int, nbytes: int, own: bool, lent: int,
                    size: int) -> grpc.StatusCode | None:
    """What the daemon must answer an intact pooled send: None (accepted) or the code.
    ``lent``/``size``: the segment the daemon lent the owner and its size; ``own``:
    whether the sender is the session it was lent to."""
    if segment <= 0 or nbytes <= 0 or dead or meta_raw is None:
        return Code.INVALID_ARGUMENT
    try:
        meta, _, _ = tensors.decode_meta(meta_raw)
        tensors.check_announced(meta, LIMIT)
    except RendezvousError as exc:
        return exc.code
    if meta.nbytes != nbytes or not own or segment != lent or nbytes > size:
        return Code.INVALID_ARGUMENT
    return None


def test_fuzz_pooled_sends(node):
    n = node
    lt, d = n.lt, n.d
    k = _node_key("pooled")
    lt.run(_give_back_lent(n))
    lt.run(_settled(n))

    async def open_owner(value: np.ndarray) -> tuple[Client, str, int]:
        """A new session (the owner) and a segment the daemon lent it for ``value``, written with it.
        Each example has a session of its own: when it ends, the daemon takes back all it lent."""
        owner = Client(d.local_target)
        await owner.connect()
        sid = _session_of(d, owner)
        grant = await owner._link.call(LocalOp(Kind.LEND, struct.pack("<Q", value.nbytes), 5))
        [(granted, size)] = localwire.unpack_grants(grant)
        seg_id = owner._link.segments.take(value.nbytes)
        assert seg_id == granted and size == shm.size_class(value.nbytes)
        seg = d.pool.get(seg_id)
        assert seg.lent_to == sid and seg.held_by is None and not seg.tensor and seg.size == size
        assert d.pool.stats()["lent"] == 1
        owner._link.segments.write(seg_id, value)
        return owner, sid, seg_id

    async def close_owner(owner: Client, sid: str) -> None:
        await owner.close()
        await until(lambda: sid not in d.sessions.sessions, 5, "the owner's session to end")

    async def recv(c: Client, sid: str | None, seg_id: int, check) -> None:
        got = await c.recv(k, step_id=POOL_STEP, timeout=5)
        check(got)
        if sid is not None and got.nbytes >= SHM_THRESHOLD:  # the segment itself, handed over (no copy)
            assert d.pool.get(seg_id).held_by == sid and d.pool.stats()["held"] == 1
        del got

    @settings(deadline=None, max_examples=75)
    @given(st.data())
    def one(data):
        before = lt.run(_snapshot(d))
        value = np.arange(data.draw(st.integers(1, 20000), "elements"), dtype=data.draw(_dtypes_for_shm))
        if value.size % 2 == 0 and data.draw(st.booleans(), "2-d"):
            value = value.reshape(2, -1)
        owner, sid, seg_id = lt.run(open_owner(value))
        try:
            example(data, owner, sid, value, seg_id, before)
        finally:  # the owner goes with what it was lent; what the example left waiting is received
            lt.run(close_owner(owner, sid))
            lt.run(_drain(n, before))
        lt.run(_settled(n))
        assert lt.run(_snapshot(d)) == before

    def example(data, owner: Client, sid: str, value: np.ndarray, seg_id: int, before: collections.Counter) -> None:
        size = d.pool.get(seg_id).size
        sessions = {"owner": (owner, sid), "other": (n.other, n.other_sid), "grpc": (n.rpc, None)}
        meta = tensors.encode_meta(tensors.TensorMeta(value.dtype, value.shape))
        # a quarter the send a client makes; the others draw each part, right or wrong
        right = data.draw(st.integers(0, 3), "right") == 0
        sender = "owner" if right else data.draw(st.sampled_from(["owner", "owner", "other"]), "sender")
        which = "real" if right else data.draw(st.sampled_from(["real", "real", "another", "zero", "huge"]),
                                               "segment")
        if which == "real":
            segment = seg_id
        elif which == "another":  # a neighbour: free, or no segment at all; not lent to anyone
            segment = max(1, seg_id + data.draw(st.sampled_from([-2, -1, 1, 2])))
            segment = segment if segment != seg_id else seg_id + 1
        elif which == "huge":
            segment = data.draw(st.sampled_from([2**63, 2**64 - 1, seg_id + 2**32]))
        else:
            segment = 0
        nbytes = value.nbytes if right else data.draw(
            st.sampled_from([value.nbytes, value.nbytes, 0, -1, value.nbytes + 1, 2**62]), "nbytes")
        meta_raw = meta if right else data.draw(st.one_of(st.sampled_from([meta, meta, meta, None]),
                                                          _tensor_protos()), "meta")
        dead = not right and data.draw(st.integers(0, 9)) == 0
        req = lpb.SendRequest(step_id=POOL_STEP, rendezvous_key=k, is_dead=dead)
        if meta_raw is not None:
            req.tensor.ParseFromString(meta_raw)
        req.pooled.segment = segment
        req.pooled.nbytes = nbytes
        raw = req.SerializeToString()
        intact = right or data.draw(st.integers(0, 3), "mutate") != 3
        if not intact:
            raw = data.draw(_mutated_bytes(raw))
        out = lt.run(_session_call(sessions[sender][0], Kind.SEND, raw, 5.0))
        _check_local_outcome(f"pooled Send ({sender}, {which} segment)", out)
        seg = d.pool.get(seg_id)
        meta_field = req.tensor.SerializeToString() if req.HasField("tensor") else None
        if intact:  # accepted exactly when the owner names its segment, its size and a matching meta
            verdict = _pooled_verdict(meta_field, dead, segment, nbytes, sender == "owner", seg_id, size)
            outcome = out.code if isinstance(out, RendezvousError) else None
            assert outcome == verdict, (verdict, outcome, getattr(out, "message", ""), sender, which, nbytes)
        if isinstance(out, RendezvousError):
            # a mutation may also name a step that the other properties aborted in this daemon
            allowed = (Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED) + (() if intact else (Code.ABORTED,))
            assert out.code in allowed, (out.code, out.message)
            assert lt.run(_snapshot(d)) == before, "a refused send left a tensor"
            assert seg is not None and not seg.tensor and seg.held_by is None
            if sender == "other":  # another session's segment: refused, and left to its owner
                assert seg.lent_to == sid, seg.lent_to
                if intact and _pooled_verdict(meta_field, dead, segment, nbytes, True, seg_id, size) is None:
                    assert "not lent to this client" in out.message, out.message
            elif intact and segment == seg_id and nbytes > 0:
                assert seg.lent_to is None, "a refused send kept its segment lent (the client forgets it)"
            elif intact and segment != seg_id:
                assert seg.lent_to == sid, "a send naming another segment took this one"
            else:
                assert seg.lent_to in (sid, None), seg.lent_to
            return
        if not intact and not _names_a_segment(raw):
            # the mutation made a plain send (no pooled field; a TensorProto with no
            # content is zeros): accepted from any session, the lent segment untouched
            assert seg is not None and not seg.tensor and seg.lent_to == sid, (sender, which)
            left = lt.run(_snapshot(d)) - before
            assert sum(left.values()) == 1, left
            event("mutated into a plain Send, accepted")
            return
        # accepted: only the owner's own segment can be (the only one lent), now under the tensor
        assert sender == "owner" and seg is not None and seg.tensor and seg.lent_to is None, (sender, which)
        for granted, _ in localwire.unpack_grants(out):  # a replacement, lent for the owner's next send
            assert granted != seg_id and d.pool.get(granted).lent_to == sid
        s = d.pool.stats()
        assert s["in_table"] == 1 and s["held"] == 0, s
        left = lt.run(_snapshot(d)) - before
        assert sum(left.values()) == 1, left
        if intact:
            assert left == collections.Counter({(POOL_STEP, k): 1}), left
            got_meta, _, _ = tensors.decode_meta(meta_field)
            who = data.draw(st.sampled_from(sorted(sessions)), "recipient")

            def check(got: np.ndarray) -> None:
                assert got.dtype == got_meta.dtype and got.shape == got_meta.shape
                if meta_raw == meta:
                    assert np.array_equal(got, value)
                else:  # another dtype and shape of as many bytes: the same bytes
                    assert got.tobytes()[:value.nbytes] == value.tobytes()[:got.nbytes]

            lt.run(recv(*sessions[who], seg_id, check))
            event(f"pooled Send accepted, received by {who}")

    one()
    lt.run(_node_still_serves(n))


# -- 5c. raw bytes on a session socket -------------------------------------------------------

REPLY_KINDS = frozenset({Kind.OK, Kind.ERROR, Kind.RECV_REPLY, Kind.RECV_MANY_REPLY, Kind.SEGMENTS, Kind.RETIRE,
                         Kind.WELCOME, Kind.PENDING_REPLY})
# frames answered at once, in order (a RECV is answered when its tensor comes; RELEASE and CANCEL never)
# (a RECV, RECV_MANY or SEND_IPC is answered once its work is done, maybe after the sentinel)
SYNC_KINDS = frozenset(range(256)) - {Kind.RECV, Kind.RECV_MANY, Kind.RELEASE, Kind.CANCEL, Kind.IPC_RELEASE,
                                      Kind.SEND_IPC}
CLIENT_KINDS = [k for k in Kind if k < 0x80]
SENTINEL = 2**64 - 1  # the op id of the PENDING frame that ends an example's stream
RAW_KEY = _node_key("raw")
HELLO_FRAME = localwire.frame(Kind.HELLO, 1, lpb.AttachRequest(client_id="0123456789ab", pid=1).SerializeToString())
_raw_steps = st.sampled_from([RAW_STEP, RAW_STEP, 0, 1])
_raw_keys = st.one_of(st.just(RAW_KEY), st.just(RAW_KEY), _local_keys)


@st.composite
def _raw_frames(draw: st.DrawFn) -> bytes:
    """One well-formed frame a client could write (its body valid or not)."""
    kind = draw(st.one_of(st.sampled_from(CLIENT_KINDS), st.sampled_from(CLIENT_KINDS),
                          st.integers(0, 255)), "kind")
    op = draw(st.integers(1, 6), "op")  # few ids: a CANCEL meets its RECV, a RECV meets one in flight
    if kind in (Kind.SEND, Kind.RETURN):
        req = lpb.SendRequest(step_id=draw(_raw_steps), rendezvous_key=draw(_raw_keys),
                              is_dead=draw(st.integers(0, 9)) == 0)
        value = draw(_small_arrays()) if draw(st.booleans()) else np.arange(draw(st.integers(1, 100)))
        if value.dtype != object and draw(st.booleans()):
            req.tensor.ParseFromString(tensors.encode_meta(tensors.TensorMeta(value.dtype, value.shape)))
            req.pooled.segment = draw(st.integers(0, 40))
            req.pooled.nbytes = draw(st.sampled_from([value.nbytes, value.nbytes, 0, -1]))
        else:
            req.tensor.ParseFromString(tensors.encode_tensor(value))
        body = req.SerializeToString()
    elif kind == Kind.RECV:
        body = lpb.LocalRecvRequest(step_id=draw(_raw_steps), rendezvous_key=draw(_raw_keys),
                                    timeout=draw(st.sampled_from([0.0, 0.0, 0.01, 1e-9, -1.0]))).SerializeToString()
    elif kind == Kind.SEND_MANY:
        keys_ = draw(st.lists(_raw_keys, max_size=3))
        body = local_messages.send_many_request(keys_, [np.arange(draw(st.integers(1, 50))) for _ in keys_],
                                                draw(_raw_steps))
    elif kind == Kind.RECV_MANY:
        body = lpb.LocalRecvManyRequest(step_id=draw(_raw_steps), rendezvous_keys=draw(st.lists(_raw_keys, max_size=4)),
                                        timeout=draw(st.sampled_from([0.0, 0.01, 1e-9, -1.0]))).SerializeToString()
    elif kind == Kind.ABORT:
        body = lpb.AbortRequest(step_id=draw(_ABORT_STEPS), message=draw(st.text(max_size=8))).SerializeToString()
    elif kind == Kind.RELEASE:
        body = localwire.pack_ids(draw(st.lists(st.one_of(st.integers(0, 40), _INTERESTING), max_size=4)))
    elif kind == Kind.LEND:
        body = struct.pack("<Q", draw(st.one_of(st.sampled_from([0, 1, SHM_THRESHOLD, 1 << 16, LIMIT, LIMIT + 1]),
                                                _INTERESTING)))
    elif kind == Kind.HELLO:
        body = lpb.AttachRequest(client_id=draw(st.text(max_size=40)), pid=draw(st.integers(-2**63, 2**63 - 1))
                                 ).SerializeToString()
    elif kind in (Kind.PENDING, Kind.CANCEL):
        body = b""
    else:
        body = draw(st.binary(max_size=24))
    if draw(st.integers(0, 5)) == 0:  # a body of the wrong length or kind
        body = draw(st.binary(max_size=24))
    return localwire.frame(kind, op, body)


@st.composite
def _reframed(draw: st.DrawFn) -> bytes:
    """A frame whose body was mutated, with its header telling the new length."""
    [(kind, op, body)], _ = _split_frames(draw(_raw_frames()))
    if draw(st.integers(0, 4)) == 0:
        kind = draw(st.integers(0, 255), "kind")
    return localwire.frame(kind, op, draw(_mutated_bytes(body)))


@st.composite
def _raw_streams(draw: st.DrawFn, preloaded: bool = False) -> bytes:
    """What a broken or hostile client writes: mostly a HELLO first, then frames
    (their bodies intact or mutated), and sometimes an end that breaks the framing:
    a mutated frame, junk, or a header announcing more than the socket takes.
    ``preloaded``: a tensor waits under RAW_KEY; the stream mostly asks for it."""
    parts = [HELLO_FRAME] if draw(st.integers(0, 5)) else []
    if preloaded and draw(st.integers(0, 3)):
        parts.append(localwire.frame(Kind.RECV, 6, lpb.LocalRecvRequest(step_id=RAW_STEP, rendezvous_key=RAW_KEY)
                                     .SerializeToString()))
    for _ in range(draw(st.integers(0, 5), "frames")):
        parts.append(draw(_raw_frames()) if draw(st.integers(0, 3)) else draw(_reframed()))
    how = draw(st.sampled_from(["none", "none", "none", "mutated", "junk", "header"]), "end")
    if how == "mutated":
        parts.append(draw(_raw_frames().flatmap(_mutated_bytes)))
    elif how == "junk":
        parts.append(draw(st.binary(min_size=1, max_size=40)))
    elif how == "header":
        length = draw(st.sampled_from([FRAME_LIMIT, FRAME_LIMIT + 1, 2**32 - 1, 300_000, 40]))
        parts.append(localwire.HEADER.pack(length, draw(st.integers(0, 255)), draw(st.integers(0, 2**64 - 1))))
    return b"".join(parts)


def _split_frames(stream: bytes) -> tuple[list[tuple[int, int, bytes]], str]:
    """The frames the daemon reads from ``stream``, and how it ends: "whole",
    "partial" (a frame begun and not ended) or "broken" (a frame over the limit)."""
    out, pos, hsize = [], 0, localwire.HEADER.size
    while len(stream) - pos >= hsize:
        length, kind, op = localwire.HEADER.unpack_from(stream, pos)
        if length > FRAME_LIMIT:
            return out, "broken"
        if pos + hsize + length > len(stream):
            return out, "partial"
        out.append((kind, op, stream[pos + hsize:pos + hsize + length]))
        pos += hsize + length
    return out, "whole" if pos == len(stream) else "partial"


def _greeted(frames_in: list[tuple[int, int, bytes]]) -> bool:
    """Whether the session opens (a HELLO the daemon can parse comes before any other frame)."""
    for kind, _, body in frames_in:
        if kind != Kind.HELLO:
            return False
        with contextlib.suppress(DecodeError):
            lpb.AttachRequest.FromString(body)
            return True
    return False


def _raw_exchange(path: str, stream: bytes, end_writes: bool) -> tuple[list[tuple[int, int, bytes]], list[int], bool]:
    """Write ``stream`` on a fresh session socket and read what comes back until the
    sentinel's answer or the end of the connection: (frames, descriptors, whether the
    daemon closed it). ``end_writes``: shut this side's writing after the stream."""
    reader = localwire.FrameReader(1 << 40)
    got: list[tuple[int, int, bytes]] = []
    fds: list[int] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5.0)
        sock.connect(path)
        try:
            sock.sendall(stream)
            if end_writes:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon has closed it already (what is read says so)
        while True:
            try:
                data, anc, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(localwire.MAX_FDS * 4))
            except ConnectionResetError:
                data, anc = b"", []
            except TimeoutError:
                raise AssertionError(f"the daemon neither answered nor closed; it answered {got}") from None
            fds.extend(localwire.take_fds(anc))
            if not data:
                return got, fds, True
            got += [(kind, op, bytes(body)) for kind, op, body in reader.feed(data)]
            if (Kind.PENDING_REPLY, SENTINEL) in {(kind, op) for kind, op, _ in got}:
                # what came with the sentinel's answer counts too (its descriptors came with it)
                return got, fds, False


def _check_raw_replies(sent: list[tuple[int, int, bytes]], got: list[tuple[int, int, bytes]], fds: list[int]) -> None:
    ops = {op for _, op, _ in sent}
    grants = []
    for kind, op, body in got:
        assert kind in REPLY_KINDS, f"the daemon wrote a frame of kind {kind}"
        event(f"raw: {Kind(kind).name}")
        if kind in (Kind.SEGMENTS, Kind.RETIRE):
            assert op == 0
            if kind == Kind.SEGMENTS:
                grants += localwire.unpack_grants(body)
            continue
        if kind == Kind.ERROR and op == 0:  # the session's end, and why (it broke the framing)
            assert (kind, op, body) == got[-1], "the daemon went on after ending the session"
            code, _ = localwire.unpack_error(body)
            assert from_status(code, "").code in (Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED)
            continue
        assert op in ops, f"a reply to operation {op}, which was never sent"
        if kind == Kind.ERROR:
            code, message = localwire.unpack_error(body)
            err = from_status(code, message)
            event(f"raw: ERROR {err.code.name}")
            assert err.code in LOCAL_CODES | {Code.DEADLINE_EXCEEDED}, (err.code, message)
        elif kind == Kind.WELCOME:
            info = lpb.AttachResponse.FromString(body)
            assert info.shm_threshold == SHM_THRESHOLD and info.max_frame_bytes == FRAME_LIMIT
        elif kind == Kind.RECV_REPLY:
            lpb.LocalRecvResponse.FromString(body)
            event("raw: RECV_REPLY")
        elif kind == Kind.RECV_MANY_REPLY:
            many = lpb.LocalRecvManyResponse.FromString(body)
            assert not (many.replies and many.failures)
            event(f"raw: RECV_MANY_REPLY {'failed' if many.failures else 'answered'}")
        elif kind == Kind.PENDING_REPLY:
            lpb.PendingResponse.FromString(body)
        elif body:  # OK: a segment lent
            assert len(localwire.unpack_grants(body)) == 1
    # every descriptor came with its SEGMENTS frame, and is a sealed memfd of the size announced
    assert len(fds) == len(grants), (len(fds), grants)
    for fd, (_, size) in zip(fds, grants):
        assert os.fstat(fd).st_size == size
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & shm.SEALS == shm.SEALS


def test_fuzz_session_socket_raw_frames(node):
    n = node
    lt, d = n.lt, n.d
    lt.run(_give_back_lent(n))
    lt.run(_settled(n))
    sessions = set(d.sessions.sessions)
    sentinel = localwire.frame(Kind.PENDING, SENTINEL)

    async def produce(k: str, value: np.ndarray, step_id: int) -> None:
        """Send from a client of its own: the tensor outlives its session, the segment lent
        to replace the one it filled does not."""
        async with Client(d.local_target) as p:
            await p.send(k, value, step_id=step_id)
            assert p.stats() == {"send_shm": 1}
        await until(lambda: set(d.sessions.sessions) == sessions and d.pool.stats()["lent"] == 0, 5,
                    "the producer's session to end")
        assert d.pool.stats()["in_table"] == 1

    async def after(before: collections.Counter) -> None:
        # the raw session is gone, and with it every hold it had
        await until(lambda: set(d.sessions.sessions) == sessions, 5, "the raw session to end")
        await until(lambda: d.pool.stats()["held"] == 0 and d.pool.stats()["lent"] == 0, 5,
                    "the raw session's segments to be given back")
        await _drain(n, before)
        await _settled(n)
        # a new client works
        async with Client(d.local_target) as c:
            assert c.session
            check = _node_key("raw-check")
            for value in (np.arange(3), np.arange(300, dtype=np.float32)):  # inline, then through the pool
                await c.send(check, value, step_id=CHECK_STEP)
                got = await c.recv(check, step_id=CHECK_STEP, timeout=5)
                assert np.array_equal(got, value)
                del got
            assert c.stats()["send_shm"] == 1 and c.stats()["recv_shm"] == 1
        await until(lambda: set(d.sessions.sessions) == sessions and d.pool.stats()["lent"] == 0, 5,
                    "the checking client's session to end")
        await _settled(n)
        assert _waiting(d) == before

    @settings(deadline=None, max_examples=75)
    # found by this test: a RECV_MANY of one key twice with one tensor there, ended
    # with its session; the kept tensor's segment stayed "in the table" after delivery
    @example((True, b'\x10\x00\x00\x00\x01\x01\x00\x00\x00\x00\x00\x00\x00\n\x0c0123456789ab\x10\x01\xd6\x00\x00\x00\n\x01\x00\x00\x00\x00\x00\x00\x00\x08\x06\x12h' + RAW_KEY.encode() + b'\x12h' + RAW_KEY.encode()))
    @given(st.booleans().flatmap(lambda preload: st.tuples(st.just(preload), _raw_streams(preload))))
    def one(drawn):
        preload, stream = drawn
        sent, ending = _split_frames(stream + sentinel)
        for kind, _, body in sent:  # steps 0 and 1 stay live, and the tests' own
            if kind == Kind.ABORT:
                with contextlib.suppress(DecodeError):
                    assume(lpb.AbortRequest.FromString(body).step_id not in LIVE_STEPS)
        answered = ending == "whole" and sent[-1] == (Kind.PENDING, SENTINEL, b"")
        opens = _greeted(sent)
        event(f"raw: {ending}, {'opens' if opens else 'no hello'}")
        before = lt.run(_snapshot(d))
        if preload:  # a tensor on a pool segment for the raw session's RECVs of RAW_KEY
            lt.run(produce(RAW_KEY, np.arange(100, dtype=np.float64), RAW_STEP))
        fds: list[int] = []
        try:
            # a stream that ends inside a frame (or swallowed the sentinel) is ended by closing this side
            unfinished = ending == "partial" or (ending == "whole" and not answered)
            got, fds, closed = _raw_exchange(d.sessions.path, stream + sentinel, end_writes=unfinished)
            _check_raw_replies(sent, got, fds)
            if answered and opens:
                # bad frames get ERROR frames; the session lives on and answers the sentinel
                assert not closed, "the daemon closed a session over a well-framed stream"
                replies = collections.Counter(op for kind, op, _ in got if kind not in (Kind.SEGMENTS, Kind.RETIRE))
                for kind, op, _ in sent:
                    if kind in SYNC_KINDS:
                        replies[op] -= 1
                assert min(replies.values(), default=0) >= 0, ("a frame went unanswered", replies)
            else:
                # broken framing, or no HELLO first: the daemon ends the session
                assert closed, "the daemon did not close a session it cannot go on with"
        finally:
            for fd in fds:
                os.close(fd)
        lt.run(after(before))

    one()
    lt.run(_node_still_serves(n))


async def _node_still_serves(n: _Node) -> None:
    d = n.d
    await until(lambda: not d.local.waits and d.server.table.stats()["waiters"] == 0, 10,
                "the fuzzed recvs to be gone")
    k = _node_key("fuzz-check")
    big = np.arange(1 << 12, dtype=np.float32)  # 16 KiB: through the pool on the session socket
    for sender, receiver in ((n.client, n.client), (n.rpc, n.client), (n.client, n.rpc), (n.other, n.client)):
        await sender.send(k, np.array([1]), step_id=CHECK_STEP)
        assert (await receiver.recv(k, step_id=CHECK_STEP, timeout=10)).tolist() == [1]
        await sender.send(k, big, step_id=CHECK_STEP)
        got = await receiver.recv(k, step_id=CHECK_STEP, timeout=10)
        assert np.array_equal(got, big)
        del got
    assert n.client.stats().get("send_shm", 0) >= 1 and n.client.stats().get("recv_shm", 0) >= 1
    await _give_back_lent(n)
    await _settled(n)
    assert _waiting(d) == collections.Counter()


# -- 6. config files ------------------------------------------------------------------------------

def _toml_string(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _toml_string(v)
    if isinstance(v, datetime.datetime):
        return v.isoformat()
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{_toml_string(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"


def _toml(data: dict) -> str:
    return "".join(f"{_toml_string(k)} = {_toml_value(v)}\n" for k, v in data.items())


# TOML's integers are 64-bit; larger ones (which tomllib reads anyway) have their
# own test: test_a_config_integer_too_large_for_a_float_is_invalid_argument.
_toml_scalars = st.one_of(
    st.integers(-2**63, 2**63 - 1), st.integers(-3, 70000), st.floats(), st.booleans(), st.text(max_size=12),
    st.sampled_from(["grpc", "grpc+mpi", "json", "text", "debug", "1", "0", "auto", "4096", "-1", "1e400", "nan",
                     "", "unix:/tmp/x.sock"]),
    st.datetimes(),
)
_toml_values = st.one_of(_toml_scalars, st.lists(_toml_scalars, max_size=3),
                         st.dictionaries(st.text(max_size=4), _toml_scalars, max_size=2))
_config_keys = st.one_of(st.sampled_from(sorted(CONFIG_FIELDS)), st.text(max_size=10))


def _check_config_file(path: Path, data: dict | None) -> None:
    """Config.load of the file: a Config whose values came from it, typed as the
    fields are, or InvalidArgument naming the key (or saying it is not TOML)."""
    try:
        cfg = Config.load(env={}, file=path)
    except InvalidArgument as exc:
        msg = exc.message
        if data is None:
            assert "is not TOML" in msg, msg
        else:
            assert any(name in msg or repr(name) in msg for name in data), msg
        return
    assert data is not None, "a file that is not TOML was read"
    for name, value in data.items():
        assert name in CONFIG_FIELDS, f"unknown key {name!r} accepted"
        assert cfg.sources[name] == f"file {path}"
        got, default = getattr(cfg, name), CONFIG_FIELDS[name].default
        if default is None:
            assert got is None or type(got) is bool, (name, got)
        else:
            assert type(got) is type(default), (name, got)
        if not isinstance(value, str) and not (isinstance(value, float) and math.isnan(value)):
            # a TOML integer for a float field is that integer as a float (rounded past 2**53)
            want = float(value) if isinstance(got, float) and type(value) is int else value
            assert got == want, (name, got, value)


@settings(deadline=None, max_examples=250)
@given(st.dictionaries(_config_keys, _toml_values, max_size=5))
def test_fuzz_config_file_values(data):
    with tempfile.TemporaryDirectory(prefix="rdv-cfg") as tmp:
        path = Path(tmp) / "rendezvousd.toml"
        path.write_text(_toml(data), encoding="utf-8")
        if "nan" not in repr(data):  # the writer writes what was drawn (NaN never compares equal)
            assert tomllib.loads(path.read_text(encoding="utf-8")) == data
        _check_config_file(path, data)


@settings(deadline=None, max_examples=150)
@given(st.one_of(st.text(max_size=80), st.text("abc_=\"'[]{}.,#\n 019+-eEinfa", max_size=60),
                 st.binary(max_size=60).map(lambda b: b.decode("latin-1")),
                 st.dictionaries(_config_keys, _toml_values, max_size=4).map(_toml).flatmap(_mutated_text)))
def test_fuzz_config_file_text(text):
    # Written as UTF-8; a file that is not has its own test:
    # test_a_config_file_that_is_not_utf8_is_invalid_argument.
    with tempfile.TemporaryDirectory(prefix="rdv-cfg") as tmp:
        path = Path(tmp) / "rendezvousd.toml"
        path.write_bytes(text.encode("utf-8"))
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            data = None
        _check_config_file(path, data)


def test_a_config_file_that_is_not_utf8_is_invalid_argument(tmp_path):
    path = tmp_path / "rendezvousd.toml"
    path.write_bytes(b"\xff")
    with pytest.raises(InvalidArgument):
        Config.load(env={}, file=path)


def test_a_config_integer_too_large_for_a_float_is_invalid_argument(tmp_path):
    path = tmp_path / "rendezvousd.toml"
    path.write_text("grace = 1" + "0" * 309 + "\n")
    with pytest.raises(InvalidArgument, match="grace"):
        Config.load(env={}, file=path)
