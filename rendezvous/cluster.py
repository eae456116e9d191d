"""Cluster specs: which task serves at which address.

A cluster is TensorFlow's shape: ``{"worker": ["host:port", ...], "ps": [...]}``
(a job may also map task indices to addresses: ``{"ps": {"0": "host:port"}}``),
given as a dict, a :class:`ClusterSpec`, or the path of a JSON file holding one.
A task may be written ``{"address": "host:port", "incarnation": N}`` to publish
its incarnation too (a number below 2**64, or a ``0x`` hex string): that task's
server takes it as its own, and its consumers put it in their keys (see
``Server.incarnation_of``).
An address with port 0 means "let the OS choose" for the local task; the
chosen port is published to peers by :meth:`ClusterSpec.with_address` (the MPI
world does this with an allgather).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from .errors import InvalidArgument, UnknownTask
from .keys import TaskName

__all__ = ["ClusterSpec", "ClusterLike", "parse_address"]

_JOB_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
_ADDR_RE = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:\[\]]+):(?P<port>\d{1,5})\Z")


def parse_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6); InvalidArgument if malformed."""
    m = _ADDR_RE.match(address) if isinstance(address, str) else None
    if m is None or int(m.group("port")) > 65535:
        raise InvalidArgument(f"address {address!r} is not host:port")
    return m.group("host"), int(m.group("port"))


@dataclass(frozen=True)
class ClusterSpec:
    """An immutable map of job name -> task index -> ``host:port``, and the
    incarnations known of its tasks."""

    jobs: Mapping[str, Mapping[int, str]]
    incarnations: Mapping[TaskName, int] = field(default_factory=dict)

    @classmethod
    def from_any(cls, spec: "ClusterLike") -> "ClusterSpec":
        if isinstance(spec, ClusterSpec):
            return spec
        if isinstance(spec, (str, os.PathLike)):
            path = Path(spec)
            try:
                text = path.read_text()
            except OSError as exc:
                raise InvalidArgument(f"cannot read cluster file {str(path)!r}: {exc}") from exc
            try:
                data = json.loads(text)
            except ValueError as exc:
                raise InvalidArgument(f"cluster file {str(path)!r} is not JSON: {exc}") from exc
            # Accept a TF_CONFIG-like wrapper too: {"cluster": {...}}.
            if isinstance(data, dict) and isinstance(data.get("cluster"), dict):
                data = data["cluster"]
            return cls.from_any(data)
        if not isinstance(spec, Mapping):
            raise InvalidArgument(f"a cluster is a mapping of job name to addresses, not {type(spec).__name__}")
        jobs: dict[str, dict[int, str]] = {}
        incarnations: dict[TaskName, int] = {}
        seen: dict[str, str] = {}
        for job, tasks in spec.items():
            if not isinstance(job, str) or not _JOB_RE.match(job):
                raise InvalidArgument(f"cluster job name {job!r} must start with a letter and hold only letters, digits and '_'")
            if isinstance(tasks, Mapping):
                items = []
                for idx, addr in tasks.items():
                    try:
                        items.append((int(idx), addr))
                    except (TypeError, ValueError):
                        raise InvalidArgument(f"job {job!r}: task index {idx!r} is not an integer") from None
            elif isinstance(tasks, (list, tuple)):
                items = list(enumerate(tasks))
            else:
                raise InvalidArgument(f"job {job!r}: expected a list of addresses or a map of index to address")
            table: dict[int, str] = {}
            for idx, addr in items:
                if idx < 0:
                    raise InvalidArgument(f"job {job!r}: negative task index {idx}")
                if isinstance(addr, Mapping):
                    addr, incarnation = _entry(job, idx, addr)
                    if incarnation:
                        incarnations[TaskName(job, 0, idx)] = incarnation
                _, port = parse_address(addr)
                if port != 0:
                    other = seen.get(addr)
                    if other is not None:
                        raise InvalidArgument(f"address {addr} is given to both {other} and /job:{job}/task:{idx}")
                    seen[addr] = f"/job:{job}/task:{idx}"
                table[idx] = addr
            jobs[job] = table
        return cls(jobs, incarnations)

    def address(self, task: TaskName) -> str:
        """The address serving ``task``; UnknownTask if the cluster lacks it."""
        try:
            return self.jobs[task.job][task.task]
        except KeyError:
            raise UnknownTask(f"task {task} is not in the cluster (jobs: {self.describe()})") from None

    def __contains__(self, task: object) -> bool:
        return isinstance(task, TaskName) and task.task in self.jobs.get(task.job, {})

    def tasks(self) -> Iterator[TaskName]:
        """Every task, in job-name then index order (the order ranks are assigned)."""
        for job in sorted(self.jobs):
            for idx in sorted(self.jobs[job]):
                yield TaskName(job, 0, idx)

    def incarnation(self, task: TaskName) -> int:
        """The incarnation published for ``task``; 0: none known."""
        return self.incarnations.get(task, 0)

    def with_address(self, task: TaskName, address: str, incarnation: int | None = None) -> "ClusterSpec":
        """This cluster with ``task`` at ``address`` (and, unless None, of ``incarnation``)."""
        parse_address(address)
        jobs = {j: dict(t) for j, t in self.jobs.items()}
        jobs.setdefault(task.job, {})[task.task] = address
        incarnations = dict(self.incarnations)
        if incarnation is not None:
            incarnations[task] = _incarnation(incarnation, task)
        return ClusterSpec(jobs, incarnations)

    def as_dict(self) -> dict[str, list[Any] | dict[str, Any]]:
        """The JSON form (a task whose incarnation is known as ``{"address", "incarnation"}``)."""
        out: dict[str, Any] = {}
        for job, tasks in self.jobs.items():
            entries = {}
            for i, addr in tasks.items():
                inc = self.incarnations.get(TaskName(job, 0, i), 0)
                entries[i] = {"address": addr, "incarnation": inc} if inc else addr
            idx = sorted(entries)
            out[job] = [entries[i] for i in idx] if idx == list(range(len(idx))) else {str(i): entries[i] for i in idx}
        return out

    def describe(self) -> str:
        return ", ".join(f"{j}[{len(t)}]" for j, t in sorted(self.jobs.items())) or "none"


def _incarnation(value: Any, task: Any) -> int:
    try:
        number = int(value, 0) if isinstance(value, str) else value
    except ValueError:
        number = None
    if type(number) is not int or not 0 <= number < 1 << 64:
        raise InvalidArgument(f"{task}: incarnation {value!r} is not a number in [0, 2**64)")
    return number


def _entry(job: str, idx: int, entry: Mapping[str, Any]) -> tuple[Any, int]:
    """``{"address": ..., "incarnation": ...}``: the address and the incarnation (0: none)."""
    unknown = set(entry) - {"address", "incarnation"}
    if "address" not in entry or unknown:
        raise InvalidArgument(f"/job:{job}/task:{idx}: a task is \"host:port\" or {{\"address\": \"host:port\", "
                              f"\"incarnation\": N}}, not {dict(entry)!r}")
    return entry["address"], _incarnation(entry.get("incarnation", 0), f"/job:{job}/task:{idx}")


ClusterLike = Union[ClusterSpec, Mapping[str, Any], str, "os.PathLike[str]"]
