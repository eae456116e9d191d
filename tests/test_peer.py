"""The consumer's client for one remote task (rendezvous/rpc/peer.py), against a
*scripted peer*: a real grpc.aio server on an OS-chosen loopback port whose
RecvTensorStream handler hands each stream to the test, which reads the
client's requests and writes whatever replies (or aborts) it scripts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
from google.protobuf import any_pb2

from rendezvous import errors
from rendezvous.codec import groups, wire
from rendezvous.codec.assembly import Assembly
from rendezvous.codec.parsing import ReplyHead
from rendezvous.codec.replies import batch_responses, descriptor_response, error_frame, stream_frames, with_call_id
from rendezvous.codec.requests import many_keys_field
from rendezvous.buffers import RecvBuffers
from rendezvous.config import Config
from rendezvous.devices import Devices
from rendezvous.errors import (
    DeadlineExceeded,
    Internal,
    PeerUnavailable,
    ResourceExhausted,
)
from rendezvous.keys import TaskName
from rendezvous.rank.kept import Kept
from rendezvous.rpc.consumer_stream import PendingCall
from rendezvous.rpc.peer import BatchFailed, PeerClient
from rendezvous.stats import Stats
from rendezvous.items import Received
from rendezvous.codec.tensors import TensorMeta
from rendezvous.transport import Arrival, DataPlane, Path, Planes
from rendezvous.transport.calls import EOF, CallBase
from rendezvous.transport.inline import InlinePlane
from rendezvous.v1 import rendezvous_pb2 as pb

from conftest import free_port, key, run, until

pytestmark = pytest.mark.timeout(60)

PEER = TaskName("worker", 0, 1)
K1, K2, K3 = key(1, 0, "one"), key(1, 0, "two"), key(1, 0, "three")


# --- the scripted peer --------------------------------------------------------------

class PeerSide:
    """The peer's end of one RecvTensorStream: ``next()`` gives the client's
    requests one by one (batches flattened, a RecvMany as the recvs it stands
    for, kept in ``many`` too); ``write``/``abort``/``end`` are carried out by
    the handler, in order."""

    def __init__(self, requests: AsyncIterator[bytes], index: int) -> None:
        self.index = index
        self.raw: list[bytes] = []
        self.many: list[pb.StreamRequest] = []
        self._requests: asyncio.Queue[pb.StreamRequest] = asyncio.Queue()
        self._outbox: asyncio.Queue[tuple] = asyncio.Queue()
        self.client_done = asyncio.Event()
        self._reader = asyncio.ensure_future(self._read(requests))

    async def _read(self, requests: AsyncIterator[bytes]) -> None:
        try:
            async for raw in requests:
                self.raw.append(raw)
                msg = pb.StreamRequest.FromString(raw)
                for one in [msg, *msg.batch]:
                    kind = one.WhichOneof("kind")
                    if kind == "recv_many":  # seen as the recvs it stands for
                        self.many.append(one)
                        many = one.recv_many
                        for i, k in enumerate(many.rendezvous_keys):
                            recv = pb.RecvTensorRequest(step_id=many.step_id, rendezvous_key=k,
                                                        request_id=many.request_ids[i],
                                                        transport_options=many.transport_options)
                            self._requests.put_nowait(pb.StreamRequest(call_id=one.call_id + i, recv=recv))
                    elif kind is not None:
                        self._requests.put_nowait(one)
        finally:
            self.client_done.set()

    async def next(self) -> pb.StreamRequest:
        return await asyncio.wait_for(self._requests.get(), 10)

    async def recvs(self, n: int) -> list[pb.StreamRequest]:
        got = [await self.next() for _ in range(n)]
        assert all(r.WhichOneof("kind") == "recv" for r in got), got
        return got

    def pending_requests(self) -> int:
        return self._requests.qsize()

    def write(self, *messages: bytes) -> None:
        for m in messages:
            self._outbox.put_nowait(("write", m))

    def abort(self, code: grpc.StatusCode, details: str = "scripted") -> None:
        self._outbox.put_nowait(("abort", code, details))

    def end(self) -> None:
        self._outbox.put_nowait(("end",))

    async def serve(self, context: grpc.aio.ServicerContext) -> None:
        try:
            while True:
                what = await self._outbox.get()
                if what[0] == "write":
                    await context.write(what[1])
                elif what[0] == "abort":
                    await context.abort(what[1], what[2])
                else:
                    return
        finally:
            self._reader.cancel()


class ScriptedPeer:
    def __init__(self) -> None:
        self.sides: list[PeerSide] = []
        self._new: asyncio.Queue[PeerSide] = asyncio.Queue()
        self.server: grpc.aio.Server | None = None
        self.target = ""

    async def _handle(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        side = PeerSide(requests, len(self.sides))
        self.sides.append(side)
        self._new.put_nowait(side)
        await side.serve(context)

    async def start(self) -> None:
        self.server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(self._handle)
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("rendezvous.v1.Rendezvous", {"RecvTensorStream": handler})])
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.target = f"127.0.0.1:{port}"

    async def stream(self) -> PeerSide:
        """The next stream a client opens."""
        return await asyncio.wait_for(self._new.get(), 10)


def _inline_planes(extra: list[DataPlane] = ()) -> Planes:
    inline = InlinePlane(chunk_bytes=1 << 20, buffers=RecvBuffers(), devices=Devices([]),
                         staging=(4096, 2), stats=Stats())
    return Planes([*extra, inline])


@contextlib.asynccontextmanager
async def scripted(planes: Planes | None = None, on_unclaimed=None, kept: Kept | None = None,
                   **config) -> AsyncIterator[tuple[ScriptedPeer, PeerClient]]:
    """A client of a scripted peer; with ``kept``, what nobody waits for is kept
    there and recvs about to ask take from it, as a rank server's do."""
    peer = ScriptedPeer()
    await peer.start()
    settings = {"connect_timeout": 10.0, **config}
    if kept is not None:
        on_unclaimed = lambda step_id, k, fetched: kept.keep(step_id, k, fetched.item, why=None)  # noqa: E731
    client = PeerClient(PEER, peer.target, Config.load(settings, env={}), planes=planes or _inline_planes(),
                        on_unclaimed=on_unclaimed, kept=kept)
    try:
        yield peer, client
    finally:
        await client.close()
        await peer.server.stop(0)


def reply(call_id: int, value, chunk: int = 1 << 20) -> list[bytes]:
    return list(stream_frames(call_id, Received(value, value is None), chunk))


async def connected(peer: ScriptedPeer, client: PeerClient) -> PeerSide:
    """Open the client's stream with one answered recv, so that a short deadline
    afterwards measures the recv, not the connection."""
    r = asyncio.ensure_future(client.recv(key(1, 0, "warm-up"), step_id=99, timeout=10))
    side = await peer.stream()
    (req,) = await side.recvs(1)
    side.write(*reply(req.call_id, np.array([0])))
    await r
    return side


# --- replies ------------------------------------------------------------------------

def test_replies_resolve_the_right_recv_out_of_order():
    async def main():
        async with scripted() as (peer, client):
            recvs = [asyncio.ensure_future(client.recv(k, step_id=4, timeout=10)) for k in (K1, K2, K3)]
            side = await peer.stream()
            reqs = await side.recvs(3)
            by_key = {r.recv.rendezvous_key: r for r in reqs}
            assert set(by_key) == {K1, K2, K3}
            assert all(r.recv.step_id == 4 for r in reqs)
            assert len({r.call_id for r in reqs}) == 3 and len({r.recv.request_id for r in reqs}) == 3
            assert all(r.recv.request_id != 0 and r.call_id != 0 for r in reqs)
            # answer in reverse order, the last two in one batched message
            side.write(*reply(by_key[K3].call_id, np.array([3.0])))
            side.write(batch_responses(reply(by_key[K2].call_id, np.array([2.0]))
                                              + reply(by_key[K1].call_id, np.array([1.0]))))
            got = await asyncio.gather(*recvs)
            assert [f.item.value.tolist() for f in got] == [[1.0], [2.0], [3.0]]
            assert all(f.path is Path.GRPC and not f.item.is_dead and not f.placed for f in got)
            assert len(peer.sides) == 1  # one stream carries every recv
    run(main(), 20)


def test_chunked_reply_is_assembled_while_another_reply_interleaves():
    async def main():
        async with scripted() as (peer, client):
            big = np.arange(1000, dtype=np.int32).reshape(10, 100)
            a = asyncio.ensure_future(client.recv(K1, step_id=1, timeout=10))
            b = asyncio.ensure_future(client.recv(K2, step_id=1, timeout=10))
            side = await peer.stream()
            by_key = {r.recv.rendezvous_key: r.call_id for r in await side.recvs(2)}
            chunks = reply(by_key[K1], big, chunk=512)
            assert len(chunks) == 8
            side.write(*chunks[:3])
            side.write(*reply(by_key[K2], np.array([7], np.uint8)))  # between two chunks
            side.write(*chunks[3:])
            assert (await b).item.value.tolist() == [7]
            got = (await a).item.value
            assert got.dtype == np.int32 and got.shape == (10, 100)
            np.testing.assert_array_equal(got, big)
    run(main(), 20)


def test_dead_tensor():
    async def main():
        async with scripted() as (peer, client):
            r = asyncio.ensure_future(client.recv(K1, step_id=1, timeout=10))
            side = await peer.stream()
            (req,) = await side.recvs(1)
            side.write(*reply(req.call_id, None))
            fetched = await r
            assert fetched.item.is_dead and fetched.item.value is None and fetched.path is Path.GRPC
    run(main(), 20)


@pytest.mark.parametrize("error", [
    errors.Aborted("step 4 aborted: input lost"),
    errors.NotFound("no such thing"),
    errors.FailedPrecondition("not this task"),
    errors.InvalidArgument("bad key"),
    errors.Unavailable("draining"),
    errors.ResourceExhausted("too big"),
    errors.Internal("oops"),
])
def test_error_frame_becomes_the_matching_error(error):
    async def main():
        async with scripted() as (peer, client):
            r = asyncio.ensure_future(client.recv(K1, step_id=1, timeout=10))
            side = await peer.stream()
            (req,) = await side.recvs(1)
            side.write(error_frame(req.call_id, error))
            with pytest.raises(type(error)) as info:
                await r
            assert type(info.value) is type(error) and info.value.message == error.message
            # an answer, not a broken stream: nothing is re-sent, the stream goes on
            r2 = asyncio.ensure_future(client.recv(K2, step_id=1, timeout=10))
            (req2,) = await side.recvs(1)
            side.write(*reply(req2.call_id, np.array([5])))
            assert (await r2).item.value[0] == 5
            assert len(peer.sides) == 1 and side.pending_requests() == 0
    run(main(), 20)


def test_deadline_is_deadline_exceeded_and_sends_a_cancel():
    async def main():
        async with scripted() as (peer, client):
            side = await connected(peer, client)
            r = asyncio.ensure_future(client.recv(K1, step_id=1, timeout=0.2))
            (req,) = await side.recvs(1)
            with pytest.raises(DeadlineExceeded, match="timed out"):
                await r
            cancel = await side.next()
            assert cancel.WhichOneof("kind") == "cancel" and cancel.call_id == req.call_id
            # a late reply for it is dropped; the stream still serves
            side.write(*reply(req.call_id, np.array([1])))
            r2 = asyncio.ensure_future(client.recv(K2, step_id=1, timeout=10))
            (req2,) = await side.recvs(1)
            side.write(*reply(req2.call_id, np.array([2])))
            assert (await r2).item.value[0] == 2
    run(main(), 20)


def test_cancelled_recv_sends_a_cancel():
    async def main():
        async with scripted() as (peer, client):
            r = asyncio.ensure_future(client.recv(K1, step_id=1, timeout=10))
            side = await peer.stream()
            (req,) = await side.recvs(1)
            r.cancel()
            with pytest.raises(asyncio.CancelledError):
                await r
            cancel = await side.next()
            assert cancel.WhichOneof("kind") == "cancel" and cancel.call_id == req.call_id
    run(main(), 20)


def test_reply_announcing_more_than_max_tensor_bytes_is_refused():
    async def main():
        async with scripted(max_tensor_bytes=1000) as (peer, client):
            r = asyncio.ensure_future(client.recv(K1, step_id=1, timeout=10))
            side = await peer.stream()
            (req,) = await side.recvs(1)
            side.write(*reply(req.call_id, np.zeros(2000, np.uint8), chunk=500))  # 4 frames
            with pytest.raises(ResourceExhausted, match="2000 bytes") as info:
                await r
            assert "max_tensor_bytes" in info.value.message
            # the rest of that reply is ignored; at the limit is fine
            r2 = asyncio.ensure_future(client.recv(K2, step_id=1, timeout=10))
            (req2,) = await side.recvs(1)
            side.write(*reply(req2.call_id, np.ones(125, np.float64)))  # exactly 1000 bytes
            assert (await r2).item.value.sum() == 125
            assert len(peer.sides) == 1
    run(main(), 20)


def _bad_status_frame(call_id: int) -> bytes:
    """A StreamResponse whose error is not a parseable Status (a truncated string field)."""
    status = b"\x12\x05ab"
    return wire.varint_field(1, call_id) + wire.len_field_header(4, len(status)) + status


@pytest.mark.parametrize("malformed", [
    lambda cid: pb.StreamResponse(chunk=b"xyz").SerializeToString(),  # no call_id
    lambda cid: wire.varint_field(1, cid) + b"\x12\x10\x08",  # a response field cut short
    lambda cid: b"\x08",  # a truncated varint
], ids=["no-call-id", "truncated-field", "truncated-varint"])
def test_malformed_frame_is_internal(malformed):
    async def main():
        async with scripted() as (peer, client):
            r = asyncio.ensure_future(client.recv(K1, step_id=1, timeout=10))
            side = await peer.stream()
            (req,) = await side.recvs(1)
            side.write(malformed(req.call_id))
            with pytest.raises(Internal, match="malformed reply"):
                await r
            assert len(peer.sides) == 1  # the peer is broken: not re-sent
    run(main(), 20)


def test_error_frame_with_an_unparseable_status_is_internal():
    """An error frame whose status does not parse once killed the stream reader with protobuf's DecodeError and had every pending recv re-sent."""
    async def main():
        async with scripted(reconnect_attempts=1) as (peer, client):
            r = asyncio.ensure_future(client.recv(K1, step_id=1, timeout=10))
            side = await peer.stream()
            (req,) = await side.recvs(1)
            first = client._stream
            side.write(_bad_status_frame(req.call_id))
            resent = asyncio.ensure_future(peer.stream())
            await asyncio.wait({r, resent}, return_when=asyncio.FIRST_COMPLETED, timeout=10)
            resent.cancel()
            outcome = r.exception() if r.done() else "re-sent on a new stream"
            r.cancel()
            # Collect what the broken reader task died with: left unretrieved, asyncio logs it
            # whenever the task is garbage-collected, and on Python 3.11.7 a traceback printed
            # from a collection that interrupts ast.parse (pytest's failure reports) breaks it.
            await asyncio.gather(r, resent, first.reader, return_exceptions=True)
            return outcome
    outcome = run(main(), 20)
    assert isinstance(outcome, Internal), outcome


def _truncated_tensor(call_id: int) -> list[bytes]:
    bad_tensor = b"\x08\x01\x12\x05\x12\x03"  # dtype, then a shape field cut short
    return [with_call_id(call_id, wire.len_field_header(1, len(bad_tensor)) + bad_tensor)]


def _overlong_chunks(call_id: int) -> list[bytes]:
    first, _ = reply(call_id, np.array([1, 2], np.int32), chunk=4)  # announces 8 bytes, carries 4
    return [first, wire.varint_field(1, call_id) + wire.len_field_header(3, 8) + bytes(8)]  # then 8 more


@pytest.mark.parametrize("make", [_truncated_tensor, _overlong_chunks], ids=["truncated-tensor", "overlong"])
def test_malformed_tensor_in_a_reply_is_internal(make):
    """A malformed tensor in a reply once failed the recv with the parser's INVALID_ARGUMENT, as if the caller were at fault."""
    async def main():
        async with scripted() as (peer, client):
            r = asyncio.ensure_future(client.recv(K1, step_id=1, timeout=10))
            side = await peer.stream()
            (req,) = await side.recvs(1)
            side.write(*make(req.call_id))
            outcome = await asyncio.gather(r, return_exceptions=True)
            assert len(peer.sides) == 1
            return outcome[0]
    outcome = run(main(), 20)
    assert isinstance(outcome, Internal), repr(outcome)


# --- broken streams -------------------------------------------------------------------

def test_broken_stream_resends_with_the_same_request_id():
    async def main():
        async with scripted() as (peer, client):
            r = asyncio.ensure_future(client.recv(K1, step_id=9, timeout=10))
            first = await peer.stream()
            (req1,) = await first.recvs(1)
            first.abort(grpc.StatusCode.UNAVAILABLE, "listener restarting")
            second = await peer.stream()
            (req2,) = await second.recvs(1)
            assert req2.recv.request_id == req1.recv.request_id != 0
            assert (req2.recv.rendezvous_key, req2.recv.step_id) == (K1, 9)
            second.write(*reply(req2.call_id, np.array([6, 6])))
            assert (await r).item.value.tolist() == [6, 6]
            assert len(peer.sides) == 2
    run(main(), 20)


@pytest.mark.parametrize("attempts", [0, 2])
def test_reconnect_attempts_is_honoured(attempts):
    async def main():
        async with scripted(reconnect_attempts=attempts) as (peer, client):
            r = asyncio.ensure_future(client.recv(K1, step_id=1, timeout=10))
            ids = set()
            for _ in range(attempts + 1):
                side = await peer.stream()
                (req,) = await side.recvs(1)
                ids.add(req.recv.request_id)
                side.abort(grpc.StatusCode.UNAVAILABLE, "gone again")
            with pytest.raises(PeerUnavailable, match="gone again"):
                await r
            assert len(peer.sides) == attempts + 1 and len(ids) == 1
    run(main(), 20)


def test_stream_failing_with_another_status_is_not_resent():
    async def main():
        async with scripted(reconnect_attempts=3) as (peer, client):
            r = asyncio.ensure_future(client.recv(K1, step_id=1, timeout=10))
            side = await peer.stream()
            await side.recvs(1)
            side.abort(grpc.StatusCode.PERMISSION_DENIED, "who are you")
            with pytest.raises(errors.RendezvousError, match="who are you") as info:
                await r
            assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
            assert len(peer.sides) == 1
    run(main(), 20)


def test_close_fails_pending_recvs_with_peer_unavailable():
    async def main():
        async with scripted() as (peer, client):
            pending = [asyncio.ensure_future(client.recv(k, step_id=1, timeout=10)) for k in (K1, K2)]
            side = await peer.stream()
            await side.recvs(2)
            await client.close()
            for r in pending:
                with pytest.raises(PeerUnavailable):
                    await r
            with pytest.raises(PeerUnavailable, match="closed"):
                await client.recv(K3, step_id=1, timeout=10)
            await client.close()  # idempotent
            assert len(peer.sides) == 1
    run(main(), 20)


# --- the planes -------------------------------------------------------------------------

class DescriptorPlane(DataPlane):
    """Offers an endpoint on every request; its descriptor replies arrive as
    ``pending`` futures the test resolves; drained replies are recorded."""

    path = Path.MPI
    descriptor_url = "type.googleapis.com/test.Descriptor"

    def __init__(self) -> None:
        self.arrivals: list[tuple[asyncio.Future, object]] = []
        self.drained: list[ReplyHead] = []

    def offer(self, placement):
        return any_pb2.Any(type_url="type.googleapis.com/test.Endpoint", value=str(placement).encode()
                           ).SerializeToString()

    def plan(self, request, item):
        return None

    def receive(self, reply, head, placement):
        fut = asyncio.get_running_loop().create_future()
        self.arrivals.append((fut, placement))
        return Arrival(Path.MPI, pending=fut, placed=True)

    def drain(self, reply, head):
        self.drained.append(head)


def _descriptor(call_id: int, meta: TensorMeta) -> bytes:
    options = any_pb2.Any(type_url=DescriptorPlane.descriptor_url, value=b"\x08\x01").SerializeToString()
    return with_call_id(call_id, descriptor_response(meta, options))


def test_requests_carry_the_offer_and_descriptor_replies_go_to_their_plane():
    async def main():
        plane = DescriptorPlane()
        async with scripted(planes=_inline_planes([plane])) as (peer, client):
            r = asyncio.ensure_future(client.recv(K1, step_id=1, timeout=10, placement="GPU:1"))
            side = await peer.stream()
            (req,) = await side.recvs(1)
            opts = req.recv.transport_options
            assert opts.type_url == "type.googleapis.com/test.Endpoint" and opts.value == b"GPU:1"
            side.write(_descriptor(req.call_id, TensorMeta(np.dtype(np.float32), (2, 2))))
            await until(lambda: plane.arrivals, what="the descriptor to reach its plane")
            fut, placement = plane.arrivals[0]
            assert placement == "GPU:1" and not r.done()
            value = np.eye(2, dtype=np.float32)
            fut.set_result(value)
            fetched = await r
            assert fetched.item.value is value and fetched.path is Path.MPI and fetched.placed
    run(main(), 20)


def test_descriptor_for_a_recv_that_timed_out_is_received_and_kept():
    async def main():
        plane = DescriptorPlane()
        kept = []
        async with scripted(planes=_inline_planes([plane]), on_unclaimed=lambda *a: kept.append(a)) as (peer, client):
            side = await connected(peer, client)
            r = asyncio.ensure_future(client.recv(K1, step_id=1, timeout=0.2, placement="GPU:0"))
            (req,) = await side.recvs(1)
            with pytest.raises(DeadlineExceeded):
                await r
            assert (await side.next()).WhichOneof("kind") == "cancel"
            # a committed reply answers the cancel: its bytes are received (onto the
            # host: whoever takes it places it) and kept, never dropped
            side.write(_descriptor(req.call_id, TensorMeta(np.dtype(np.int64), (3,))))
            side.write(*reply(req.call_id + 1000, np.array([1])))  # unknown call: ignored
            await until(lambda: plane.arrivals, what="the descriptor's bytes to be received")
            (fut, placement), = plane.arrivals
            assert placement is None and plane.drained == []
            fut.set_result(np.array([7, 8, 9]))
            await until(lambda: kept, what="the tensor to be kept")
            (step, key, fetched), = kept
            assert (step, key) == (1, K1) and fetched.item.value.tolist() == [7, 8, 9]
            assert not fetched.placed and fetched.path == Path.MPI
    run(main(), 20)


def test_a_reply_already_on_its_way_when_the_recv_gave_up_is_kept():
    async def main():
        kept = []
        async with scripted(on_unclaimed=lambda *a: kept.append(a)) as (peer, client):
            side = await connected(peer, client)
            r = asyncio.ensure_future(client.recv(K1, step_id=4, timeout=0.2))
            (req,) = await side.recvs(1)
            with pytest.raises(DeadlineExceeded):
                await r
            assert (await side.next()).WhichOneof("kind") == "cancel"
            value = np.arange(3000, dtype=np.float32)
            side.write(*reply(req.call_id, value, chunk=4096))  # the producer had started it
            await until(lambda: kept, what="the tensor to be kept")
            (step, key, fetched), = kept
            assert (step, key) == (4, K1) and np.array_equal(fetched.item.value, value)
            assert not client._stream.pending  # the orphan is gone once its reply is whole
    run(main(), 20)


async def _gave_up_then_asked_again(client: PeerClient, side: PeerSide):
    """A recv of K1 (step 2) that timed out after asking, its cancel sent (an
    orphan now), then a second recv of the key that asked too: the first
    request, the second recv, its request."""
    first = asyncio.ensure_future(client.recv(K1, step_id=2, timeout=0.2))
    (req1,) = await side.recvs(1)
    with pytest.raises(DeadlineExceeded):
        await first
    assert (await side.next()).WhichOneof("kind") == "cancel"
    second = asyncio.ensure_future(client.recv(K1, step_id=2, timeout=10))
    (req2,) = await side.recvs(1)
    return req1, second, req2


def test_an_orphans_tensor_goes_to_a_recv_of_the_same_key_still_waiting():
    async def main():
        kept = []
        async with scripted(on_unclaimed=lambda *a: kept.append(a)) as (peer, client):
            side = await connected(peer, client)
            req1, second, req2 = await _gave_up_then_asked_again(client, side)
            side.write(*reply(req1.call_id, np.array([5])))  # the first recv's tensor arrives
            got = await second
            assert got.item.value.tolist() == [5] and not kept
            # the second recv's own request is cancelled: it took the orphan's tensor
            nxt = await side.next()
            assert nxt.WhichOneof("kind") == "cancel" and nxt.call_id == req2.call_id
    run(main(), 20)


def test_a_timed_out_batchs_late_replies_go_to_the_batch_that_asked_again_in_order():
    """A batch gave up with its requests out (its calls are orphans); a second
    batch of the same keys asked, a key twice. Every late reply goes to the
    oldest call of its key still waiting (each taker found from an index, not
    a pass over every waiting call: see ConsumerStream._waiting_for), that
    call's own request is cancelled, and nothing is left over or kept."""
    keys = [key(1, 0, f"burst{i}") for i in range(200)]

    async def main():
        kept = []
        async with scripted(on_unclaimed=lambda *a: kept.append(a)) as (peer, client):
            side = await connected(peer, client)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.recv_batch(keys, step_id=3), 0.3)
            first = await side.recvs(len(keys))
            cancels = [await side.next() for _ in keys]
            assert {c.WhichOneof("kind") for c in cancels} == {"cancel"}
            again = keys + [keys[7]]  # the same keys, and key 7 a second time
            second = asyncio.ensure_future(client.recv_batch(again, step_id=3))
            asked = await side.recvs(len(again))
            for i, q in enumerate(first):  # the producer had started them all
                side.write(*reply(q.call_id, np.array([i])))
            await until(lambda: side.pending_requests() >= len(keys), what="the second batch's cancels")
            taken = [await side.next() for _ in keys]
            assert [c.WhichOneof("kind") for c in taken] == ["cancel"] * len(keys)
            # the oldest call of each key took it: key 7's first call, not its second
            assert sorted(c.call_id for c in taken) == [q.call_id for q in asked[:len(keys)]]
            side.write(*reply(asked[-1].call_id, np.array([1000])))  # key 7's second call, answered itself
            got = await second
            assert [f.item.value.tolist() for f in got] == [[i] for i in range(len(keys))] + [[1000]]
            assert kept == []
    run(main(), 30)


def test_a_cancel_answered_with_cancelled_ends_the_orphan():
    async def main():
        kept = []
        async with scripted(on_unclaimed=lambda *a: kept.append(a)) as (peer, client):
            side = await connected(peer, client)
            r = asyncio.ensure_future(client.recv(K1, step_id=1, timeout=0.2))
            (req,) = await side.recvs(1)
            with pytest.raises(DeadlineExceeded):
                await r
            assert client._stream.pending  # kept as an orphan until the producer answers
            side.write(error_frame(req.call_id, errors.Cancelled("nothing sent")))
            await until(lambda: not client._stream.pending, what="the orphan to end")
            assert kept == []
    run(main(), 20)


def test_a_reply_too_large_for_memory_fails_that_recv_only(monkeypatch):
    """A tensor under max_tensor_bytes but larger than memory once raised an
    uncaught MemoryError that broke the stream (and re-sent its other recvs)."""
    from rendezvous.codec.assembly import Assembly
    from rendezvous.codec.parsing import ReplyHead
    from rendezvous.codec.replies import batch_responses, descriptor_response, error_frame, stream_frames, with_call_id
    from rendezvous.codec.requests import many_keys_field

    async def main():
        async with scripted() as (peer, client):
            side = await connected(peer, client)
            big = asyncio.ensure_future(client.recv(K1, step_id=1, timeout=10))
            small = asyncio.ensure_future(client.recv(key(1, 0, "small"), step_id=1, timeout=10))
            req_big, req_small = await side.recvs(2)

            def no_memory(*args, **kwargs):
                raise MemoryError()
            monkeypatch.setattr(Assembly, "__init__", no_memory)
            side.write(*reply(req_big.call_id, np.arange(4096, dtype=np.float64), chunk=1024))
            with pytest.raises(errors.ResourceExhausted, match="out of memory"):
                await big
            monkeypatch.undo()
            side.write(*reply(req_small.call_id, np.array([2])))
            assert (await small).item.value.tolist() == [2]
            assert client._stream is not None and client._stream.alive
    run(main(), 20)


def test_a_reply_arriving_in_the_same_turn_as_the_deadline_is_kept():
    """The reply resolved the recv's future just as its deadline cancelled it:
    the recv raised DeadlineExceeded and the tensor was lost."""
    async def main():
        kept = []
        async with scripted(on_unclaimed=lambda *a: kept.append(a)) as (peer, client):
            side = await connected(peer, client)
            r = asyncio.ensure_future(client.recv(K1, step_id=5, timeout=10))
            (req,) = await side.recvs(1)
            stream = client._stream
            await until(lambda: req.call_id in stream.pending, what="the call to be pending")
            # the reply completes the future, and in the same turn the recv is cancelled
            stream._dispatch(reply(req.call_id, np.array([42]))[0])
            r.cancel()
            with pytest.raises(asyncio.CancelledError):
                await r
            (step, k, fetched), = kept
            assert (step, k) == (5, K1) and fetched.item.value.tolist() == [42]
    run(main(), 20)


# --- a stream that breaks with recvs unanswered (a partition) ----------------------------

def test_a_recv_that_ended_unanswered_on_a_broken_stream_is_asked_again_with_its_request_id():
    async def main():
        async with scripted(reconnect_attempts=0) as (peer, client):
            r = asyncio.ensure_future(client.recv(K1, step_id=3, timeout=10))
            first = await peer.stream()
            (req1,) = await first.recvs(1)
            first.abort(grpc.StatusCode.UNAVAILABLE, "ping timeout")
            with pytest.raises(PeerUnavailable):
                await r
            # The producer may have written the tensor into the dead stream: the
            # next recv of the key asks with the same id (the retry cache answers).
            r = asyncio.ensure_future(client.recv(K1, step_id=3, timeout=10))
            second = await peer.stream()
            (req2,) = await second.recvs(1)
            assert req2.recv.request_id == req1.recv.request_id
            second.write(*reply(req2.call_id, np.array([5])))
            assert (await r).item.value.tolist() == [5]
            # Answered: the id is settled, a later recv of the key is a new request.
            r = asyncio.ensure_future(client.recv(K1, step_id=3, timeout=10))
            (req3,) = await second.recvs(1)
            assert req3.recv.request_id != req1.recv.request_id
            second.write(*reply(req3.call_id, np.array([6])))
            await r
            # Another key, or another step, never takes the id.
            r = asyncio.ensure_future(client.recv(K2, step_id=3, timeout=10))
            (req4,) = await second.recvs(1)
            assert req4.recv.request_id not in (req1.recv.request_id, req3.recv.request_id)
            second.write(*reply(req4.call_id, np.array([7])))
            await r
    run(main(), 20)


def test_an_orphan_whose_cancel_never_got_an_answer_keeps_its_request_id_when_the_stream_breaks():
    async def main():
        async with scripted() as (peer, client):
            side = await connected(peer, client)
            r = asyncio.ensure_future(client.recv(K1, step_id=2, timeout=0.2))
            (req1,) = await side.recvs(1)
            with pytest.raises(DeadlineExceeded):
                await r
            assert (await side.next()).WhichOneof("kind") == "cancel"
            side.abort(grpc.StatusCode.UNAVAILABLE, "the cable")  # the cancel is never answered
            await until(lambda: not client.live_stream(), what="the client to see the stream end")
            r = asyncio.ensure_future(client.recv(K1, step_id=2, timeout=10))
            again = await peer.stream()
            (req2,) = await again.recvs(1)
            assert req2.recv.request_id == req1.recv.request_id
            again.write(*reply(req2.call_id, np.array([1])))
            await r
    run(main(), 20)


def test_every_request_id_left_in_doubt_for_a_key_is_asked_again_oldest_first():
    """Two recvs of one key cut off by one broken stream (one gave up and was
    waiting for its cancel's answer, the other had asked after it): the
    producer may have taken a tensor for each, so both ids stay in doubt, and
    the next recvs of the key ask with them in the order they were taken (one
    id per key lost the older one: its tensor, taken and never delivered,
    was lost). A recv that gives up before it could ask with its id (no
    stream yet) leaves it in doubt as well."""
    async def main():
        async with scripted(reconnect_attempts=0) as (peer, client):
            side = await connected(peer, client)
            req1, later, req2 = await _gave_up_then_asked_again(client, side)
            side.abort(grpc.StatusCode.UNAVAILABLE, "the cable")
            with pytest.raises(PeerUnavailable):
                await later
            asked = []
            for value in (1, 2):
                r = asyncio.ensure_future(client.recv(K1, step_id=2, timeout=10))
                again = side if asked else await peer.stream()
                side = again
                (req,) = await again.recvs(1)
                asked.append(req.recv.request_id)
                again.write(*reply(req.call_id, np.array([value])))
                assert (await r).item.value.tolist() == [value]
            assert asked == [req1.recv.request_id, req2.recv.request_id]
            assert not client.in_doubt
            # in doubt, and given up before a stream was there to ask on: still in doubt
            client.in_doubt.add(2, K2, 4242)
            await peer.server.stop(0)
            side.abort(grpc.StatusCode.UNAVAILABLE, "gone")
            await until(lambda: not client.live_stream(), what="the client to see the stream end")
            with pytest.raises((PeerUnavailable, DeadlineExceeded)):
                await client.recv(K2, step_id=2, timeout=0.5)
            assert client.in_doubt.ids(2, K2) == [4242]
    run(main(), 20)


def test_a_recv_the_producer_answered_with_an_error_does_not_keep_its_id():
    async def main():
        async with scripted() as (peer, client):
            side = await connected(peer, client)
            r = asyncio.ensure_future(client.recv(K1, step_id=2, timeout=10))
            (req1,) = await side.recvs(1)
            side.write(error_frame(req1.call_id, errors.Aborted("step 2 aborted")))
            with pytest.raises(errors.Aborted):
                await r
            r = asyncio.ensure_future(client.recv(K1, step_id=2, timeout=10))
            (req2,) = await side.recvs(1)
            assert req2.recv.request_id != req1.recv.request_id
            side.write(*reply(req2.call_id, np.array([1])))
            await r
    run(main(), 20)


async def _on_its_way(peer: ScriptedPeer, client: PeerClient, plane: DescriptorPlane, timeout: float):
    """A recv of K1 (step 1) answered with a descriptor: its bytes are on their
    way outside the stream (a transfer posted to ``plane``)."""
    side = await connected(peer, client)
    r = asyncio.ensure_future(client.recv(K1, step_id=1, timeout=timeout))
    (req,) = await side.recvs(1)
    side.write(_descriptor(req.call_id, TensorMeta(np.dtype(np.int64), (2,))))
    await until(lambda: plane.arrivals, what="the transfer to be posted")
    return side, req, r


def test_an_mpi_transfer_whose_stream_ends_still_lands_in_its_recv():
    """A producer that stops ends its stream once its sends are done: the bytes
    land just after. The recv waits for them (within the reconnect window) and
    is never asked again."""
    async def main():
        plane = DescriptorPlane()
        kept = []
        async with scripted(planes=_inline_planes([plane]), reconnect_attempts=3,
                            on_unclaimed=lambda *a: kept.append(a)) as (peer, client):
            side, req, r = await _on_its_way(peer, client, plane, 10)
            side.end()
            await until(lambda: not client.live_stream(), what="the client to see the stream end")
            assert not r.done()
            (fut, _), = plane.arrivals
            fut.set_result(np.array([4, 2]))
            assert (await r).item.value.tolist() == [4, 2]
            assert len(peer.sides) == 1  # not asked again
            assert kept == []  # delivered once, to its recv
    run(main(), 20)


def test_closing_the_client_ends_the_wait_for_a_cut_transfer_at_once():
    async def main():
        plane = DescriptorPlane()
        async with scripted(planes=_inline_planes([plane])) as (peer, client):
            side, req, r = await _on_its_way(peer, client, plane, 20)
            side.end()
            await until(lambda: not client.live_stream(), what="the client to see the stream end")
            assert not r.done()  # waiting for the bytes (the 30 s window)
            await client.close()
            with pytest.raises(PeerUnavailable, match="closed locally.*kept for the next recv"):
                await asyncio.wait_for(r, 5)
    run(main(), 20)


def test_a_recv_whose_transfer_was_cut_from_its_stream_keeps_its_own_deadline():
    async def main():
        plane = DescriptorPlane()
        kept = []
        async with scripted(planes=_inline_planes([plane]), on_unclaimed=lambda *a: kept.append(a)) as (peer, client):
            side, req, r = await _on_its_way(peer, client, plane, 0.5)
            side.abort(grpc.StatusCode.UNAVAILABLE, "ping timeout")
            with pytest.raises(DeadlineExceeded):  # the 30 s window does not outlast the recv's deadline
                await r
            (fut, _), = plane.arrivals
            fut.set_result(np.array([4, 2]))  # lands late: kept, not lost
            await until(lambda: kept, what="the late tensor to be kept")
            (step_id, k, fetched), = kept
            assert (step_id, k, fetched.item.value.tolist()) == (1, K1, [4, 2])
    run(main(), 20)


def test_an_mpi_transfer_cut_from_its_stream_fails_the_recv_after_the_window_and_lands_for_the_next_recv():
    async def main():
        plane = DescriptorPlane()
        # keepalive off: the reconnect window is connect_timeout
        async with scripted(planes=_inline_planes([plane]), reconnect_attempts=3, keepalive_time=0,
                            connect_timeout=1.0) as (peer, client):
            side, req, r = await _on_its_way(peer, client, plane, 10)
            side.abort(grpc.StatusCode.UNAVAILABLE, "ping timeout")
            # Fails once the window is over, not re-sent (a second transfer would
            # bring it twice).
            with pytest.raises(PeerUnavailable, match="did not land within 1s.*kept for the next recv"):
                await r
            assert len(peer.sides) == 1
            # The next recv asks the producer anew (the tensor was served: it waits)...
            r = asyncio.ensure_future(client.recv(K1, step_id=1, timeout=10))
            again = await peer.stream()
            (req2,) = await again.recvs(1)
            assert req2.recv.request_id != req.recv.request_id
            # ...and gets the bytes of the cut transfer when they land; its own
            # request is cancelled.
            (fut, _), = plane.arrivals
            fut.set_result(np.array([4, 2]))
            assert (await r).item.value.tolist() == [4, 2]
            assert (await again.next()).WhichOneof("kind") == "cancel"
    run(main(), 20)


def test_a_cut_transfer_landing_while_the_next_recv_waits_for_its_stream_is_taken_not_asked_again():
    """The cable is back, the next recv of the key waits for its stream, and the
    cut transfer lands meanwhile (MPI's connection came back first): the recv
    takes it from what the server keeps as it is about to ask, and asks nobody
    (the producer served the tensor once; asked again, it waits for another)."""
    async def main():
        plane = DescriptorPlane()
        kept = Kept()
        async with scripted(planes=_inline_planes([plane]), kept=kept, reconnect_attempts=3, keepalive_time=0,
                            connect_timeout=1.0) as (peer, client):
            side, req, r = await _on_its_way(peer, client, plane, 10)
            side.abort(grpc.StatusCode.UNAVAILABLE, "ping timeout")
            with pytest.raises(PeerUnavailable, match="kept for the next recv"):
                await r
            gate, waiting = asyncio.Event(), asyncio.Event()
            reconnect = client._reconnect

            async def slow_reconnect(deadline):
                waiting.set()
                await gate.wait()  # the channel comes back after the transfer landed
                await reconnect(deadline)

            client._reconnect = slow_reconnect
            r = asyncio.ensure_future(client.recv(K1, step_id=1, timeout=10))
            await asyncio.wait_for(waiting.wait(), 10)
            (fut, _), = plane.arrivals
            fut.set_result(np.array([4, 2]))
            await until(lambda: kept.has(1, K1), what="the landed tensor to be kept")
            gate.set()
            assert (await asyncio.wait_for(r, 5)).item.value.tolist() == [4, 2]
            assert not kept and not client.live_stream().pending
            assert all(not side.pending_requests() for side in peer.sides)
            # exactly once: the key is not answered again
            with pytest.raises(DeadlineExceeded):
                await client.recv(K1, step_id=1, timeout=0.3)
    run(main(), 30)


def test_a_batch_takes_what_is_kept_for_its_keys_as_each_part_leaves_and_asks_the_rest():
    """Kept for a key in each of a batch's two requests (they landed while it
    waited to ask): those are taken, not asked; the rest are asked in runs of
    neighbours, each call under its own id, and answered in key order. An id
    left in doubt for a key taken stays in doubt."""
    async def main():
        kept = Kept()
        async with scripted(kept=kept) as (peer, client):
            side = await connected(peer, client)
            kept.keep(2, LONG[1], Received(np.array([-1]), False), why=None)
            kept.keep(2, LONG[3], Received(np.array([-3]), False), why=None)
            client.in_doubt.add(2, LONG[1], 4242)
            r = asyncio.ensure_future(client.recv_batch(LONG, step_id=2))
            q0, q2 = await side.recvs(2)
            assert [q0.recv.rendezvous_key, q2.recv.rendezvous_key] == [LONG[0], LONG[2]]
            assert [list(m.recv_many.rendezvous_keys) for m in side.many[-2:]] == [LONG[:1], LONG[2:3]]
            side.write(*reply(q2.call_id, np.array([2])), *reply(q0.call_id, np.array([0])))
            assert [f.item.value.tolist() for f in await r] == [[0], [-1], [2], [-3]]
            assert not kept and not side.pending_requests()
            assert client.in_doubt.ids(2, LONG[1]) == [4242]
    run(main(), 20)


class _FailedChannel:
    """A channel gRPC reports as failed (it was up once) that comes back when asked."""

    def __init__(self) -> None:
        self.readied = 0

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return grpc.ChannelConnectivity.TRANSIENT_FAILURE

    async def channel_ready(self) -> None:
        self.readied += 1


def _probing(monkeypatch, answers: list) -> list:
    """asyncio.open_connection as the peer client's probe sees it: each call takes
    the next answer (an exception to raise, or None for a connection)."""
    calls = []

    class Writer:
        def close(self) -> None:
            pass

    async def open_connection(host, port):
        calls.append((host, port))
        answer = answers.pop(0)
        if answer is not None:
            raise answer
        return None, Writer()

    monkeypatch.setattr("rendezvous.rpc.peer.asyncio.open_connection", open_connection)
    return calls


def test_no_route_to_the_peer_is_probed_again_within_the_window(monkeypatch):
    """A link just back (its neighbour entry still failed) answers the probe with
    EHOSTUNREACH: silent for now, not gone. The probe asks again, and the recv
    goes on once the peer answers; a refused connection (the process is gone)
    fails at once."""
    import errno

    async def main():
        client = PeerClient(PEER, "127.0.0.1:9", Config.load({"keepalive_time": 1.0, "keepalive_timeout": 1.0},
                                                              env={}), planes=_inline_planes())
        client._channel = _FailedChannel()
        calls = _probing(monkeypatch, [OSError(errno.EHOSTUNREACH, "No route to host"),
                                       OSError(errno.ENETUNREACH, "Network is unreachable"), None])
        await client._reconnect(deadline=None)
        assert len(calls) == 3 and client._channel.readied == 1
        calls = _probing(monkeypatch, [ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")])
        with pytest.raises(PeerUnavailable, match="refused"):
            await client._reconnect(deadline=None)
        assert len(calls) == 1
        client._channel = None
    run(main(), 20)


# -- a batch from one peer (recv_batch) -----------------------------------------------------------


def test_a_batch_asks_every_key_at_once_and_answers_in_key_order():
    async def main():
        async with scripted() as (peer, client):
            side = await connected(peer, client)
            r = asyncio.ensure_future(client.recv_batch([K1, K2, K3], step_id=2))
            reqs = await side.recvs(3)
            assert [q.recv.rendezvous_key for q in reqs] == [K1, K2, K3]
            assert len(side.many) == 1 and list(side.many[0].recv_many.rendezvous_keys) == [K1, K2, K3]
            assert [q.call_id for q in reqs] == [side.many[0].call_id + i for i in range(3)]
            for q, v in reversed(list(zip(reqs, (1, 2, 3)))):  # answered in another order
                side.write(*reply(q.call_id, np.array([v])))
            assert [f.item.value.tolist() for f in await r] == [[1], [2], [3]]
    run(main(), 20)


def test_a_batch_whose_stream_breaks_asks_again_with_the_same_ids():
    async def main():
        async with scripted() as (peer, client):
            side = await connected(peer, client)
            r = asyncio.ensure_future(client.recv_batch([K1, K2], step_id=2))
            q1, q2 = await side.recvs(2)
            side.write(*reply(q1.call_id, np.array([1])))
            await until(lambda: not client.live_stream().pending.get(q1.call_id), what="the first answer")
            side.abort(grpc.StatusCode.UNAVAILABLE, "the cable")
            again = await peer.stream()
            (q2b,) = await again.recvs(1)
            assert q2b.recv.rendezvous_key == K2 and q2b.recv.request_id == q2.recv.request_id
            again.write(*reply(q2b.call_id, np.array([2])))
            assert [f.item.value.tolist() for f in await r] == [[1], [2]]
    run(main(), 20)


#: keys so long that three fill one RecvMany (MANY_REQUEST_BYTES): a batch of
#: four goes as two requests
LONG = [key(1, 0, f"{i}-" + "x" * 9000) for i in range(4)]


def test_a_large_batch_sends_its_first_request_before_making_the_rest():
    async def main():
        async with scripted() as (peer, client):
            side = await connected(peer, client)
            r = asyncio.ensure_future(client.recv_batch(LONG, step_id=2))
            reqs = await side.recvs(4)
            # the first RecvMany left in a message of its own (written while the
            # second was being made), not batched with the second as queued ones are
            first, second = (pb.StreamRequest.FromString(m) for m in side.raw[1:3])
            assert first.WhichOneof("kind") == "recv_many" and not first.batch
            assert list(first.recv_many.rendezvous_keys) == LONG[:3]
            assert list(second.recv_many.rendezvous_keys) == LONG[3:]
            for i, q in enumerate(reqs):
                side.write(*reply(q.call_id, np.array([i])))
            assert [f.item.value.tolist() for f in await r] == [[0], [1], [2], [3]]
    run(main(), 20)


def test_a_key_tuple_asked_again_is_sent_from_its_remembered_encoding_and_a_list_never_is():
    """A rank server asks the same key tuple every step: its RecvMany parts are
    encoded once and reused (the same bytes objects), and every request still
    names exactly the keys asked, in order. A list could change under its
    identity, so it is encoded afresh each time."""
    async def main():
        async with scripted() as (peer, client):
            side = await connected(peer, client)
            asked = tuple(LONG)
            seen: list[list[str]] = []
            for step, keys in enumerate([asked, asked, list(LONG)], start=2):
                r = asyncio.ensure_future(client.recv_batch(keys, step_id=step))
                reqs = await side.recvs(4)
                seen.append([q.recv.rendezvous_key for q in reqs])
                assert {q.recv.step_id for q in reqs} == {step}
                for i, q in enumerate(reqs):
                    side.write(*reply(q.call_id, np.array([i])))
                assert [f.item.value.tolist() for f in await r] == [[0], [1], [2], [3]]
                if step == 2:
                    first = client._key_parts(asked)
            assert seen == [LONG] * 3
            assert client._key_parts(asked) is first and [(a, b) for a, b, _ in first] == [(0, 3), (3, 4)]
            assert list(client._parts) == [id(asked)]  # the list was not kept
            mutable = list(LONG)
            client._key_parts(mutable)
            mutable.reverse()
            assert [many_keys_field([k.encode() for k in mutable[a:b]])
                    for a, b, _ in client._key_parts(mutable)] == [e for _, _, e in client._key_parts(mutable)]
    run(main(), 20)


class _FakeCall(CallBase):
    """A stream another way than gRPC (as the MPI request path opens them): what
    it is sent is kept; ``answer`` replies to each recv request it sees."""

    inline_path = Path.MPI

    def __init__(self, answer: bool) -> None:
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.asked: list[pb.RecvTensorRequest] = []
        self.many = 0  # RecvMany requests seen
        self._answer = answer

    async def write(self, message: bytes) -> None:
        msg = pb.StreamRequest.FromString(message)
        for one in [msg, *msg.batch]:
            kind = one.WhichOneof("kind")
            if kind == "recv":
                asked = [(one.call_id, one.recv)]
            elif kind == "recv_many":
                self.many += 1
                m = one.recv_many
                asked = [(one.call_id + i, pb.RecvTensorRequest(step_id=m.step_id, rendezvous_key=k,
                                                                request_id=m.request_ids[i]))
                         for i, k in enumerate(m.rendezvous_keys)]
            else:
                continue
            for call_id, recv in asked:
                self.asked.append(recv)
                if self._answer:
                    value = np.array([LONG.index(recv.rendezvous_key)])
                    for frame in reply(call_id, value):
                        self.inbox.put_nowait(frame)

    async def read(self):
        return await self.inbox.get()

    def cancel(self) -> None:
        self.inbox.put_nowait(EOF)


def test_a_batch_whose_stream_ends_while_its_first_request_leaves_asks_every_key_again():
    async def main():
        broken, fresh = _FakeCall(answer=False), _FakeCall(answer=True)
        calls = [broken, fresh]
        client = PeerClient(PEER, "mpi", Config.load({}, env={}), planes=_inline_planes(),
                            open_call=lambda: calls.pop(0))
        broken.inbox.put_nowait(EOF)  # read by the stream's reader in its first turn
        try:
            got = await client.recv_batch(LONG, step_id=2)
        finally:
            await client.close()
        assert [f.item.value.tolist() for f in got] == [[0], [1], [2], [3]]
        # asked once each on the new stream, together (as the batch's RecvMany
        # parts), with the ids they were first asked with
        assert [q.rendezvous_key for q in fresh.asked] == LONG and fresh.many == 2
        first_asked = [q.request_id for q in broken.asked]  # (what left before the stream ended)
        assert [q.request_id for q in fresh.asked][:len(first_asked)] == first_asked
        assert len({q.request_id for q in fresh.asked}) == 4
    run(main(), 20)


class _NonWaitingCall(CallBase):
    """The MPI request path's call: requests handed over without waiting, replies
    handed to the stream's dispatch as they arrive; its reader never gets one."""

    inline_path = Path.MPI

    def __init__(self) -> None:
        self.sent: list[pb.StreamRequest] = []
        self.dispatch = None
        self._end = asyncio.get_running_loop().create_future()

    def write_nowait(self, message: bytes) -> bool:
        self.sent.append(pb.StreamRequest.FromString(message))
        return True

    async def write(self, message: bytes) -> None:
        raise AssertionError("a request with nothing queued before it is handed over at once")

    def deliver_to(self, dispatch) -> None:
        self.dispatch = dispatch

    async def read(self):
        return await self._end

    def cancel(self) -> None:
        if not self._end.done():
            self._end.set_result(EOF)


def test_on_a_call_that_takes_messages_at_once_a_recv_needs_no_reader_or_writer_turn():
    async def main():
        call = _NonWaitingCall()
        client = PeerClient(PEER, "mpi", Config.load({}, env={}), planes=_inline_planes(), open_call=lambda: call)
        try:
            r = asyncio.ensure_future(client.recv(K1, step_id=2, timeout=10))
            await until(lambda: call.sent, what="the request")
            (q,) = call.sent
            assert q.recv.rendezvous_key == K1
            assert all(call.dispatch(frame) for frame in reply(q.call_id, np.array([5])))
            assert (await r).item.value.tolist() == [5]
        finally:
            await client.close()
    run(main(), 20)


def test_on_such_a_call_what_one_turn_asks_leaves_packed_in_one_message():
    """Requests and cancels made in one turn leave at its end as one message
    (on the MPI request path one MPI message, not one per recv or cancel)."""
    async def main():
        call = _NonWaitingCall()
        client = PeerClient(PEER, "mpi", Config.load({}, env={}), planes=_inline_planes(), open_call=lambda: call)
        try:
            recvs = [asyncio.ensure_future(client.recv(k, step_id=2, timeout=10)) for k in (K1, K2, K3)]
            await until(lambda: call.sent, what="the requests")
            (asked,) = call.sent
            assert list(asked.recv_many.rendezvous_keys) == [K1, K2, K3]
            for r in recvs:
                r.cancel()
            await asyncio.gather(*recvs, return_exceptions=True)
            await until(lambda: len(call.sent) == 2, what="the cancels")
            cancels = call.sent[1].batch
            assert [c.WhichOneof("kind") for c in cancels] == ["cancel"] * 3
            assert [c.call_id for c in cancels] == [asked.call_id + i for i in range(3)]
        finally:
            await client.close()
    run(main(), 20)


def test_a_batch_with_an_error_keeps_what_arrived_and_cancels_the_rest():
    async def main():
        kept = []
        async with scripted(on_unclaimed=lambda *a: kept.append(a)) as (peer, client):
            side = await connected(peer, client)
            r = asyncio.ensure_future(client.recv_batch([K1, K2, K3], step_id=2))
            q1, q2, q3 = await side.recvs(3)
            side.write(*reply(q1.call_id, np.array([1])))
            await until(lambda: not client.live_stream().pending.get(q1.call_id), what="the first answer")
            side.write(error_frame(q2.call_id, errors.Aborted("step 2 aborted")))
            with pytest.raises(BatchFailed) as info:
                await r
            assert list(info.value.failures) == [1] and isinstance(info.value.failures[1], errors.Aborted)
            assert [(k, s) for s, k, _ in kept] == [(K1, 2)]  # the arrived one goes to the server
            assert (await side.next()).WhichOneof("kind") == "cancel"  # the third is withdrawn
    run(main(), 20)


# -- group replies (many calls answered by one frame) ------------------------------------------


def _group(calls: list[tuple[int, np.ndarray]]) -> bytes:
    arrays = [v for _, v in calls]
    return groups.group_frame([c for c, _ in calls], arrays, groups.layout(arrays))


def test_a_group_reply_answers_the_calls_it_names_in_any_order():
    async def main():
        async with scripted() as (peer, client):
            side = await connected(peer, client)
            r = asyncio.ensure_future(client.recv_batch([K1, K2, K3], step_id=2))
            q1, q2, q3 = await side.recvs(3)
            side.write(_group([(q3.call_id, np.array([3.0, 3.5])), (q1.call_id, np.arange(6).reshape(2, 3))]))
            side.write(*reply(q2.call_id, np.array([2])))
            got = await r
            assert [f.item.value.tolist() for f in got] == [[[0, 1, 2], [3, 4, 5]], [2], [3.0, 3.5]]
            assert got[0].item.value.shape == (2, 3) and all(f.path is Path.GRPC for f in got)
    run(main(), 20)


def test_a_group_answering_a_recv_that_gave_up_is_kept():
    async def main():
        kept = []
        async with scripted(on_unclaimed=lambda *a: kept.append(a)) as (peer, client):
            side = await connected(peer, client)
            with pytest.raises(errors.DeadlineExceeded):
                await client.recv(K1, step_id=3, timeout=0.2)
            (q,) = [await side.next()]
            assert (await side.next()).WhichOneof("kind") == "cancel"
            side.write(_group([(q.call_id, np.array([7]))]))  # the producer had started it
            await until(lambda: kept, what="the late tensor to be kept")
            (step, k, fetched), = kept
            assert (step, k, fetched.item.value.tolist()) == (3, K1, [7])
    run(main(), 20)


@pytest.mark.parametrize("lie", ["too short", "unknown dtype", "no payload"])
def test_a_group_that_lies_fails_its_calls_with_internal(lie):
    async def main():
        async with scripted() as (peer, client):
            side = await connected(peer, client)
            r = asyncio.ensure_future(client.recv_batch([K1, K2], step_id=2))
            q1, q2 = await side.recvs(2)
            value = np.array([1.0])
            lay = groups.layout([value])
            if lie == "too short":  # announces 1,000 elements, carries one
                lay.dims = np.array([1000], "<u8").tobytes()
                lay.ranks = np.array([1], "<u4").tobytes()
            elif lie == "unknown dtype":
                lay.dtypes = bytes([200])
            side.write(groups.group_frame([q1.call_id], None if lie == "no payload" else [value], lay))
            with pytest.raises(BatchFailed) as info:
                await r
            assert all(isinstance(e, errors.Internal) for e in info.value.failures.values())
            assert "malformed reply" in str(next(iter(info.value.failures.values())))
    run(main(), 20)


# -- coalescing: recvs issued together leave as one RecvMany ------------------------------------


def test_recvs_gathered_in_one_turn_leave_as_one_batched_request():
    async def main():
        async with scripted() as (peer, client):
            side = await connected(peer, client)
            got = asyncio.ensure_future(asyncio.gather(*(client.recv(k, step_id=5, timeout=10) for k in (K1, K2, K3))))
            reqs = await side.recvs(3)
            assert len(side.many) == 1 and list(side.many[0].recv_many.rendezvous_keys) == [K1, K2, K3]
            assert len({q.recv.request_id for q in reqs}) == 3 and all(q.recv.request_id for q in reqs)
            side.write(_group([(q.call_id, np.array([i])) for i, q in enumerate(reqs)]))
            assert [f.item.value.tolist() for f in await got] == [[0], [1], [2]]
            # a recv on its own still goes as a plain request
            one = asyncio.ensure_future(client.recv(K1, step_id=6, timeout=10))
            (q,) = await side.recvs(1)
            side.write(*reply(q.call_id, np.array([9])))
            assert (await one).item.value.tolist() == [9] and len(side.many) == 1
    run(main(), 20)


def test_a_cancel_never_overtakes_the_request_it_cancels():
    async def main():
        async with scripted() as (peer, client):
            side = await connected(peer, client)
            stream = client.live_stream()
            pending = PendingCall(asyncio.get_running_loop().create_future(), K1, 5, None, 77)
            # submitted and given up in the same turn: the request still waits for the turn's end
            stream.submit(1000, pending, 5, K1.encode(), 77, None)
            assert stream.cancel(1000, pending)
            first, second = await side.next(), await side.next()
            assert (first.WhichOneof("kind"), second.WhichOneof("kind")) == ("recv", "cancel")
            assert first.call_id == second.call_id == 1000 and first.recv.request_id == 77
    run(main(), 20)


def test_a_batch_waits_on_one_future_resolved_by_its_calls():
    """recv_batch's calls are their own outcomes, not futures: the batch's one
    future resolves when all are answered, at the first failure, or (a stream
    broke under some) once every call has settled."""
    from rendezvous.errors import NotFound, PeerUnavailable
    from rendezvous.rpc.consumer_stream import Broken
    from rendezvous.rpc.batch import _Batch, _Call

    def calls(batch):
        return (_Call(batch, f"k{i}", 1, None, i + 1) for i in range(3))

    async def main():
        loop = asyncio.get_running_loop()
        batch = _Batch(loop, 3)
        a, b, c = calls(batch)
        a.set_result(1)
        b.set_result(2)
        assert not batch.waiter.done() and (a.result(), b.done(), c.done()) == (1, True, False)
        c.set_result(3)
        assert batch.waiter.done() and c.future is c  # the stream sees one object per call
        with pytest.raises(asyncio.InvalidStateError):
            c.set_result(4)  # answered once
        batch = _Batch(loop, 3)
        a, b, c = calls(batch)
        b.set_exception(NotFound("no"))
        assert batch.waiter.done() and isinstance(b.exception(), NotFound)
        with pytest.raises(NotFound):
            b.result()
        assert c.cancel() and c.cancelled() and not c.cancel()
        with pytest.raises(asyncio.CancelledError):
            c.exception()
        batch = _Batch(loop, 3)
        a, b, c = calls(batch)
        a.set_exception(Broken(PeerUnavailable("gone")))
        b.set_exception(NotFound("no"))
        assert not batch.waiter.done()  # a broken stream: every call settles first
        c.set_exception(Broken(PeerUnavailable("gone")))
        assert batch.waiter.done()
    run(main())


def test_a_batchs_call_starts_as_a_pending_recv_does():
    """A batch's call sets its PendingCall fields itself (once per key, without
    PendingCall.__init__): every field a PendingCall has, with the same values."""
    from rendezvous.rpc.consumer_stream import PendingCall
    from rendezvous.rpc.batch import _Batch, _Call

    async def main():
        loop = asyncio.get_running_loop()
        call = _Call(_Batch(loop, 1), "k", 7, "where", 42)
        pending = PendingCall(loop.create_future(), "k", 7, "where", 42)
        for name in PendingCall.__slots__:
            if name != "future":
                assert getattr(call, name) == getattr(pending, name), name
        assert call.future is call and not call.done()
    run(main())


def test_a_first_connect_cut_short_by_the_recvs_deadline_is_deadline_exceeded(monkeypatch):
    """A recv whose deadline comes before the connect timeout waits for the
    first connection only that long; when that wait ends (its timer may fire a
    hair before the deadline, as the loop's do), the recv fails with
    DEADLINE_EXCEEDED, never UNAVAILABLE: the peer may be fine, the recv was
    short. (It raised PeerUnavailable "could not connect within 0.005s" in a
    race of 2-20 ms deadlines.)

    Checked to fail: with the wait's end judged by the clock (loop.time() >=
    deadline), the early timer made it UNAVAILABLE."""
    real_wait_for = asyncio.wait_for

    async def early_timer(aw, timeout):
        if getattr(aw, "__qualname__", "").endswith("channel_ready"):
            aw.close()
            raise TimeoutError  # fired before the deadline, as a loop timer may
        return await real_wait_for(aw, timeout)

    async def main():
        port = free_port()  # nothing listens: the first connect never completes
        client = PeerClient(PEER, f"127.0.0.1:{port}", Config.load({}, env={}), planes=_inline_planes())
        monkeypatch.setattr(asyncio, "wait_for", early_timer)
        try:
            with pytest.raises(errors.DeadlineExceeded, match="never reached"):
                await client.recv(key(1, 0, "x"), 1, timeout=5)
        finally:
            monkeypatch.undo()
            await client.close()
    run(main(), 30)
