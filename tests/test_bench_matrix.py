"""The benchmark matrix and its regression guard (rendezvous/bench/matrix.py,
``rendezvous bench --guard``): every cell against its raw transport, floors
read and judged, a run below a floor failing the command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rendezvous.bench import matrix
from rendezvous.bench.matrix import CELLS, Floors, check, load_floors, reference

pytestmark = pytest.mark.timeout(30)
KiB, MiB = 1 << 10, 1 << 20


def _doc(ratio: float = 0.5) -> dict:
    """Every cell at 1 KiB and 64 MiB moving ``ratio`` of its raw transport's bandwidth."""
    transfers = [{"contender": "mpi", "size": s, "gbps": 10.0} for s in (KiB, 64 * MiB)]
    transfers += [{"contender": "grpc", "size": s, "gbps": 1.0} for s in (KiB, 64 * MiB)]
    for name, _ in CELLS:
        for s in (KiB, 64 * MiB):
            ref = 10.0 if reference(name, s) == "mpi" else 1.0
            transfers.append({"contender": name, "size": s, "gbps": ratio * ref})
    rate = {"bytes": KiB, "outstanding": 100, "results": [
        {"contender": "grpc", "per_s": 1000.0}, {"contender": "mpi", "per_s": 100000.0},
        {"contender": "optimal", "per_s": 2000.0}]}
    return {"sizes": [KiB, 64 * MiB], "transfers": transfers, "rate": rate}


def test_each_cell_is_compared_with_the_transport_that_carries_it():
    # gRPC carries the inline path and MPI_DISABLED; MPI carries requests over MPI
    assert {reference(c, s) for c in ("default", "blocking_default", "grpc_only", "local_grpc")
            for s in (KiB, 256 * MiB)} == {"grpc"}
    assert {reference(c, s) for c in ("default_mr", "optimal_mr", "blocking_optimal_mr")
            for s in (KiB, 256 * MiB)} == {"mpi"}
    # the optimal path asked over gRPC: the request dominates small tensors, the bytes large ones
    for c in ("optimal", "blocking_optimal", "local_socket"):
        assert (reference(c, 64 * KiB), reference(c, MiB)) == ("grpc", "mpi")


def test_the_matrix_is_each_cells_bandwidth_over_its_reference():
    got = matrix.cells(_doc(0.5))
    assert set(got) == {(name, s) for name, _ in CELLS for s in (KiB, 64 * MiB)}
    assert all(v == pytest.approx(0.5) for v in got.values())
    assert matrix.rates(_doc())["optimal"] == pytest.approx(2.0)
    header, rows = matrix.matrix_rows(_doc(0.5))
    assert header == ["cell", "1 KiB", "64 MiB", "100 in flight"]
    assert ["blocking_optimal", "0.5 g", "0.5 m", ""] in rows


def test_raw_mpi_against_a_memcpy_is_judged_by_each_ones_fastest_transfer():
    """A loaded machine slows some transfers of a run, which moves the median;
    the fastest says what the machine can do (a missing CMA halves even that)."""
    doc = {"sizes": [64 * MiB], "transfers": [
        {"contender": "memcpy", "size": 64 * MiB, "gbps": 19.0, "min_us": 3000.0},
        {"contender": "mpi", "size": 64 * MiB, "gbps": 9.0, "min_us": 4000.0}]}
    assert matrix.raw_ratios(doc)[("mpi", 64 * MiB)] == pytest.approx(0.75)
    for t in doc["transfers"]:
        del t["min_us"]  # a run that kept no fastest transfer: the bandwidths
    assert matrix.raw_ratios(doc)[("mpi", 64 * MiB)] == pytest.approx(9.0 / 19.0)


def test_the_rate_of_many_in_flight_is_judged_by_each_ones_best_round():
    doc = _doc()
    for r in doc["rate"]["results"]:
        r["best_per_s"] = r["per_s"] * (3.0 if r["contender"] == "optimal" else 1.0)
    assert matrix.rates(doc)["optimal"] == pytest.approx(6.0)  # 3 x its median round's 2.0
    del doc["rate"]["results"][0]["best_per_s"]  # the reference kept no best round: the medians
    assert matrix.rates(doc)["optimal"] == pytest.approx(2.0)


def test_a_cell_below_its_floor_or_not_measured_is_a_breach():
    floors = Floors({"blocking_optimal": {64 * MiB: 0.4}, "optimal_mr": {KiB: 0.6}, "local_grpc": {16 * MiB: 0.1}},
                    {"optimal": 1.5, "default": 1.0})
    breaches = check(_doc(0.5), floors)
    assert [(b.cell, b.size, b.measured) for b in breaches] == [
        ("optimal_mr", KiB, pytest.approx(0.5)), ("local_grpc", 16 * MiB, None), ("default", 0, None)]
    assert "optimal_mr at 1 KiB: 0.5 x raw mpi, below its floor 0.6" in str(breaches[0])
    assert "not measured" in str(breaches[1])
    assert check(_doc(0.9), Floors({"blocking_optimal": {64 * MiB: 0.4}}, {"optimal": 1.5})) == []
    header, rows = matrix.matrix_rows(_doc(0.5), floors)
    assert ["optimal_mr", "0.5 m <0.6!", "0.5 m", ""] in rows
    assert ["optimal", "0.5 g", "0.5 m", "2 g"] in rows


def test_floors_files_are_checked(tmp_path):
    path = tmp_path / "floors.json"

    def floors(doc):
        path.write_text(json.dumps(doc))
        return load_floors(path)

    good = floors({"schema": matrix.FLOORS_SCHEMA, "floors": {"blocking_optimal": {"64M": 0.4, "1K": 0.2}},
                   "rate": {"optimal": 1}})
    assert good.cells == {"blocking_optimal": {64 * MiB: 0.4, KiB: 0.2}} and good.rate == {"optimal": 1.0}
    assert matrix.sizes_of(good) == [KiB, 64 * MiB]
    for bad, why in (({"floors": {"optimal": {"1K": 1}}}, "schema"),
                     ({"schema": matrix.FLOORS_SCHEMA, "floors": {"fast": {"1K": 1}}}, "unknown cell 'fast'"),
                     ({"schema": matrix.FLOORS_SCHEMA, "floors": {"optimal": {"1K": -1}}}, "positive fraction"),
                     ({"schema": matrix.FLOORS_SCHEMA, "floors": {}}, "no floors")):
        with pytest.raises(ValueError, match=why):
            floors(bad)


def test_the_repositorys_floors_name_every_cell_at_every_quick_size():
    """The floors shipped (rendezvous/bench/floors.json) guard the whole matrix: every cell, at the quick sizes."""
    floors = load_floors(matrix.FLOORS_FILE)
    assert set(floors.cells) == {name for name, _ in CELLS}
    sizes = matrix.sizes_of(floors)
    assert all(set(by_size) == set(sizes) for by_size in floors.cells.values())
    assert KiB in sizes and 64 * MiB in sizes and 16 * MiB in sizes


def _guard(tmp_path: Path, floors: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "floors.json"
    path.write_text(json.dumps({"schema": matrix.FLOORS_SCHEMA, **floors}))
    cmd = [sys.executable, "-m", "rendezvous", "bench", "--guard", str(path), "--samples", "3", "--rounds", "1",
           "--outstanding", "16", "--out", str(tmp_path / "out")]
    env = {k: v for k, v in os.environ.items() if k not in ("MPI_DISABLED", "MPI_OPTIMAL_PATH")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"guard hung:\n{out[-3000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_the_guard_passes_a_run_above_its_floors_and_fails_one_below(tmp_path):
    if not (Path(sys.executable).parent / "mpiexec").exists() and not os.environ.get("RENDEZVOUS_MPIEXEC"):
        pytest.skip("no mpiexec (pip install 'rendezvous[mpi]')")
    low = _guard(tmp_path, {"floors": {"optimal": {"1K": 1e-6}, "blocking_grpc_only": {"1K": 1e-6}},
                            "rate": {"optimal": 1e-6}})
    assert low.returncode == 0, low.stdout[-3000:] + low.stderr[-3000:]
    assert "every cell at or above its floor (3 floors)" in low.stdout
    assert "optimal" in low.stdout and "blocking_grpc_only" in low.stdout
    high = _guard(tmp_path, {"floors": {"optimal": {"1K": 1e6}, "blocking_grpc_only": {"1K": 1e-6}}})
    assert high.returncode == 1, high.stdout[-3000:] + high.stderr[-3000:]
    assert "1 cell(s) below their floor" in high.stdout
    assert "optimal at 1 KiB:" in high.stdout and "below its floor 1e+06" in high.stdout
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert set(doc["contenders"]) == {"mpi", "grpc", "optimal", "blocking_grpc_only"}
    assert doc["rss"] is None and doc["wakeup"] == [] and doc["idle"] == []
