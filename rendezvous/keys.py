"""Rendezvous keys, in TensorFlow's format, and the device and task names in them.

A key names one tensor transfer::

    src_device;src_incarnation;dst_device;name;frame_id:iter_id

for example ``/job:ps/replica:0/task:0/cpu:0;ccc0db7aa974ba53;/job:worker/replica:0/task:0/gpu:0;edge_37_x;0:0``.

* ``src_device`` and ``dst_device`` are device names
  (``/job:J/replica:R/task:T/device:TYPE:ID``, with ``replica`` and ``task``
  optional, or a legacy form such as ``/cpu:0`` or ``/job:J/replica:R/task:T/gpu:0``);
* ``src_incarnation`` is the producing device's incarnation, a 64-bit number
  written as 16 lowercase hex digits (parsed case-insensitively, 1 to 16 digits);
* ``name`` is the edge name: anything non-empty without ``;``;
* ``frame_id:iter_id`` locate the transfer in a loop (``0:0`` outside loops).

The tensor lives in the task of ``src_device`` (:attr:`Key.src_task`); a
legacy device with no job (``/cpu:0``) means "this process" (``None``).

Stricter than TensorFlow, so that every valid name formats back to itself:
numbers (replica, task, device id, frame and iteration ids) are plain ASCII
decimal without leading zeros; replica, task and device id must fit TF's
``int`` (below ``2**31``); an incarnation of more than 16 hex digits is
rejected rather than silently overflowed.

Every failure raises :class:`~rendezvous.errors.InvalidKey`, whose ``field``
names the part that is wrong and whose message quotes the offending text.
"""

from __future__ import annotations

import functools
import operator
import re
import secrets
from dataclasses import dataclass

from .errors import Aborted, FailedPrecondition, InvalidKey

__all__ = [
    "TaskName",
    "DeviceName",
    "Key",
    "parse_key",
    "format_key",
    "make_key",
    "as_key",
    "OwnKeys",
    "new_incarnation",
    "MAX_INCARNATION",
    "MAX_FRAME_ID",
    "MAX_ITER_ID",
    "MAX_DEVICE_INT",
]

MAX_INCARNATION: int = (1 << 64) - 1
"""Largest incarnation (a uint64)."""
MAX_FRAME_ID: int = (1 << 64) - 1
"""Largest frame id (a uint64 in TensorFlow)."""
MAX_ITER_ID: int = (1 << 63) - 1
"""Largest iteration id (an int64 in TensorFlow)."""
MAX_DEVICE_INT: int = (1 << 31) - 1
"""Largest replica, task or device id (an ``int`` in TensorFlow)."""

MAX_KEY_LENGTH: int = 16384
"""Longest key accepted (characters). TensorFlow's keys are a few hundred
characters; a longer one is refused, so that nobody can make a server hold
megabytes per key."""

_CACHE_SIZE = 4096
# Only keys (and devices) up to this long are cached, so each cache holds at
# most _CACHE_SIZE * _CACHEABLE characters, whatever callers send.
_CACHEABLE = 1024
_QUOTE_LIMIT = 200  # characters of offending text quoted in a message

_IDENT_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_UINT_RE = re.compile(r"0|[1-9][0-9]*")
_HEX_RE = re.compile(r"[0-9A-Fa-f]{1,16}")
# Words that name a component; never taken as a legacy device type.
_RESERVED = frozenset({"job", "replica", "task", "device"})


def _q(text: object) -> str:
    """``repr`` of ``text``, shortened when it is very long."""
    if isinstance(text, str) and len(text) > _QUOTE_LIMIT:
        return f"{text[:_QUOTE_LIMIT]!r}... ({len(text)} characters)"
    return repr(text)


def _uint(text: str, limit: int) -> int | None:
    """``text`` as a canonical decimal integer in ``[0, limit]``, else ``None``."""
    if len(text) > len(str(limit)) or _UINT_RE.fullmatch(text) is None:
        return None
    value = int(text)
    return value if value <= limit else None


def _uint_error(what: str, text: str, limit: int, *, has: bool = False) -> str:
    """Says that ``text`` (the ``what``) is not a decimal integer in ``[0, limit]``."""
    verb = "has {} {}, which is not" if has else "{} {} is not"
    return (verb.format(what, _q(text)) + f" a decimal integer in [0, {limit}] "
            f"(ASCII digits, no sign or leading zeros)")


# -- task names -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TaskName:
    """One task of a cluster: ``/job:J/replica:R/task:T``."""

    job: str
    replica: int
    task: int

    def __str__(self) -> str:
        return f"/job:{self.job}/replica:{self.replica}/task:{self.task}"

    @classmethod
    def parse(cls, s: str) -> TaskName:
        """Parse ``/job:J/replica:R/task:T`` or ``/job:J/task:T`` (replica 0).

        Raises :class:`InvalidKey` with ``field="task"`` for anything else.
        """
        if not isinstance(s, str):
            raise InvalidKey(f"invalid task name: expected a string, got {type(s).__name__}", field="task")
        parts = s.split("/")
        if len(parts) not in (3, 4) or parts[0] != "":
            raise InvalidKey(f"invalid task name: task {_q(s)} is not /job:J/replica:R/task:T or /job:J/task:T",
                             field="task")
        job_part, task_part = parts[1], parts[-1]
        replica_part = parts[2] if len(parts) == 4 else "replica:0"
        prefixes = (job_part[:4], replica_part[:8], task_part[:5])
        if prefixes != ("job:", "replica:", "task:"):
            raise InvalidKey(f"invalid task name: task {_q(s)} is not /job:J/replica:R/task:T or /job:J/task:T",
                             field="task")
        job = job_part[4:]
        if _IDENT_RE.fullmatch(job) is None:
            raise InvalidKey(f"invalid task name: job {_q(job)} in {_q(s)} must start with a letter "
                             f"and hold only letters, digits and '_'", field="task")
        replica = _uint(replica_part[8:], MAX_DEVICE_INT)
        if replica is None:
            raise InvalidKey(f"invalid task name: {_uint_error('replica', replica_part[8:], MAX_DEVICE_INT)} "
                             f"(in {_q(s)})", field="task")
        task = _uint(task_part[5:], MAX_DEVICE_INT)
        if task is None:
            raise InvalidKey(f"invalid task name: {_uint_error('task', task_part[5:], MAX_DEVICE_INT)} "
                             f"(in {_q(s)})", field="task")
        return cls(job, replica, task)


# -- device names ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceName:
    """A parsed device name: ``/job:J/replica:R/task:T/device:TYPE:ID``.

    ``job``, ``replica`` and ``task`` are ``None`` where the name leaves them
    out. ``legacy`` is true for names written without ``device:`` (``/cpu:0``),
    so that ``str()`` gives back exactly the text that was parsed.
    """

    job: str | None
    replica: int | None
    task: int | None
    type: str
    id: int
    legacy: bool

    @classmethod
    def parse(cls, s: str, field: str = "device") -> DeviceName:
        """Parse a device name; :class:`InvalidKey` (with ``field``) if it is not one."""
        if not isinstance(s, str):
            raise InvalidKey(f"invalid device name: {field} must be a string, got {type(s).__name__}",
                             field=field)
        parsed = _parse_device(s)
        if isinstance(parsed, str):
            raise InvalidKey(f"invalid device name: {field} {_q(s)} {parsed}", field=field)
        if cls is not DeviceName:  # a subclass gets an instance of itself
            return cls(parsed.job, parsed.replica, parsed.task, parsed.type, parsed.id, parsed.legacy)
        return parsed

    def __str__(self) -> str:
        out = []
        if self.job is not None:
            out.append(f"/job:{self.job}")
        if self.replica is not None:
            out.append(f"/replica:{self.replica}")
        if self.task is not None:
            out.append(f"/task:{self.task}")
        out.append(f"/{self.type}:{self.id}" if self.legacy else f"/device:{self.type}:{self.id}")
        return "".join(out)

    @property
    def task_name(self) -> TaskName | None:
        """The task this device belongs to; ``None`` if the name has no job."""
        if self.job is None:
            return None
        return TaskName(self.job,
                        0 if self.replica is None else self.replica,
                        0 if self.task is None else self.task)

    @property
    def is_gpu(self) -> bool:
        """Whether this is a GPU (the type compared case-insensitively)."""
        return self.type.upper() == "GPU"


def _parse_device(s: str) -> DeviceName | str:
    """:func:`_parse_device_uncached`, cached for names of ordinary length."""
    return _parse_device_cached(s) if len(s) <= _CACHEABLE else _parse_device_uncached(s)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _parse_device_cached(s: str) -> DeviceName | str:
    return _parse_device_uncached(s)


def _parse_device_uncached(s: str) -> DeviceName | str:
    """The :class:`DeviceName` for ``s``, or a phrase saying what is wrong with it.

    Cached on the string; returning (not raising) the reason lets invalid
    names be cached too, and lets each caller name its own field.
    """
    if not s:
        return "is empty"
    if s[0] != "/":
        return "must start with '/'"
    job: str | None = None
    replica: int | None = None
    task: int | None = None
    stage = 0  # components seen so far: 1 job, 2 replica, 3 task
    for comp in s[1:].split("/"):
        if stage == 4:
            return f"has {_q(comp)} after its device part (TYPE:ID must come last)"
        prefix, colon, value = comp.partition(":")
        if not colon:
            return f"has a component {_q(comp)} that is not NAME:VALUE"
        if prefix == "job":
            if stage >= 1:
                return f"has 'job' after {('job', 'replica', 'task')[stage - 1]!r} (components go job, replica, task, device; each once)"
            if _IDENT_RE.fullmatch(value) is None:
                return f"has job {_q(value)}, which must start with a letter and hold only letters, digits and '_'"
            job, stage = value, 1
        elif prefix == "replica":
            if stage >= 2:
                return f"has 'replica' after {('job', 'replica', 'task')[stage - 1]!r} (components go job, replica, task, device; each once)"
            replica = _uint(value, MAX_DEVICE_INT)
            if replica is None:
                return _uint_error("replica", value, MAX_DEVICE_INT, has=True)
            stage = 2
        elif prefix == "task":
            if stage >= 3:
                return "has 'task' twice (components go job, replica, task, device; each once)"
            task = _uint(value, MAX_DEVICE_INT)
            if task is None:
                return _uint_error("task", value, MAX_DEVICE_INT, has=True)
            stage = 3
        else:
            legacy = prefix != "device"
            if legacy:
                dev_type, dev_id = prefix, value
                if dev_type.lower() in _RESERVED:
                    return (f"has a component {_q(comp)} that is neither job, replica, task "
                            f"nor a device TYPE:ID")
            else:
                dev_type, colon, dev_id = value.partition(":")
                if not colon:
                    return f"has device {_q(value)}, which is not TYPE:ID"
            if _IDENT_RE.fullmatch(dev_type) is None:
                return (f"has device type {_q(dev_type)}, which must start with a letter "
                        f"and hold only letters, digits and '_'")
            parsed_id = _uint(dev_id, MAX_DEVICE_INT)
            if parsed_id is None:
                return _uint_error("device id", dev_id, MAX_DEVICE_INT, has=True)
            stage = 4
    if stage != 4 or parsed_id is None:  # (stage 4 has its id)
        return "has no device part (/device:TYPE:ID, or a legacy /TYPE:ID such as /cpu:0)"
    return DeviceName(job, replica, task, dev_type, parsed_id, legacy)


def _device(s: object, field: str) -> DeviceName:
    """The parsed device of a key's ``field``, or :class:`InvalidKey` naming it."""
    if not isinstance(s, str):
        raise InvalidKey(f"invalid rendezvous key: {field} must be a string, got {type(s).__name__}",
                         field=field)
    parsed = _parse_device(s)
    if isinstance(parsed, str):
        raise InvalidKey(f"invalid rendezvous key: {field} {_q(s)} {parsed}", field=field)
    return parsed


def _as_int(value: object) -> int | None:
    """``value`` as an int if it is an integer (numpy ones too) but not a bool."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


# -- keys -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Key:
    """A validated rendezvous key; equal keys have equal :meth:`format`."""

    src_device: str
    src_incarnation: int
    dst_device: str
    name: str
    frame_id: int = 0
    iter_id: int = 0

    def __post_init__(self) -> None:
        _device(self.src_device, "src_device")
        incarnation = _as_int(self.src_incarnation)
        if incarnation is None or not 0 <= incarnation <= MAX_INCARNATION:
            raise InvalidKey(f"invalid rendezvous key: src_incarnation {_q(self.src_incarnation)} "
                             f"is not an integer in [0, 2**64)", field="src_incarnation")
        _device(self.dst_device, "dst_device")
        if not isinstance(self.name, str):
            raise InvalidKey(f"invalid rendezvous key: name must be a string, got {type(self.name).__name__}",
                             field="name")
        if not self.name:
            raise InvalidKey("invalid rendezvous key: name '' is empty", field="name")
        if ";" in self.name:
            raise InvalidKey(f"invalid rendezvous key: name {_q(self.name)} contains ';'", field="name")
        frame_id, iter_id = _as_int(self.frame_id), _as_int(self.iter_id)
        if frame_id is None or not 0 <= frame_id <= MAX_FRAME_ID:
            raise InvalidKey(f"invalid rendezvous key: frame_id {_q(self.frame_id)} "
                             f"is not an integer in [0, 2**64)", field="frame_iter")
        if iter_id is None or not 0 <= iter_id <= MAX_ITER_ID:
            raise InvalidKey(f"invalid rendezvous key: iter_id {_q(self.iter_id)} "
                             f"is not an integer in [0, 2**63)", field="frame_iter")
        # Normalise integer-likes (numpy scalars, int subclasses) to plain int.
        if type(self.src_incarnation) is not int:
            object.__setattr__(self, "src_incarnation", int(incarnation))
        if type(self.frame_id) is not int:
            object.__setattr__(self, "frame_id", int(frame_id))
        if type(self.iter_id) is not int:
            object.__setattr__(self, "iter_id", int(iter_id))

    @classmethod
    def parse(cls, s: str) -> Key:
        """Parse ``src_device;src_incarnation;dst_device;name;frame_id:iter_id``.

        Not cached; :func:`parse_key` is the cached form.
        """
        if not isinstance(s, str):
            raise InvalidKey(f"invalid rendezvous key: expected a string, got {type(s).__name__}", field="key")
        if len(s) > MAX_KEY_LENGTH:
            raise InvalidKey(f"invalid rendezvous key: {len(s)} characters, more than the {MAX_KEY_LENGTH} "
                             f"allowed: {_q(s)}", field="key")
        parts = s.split(";")
        if len(parts) != 5:
            raise InvalidKey(f"invalid rendezvous key: expected 5 ';'-separated fields "
                             f"(src_device;src_incarnation;dst_device;name;frame_id:iter_id), "
                             f"got {len(parts)} in {_q(s)}", field="key")
        src, inc, dst, name, frame_iter = parts
        try:
            _device(src, "src_device")
            if _HEX_RE.fullmatch(inc) is None:
                if not inc:
                    why = "is empty"
                elif len(inc) > 16 and all(c in "0123456789abcdefABCDEF" for c in inc):
                    why = f"has {len(inc)} hex digits, more than 16 (it must fit 64 bits)"
                else:
                    why = "is not hexadecimal"
                raise InvalidKey(f"invalid rendezvous key: src_incarnation {_q(inc)} {why}",
                                 field="src_incarnation")
            _device(dst, "dst_device")
            if not name:
                raise InvalidKey("invalid rendezvous key: name '' is empty", field="name")
            frame_text, colon, iter_text = frame_iter.partition(":")
            if not colon:
                raise InvalidKey(f"invalid rendezvous key: frame_iter {_q(frame_iter)} is not frame_id:iter_id",
                                 field="frame_iter")
            frame_id = _uint(frame_text, MAX_FRAME_ID)
            if frame_id is None:
                raise InvalidKey("invalid rendezvous key: frame_iter "
                                 + _uint_error("frame_id", frame_text, MAX_FRAME_ID, has=True), field="frame_iter")
            iter_id = _uint(iter_text, MAX_ITER_ID)
            if iter_id is None:
                raise InvalidKey("invalid rendezvous key: frame_iter "
                                 + _uint_error("iter_id", iter_text, MAX_ITER_ID, has=True), field="frame_iter")
            return cls(src, int(inc, 16), dst, name, frame_id, iter_id)
        except InvalidKey as exc:
            raise InvalidKey(f"{exc.message} (in {_q(s)})", field=exc.field) from None

    def format(self) -> str:
        """The canonical string: the incarnation as 16 lowercase hex digits."""
        return (f"{self.src_device};{self.src_incarnation:016x};{self.dst_device};"
                f"{self.name};{self.frame_id}:{self.iter_id}")

    __str__ = format

    @property
    def src(self) -> DeviceName:
        """The parsed source device."""
        return _device(self.src_device, "src_device")

    @property
    def dst(self) -> DeviceName:
        """The parsed destination device."""
        return _device(self.dst_device, "dst_device")

    @property
    def src_task(self) -> TaskName | None:
        """Where the tensor lives: the source device's task (``None``: this process)."""
        return self.src.task_name

    @property
    def dst_task(self) -> TaskName | None:
        """The task that receives the tensor (``None``: this process)."""
        return self.dst.task_name


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _parse_key_cached(s: str) -> Key:
    return Key.parse(s)


def parse_key(s: str) -> Key:
    """:meth:`Key.parse`, cached on the string (keys repeat every step)."""
    if not isinstance(s, str):  # also keeps unhashable values away from the cache
        raise InvalidKey(f"invalid rendezvous key: expected a string, got {type(s).__name__}", field="key")
    if len(s) > _CACHEABLE:
        return Key.parse(s)  # long keys are rare: not worth their room in the cache
    return _parse_key_cached(s)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _canonical_cached(s: str) -> str:
    return _parse_key_cached(s).format()


def canonical_key(key: Key | str) -> str:
    """The canonical string of ``key`` (a :class:`Key` or a key string), cached
    on the string like :func:`parse_key`: a step asks for the same keys again."""
    if type(key) is str and len(key) <= _CACHEABLE:
        return _canonical_cached(key)
    return as_key(key).format()


class OwnKeys:
    """The canonical form of each key string given before, checked once as a
    key ``task`` produces (``task`` None: any task's): a step sends and asks
    for the same keys again. At most ``limit`` strings of at most
    ``max_chars`` characters are remembered, all forgotten at once when full
    (keys of old steps do not come again). A key of another task is
    FAILED_PRECONDITION, saying ``refusal`` (a format of ``key``, ``src`` and
    ``task``), and is never remembered. With ``incarnation`` (not 0), a key
    naming another incarnation of ``task`` than 0 or this one is ABORTED: it was
    made for a server of ``task`` that is gone (TensorFlow's "worker job was
    probably restarted")."""

    __slots__ = ("task", "refusal", "limit", "max_chars", "known", "incarnation")

    def __init__(self, task: TaskName | None, refusal: str, limit: int = 1 << 13,
                 max_chars: int = _CACHEABLE, incarnation: int = 0) -> None:
        self.task = task
        self.refusal = refusal
        self.limit = limit
        self.max_chars = max_chars
        self.incarnation = incarnation
        #: key string -> its canonical form, checked already
        self.known: dict[str, str] = {}

    def canonical(self, key: Key | str) -> str:
        """The canonical form of ``key``, or InvalidKey, or FailedPrecondition."""
        if type(key) is str:
            known = self.known.get(key)
            if known is not None:
                return known
        k = as_key(key)
        src = k.src_task
        canonical = k.format()
        if src is not None and self.task is not None and src != self.task:
            raise FailedPrecondition(self.refusal.format(key=canonical, src=src, task=self.task))
        stale = k.src_incarnation
        if stale and self.incarnation and stale != self.incarnation:
            raise Aborted(f"key {canonical!r} names incarnation {stale:#x} of {self.task}, whose server is now "
                          f"incarnation {self.incarnation:#x}: its producer was restarted (or the key was made for "
                          f"another run); make keys with the producer's current incarnation "
                          f"(Server.incarnation_of) or 0")
        if type(key) is str and len(key) <= self.max_chars:
            if len(self.known) >= self.limit:
                self.known.clear()
            self.known[key] = canonical
        return canonical


def format_key(key: Key) -> str:
    """``key.format()``: the canonical string of ``key``."""
    return key.format()


def make_key(src_device: str | DeviceName, dst_device: str | DeviceName, name: str, *,
             incarnation: int = 0, frame_id: int = 0, iter_id: int = 0) -> Key:
    """A key for ``name`` sent from ``src_device`` to ``dst_device`` (TF's ``Rendezvous::CreateKey``)."""
    return Key(str(src_device) if isinstance(src_device, DeviceName) else src_device,
               incarnation,
               str(dst_device) if isinstance(dst_device, DeviceName) else dst_device,
               name, frame_id, iter_id)


def new_incarnation() -> int:
    """A random incarnation for a server that starts (never 0: 0 means "any")."""
    return secrets.randbits(64) or 1


def as_key(key: Key | str) -> Key:
    """``key`` itself if it is a :class:`Key`, else :func:`parse_key` of it."""
    return key if isinstance(key, Key) else parse_key(key)
