from google.protobuf import struct_pb2 as _struct_pb2
from rendezvous.v1 import local_pb2 as _local_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("task", "protocol", "paths", "table", "daemon")
    TASK_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DAEMON_FIELD_NUMBER: _ClassVar[int]
    task: str
    protocol: str
    paths: _struct_pb2.Struct
    table: _struct_pb2.Struct
    daemon: _struct_pb2.Struct
    def __init__(self, task: _Optional[str] = ..., protocol: _Optional[str] = ..., paths: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., table: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., daemon: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...
