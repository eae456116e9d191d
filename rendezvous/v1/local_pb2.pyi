from rendezvous.v1 import rendezvous_pb2 as _rendezvous_pb2
from rendezvous.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolSlot(_message.Message):
    __slots__ = ("segment", "nbytes")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    segment: int
    nbytes: int
    def __init__(self, segment: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class SendRequest(_message.Message):
    __slots__ = ("step_id", "rendezvous_key", "tensor", "is_dead", "pooled", "ipc")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_KEY_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    IS_DEAD_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    IPC_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    rendezvous_key: str
    tensor: _tensor_pb2.TensorProto
    is_dead: bool
    pooled: PoolSlot
    ipc: _rendezvous_pb2.IpcTransfer
    def __init__(self, step_id: _Optional[int] = ..., rendezvous_key: _Optional[str] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorProto, _Mapping]] = ..., is_dead: _Optional[bool] = ..., pooled: _Optional[_Union[PoolSlot, _Mapping]] = ..., ipc: _Optional[_Union[_rendezvous_pb2.IpcTransfer, _Mapping]] = ...) -> None: ...

class SendResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LocalSendManyRequest(_message.Message):
    __slots__ = ("step_id", "rendezvous_keys", "group")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_KEYS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    rendezvous_keys: _containers.RepeatedScalarFieldContainer[str]
    group: _rendezvous_pb2.ReplyGroup
    def __init__(self, step_id: _Optional[int] = ..., rendezvous_keys: _Optional[_Iterable[str]] = ..., group: _Optional[_Union[_rendezvous_pb2.ReplyGroup, _Mapping]] = ...) -> None: ...

class LocalRecvRequest(_message.Message):
    __slots__ = ("step_id", "rendezvous_key", "timeout", "ipc_device")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    IPC_DEVICE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    rendezvous_key: str
    timeout: float
    ipc_device: bytes
    def __init__(self, step_id: _Optional[int] = ..., rendezvous_key: _Optional[str] = ..., timeout: _Optional[float] = ..., ipc_device: _Optional[bytes] = ...) -> None: ...

class LocalRecvResponse(_message.Message):
    __slots__ = ("tensor", "is_dead", "path", "pooled", "ipc")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    IS_DEAD_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    IPC_FIELD_NUMBER: _ClassVar[int]
    tensor: _tensor_pb2.TensorProto
    is_dead: bool
    path: str
    pooled: PoolSlot
    ipc: _rendezvous_pb2.IpcTransfer
    def __init__(self, tensor: _Optional[_Union[_tensor_pb2.TensorProto, _Mapping]] = ..., is_dead: _Optional[bool] = ..., path: _Optional[str] = ..., pooled: _Optional[_Union[PoolSlot, _Mapping]] = ..., ipc: _Optional[_Union[_rendezvous_pb2.IpcTransfer, _Mapping]] = ...) -> None: ...

class LocalRecvManyRequest(_message.Message):
    __slots__ = ("step_id", "rendezvous_keys", "timeout")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_KEYS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    rendezvous_keys: _containers.RepeatedScalarFieldContainer[str]
    timeout: float
    def __init__(self, step_id: _Optional[int] = ..., rendezvous_keys: _Optional[_Iterable[str]] = ..., timeout: _Optional[float] = ...) -> None: ...

class LocalRecvFailure(_message.Message):
    __slots__ = ("index", "code", "message")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    index: int
    code: int
    message: str
    def __init__(self, index: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class LocalRecvManyResponse(_message.Message):
    __slots__ = ("replies", "failures", "group", "group_paths")
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GROUP_PATHS_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[LocalRecvResponse]
    failures: _containers.RepeatedCompositeFieldContainer[LocalRecvFailure]
    group: _rendezvous_pb2.ReplyGroup
    group_paths: bytes
    def __init__(self, replies: _Optional[_Iterable[_Union[LocalRecvResponse, _Mapping]]] = ..., failures: _Optional[_Iterable[_Union[LocalRecvFailure, _Mapping]]] = ..., group: _Optional[_Union[_rendezvous_pb2.ReplyGroup, _Mapping]] = ..., group_paths: _Optional[bytes] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("step_id", "message")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    message: str
    def __init__(self, step_id: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PendingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PendingEntry(_message.Message):
    __slots__ = ("step_id", "rendezvous_key", "kind", "count", "oldest_age_seconds", "producer")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_KEY_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    OLDEST_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    rendezvous_key: str
    kind: str
    count: int
    oldest_age_seconds: float
    producer: str
    def __init__(self, step_id: _Optional[int] = ..., rendezvous_key: _Optional[str] = ..., kind: _Optional[str] = ..., count: _Optional[int] = ..., oldest_age_seconds: _Optional[float] = ..., producer: _Optional[str] = ...) -> None: ...

class PendingResponse(_message.Message):
    __slots__ = ("entries", "omitted")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    OMITTED_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[PendingEntry]
    omitted: int
    def __init__(self, entries: _Optional[_Iterable[_Union[PendingEntry, _Mapping]]] = ..., omitted: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("client_id", "pid")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    pid: int
    def __init__(self, client_id: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("task", "shm_threshold", "max_tensor_bytes", "session_socket", "max_frame_bytes")
    TASK_FIELD_NUMBER: _ClassVar[int]
    SHM_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MAX_TENSOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSION_SOCKET_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    task: str
    shm_threshold: int
    max_tensor_bytes: int
    session_socket: str
    max_frame_bytes: int
    def __init__(self, task: _Optional[str] = ..., shm_threshold: _Optional[int] = ..., max_tensor_bytes: _Optional[int] = ..., session_socket: _Optional[str] = ..., max_frame_bytes: _Optional[int] = ...) -> None: ...
