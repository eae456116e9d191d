"""The rank server: one per rank of a job.

:mod:`rendezvous.rank.server` is the server itself, on an asyncio loop (the
public name is :class:`rendezvous.aio.Server`); :mod:`rendezvous.rank.blocking`
drives it from a loop thread of its own for plain scripts
(:class:`rendezvous.Server`); :mod:`rendezvous.rank.launch` starts ranks as
local processes and reads a launcher's rank.
"""
