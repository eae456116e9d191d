"""Rendezvous keys: ``src_device;src_incarnation;dst_device;name;frame_id:iter_id``."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from .errors import InvalidKey

__all__ = ["TaskName", "DeviceName", "Key", "parse_key", "format_key", "make_key", "as_key"]

_NAME = r"[A-Za-z][A-Za-z0-9_]*"
_DEV_RE = re.compile(
    rf"(?:/job:(?P<job>{_NAME}))?(?:/replica:(?P<replica>\d+))?(?:/task:(?P<task>\d+))?"
    rf"/(?P<dev>device:)?(?P<type>{_NAME}):(?P<id>\d+)\Z")
_TASK_RE = re.compile(rf"/job:(?P<job>{_NAME})(?:/replica:(?P<replica>\d+))?/task:(?P<task>\d+)\Z")
_HEX_RE = re.compile(r"[0-9A-Fa-f]{1,16}\Z")
_FRAME_RE = re.compile(r"(\d+):(\d+)\Z")


@dataclass(frozen=True, slots=True)
class TaskName:
    job: str
    replica: int
    task: int

    def __str__(self) -> str:
        return f"/job:{self.job}/replica:{self.replica}/task:{self.task}"

    @classmethod
    def parse(cls, s: str) -> "TaskName":
        m = _TASK_RE.match(s) if isinstance(s, str) else None
        if m is None:
            raise InvalidKey(f"task name {s!r} is not /job:J/replica:R/task:T", field="task")
        return cls(m["job"], int(m["replica"] or 0), int(m["task"]))


@dataclass(frozen=True, slots=True)
class DeviceName:
    job: str | None
    replica: int | None
    task: int | None
    type: str
    id: int
    legacy: bool

    @classmethod
    def parse(cls, s: str, field: str = "device") -> "DeviceName":
        return _parse_device(s, field)

    def __str__(self) -> str:
        out = ""
        if self.job is not None:
            out += f"/job:{self.job}"
        if self.replica is not None:
            out += f"/replica:{self.replica}"
        if self.task is not None:
            out += f"/task:{self.task}"
        return out + ("/" if self.legacy else "/device:") + f"{self.type}:{self.id}"

    @property
    def task_name(self) -> TaskName | None:
        if self.job is None:
            return None
        return TaskName(self.job, self.replica or 0, self.task or 0)

    @property
    def is_gpu(self) -> bool:
        return self.type.upper() == "GPU"


@functools.lru_cache(maxsize=4096)
def _parse_device(s: str, field: str) -> DeviceName:
    m = _DEV_RE.match(s) if isinstance(s, str) else None
    if m is None:
        raise InvalidKey(f"invalid rendezvous key: {field} {s!r} is not a device name "
                         f"like /job:J/replica:R/task:T/device:TYPE:ID", field=field)
    rep, task = m["replica"], m["task"]
    return DeviceName(m["job"], None if rep is None else int(rep), None if task is None else int(task),
                      m["type"], int(m["id"]), m["dev"] is None)


@dataclass(frozen=True, slots=True)
class Key:
    src_device: str
    src_incarnation: int
    dst_device: str
    name: str
    frame_id: int = 0
    iter_id: int = 0

    def __post_init__(self) -> None:
        _parse_device(self.src_device, "src_device")
        _parse_device(self.dst_device, "dst_device")
        if not isinstance(self.src_incarnation, int) or not 0 <= self.src_incarnation < 1 << 64:
            raise InvalidKey(f"invalid rendezvous key: src_incarnation {self.src_incarnation!r} is not in [0, 2**64)",
                             field="src_incarnation")
        if not isinstance(self.name, str) or not self.name or ";" in self.name:
            raise InvalidKey(f"invalid rendezvous key: name {self.name!r} must be non-empty without ';'", field="name")
        if not 0 <= self.frame_id < 1 << 64 or not 0 <= self.iter_id < 1 << 63:
            raise InvalidKey(f"invalid rendezvous key: frame/iter {self.frame_id}:{self.iter_id} out of range",
                             field="frame_iter")

    @classmethod
    def parse(cls, s: str) -> "Key":
        return parse_key(s)

    def format(self) -> str:
        return (f"{self.src_device};{self.src_incarnation:016x};{self.dst_device};{self.name};"
                f"{self.frame_id}:{self.iter_id}")

    __str__ = format

    @property
    def src(self) -> DeviceName:
        return _parse_device(self.src_device, "src_device")

    @property
    def dst(self) -> DeviceName:
        return _parse_device(self.dst_device, "dst_device")

    @property
    def src_task(self) -> TaskName | None:
        return self.src.task_name

    @property
    def dst_task(self) -> TaskName | None:
        return self.dst.task_name


@functools.lru_cache(maxsize=4096)
def parse_key(s: str) -> Key:
    if not isinstance(s, str):
        raise InvalidKey(f"invalid rendezvous key: expected a string, got {type(s).__name__}", field="key")
    parts = s.split(";")
    if len(parts) != 5:
        raise InvalidKey(f"invalid rendezvous key: expected 5 ';'-separated fields, got {len(parts)} in {s!r}",
                         field="key")
    src, inc, dst, name, fi = parts
    if not _HEX_RE.match(inc):
        raise InvalidKey(f"invalid rendezvous key: src_incarnation {inc!r} is not 1-16 hex digits (in {s!r})",
                         field="src_incarnation")
    m = _FRAME_RE.match(fi)
    if m is None:
        raise InvalidKey(f"invalid rendezvous key: {fi!r} is not frame_id:iter_id (in {s!r})", field="frame_iter")
    return Key(src, int(inc, 16), dst, name, int(m[1]), int(m[2]))


def format_key(key: Key) -> str:
    return key.format()


def make_key(src_device: str, dst_device: str, name: str, *, incarnation: int = 0,
             frame_id: int = 0, iter_id: int = 0) -> Key:
    return Key(src_device, incarnation, dst_device, name, frame_id, iter_id)


def as_key(key: "Key | str") -> Key:
    return key if isinstance(key, Key) else parse_key(key)
