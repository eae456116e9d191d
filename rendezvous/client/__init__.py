"""Local clients of a node's rendezvousd: :class:`Client` (blocking) and
:class:`rendezvous.client.aio.Client` (asyncio)."""

from rendezvous.local.messages import LocalPending, PendingList

from .blocking import Client

__all__ = ["Client", "LocalPending", "PendingList"]
