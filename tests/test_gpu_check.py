"""make gpu-check (rendezvous/bench/gpu_check.py): what it says where there is
no GPU, and how it reads the bench's GPU targets."""

from __future__ import annotations

import importlib.util
import json

import pytest

from rendezvous.bench import gpu_check

pytestmark = pytest.mark.timeout(30)


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed here")
def test_without_cupy_it_says_so_and_skips(capsys):
    assert gpu_check.main(["--no-bench"]) == 0
    out = capsys.readouterr().out
    assert "gpu-check: no GPU / cupy not importable" in out and "skipped" in out


def _results(tmp_path, ok):
    doc = {"targets": [
        {"id": "latency_1k_default", "what": "not a GPU target", "measured": 9.0, "op": "<=", "limit": 1.0,
         "ok": False, "note": ""},
        {"id": f"gpu_staged_{16 << 20}", "what": "staged GPU->GPU vs min(D2H, raw MPI), 16 MiB", "measured": 0.91,
         "op": ">=", "limit": 0.8, "ok": True, "note": ""},
        {"id": f"gpu_staged_{64 << 20}", "what": "staged GPU->GPU vs min(D2H, raw MPI), 64 MiB",
         "measured": 0.85 if ok else 0.5, "op": ">=", "limit": 0.8, "ok": ok, "note": ""},
        # a setting of the sweep (--gpu-staging) that misses: reported, not a failure of the check
        {"id": f"gpu_staged_1M_x2_{64 << 20}", "what": "GPU->GPU, 1 MiB chunks x 2 vs min(D2H, raw MPI), 64 MiB",
         "measured": 0.4, "op": ">=", "limit": 0.8, "ok": False, "note": ""}],
        "transfers": [{"contender": "gpu_staged", "size": 16 << 20, "gbps": 11.5},
                      {"contender": "gpu_staged_1M_x2", "size": 64 << 20, "gbps": 4.0},
                      {"contender": "gpu_staged", "size": 1 << 20, "gbps": 3.0},  # below 16 MiB: left out
                      {"contender": "grpc", "size": 16 << 20, "gbps": 1.0}]}  # not a GPU contender
    (tmp_path / "bench.json").write_text(json.dumps(doc))
    return gpu_check._bandwidth(tmp_path)


def test_the_report_reads_only_the_staged_gpu_targets(tmp_path):
    ok, lines = _results(tmp_path, ok=True)
    assert ok
    assert [line.split(":")[0].strip() for line in lines] == [
        "staged GPU->GPU vs min(D2H, raw MPI), 16 MiB", "staged GPU->GPU vs min(D2H, raw MPI), 64 MiB",
        "GPU->GPU, 1 MiB chunks x 2 vs min(D2H, raw MPI), 64 MiB", "gpu_staged    16 MiB",
        "gpu_staged_1M_x2    64 MiB"]
    ok, lines = _results(tmp_path, ok=False)
    assert not ok and "MISSED" in lines[1]


def test_the_ipc_bench_runs_end_to_end_on_the_fake_gpu(tmp_path):
    """The IPC bench's harness (a producer process, recvs one at a time and all
    at once, the copy it is compared with), on the fake GPU: every tensor came
    by IPC. Its figures are the fake's and judged nowhere."""
    from rendezvous.bench import gpu_ipc

    out = tmp_path / "ipc.json"
    assert gpu_ipc.main(["--fake", "--sizes", "64K,1M", "--count", "3", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["fake"] and doc["ok"] and [r["size"] for r in doc["rows"]] == [64 << 10, 1 << 20]
    assert all(r["ipc_one_gbps"] > 0 and r["ipc_many_gbps"] > 0 and r["d2d_gbps"] > 0 for r in doc["rows"])


def test_the_ipc_bench_through_a_daemon_runs_end_to_end_on_the_fake_gpu(tmp_path):
    """``--daemon``: a daemon and a producing client in processes of their own,
    this process the consuming client; every tensor came by IPC, both hops."""
    from rendezvous.bench import gpu_ipc

    out = tmp_path / "ipc_local.json"
    assert gpu_ipc.main(["--fake", "--daemon", "--sizes", "64K,1M", "--count", "3", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["fake"] and doc["daemon"] and doc["ok"] and [r["size"] for r in doc["rows"]] == [64 << 10, 1 << 20]
    assert all(r["ipc_one_gbps"] > 0 and r["d2d_gbps"] > 0 for r in doc["rows"])
