from rendezvous.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShmSegment(_message.Message):
    __slots__ = ("name", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class SendRequest(_message.Message):
    __slots__ = ("step_id", "rendezvous_key", "tensor", "is_dead", "shm", "client_id")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_KEY_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    IS_DEAD_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    rendezvous_key: str
    tensor: _tensor_pb2.TensorProto
    is_dead: bool
    shm: ShmSegment
    client_id: str
    def __init__(self, step_id: _Optional[int] = ..., rendezvous_key: _Optional[str] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorProto, _Mapping]] = ..., is_dead: _Optional[bool] = ..., shm: _Optional[_Union[ShmSegment, _Mapping]] = ..., client_id: _Optional[str] = ...) -> None: ...

class SendResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LocalRecvRequest(_message.Message):
    __slots__ = ("step_id", "rendezvous_key", "timeout", "client_id")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    rendezvous_key: str
    timeout: float
    client_id: str
    def __init__(self, step_id: _Optional[int] = ..., rendezvous_key: _Optional[str] = ..., timeout: _Optional[float] = ..., client_id: _Optional[str] = ...) -> None: ...

class LocalRecvResponse(_message.Message):
    __slots__ = ("tensor", "is_dead", "shm", "path")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    IS_DEAD_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    tensor: _tensor_pb2.TensorProto
    is_dead: bool
    shm: ShmSegment
    path: str
    def __init__(self, tensor: _Optional[_Union[_tensor_pb2.TensorProto, _Mapping]] = ..., is_dead: _Optional[bool] = ..., shm: _Optional[_Union[ShmSegment, _Mapping]] = ..., path: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[PendingEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[PendingEntry, _Mapping]]] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("client_id", "pid")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    pid: int
    def __init__(self, client_id: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("task", "shm_threshold", "max_tensor_bytes", "shm_prefix")
    TASK_FIELD_NUMBER: _ClassVar[int]
    SHM_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MAX_TENSOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_PREFIX_FIELD_NUMBER: _ClassVar[int]
    task: str
    shm_threshold: int
    max_tensor_bytes: int
    shm_prefix: str
    def __init__(self, task: _Optional[str] = ..., shm_threshold: _Optional[int] = ..., max_tensor_bytes: _Optional[int] = ..., shm_prefix: _Optional[str] = ...) -> None: ...
