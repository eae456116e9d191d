"""Field numbers of the messages written and scanned by hand, by name.

The hot paths (replies, requests, the local hop) write and scan protobuf
fields directly (:mod:`rendezvous.codec.wire`) instead of building message objects.
Their field numbers come from here, and here they come from the generated
modules, so they follow ``protos/`` and cannot drift from it.
"""

from __future__ import annotations

from google.protobuf import any_pb2

from ..v1 import local_pb2 as _local
from ..v1 import rendezvous_pb2 as _rdv
from ..v1 import tensor_pb2 as _tensor

# google.protobuf.Any
ANY_TYPE_URL = any_pb2.Any.TYPE_URL_FIELD_NUMBER
ANY_VALUE = any_pb2.Any.VALUE_FIELD_NUMBER

# TensorProto, TensorShapeProto and its Dim
TENSOR_DTYPE = _tensor.TensorProto.DTYPE_FIELD_NUMBER
TENSOR_SHAPE = _tensor.TensorProto.TENSOR_SHAPE_FIELD_NUMBER
TENSOR_VERSION = _tensor.TensorProto.VERSION_NUMBER_FIELD_NUMBER
TENSOR_CONTENT = _tensor.TensorProto.TENSOR_CONTENT_FIELD_NUMBER
TENSOR_STRING_VAL = _tensor.TensorProto.STRING_VAL_FIELD_NUMBER
SHAPE_DIM = _tensor.TensorShapeProto.DIM_FIELD_NUMBER
SHAPE_UNKNOWN_RANK = _tensor.TensorShapeProto.UNKNOWN_RANK_FIELD_NUMBER
DIM_SIZE = _tensor.TensorShapeProto.Dim.SIZE_FIELD_NUMBER
DIM_NAME = _tensor.TensorShapeProto.Dim.NAME_FIELD_NUMBER

# RecvTensorRequest
REQUEST_STEP_ID = _rdv.RecvTensorRequest.STEP_ID_FIELD_NUMBER
REQUEST_KEY = _rdv.RecvTensorRequest.RENDEZVOUS_KEY_FIELD_NUMBER
REQUEST_TRANSPORT_OPTIONS = _rdv.RecvTensorRequest.TRANSPORT_OPTIONS_FIELD_NUMBER
REQUEST_ID = _rdv.RecvTensorRequest.REQUEST_ID_FIELD_NUMBER

# RecvTensorResponse
RESPONSE_TENSOR = _rdv.RecvTensorResponse.TENSOR_FIELD_NUMBER
RESPONSE_IS_DEAD = _rdv.RecvTensorResponse.IS_DEAD_FIELD_NUMBER
RESPONSE_SEND_START_MICROS = _rdv.RecvTensorResponse.SEND_START_MICROS_FIELD_NUMBER
RESPONSE_TRANSPORT_OPTIONS = _rdv.RecvTensorResponse.TRANSPORT_OPTIONS_FIELD_NUMBER

# StreamRequest
STREAM_REQUEST_CALL_ID = _rdv.StreamRequest.CALL_ID_FIELD_NUMBER
STREAM_REQUEST_RECV = _rdv.StreamRequest.RECV_FIELD_NUMBER
STREAM_REQUEST_CANCEL = _rdv.StreamRequest.CANCEL_FIELD_NUMBER
STREAM_REQUEST_BATCH = _rdv.StreamRequest.BATCH_FIELD_NUMBER
STREAM_REQUEST_RECV_MANY = _rdv.StreamRequest.RECV_MANY_FIELD_NUMBER

# RecvMany
MANY_STEP_ID = _rdv.RecvMany.STEP_ID_FIELD_NUMBER
MANY_KEYS = _rdv.RecvMany.RENDEZVOUS_KEYS_FIELD_NUMBER
MANY_REQUEST_IDS = _rdv.RecvMany.REQUEST_IDS_FIELD_NUMBER
MANY_TRANSPORT_OPTIONS = _rdv.RecvMany.TRANSPORT_OPTIONS_FIELD_NUMBER

# ReplyGroup
GROUP_CALL_IDS = _rdv.ReplyGroup.CALL_IDS_FIELD_NUMBER
GROUP_DTYPES = _rdv.ReplyGroup.DTYPES_FIELD_NUMBER
GROUP_RANKS = _rdv.ReplyGroup.RANKS_FIELD_NUMBER
GROUP_DIMS = _rdv.ReplyGroup.DIMS_FIELD_NUMBER
GROUP_OFFSETS = _rdv.ReplyGroup.OFFSETS_FIELD_NUMBER
GROUP_PAYLOAD = _rdv.ReplyGroup.PAYLOAD_FIELD_NUMBER
GROUP_TRANSPORT_OPTIONS = _rdv.ReplyGroup.TRANSPORT_OPTIONS_FIELD_NUMBER
GROUP_SEND_START_MICROS = _rdv.ReplyGroup.SEND_START_MICROS_FIELD_NUMBER

# StreamResponse
STREAM_RESPONSE_CALL_ID = _rdv.StreamResponse.CALL_ID_FIELD_NUMBER
STREAM_RESPONSE_RESPONSE = _rdv.StreamResponse.RESPONSE_FIELD_NUMBER
STREAM_RESPONSE_CHUNK = _rdv.StreamResponse.CHUNK_FIELD_NUMBER
STREAM_RESPONSE_ERROR = _rdv.StreamResponse.ERROR_FIELD_NUMBER
STREAM_RESPONSE_BATCH = _rdv.StreamResponse.BATCH_FIELD_NUMBER
STREAM_RESPONSE_GROUP = _rdv.StreamResponse.GROUP_FIELD_NUMBER

# Padding: a field the messages padded reserve (so every reader skips it),
# written so that the tensor bytes after it start at an aligned offset (see
# wire.align_pad). One tag byte.
PAD = 15
assert PAD not in {f.number for m in (_rdv.StreamResponse, _rdv.ReplyGroup, _local.LocalRecvResponse,
                                      _local.LocalRecvManyResponse, _local.LocalSendManyRequest)
                   for f in m.DESCRIPTOR.fields}

# The local service (local.proto)
SLOT_SEGMENT = _local.PoolSlot.SEGMENT_FIELD_NUMBER
SLOT_NBYTES = _local.PoolSlot.NBYTES_FIELD_NUMBER
SEND_STEP_ID = _local.SendRequest.STEP_ID_FIELD_NUMBER
SEND_KEY = _local.SendRequest.RENDEZVOUS_KEY_FIELD_NUMBER
SEND_TENSOR = _local.SendRequest.TENSOR_FIELD_NUMBER
SEND_IS_DEAD = _local.SendRequest.IS_DEAD_FIELD_NUMBER
SEND_POOLED = _local.SendRequest.POOLED_FIELD_NUMBER
SEND_IPC = _local.SendRequest.IPC_FIELD_NUMBER
SEND_NAMED_SHM = 5  # reserved: a named POSIX segment, no longer accepted
LOCAL_RECV_STEP_ID = _local.LocalRecvRequest.STEP_ID_FIELD_NUMBER
LOCAL_RECV_KEY = _local.LocalRecvRequest.RENDEZVOUS_KEY_FIELD_NUMBER
LOCAL_RECV_TIMEOUT = _local.LocalRecvRequest.TIMEOUT_FIELD_NUMBER
# LocalRecvResponse begins with RecvTensorResponse's fields 1 and 2 (tensor,
# is_dead), so a RecvTensorResponse's bytes are a valid start of one.
LOCAL_REPLY_TENSOR = _local.LocalRecvResponse.TENSOR_FIELD_NUMBER
LOCAL_REPLY_IS_DEAD = _local.LocalRecvResponse.IS_DEAD_FIELD_NUMBER
LOCAL_REPLY_POOLED = _local.LocalRecvResponse.POOLED_FIELD_NUMBER
LOCAL_REPLY_IPC = _local.LocalRecvResponse.IPC_FIELD_NUMBER
LOCAL_REPLY_PATH = _local.LocalRecvResponse.PATH_FIELD_NUMBER
SEND_MANY_STEP_ID = _local.LocalSendManyRequest.STEP_ID_FIELD_NUMBER
SEND_MANY_KEYS = _local.LocalSendManyRequest.RENDEZVOUS_KEYS_FIELD_NUMBER
SEND_MANY_GROUP = _local.LocalSendManyRequest.GROUP_FIELD_NUMBER
LOCAL_MANY_REPLIES = _local.LocalRecvManyResponse.REPLIES_FIELD_NUMBER
LOCAL_MANY_FAILURES = _local.LocalRecvManyResponse.FAILURES_FIELD_NUMBER
LOCAL_MANY_GROUP = _local.LocalRecvManyResponse.GROUP_FIELD_NUMBER
LOCAL_MANY_GROUP_PATHS = _local.LocalRecvManyResponse.GROUP_PATHS_FIELD_NUMBER

assert (LOCAL_REPLY_TENSOR, LOCAL_REPLY_IS_DEAD) == (RESPONSE_TENSOR, RESPONSE_IS_DEAD)
