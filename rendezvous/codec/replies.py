"""Hand-encoded RecvTensor replies: the bytes of a tensor are never re-serialized.

A reply is built as a short header (protobuf fields written by hand) followed by
the tensor's own bytes; joining the two into the message gRPC sends is the one
payload copy on the producer side. The result is an ordinary protobuf
``RecvTensorResponse`` or ``StreamResponse`` (see protos/rendezvous/v1), so any
client generated from the protos reads it. The consumer's side of these bytes
is :mod:`.parsing` and :mod:`.assembly`.

Copies of the payload, default (gRPC inline) path:
  producer: 1 (join into the message bytes) + gRPC's own send copies
  consumer: 0 for one frame, 1 for a chunked reply (into the destination)
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np

from ..items import Received
from ..v1 import rendezvous_pb2 as pb
from . import fields as F
from . import wire
from .dtypes import is_memcpyable
from .tensors import TensorMeta, encode_meta

__all__ = ["MAX_MESSAGE_BYTES", "payload_view", "unary_response", "descriptor_response", "stream_frames",
           "with_call_id", "batch_responses", "error_frame"]

# gRPC's message size fields are signed 32-bit; stay clear of the edge.
MAX_MESSAGE_BYTES = (1 << 31) - (1 << 20)


def payload_view(arr: np.ndarray) -> memoryview:
    """The array's bytes as a flat memoryview; a copy only if not C-contiguous."""
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data


def _response_fields(is_dead: bool, send_start_micros: int, transport_options: bytes | None) -> bytes:
    head = wire.varint_field(F.RESPONSE_IS_DEAD, int(is_dead)) + \
        wire.varint_field(F.RESPONSE_SEND_START_MICROS, send_start_micros)
    if transport_options:
        head += wire.len_field_header(F.RESPONSE_TRANSPORT_OPTIONS, len(transport_options)) + transport_options
    return head


def _tensor_parts(value: np.ndarray) -> tuple[list, int]:
    """(parts, length) of a complete TensorProto for ``value``."""
    if not is_memcpyable(value):
        from .tensors import encode_tensor  # strings: small, serialized by protobuf

        data = encode_tensor(value)
        return [data], len(data)
    meta = encode_meta(TensorMeta(value.dtype, tuple(value.shape)))
    payload = payload_view(value)
    if len(payload) == 0:
        return [meta], len(meta)
    content = wire.len_field_header(F.TENSOR_CONTENT, len(payload))
    return [meta, content, payload], len(meta) + len(content) + len(payload)


def unary_response(item: Received, send_start_micros: int = 0) -> bytes:
    """A whole ``RecvTensorResponse`` (the TensorFlow-compatible unary reply)."""
    parts = [_response_fields(item.is_dead, send_start_micros, None)]
    if not item.is_dead:
        tparts, tlen = _tensor_parts(item.value)
        if tlen > MAX_MESSAGE_BYTES:
            from ..errors import ResourceExhausted

            raise ResourceExhausted(
                f"tensor of {tlen} bytes does not fit one gRPC message; use RecvTensorStream, which chunks it")
        parts.append(wire.len_field_header(F.RESPONSE_TENSOR, tlen))
        parts.extend(tparts)
    return b"".join(parts)


def descriptor_response(meta: TensorMeta, transport_options: bytes, send_start_micros: int = 0) -> bytes:
    """A ``RecvTensorResponse`` carrying dtype and shape only, plus where the bytes come from."""
    tensor = encode_meta(meta)
    return b"".join([
        _response_fields(False, send_start_micros, transport_options),
        wire.len_field_header(F.RESPONSE_TENSOR, len(tensor)), tensor,
    ])


def stream_frames(call_id: int, item: Received, chunk_bytes: int,
                  send_start_micros: int = 0) -> Iterator[bytes | wire.Pieces]:
    """The StreamResponse frames answering ``call_id`` with ``item``, produced lazily.

    The first frame holds dtype, shape and up to ``chunk_bytes`` of content; the
    rest carry ``chunk`` fields. Each frame costs one copy of its slice, made
    by whoever joins it: a frame with ``wire.GATHER_BYTES`` of content or more
    is :class:`wire.Pieces` (``join()`` gives its bytes).
    """
    cid = _call_id_field(call_id)
    head = _response_fields(item.is_dead, send_start_micros, None)
    value = item.value
    if item.is_dead:
        yield b"".join([cid, wire.len_field_header(F.STREAM_RESPONSE_RESPONSE, len(head)), head])
        return
    if not is_memcpyable(value):
        tparts, tlen = _tensor_parts(value)
        if tlen > MAX_MESSAGE_BYTES:
            from ..errors import ResourceExhausted

            raise ResourceExhausted(f"string tensor of {tlen} bytes exceeds one gRPC message")
        tensor_hdr = wire.len_field_header(F.RESPONSE_TENSOR, tlen)
        resp_len = len(head) + len(tensor_hdr) + tlen
        yield b"".join([cid, wire.len_field_header(F.STREAM_RESPONSE_RESPONSE, resp_len), head, tensor_hdr, *tparts])
        return
    meta = _meta_bytes(value.dtype, value.shape)
    payload = payload_view(value)
    total = len(payload)
    first = min(total, chunk_bytes)
    content = wire.len_field_header(F.TENSOR_CONTENT, first) if first else b""
    tlen = len(meta) + len(content) + first
    tensor_hdr = wire.len_field_header(F.RESPONSE_TENSOR, tlen)
    resp_len = len(head) + len(tensor_hdr) + tlen
    resp_hdr = wire.len_field_header(F.STREAM_RESPONSE_RESPONSE, resp_len)
    # the content starts at an aligned offset of the frame: a frame that
    # arrives at an aligned address is read in place, as arrays of its dtype
    pad = wire.align_pad(len(cid) + len(resp_hdr) + len(head) + len(tensor_hdr) + len(meta) + len(content)) \
        if first else b""
    yield wire.frame([cid, pad, resp_hdr, head, tensor_hdr, meta, content, payload[:first]], first)
    pos = first
    while pos < total:
        end = min(total, pos + chunk_bytes)
        yield wire.frame([cid, wire.len_field_header(F.STREAM_RESPONSE_CHUNK, end - pos), payload[pos:end]], end - pos)
        pos = end


def _call_id_field(call_id: int) -> bytes:
    # call_id 0 is written explicitly: a frame must always name its call
    return wire.varint_field(F.STREAM_RESPONSE_CALL_ID, call_id) or \
        wire.tag(F.STREAM_RESPONSE_CALL_ID, wire.VARINT) + b"\x00"


def with_call_id(call_id: int, response: bytes) -> bytes:
    """A StreamResponse frame answering ``call_id`` with a whole RecvTensorResponse."""
    return b"".join([_call_id_field(call_id),
                     wire.len_field_header(F.STREAM_RESPONSE_RESPONSE, len(response)), response])


@functools.lru_cache(maxsize=4096)
def _meta_bytes(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """dtype and shape as TensorProto fields; a job sends the same few shapes
    over and over, so each is encoded once."""
    return encode_meta(TensorMeta(dtype, shape))


def batch_responses(messages: list[bytes]) -> bytes:
    """Several StreamResponse frames packed as one (the ``batch`` entries of an
    outer one), each entry at an aligned offset: a frame's tensor bytes, aligned
    within it, stay aligned in the message."""
    return wire.pack(messages, F.STREAM_RESPONSE_BATCH, aligned=True)


def error_frame(call_id: int, error: BaseException) -> bytes:
    from ..errors import to_status

    code, message = to_status(error)
    status = pb.Status(code=code.value[0], message=message).SerializeToString()
    return b"".join([_call_id_field(call_id), wire.len_field_header(F.STREAM_RESPONSE_ERROR, len(status)), status])
