"""Clients: ``peer`` (a rank's client of another rank), and the local client
of a node's rendezvousd: :class:`Client` (blocking, :mod:`.local`) and
``rendezvous.client.aio.Client`` (asyncio)."""

from typing import Any

__all__ = ["Client", "LocalPending"]


def __getattr__(name: str) -> Any:
    # Imported on first use: rank servers import this package for the peer client only.
    if name in __all__:
        from . import local

        return getattr(local, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
