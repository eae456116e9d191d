"""Lying peers and broken batches at the consumer (rendezvous/rpc/consumer_stream.py,
rendezvous/rpc/batch.py), against the scripted peer of ``test_peer.py``: a
real grpc.aio server whose stream handler writes whatever the test scripts.

A reply that lies (a shape no array can have, a fusion buffer that does not
hold its group, a frame that does not parse) ends the calls it touches with
INTERNAL, cancels the stream at the producer and is never re-sent as if the
peer had gone; a batch keeps the request_id of every call left in doubt,
and re-asks the calls of a broken stream together, with their ids; what
arrived before a batch failed is kept; and every array handed out is
aligned to its dtype, however its bytes lay in the message."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from google.protobuf import any_pb2

from rendezvous import errors
from rendezvous.codec import groups
from rendezvous.errors import Internal
from rendezvous.rpc.peer import BatchFailed
from rendezvous.codec.tensors import TensorMeta
from rendezvous.transport import DataPlane, Path

from conftest import key, run, until
from test_peer import K1, K2, K3, DescriptorPlane, _descriptor, _group, _inline_planes, connected, reply, scripted

pytestmark = pytest.mark.timeout(60)


def _skipped_field(n: int) -> bytes:
    """``n`` bytes (2 or more) of a field no reader knows (field 15, length-delimited): skipped."""
    return bytes((15 << 3 | 2, n - 2)) + bytes(n - 2)


def _shape_lie(call_id: int, options: bytes | None = None) -> bytes:
    """A group answering ``call_id`` with a float64 tensor of shape (0, 2**62):
    no bytes (so a check of its size alone passes), but numpy cannot make it."""
    value = np.zeros((0, 2), np.float64)
    lay = groups.layout([value])
    lay.dims = np.array([0, 2**62], "<u8").tobytes()
    return groups.group_frame([call_id], None if options else [value], lay, 0, options)


async def _outcome(r: asyncio.Future, peer, timeout: float = 10) -> object:
    """What ``r`` ended with, or "re-sent" if its keys were asked again on a new
    stream first (the client took the lie for a peer that went away)."""
    resent = asyncio.ensure_future(peer.stream())
    await asyncio.wait({r, resent}, return_when=asyncio.FIRST_COMPLETED, timeout=timeout)
    resent.cancel()
    if r.done():
        return r.exception() or r.result()
    r.cancel()
    await asyncio.gather(r, return_exceptions=True)
    return "re-sent on a new stream" if len(peer.sides) > 1 else "still waiting"


# -- a group reply whose shape no array can have ------------------------------------------------

def test_a_group_whose_shape_no_array_can_have_ends_the_stream_with_internal_and_cancels_it():
    """Shape (0, 2**62) once passed the group's checks (its size is 0) and made
    numpy raise while the views were made: the stream's reader died, and every
    call on the stream was re-sent as if the peer had gone, the old stream
    left open at the producer."""
    async def main():
        async with scripted(reconnect_attempts=1) as (peer, client):
            side = await connected(peer, client)
            first = client.live_stream()
            single = asyncio.ensure_future(client.recv(K3, step_id=2, timeout=10))
            r = asyncio.ensure_future(client.recv_batch([K1, K2], step_id=2))
            asked = await side.recvs(3)
            q1 = next(q for q in asked if q.recv.rendezvous_key == K1)
            side.write(_shape_lie(q1.call_id))
            outcome = await _outcome(r, peer)
            single_outcome = await _outcome(single, peer, 5)
            await asyncio.gather(first.reader, return_exceptions=True)
            assert isinstance(outcome, BatchFailed), outcome
            assert all(isinstance(e, Internal) for e in outcome.failures.values()), outcome.failures
            assert "malformed reply" in str(outcome.failures[0]) and sorted(outcome.failures) == [0, 1]
            assert isinstance(single_outcome, Internal), single_outcome
            assert len(peer.sides) == 1  # not re-sent
            # the stream was cancelled: the producer's side of it ends (it holds nothing for it)
            await asyncio.wait_for(side.client_done.wait(), 10)
    run(main(), 40)


class FusionPlane(DataPlane):
    """Receives group payloads announced by ``transport_options`` (as the MPI
    plane does): each posted receive is a future the test resolves."""

    path = Path.MPI
    descriptor_url = "type.googleapis.com/test.Fusion"
    OPTIONS = any_pb2.Any(type_url=descriptor_url, value=b"\x08\x01").SerializeToString()

    def __init__(self) -> None:
        self.posted: list[tuple[asyncio.Future, groups.Group]] = []

    def plan(self, request, item):
        return None

    def receive(self, reply, head, placement):
        raise AssertionError("no single reply comes this way here")

    def receive_group(self, reply, group):
        fut = asyncio.get_running_loop().create_future()
        self.posted.append((fut, group))
        return fut


def test_a_group_announcing_a_fusion_buffer_with_an_impossible_shape_is_refused_before_anything_is_posted():
    """The same lie on the fusion-buffer path once had its buffer received and
    then raised in the callback that makes the views: the batch never resolved."""
    async def main():
        plane = FusionPlane()
        async with scripted(planes=_inline_planes([plane]), reconnect_attempts=1) as (peer, client):
            side = await connected(peer, client)
            r = asyncio.ensure_future(client.recv_batch([K1, K2], step_id=2))
            q1, q2 = await side.recvs(2)
            side.write(_shape_lie(q1.call_id, FusionPlane.OPTIONS))
            await until(lambda: r.done() or plane.posted, what="the batch to fail or the buffer to be posted")
            for fut, group in plane.posted:  # lands: the bytes it announced
                fut.set_result(np.zeros(group.nbytes, np.uint8))
            done, _ = await asyncio.wait({r}, timeout=5)
            assert done, "the batch never resolved"
            assert isinstance(r.exception(), BatchFailed), r.exception()
            assert all(isinstance(e, Internal) for e in r.exception().failures.values())
            assert not plane.posted  # refused before anything was received for it
            assert len(peer.sides) == 1
    run(main(), 30)


def test_a_fusion_buffer_that_does_not_hold_its_group_fails_the_group_with_internal():
    """A fusion buffer shorter than its group (a lying or broken transfer): the
    views cannot be made when it lands. That once raised in a done-callback and
    the batch waited forever; now the group's calls fail with INTERNAL, and the
    stream ends (cancelled at the producer) as for any lie."""
    async def main():
        plane = FusionPlane()
        async with scripted(planes=_inline_planes([plane]), reconnect_attempts=1) as (peer, client):
            side = await connected(peer, client)
            r = asyncio.ensure_future(client.recv_batch([K1, K2], step_id=2))
            q1, q2 = await side.recvs(2)
            arrays = [np.arange(4, dtype=np.float64), np.arange(3, dtype=np.int32)]
            side.write(groups.group_frame([q1.call_id, q2.call_id], None, groups.layout(arrays), 0,
                                         FusionPlane.OPTIONS))
            await until(lambda: plane.posted, what="the fusion buffer's receive")
            (fut, group), = plane.posted
            fut.set_result(np.zeros(group.nbytes - 8, np.uint8))  # 8 bytes short
            done, _ = await asyncio.wait({r}, timeout=5)
            assert done, "the batch never resolved"
            assert isinstance(r.exception(), BatchFailed), r.exception()
            assert sorted(r.exception().failures) == [0, 1]
            assert all(isinstance(e, Internal) for e in r.exception().failures.values())
            await asyncio.wait_for(side.client_done.wait(), 10)  # the stream was cancelled
            assert len(peer.sides) == 1
    run(main(), 30)


# -- request ids of a batch ------------------------------------------------------------------------

def test_a_batch_failed_by_a_malformed_frame_keeps_the_request_id_of_every_call():
    """The producer may have taken the tensors and written them into the stream
    the malformed frame ended: the next recv of each key asks with its id (the
    producer answers it from its retry cache), as a single recv does. The ids
    were once dropped, and the next recvs asked with fresh ones."""
    async def main():
        async with scripted(reconnect_attempts=1) as (peer, client):
            side = await connected(peer, client)
            r = asyncio.ensure_future(client.recv_batch([K1, K2], step_id=2))
            q1, q2 = await side.recvs(2)
            side.write(b"\x08")  # a truncated varint: no frame at all
            with pytest.raises(BatchFailed) as info:
                await r
            assert all(isinstance(e, Internal) for e in info.value.failures.values())
            again = asyncio.ensure_future(client.recv_batch([K1, K2], step_id=2))
            fresh = await peer.stream()
            a1, a2 = await fresh.recvs(2)
            assert (a1.recv.request_id, a2.recv.request_id) == (q1.recv.request_id, q2.recv.request_id)
            fresh.write(*reply(a1.call_id, np.array([1])), *reply(a2.call_id, np.array([2])))
            assert [f.item.value.tolist() for f in await again] == [[1], [2]]
    run(main(), 30)


def test_a_broken_batch_of_more_than_4096_keys_is_asked_again_as_one_batch_with_every_id():
    """5,000 keys asked, the stream broken under them (the peer restarted its
    listener): every key is asked again on the new stream with the request_id
    it was first asked with, in RecvMany requests, not one recv at a time.
    The ids once went through the per-peer memory of unsettled recvs (4,096),
    and the first 904 keys were asked again with fresh ids: the tensors the
    producer had taken for them sat in its retry cache under the old ids."""
    keys = tuple(key(1, 0, f"b{i}") for i in range(5000))

    async def main():
        async with scripted() as (peer, client):
            side = await connected(peer, client)
            r = asyncio.ensure_future(client.recv_batch(keys, step_id=2))
            asked = await side.recvs(len(keys))
            ids = {q.recv.rendezvous_key: q.recv.request_id for q in asked}
            assert len(set(ids.values())) == len(keys)
            side.abort(grpc.StatusCode.UNAVAILABLE, "listener restarting")
            again = await peer.stream()
            first = await again.next()
            assert again.many, "the first key was asked again on its own, not in the batch"
            assert first.recv.request_id == ids[first.recv.rendezvous_key], "asked again with a fresh id"
            rest = await again.recvs(len(keys) - 1)
            reasked = [first, *rest]
            assert [q.recv.rendezvous_key for q in reasked] == list(keys)
            assert [q.recv.request_id for q in reasked] == [ids[k] for k in keys]
            assert sum(len(m.recv_many.rendezvous_keys) for m in again.many) == len(keys)
            for s in range(0, len(keys), 1000):
                again.write(_group([(q.call_id, np.array([s + j])) for j, q in enumerate(reasked[s:s + 1000])]))
            got = await r
            assert [f.item.value.tolist() for f in got] == [[i] for i in range(len(keys))]
            assert not client.in_doubt
    run(main(), 50)


def test_a_batch_whose_peer_stays_away_fails_and_keeps_what_arrived_and_every_id_in_doubt():
    kept = []

    async def main():
        async with scripted(on_unclaimed=lambda *a: kept.append(a), reconnect_attempts=1) as (peer, client):
            side = await connected(peer, client)
            r = asyncio.ensure_future(client.recv_batch([K1, K2, K3], step_id=2))
            q1, q2, q3 = await side.recvs(3)
            side.write(*reply(q1.call_id, np.array([1])))
            await until(lambda: q1.call_id not in client.live_stream().pending, what="the first answer")
            side.abort(grpc.StatusCode.UNAVAILABLE, "gone")
            again = await peer.stream()
            b2 = await again.next()
            assert again.many, "the keys were asked again one by one, not as one batch"
            (b3,) = await again.recvs(1)
            assert (b2.recv.request_id, b3.recv.request_id) == (q2.recv.request_id, q3.recv.request_id)
            again.write(*reply(b2.call_id, np.array([2])))
            await until(lambda: b2.call_id not in client.live_stream().pending, what="the second answer")
            again.abort(grpc.StatusCode.UNAVAILABLE, "gone again")  # past reconnect_attempts
            with pytest.raises(BatchFailed) as info:
                await r
            assert list(info.value.failures) == [2]
            assert isinstance(info.value.failures[2], errors.PeerUnavailable)
            assert sorted((k, f.item.value.tolist()) for _, k, f in kept) == [(K1, [1]), (K2, [2])]
            # the one in doubt is asked with its id by the next recv of its key
            last = asyncio.ensure_future(client.recv(K3, step_id=2, timeout=10))
            third = await peer.stream()
            (c3,) = await third.recvs(1)
            assert c3.recv.request_id == q3.recv.request_id
            third.write(*reply(c3.call_id, np.array([3])))
            assert (await last).item.value.tolist() == [3]
    run(main(), 30)


# -- a call its stream cancelled ---------------------------------------------------------------

def test_a_batch_whose_transfer_is_cancelled_fails_and_keeps_what_arrived():
    """A call whose transfer was cancelled before it landed (the MPI engine
    stopped) once made the batch raise a bare CancelledError, and the tensors
    that had arrived for its other keys were dropped."""
    kept = []

    async def main():
        plane = DescriptorPlane()
        async with scripted(planes=_inline_planes([plane]), on_unclaimed=lambda *a: kept.append(a)) as (peer, client):
            side = await connected(peer, client)
            r = asyncio.ensure_future(client.recv_batch([K1, K2], step_id=2))
            q1, q2 = await side.recvs(2)
            side.write(*reply(q1.call_id, np.array([1])))
            side.write(_descriptor(q2.call_id, TensorMeta(np.dtype(np.float32), (2,))))
            await until(lambda: plane.arrivals, what="the transfer to be posted")
            plane.arrivals[0][0].cancel()
            outcome = (await asyncio.gather(r, return_exceptions=True))[0]
            assert isinstance(outcome, BatchFailed), repr(outcome)
            assert list(outcome.failures) == [1] and isinstance(outcome.failures[1], errors.Unavailable)
            assert [(k, f.item.value.tolist()) for _, k, f in kept] == [(K1, [1])]
    run(main(), 30)


# -- aligned views -------------------------------------------------------------------------------

MIXED = [np.arange(5, dtype=np.float64) + 0.5, np.arange(3, dtype=np.int32), np.array([1 + 2j], np.complex128),
         np.arange(7, dtype=np.int8), np.arange(4, dtype=np.float16), np.arange(6, dtype=np.int64).reshape(2, 3)]


def _aligned(value: np.ndarray) -> bool:
    return value.ctypes.data % value.dtype.alignment == 0


@pytest.mark.parametrize("shift", [0, 3, 6])
def test_arrays_whose_bytes_lie_misaligned_in_the_message_are_handed_out_aligned(shift):
    """A reply's tensor bytes lie wherever its producer put them in the
    message (here pushed by a padding field of ``shift`` bytes, as a producer
    that does not align its frames would): every array handed out is aligned
    to its dtype, with the right values."""
    async def main():
        async with scripted() as (peer, client):
            side = await connected(peer, client)
            r = asyncio.ensure_future(client.recv_batch([key(1, 0, f"m{i}") for i in range(len(MIXED))], step_id=2))
            asked = await side.recvs(len(MIXED))
            pad = _skipped_field(shift) if shift else b""
            side.write(pad + _group([(q.call_id, v) for q, v in zip(asked, MIXED)]))
            got = [f.item.value for f in await r]
            one = asyncio.ensure_future(client.recv(K1, step_id=3, timeout=10))
            (q,) = await side.recvs(1)
            first, = reply(q.call_id, np.arange(9, dtype=np.float64))
            side.write(pad + first)
            got.append((await one).item.value)
            for want, have in zip([*MIXED, np.arange(9, dtype=np.float64)], got):
                assert have.dtype == want.dtype and _aligned(have), (have.dtype, have.ctypes.data % 8)
                np.testing.assert_array_equal(have, want)
    run(main(), 30)
