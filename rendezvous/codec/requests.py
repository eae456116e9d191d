"""The consumer's StreamRequests, written by hand: a recv, many recvs at once,
a cancel, and several packed as one message."""

from __future__ import annotations

import numpy as np

from rendezvous.v1 import rendezvous_pb2 as pb

from . import fields as F
from . import wire

__all__ = ["recv_request", "many_keys_field", "recv_many_request", "cancel_request", "release_request",
           "batch_requests"]


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


def release_request(export_ids: list[int], failed: bool) -> bytes:
    """A StreamRequest releasing what the producer exported (CUDA IPC): ``failed``,
    the consumer could not copy it."""
    return pb.StreamRequest(release=pb.IpcRelease(export_ids=export_ids, failed=failed)).SerializeToString()


def batch_requests(messages: list[bytes]) -> bytes:
    """Several StreamRequests packed as one (the ``batch`` entries of an outer one)."""
    return wire.pack(messages, F.STREAM_REQUEST_BATCH)
