"""One session socket on an asyncio loop: :class:`Connection`.

The daemon's side of every session and the asyncio client's side of its
own are a ``Connection``: frames in (handed to the owner in arrival order,
with the descriptors that came with them), frames out (coalesced per loop
turn, descriptors attached), bounded in everything a peer can make it hold.

One class of about 300 lines: reading, writing and closing share its
bounds (the write backlog, descriptors queued, frames read and not yet
handed over), and split apart they would have to reach into each other.
"""

from __future__ import annotations

import array
import asyncio
import collections
import logging
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .frames import MAX_FDS, READ_BYTES, FrameError, FrameReader, close_fds, take_fds

__all__ = ["Connection"]

log = logging.getLogger("rendezvous")

#: frames handed to the owner in one loop turn, at most; the rest wait for the next
_TURN_FRAMES = 256
#: bytes gathered into one write at most (a Unix socket takes a few hundred KiB at once)
_GATHER_BYTES = 512 << 10


def _ignore(*_: Any) -> None:
    pass


class Connection:
    """One stream socket on an asyncio loop: frames in (``on_frames(frames, fds)``,
    called with frames in arrival order and the descriptors that came with
    them), frames out (:meth:`write`, coalesced per loop turn, descriptors
    attached), ``on_close(error or None)`` once when the socket ends.

    What a peer can make this side hold is bounded:

    * a frame's body by ``limit`` (``limits`` by kind; see :class:`FrameReader`);
    * replies it does not read: above ``high_water`` bytes, or ``max_fds``
      descriptors, waiting to go out, no more frames are taken from it (those
      already read wait, unhandled) and its socket is not read, until half of
      that has gone out;
    * the work one burst starts: at most a few hundred frames are handed over
      per loop turn, ``group`` at a time with the backlog checked in between,
      and nothing more is read while frames wait.

    Closing drops everything held for the peer at once (buffers, queued
    frames, the owner's callbacks): nothing waits for the garbage collector.
    What was written and had not all gone out when the connection closed is
    told to whoever asked (:meth:`on_unsent`): an answer that carries tensors
    gives them back."""

    def __init__(self, sock: socket.socket, *, limit: int,
                 on_frames: Callable[[list[tuple[int, int, memoryview]], list[int]], None],
                 on_close: Callable[[BaseException | None], None], fds: bool = False,
                 high_water: int = 64 << 20, max_fds: int = 64, limits: Mapping[int, int] | None = None,
                 group: int = _TURN_FRAMES, farewell: Callable[[FrameError], bytes] | None = None) -> None:
        self.sock = sock
        sock.setblocking(False)
        self.loop = asyncio.get_running_loop()
        self.reader = FrameReader(limit, limits)
        self._on_frames = on_frames
        self._on_close = on_close
        self._fds = fds  # whether to accept descriptors (the client does; the daemon never)
        self._inbox: collections.deque[tuple[int, int, memoryview]] = collections.deque()
        self._inbox_fds: list[int] = []
        self._dispatching = False  # a dispatch is scheduled for the next turn
        self._out: collections.deque[tuple[Any, tuple[int, ...]]] = collections.deque()
        self._out_bytes = 0
        self._out_fds = 0
        self._queued = 0  # bytes ever written (queued), and ever sent: where on_unsent's marks stand
        self._gone = 0
        self._unsent: collections.deque[tuple[int, Callable[..., None], tuple]] = collections.deque()
        self._high = high_water
        self._max_fds = max_fds
        self._group = max(1, group)
        self._farewell = farewell  # the last frame to a peer that broke the framing: why
        self._room = asyncio.Event()  # set while the peer reads its replies (not blocked)
        self._room.set()
        self._error: BaseException | None = None  # what ends a connection closing after its flush
        self._flushing = False
        self._writing = False
        self._reading = False
        self._closing = False
        self.closed = False
        self._fd = sock.fileno()
        self._read_on()

    # -- reading ------------------------------------------------------------------

    def _read_on(self) -> None:
        if not self._reading and not self.closed:
            self._reading = True
            self.loop.add_reader(self._fd, self._readable)

    def _read_off(self) -> None:
        if self._reading:
            self._reading = False
            self.loop.remove_reader(self._fd)

    @property
    def blocked(self) -> bool:
        """Whether the peer is not reading what was written to it (see the class)."""
        return self._out_bytes > self._high or self._out_fds > self._max_fds

    def _readable(self) -> None:
        fds: list[int] = []
        try:
            for _ in range(16):  # a bounded burst, then let the loop run others
                into = self.reader.into()
                fds = []
                if into is not None:
                    if self._fds:
                        n, anc, _, _ = self.sock.recvmsg_into([into], socket.CMSG_SPACE(MAX_FDS * 4))
                        fds = take_fds(anc)
                    else:
                        n = self.sock.recv_into(into)
                    if n == 0:
                        self.close(ConnectionError("the peer closed the socket in the middle of a frame"))
                        return
                    frames = self.reader.filled(n)
                else:
                    if self._fds:
                        data, anc, _, _ = self.sock.recvmsg(READ_BYTES, socket.CMSG_SPACE(MAX_FDS * 4))
                        fds = take_fds(anc)
                    else:
                        data = self.sock.recv(READ_BYTES)
                    if not data:
                        if self.reader.partial:
                            self.close(ConnectionError("the peer closed the socket in the middle of a frame"))
                        else:
                            self._dispatch()  # what came before the end is handled first
                            self.close(None)
                        return
                    frames = self.reader.feed(data)
                self._inbox.extend(frames)
                self._inbox_fds += fds
                fds = []
                if self._inbox or self._inbox_fds:
                    break  # hand these over before reading more
        except (BlockingIOError, InterruptedError):
            pass
        except (FrameError, OSError) as exc:
            close_fds(fds)  # they came with the read that broke the framing
            self._dispatch()  # the frames before the broken one are whole: they count
            if isinstance(exc, FrameError) and self._farewell is not None and not self.closed:
                self._error = exc
                self.write(self._farewell(exc))  # the peer learns why, then the end
                self.close_after_flush()
            else:
                self.close(exc)
            return
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand waiting frames to the owner: a bounded number per turn, none while
        the peer is not reading its replies. Reading goes on once none wait."""
        self._dispatching = False
        budget = _TURN_FRAMES
        while (self._inbox or self._inbox_fds) and not self.closed and not self.blocked and not self._closing:
            if budget <= 0:
                self._dispatching = True
                self.loop.call_soon(self._dispatch)
                break
            group = [self._inbox.popleft() for _ in range(min(self._group, budget, len(self._inbox)))]
            fds, self._inbox_fds = self._inbox_fds, []
            budget -= len(group)
            self._on_frames(group, fds)
        if self.closed or self._closing:
            return
        if self._inbox or self._inbox_fds or self.blocked:
            self._read_off()
        else:
            self._read_on()

    # -- writing ------------------------------------------------------------------

    def write(self, data: bytes, fds: Sequence[int] = ()) -> None:
        """Queue ``data`` (whole frames) to go out at the end of this loop turn, with
        ``fds`` attached to its first byte. The connection owns ``fds`` from here:
        it closes them once sent (or when it closes)."""
        if self.closed or not data:  # descriptors ride on a byte: none without data
            close_fds(fds)
            return
        self._out.append((data, tuple(fds)))
        self._out_bytes += len(data)
        self._queued += len(data)
        self._out_fds += len(fds)
        if not self._flushing and not self._writing:
            self._flushing = True
            self.loop.call_soon(self._flush)
        if self.blocked:
            self._room.clear()
            self._read_off()

    def on_unsent(self, lost: Callable[..., None], *args: Any) -> None:
        """Call ``lost(*args)`` if this connection closes before everything written
        so far has gone out (the peer went away in the middle of it, or before
        it): an answer that carries tensors gives them back then. Called at
        once if the connection is closed already; dropped, uncalled, once those
        bytes are sent."""
        if self.closed:
            lost(*args)
        elif self._queued > self._gone:
            self._unsent.append((self._queued, lost, args))

    async def room(self) -> None:
        """Return once the peer is reading its replies (at once, unless it is
        blocked: see the class). Replies made elsewhere than in ``on_frames``
        (a recv that waited for its tensor) wait here, so what a peer that reads
        nothing can make this side hold stays bounded."""
        while self.blocked and not self.closed:
            await self._room.wait()

    def _flush(self) -> None:
        self._flushing = False
        if self.closed:
            return
        try:
            while self._out:
                bufs: list[Any] = []
                fds: tuple[int, ...] = ()
                gathered = 0
                for data, attached in self._out:
                    if attached:
                        if bufs:
                            break  # descriptors start a write of their own
                        fds = attached
                    bufs.append(data)
                    gathered += len(data)
                    # about what the socket takes at once: a reply of many small pieces
                    # is not walked again whole for each partial write
                    if len(bufs) >= 512 or gathered >= _GATHER_BYTES:
                        break
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
                sent = self.sock.sendmsg(bufs, anc)
                self._sent(sent)
        except (BlockingIOError, InterruptedError):
            if not self._writing:
                self._writing = True
                self.loop.add_writer(self._fd, self._writable)
            self._resume_if_drained()
            return
        except OSError as exc:
            self.close(exc)
            return
        if self._writing:
            self._writing = False
            self.loop.remove_writer(self._fd)
        if self._closing:
            self.close(self._error)
            return
        self._resume_if_drained()

    def _resume_if_drained(self) -> None:
        """Take frames again once the peer has read half of what it was blocked on."""
        if self.closed or self._out_bytes > self._high // 2 or self._out_fds > self._max_fds // 2:
            return
        self._room.set()
        if not self._closing and not self._dispatching and not self._reading:
            self._dispatch()

    def _sent(self, n: int) -> None:
        self._out_bytes -= n
        self._gone += n
        unsent = self._unsent
        while unsent and unsent[0][0] <= self._gone:
            unsent.popleft()
        while n > 0:
            data, fds = self._out[0]
            close_fds(fds)  # the peer has its own copies now
            self._out_fds -= len(fds)
            if n >= len(data):
                self._out.popleft()
                n -= len(data)
            else:
                self._out[0] = (memoryview(data)[n:], ())  # its descriptors went with its first byte
                n = 0

    def _writable(self) -> None:
        self._flush()

    @property
    def ending(self) -> bool:
        """Closed, or closing once its output is out."""
        return self.closed or self._closing

    @property
    def backlog(self) -> int:
        """Bytes waiting to go out."""
        return self._out_bytes

    @property
    def queued_fds(self) -> int:
        """Descriptors waiting to go out."""
        return self._out_fds

    # -- closing --------------------------------------------------------------------

    def close_after_flush(self) -> None:
        """Read no more, and close once what was written has gone out (an ERROR
        frame that says why the connection ends reaches the peer)."""
        if self.closed or self._closing:
            return
        self._closing = True
        self._read_off()
        if not self._flushing and not self._writing:
            self._flushing = True
            self.loop.call_soon(self._flush)

    def close(self, error: BaseException | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        on_close = self._on_close
        try:
            self._read_off()
            if self._writing:
                self.loop.remove_writer(self._fd)
        finally:
            for _, fds in self._out:
                close_fds(fds)
            close_fds(self._inbox_fds)
            self._out.clear()
            self._inbox.clear()
            self._inbox_fds = []
            self._out_bytes = self._out_fds = 0
            self.reader.discard()
            self._room.set()  # whoever waits for room sees the end
            self.sock.close()
            # the owner and this connection refer to each other: let go at once
            self._on_frames = self._on_close = _ignore
            self._farewell = None
            unsent, self._unsent = self._unsent, collections.deque()
            for _, lost, args in unsent:  # written, and not all of it went out
                try:
                    lost(*args)
                except Exception as exc:
                    log.error("giving back what a closed connection did not send failed", exc_info=exc)
            on_close(error)
