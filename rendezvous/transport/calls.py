"""The request path's contract: one RecvTensorStream as the consumer and the
producer see it, whatever carries it (a gRPC call, MPI messages).

:class:`RequestCall` is the consumer's end (the peer client writes requests,
reads reply frames, cancels); :class:`StreamContext` is the producer's end
(the stream handler writes frames and ends the stream with an error). Both
speak this package's errors: a stream that ends with a status other than OK
raises :class:`CallEnded` holding the :class:`~rendezvous.errors.RendezvousError`
of that status; a clean end reads as :data:`EOF`. The gRPC implementations
are in ``rendezvous.rpc.grpc_calls``, the MPI ones in ``rendezvous.mpi.control``.

What an implementation can do beyond the basics is an attribute that is
None (or False) when it cannot: a call that takes messages without waiting
(``write_nowait``), hands replies to the reader as they arrive
(``deliver_to``), or wants to know which recvs wait (``watch``); a context
that joins a frame's pieces itself (``gathers``). The base classes give
those defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import Any, NoReturn, Protocol

from rendezvous.errors import RendezvousError
from rendezvous.paths import Path

__all__ = ["EOF", "CallEnded", "RequestCall", "StreamContext", "CallBase", "ContextBase"]


class _Eof:
    def __repr__(self) -> str:
        return "EOF"


#: what ``read`` returns once the stream ended cleanly
EOF: Any = _Eof()


class CallEnded(Exception):
    """The stream ended with a status other than OK: ``error`` is what that
    status means (UNAVAILABLE, CANCELLED and INTERNAL from the transport
    itself: the peer or the stream is gone)."""

    def __init__(self, error: RendezvousError) -> None:
        super().__init__(str(error))
        self.error = error


class RequestCall(Protocol):
    """The consumer's end of one stream."""

    #: the path of a reply carried inside this stream's messages
    inline_path: Path
    #: write a message if that needs no waiting: True once handed over, False
    #: (nothing done) when ``write`` must do it; None: every write may wait
    write_nowait: Callable[[bytes], bool] | None
    #: ``deliver_to(dispatch)``: ``dispatch(message)`` is offered each message
    #: as it arrives, while none waits for ``read``; False leaves it to ``read``
    deliver_to: Callable[[Callable[[Any], bool]], None] | None
    #: ``watch(awaited)``: the recvs awaiting replies on this stream
    watch: Callable[[Sized], None] | None

    async def write(self, message: bytes) -> None: ...

    async def read(self) -> Any:
        """The next message, :data:`EOF` after a clean end; raises :class:`CallEnded`."""

    def cancel(self) -> Any:
        """End the stream from this side: the producer puts back what it has not sent."""


class StreamContext(Protocol):
    """The producer's end of one stream."""

    #: the path of a reply carried inside this stream's frames
    inline_path: Path
    #: whether ``write`` takes a frame as its pieces (and joins them itself)
    gathers: bool
    #: write a frame without waiting (after ``has_room``); None: writes may wait
    write_nowait: Callable[[Any], None] | None
    #: ``deliver_to(take, taken)``: requests offered as they arrive (see the MPI path)
    deliver_to: Callable[[Callable[[Any], bool], Callable[[], None]], None] | None

    async def write(self, message: Any) -> None: ...

    def has_room(self) -> bool:
        """Whether ``write`` would return at once now."""

    async def abort(self, error: RendezvousError) -> NoReturn:
        """End the stream with ``error``'s status; never returns."""


class CallBase:
    """Defaults of a :class:`RequestCall` that only reads, writes and cancels."""

    inline_path = Path.GRPC
    write_nowait: Callable[[bytes], bool] | None = None
    deliver_to: Callable[[Callable[[Any], bool]], None] | None = None
    watch: Callable[[Sized], None] | None = None


class ContextBase:
    """Defaults of a :class:`StreamContext` that only writes and aborts."""

    inline_path = Path.GRPC
    gathers = False
    write_nowait: Callable[[Any], None] | None = None
    deliver_to: Callable[[Callable[[Any], bool], Callable[[], None]], None] | None = None

    def has_room(self) -> bool:
        return True
