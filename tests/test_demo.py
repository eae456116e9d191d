"""The main job (`make demo`): parameter-server training, with MPI and with MPI_DISABLED=1,
each run writing its timeline."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rendezvous.timeline import read_trace

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_parameter_server_job_converges_on_both_paths(tmp_path):
    timeline = tmp_path / "timeline"
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "ps_training.py"), "--steps", "21",
                          "--timeout", "100", "--timeline", str(timeline)], capture_output=True, text=True, timeout=230)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = out.stdout.split("=== run ")[1:]
    assert len(runs) == 2
    finals = []
    for run in runs:
        losses = [float(m) for m in re.findall(r"^\s+\d+\s+([0-9.]+)$", run, re.M)]
        assert len(losses) >= 3 and losses[-1] < losses[0] - 0.3, losses  # it learns
        finals.append(float(re.search(r"final loss: ([0-9.]+)", run).group(1)))
    assert finals[0] == finals[1]
    mpi_run, grpc_run = runs
    mpi_row = re.search(r"MPI\s+(\d+)\s+([\d,]+)", mpi_run)
    assert int(mpi_row.group(1)) > 0, "parameters and gradients should move over MPI"
    assert int(re.search(r"MPI\s+(\d+)", grpc_run).group(1)) == 0
    assert "-> the same" in out.stdout
    # --timeline: every rank's file, each run's ranks merged, and where to open them
    assert "https://ui.perfetto.dev" in out.stdout and str(timeline / "mpi.json") in out.stdout
    for run, path in (("mpi", "mpi"), ("grpc", "grpc")):
        assert sorted(p.name for p in (timeline / run).iterdir()) == ["ps-0.json", "worker-0.json", "worker-1.json"]
        events = read_trace(timeline / f"{run}.json")
        names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
        assert names == {"/job:ps/replica:0/task:0", "/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1"}
        grads = [e for e in events if e["ph"] == "X" and e["name"] == "recv grad_w"]
        assert len(grads) == 2 * 21  # the ps's, from each worker at each step
        assert {e["args"]["path"] for e in grads} == {path} and {e["args"]["bytes"] for e in grads} == {2 << 20}
        assert sum(e["name"] == "serve grad_w" for e in events) == 2 * 21  # the workers'


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_gpu_example_runs_on_the_stand_in_gpu():
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        pytest.skip("no mpiexec (pip install 'rendezvous[mpi]')")
    out = subprocess.run([str(mpiexec), "-n", "2", sys.executable, "-m", "mpi4py",
                          str(ROOT / "examples" / "gpu_exchange.py"), "--fake", "--mib", "8"],
                         capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for rank in (0, 1):
        # a rank's line as it wrote it, wherever the launcher put it among the other's
        line = re.search(rf"rank {rank}: [^\n]*?gpu stats \{{[^}}]*\}}", out.stdout)
        assert line is not None, out.stdout
        line = line.group(0)
        assert "FakeDeviceArray of 8 MiB onto the GPU" in line and "ndarray onto the host" in line
        assert "'staged_recvs': 1" in line
    assert "CUDA-aware MPI: no" in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_loopback_demo_prints_each_rate_in_a_unit_that_fits():
    """`make demo-loopback`: every rate in a unit where its figure reads (never
    "0.00GB/s" for 1 KiB), and consistent with the size and time shown."""
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "loopback_demo.py")], capture_output=True,
                         text=True, timeout=140)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = re.findall(r"^/job:worker/replica:0/task:[01]\s+(\d+) (KiB|MiB)\s+(\w+)\s+([\d.]+) (µs|ms|s)\s+"
                      r"([\d.]+) (B/s|kB/s|MB/s|GB/s)$", out.stdout, re.M)
    assert len(rows) == 10, out.stdout  # 5 sizes from 2 workers
    for n, binary, path, took, time_unit, rate, rate_unit in rows:
        assert path == "grpc"  # the path the recv's tensor counted on (protocol grpc: no other)
        assert 1 <= float(rate) < 1000, rate
        nbytes = int(n) * {"KiB": 1 << 10, "MiB": 1 << 20}[binary]
        seconds = float(took) / {"µs": 1e6, "ms": 1e3, "s": 1.0}[time_unit]
        per_s = float(rate) * {"B/s": 1.0, "kB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9}[rate_unit]
        assert per_s == pytest.approx(nbytes / seconds, rel=0.02)
    assert "ps received 30 tensors, 486 MiB over grpc, 0 errors" in out.stdout
