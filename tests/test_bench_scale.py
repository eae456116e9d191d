"""`rendezvous bench-scale`: two-rank jobs measure real connections, threads and memory.

Nothing here asserts a time or a memory figure (the machine decides those);
only what must hold on any machine: before any traffic a rank has no
connection to a peer (channels open lazily), after the full-mesh exchange it
holds one to its peer and one from it, it has threads, descriptors and
resident memory, the tensors went the way the setup says, and the results
document has what BENCHMARKS.md quotes.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from rendezvous.bench import footprint, scale

pytestmark = pytest.mark.timeout(90)

SNAPSHOT_KEYS = {"tcp_established", "tcp_peer", "tcp_peer_out", "tcp_peer_in", "tcp_other", "tcp_listen", "threads",
                 "thread_names", "fds", "fds_less_pipes", "fd_kinds", "rss_bytes", "peak_rss_bytes"}


def _bench(tmp_path, setups: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "rendezvous", "bench-scale", "--ranks", "2", "--setups", setups,
         "--timeout", "60", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=80)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert (tmp_path / "scale.md").read_text().startswith("# Per-rank cost as peers grow")
    doc = json.loads((tmp_path / "scale.json").read_text())
    assert {"kind", "created", "environment", "config", "tensors", "runs", "per_peer"} <= set(doc)
    assert doc["kind"] == "rendezvous bench-scale"
    assert doc["config"]["keepalive_time"] >= 0
    return doc


def _check(run: dict, setup: str) -> None:
    assert run["setup"] == setup and run["ranks"] == 2
    assert {"median", "startup", "transfers_by_path", "per_rank"} <= set(run)
    ranks = run["per_rank"]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert len({r["pid"] for r in ranks}) == 2
    for r in ranks:
        before, after = r["before"], r["after"]
        assert SNAPSHOT_KEYS <= set(before) and SNAPSHOT_KEYS <= set(after)
        # channels open lazily: nothing to or from the peer before the first recv
        assert before["tcp_peer"] == 0, before
        assert after["tcp_peer_out"] >= 1 and after["tcp_peer_in"] >= 1, after
        assert after["tcp_established"] >= after["tcp_peer"]
        assert after["tcp_listen"] >= 1  # the rank's own gRPC server
        assert after["threads"] > 0 and after["thread_names"].get("py:rendezvous-loop") == 1
        assert after["fds"] > 0 and after["rss_bytes"] > 0
        assert after["peak_rss_bytes"] >= after["rss_bytes"]
        assert r["received_bytes"] == scale.SMALL_BYTES + (1 << 20)
        assert r["start_s"] > 0 and r["construct_s"] >= 0
        assert r["nofile"][0] > 0
    assert run["median"]["after"]["tcp_peer"] >= 2


def test_a_two_rank_grpc_job_measures_real_connections(tmp_path):
    doc = _bench(tmp_path, "grpc")
    (run,) = doc["runs"]
    _check(run, "grpc")
    assert run["transfers_by_path"].get("grpc") == 4  # two tensors each way, all over gRPC
    assert doc["per_peer"] == {"grpc": None}  # one job size: no increment to compute


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_a_two_rank_grpc_mpi_job_builds_its_rank_map_and_moves_the_big_tensor_over_mpi(tmp_path):
    from rendezvous.bench.procs import mpiexec

    if mpiexec() is None:
        pytest.skip("no mpiexec (pip install 'rendezvous[mpi]')")
    doc = _bench(tmp_path, "grpc+mpi")
    (run,) = doc["runs"]
    _check(run, "grpc+mpi")
    assert run["transfers_by_path"].get("mpi") == 2  # the 1 MiB tensors: optimal path
    assert run["transfers_by_path"].get("grpc") == 2  # the 64-byte ones: inline
    for r in run["per_rank"]:
        assert r["entries"] == 2 and r["entry_bytes"] > 0
        assert r["exchange_left"] >= r["exchange_entered"]
        assert r["after"]["thread_names"].get("py:rendezvous-mpi") == 1
    assert run["startup"]["rank_map_bytes"] == sum(r["entry_bytes"] for r in run["per_rank"])


@pytest.mark.timeout(10)
def test_snapshot_tells_connections_to_peers_from_connections_of_peers():
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_server(("127.0.0.1", 0)) as peer:
        own = server.getsockname()[1]
        with socket.create_connection(peer.getsockname()) as out, \
                socket.create_connection(server.getsockname()) as other:
            accepted_out, _ = peer.accept()
            accepted_in, _ = server.accept()
            with accepted_out, accepted_in:
                snap = footprint.snapshot(own, {("127.0.0.1", peer.getsockname()[1])},
                                      exclude_fds={accepted_out.fileno(), other.fileno()})
    # ours: `out` (to the peer's server) and `accepted_in` (into our server); the
    # peer's side of `out` and the client `other` stand for other processes and are
    # left out. (Other tests' sockets in this process can only add to the totals.)
    assert snap["tcp_peer_out"] == 1 and snap["tcp_peer_in"] == 1
    assert snap["tcp_established"] >= 2 and snap["tcp_listen"] >= 2
    assert snap["fd_kinds"]["socket tcp"] >= 4
    assert snap["threads"] >= 1 and snap["rss_bytes"] > 0


@pytest.mark.timeout(10)
def test_proc_net_tcp_addresses_are_decoded():
    if sys.byteorder != "little":
        pytest.skip("the sample is a little-endian machine's /proc/net/tcp")
    assert footprint._address("0100007F:1F90") == ("127.0.0.1", 8080)
    assert footprint._address("0000000000000000FFFF00000100007F:0050") == ("127.0.0.1", 80)


@pytest.mark.timeout(30)
def test_bad_flags_are_refused_before_anything_starts(tmp_path):
    for flags in (["--ranks", "1"], ["--setups", "udp"], ["--big", "3"]):
        out = subprocess.run([sys.executable, "-m", "rendezvous", "bench-scale", *flags, "--out", str(tmp_path)],
                             capture_output=True, text=True, timeout=25)
        assert out.returncode != 0 and "bench-scale" in out.stderr, (flags, out.stderr)
    assert not (tmp_path / "scale.json").exists()
