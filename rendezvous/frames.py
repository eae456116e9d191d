"""Hand-encoded RecvTensor replies: the bytes of a tensor are never re-serialized.

A reply is built as a short header (protobuf fields written by hand) followed by
the tensor's own bytes; joining the two into the message gRPC sends is the one
payload copy on the producer side. The result is an ordinary protobuf
``RecvTensorResponse`` or ``StreamResponse`` (see protos/rendezvous/v1), so any
client generated from the protos reads it.

On the consumer side a single-frame reply decodes to a numpy view on the
received message (no copy); a chunked reply is copied once, chunk by chunk, into
a buffer allocated when the first frame announces dtype and shape.

Copies of the payload, default (gRPC inline) path:
  producer: 1 (join into the message bytes) + gRPC's own send copies
  consumer: 0 for one frame, 1 for a chunked reply (into the destination)
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from . import fields as F
from . import wire
from .buffers import RecvBuffers
from .errors import InvalidArgument, RendezvousError, from_status
from .items import Received
from .dtypes import is_memcpyable
from .tensors import TensorMeta, check_announced, decode_meta, decode_tensor, encode_meta
from .v1 import rendezvous_pb2 as pb

__all__ = [
    "payload_view",
    "unary_response",
    "stream_frames",
    "error_frame",
    "descriptor_response",
    "ReplyHead",
    "StreamFrame",
    "parse_stream_frame",
    "iter_stream_frames",
    "recv_request",
    "recv_many_request",
    "many_keys_field",
    "cancel_request",
    "batch_requests",
    "batch_responses",
    "parse_response",
    "Assembly",
    "MAX_MESSAGE_BYTES",
    "prime_allocator",
    "with_call_id",
]

# gRPC's message size fields are signed 32-bit; stay clear of the edge.
MAX_MESSAGE_BYTES = (1 << 31) - (1 << 20)

# glibc's malloc maps a block above its mmap threshold (128 KiB at start)
# and, when such a block is freed, raises the threshold to its size and the
# heap trim threshold to twice that. Every frame of a chunked reply is two
# chunk-sized blocks at once (our joined message and gRPC's copy of it), so
# after the first frame the trim threshold is exactly what two frames free:
# each frame then shrinks the heap and grows it again, and its pages are
# faulted in and zeroed anew (on a 2-core VM that tripled the time of a
# 1 MiB recv). One block a few chunks large, allocated and freed untouched
# when the first stream opens, sets the thresholds above that. Its only
# lasting effect is that up to twice its size of freed heap is kept for reuse.
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc adapts the threshold only up to this
_primed = 0


def prime_allocator(chunk_bytes: int) -> None:
    """Make the allocator keep chunk-sized frame buffers for reuse (see above).
    Cheap: the block is never touched. Idempotent per size. The thresholds are
    the process's (glibc has one heap policy), so this is a process-wide
    setting by nature: a rank server applies it once when it starts."""
    global _primed
    size = min(8 * chunk_bytes, _MMAP_THRESHOLD_MAX - (64 << 10))
    if size <= _primed:
        return
    _primed = size
    np.empty(size, np.uint8)  # mapped, then unmapped at once: only the thresholds change


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
            from .errors import ResourceExhausted

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
            from .errors import ResourceExhausted

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


def recv_request(call_id: int, step_id: int, key: bytes, request_id: int,
                 transport_options: bytes | None = None) -> bytes:
    """A StreamRequest carrying one RecvTensorRequest, written by hand (it is
    on every recv's path; building protobuf objects costs more than this)."""
    req = b"".join([
        wire.varint_field(F.REQUEST_STEP_ID, step_id),
        wire.len_field_header(F.REQUEST_KEY, len(key)), key,
        wire.len_field_header(F.REQUEST_TRANSPORT_OPTIONS, len(transport_options)) if transport_options else b"",
        transport_options or b"",
        wire.varint_field(F.REQUEST_ID, request_id),
    ])
    return b"".join([wire.varint_field(F.STREAM_REQUEST_CALL_ID, call_id),
                     wire.len_field_header(F.STREAM_REQUEST_RECV, len(req)), req])


def many_keys_field(keys: list[bytes]) -> bytes:
    """A ``RecvMany``'s ``rendezvous_keys``, encoded: what :func:`recv_many_request`
    takes instead of the keys, for a consumer that asks the same keys every step."""
    parts: list[bytes] = []
    key_tag = wire.tag(F.MANY_KEYS, wire.LEN)
    encode = wire.encode_varint
    for key in keys:
        parts += (key_tag, encode(len(key)), key)
    return b"".join(parts)


def recv_many_request(call_id: int, step_id: int, keys: list[bytes] | bytes, request_ids: list[int],
                      transport_options: bytes | None = None) -> bytes:
    """A StreamRequest asking for ``keys`` at once (a ``RecvMany``): the calls
    ``call_id`` .. ``call_id + len(keys) - 1``, one per key, in order.
    ``keys`` may come encoded already (:func:`many_keys_field`)."""
    parts = [wire.varint_field(F.MANY_STEP_ID, step_id),
             keys if type(keys) is bytes else many_keys_field(keys)]  # type: ignore[arg-type]
    ids = np.array(request_ids, "<u8").tobytes()
    parts += (wire.len_field_header(F.MANY_REQUEST_IDS, len(ids)), ids)
    if transport_options:
        parts += (wire.len_field_header(F.MANY_TRANSPORT_OPTIONS, len(transport_options)), transport_options)
    body = b"".join(parts)
    return b"".join([wire.varint_field(F.STREAM_REQUEST_CALL_ID, call_id) or
                     wire.tag(F.STREAM_REQUEST_CALL_ID, wire.VARINT) + b"\x00",
                     wire.len_field_header(F.STREAM_REQUEST_RECV_MANY, len(body)), body])


def cancel_request(call_id: int) -> bytes:
    """A StreamRequest cancelling ``call_id`` (an empty Cancel message)."""
    return wire.varint_field(F.STREAM_REQUEST_CALL_ID, call_id) + wire.len_field_header(F.STREAM_REQUEST_CANCEL, 0)


def _batch(messages: list, field_number: int, aligned: bool = False) -> bytes:
    parts: list = []
    pos = 0
    for m in messages:
        header = wire.len_field_header(field_number, len(m))
        if aligned:  # each entry starts at an aligned offset (a padding field before it)
            pad = wire.align_pad(pos + len(header))
            if pad:
                parts.append(pad)
            pos += len(pad) + len(header) + len(m)
        parts.append(header)
        if type(m) is wire.Pieces:
            parts += m.parts
        else:
            parts.append(m)
    return b"".join(parts)


def batch_requests(messages: list[bytes]) -> bytes:
    """Several StreamRequests packed as one (the ``batch`` entries of an outer one)."""
    return _batch(messages, F.STREAM_REQUEST_BATCH)


def batch_responses(messages: list[bytes]) -> bytes:
    """Several StreamResponse frames packed as one (the ``batch`` entries of an
    outer one), each entry at an aligned offset: a frame's tensor bytes, aligned
    within it, stay aligned in the message."""
    return _batch(messages, F.STREAM_RESPONSE_BATCH, aligned=True)


def error_frame(call_id: int, error: BaseException) -> bytes:
    from .errors import to_status

    code, message = to_status(error)
    status = pb.Status(code=code.value[0], message=message).SerializeToString()
    return b"".join([_call_id_field(call_id), wire.len_field_header(F.STREAM_RESPONSE_ERROR, len(status)), status])


# --- consumer side -----------------------------------------------------------

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


class Assembly:
    """Reassembles one reply's tensor from a first frame and its chunks."""

    __slots__ = ("meta", "dest", "filled")

    def __init__(self, meta: TensorMeta, first: memoryview, buffers: RecvBuffers | None = None) -> None:
        self.meta = meta
        # from the receive cache: a large one is reused once dropped
        try:
            self.dest = buffers.empty(meta.nbytes, np.uint8) if buffers is not None \
                else np.empty(meta.nbytes, np.uint8)
        except MemoryError:
            from .errors import ResourceExhausted

            raise ResourceExhausted(f"cannot allocate the {meta.nbytes} bytes a reply announces") from None
        self.filled = 0
        self.add(first)

    def add(self, part: memoryview) -> bool:
        """Copy the next part in (the consumer's one copy); True when complete."""
        n = len(part)
        if self.filled + n > self.meta.nbytes:
            raise InvalidArgument(
                f"reply carries more than the {self.meta.nbytes} bytes its dtype and shape announce")
        self.dest[self.filled:self.filled + n] = np.frombuffer(part, dtype=np.uint8)
        self.filled += n
        return self.filled == self.meta.nbytes

    def result(self) -> np.ndarray:
        return self.dest.view(self.meta.dtype).reshape(self.meta.shape)


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
