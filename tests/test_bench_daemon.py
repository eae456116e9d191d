"""`rendezvous bench-daemon`: a tiny run writes every contender and names the targets.

Times are never asserted (the benchmark judges its targets itself); only that
each contender was measured, with positive timings, and that the Markdown
states every target with its result.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rendezvous.bench.daemon import CONTENDERS
from rendezvous.bench.report import daemon_markdown
from rendezvous.bench.daemon_results import daemon_targets

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SIZES = ("1024", str(1 << 20))


def _positive(summary: dict) -> None:
    assert summary["samples"] >= 1
    assert summary["median_us"] > 0 and summary["min_us"] > 0 and summary["gbps"] > 0


@pytest.mark.mpi
def test_a_tiny_daemon_bench_run_has_every_contender(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "rendezvous", "bench-daemon", "--quick", "--sizes", "1K,1M", "--aio-sizes", "1K,1M",
         "--cross-sizes", "1K,1M", "--samples", "2", "--rounds", "1", "--small-ops", "20", "--outstanding", "50",
         "--rate-rounds", "1", "--pool-bytes", "64M", "--timeout", "250", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    doc = json.loads((tmp_path / "daemon.json").read_text())
    assert set(doc["contenders"]) == set(CONTENDERS)

    hop = doc["local_hop"]
    for name in ("local_blocking", "local_aio"):
        assert set(hop[name]) == set(SIZES)
        for cell in hop[name].values():
            assert set(cell) == {"send", "recv", "hop"}
            for summary in cell.values():
                _positive(summary)
                assert summary["samples"] == 2
    assert set(hop["memcpy"]) == set(SIZES)
    for cell in hop["memcpy"].values():
        _positive(cell["copy"])

    ops = doc["small"]["ops"]
    for name in ("send_blocking", "recv_blocking", "send_aio", "recv_aio", "grpc_aio_unary", "grpc_sync_unary"):
        _positive(ops[name])
        assert ops[name]["samples"] == 20
    for name in ("rate_aio_recv", "rate_grpc_aio"):
        rate = doc["small"]["rate"][name]
        assert rate["median_ops_per_s"] > 0 and rate["failures"] == 0, rate

    cross = doc["cross"]
    for name in ("daemons_mpi", "daemons_grpc"):
        assert set(cross[name]) == set(SIZES)
        for cell in cross[name].values():
            for summary in cell.values():
                _positive(summary)
    for cell in cross["raw_mpi"].values():
        _positive(cell["oneway"])

    memory = doc["memory"]
    assert set(memory["scenarios"]) == {"local_hop", "small", "cross"}
    for scenario in memory["scenarios"].values():
        for proc in scenario["processes"].values():
            assert proc["peak_rss"] > 0 and proc["pid"] > 0
        for pool in scenario["pools"].values():
            assert "error" not in pool and pool["shm_pool_bytes"] <= memory["pool_limit"]
    # the shared-memory path carried the 1 MiB tensors (the daemon's pool lent segments)
    stats = memory["scenarios"]["local_hop"]["client_stats"]
    assert stats["A"]["blocking"]["send_shm"] > 0 and stats["B"]["aio"]["recv_shm"] > 0

    # every target is judged: measured ones met or missed, the 64 MiB ones (not run) "not measured"
    ids = {t["id"]: t for t in doc["targets"]}
    assert {"local_hop_1MiB_blocking", "small_send_blocking", "small_recv_blocking", "rate",
            "cross_mpi_64MiB", "local_hop_large_blocking"} <= set(ids)
    assert ids["local_hop_1MiB_blocking"]["measured"] > 0 and ids["local_hop_1MiB_blocking"]["met"] in (True, False)
    assert ids["rate"]["met"] in (True, False) and ids["small_recv_aio"]["met"] in (True, False)
    assert ids["cross_mpi_64MiB"]["met"] is None and ids["local_hop_large_blocking"]["met"] is None

    table = (tmp_path / "daemon.md").read_text()
    assert table == daemon_markdown(doc) and daemon_targets(doc) == doc["targets"]
    assert "## Targets" in table
    for t in doc["targets"]:
        assert t["what"] in table
    assert "hop ÷ memcpy" in table and "× grpc.aio unary" in table and "hop ÷ raw MPI" in table
    assert "**met**" in table or "**missed**" in table
    assert "not measured" in table
    assert "1 KiB" in table and "1 MiB" in table and "peak RSS MiB" in table


def test_bad_flags_are_refused_before_anything_starts(tmp_path):
    for flags, message in ((["--sizes", "1X"], "--sizes"), (["--scenarios", "local,gpu"], "unknown gpu"),
                           (["--pool-bytes", "1M", "--sizes", "1M"], "cannot hold"),
                           (["--daemon-env", "NOVALUE"], "NAME=VALUE")):
        out = subprocess.run([sys.executable, "-m", "rendezvous", "bench-daemon", *flags, "--out", str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and message in out.stderr, (flags, out.stderr)
    assert not (tmp_path / "daemon.json").exists()
