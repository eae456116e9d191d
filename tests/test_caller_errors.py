"""Errors reach the caller that can act on them, saying what went wrong: a
send of what cannot travel is refused at the producer; a port in use, or an
address that is not this machine's, says so; a recv from a peer that never
answered says it was never reached; grpc+mpi started without a launcher warns
that everything goes over gRPC."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import rendezvous
from rendezvous import aio
from rendezvous.errors import DeadlineExceeded, InvalidArgument, Unavailable, UnsupportedDType

from conftest import cluster, key, run

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("value,said", [
    (np.array(["a", "bc"]), "numpy unicode strings"),
    (np.array([b"x", "y"], dtype=object), "object array holds a str"),
    (np.array([1, 2], dtype=object), "object array holds a int"),
    (np.zeros(2, dtype=[("a", "i4"), ("b", "f4")]), "has no TensorFlow DataType"),
    (np.array(["2024-01-01"], dtype="M8[D]"), "datetime64"),
])
def test_send_refuses_what_cannot_be_sent_and_the_server_goes_on(value, said):
    async def main():
        async with cluster(2) as (a, b):
            with pytest.raises(UnsupportedDType, match=said) as info:
                b.send(key(1, 0, "bad"), value)
            assert info.value.code.name == "INVALID_ARGUMENT"
            assert b.pending() == []  # nothing half-queued
            good = np.array([b"fine", b""], dtype=object)
            b.send(key(1, 0, "good"), good)
            assert (await a.recv(key(1, 0, "good"), timeout=10)).tolist() == [b"fine", b""]
    run(main())


def test_blocking_send_refuses_too():
    server = rendezvous.Server({"worker": ["127.0.0.1:0"]}, "worker", 0)
    with server:
        with pytest.raises(UnsupportedDType, match="unicode"):
            server.send(key(0, 0, "u"), np.array(["text"]))
        server.send(key(0, 0, "s"), np.array([b"text"]))
        assert server.recv(key(0, 0, "s"), timeout=5).tolist() == [b"text"]


def test_a_port_in_use_says_so():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]

        async def main():
            server = aio.Server({"worker": [f"127.0.0.1:{port}"]}, "worker", 0)
            with pytest.raises(Unavailable, match=f"cannot listen on 127.0.0.1:{port}: Address already in use: "
                                                  f"another process listens on port {port}"):
                await server.start()
        run(main())


def test_an_address_of_another_machine_says_so():
    async def main():
        # TEST-NET-1 (RFC 5737): never an address of this machine
        server = aio.Server({"worker": ["192.0.2.1:50051"]}, "worker", 0)
        with pytest.raises(Unavailable, match="192.0.2.1 is not an address of this machine"):
            await server.start()
    run(main())


def test_a_recv_from_a_peer_never_reached_says_so():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]  # bound, not listening: nothing answers there

        async def main():
            server = aio.Server({"worker": ["127.0.0.1:0", f"127.0.0.1:{free}"]}, "worker", 0)
            async with server:
                with pytest.raises(DeadlineExceeded) as info:
                    await server.recv(key(1, 0, "w"), timeout=0.5)
            message = str(info.value)
            assert key(1, 0, "w") in message and f"127.0.0.1:{free}" in message
            assert "never reached" in message
        run(main())


def test_a_timeout_from_a_peer_that_was_reached_does_not_say_never_reached():
    async def main():
        async with cluster(2) as (a, b):
            b.send(key(1, 0, "first"), np.ones(1))
            await a.recv(key(1, 0, "first"), timeout=10)
            with pytest.raises(DeadlineExceeded) as info:
                await a.recv(key(1, 0, "never-sent"), timeout=0.3)
            assert "never reached" not in str(info.value) and "timed out after 0.3s" in str(info.value)
    run(main())


def test_a_bad_switch_stops_the_server_naming_the_variable(monkeypatch):
    monkeypatch.setenv("MPI_DISABLED", "maybe")
    with pytest.raises(InvalidArgument, match="^MPI_DISABLED: 'maybe' is not a switch value"):
        rendezvous.Server({"worker": ["127.0.0.1:0"]}, "worker", 0, protocol="grpc+mpi")


GRPC_MPI_ALONE = textwrap.dedent("""
    import asyncio
    from rendezvous import aio

    async def main():
        s = aio.Server({"worker": ["127.0.0.1:0", "127.0.0.1:0"]}, "worker", 0, protocol="grpc+mpi")
        await s.start()
        print("mpi ranks", len(s.mpi_ranks), flush=True)
        await s.stop(0)

    asyncio.run(main())
""")


@pytest.mark.mpi
def test_grpc_mpi_outside_a_launcher_warns_once_what_runs_instead():
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith(("PMI_", "OMPI_", "PMIX_", "MV2_", "SLURM_", "HYDRA_"))}
    out = subprocess.run([sys.executable, "-c", GRPC_MPI_ALONE], capture_output=True, text=True, timeout=50,
                         env=env)
    assert out.returncode == 0, out.stderr
    assert "mpi ranks 1" in out.stdout
    warning = "protocol grpc+mpi outside an MPI launcher"
    assert out.stderr.count(warning) == 1, out.stderr
    assert "goes over gRPC" in out.stderr and "mpiexec" in out.stderr and "MPI_DISABLED=1" in out.stderr


def test_grpc_mpi_with_mpi_disabled_does_not_warn(monkeypatch, caplog):
    monkeypatch.setenv("MPI_DISABLED", "1")

    async def main():
        s = aio.Server({"worker": ["127.0.0.1:0", "127.0.0.1:0"]}, "worker", 0, protocol="grpc+mpi")
        await s.start()
        await s.stop(0)
    with caplog.at_level(logging.WARNING, logger="rendezvous"):
        run(main())
    assert not any("outside an MPI launcher" in r.getMessage() for r in caplog.records)


def test_a_recv_that_waits_longer_than_the_stall_limit_says_what_it_waits_for(caplog):
    async def main():
        async with cluster(2, stall_warning=0.2) as (a, b):
            with pytest.raises(DeadlineExceeded):
                await a.recv(key(1, 0, "slow"), step_id=4, timeout=1.0)
            with pytest.raises(DeadlineExceeded):  # a timeout within the limit: nothing to say
                await a.recv(key(1, 0, "quick"), timeout=0.15)
            return b.target
    with caplog.at_level(logging.WARNING, logger="rendezvous"):
        producer = run(main())
    said = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    assert len(said) == 1, said
    assert key(1, 0, "slow") in said[0] and "(step 4)" in said[0]
    assert f"its producer /job:worker/replica:0/task:1 at {producer}" in said[0] and "timeout 1s" in said[0]
