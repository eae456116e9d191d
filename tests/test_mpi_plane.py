"""The MPI data plane (rendezvous/mpi/plane.py) in process, without MPI: a
scripted world (identity, TAG_UB) and a scripted progress engine that records
the sends and receives the plane posts and lets the test complete them (a
delivery copies the sent bytes into the posted receive buffer)."""

from __future__ import annotations

import asyncio
import gc
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from google.protobuf import any_pb2

from rendezvous.codec import groups
from rendezvous.codec.parsing import ReplyHead, parse_stream_frame
from rendezvous.codec.replies import descriptor_response, unary_response, with_call_id
from rendezvous.buffers import RecvBuffers
from rendezvous.config import Config
from rendezvous.devices import CPU, Devices, Placement
from rendezvous.errors import Internal, InvalidArgument
from rendezvous.testing.fakegpu import FakeBackend
from rendezvous.mpi.plane import MpiPlane
from rendezvous.stats import Stats
from rendezvous.items import Received
from rendezvous.codec.tensors import TensorMeta, decode_meta
from rendezvous.transport import Path, Planes
from rendezvous.transport.inline import InlinePlane
from rendezvous.v1 import rendezvous_pb2 as pb

from conftest import run

pytestmark = pytest.mark.timeout(60)

WORLD = 0x5EED_0000_0000_0001
ENDPOINT_URL = "type.googleapis.com/rendezvous.v1.MpiEndpoint"
TRANSFER_URL = "type.googleapis.com/rendezvous.v1.MpiTransfer"


# --- the scripted world and engine ------------------------------------------------

class FakeMPI:
    TAG_UB = object()  # an attribute key, as mpi4py's MPI.TAG_UB is


class FakeComm:
    def __init__(self, tag_ub: int | None) -> None:
        self.tag_ub = tag_ub

    def Get_attr(self, attr: Any) -> int | None:
        assert attr is FakeMPI.TAG_UB
        return self.tag_ub


class FakeWorld:
    MPI = FakeMPI

    def __init__(self, rank: int = 0, size: int = 4, world_id: int = WORLD, tag_ub: int | None = 32767,
                 cuda_aware: bool = False) -> None:
        self.comm = FakeComm(tag_ub)
        self.rank, self.size, self.world_id = rank, size, world_id
        self._cuda_aware = cuda_aware
        self.probes = 0

    def probe_cuda_aware(self) -> tuple[bool, str]:
        self.probes += 1
        return self._cuda_aware, "the fake world's probe"


@dataclass
class Op:
    kind: str
    buf: Any
    rank: int
    tag: int
    chunk: int
    future: asyncio.Future


class FakeEngine:
    """Records what the plane posts; the test completes it."""

    def __init__(self) -> None:
        self.sends: list[Op] = []
        self.recvs: list[Op] = []
        self.pipelines: list[tuple[Any, asyncio.Future]] = []
        self.posted = asyncio.Event()

    def _op(self, kind: str, buf: Any, rank: int, tag: int, chunk: int) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        (self.sends if kind == "send" else self.recvs).append(Op(kind, buf, rank, tag, chunk, fut))
        self.posted.set()
        return fut

    def isend(self, buf, rank, tag, chunk):
        return self._op("send", buf, rank, tag, chunk)

    def irecv(self, buf, rank, tag, chunk):
        return self._op("recv", buf, rank, tag, chunk)

    def pipeline(self, make):
        fut = asyncio.get_running_loop().create_future()
        self.pipelines.append((make, fut))
        self.posted.set()
        return fut

    async def next_recv(self) -> Op:
        while not self.recvs:
            self.posted.clear()
            await asyncio.wait_for(self.posted.wait(), 10)
        return self.recvs[0]


async def complete(fut: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Complete an engine future and wait until every done-callback registered
    before now (the plane's) has run."""
    ran = asyncio.get_running_loop().create_future()
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
    fut.add_done_callback(lambda f: ran.set_result(None))
    await ran


async def deliver(send: Op, recv: Op) -> None:
    """What MPI does for a matched pair: the sent bytes land in the receive buffer."""
    src = np.asarray(send.buf).reshape(-1).view(np.uint8)
    dst = np.asarray(recv.buf).reshape(-1).view(np.uint8)
    assert src.nbytes == dst.nbytes and send.tag == recv.tag
    dst[:] = src
    await complete(recv.future)
    await complete(send.future)


def config(**overrides) -> Config:
    return Config.load({"cuda_aware": False, **overrides}, env={})


def make_plane(world: FakeWorld | None = None, engine: FakeEngine | None = None, stats: Stats | None = None,
               devices: Devices | None = None, **cfg) -> MpiPlane:
    return MpiPlane(world or FakeWorld(), engine or FakeEngine(), config(**cfg), stats or Stats(),
                    buffers=RecvBuffers(), devices=devices or Devices([]))


def request(world_id: int = WORLD, rank: int = 1, max_chunk_bytes: int = 0) -> pb.RecvTensorRequest:
    req = pb.RecvTensorRequest(step_id=1, rendezvous_key="k")
    req.transport_options.Pack(pb.MpiEndpoint(world_id=world_id, rank=rank, max_chunk_bytes=max_chunk_bytes))
    return req


def request_from(consumer: MpiPlane, placement=None) -> pb.RecvTensorRequest:
    """The request a consumer plane's offer makes."""
    req = pb.RecvTensorRequest(step_id=1, rendezvous_key="k")
    req.transport_options.ParseFromString(consumer.offer(placement))
    return req


def planned(plane: MpiPlane, req, item: Received):
    """``plane.plan(req, item)``, its transfer started as a stream starts it
    when it hands the descriptor over."""
    reply = plane.plan(req, item)
    if reply is not None and reply.carry is not None:
        reply.carry.start()
    return reply


def first_frame(reply, call_id: int = 3) -> tuple[bytes, ReplyHead]:
    (buf,) = list(reply.stream_frames(call_id))
    frame = parse_stream_frame(buf)
    assert frame.call_id == call_id and frame.head is not None
    return buf, frame.head


def transfer_of(buf: bytes, head: ReplyHead) -> pb.MpiTransfer:
    a, b = head.transport_options
    wrapped = any_pb2.Any.FromString(bytes(buf[a:b]))
    assert wrapped.type_url == TRANSFER_URL
    transfer = pb.MpiTransfer()
    assert wrapped.Unpack(transfer)
    return transfer


def descriptor(meta: TensorMeta, *, world_id: int = WORLD, source_rank: int = 0, tag: int = 5,
               nbytes: int | None = None, chunk_bytes: int = 1 << 20,
               url: str = TRANSFER_URL) -> tuple[bytes, ReplyHead]:
    transfer = pb.MpiTransfer(world_id=world_id, source_rank=source_rank, tag=tag,
                              nbytes=meta.nbytes if nbytes is None else nbytes, chunk_bytes=chunk_bytes)
    options = any_pb2.Any(type_url=url, value=transfer.SerializeToString()).SerializeToString()
    buf = with_call_id(1, descriptor_response(meta, options))
    return buf, parse_stream_frame(buf).head


# --- construction and offer -------------------------------------------------------

def test_cuda_awareness_is_probed_only_when_not_configured():
    world = FakeWorld(cuda_aware=True)
    plane = MpiPlane(world, FakeEngine(), Config.load({}, env={}), Stats(), buffers=RecvBuffers(),
                     devices=Devices([]))
    assert world.probes == 1 and plane.cuda_aware is True and plane.cuda_aware_source == "the fake world's probe"
    world = FakeWorld(cuda_aware=True)
    plane = make_plane(world)  # cuda_aware=False configured
    assert world.probes == 0 and plane.cuda_aware is False and plane.cuda_aware_source == "RENDEZVOUS_CUDA_AWARE"


def _endpoint(offer: bytes) -> pb.MpiEndpoint:
    wrapped = any_pb2.Any.FromString(offer)
    assert wrapped.type_url == ENDPOINT_URL
    endpoint = pb.MpiEndpoint()
    assert wrapped.Unpack(endpoint)
    return endpoint


def test_offer_is_the_endpoint_and_the_staged_one_for_gpu_placements():
    plane = make_plane(FakeWorld(rank=2), gpu_staging_chunk_bytes=1 << 16)
    for placement in (None, CPU):
        e = _endpoint(plane.offer(placement))
        assert (e.world_id, e.rank, e.max_chunk_bytes) == (WORLD, 2, 0)
    e = _endpoint(plane.offer(Placement("GPU", 1)))
    assert (e.world_id, e.rank, e.max_chunk_bytes) == (WORLD, 2, 1 << 16)
    aware = make_plane(FakeWorld(rank=2), cuda_aware=True)
    assert _endpoint(aware.offer(Placement("GPU", 0))).max_chunk_bytes == 0  # no staging: whole messages


# --- producer -----------------------------------------------------------------------

def test_plan_returns_a_descriptor_whose_send_of_the_arrays_own_buffer_starts_when_handed_over():
    async def main():
        engine, stats = FakeEngine(), Stats()
        plane = make_plane(FakeWorld(rank=0), engine, stats, mpi_chunk_bytes=1000)
        consumer = make_plane(FakeWorld(rank=3))
        arr = np.arange(32 * 32, dtype=np.float32).reshape(32, 32)
        item = Received(arr, False)
        reply = plane.plan(request_from(consumer), item)
        # planned, not posted: until its stream hands the descriptor over, the
        # reply holds its item (it goes back to the table if dropped)
        assert reply is not None and reply.path is Path.MPI and not reply.committed and reply.item is item
        assert reply.carry is not None and engine.sends == []
        with pytest.raises(Internal):
            reply.unary()  # only a stream starts the transfer
        reply.carry.start()
        (send,) = engine.sends
        with pytest.raises(Internal, match="started twice"):
            reply.carry.start()
        assert np.shares_memory(send.buf, arr) and send.buf.nbytes == arr.nbytes  # no copy
        assert (send.rank, send.tag, send.chunk) == (3, 1, 1000)
        buf, head = first_frame(reply)
        t = transfer_of(buf, head)
        assert (t.world_id, t.source_rank, t.tag, t.nbytes, t.chunk_bytes) == (WORLD, 0, 1, arr.nbytes, 1000)
        meta, cs, ce = decode_meta(buf, *head.tensor)
        assert meta == TensorMeta(np.dtype(np.float32), (32, 32)) and cs == ce  # no content inline
        assert not head.is_dead
        # the server's planes route such a reply back to this plane
        inline = InlinePlane(chunk_bytes=1 << 20, buffers=RecvBuffers(), devices=Devices([]),
                             staging=(4096, 2), stats=stats)
        planes = Planes([inline])
        planes.register(plane)
        assert planes.for_reply(buf, head) is plane
        assert stats.snapshot()["grpc"]["fallbacks"] == 0
        await complete(send.future)
    run(main(), 20)


def test_a_descriptor_dropped_before_it_is_handed_over_posts_nothing_and_frees_its_tag():
    """A reply cancelled or cut off with its stream before its descriptor left:
    no send waits in the network for a receive nobody will post, and its tag
    is no longer held."""
    async def main():
        engine = FakeEngine()
        plane = make_plane(FakeWorld(rank=0), engine)
        arr = np.ones(4096, np.uint8)
        dropped = plane.plan(request(), Received(arr, False))
        assert plane._tags.busy[1] == {transfer_of(*first_frame(dropped)).tag}
        dropped.carry.release()
        dropped.carry.release()  # once is what counts
        assert engine.sends == [] and plane._tags.busy[1] == set()
        with pytest.raises(Internal, match="started twice"):
            dropped.carry.start()  # released: never started after all
        assert engine.sends == []
        # a group's fusion buffer alike
        carry = plane.plan_group(request(), [arr, arr], groups.layout([arr, arr]))
        assert carry is not None and len(plane._tags.busy[1]) == 1
        carry.release()
        assert engine.sends == [] and plane._tags.busy[1] == set()
        # started, the tag is held until the send completes
        carry = plane.plan_group(request(), [arr, arr], groups.layout([arr, arr]))
        carry.start()
        (send,) = engine.sends
        assert len(plane._tags.busy[1]) == 1
        await complete(send.future)
        assert plane._tags.busy[1] == set()
    run(main(), 20)


def test_plan_of_a_non_contiguous_array_sends_its_contiguous_bytes():
    async def main():
        engine = FakeEngine()
        plane = make_plane(engine=engine)
        arr = np.arange(4096, dtype=np.int64)[::2]
        reply = planned(plane, request(), Received(arr, False))
        (send,) = engine.sends
        assert np.asarray(send.buf).tobytes() == arr.tobytes()
        assert transfer_of(*first_frame(reply)).nbytes == arr.nbytes == 2048 * 8
    run(main(), 20)


def test_consumer_chunk_size_limits_the_chunk():
    async def main():
        engine = FakeEngine()
        plane = make_plane(engine=engine, mpi_chunk_bytes=1 << 20)
        reply = planned(plane, request(max_chunk_bytes=4096), Received(np.zeros(1 << 16, np.uint8), False))
        assert engine.sends[0].chunk == 4096 and transfer_of(*first_frame(reply)).chunk_bytes == 4096
    run(main(), 20)


def test_tags_are_unique_per_rank_while_in_flight_and_reused_after():
    async def main():
        engine = FakeEngine()
        plane = make_plane(FakeWorld(tag_ub=4), engine)
        arr = np.ones(2048, np.uint8)

        def plan(rank: int = 1) -> int:
            t = transfer_of(*first_frame(planned(plane, request(rank=rank), Received(arr, False)))).tag
            assert engine.sends[-1].tag == t
            return t

        a, b = plan(), plan()
        assert (a, b) == (1, 2)
        assert plan(rank=2) == 1  # another rank has tags of its own
        await complete(engine.sends[0].future)  # a done: its tag is free again, but tags cycle
        c, d = plan(), plan()
        assert (c, d) == (3, 4)
        assert len({b, c, d}) == 3  # in flight at once: all different
        await complete(engine.sends[1].future)
        await complete(engine.sends[3].future)
        assert plan() == 1  # wrapped around past TAG_UB, to a tag no longer in flight
    run(main(), 20)


def test_every_tag_up_to_tag_ub_can_be_in_flight():
    """The capacity check once allowed one transfer fewer in flight than there are tags."""
    async def main():
        engine = FakeEngine()
        plane = make_plane(FakeWorld(tag_ub=3), engine)
        arr = np.ones(2048, np.uint8)
        tags = [transfer_of(*first_frame(planned(plane, request(), Received(arr, False)))).tag for _ in range(3)]
        assert tags == [1, 2, 3]
        with pytest.raises(Internal, match="in flight"):
            planned(plane, request(), Received(arr, False))
    run(main(), 20)


def fill(plane: MpiPlane, arr: np.ndarray, rank: int = 1) -> list[int]:
    """Plan sends to ``rank`` until its tags run out (Internal); the tags taken."""
    tags = []
    for _ in range(64):
        try:
            reply = planned(plane, request(rank=rank), Received(arr, False))
        except Internal as exc:
            assert "in flight" in exc.message
            return tags
        tags.append(transfer_of(*first_frame(reply)).tag)
    raise AssertionError(f"tags to rank {rank} never ran out: {tags}")


def test_all_tags_in_flight_is_internal_and_posts_nothing():
    async def main():
        engine = FakeEngine()
        plane = make_plane(FakeWorld(tag_ub=3), engine)
        tags = fill(plane, np.ones(2048, np.uint8))
        assert 2 <= len(tags) <= 3 and len(set(tags)) == len(tags) and set(tags) <= {1, 2, 3}
        assert [op.tag for op in engine.sends] == tags  # the refused plans posted nothing
    run(main(), 20)


def test_failed_send_counts_an_error_and_frees_its_tag():
    async def main():
        engine, stats = FakeEngine(), Stats()
        plane = make_plane(FakeWorld(tag_ub=2), engine, stats)
        arr = np.ones(2048, np.uint8)
        tags = fill(plane, arr)
        await complete(engine.sends[0].future, error=RuntimeError("MPI_ERR_TRUNCATE"))
        assert stats.snapshot()["mpi"]["errors"] == 1
        tag = transfer_of(*first_frame(planned(plane, request(), Received(arr, False)))).tag
        assert tag not in tags[1:]  # a tag free again, none still in flight
    run(main(), 20)


@pytest.mark.parametrize("case, value, req, fallbacks", [
    ("below threshold", np.ones(1023, np.uint8), request(), 0),
    ("big strings", np.array([b"x" * 2000], dtype=object), request(), 1),
    ("small strings", np.array([b"x" * 10], dtype=object), request(), 0),
    ("fixed bytes", np.array([b"x" * 2000], dtype="S2000"), request(), 0),
    ("no endpoint", np.ones(4096, np.uint8), pb.RecvTensorRequest(step_id=1, rendezvous_key="k"), 1),
    ("another transport", np.ones(4096, np.uint8),
     pb.RecvTensorRequest(transport_options=any_pb2.Any(type_url="type.googleapis.com/x.Other")), 1),
    ("another world", np.ones(4096, np.uint8), request(world_id=WORLD + 2), 1),
    ("dead", None, request(), 0),
])
def test_plan_falls_back_to_inline(case, value, req, fallbacks):
    async def main():
        engine, stats = FakeEngine(), Stats()
        plane = make_plane(engine=engine, stats=stats)  # threshold 1024 bytes (the default)
        assert planned(plane, req, Received(value, value is None)) is None
        assert engine.sends == [] and engine.pipelines == []
        assert stats.snapshot()["grpc"]["fallbacks"] == fallbacks
        assert stats.snapshot()["mpi"]["fallbacks"] == 0
    run(main(), 20)


def test_optimal_path_off_never_plans():
    async def main():
        engine, stats = FakeEngine(), Stats()
        plane = make_plane(engine=engine, stats=stats, mpi_optimal_path=False)
        assert planned(plane, request(), Received(np.ones(1 << 16, np.uint8), False)) is None
        assert engine.sends == [] and stats.snapshot()["grpc"]["fallbacks"] == 0
    run(main(), 20)


@pytest.mark.parametrize("rank", [4, -1, 1000])
def test_endpoint_rank_outside_the_world_is_invalid_argument(rank):
    async def main():
        engine = FakeEngine()
        plane = make_plane(FakeWorld(size=4), engine)
        arr = np.ones(4096, np.uint8)
        with pytest.raises(InvalidArgument, match=f"rank {rank}"):
            planned(plane, request(rank=rank), Received(arr, False))
        assert engine.sends == []
        # no tag was taken for it
        assert transfer_of(*first_frame(planned(plane, request(rank=3), Received(arr, False)))).tag == 1
    run(main(), 20)


def test_unparseable_endpoint_is_invalid_argument_or_a_fallback():
    """A malformed MpiEndpoint once raised protobuf's DecodeError out of plan (answered INTERNAL)."""
    async def main():
        engine = FakeEngine()
        plane = make_plane(engine=engine)
        req = pb.RecvTensorRequest(transport_options=any_pb2.Any(type_url=ENDPOINT_URL, value=b"\x10\xff"))
        try:
            got = planned(plane, req, Received(np.ones(4096, np.uint8), False))
        except InvalidArgument:
            got = None
        assert got is None and engine.sends == []
    run(main(), 20)


@pytest.mark.parametrize("cuda_aware", [False, True])
def test_plan_of_a_gpu_tensor_posts_a_pipeline(cuda_aware):
    async def main():
        fake = FakeBackend()
        engine, stats = FakeEngine(), Stats()
        plane = make_plane(FakeWorld(tag_ub=2), engine, stats, devices=Devices([fake]), cuda_aware=cuda_aware,
                           gpu_staging_chunk_bytes=8192, mpi_chunk_bytes=1 << 20)
        host = np.arange(4096, dtype=np.float32)
        reply = planned(plane, request(), Received(fake.wrap(fake.array(host)), False))
        assert engine.sends == [] and len(engine.pipelines) == 1
        t = transfer_of(*first_frame(reply))
        assert t.nbytes == host.nbytes and t.tag == 1
        gpu = stats.gpu_snapshot()
        if cuda_aware:
            assert t.chunk_bytes == 1 << 20 and gpu["direct_sends"] == 1 and gpu["staged_sends"] == 0
        else:
            assert t.chunk_bytes == 8192 and gpu["staged_sends"] == 1 and gpu["staged_bytes"] == host.nbytes
        small = np.ones(2048, np.uint8)
        others = fill(plane, small)  # TAG_UB=2: every other tag to rank 1 now in flight too
        await complete(engine.pipelines[0][1])
        tag = transfer_of(*first_frame(planned(plane, request(), Received(small, False)))).tag
        assert tag not in others  # the pipeline's tag was given back
    run(main(), 20)


# --- consumer -----------------------------------------------------------------------

def test_receive_posts_a_receive_and_resolves_to_the_delivered_bytes():
    async def main():
        producer_engine, consumer_engine = FakeEngine(), FakeEngine()
        producer = make_plane(FakeWorld(rank=0), producer_engine, mpi_chunk_bytes=4096)
        consumer = make_plane(FakeWorld(rank=2), consumer_engine)
        arr = np.random.default_rng(3).standard_normal((64, 33)).astype(np.float64)
        reply = planned(producer, request_from(consumer), Received(arr, False))
        buf, head = first_frame(reply)
        arrival = consumer.receive(buf, head, None)
        assert arrival.path is Path.MPI and arrival.placed and arrival.pending is not None
        assert arrival.value is None and arrival.assembly is None
        got = asyncio.ensure_future(arrival.pending)
        recv = await consumer_engine.next_recv()
        send = producer_engine.sends[0]
        assert (recv.rank, recv.tag, recv.chunk) == (0, send.tag, 4096)
        assert recv.buf.dtype == np.float64 and recv.buf.shape == (64, 33)
        assert not got.done()
        await deliver(send, recv)
        value = await got
        assert value is recv.buf
        np.testing.assert_array_equal(value, arr)
    run(main(), 20)


def test_a_groups_fusion_buffer_is_received_into_a_reused_buffer():
    """A group's fusion buffer (many small tensors in one MPI message) lands in
    the plane's RecvBuffers: once the tensors viewing it are dropped, the next
    group of that size reuses it; while one is held, it is never written."""
    async def main():
        producer_engine, consumer_engine = FakeEngine(), FakeEngine()
        producer = make_plane(FakeWorld(rank=0), producer_engine)
        consumer = make_plane(FakeWorld(rank=2), consumer_engine)
        arrays = [np.full((256, 64), i, np.float32) for i in range(8)]  # 512 KiB: above the cache's 256 KiB

        async def one_group(start: int) -> list:
            lay = groups.layout(arrays)
            carry = producer.plan_group(request_from(consumer), arrays, lay)
            carry.start()
            options = carry.options
            frame = groups.group_frame(list(range(start, start + len(arrays))), None, lay, 0, options)
            group = groups.parse_group(frame, *parse_stream_frame(frame).group)
            landing = consumer.receive_group(frame, group)
            recv = await consumer_engine.next_recv()
            consumer_engine.recvs.remove(recv)
            await deliver(producer_engine.sends.pop(0), recv)
            return groups.views(group, await landing)

        first = await one_group(0)
        assert consumer.buffers.reused == 0
        held = await one_group(10)
        assert consumer.buffers.reused == 0 and not np.shares_memory(first[0], held[0])
        del first
        third = await one_group(20)
        assert consumer.buffers.reused == 1
        for i, (a, b) in enumerate(zip(held, third)):
            assert (a == i).all() and (b == i).all()
    run(main(), 20)


def test_an_mpi_error_fails_that_receive_with_internal_and_the_next_one_works():
    """docs/mpi.md: an MPI error fails that one recv with INTERNAL, never the process."""
    from rendezvous.errors import Internal

    async def main():
        producer_engine, consumer_engine = FakeEngine(), FakeEngine()
        producer = make_plane(FakeWorld(rank=0), producer_engine)
        consumer = make_plane(FakeWorld(rank=2), consumer_engine)
        arr = np.arange(4096, dtype=np.float32)
        buf, head = first_frame(planned(producer, request_from(consumer), Received(arr, False)))
        got = asyncio.ensure_future(consumer.receive(buf, head, None).pending)
        recv = await consumer_engine.next_recv()
        await complete(recv.future, error=Internal("MPI error receiving from rank 0: MPI_ERR_TRUNCATE"))
        with pytest.raises(Internal, match="MPI_ERR_TRUNCATE"):
            await got
        # the plane goes on: the next transfer is received
        buf, head = first_frame(planned(producer, request_from(consumer), Received(arr + 1, False)))
        consumer_engine.recvs.clear()
        got = asyncio.ensure_future(consumer.receive(buf, head, None).pending)  # posted here, at once
        recv = await consumer_engine.next_recv()
        await deliver(producer_engine.sends[-1], recv)
        np.testing.assert_array_equal(await got, arr + 1)
    run(main(), 20)


@pytest.mark.parametrize("bad, match", [
    (dict(world_id=WORLD + 1), "another MPI job"),
    (dict(nbytes=999), "999 bytes"),
    (dict(chunk_bytes=0), "chunk size"),
    (dict(url="type.googleapis.com/rendezvous.v1.Other"), "unknown transport"),
])
def test_bad_descriptors_are_internal_before_anything_is_posted(bad, match):
    async def main():
        engine = FakeEngine()
        plane = make_plane(FakeWorld(rank=1), engine)
        buf, head = descriptor(TensorMeta(np.dtype(np.int32), (10, 10)), **bad)
        with pytest.raises(Internal, match=match):
            plane.receive(buf, head, None)
        plane.drain(buf, head)  # drain refuses it quietly
        assert engine.recvs == [] and engine.pipelines == []
    run(main(), 20)


def test_descriptor_without_a_tensor_is_internal():
    async def main():
        engine = FakeEngine()
        plane = make_plane(engine=engine)
        buf = with_call_id(1, unary_response(Received(None, True)))
        head = parse_stream_frame(buf).head
        with pytest.raises(Internal, match="dtype and shape"):
            plane.receive(buf, head, None)
        assert engine.recvs == []
    run(main(), 20)


def test_good_descriptor_is_accepted():
    async def main():
        engine = FakeEngine()
        plane = make_plane(FakeWorld(rank=1), engine)
        buf, head = descriptor(TensorMeta(np.dtype(np.int32), (10, 10)), source_rank=3, tag=9, chunk_bytes=128)
        got = asyncio.ensure_future(plane.receive(buf, head, None).pending)
        recv = await engine.next_recv()
        assert (recv.rank, recv.tag, recv.chunk, recv.buf.nbytes) == (3, 9, 128, 400)
        recv.buf[...] = 7
        await complete(recv.future)
        assert (await got).sum() == 700
    run(main(), 20)


def test_drain_posts_a_receive_and_swallows_its_result():
    async def main():
        loop = asyncio.get_running_loop()
        reported: list[dict] = []
        loop.set_exception_handler(lambda _loop, context: reported.append(context))
        engine = FakeEngine()
        plane = make_plane(FakeWorld(rank=1), engine)
        meta = TensorMeta(np.dtype(np.float32), (5, 7))
        for error in (None, RuntimeError("MPI_ERR_OTHER")):
            buf, head = descriptor(meta, source_rank=2, tag=11, chunk_bytes=64)
            plane.drain(buf, head)
            recv = engine.recvs[-1]
            assert (recv.rank, recv.tag, recv.chunk) == (2, 11, 64)
            assert recv.buf.dtype == np.uint8 and recv.buf.nbytes == meta.nbytes
            await complete(recv.future, error=error)
        assert len(engine.recvs) == 2
        engine.recvs.clear()
        del recv
        gc.collect()  # a failed future nobody looked at would be reported now
        assert reported == []
    run(main(), 20)


def test_a_host_receive_is_posted_in_the_replys_own_turn():
    """The descriptor's receive is posted as the reply is dispatched, not a turn
    later by a task: a large message's single copy starts as soon as it can."""
    async def main():
        producer_engine, consumer_engine = FakeEngine(), FakeEngine()
        producer = make_plane(FakeWorld(rank=0), producer_engine)
        consumer = make_plane(FakeWorld(rank=2), consumer_engine)
        arr = np.arange(1 << 16, dtype=np.float32)
        buf, head = first_frame(planned(producer, request_from(consumer), Received(arr, False)))
        arrival = consumer.receive(buf, head, None)
        assert len(consumer_engine.recvs) == 1  # no await in between
        fut = asyncio.ensure_future(arrival.pending)
        await deliver(producer_engine.sends[-1], consumer_engine.recvs[0])
        np.testing.assert_array_equal(await fut, arr)
    run(main(), 20)


# --- a completed large send lets its answer go ------------------------------------

def test_a_completed_send_of_a_megabyte_or_more_releases_its_request_id_and_no_other_does():
    """The plane says a request's answer was delivered (the retry cache lets it
    go) only once a send of at least DELIVERED_BYTES completed: not when it
    is posted, not for a smaller send (its bytes may wait in the consumer's
    MPI buffers), not for a send that failed, and never for a group's buffer."""
    from rendezvous.mpi.plane import DELIVERED_BYTES

    async def main():
        engine = FakeEngine()
        plane = make_plane(FakeWorld(rank=0), engine)
        released: list[int] = []
        plane.delivered = released.append

        def asked(request_id: int) -> pb.RecvTensorRequest:
            req = request()
            req.request_id = request_id
            return req

        large = np.zeros(DELIVERED_BYTES, np.uint8)
        planned(plane, asked(11), Received(large, False))
        planned(plane, asked(12), Received(np.zeros(DELIVERED_BYTES - 1, np.uint8), False))
        planned(plane, asked(13), Received(large, False))
        carry = plane.plan_group(request(), [large], groups.layout([large]))
        carry.start()
        big, small, failing, group = engine.sends
        assert released == []  # posted, not completed
        await complete(small.future)
        await complete(failing.future, error=RuntimeError("MPI_ERR_OTHER"))
        await complete(group.future)
        assert released == []
        await complete(big.future)
        assert released == [11]
    run(main(), 20)


@pytest.mark.mpi
@pytest.mark.timeout(200)
@pytest.mark.parametrize("requests", ["grpc", "mpi"])
def test_a_completed_large_send_on_the_optimal_path_leaves_the_retry_cache_under_mpiexec(requests):
    """Two ranks under mpiexec, the optimal path on (requests over gRPC, or
    over MPI): once the producer's 2 MiB send completed, its retry cache
    holds only the 64 KiB answer (held for its window); before the release
    was wired end to end, the 2 MiB answer (a daemon's pool segment, on a
    daemon) stayed for the whole window."""
    from pathlib import Path as FsPath

    from test_mpi import launch

    env = {"MPI_OPTIMAL_PATH": "1", "RENDEZVOUS_MPI_REQUESTS": "1" if requests == "mpi" else "0"}
    script = str(FsPath(__file__).resolve().parent / "mpi_release.py")
    _, results, out = launch(2, "held", env=env, timeout=180, script=script)
    producer = next(r for r in results if r["rank"] == 1)
    consumer = next(r for r in results if r["rank"] == 0)
    assert consumer["transfers"] == 2, out[-3000:]  # both came by MPI
    assert producer["held"] == 1 and producer["held_bytes"] == 64 << 10, producer
