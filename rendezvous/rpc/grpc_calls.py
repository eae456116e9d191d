"""A gRPC stream as the request path's contract (:mod:`rendezvous.transport.calls`):
the consumer's call and the producer's context. gRPC's status codes and
errors are turned into this package's here, and nowhere else on the stream's
path."""

from __future__ import annotations

from typing import Any, NoReturn

import grpc

from rendezvous.errors import Internal, RendezvousError, from_status
from rendezvous.transport.calls import EOF, CallBase, CallEnded, ContextBase

__all__ = ["GrpcCall", "GrpcContext"]


class GrpcCall(CallBase):
    """The consumer's end of a RecvTensorStream call (``grpc.aio`` stream-stream)."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self.write = call.write
        self.cancel = call.cancel

    async def read(self) -> Any:
        try:
            message = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise CallEnded(from_status(exc.code(), exc.details() or "")) from None
        return EOF if message is grpc.aio.EOF else message


class GrpcContext(ContextBase):
    """The producer's end of a RecvTensorStream call (a ``grpc.aio`` servicer context)."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self.write = context.write

    async def abort(self, error: RendezvousError) -> NoReturn:
        code = error.code if isinstance(error, RendezvousError) else Internal.code
        await self._context.abort(code, error.message)
        raise AssertionError("grpc's abort returned")  # it raises: never reached
