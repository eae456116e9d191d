"""The local protocol's CUDA IPC messages (session socket only).

Between a client and its daemon on one node, on the session socket:

* a **send** of a GPU tensor is a ``SEND_IPC`` frame: a ``SendRequest``
  whose ``tensor`` holds dtype and shape only and whose ``ipc`` is an
  ``IpcTransfer`` (the allocation's handle, the offset, an IPC event done
  once the tensor is written, the GPU's UUID): the daemon copies it onto
  that GPU and answers OK once the copy is done, the client letting go then
  (UNAVAILABLE: it cannot, and the client sends through the host);
* a **recv** names the UUID of the GPU it puts the tensor on
  (``LocalRecvRequest.ipc_device``); the daemon may answer with the tensor
  on that GPU, exported (``LocalRecvResponse.ipc``), and holds it until the
  client's ``IPC_RELEASE`` of its ``export_id`` (``failed``: the client
  could not copy it, and the daemon keeps it for the next recv of its key).
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from rendezvous.codec import fields as F, wire
from rendezvous.codec.tensors import TensorMeta, decode_meta, encode_meta
from rendezvous.errors import InvalidArgument
from rendezvous.paths import Path
from rendezvous.v1 import rendezvous_pb2 as pb

__all__ = ["send_body", "sent", "reply_body", "replied", "release_body",
           "parse_release"]


def _transfer(raw: bytes | memoryview, meta_span: tuple[int, int] | None,
              span: tuple[int, int]) -> tuple[pb.IpcTransfer, TensorMeta]:
    """The transfer at ``span`` and the meta at ``meta_span``, checked against each other."""
    try:
        transfer = pb.IpcTransfer.FromString(bytes(raw[span[0]:span[1]]))
    except DecodeError as exc:
        raise InvalidArgument(f"malformed IpcTransfer: {exc}") from None
    if meta_span is None or not transfer.memory or not transfer.device:
        raise InvalidArgument("an IPC transfer needs the tensor's dtype and shape, a memory handle and a GPU")
    meta, _, _ = decode_meta(raw, *meta_span)
    if meta.nbytes != transfer.nbytes:
        raise InvalidArgument(f"an IPC transfer announces {transfer.nbytes} bytes for {meta.dtype}"
                              f"{list(meta.shape)} ({meta.nbytes} bytes)")
    return transfer, meta


def _spans(raw: bytes | memoryview, meta_field: int, ipc_field: int
           ) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    meta = ipc = None
    for num, wt, a, b in wire.iter_fields(raw):
        if num == meta_field and wt == wire.LEN:
            meta = (a, b)
        elif num == ipc_field and wt == wire.LEN:
            ipc = (a, b)
    return meta, ipc


def send_body(head: bytes, meta: TensorMeta, transfer: pb.IpcTransfer) -> bytes:
    """A SendRequest (``head``: its step and key) whose tensor stays on its GPU, exported."""
    m, t = encode_meta(meta), transfer.SerializeToString()
    return b"".join([head, wire.len_field_header(F.SEND_TENSOR, len(m)), m,
                     wire.len_field_header(F.SEND_IPC, len(t)), t])


def sent(raw: bytes | memoryview) -> tuple[int, str, pb.IpcTransfer, TensorMeta]:
    """A SEND_IPC's step, key, transfer and tensor meta (InvalidArgument if any is missing)."""
    meta, ipc = _spans(raw, F.SEND_TENSOR, F.SEND_IPC)
    if ipc is None:
        raise InvalidArgument("a SEND_IPC without an IpcTransfer")
    transfer, got = _transfer(raw, meta, ipc)
    step_id, key = 0, ""
    for num, wt, a, b in wire.iter_fields(raw):
        if num == F.SEND_STEP_ID and wt == wire.VARINT:
            step_id = wire.to_signed64(a)
        elif num == F.SEND_KEY and wt == wire.LEN:
            try:
                key = bytes(raw[a:b]).decode()
            except UnicodeDecodeError:
                raise InvalidArgument("rendezvous_key is not UTF-8") from None
    return step_id, key, transfer, got


def reply_body(meta: TensorMeta, transfer: pb.IpcTransfer, path: Path) -> bytes:
    """A LocalRecvResponse naming the export of the tensor, and how the daemon got it."""
    m, t, p = encode_meta(meta), transfer.SerializeToString(), path.value.encode()
    return b"".join([wire.len_field_header(F.LOCAL_REPLY_TENSOR, len(m)), m,
                     wire.len_field_header(F.LOCAL_REPLY_IPC, len(t)), t,
                     wire.len_field_header(F.LOCAL_REPLY_PATH, len(p)), p])


def replied(raw: bytes | memoryview) -> tuple[pb.IpcTransfer, TensorMeta] | None:
    """A LocalRecvResponse's export and tensor meta, or None if it has none."""
    meta, ipc = _spans(raw, F.LOCAL_REPLY_TENSOR, F.LOCAL_REPLY_IPC)
    return None if ipc is None else _transfer(raw, meta, ipc)


def release_body(export_ids: list[int], failed: bool) -> bytes:
    return pb.IpcRelease(export_ids=export_ids, failed=failed).SerializeToString()


def parse_release(raw: bytes | memoryview) -> pb.IpcRelease:
    try:
        return pb.IpcRelease.FromString(bytes(raw))
    except DecodeError as exc:
        raise InvalidArgument(f"malformed IpcRelease: {exc}") from None
