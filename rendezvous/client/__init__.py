"""The local client of a node's rendezvousd: :class:`Client` (blocking,
:mod:`.local`) and ``rendezvous.client.aio.Client`` (asyncio). It speaks the
local service (``protos/rendezvous/v1/local.proto``) and needs no MPI."""

from .local import Client, LocalPending

__all__ = ["Client", "LocalPending"]
