from google.protobuf import any_pb2 as _any_pb2
from rendezvous.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RecvTensorRequest(_message.Message):
    __slots__ = ("step_id", "rendezvous_key", "dma_ok", "transport_options", "request_id")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_KEY_FIELD_NUMBER: _ClassVar[int]
    DMA_OK_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    rendezvous_key: str
    dma_ok: bool
    transport_options: _any_pb2.Any
    request_id: int
    def __init__(self, step_id: _Optional[int] = ..., rendezvous_key: _Optional[str] = ..., dma_ok: _Optional[bool] = ..., transport_options: _Optional[_Union[_any_pb2.Any, _Mapping]] = ..., request_id: _Optional[int] = ...) -> None: ...

class RecvTensorResponse(_message.Message):
    __slots__ = ("tensor", "is_dead", "send_start_micros", "transport_options")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    IS_DEAD_FIELD_NUMBER: _ClassVar[int]
    SEND_START_MICROS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    tensor: _tensor_pb2.TensorProto
    is_dead: bool
    send_start_micros: int
    transport_options: _any_pb2.Any
    def __init__(self, tensor: _Optional[_Union[_tensor_pb2.TensorProto, _Mapping]] = ..., is_dead: _Optional[bool] = ..., send_start_micros: _Optional[int] = ..., transport_options: _Optional[_Union[_any_pb2.Any, _Mapping]] = ...) -> None: ...

class MpiEndpoint(_message.Message):
    __slots__ = ("world_id", "rank", "max_chunk_bytes", "inline_below")
    WORLD_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    INLINE_BELOW_FIELD_NUMBER: _ClassVar[int]
    world_id: int
    rank: int
    max_chunk_bytes: int
    inline_below: int
    def __init__(self, world_id: _Optional[int] = ..., rank: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., inline_below: _Optional[int] = ...) -> None: ...

class MpiTransfer(_message.Message):
    __slots__ = ("world_id", "source_rank", "tag", "nbytes", "chunk_bytes")
    WORLD_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_RANK_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    world_id: int
    source_rank: int
    tag: int
    nbytes: int
    chunk_bytes: int
    def __init__(self, world_id: _Optional[int] = ..., source_rank: _Optional[int] = ..., tag: _Optional[int] = ..., nbytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class IpcEndpoint(_message.Message):
    __slots__ = ("node", "pid", "devices", "next")
    NODE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    node: bytes
    pid: int
    devices: _containers.RepeatedScalarFieldContainer[bytes]
    next: _any_pb2.Any
    def __init__(self, node: _Optional[bytes] = ..., pid: _Optional[int] = ..., devices: _Optional[_Iterable[bytes]] = ..., next: _Optional[_Union[_any_pb2.Any, _Mapping]] = ...) -> None: ...

class IpcTransfer(_message.Message):
    __slots__ = ("memory", "offset", "event", "export_id", "producer", "nbytes", "device")
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    EXPORT_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    memory: bytes
    offset: int
    event: bytes
    export_id: int
    producer: str
    nbytes: int
    device: bytes
    def __init__(self, memory: _Optional[bytes] = ..., offset: _Optional[int] = ..., event: _Optional[bytes] = ..., export_id: _Optional[int] = ..., producer: _Optional[str] = ..., nbytes: _Optional[int] = ..., device: _Optional[bytes] = ...) -> None: ...

class IpcRelease(_message.Message):
    __slots__ = ("export_ids", "failed")
    EXPORT_IDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    export_ids: _containers.RepeatedScalarFieldContainer[int]
    failed: bool
    def __init__(self, export_ids: _Optional[_Iterable[int]] = ..., failed: _Optional[bool] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RecvMany(_message.Message):
    __slots__ = ("step_id", "rendezvous_keys", "request_ids", "transport_options")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_KEYS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    rendezvous_keys: _containers.RepeatedScalarFieldContainer[str]
    request_ids: _containers.RepeatedScalarFieldContainer[int]
    transport_options: _any_pb2.Any
    def __init__(self, step_id: _Optional[int] = ..., rendezvous_keys: _Optional[_Iterable[str]] = ..., request_ids: _Optional[_Iterable[int]] = ..., transport_options: _Optional[_Union[_any_pb2.Any, _Mapping]] = ...) -> None: ...

class ReplyGroup(_message.Message):
    __slots__ = ("call_ids", "dtypes", "ranks", "dims", "offsets", "payload", "transport_options", "send_start_micros")
    CALL_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    SEND_START_MICROS_FIELD_NUMBER: _ClassVar[int]
    call_ids: _containers.RepeatedScalarFieldContainer[int]
    dtypes: bytes
    ranks: _containers.RepeatedScalarFieldContainer[int]
    dims: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    payload: bytes
    transport_options: _any_pb2.Any
    send_start_micros: int
    def __init__(self, call_ids: _Optional[_Iterable[int]] = ..., dtypes: _Optional[bytes] = ..., ranks: _Optional[_Iterable[int]] = ..., dims: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ..., payload: _Optional[bytes] = ..., transport_options: _Optional[_Union[_any_pb2.Any, _Mapping]] = ..., send_start_micros: _Optional[int] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("call_id", "recv", "cancel", "recv_many", "release", "batch")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    RECV_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    RECV_MANY_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    recv: RecvTensorRequest
    cancel: Cancel
    recv_many: RecvMany
    release: IpcRelease
    batch: _containers.RepeatedCompositeFieldContainer[StreamRequest]
    def __init__(self, call_id: _Optional[int] = ..., recv: _Optional[_Union[RecvTensorRequest, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., recv_many: _Optional[_Union[RecvMany, _Mapping]] = ..., release: _Optional[_Union[IpcRelease, _Mapping]] = ..., batch: _Optional[_Iterable[_Union[StreamRequest, _Mapping]]] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("call_id", "response", "chunk", "error", "batch", "group")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    response: RecvTensorResponse
    chunk: bytes
    error: Status
    batch: _containers.RepeatedCompositeFieldContainer[StreamResponse]
    group: ReplyGroup
    def __init__(self, call_id: _Optional[int] = ..., response: _Optional[_Union[RecvTensorResponse, _Mapping]] = ..., chunk: _Optional[bytes] = ..., error: _Optional[_Union[Status, _Mapping]] = ..., batch: _Optional[_Iterable[_Union[StreamResponse, _Mapping]]] = ..., group: _Optional[_Union[ReplyGroup, _Mapping]] = ...) -> None: ...
