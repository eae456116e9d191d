"""How a session's answers are made: where each fetched tensor goes.

A tensor a local client receives crosses to it on a pool segment (the one it
lies on already, or one it is copied into: off the loop from 4 MiB) or inside
the answer's frame (dead, small, not plain bytes, the pool full, or the
session at its share of segments). :class:`Placing` chooses (``_places``),
makes the replies that name segments (``_pooled``), and hands the segments
over (``_hand_over``), in that order: nothing is handed over before the whole
answer is made, and the hand-over and the write follow with no await between
them, so an answer that cannot be made holds no segment, and the segments a
session's answers hold together never pass its share, counting those chosen
for answers still waiting for their copies.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from rendezvous.codec.dtypes import is_memcpyable
from rendezvous.errors import ResourceExhausted, Unavailable
from rendezvous.local import messages
from rendezvous.paths import Hop, Path
from rendezvous.stats import payload_nbytes
from rendezvous.items import Received
from rendezvous.codec.tensors import TensorMeta

from .pool import Pool, Segment

#: the most tensor bytes a RECV_MANY's answer carries in its frame (a frame's
#: length is a u32; keys and field headers take the rest)
_MANY_INLINE_BYTES = (1 << 32) - (64 << 20)

if TYPE_CHECKING:
    from rendezvous.local.connection import Connection

    from .listener import SessionListener
    from .service import LocalServicer

__all__ = ["Placing", "Answer"]

#: copies this big into a segment run on a worker thread (numpy releases the GIL)
_OFF_LOOP_BYTES = 4 << 20


class Answer(NamedTuple):
    """A RECV's answer: the LocalRecvResponse bytes, how it crosses the hop, its payload bytes."""

    body: bytes
    hop: Hop
    nbytes: int


class Placing:
    """The answer-making half of a session (:class:`rendezvous.daemon.sessions.Session`)."""

    server: SessionListener
    servicer: LocalServicer
    pool: Pool
    id: str
    conn: Connection
    #: segments chosen for this session's answers being made, not handed over yet
    _reserved: int

    def _introduce(self, seg: Segment) -> None:
        raise NotImplementedError

    async def _reply(self, item: Received, path: Path) -> Answer:
        """A fetched tensor as its LocalRecvResponse (see :meth:`_places`), its
        segment (if any) handed over."""
        places = await self._places([item])
        prepared, handed = self._pooled([(item, path)], places)
        body = prepared.get(0)
        if body is None:
            reply = Answer(messages.inline_reply(item, path), Hop.INLINE, payload_nbytes(item.value))
        else:
            reply = Answer(body, Hop.SHM, places[0][0].nbytes)  # type: ignore[index]
        self._hand_over(handed)
        return reply

    async def _places(self, items: list[Received]) -> list[tuple[np.ndarray, Segment] | None]:
        """Where each fetched tensor goes to the client: a pool segment (the one it
        is on, or one it is copied into) or None (the bytes go in the frame:
        dead, small and not on a segment already, not plain bytes, the pool full, or the session at its share
        of segments, counting those chosen for its other answers being made).
        Nothing is handed over yet: the caller does that with no await after."""
        out: list[tuple[np.ndarray, Segment] | None] = []
        threshold = self.server.threshold
        share = self.server.segment_share
        taken: set[int] = set()  # segments this answer hands over (a tensor sent twice is copied once)
        mine = 0  # segments this answer reserved (counted in _reserved while it awaits copies)
        try:
            for item in items:
                value = item.value
                if (item.is_dead or threshold < 0 or not isinstance(value, np.ndarray) or not is_memcpyable(value)
                        or value.nbytes == 0
                        or (value.nbytes < threshold and self.pool.segment_of(value, whole=True) is None)
                        or self.pool.holds(self.id) + self._reserved >= share):  # (small, on its own segment: lent)
                    out.append(None)
                    continue
                self._reserved += 1
                mine += 1
                seg = self.pool.segment_of(value)
                if seg is None or seg.held_by is not None or seg.id in taken or value.nbytes > seg.size:
                    copy = self.pool.array(value.shape, value.dtype)
                    if copy is None:  # the pool is full: the bytes go in the frame
                        self._reserved -= 1
                        mine -= 1
                        out.append(None)
                        continue
                    if value.nbytes >= _OFF_LOOP_BYTES:
                        await asyncio.get_running_loop().run_in_executor(None, np.copyto, copy, value)
                    else:
                        np.copyto(copy, value)
                    value = copy
                    seg = self.pool.segment_of(value)
                    assert seg is not None
                taken.add(seg.id)
                out.append((value, seg))
        finally:
            self._reserved -= mine
        return out

    def _pooled(self, got: list[Any], places: list[tuple[np.ndarray, Segment] | None]
                ) -> tuple[dict[int, bytes], list[Segment]]:
        """The LocalRecvResponse (by position) of each (item, path) in ``got`` that
        goes on the segment :meth:`_places` chose, and those segments, not
        handed over yet. A segment another answer took meanwhile leaves its
        tensor inline. Called with no await before the write."""
        if self.conn.closed:
            raise Unavailable("the client went away")
        prepared: dict[int, bytes] = {}
        handed: list[Segment] = []
        for i, ((item, path), place) in enumerate(zip(got, places)):
            if place is None or place[1].held_by is not None:
                continue
            value, seg = place
            prepared[i] = messages.pooled_reply(TensorMeta(value.dtype, value.shape), seg.id, value.nbytes, path)
            handed.append(seg)
        return prepared, handed

    def _hand_over(self, handed: list[Segment]) -> None:
        """Hand the segments of an answer about to be written to this session (each
        introduced first if the client does not map it yet)."""
        done: list[Segment] = []
        try:
            for seg in handed:
                self.pool.hand_to(seg, self.id)
                done.append(seg)
        except BaseException:
            for seg in done:
                self.pool.release(seg.id, self.id)
            raise
        for seg in handed:
            self._introduce(seg)

    def _many_body(self, got: list[Any], places: list[tuple[np.ndarray, Segment] | None]
                   ) -> tuple[list, dict[Hop, list[int]], list[Segment]]:
        """A RECV_MANY's LocalRecvManyResponse (:func:`messages.many_answer`: the
        tensors on segments as replies naming them, the host arrays that go
        inline packed in one group), per hop the tensors and bytes that
        crossed it, and the segments to hand over (:meth:`_hand_over`) before
        it is written. Called with no await before the write; nothing is
        handed over here, so an answer that cannot be made (too large for one
        frame) holds nothing."""
        prepared, handed = self._pooled(got, places)
        shm_bytes = sum(place[0].nbytes for i in prepared if (place := places[i]) is not None)
        inline = [f.item for i, f in enumerate(got) if i not in prepared]
        inline_bytes = sum(payload_nbytes(item.value) for item in inline)
        if inline_bytes > _MANY_INLINE_BYTES:
            raise ResourceExhausted(f"the answer to a batch of {len(got)} keys would carry {inline_bytes} bytes in "
                                    f"its frame (the shared-memory pool has no room for them); at most "
                                    f"{_MANY_INLINE_BYTES}: ask for fewer keys at once")
        hops = {Hop.SHM: [len(prepared), shm_bytes], Hop.INLINE: [len(inline), inline_bytes]}
        body = messages.many_answer(got, self.servicer.config.max_tensor_bytes, prepared)
        return body, {hop: t for hop, t in hops.items() if t[0]}, handed
