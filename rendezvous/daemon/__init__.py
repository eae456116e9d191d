"""rendezvousd, the node daemon: :mod:`.daemon` (lifecycle, health, stalls,
the socket, the command's ``run``), :mod:`.service` (the local service the
node's training processes call) and :mod:`.metrics` (Prometheus). It is built
on :class:`rendezvous.aio.Server`; nothing below it imports this package."""
