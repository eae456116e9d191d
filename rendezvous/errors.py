"""The error hierarchy, and its one mapping to and from gRPC status codes.

Every failure a caller can see is a :class:`RendezvousError` carrying a
:class:`grpc.StatusCode`. Servers turn these into statuses with
:func:`to_status`; clients turn statuses back into the same classes with
:func:`from_status`, so a consumer catches ``Aborted`` whether the step was
aborted locally or on the producing rank. A local cancellation stays
:class:`asyncio.CancelledError` and is never wrapped.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

__all__ = [
    "RendezvousError",
    "InvalidArgument",
    "AlreadyExists",
    "InvalidKey",
    "UnsupportedDType",
    "Aborted",
    "DeadlineExceeded",
    "Unavailable",
    "PeerUnavailable",
    "NotFound",
    "UnknownTask",
    "FailedPrecondition",
    "ResourceExhausted",
    "NotPlaced",
    "Unauthenticated",
    "Internal",
    "Cancelled",
    "from_status",
    "batch_failure",
    "to_status",
]


class RendezvousError(Exception):
    """Base of every error this package raises for a failed transfer."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[type[RendezvousError], tuple[str, ...]]:  # pickling (multiprocessing)
        return (self.__class__, (self.message,))

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.message == other.message

    def __hash__(self) -> int:
        return hash((type(self), self.message))


class InvalidArgument(RendezvousError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class InvalidKey(InvalidArgument):
    """A rendezvous key (or one of its device names) does not parse.

    ``field`` names the part that is wrong: ``"key"`` for the overall shape,
    else ``src_device``, ``src_incarnation``, ``dst_device``, ``name`` or
    ``frame_iter``.
    """

    def __init__(self, message: str = "", field: str = "key") -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[type[RendezvousError], tuple[str, ...]]:
        return (self.__class__, (self.message, self.field))


class UnsupportedDType(InvalidArgument):
    """A tensor's dtype has no TensorFlow DataType this package can carry."""


class Aborted(RendezvousError):
    """The step was aborted (or cleaned up); the message is the abort's."""

    code = grpc.StatusCode.ABORTED


class DeadlineExceeded(RendezvousError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(RendezvousError):
    """The server is draining or stopped, or a peer cannot be reached."""

    code = grpc.StatusCode.UNAVAILABLE


class PeerUnavailable(Unavailable):
    """The peer rank is unreachable or its connection broke mid-transfer."""


class NotFound(RendezvousError):
    code = grpc.StatusCode.NOT_FOUND


class UnknownTask(NotFound):
    """The key's source task is not in the cluster."""


class FailedPrecondition(RendezvousError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class AlreadyExists(RendezvousError):
    """Something claimed twice: a rank joining a bootstrap that another process joined as."""

    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(RendezvousError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotPlaced(ResourceExhausted):
    """The tensor arrived but could not be put where the recv wanted it (device
    memory full). ``value`` is the tensor as it arrived (on the host), which the
    server keeps for the next recv of the same key and step: nothing fetched is
    lost; the recv fails with this error, a ResourceExhausted."""

    def __init__(self, message: str, value: object) -> None:
        super().__init__(message)
        self.value = value


class Unauthenticated(RendezvousError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Internal(RendezvousError):
    code = grpc.StatusCode.INTERNAL


class Cancelled(RendezvousError):
    """The remote side cancelled the call (a local cancel stays CancelledError)."""

    code = grpc.StatusCode.CANCELLED


# The most general class for each code; subclasses never appear here, so a
# status always comes back as the base class of its code.
_BY_CODE: dict[grpc.StatusCode, type[RendezvousError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        Aborted,
        DeadlineExceeded,
        Unavailable,
        NotFound,
        FailedPrecondition,
        AlreadyExists,
        ResourceExhausted,
        Unauthenticated,
        Internal,
        Cancelled,
    )
}
_BY_VALUE: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def status_code_from_int(value: int) -> grpc.StatusCode:
    """The StatusCode for its integer value (UNKNOWN for values gRPC lacks)."""
    return _BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


def from_status(code: grpc.StatusCode | int, message: str) -> RendezvousError:
    """The error a caller sees for a failed call with this status."""
    if isinstance(code, int):
        code = status_code_from_int(code)
    cls = _BY_CODE.get(code)
    if cls is None:
        err = RendezvousError(message)
        err.code = code
        return err
    return cls(message)


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a server answers with for an exception raised while serving."""
    if isinstance(exc, RendezvousError):
        return exc.code, exc.message
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def batch_failure(keys: list[str], step_id: int, failures: Mapping[int, BaseException]) -> BaseException:
    """One error for a recv_many that failed: the status of its first failure
    (by position), a message naming each failed key and why, and
    ``failures`` (key -> error) for programs."""
    first = failures[min(failures)]
    if not isinstance(first, RendezvousError):
        return first  # not a transfer's failure (a bug): as it is
    shown = "; ".join(f"{keys[i]}: {getattr(e, 'code', grpc.StatusCode.UNKNOWN).name}: {e}"
                      for i, e in sorted(failures.items())[:5])
    more = f"; and {len(failures) - 5} more" if len(failures) > 5 else ""
    error = from_status(first.code, f"recv_many of {len(keys)} keys (step {step_id}): {len(failures)} failed "
                                    f"({shown}{more}); nothing of the batch was taken: what had arrived is kept "
                                    "for the next recv of its key")
    error.failures = {keys[i]: e for i, e in sorted(failures.items())}  # type: ignore[attr-defined]
    return error
