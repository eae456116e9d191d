"""Replies as the consumer reads them: a StreamResponse split into its frames
and each frame into its parts, as offsets into the message (nothing copied),
and an inline tensor decoded to a view on the message where it can be."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from ..buffers import RecvBuffers
from ..errors import InvalidArgument, RendezvousError, from_status
from ..v1 import rendezvous_pb2 as pb
from . import fields as F
from . import wire
from .assembly import Assembly
from .tensors import TensorMeta, check_announced, decode_meta, decode_tensor

__all__ = ["ReplyHead", "parse_response", "StreamFrame", "iter_stream_frames", "parse_stream_frame",
           "decode_inline", "is_memcpyable_meta"]


@dataclass(slots=True)
class ReplyHead:
    """What the first part of a reply says, as offsets into the message bytes."""

    is_dead: bool = False
    tensor: tuple[int, int] | None = None             # TensorProto span
    transport_options: tuple[int, int] | None = None  # google.protobuf.Any span
    send_start_micros: int = 0
    #: ``decode_meta`` of the tensor span, once someone has parsed it (it is parsed once)
    decoded: tuple[TensorMeta, int, int] | None = None


def parse_response(buf: bytes, start: int = 0, end: int | None = None) -> ReplyHead:
    head = ReplyHead()
    for num, wt, a, b in wire.iter_fields(buf, start, end):
        if num == F.RESPONSE_TENSOR and wt == wire.LEN:
            head.tensor = (a, b)
        elif num == F.RESPONSE_IS_DEAD and wt == wire.VARINT:
            head.is_dead = bool(a)
        elif num == F.RESPONSE_SEND_START_MICROS and wt == wire.VARINT:
            head.send_start_micros = wire.to_signed64(a)
        elif num == F.RESPONSE_TRANSPORT_OPTIONS and wt == wire.LEN:
            head.transport_options = (a, b)
    return head


@dataclass(slots=True)
class StreamFrame:
    call_id: int
    head: ReplyHead | None = None
    chunk: tuple[int, int] | None = None
    error: RendezvousError | None = None
    group: tuple[int, int] | None = None  # span of a ReplyGroup (call_id unset: -1)


def iter_stream_frames(buf: bytes) -> Iterator[StreamFrame]:
    """The frames in one StreamResponse message: itself, or the entries of its
    ``batch`` (field 5) in order. Offsets point into ``buf``; nothing is copied."""
    spans = [(a, b) for num, wt, a, b in wire.iter_fields(buf) if num == F.STREAM_RESPONSE_BATCH and wt == wire.LEN]
    if not spans:
        yield parse_stream_frame(buf)
        return
    for a, b in spans:
        yield parse_stream_frame(buf, a, b)


def parse_stream_frame(buf: bytes, start: int = 0, end: int | None = None) -> StreamFrame:
    """Split one StreamResponse into its parts (offsets into ``buf``, no copies)."""
    frame = StreamFrame(call_id=-1)
    for num, wt, a, b in wire.iter_fields(buf, start, end):
        if num == F.STREAM_RESPONSE_CALL_ID and wt == wire.VARINT:
            frame.call_id = a
        elif num == F.STREAM_RESPONSE_RESPONSE and wt == wire.LEN:
            frame.head = parse_response(buf, a, b)
        elif num == F.STREAM_RESPONSE_CHUNK and wt == wire.LEN:
            frame.chunk = (a, b)
        elif num == F.STREAM_RESPONSE_ERROR and wt == wire.LEN:
            try:
                status = pb.Status.FromString(bytes(buf[a:b]))
            except DecodeError:
                raise InvalidArgument("stream frame with a malformed status") from None
            if status.code == 0:
                raise InvalidArgument("stream frame carries an error whose status is OK")
            frame.error = from_status(status.code, status.message)
        elif num == F.STREAM_RESPONSE_GROUP and wt == wire.LEN:
            frame.group = (a, b)
    if frame.call_id < 0 and frame.group is None:
        raise InvalidArgument("stream frame without call_id")
    return frame


def decode_inline(buf: bytes, span: tuple[int, int], decoded: tuple[TensorMeta, int, int] | None = None,
                  buffers: RecvBuffers | None = None, max_bytes: int | None = None) -> np.ndarray | Assembly:
    """A whole tensor (a view on ``buf``, or a copy of it where the bytes are
    not aligned to the dtype) or, if only its first part is here, an Assembly
    (its destination from ``buffers`` when given).

    ``decoded`` is ``decode_meta(buf, *span)`` when the caller has it already
    (and has checked its size); otherwise a tensor announcing more than
    ``max_bytes`` is ResourceExhausted before anything is allocated."""
    start, end = span
    if decoded is None:
        decoded = decode_meta(buf, start, end)
        check_announced(decoded[0], max_bytes)
    meta, cs, ce = decoded
    memcpyable = is_memcpyable_meta(meta)
    if memcpyable and ce > cs and ce - cs == meta.nbytes:
        # the whole content is here: a view on the message, nothing parsed twice
        count = (ce - cs) // meta.dtype.itemsize
        value = np.frombuffer(buf, dtype=meta.dtype, count=count, offset=cs)
        if not value.flags.aligned:  # the bytes lie where the dtype cannot be read in place
            value = value.copy()
        return value.reshape(meta.shape)
    if not memcpyable or ce - cs == meta.nbytes:
        return decode_tensor(buf, start, end)
    if ce == cs and meta.nbytes:
        # No content yet but bytes are due: the typed-field (TensorFlow) encodings
        # carry no chunks, so only decode_tensor can say what this is.
        return decode_tensor(buf, start, end)
    return Assembly(meta, memoryview(buf)[cs:ce], buffers)


def is_memcpyable_meta(meta: TensorMeta) -> bool:
    return meta.dtype != np.dtype(object)
