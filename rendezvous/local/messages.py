"""The local protocol's messages, both directions, encoded and parsed by hand.

A daemon and its local clients exchange the messages of ``local.proto``
(``SendRequest``, ``LocalRecvRequest``, ``LocalRecvResponse``, ...), on the
session socket's frames (:mod:`rendezvous.local.frames`) or as the gRPC
``LocalRendezvous`` service's raw bytes. Every message that carries a
tensor is written and read here by hand, so a tensor's bytes are never
copied through protobuf: a send's or a reply's tensor is a header and the
array's own bytes, and the reader takes a view on them. A tensor in the
daemon's shared memory travels as a ``PoolSlot`` (segment id and size)
beside its dtype and shape.

The client side builds sends and recvs and parses replies; the daemon side
parses sends and recvs and builds replies. Both use this one module.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import grpc
import numpy as np
from google.protobuf.message import DecodeError, Message

from rendezvous.codec import fields as F, groups, wire
from rendezvous.codec.replies import unary_response
from rendezvous.errors import InvalidArgument, RendezvousError, from_status
from rendezvous.keys import Key, canonical_key
from rendezvous.paths import Hop, Path
from rendezvous.items import Received
from rendezvous.codec.dtypes import as_array, is_memcpyable
from rendezvous.codec.tensors import TensorMeta, decode_meta, decode_tensor, encode_header, encode_meta
from rendezvous.v1 import local_pb2 as lpb

from .frames import unpack_error

__all__ = ["SERVICE", "METHOD", "LocalPending", "PendingList", "to_pending",
           "send_head", "inline_send", "pooled_send", "returned", "send_many_request", "parse_send_many", "SendFields", "parse_send", "parse_slot",
           "recv_request", "parse_recv", "recv_many_request", "parse_recv_many", "many_reply", "many_answer",
           "ManyReply", "parse_many", "returned_many", "packed_view", "PATHS", "inline_reply", "pooled_reply",
           "ReplyFields", "reply_fields", "LocalReply", "parse_reply", "error_from", "frame_error", "many_failed"]

#: the gRPC service of the local protocol, and its methods' path prefix
SERVICE = "rendezvous.v1.LocalRendezvous"
METHOD = f"/{SERVICE}/"
#: a batch's answer for one key: the span of its own reply, or a packed tensor's (dtype, shape, offset, path)
Span = tuple[int, int]
Packed = tuple[np.dtype, tuple[int, ...], int, Path]
_M = TypeVar("_M", bound=Message)


# -- PENDING --------------------------------------------------------------------------


class LocalPending(NamedTuple("LocalPending", [("step_id", int), ("key", str), ("kind", str), ("count", int),
                                                ("oldest_age_s", float), ("producer", str)])):
    """One entry of a client's ``pending()``: ``kind`` "tensor" (produced, not consumed), "waiter"
    (a consumer waits here) or "remote" (a local recv waits); ``producer``, the key's producing
    task. (The functional form: a field named ``count`` in a class body would hide ``tuple.count``.)"""

    __slots__ = ()


class PendingList(list[LocalPending]):
    """A client's ``pending()``: the entries (the oldest first), and in
    ``omitted`` how many the daemon left out to keep its answer one bounded message."""

    omitted: int = 0


def to_pending(raw: bytes | memoryview) -> PendingList:
    reply = lpb.PendingResponse.FromString(bytes(raw))
    out = PendingList(LocalPending(e.step_id, e.rendezvous_key, e.kind, e.count, e.oldest_age_seconds, e.producer)
                      for e in reply.entries)
    out.omitted = reply.omitted
    return out


# -- SEND (and RETURN) ------------------------------------------------------------------


def send_head(key: Key | str, step_id: int) -> bytes:
    """A SendRequest's step and key, the part every send begins with."""
    k = canonical_key(key).encode()
    return wire.varint_field(F.SEND_STEP_ID, step_id) + wire.len_field_header(F.SEND_KEY, len(k)) + k


def inline_send(head: bytes, tensor: Any, is_dead: bool) -> tuple[bytes, int]:
    """The SendRequest bytes with the tensor inside; (body, payload bytes)."""
    if is_dead:
        return head + wire.varint_field(F.SEND_IS_DEAD, 1), 0
    arr = as_array(tensor)
    header, payload = encode_header(arr)
    size = len(header) + (len(payload) if payload is not None else 0)
    parts: list[bytes | memoryview] = [head, wire.len_field_header(F.SEND_TENSOR, size), header]
    if payload is not None:
        parts.append(payload)
    return b"".join(parts), arr.nbytes if is_memcpyable(arr) else 0


def pooled_send(head: bytes, arr: np.ndarray, seg_id: int) -> bytes:
    """The SendRequest bytes naming pool segment ``seg_id``, which holds ``arr``'s bytes."""
    meta = encode_meta(TensorMeta(arr.dtype, arr.shape))
    slot = wire.varint_field(F.SLOT_SEGMENT, seg_id) + wire.varint_field(F.SLOT_NBYTES, arr.nbytes)
    return b"".join([head, wire.len_field_header(F.SEND_TENSOR, len(meta)), meta,
                     wire.len_field_header(F.SEND_POOLED, len(slot)), slot])


def returned(key: str, step_id: int, reply: bytes | memoryview) -> bytes:
    """A RETURN frame's body for a recv's reply that came after its caller gave up:
    the same tensor (inline, or the same pool segment), as a SendRequest the
    daemon keeps for the next recv of ``key`` in ``step_id``."""
    parts = [send_head(key, step_id)]
    got = reply_fields(reply)
    if got.is_dead:
        parts.append(wire.varint_field(F.SEND_IS_DEAD, 1))
    if got.tensor is not None:
        a, b = got.tensor
        parts += [wire.len_field_header(F.SEND_TENSOR, b - a), bytes(reply[a:b])]
    if got.slot is not None:  # field 7 in both messages: the slot passes as it is
        a, b = got.slot
        parts += [wire.len_field_header(F.SEND_POOLED, b - a), bytes(reply[a:b])]
    return b"".join(parts)


def send_many_request(keys: list[str], arrays: list[np.ndarray], step_id: int) -> bytes:
    """A SEND_MANY's body: ``arrays`` (host arrays of fixed-size dtypes, little-
    endian) under ``keys`` (canonical), packed in one group."""
    head = [wire.varint_field(F.SEND_MANY_STEP_ID, step_id)]
    for key in keys:
        k = key.encode()
        head += [wire.len_field_header(F.SEND_MANY_KEYS, len(k)), k]
    # the group starts at an aligned offset of the body, and so does its payload
    head.append(wire.align_pad(sum(map(len, head))))
    return b"".join([*head, *groups.group_parts(range(len(arrays)), arrays, groups.layout(arrays),
                                               field=F.SEND_MANY_GROUP)])


def parse_send_many(raw: bytes | memoryview) -> tuple[int, list[str], list[np.ndarray]]:
    """A SEND_MANY's step, keys and tensors (views on ``raw``); InvalidArgument if
    it cannot be walked, a key is not UTF-8, or its group lies or does not
    answer its keys in order."""
    step_id, keys, span = 0, [], None
    for num, wt, a, b in wire.iter_fields(raw):
        if num == F.SEND_MANY_STEP_ID and wt == wire.VARINT:
            step_id = wire.to_signed64(a)
        elif num == F.SEND_MANY_KEYS and wt == wire.LEN:
            keys.append(_text(raw, a, b, "rendezvous_key"))
        elif num == F.SEND_MANY_GROUP and wt == wire.LEN:
            span = (a, b)
    if span is None:
        if keys:
            raise InvalidArgument(f"a SEND_MANY names {len(keys)} keys and carries no tensors")
        return step_id, keys, []
    group = groups.parse_group(raw, *span)
    if group.call_ids != list(range(len(keys))) or group.payload is None:
        raise InvalidArgument(f"a SEND_MANY of {len(keys)} keys carries {len(group.call_ids)} tensors "
                              "(they must be its keys', in order, inside it)")
    try:
        return step_id, keys, groups.views(group, raw, group.payload[0])
    except (ValueError, TypeError, OverflowError) as exc:  # a shape no array can have
        raise InvalidArgument(f"a SEND_MANY carries a tensor that cannot be made: {exc}") from None


class SendFields(NamedTuple):
    """What a SendRequest says; ``tensor`` and ``slot`` are byte spans of it."""

    step_id: int
    key: str
    tensor: tuple[int, int] | None
    is_dead: bool
    slot: tuple[int, int] | None  # (segment id, nbytes) of a pooled send


def parse_send(raw: bytes | memoryview) -> SendFields:
    """A SendRequest's fields, without copying its tensor (InvalidArgument if it cannot
    be walked, names a retired kind of segment or an IPC export, or its key is not UTF-8)."""
    step_id, key, tensor, is_dead, slot = 0, "", None, False, None
    for num, wt, a, b in wire.iter_fields(raw):
        if num == F.SEND_STEP_ID and wt == wire.VARINT:
            step_id = wire.to_signed64(a)
        elif num == F.SEND_KEY and wt == wire.LEN:
            key = _text(raw, a, b, "rendezvous_key")
        elif num == F.SEND_TENSOR and wt == wire.LEN:
            tensor = (a, b)
        elif num == F.SEND_IS_DEAD and wt == wire.VARINT:
            is_dead = bool(a)
        elif num == F.SEND_POOLED and wt == wire.LEN:
            slot = parse_slot(raw, a, b)
        elif num == F.SEND_NAMED_SHM or num == F.SEND_IPC:  # (an IPC send comes in a SEND_IPC frame only)
            raise InvalidArgument("a SendRequest's tensor is inline or pooled here: named shared-memory segments"
                                  " are no longer accepted, and an IPC send is a SEND_IPC frame of a session")
    return SendFields(step_id, key, tensor, is_dead, slot)


def parse_slot(buf: bytes | memoryview, a: int, b: int) -> tuple[int, int]:
    """The (segment id, nbytes) of the PoolSlot at ``buf[a:b]``."""
    segment, nbytes = 0, 0
    for num, wt, x, y in wire.iter_fields(buf, a, b):
        if num == F.SLOT_SEGMENT and wt == wire.VARINT:
            segment = x
        elif num == F.SLOT_NBYTES and wt == wire.VARINT:
            nbytes = wire.to_signed64(x)
    if segment <= 0 or nbytes <= 0:
        raise InvalidArgument(f"a pooled send names segment {segment} with {nbytes} bytes")
    return segment, nbytes


def _text(buf: bytes | memoryview, a: int, b: int, what: str) -> str:
    try:
        return bytes(buf[a:b]).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument(f"{what} is not UTF-8") from None


# -- RECV --------------------------------------------------------------------------------


def recv_request(key: Key | str, step_id: int, timeout: float | None, ipc_device: bytes = b"") -> bytes:
    return lpb.LocalRecvRequest(step_id=step_id, rendezvous_key=canonical_key(key), timeout=timeout or 0.0,
                                ipc_device=ipc_device).SerializeToString()


def _parse(message: type[_M], raw: bytes | memoryview) -> _M:
    """``raw`` as the protobuf ``message`` type, or InvalidArgument naming it."""
    try:
        return message.FromString(bytes(raw))
    except DecodeError as exc:
        raise InvalidArgument(f"malformed {message.__name__}: {exc}") from None


def parse_recv(raw: bytes | memoryview) -> lpb.LocalRecvRequest:
    return _parse(lpb.LocalRecvRequest, raw)


def recv_many_request(keys: list[str], step_id: int, timeout: float | None) -> bytes:
    """A RECV_MANY's body: ``keys`` (canonical already) of ``step_id`` under one deadline."""
    return lpb.LocalRecvManyRequest(step_id=step_id, rendezvous_keys=keys,
                                    timeout=timeout or 0.0).SerializeToString()


def parse_recv_many(raw: bytes | memoryview) -> lpb.LocalRecvManyRequest:
    return _parse(lpb.LocalRecvManyRequest, raw)


#: a path's code in ``LocalRecvManyResponse.group_paths``
PATHS = tuple(Path)
_PATH_CODE = {p: i for i, p in enumerate(PATHS)}


def many_reply(replies: list[bytes], packed: list[int] | None = None, arrays: list[np.ndarray] | None = None,
               paths: list[Path] | None = None) -> list[bytes | memoryview]:
    """A LocalRecvManyResponse, as pieces to gather (the packed arrays' memory
    among them): ``replies`` (LocalRecvResponse bodies) answer the keys not
    ``packed``, in key order; the host ``arrays`` brought by ``paths`` answer
    the keys at positions ``packed``, in one group."""
    parts: list[bytes | memoryview] = []
    for body in replies:
        parts += [wire.len_field_header(F.LOCAL_MANY_REPLIES, len(body)), body]
    if packed:
        assert arrays is not None and paths is not None
        # the group starts at an aligned offset of the answer, and so does its payload
        pad = wire.align_pad(sum(map(len, parts)))
        if pad:
            parts.append(pad)
        parts += groups.group_parts(packed, arrays, groups.layout(arrays), field=F.LOCAL_MANY_GROUP)
        codes = bytes(_PATH_CODE[p] for p in paths)
        parts += [wire.len_field_header(F.LOCAL_MANY_GROUP_PATHS, len(codes)), codes]
    return parts


def many_answer(got: Sequence[tuple[Received, Path]], limit: int,
                prepared: dict[int, bytes] | None = None) -> list[bytes | memoryview]:
    """A batch's LocalRecvManyResponse (as :func:`many_reply`'s pieces):
    ``prepared`` replies (by position) as they are; every other host array of
    a fixed-size dtype (at most ``limit`` bytes) packed in the group; the rest
    (dead, strings) as inline replies."""
    prepared = prepared or {}
    replies: list[bytes] = []
    packed: list[int] = []
    arrays: list[np.ndarray] = []
    paths: list[Path] = []
    for i, (item, path) in enumerate(got):
        body = prepared.get(i)
        if body is None and not item.is_dead and groups.fusable(item.value, limit):
            packed.append(i)
            arrays.append(item.value)
            paths.append(path)
        else:
            replies.append(body if body is not None else inline_reply(item, path))
    return many_reply(replies, packed, arrays, paths)


def many_failed(failures: list[tuple[int, int, str]]) -> bytes:
    """A LocalRecvManyResponse saying which keys (index, status code, message) failed."""
    return lpb.LocalRecvManyResponse(failures=[lpb.LocalRecvFailure(index=i, code=c, message=m)
                                               for i, c, m in failures]).SerializeToString()


class ManyReply(NamedTuple):
    """A parsed LocalRecvManyResponse: per key, the byte span of its reply or,
    for a packed one, its (dtype, shape, offset) in the answer and its path;
    or the failures. ``payload``: the span of the packed tensors' bytes."""

    answers: list[Span | Packed]
    failures: dict[int, RendezvousError]
    payload: tuple[int, int] | None = None


def parse_many(raw: bytes | memoryview, n: int) -> ManyReply:
    """The answers (spans and packed tensors of ``raw``) or failures of a batch
    of ``n`` keys. A reply that answers another number of keys, a key twice,
    or names a failure outside the batch is InvalidArgument (a group that
    lies, as :func:`rendezvous.codec.groups.parse_group` says)."""
    spans: list[tuple[int, int]] = []
    failures: dict[int, RendezvousError] = {}
    group = codes = None
    for num, wt, a, b in wire.iter_fields(raw):
        if num == F.LOCAL_MANY_REPLIES and wt == wire.LEN:
            spans.append((a, b))
        elif num == F.LOCAL_MANY_GROUP and wt == wire.LEN:
            group = groups.parse_group(raw, a, b)
        elif num == F.LOCAL_MANY_GROUP_PATHS and wt == wire.LEN:
            codes = bytes(raw[a:b])
        elif num == F.LOCAL_MANY_FAILURES and wt == wire.LEN:
            one = _parse(lpb.LocalRecvFailure, raw[a:b])
            if one.index >= n:
                raise InvalidArgument(f"a batch of {n} keys failed at key {one.index}")
            failures[one.index] = from_status(one.code, one.message)
    if failures:
        return ManyReply([], failures)
    answers: list[Span | Packed | None] = [None] * n
    if group is not None:
        if group.payload is None or codes is None or len(codes) != len(group.call_ids):
            raise InvalidArgument("the daemon's packed answers come without their payload or paths")
        if max(group.call_ids) >= n or max(codes) >= len(PATHS):
            raise InvalidArgument(f"the daemon's packed answers name a key or path outside a batch of {n}")
        base = group.payload[0]
        for i, dt, shape, off, code in zip(group.call_ids, group.dtypes, group.shapes, group.offsets, codes):
            answers[i] = (dt, shape, base + off, PATHS[code])
    if len(spans) + (len(group.call_ids) if group is not None else 0) != n:
        raise InvalidArgument(f"the daemon answered {len(spans)} of a batch of {n} keys")
    it = iter(spans)
    filled = [answer if answer is not None else next(it) for answer in answers]
    return ManyReply(filled, {}, group.payload if group is not None else None)


def returned_many(keys: tuple[str, ...], step_id: int, reply: bytes | memoryview) -> list[bytes]:
    """RETURN frames' bodies for a batch's answer that came after its caller gave
    up, each key's tensor as :func:`returned` makes it; last key first, so that
    the daemon, which keeps each in front, keeps them in their order (FIFO per
    key). None if the batch failed (nothing was taken)."""
    try:
        got = parse_many(reply, len(keys))
        out = []
        for key, answer in reversed(list(zip(keys, got.answers))):
            if len(answer) == 2:
                out.append(returned(key, step_id, reply[answer[0]:answer[1]]))
            else:
                value = packed_view(reply, answer)
                out.append(returned(key, step_id, inline_reply(Received(value, False), answer[3])))
    except InvalidArgument:
        return []  # not an answer to this batch: nothing of it can be given back
    return out


def packed_view(raw: bytes | memoryview | np.ndarray, answer: Packed, shift: int = 0) -> np.ndarray:
    """A packed answer's tensor: a view on ``raw`` (where the answer's byte
    ``shift`` is; see :func:`packed_base`). A shape no array can have is
    InvalidArgument."""
    dt, shape, offset, _ = answer
    try:
        return np.frombuffer(raw, dt, math.prod(shape), offset - shift).reshape(shape)
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidArgument(f"the daemon's packed answer cannot be made into {dt} {shape}: {exc}") from None


def packed_base(raw: bytes | memoryview, got: ManyReply) -> tuple[bytes | memoryview | np.ndarray, int]:
    """Where the views of ``got``'s packed tensors are made so that each is
    aligned to its dtype (packed tensors lie at multiples of 8 within the
    payload): ``(raw, 0)`` when the payload lies at an aligned address (the
    daemon aligns it within the answer, so a body that starts aligned needs
    nothing), else a copy of the payload, with the offset it starts at."""
    if got.payload is None:
        return raw, 0
    a, b = got.payload
    payload = np.frombuffer(raw, np.uint8, b - a, a)
    if b == a or payload.__array_interface__["data"][0] % wire.ALIGN == 0:
        return raw, 0
    return payload.copy(), a


def _path_field(path: Path) -> bytes:
    return wire.len_field_header(F.LOCAL_REPLY_PATH, len(path.value)) + path.value.encode()


def inline_reply(item: Received, path: Path) -> bytes:
    """A LocalRecvResponse with the tensor inside, and how the daemon got it.
    The tensor's bytes (the last of the tensor's field) start at an aligned
    offset, so a client whose frame arrives at an aligned address reads them
    in place."""
    tensor = unary_response(item)
    value = item.value
    pad = b""
    if not item.is_dead and type(value) is np.ndarray and value.nbytes and is_memcpyable(value):
        pad = wire.align_pad(len(tensor) - value.nbytes)
    return b"".join((pad, tensor, _path_field(path)))


def pooled_reply(meta: TensorMeta, seg_id: int, nbytes: int, path: Path) -> bytes:
    """A LocalRecvResponse naming the pool segment that holds the tensor."""
    head = encode_meta(meta)
    slot = wire.varint_field(F.SLOT_SEGMENT, seg_id) + wire.varint_field(F.SLOT_NBYTES, nbytes)
    return b"".join([wire.len_field_header(F.LOCAL_REPLY_TENSOR, len(head)), head,
                     wire.len_field_header(F.LOCAL_REPLY_POOLED, len(slot)), slot, _path_field(path)])


class ReplyFields(NamedTuple):
    """What a LocalRecvResponse says; ``tensor`` and ``slot`` are byte spans of it."""

    tensor: tuple[int, int] | None
    is_dead: bool
    slot: tuple[int, int] | None
    path: Path


def reply_fields(raw: bytes | memoryview) -> ReplyFields:
    tensor = slot = None
    is_dead = False
    path = Path.LOCAL
    for num, wt, a, b in wire.iter_fields(raw):
        if num == F.LOCAL_REPLY_TENSOR and wt == wire.LEN:
            tensor = (a, b)
        elif num == F.LOCAL_REPLY_IS_DEAD and wt == wire.VARINT:
            is_dead = bool(a)
        elif num == F.LOCAL_REPLY_POOLED and wt == wire.LEN:
            slot = (a, b)
        elif num == F.LOCAL_REPLY_PATH and wt == wire.LEN:
            try:
                path = Path(bytes(raw[a:b]).decode())
            except ValueError:
                raise InvalidArgument(f"daemon reply names an unknown path {bytes(raw[a:b])!r}") from None
    return ReplyFields(tensor, is_dead, slot, path)


class LocalReply(NamedTuple):
    """A parsed LocalRecvResponse: the item, how the daemon got it, how it crossed the hop."""

    item: Received
    path: Path
    hop: Hop


#: (segment id, nbytes, meta) -> the client's array on that segment
SegmentView = Callable[[int, int, TensorMeta], np.ndarray]


def parse_reply(raw: bytes | memoryview, view: SegmentView | None = None) -> LocalReply:
    """A LocalRecvResponse as the client's item: a view on the reply's bytes, or
    (``view``) on the pool segment it names."""
    got = reply_fields(raw)
    if got.is_dead:
        return LocalReply(Received(None, True), got.path, Hop.INLINE)
    if got.tensor is None:
        raise InvalidArgument("daemon reply carries no tensor")
    if got.slot is not None:
        if view is None:
            raise InvalidArgument("a pooled reply outside a session")
        seg = lpb.PoolSlot.FromString(bytes(raw[got.slot[0]:got.slot[1]]))
        meta, _, _ = decode_meta(raw, *got.tensor)
        return LocalReply(Received(view(seg.segment, seg.nbytes, meta), False), got.path, Hop.SHM)
    value = decode_tensor(raw, *got.tensor)
    if not value.flags.aligned:  # handed out of the package: aligned to its dtype, or a copy
        value = value.copy()
    return LocalReply(Received(value, False), got.path, Hop.INLINE)


# -- errors ---------------------------------------------------------------------------------


def error_from(exc: grpc.RpcError) -> RendezvousError:
    """The error a failed gRPC call of the local service means."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    return from_status(code, (exc.details() or "") if hasattr(exc, "details") else str(exc))


def frame_error(body: bytes | memoryview) -> RendezvousError:
    """The error an ERROR frame carries."""
    code, message = unpack_error(body)
    return from_status(code, message)
