"""The request path's contract (rendezvous/transport/calls.py), checked the same
way against every implementation: gRPC (a real grpc.aio server on loopback),
requests over MPI (two ranks' MpiRequests joined by a scripted engine, no
mpiexec) and an in-memory pair (tests/calls_memory.py).

Each check drives a real peer client and a real producer's servicer through
the implementation under test, or its raw call, and asserts what the
consumer gets and what the producer's table holds afterwards. The last tests
run the same checks against implementations broken on purpose and see them
fail."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest

from rendezvous import errors
from rendezvous.buffers import RecvBuffers
from rendezvous.config import Config
from rendezvous.devices import Devices
from rendezvous.mpi.control import MpiRequests
from rendezvous.rpc.grpc_calls import GrpcCall
from rendezvous.rpc.options import STREAM_METHOD
from rendezvous.rpc.peer import PeerClient
from rendezvous.rpc.retry import RetryCache
from rendezvous.rpc.servicer import RecvTensorServicer
from rendezvous.stats import Stats
from rendezvous.table import WaitingTable
from rendezvous.transport import Planes
from rendezvous.transport.calls import EOF, CallEnded, RequestCall
from rendezvous.transport.inline import InlinePlane

from calls_memory import MemoryCall
from conftest import run, until
from test_mpi_control import Wire
from test_servicer import ME, K, recv

pytestmark = pytest.mark.timeout(60)


@dataclass
class Path_:
    """One implementation, wired: the producer's table, a peer client asking it
    through the implementation, and ``open()`` for a raw call."""

    table: WaitingTable
    client: PeerClient
    open: Callable[[], RequestCall]


def _planes(stats: Stats) -> Planes:
    return Planes([InlinePlane(chunk_bytes=1 << 20, buffers=RecvBuffers(), devices=Devices([]),
                               staging=(4096, 2), stats=stats)])


def _producer() -> tuple[WaitingTable, RecvTensorServicer]:
    table, stats = WaitingTable(), Stats()
    return table, RecvTensorServicer(table, ME, stats=stats, planes=_planes(stats), retry=RetryCache(30, 1 << 30))


def _client(address: str, open_call: Callable[[], Any] | None) -> PeerClient:
    return PeerClient(ME, address, Config.load({}, env={}), planes=_planes(Stats()), open_call=open_call)


@contextlib.asynccontextmanager
async def grpc_path() -> AsyncIterator[Path_]:
    table, servicer = _producer()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(servicer.handlers())
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    client = _client(f"127.0.0.1:{port}", None)
    try:
        yield Path_(table, client, lambda: GrpcCall(channel.stream_stream(STREAM_METHOD)()))
    finally:
        await client.close()
        await channel.close()
        await server.stop(0)


@contextlib.asynccontextmanager
async def mpi_path() -> AsyncIterator[Path_]:
    table, servicer = _producer()
    wire = Wire()
    consumer = MpiRequests(wire.engines[0], comm=None, rank=0, servicer=None)
    producer = MpiRequests(wire.engines[1], comm=None, rank=1, servicer=servicer)
    consumer.start()
    producer.start()
    client = _client("rank 1", lambda: consumer.open_call(1))
    try:
        yield Path_(table, client, lambda: consumer.open_call(1))
    finally:
        await client.close()
        await consumer.close()
        await producer.close()


def memory_path(call: type = MemoryCall) -> Callable[[], contextlib.AbstractAsyncContextManager[Path_]]:
    @contextlib.asynccontextmanager
    async def path() -> AsyncIterator[Path_]:
        table, servicer = _producer()
        client = _client("memory", lambda: call(servicer))
        try:
            yield Path_(table, client, lambda: call(servicer))
        finally:
            await client.close()
    return path


PATHS = {"grpc": grpc_path, "mpi": mpi_path, "memory": memory_path()}


# -- the checks ------------------------------------------------------------------------

def _waiting(table: WaitingTable) -> int:
    return sum(p.count for p in table.pending() if p.kind == "waiter")


def _held(table: WaitingTable) -> int:
    return sum(p.count for p in table.pending() if p.kind == "tensor")


async def a_produced_tensor_is_received(p: Path_) -> None:
    p.table.send(1, K("a"), np.arange(5, dtype=np.float32))
    got = await p.client.recv(K("a"), 1, timeout=10)
    np.testing.assert_array_equal(got.item.value, np.arange(5, dtype=np.float32))
    assert got.item.value.dtype == np.float32 and _held(p.table) == 0


async def a_recv_asked_first_gets_the_tensor_when_it_comes(p: Path_) -> None:
    task = asyncio.ensure_future(p.client.recv(K("later"), 1, timeout=10))
    await until(lambda: _waiting(p.table) == 1, what="the request to wait at the producer")
    p.table.send(1, K("later"), np.array([7], np.int64))
    assert (await task).item.value.tolist() == [7]


async def a_recv_that_times_out_consumes_nothing(p: Path_) -> None:
    with pytest.raises(errors.DeadlineExceeded):
        await p.client.recv(K("t"), 1, timeout=0.2)
    await until(lambda: _waiting(p.table) == 0, what="the producer to withdraw the recv that gave up")
    p.table.send(1, K("t"), np.array([3.0]))
    assert (await p.client.recv(K("t"), 1, timeout=10)).item.value.tolist() == [3.0]
    with pytest.raises(errors.DeadlineExceeded):  # once: nothing answers again
        await p.client.recv(K("t"), 1, timeout=0.2)
    await until(lambda: _waiting(p.table) == 0 and _held(p.table) == 0, what="nothing left at the producer")


async def a_batch_comes_back_in_key_order(p: Path_) -> None:
    keys = [K(f"b{i}") for i in range(6)]
    for i in reversed(range(6)):
        p.table.send(1, keys[i], np.array([i]))
    got = await p.client.recv_batch(keys, 1)
    assert [f.item.value.tolist() for f in got] == [[i] for i in range(6)]


async def a_producers_error_arrives_as_its_error(p: Path_) -> None:
    p.table.abort(2, errors.Aborted("step 2 stopped"))
    with pytest.raises(errors.Aborted, match="step 2 stopped"):
        await p.client.recv(K("x"), 2, timeout=10)


async def a_garbage_request_ends_the_stream_with_invalid_argument(p: Path_) -> None:
    call = p.open()
    await call.write(b"\xff\xff not a request")
    with pytest.raises(CallEnded) as ended:
        while (await asyncio.wait_for(call.read(), 10)) is not EOF:
            pass
    assert isinstance(ended.value.error, errors.InvalidArgument), ended.value.error


async def a_cancelled_call_leaves_its_tensor_to_the_next_recv(p: Path_) -> None:
    call = p.open()
    await call.write(recv(1, K("c"), request_id=0))
    await until(lambda: _waiting(p.table) == 1, what="the raw request to wait at the producer")
    call.cancel()
    await until(lambda: _waiting(p.table) == 0, what="the producer to withdraw the cancelled call's recv")
    p.table.send(1, K("c"), np.array([9]))
    assert _held(p.table) == 1
    assert (await p.client.recv(K("c"), 1, timeout=10)).item.value.tolist() == [9]


CHECKS = [a_produced_tensor_is_received, a_recv_asked_first_gets_the_tensor_when_it_comes,
          a_recv_that_times_out_consumes_nothing, a_batch_comes_back_in_key_order,
          a_producers_error_arrives_as_its_error, a_garbage_request_ends_the_stream_with_invalid_argument,
          a_cancelled_call_leaves_its_tensor_to_the_next_recv]


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
@pytest.mark.parametrize("name", list(PATHS))
def test_every_request_path_keeps_the_contract(name, check):
    async def main():
        async with PATHS[name]() as p:
            await check(p)
    run(main(), 30)


# -- the checks can fail ----------------------------------------------------------------

class _AbortEndsCleanly(MemoryCall):
    """Broken: an abort ends the stream as if all went well."""

    def _end(self, how: Any) -> None:
        super()._end(EOF if isinstance(how, CallEnded) else how)


class _CancelLeavesTheProducer(MemoryCall):
    """Broken: a cancel ends the consumer's side only; the producer keeps waiting."""

    def cancel(self) -> None:
        self._end(CallEnded(errors.Cancelled("stream closed locally")))


@pytest.mark.parametrize("broken,check", [
    (_AbortEndsCleanly, a_garbage_request_ends_the_stream_with_invalid_argument),
    (_CancelLeavesTheProducer, a_cancelled_call_leaves_its_tensor_to_the_next_recv),
], ids=["abort-ends-cleanly", "cancel-leaves-the-producer"])
def test_a_broken_implementation_fails_the_check_that_guards_it(broken, check, monkeypatch):
    import conftest

    async def short_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
        await real_until(predicate, min(timeout, 1.0), what)

    real_until = conftest.until
    monkeypatch.setitem(globals(), "until", short_until)

    async def main():
        async with memory_path(broken)() as p:
            with pytest.raises((AssertionError, pytest.fail.Exception)):
                await check(p)
    run(main(), 30)


# -- the seam stays one ---------------------------------------------------------------

_PACKAGE = __import__("pathlib").Path(__file__).resolve().parent.parent / "rendezvous"
#: the modules that see a stream only through the contract (no grpc, no asking what a call can do)
_THROUGH_THE_CONTRACT = ["rpc/consumer_stream.py", "rpc/producer_stream.py", "rpc/batch.py", "mpi/control.py"]
#: the MPI layer knows no gRPC at all (a library probe may still ask ctypes what a library has)
_NO_GRPC = [p.relative_to(_PACKAGE).as_posix() for p in sorted((_PACKAGE / "mpi").glob("*.py"))]


def seam_breaks(source: str) -> list[str]:
    """What in ``source`` goes around the contract: an import of grpc, or a
    ``getattr`` with a default (asking an object what it can do)."""
    import ast

    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "grpc" for a in node.names):
            out.append(f"line {node.lineno}: import grpc")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "grpc":
            out.append(f"line {node.lineno}: from grpc")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) == 3:
            out.append(f"line {node.lineno}: getattr with a default")
    return out


@pytest.mark.parametrize("module", _THROUGH_THE_CONTRACT)
def test_the_stream_modules_see_streams_only_through_the_contract(module):
    assert not seam_breaks((_PACKAGE / module).read_text()), module


@pytest.mark.parametrize("module", _NO_GRPC)
def test_the_mpi_layer_imports_no_grpc(module):
    assert not [b for b in seam_breaks((_PACKAGE / module).read_text()) if "grpc" in b], module


def test_the_seam_check_finds_grpc_and_capability_checks():
    assert len(seam_breaks("import grpc\nfrom grpc import aio\nx = getattr(call, 'watch', None)\n")) == 3
    assert not seam_breaks("y = call.watch\nz = getattr(call, name)\n")
