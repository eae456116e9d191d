"""Rank servers talking over loopback gRPC, in one process and one loop."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest

from rendezvous import errors
from rendezvous.codec.parsing import parse_response
from rendezvous.v1 import rendezvous_pb2 as pb

from conftest import cluster, key, run, two_servers, until


def _unary(target: str, path: str = "/rendezvous.v1.Rendezvous/RecvTensor"):
    channel = grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", -1)])
    return channel, channel.unary_unary(path)


@pytest.mark.parametrize("nbytes", [0, 1, 1024, (1 << 20) + 3, 5 << 20])
def test_remote_recv_content(nbytes):
    async def main():
        async with cluster(2, chunk_bytes=1 << 20) as (a, b):
            value = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)
            b.send(key(1, 0, "t"), value, step_id=7)
            got = await a.recv(key(1, 0, "t"), step_id=7, timeout=30)
            np.testing.assert_array_equal(got, value)
            assert a.stats()["grpc"]["transfers"] == 1
            assert a.stats()["grpc"]["bytes"] == nbytes
            assert b.stats()["grpc"]["served"] == 1
    run(main())


def test_recv_before_send_and_fifo():
    async def main():
        async with cluster(2) as (a, b):
            k = key(1, 0, "x")
            first = asyncio.ensure_future(a.recv(k, step_id=1, timeout=10))
            await until(b.pending, what='the waiter to reach the producer')
            assert [p.kind for p in b.pending()] == ["waiter"]
            for i in range(3):
                b.send(k, np.full(4, i, np.int32), step_id=1)
            assert (await first)[0] == 0
            assert (await a.recv(k, step_id=1, timeout=10))[0] == 1
            assert (await a.recv(k, step_id=1, timeout=10))[0] == 2
    run(main())


@pytest.mark.parametrize("value", [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.array([True, False, True]),
    np.array(3.5, dtype=np.float64),
    np.array([b"alpha", b"", b"\x00\xff"], dtype=object),
    np.arange(10, dtype=np.complex64)[::2],
    np.zeros((0, 7), dtype=np.int16),
])
def test_remote_dtypes(value):
    async def main():
        async with cluster(2) as (a, b):
            b.send(key(1, 0, "v"), value)
            got = await a.recv(key(1, 0, "v"), timeout=10)
            assert got.dtype == value.dtype and got.shape == value.shape
            assert got.tolist() == value.tolist()
    run(main())


def test_dead_tensor_remote_and_local():
    async def main():
        async with cluster(2) as (a, b):
            b.send(key(1, 0, "d"), None, is_dead=True)
            item = await a.recv_item(key(1, 0, "d"), timeout=10)
            assert item.is_dead and item.value is None
            a.send(key(0, 0, "d"), None, is_dead=True)
            assert (await a.recv_item(key(0, 0, "d"), timeout=10)).is_dead
    run(main())


def test_local_recv_is_same_object():
    async def main():
        async with cluster(1) as (a,):
            value = np.ones(1000)
            a.send(key(0, 0, "self"), value)
            got = await a.recv(key(0, 0, "self"), timeout=5)
            assert got is value
            assert a.stats()["local"]["transfers"] == 1 and a.stats()["grpc"]["transfers"] == 0
    run(main())


def test_abort_on_producer_reaches_remote_consumer():
    async def main():
        async with cluster(2) as (a, b):
            pending = asyncio.ensure_future(a.recv(key(1, 0, "g"), step_id=5, timeout=10))
            await until(b.pending, what='the waiter to reach the producer')
            b.abort(5, "worker 1 lost its input")
            with pytest.raises(errors.Aborted, match="worker 1 lost its input"):
                await pending
            with pytest.raises(errors.Aborted, match="worker 1 lost its input"):
                await a.recv(key(1, 0, "g2"), step_id=5, timeout=10)
            with pytest.raises(errors.Aborted):
                b.send(key(1, 0, "g"), np.ones(2), step_id=5)
            # other steps are fine
            b.send(key(1, 0, "g"), np.ones(2), step_id=6)
            assert (await a.recv(key(1, 0, "g"), step_id=6, timeout=10)).sum() == 2
    run(main())


def test_abort_on_consumer_fails_its_remote_wait():
    async def main():
        async with cluster(2) as (a, b):
            pending = asyncio.ensure_future(a.recv(key(1, 0, "h"), step_id=9, timeout=10))
            await until(b.pending, what='the waiter to reach the producer')
            a.abort(9, "consumer gave up")
            with pytest.raises(errors.Aborted, match="consumer gave up"):
                await pending
            # the producer's waiter is withdrawn: a later send is kept, not lost
            await until(lambda: not b.pending(), what='the waiter to be withdrawn')
            assert b.pending() == []
    run(main())


def test_deadline_and_cancel_leave_the_tensor():
    async def main():
        async with cluster(2) as (a, b):
            k = key(1, 0, "late")
            with pytest.raises(errors.DeadlineExceeded, match="timed out"):
                await a.recv(k, step_id=1, timeout=0.2)
            task = asyncio.ensure_future(a.recv(k, step_id=1))
            await until(b.pending, what='the waiter to reach the producer')
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: not b.pending(), what='the waiter to be withdrawn')
            assert b.pending() == []  # both remote waits were withdrawn
            b.send(k, np.arange(3), step_id=1)
            np.testing.assert_array_equal(await a.recv(k, step_id=1, timeout=10), np.arange(3))
    run(main())


def test_unknown_task_and_wrong_producer():
    async def main():
        async with cluster(2) as (a, b):
            with pytest.raises(errors.UnknownTask):
                await a.recv(key(5, 0, "nope"), timeout=1)
            with pytest.raises(errors.FailedPrecondition):
                a.send(key(1, 0, "not-mine"), np.ones(1))
            # a request for a key produced elsewhere, sent to the wrong server
            channel, call = _unary(b.target)
            async with channel:
                req = pb.RecvTensorRequest(rendezvous_key=key(0, 1, "x"))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(req.SerializeToString(), timeout=5)
                assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    run(main())


def test_error_statuses_and_server_keeps_serving():
    async def main():
        async with cluster(2) as (a, b):
            channel, call = _unary(b.target)
            async with channel:
                cases = [
                    (b"\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT),  # not a protobuf
                    (pb.RecvTensorRequest(rendezvous_key="no;semicolons").SerializeToString(),
                     grpc.StatusCode.INVALID_ARGUMENT),
                    (pb.RecvTensorRequest(rendezvous_key=key(1, 0, "t"), step_id=3).SerializeToString(),
                     grpc.StatusCode.DEADLINE_EXCEEDED),
                ]
                b.abort(4, "bad step")
                cases.append((pb.RecvTensorRequest(rendezvous_key=key(1, 0, "t"), step_id=4).SerializeToString(),
                              grpc.StatusCode.ABORTED))
                for raw, code in cases:
                    # a generous deadline where time is not what is tested; only the
                    # request that waits is meant to reach it
                    limit = 0.5 if code == grpc.StatusCode.DEADLINE_EXCEEDED else 30
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call(raw, timeout=limit)
                    assert info.value.code() == code, info.value
                # garbage on the stream: the stream fails, the server does not
                stream = channel.stream_stream("/rendezvous.v1.Rendezvous/RecvTensorStream")()
                await stream.write(b"\x0a\xff")
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stream.read()
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                # still serving
                b.send(key(1, 0, "ok"), np.arange(5))
                np.testing.assert_array_equal(await a.recv(key(1, 0, "ok"), timeout=10), np.arange(5))
    run(main())


def test_draining_server_answers_unavailable():
    async def main():
        async with cluster(2) as (a, b):
            channel, call = _unary(b.target)
            async with channel:
                pending = asyncio.ensure_future(
                    call(pb.RecvTensorRequest(rendezvous_key=key(1, 0, "t")).SerializeToString(), timeout=10))
                await until(b.pending, what='the waiter to reach the producer')
                await b.stop(grace=1)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await pending
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    run(main())


def test_drain_delivers_every_byte_of_a_reply_in_flight():
    """A stopping producer finishes the replies it has started: the consumer
    gets the whole tensor, then a clean end of stream, never a cut-off."""
    async def main():
        async with cluster(2, chunk_bytes=1 << 20) as (a, b):
            value = np.random.default_rng(3).integers(0, 255, 48 << 20, dtype=np.uint8)
            b.send(key(1, 0, "big"), value, step_id=1)
            b.send(key(1, 0, "small"), np.arange(3), step_id=1)
            big = asyncio.ensure_future(a.recv(key(1, 0, "big"), step_id=1, timeout=30))
            small = asyncio.ensure_future(a.recv(key(1, 0, "small"), step_id=1, timeout=30))
            await until(lambda: b.servicer.busy() or not b.pending(), what="the replies to start")
            await b.stop(grace=20)
            np.testing.assert_array_equal(await big, value)
            np.testing.assert_array_equal(await small, np.arange(3))
            with pytest.raises(errors.PeerUnavailable):
                await a.recv(key(1, 0, "later"), step_id=1, timeout=10)
    run(main())


def test_retry_with_same_request_id_does_not_consume_twice():
    async def main():
        async with cluster(2) as (a, b):
            k = key(1, 0, "once")
            b.send(k, np.array([1.0]), step_id=2)
            b.send(k, np.array([2.0]), step_id=2)
            channel, call = _unary(b.target)
            async with channel:
                req = pb.RecvTensorRequest(rendezvous_key=k, step_id=2, request_id=424242).SerializeToString()
                first = await call(req, timeout=5)
                again = await call(req, timeout=5)
                first, again = pb.RecvTensorResponse.FromString(first), pb.RecvTensorResponse.FromString(again)
                first.send_start_micros = again.send_start_micros = 0  # a timestamp, not the answer
                assert first == again
                assert first.tensor.tensor_content == np.array([1.0]).tobytes()
                # the second tensor is still there
                assert (await a.recv(k, step_id=2, timeout=5))[0] == 2.0
                # same id, other step: refused
                other = pb.RecvTensorRequest(rendezvous_key=k, step_id=3, request_id=424242).SerializeToString()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(other, timeout=5)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                # same id, same step, another key: refused, not the first key's tensor
                # (it once was answered with it)
                b.send(key(1, 0, "other"), np.array([3.0]), step_id=2)
                wrong = pb.RecvTensorRequest(rendezvous_key=key(1, 0, "other"), step_id=2,
                                             request_id=424242).SerializeToString()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(wrong, timeout=5)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "key" in info.value.details()
                assert (await a.recv(key(1, 0, "other"), step_id=2, timeout=5))[0] == 3.0
    run(main())


def test_ten_thousand_outstanding_recvs():
    n = 10_000

    async def main():
        async with cluster(2) as (a, b):
            recvs = [asyncio.ensure_future(a.recv(key(1, 0, f"k{i}"), step_id=1, timeout=120)) for i in range(n)]
            for i in range(n):
                b.send(key(1, 0, f"k{i}"), np.array([i], dtype=np.int64), step_id=1)
            got = await asyncio.gather(*recvs)
            assert [int(v[0]) for v in got] == list(range(n))
            assert a.stats()["grpc"]["errors"] == 0
    run(main(), timeout=110)


def test_generated_stub_fetches_a_tensor():
    """A client built only from protos/ (the generated stub) reads our replies."""
    from rendezvous.v1 import rendezvous_pb2_grpc

    async def main():
        async with cluster(2) as (a, b):
            value = np.arange(6, dtype=np.float32).reshape(2, 3)
            b.send(key(1, 0, "stub"), value, step_id=1)
            b.send(key(1, 0, "stub2"), np.arange(3000, dtype=np.float64), step_id=1)
            async with grpc.aio.insecure_channel(b.target) as channel:
                stub = rendezvous_pb2_grpc.RendezvousStub(channel)
                resp = await stub.RecvTensor(pb.RecvTensorRequest(step_id=1, rendezvous_key=key(1, 0, "stub")))
                assert resp.tensor.dtype == 1  # DT_FLOAT
                assert [d.size for d in resp.tensor.tensor_shape.dim] == [2, 3]
                assert resp.tensor.tensor_content == value.tobytes()
                # the stream, chunked: first frame's content plus chunks
                call = stub.RecvTensorStream()
                await call.write(pb.StreamRequest(call_id=9, recv=pb.RecvTensorRequest(
                    step_id=1, rendezvous_key=key(1, 0, "stub2"))))
                content = b""
                while len(content) < 3000 * 8:
                    msg = await call.read()
                    assert msg.call_id == 9
                    content += msg.response.tensor.tensor_content if msg.HasField("response") else msg.chunk
                assert content == np.arange(3000, dtype=np.float64).tobytes()
                call.cancel()
    run(main())


def test_tensorflow_worker_service_path():
    """The same handler answers at TensorFlow's WorkerService path; TF's TensorProto parses it."""
    from tensorboard.compat.proto import tensor_pb2 as tf_tensor_pb2

    async def main():
        async with cluster(2) as (a, b):
            value = np.arange(10, dtype=np.int64)
            b.send(key(1, 0, "tf"), value, step_id=11)
            channel, call = _unary(b.target, "/tensorflow.WorkerService/RecvTensor")
            async with channel:
                raw = await call(pb.RecvTensorRequest(step_id=11, rendezvous_key=key(1, 0, "tf")).SerializeToString(),
                                 timeout=5)
            head = parse_response(raw)
            tf_tensor = tf_tensor_pb2.TensorProto.FromString(raw[head.tensor[0]:head.tensor[1]])
            assert tf_tensor.dtype == 9  # DT_INT64
            assert np.frombuffer(tf_tensor.tensor_content, np.int64).tolist() == value.tolist()
    run(main())


def test_blocking_server_threads():
    with two_servers() as (a, b):
        producers = [threading.Thread(target=lambda t=t: [b.send(key(1, 0, f"p{t}"), np.array([t, i]), step_id=3)
                                                            for i in range(50)]) for t in range(4)]
        for p in producers:
            p.start()
        got = {t: [tuple(a.recv(key(1, 0, f"p{t}"), step_id=3, timeout=20)) for _ in range(50)] for t in range(4)}
        for p in producers:
            p.join(10)
        for t in range(4):
            assert got[t] == [(t, i) for i in range(50)]  # FIFO per key, nothing lost or doubled
        b.abort(4, "stop")
        with pytest.raises(errors.Aborted, match="stop"):
            b.send(key(1, 0, "z"), np.ones(1), step_id=4)
        with pytest.raises(errors.DeadlineExceeded):
            a.recv(key(1, 0, "never"), step_id=5, timeout=0.2)
        assert a.stats()["grpc"]["transfers"] == 200


def test_blocking_recvs_of_large_tensors_reuse_their_receive_buffers():
    """Each large tensor received (assembled from chunks) lands in a buffer of
    the server's receive cache, reused once the caller drops the array: a
    training loop's recvs take no fresh pages. (A recv's deadline once kept the
    recv's task, and the task its result, alive: every buffer stayed in use.)"""
    with two_servers() as (a, b):
        tensor = np.arange(1 << 19, dtype=np.float32)  # 2 MiB: assembled from chunks
        for i in range(6):
            b.send(key(1, 0, f"big{i}"), tensor)
        reused = a.aio.buffers.reused
        for i in range(6):
            got = a.recv(key(1, 0, f"big{i}"), timeout=20)
            assert got[-1] == tensor[-1]
            del got
        assert a.aio.buffers.reused - reused >= 4, a.aio.buffers.stats()


def test_batched_stream_messages_with_the_generated_stub():
    """One StreamRequest with a batch of recvs; replies may come packed in `batch`."""
    from rendezvous.v1 import rendezvous_pb2_grpc

    async def main():
        async with cluster(2) as (a, b):
            for i in range(50):
                b.send(key(1, 0, f"s{i}"), np.array([i], np.int32), step_id=1)
            async with grpc.aio.insecure_channel(b.target) as channel:
                call = rendezvous_pb2_grpc.RendezvousStub(channel).RecvTensorStream()
                await call.write(pb.StreamRequest(batch=[
                    pb.StreamRequest(call_id=100 + i, recv=pb.RecvTensorRequest(step_id=1, rendezvous_key=key(1, 0, f"s{i}")))
                    for i in range(50)]))
                got = {}
                while len(got) < 50:
                    msg = await call.read()
                    for frame in (msg.batch or [msg]):
                        got[frame.call_id] = np.frombuffer(frame.response.tensor.tensor_content, np.int32)[0]
                call.cancel()
            assert got == {100 + i: i for i in range(50)}
            assert b.pending() == []
    run(main())


def test_a_key_sent_again_is_checked_and_made_canonical_as_the_first_time():
    """A producer remembers the keys it sent (a training loop sends the same
    ones every step): a key in another spelling still lands under its
    canonical form every time, and a key of another task is refused every
    time, never remembered as this task's."""
    async def main():
        async with cluster(2) as (a, b):
            canonical = key(1, 0, "again")
            spelled = canonical.replace(";0000000000000000;", ";0;")  # the incarnation unpadded
            assert spelled != canonical
            for i in range(3):
                b.send(spelled, np.full(2, i, np.int32), step_id=3)
            assert [(p.key, p.kind, p.count) for p in b.pending()] == [(canonical, "tensor", 3)]
            theirs = key(0, 1, "theirs")
            for _ in range(2):
                with pytest.raises(errors.FailedPrecondition, match="can only send its own"):
                    b.send(theirs, np.ones(1), step_id=3)
            got = [await a.recv(canonical, step_id=3, timeout=10) for _ in range(3)]
            assert [int(g[0]) for g in got] == [0, 1, 2]
    run(main())
