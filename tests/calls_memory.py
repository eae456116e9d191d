"""The request path's contract (rendezvous.transport.calls) over asyncio queues
in one process: a third implementation beside gRPC and MPI, for the
conformance suite (tests/test_request_paths.py).

``MemoryCall(servicer)`` opens a stream to ``servicer``: what the call writes
reaches the servicer's stream handler as its requests, what the handler
writes comes back to ``read``. A cancel ends the handler as gRPC does (its
task is cancelled: replies not written go back to the table)."""

from __future__ import annotations

import asyncio
from typing import Any, NoReturn

from rendezvous.errors import Cancelled, Internal, RendezvousError
from rendezvous.transport.calls import EOF, CallBase, CallEnded, ContextBase


class _Ended(Exception):
    """Ends the handler after its abort (as gRPC's abort raises)."""


class MemoryContext(ContextBase):
    def __init__(self, call: "MemoryCall") -> None:
        self._call = call

    async def write(self, message: Any) -> None:
        self._call._reply(bytes(message))

    async def abort(self, error: RendezvousError) -> NoReturn:
        self._call._end(CallEnded(error))
        raise _Ended()


class MemoryCall(CallBase):
    def __init__(self, servicer: Any) -> None:
        self._requests: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._replies: asyncio.Queue[Any] = asyncio.Queue()
        self.ended = False
        self.context = MemoryContext(self)
        self.handler = asyncio.ensure_future(self._serve(servicer))

    async def _serve(self, servicer: Any) -> None:
        try:
            await servicer.serve_stream(self._incoming(), self.context)
        except _Ended:
            pass
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the handler failed: the stream ends with INTERNAL
            self._end(CallEnded(Internal(f"{type(exc).__name__}: {exc}")))
        self._end(EOF)

    async def _incoming(self):
        while (message := await self._requests.get()) is not None:
            yield message

    def _reply(self, message: bytes) -> None:
        if not self.ended:
            self._replies.put_nowait(message)

    def _end(self, how: Any) -> None:
        if not self.ended:
            self.ended = True
            self._replies.put_nowait(how)

    async def write(self, message: bytes) -> None:
        if self.ended:
            raise CallEnded(Cancelled("stream closed"))
        self._requests.put_nowait(bytes(message))

    async def read(self) -> Any:
        item = await self._replies.get()
        if isinstance(item, CallEnded):
            self._replies.put_nowait(item)  # every later read ends the same way
            raise item
        if item is EOF:
            self._replies.put_nowait(item)
        return item

    def cancel(self) -> None:
        self._end(CallEnded(Cancelled("stream closed locally")))
        self.handler.cancel()
