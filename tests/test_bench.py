"""The benchmark suite: its numbers, its results document, and a tiny run.

The targets are judged by the benchmark itself (``make bench``), never here:
nothing below asserts a time. Run as a script under ``mpiexec`` this file is
also the scenario for the failing-rank test.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import io
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from rendezvous.bench import report, results, rss, stats
from rendezvous.bench.cli import JSON_NAME, PLOT_NAME, add_arguments
from rendezvous.bench.report import Progress
from rendezvous.bench.contenders import check, pattern

HERE = Path(__file__).resolve()
MiB = 1 << 20


# -- stats --------------------------------------------------------------------------

@pytest.mark.timeout(10)
@pytest.mark.parametrize("text,value", [("1024", 1024), ("1K", 1024), ("64k", 64 << 10), ("16M", 16 << 20),
                                        ("16MiB", 16 << 20), ("1G", 1 << 30), ("7B", 7)])
def test_parse_size(text, value):
    assert stats.parse_size(text) == value


@pytest.mark.timeout(10)
@pytest.mark.parametrize("text", ["", "K", "1T", "-1K", "1.5M", "0", "M1"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError):
        stats.parse_size(text)


@pytest.mark.timeout(10)
def test_format_size_is_exact():
    assert stats.format_size(1024) == "1 KiB"
    assert stats.format_size(512 << 20) == "512 MiB"
    assert stats.format_size(2 << 30) == "2 GiB"
    assert stats.format_size(1536) == "1536 B"
    assert stats.format_size((1 << 20) + 1024) == "1025 KiB"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    values = sorted(np.random.default_rng(q).exponential(100, 37).tolist())
    assert stats.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


@pytest.mark.timeout(10)
def test_percentile_edges():
    assert stats.percentile([5.0], 99) == 5.0
    assert stats.percentile([1, 3], 50) == 2
    with pytest.raises(ValueError):
        stats.percentile([], 50)
    with pytest.raises(ValueError):
        stats.percentile([1], 101)


@pytest.mark.timeout(10)
def test_summarize_units_and_bandwidth():
    # 1 MiB in 1, 2 and 3 ms: median 2 ms
    s = stats.summarize([3_000_000, 1_000_000, 2_000_000], MiB)
    assert s["samples"] == 3
    assert s["median_us"] == 2000
    assert s["min_us"] == 1000
    assert s["mean_us"] == 2000
    assert s["p99_us"] == pytest.approx(2980)
    assert s["gbps"] == pytest.approx(MiB / 2e6)  # bytes per ns = GB/s
    with pytest.raises(ValueError):
        stats.summarize([], 1)


@pytest.mark.timeout(10)
def test_ratio_and_samples_for():
    assert stats.ratio(3, 2) == 1.5
    assert stats.ratio(None, 2) is None and stats.ratio(1, None) is None and stats.ratio(1, 0) is None
    assert stats.samples_for(1 << 10, budget_bytes=1 << 30, least=8, most=1000) == 1000
    assert stats.samples_for(512 << 20, budget_bytes=1 << 30, least=8, most=1000) == 8
    assert stats.samples_for(64 << 20, budget_bytes=1 << 30, least=3, most=1000) == 16


@pytest.mark.timeout(10)
def test_pattern_and_check():
    p = pattern(1000)
    assert p.dtype == np.uint8 and p.nbytes == 1000 and p[255] == 255 and p[256] == 0 and p[999] == 999 % 256
    check(p, 1000)
    check(p.tobytes(), 1000)
    with pytest.raises(AssertionError, match="999"):
        check(pattern(999), 1000)
    bad = p.copy()
    bad[500] ^= 1
    with pytest.raises(AssertionError, match="byte 500"):
        check(bad, 1000)


# -- the results document -------------------------------------------------------------

SIZES = [1024, MiB, 16 * MiB, 128 * MiB]


def _raw(with_gloo: bool = True) -> dict:
    """Raw measurements as rank 0 returns them, with known ratios: at every size
    the optimal path takes 1.25x raw MPI's time (0.8x its bandwidth), the
    default path half raw gRPC's time (2x its bandwidth)."""
    def ns(base_us: float) -> list[int]:
        return [int(base_us * 1000 * f) for f in (1.0, 0.9, 1.1, 1.0, 1.0)]

    samples: dict[str, dict[int, list[int]]] = {n: {} for n in ("mpi", "grpc", "default", "optimal", "memcpy")}
    if with_gloo:
        samples["gloo"] = {}
    for size in SIZES:
        mpi_us = 5 + size / 5000
        grpc_us = 600 + size / 700
        samples["mpi"][size] = ns(mpi_us)
        samples["optimal"][size] = ns(mpi_us * 1.25)
        samples["grpc"][size] = ns(grpc_us)
        samples["default"][size] = ns(grpc_us * 0.5)
        samples["memcpy"][size] = ns(size / 12000)
        if with_gloo:
            samples["gloo"][size] = ns(mpi_us * 3)
    contenders = {"mpi": "raw MPI", "grpc": "raw grpc.aio unary", "default": "rendezvous MPI_OPTIMAL_PATH=0",
                  "optimal": "rendezvous MPI_OPTIMAL_PATH=1", "memcpy": "memcpy"}
    if with_gloo:
        contenders["gloo"] = "torch.distributed gloo"
    size = 128 * MiB
    return {
        "samples": samples,
        "cpu": {"mpi": {1024: [0.01, 0.02, 5]}, "default": {str(MiB): [0.5, 0.25, 5]}},  # JSON keys may be strings
        "rates": {"mpi": [{"elapsed_ns": 10_000_000, "errors": 0}],
                  "grpc": [{"elapsed_ns": 500_000_000, "errors": 0}, {"elapsed_ns": 400_000_000, "errors": 100}],
                  "default": [{"elapsed_ns": 200_000_000, "errors": 0}],
                  "optimal": [{"elapsed_ns": 250_000_000, "errors": 0}]},
        "rss": {"size": size, "by_contender": {
            "mpi": [{"rank": 0, "baseline_bytes": 100 * MiB, "peak_bytes": 100 * MiB + size},
                    {"rank": 1, "baseline_bytes": 90 * MiB, "peak_bytes": 90 * MiB + size}],
            "default": [{"rank": 0, "baseline_bytes": 100 * MiB, "peak_bytes": 100 * MiB + 2 * size},
                        {"rank": 1, "baseline_bytes": 90 * MiB, "peak_bytes": 90 * MiB + size + 8 * MiB}],
            "optimal": [{"rank": 0, "baseline_bytes": 100 * MiB, "peak_bytes": 100 * MiB + 2 * size},
                        {"rank": 1, "baseline_bytes": 90 * MiB, "peak_bytes": 90 * MiB + size}]}},
        "idle": [{"rank": 0, "seconds": 10.0, "cpu_seconds": 0.05, "cpu_fraction": 0.005},
                 {"rank": 1, "seconds": 10.0, "cpu_seconds": 0.3, "cpu_fraction": 0.03,
                  "threads": {"rendezvous-mpi": 0.25, "MainThread": 0.04, "event_engine 7": 0.01}}],
        "wakeup": [{"contender": "optimal", "quiet_s": 0.5, "size": 1024,
                    "samples_ns": [9_000_000, 15_000_000, 12_000_000]},
                   {"contender": "default", "quiet_s": 2.0, "size": 1024, "samples_ns": [40_000_000]}],
        "contenders": contenders,
        "notes": [] if with_gloo else ["torch is not installed: gloo not measured"],
        "environment": {"python": "3.11", "cpus": 2},
        "outstanding": 1000,
        "rate_bytes": 1024,
    }


NOW = datetime.datetime(2030, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)


def _doc(**kw) -> dict:
    return results.build(_raw(**kw), quick=True, args={"sizes": "x"}, now=NOW)


def _target(doc, tid):
    return next(t for t in doc["targets"] if t["id"] == tid)


@pytest.mark.timeout(10)
def test_build_computes_ratios_from_the_same_run():
    doc = _doc()
    results.validate(doc)
    assert doc["schema"] == results.SCHEMA and doc["created"] == "2030-01-02T03:04:05+00:00"
    assert doc["sizes"] == SIZES
    cell = next(t for t in doc["transfers"] if t["contender"] == "optimal" and t["size"] == 16 * MiB)
    assert cell["vs_mpi"]["gbps"] == pytest.approx(0.8)
    assert cell["vs_mpi"]["median_us"] == pytest.approx(1.25)
    cell = next(t for t in doc["transfers"] if t["contender"] == "default" and t["size"] == MiB)
    assert cell["vs_grpc"]["gbps"] == pytest.approx(2.0)
    mpi = next(t for t in doc["transfers"] if t["contender"] == "mpi" and t["size"] == 1024)
    assert mpi["vs_mpi"]["gbps"] == 1.0
    # CPU per transfer: consumer and producer seconds over the transfers timed
    assert mpi["cpu_us"] == {"consumer": pytest.approx(2000), "producer": pytest.approx(4000)}
    assert mpi["vs_mpi"]["cpu_consumer"] == 1.0 and mpi["vs_grpc"]["cpu_consumer"] is None  # no grpc cpu here
    cell = next(t for t in doc["transfers"] if t["contender"] == "default" and t["size"] == MiB)
    assert cell["cpu_us"] == {"consumer": pytest.approx(100_000), "producer": pytest.approx(50_000)}
    cell = next(t for t in doc["transfers"] if t["contender"] == "optimal" and t["size"] == MiB)
    assert cell["cpu_us"] == {"consumer": None, "producer": None}
    # rate: median over rounds, errors discount the round
    rate = {r["contender"]: r for r in doc["rate"]["results"]}
    assert rate["grpc"]["per_s"] == pytest.approx((2000 + 2250) / 2)
    assert rate["grpc"]["errors"] == 100
    assert rate["default"]["vs_grpc"] == pytest.approx(5000 / 2125)
    # rss: what the transfer added, in tensor sizes and against raw MPI
    rss_rows = {r["contender"]: r for r in doc["rss"]["results"]}
    assert [row["x_size"] for row in rss_rows["default"]["ranks"]] == [2.0, pytest.approx(1 + 8 / 128)]
    assert rss_rows["optimal"]["vs_mpi"] == [2.0, 1.0]


@pytest.mark.timeout(10)
def test_targets_are_judged_from_the_ratios():
    doc = _doc()
    assert _target(doc, f"optimal_vs_mpi_{MiB}")["ok"] is False  # 0.8 < 0.9
    assert _target(doc, f"optimal_vs_mpi_{MiB}")["measured"] == pytest.approx(0.8)
    assert _target(doc, f"optimal_vs_gloo_{16 * MiB}")["ok"] is True  # 2.4 >= 2
    assert _target(doc, f"default_vs_grpc_{16 * MiB}")["ok"] is True  # 2 >= 1
    assert _target(doc, f"default_vs_grpc_{128 * MiB}")["ok"] is True  # 2 >= 2
    assert _target(doc, "latency_1k_default")["measured"] == pytest.approx(0.5)
    assert _target(doc, "rate_default")["ok"] is True
    assert _target(doc, "rate_optimal")["measured"] == pytest.approx(4000 / 2125)
    assert _target(doc, "rate_optimal")["ok"] is False
    assert _target(doc, "rss_default")["ok"] is True  # 2 <= 3
    assert _target(doc, "rss_optimal")["ok"] is False  # 2 > 1.5
    assert _target(doc, "idle_cpu")["ok"] is False  # rank 1 used 3%
    assert not any(t["id"].startswith("optimal_vs_mpi_1024") for t in doc["targets"])  # from 1 MiB up only


@pytest.mark.timeout(10)
def test_targets_without_gloo_are_not_judged():
    doc = _doc(with_gloo=False)
    t = _target(doc, f"optimal_vs_gloo_{MiB}")
    assert t["ok"] is None and t["measured"] is None and "not measured" in t["note"]
    assert "gloo" not in doc["contenders"]
    results.validate(doc)


@pytest.mark.timeout(10)
def test_validate_names_the_bad_field():
    good = _doc()
    cases = [
        (lambda d: d.pop("transfers"), "missing 'transfers'"),
        (lambda d: d["transfers"][3].update(gbps="fast"), r"\$.transfers\[3\].gbps"),
        (lambda d: d["transfers"][0].update(samples=True), "got bool"),
        (lambda d: d["transfers"][0].update(contender="carrier pigeon"), "not a listed contender"),
        (lambda d: d["transfers"][0].update(size=12345), "not a listed size"),
        (lambda d: d["rss"]["results"][0]["ranks"][1].pop("peak_bytes"), "peak_bytes"),
        (lambda d: d["targets"][0].update(ok="yes"), r"\$.targets\[0\].ok"),
        (lambda d: d.update(schema="other/9"), "schema"),
        (lambda d: d["contenders"].update(mpi=3), r"\$.contenders.mpi"),
    ]
    for change, message in cases:
        doc = copy.deepcopy(good)
        change(doc)
        with pytest.raises(results.SchemaError, match=message):
            results.validate(doc)
    relaxed = copy.deepcopy(good)
    relaxed["rate"] = relaxed["rss"] = None  # phases that may be skipped
    results.validate(relaxed)


@pytest.mark.timeout(10)
def test_json_round_trip(tmp_path):
    doc = _doc()
    path = tmp_path / "b.json"
    report.write_json(doc, path)
    assert report.load(path) == json.loads(json.dumps(doc))
    path.write_text(json.dumps({**doc, "idle": "none"}))
    with pytest.raises(results.SchemaError):
        report.load(path)


def _shown(doc: dict, width: int = 200) -> str:
    """``report.show``'s output on a console that is not a terminal."""
    from rich.console import Console

    buf = io.StringIO()
    report.show(doc, Console(file=buf, width=width))
    return buf.getvalue()


def _row(text: str, *cells: str) -> str:
    """The one line of ``text`` holding every cell, in order (a table row)."""
    found = [line for line in text.splitlines()
             if all(c in line for c in cells) and _in_order(line, cells)]
    assert len(found) == 1, (cells, text)
    return found[0]


def _in_order(line: str, cells: tuple[str, ...]) -> bool:
    at = 0
    for c in cells:
        at = line.find(c, at)
        if at < 0:
            return False
        at += len(c)
    return True


@pytest.mark.timeout(10)
def test_show_draws_every_cell_ratio_and_target():
    pytest.importorskip("rich")
    doc = _doc()
    text = _shown(doc)
    assert "\x1b" not in text  # not a terminal: no colours, no cursor moves
    for cell in doc["transfers"]:
        label = doc["contenders"][cell["contender"]]
        _row(text, label, report.figure(cell["median_us"]), report.figure(cell["p99_us"]),
             report.figure(cell["gbps"], 3), report.figure(cell["vs_mpi"]["gbps"]), str(cell["samples"]))
    lines = text.splitlines()
    for size in ("1 KiB", "1 MiB", "16 MiB", "128 MiB"):  # on the first row of its size only
        assert [line.split()[2] for line in lines if line.startswith(size + " ")] == ["raw"], size
    _row(text, "MISSED", "optimal path bandwidth at 1 MiB vs raw MPI", "0.80", ">= 0.9")
    _row(text, "met", "default path bandwidth at 16 MiB vs raw gRPC unary", "2.00", ">= 1")
    _row(text, "size", "contender", "median us", "p99 us", "GB/s", "x mpi", "x grpc", "cpu us", "n")
    assert "1000 recvs outstanding" in text and "rank 1 3.00% of a core" in text
    # the wake-up test: median and worst recv after each quiet
    _row(text, "0.5 s", "MPI_OPTIMAL_PATH=1", "12,000", "15,000", "3")
    _row(text, "2 s", "MPI_OPTIMAL_PATH=0", "40,000", "40,000", "1")
    # which threads an idle rank's CPU went to, busiest first (a run from before had none)
    assert "rank 0 0.50% of a core over 10 s, rank 1 3.00% of a core over 10 s (rendezvous-mpi 250 ms, " \
           "MainThread 40 ms, event_engine 7 10 ms)" in " ".join(text.split())
    assert "n/a" not in text
    without = _shown(_doc(with_gloo=False))
    _row(without, "n/a", "optimal path bandwidth at 1 MiB vs gloo", "-", ">= 2", "gloo not measured")


@pytest.mark.timeout(10)
def test_show_prints_labels_as_written():
    pytest.importorskip("rich")
    doc = _doc()
    doc["contenders"]["mpi"] = "raw [bold]MPI[/bold] :smile:"  # neither markup nor emoji codes
    assert "raw [bold]MPI[/bold] :smile:" in _shown(doc)


@pytest.mark.timeout(10)
def test_markdown_tables():
    text = report.markdown(_doc())
    assert "| 16 MiB | rendezvous MPI_OPTIMAL_PATH=1 |" in text
    assert "| optimal path bandwidth at 1 MiB vs raw MPI |  | 0.80 | >= 0.9 | **missed** |" in text
    assert "rank 1 3.00% of one core" in text
    assert "| 0.5 s | rendezvous MPI_OPTIMAL_PATH=1 | 12,000 | 15,000 | 3 |" in text
    lines = [line for line in text.splitlines() if line.startswith("|")]
    first = next(i for i, line in enumerate(lines) if line.startswith("| size | contender"))
    lines = lines[first:]
    assert all(line.count("|") == lines[0].count("|") for line in lines[:len(_doc()["transfers"]) + 2])
    # the matrix heads the page: each cell against its raw transport
    assert text.index("The matrix") < text.index("| size | contender")
    assert "| optimal | 92.5 g | 0.8 m |" in text


@pytest.mark.timeout(60)
def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "b.png"
    assert report.write_plot(_doc(), path) is True
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 400 and height > 300


# -- peak RSS, progress, flags ---------------------------------------------------------

@pytest.mark.timeout(30)
def test_peak_rss_sees_one_allocation():
    if not rss.supported():
        pytest.skip("no resettable VmHWM on this platform")
    base = rss.reset_peak()
    assert rss.peak() < base + 16 * MiB
    block = np.ones(64 * MiB, np.uint8)  # touched: resident
    del block
    assert rss.peak() >= base + 60 * MiB
    assert rss.current() < rss.peak()
    rss.reset_peak()
    assert rss.peak() < base + 16 * MiB


@pytest.mark.timeout(30)
def test_thread_cpu_names_the_thread_that_spent_it():
    seen = {}

    def spin() -> None:
        while time.thread_time() < 0.1:  # this thread's own CPU time
            sum(range(1000))
        seen.update(rss.thread_cpu_seconds())  # read while it still runs

    before = rss.thread_cpu_seconds()
    spinner = threading.Thread(target=spin, name="bench-spinner")
    spinner.start()
    spinner.join()
    assert "bench-spinner" not in before
    assert seen["bench-spinner"] >= 0.08  # clock ticks: 10 ms each
    assert seen["MainThread"] < before["MainThread"] + 0.05  # it waited meanwhile


@pytest.mark.timeout(10)
def test_progress_in_a_log_is_a_plain_line_per_tenth():
    from rich.console import Console

    buf = io.StringIO()
    bar = Progress(out=Console(file=buf, width=80), name="bench-x")
    for i in range(1, 101):
        bar.update(i, 100, f"step {i}")
    bar.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 11  # one per tenth reached: 1% (tenth 0), 10%, ..., 100%
    assert lines[0].startswith("bench-x:   1% after ") and lines[0].endswith("(step 1)")
    assert lines[-1].startswith("bench-x: 100% after ") and lines[-1].endswith("(step 100)")
    assert "\r" not in buf.getvalue() and "\x1b" not in buf.getvalue()


@pytest.mark.timeout(10)
def test_progress_on_a_terminal_is_rich_bar():
    from rich.console import Console

    buf = io.StringIO()
    bar = Progress(out=Console(file=buf, width=100, force_terminal=True, color_system=None))
    bar.update(5, 10, "1 MiB mpi")
    bar.close()
    text = buf.getvalue()
    assert "\x1b[?25l" in text and text.endswith("\x1b[?25h")  # the cursor hidden while drawing, then shown
    last = text.rstrip("\x1b[?25h").rstrip("\n").split("\r")[-1]
    assert "50%" in last and "1 MiB mpi" in last and "━" in last
    assert "after" not in text  # not the plain lines


@pytest.mark.timeout(10)
def test_progress_stays_within_bounds():
    from rich.console import Console

    buf = io.StringIO()
    bar = Progress(out=Console(file=buf, width=80), name="b")
    bar.update(0, 0, "nothing to do")  # no division by zero
    bar.update(7, 5, "overshoot")
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("b:   0%") and lines[1].startswith("b: 100%")


@pytest.mark.timeout(10)
def test_options_from_flags():
    from rendezvous.bench.cli import _argv, _options

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--quick", "--sizes", "4K,1K,4K", "--contenders", "mpi,grpc", "--samples", "5"])
    opts = _options(args)
    assert opts.sizes == (1024, 4096) and opts.contenders == ("mpi", "grpc")
    assert opts.quick and opts.least == opts.most == 5 and opts.idle_seconds == 5.0
    assert p.parse_args(_argv(args)) == args  # what the ranks are handed means the same
    assert opts.quiet_seconds == (0.5, 2.0) and opts.wakeup_repeats == 3  # the wake-up test's defaults, quick
    with pytest.raises(SystemExit, match="carrier"):
        _options(p.parse_args(["--contenders", "mpi,carrier"]))
    quiet = p.parse_args(["--quiet-seconds", "0.25, 1"])
    assert _options(quiet).quiet_seconds == (0.25, 1.0) and p.parse_args(_argv(quiet)) == quiet
    assert _options(p.parse_args(["--quiet-seconds", ""])).quiet_seconds == ()  # no wake-up test
    with pytest.raises(SystemExit, match="comma-separated"):
        _options(p.parse_args(["--quiet-seconds", "half"]))
    with pytest.raises(SystemExit, match="negative"):
        _options(p.parse_args(["--quiet-seconds", "-1"]))


# -- the real thing, tiny --------------------------------------------------------------

def _bench(tmp_path: Path, *flags: str, timeout: float = 150) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "rendezvous", "bench", "--sizes", "1K,64K", "--samples", "3", "--rounds", "2",
           "--outstanding", "16", "--rate-rounds", "1", "--idle-seconds", "0.2", "--quiet-seconds", "0.05",
           "--out", str(tmp_path), *flags]
    env = {k: v for k, v in os.environ.items() if k not in ("MPI_DISABLED", "MPI_OPTIMAL_PATH")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"bench hung:\n{out[-3000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _needs_mpiexec() -> None:
    if not (Path(sys.executable).parent / "mpiexec").exists() and not os.environ.get("RENDEZVOUS_MPIEXEC"):
        pytest.skip("no mpiexec (pip install 'rendezvous[mpi]')")


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_tiny_run_writes_table_json_and_plot(tmp_path):
    _needs_mpiexec()
    done = _bench(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    doc = report.load(tmp_path / JSON_NAME)
    from rendezvous.bench.matrix import CELLS

    names = {"mpi", "mpi_alloc", "grpc", "memcpy", *(name for name, _ in CELLS)}
    assert names <= set(doc["contenders"])
    assert ("gloo" in doc["contenders"]) != any("gloo not measured" in n for n in doc["notes"])
    cells = {(t["contender"], t["size"]): t for t in doc["transfers"]}
    for name in doc["contenders"]:
        for size in (1024, 65536):
            cell = cells[(name, size)]
            assert cell["samples"] == 4  # 2 rounds of ceil(3 / 2)
            assert cell["gbps"] > 0 and cell["p99_us"] >= cell["median_us"] >= cell["min_us"] > 0
            assert cell["cpu_us"]["consumer"] > 0 and cell["cpu_us"]["producer"] > 0  # measured, not left out
    assert {r["contender"] for r in doc["rate"]["results"]} == {"mpi", "grpc", "default", "optimal", "default_mr",
                                                                "optimal_mr", "grpc_only"}
    assert all(r["errors"] == 0 for r in doc["rate"]["results"])
    if rss.supported():
        assert doc["rss"]["size"] == 65536 and len(doc["rss"]["results"][0]["ranks"]) == 2
    assert [r["rank"] for r in doc["idle"]] == [0, 1]
    assert all(isinstance(t, float) for r in doc["idle"] for t in r["threads"].values())
    # the wake-up test: every contender with requests over MPI, one recv per repeat, each timed
    assert {(w["contender"], w["quiet_s"], w["size"]) for w in doc["wakeup"]} == {
        (name, 0.05, 1024) for name in ("default_mr", "optimal_mr", "blocking_default_mr", "blocking_optimal_mr")}
    assert all(len(w["samples_ns"]) == 5 and w["max_us"] >= w["median_us"] > 0 for w in doc["wakeup"])
    ids = {t["id"] for t in doc["targets"]}
    assert {"latency_1k_default", "rate_default", "idle_cpu", "latency_1k_optimal_mr", "rate_optimal_mr",
            "latency_1k_blocking_default_mr"} <= ids
    # the matrix: every cell at every size, against its raw transport
    assert "The matrix" in done.stdout and "blocking_optimal" in done.stdout
    assert "The matrix" in (tmp_path / "bench.md").read_text()
    # the table, with ratios and targets, went to the terminal
    assert "raw grpc.aio unary" in done.stdout and "x mpi" in done.stdout and "Targets" in done.stdout
    assert "bench: 100%" in done.stderr  # progress, as plain lines when not on a terminal
    assert "| 64 KiB |" in (tmp_path / "bench.md").read_text()
    if report.write_plot(doc, tmp_path / "again.png"):
        assert (tmp_path / PLOT_NAME).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_a_failing_rank_ends_the_job(tmp_path):
    """Rank 1 raises in the middle of the run; rank 0, waiting for it, must not
    hang: the job is aborted and the command fails, naming the error."""
    _needs_mpiexec()
    from rendezvous.bench.procs import mpiexec

    cmd = [*mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", str(HERE), "fail", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("the job hung after a rank failed") from None
    assert proc.returncode != 0
    assert "rank 1 fails on purpose" in err
    assert not (tmp_path / JSON_NAME).exists()


@pytest.mark.timeout(60)
def test_the_launcher_gives_up_after_its_timeout(tmp_path):
    _needs_mpiexec()
    done = _bench(tmp_path, "--timeout", "0.5", "--samples", "1000", timeout=60)
    assert done.returncode == 1
    assert "ran past --timeout 0.5s" in done.stderr


def _failing_rank(out: str) -> None:
    """Under mpiexec: the tiny run, with rank 1's raw-gRPC producer raising."""
    from rendezvous.bench import cli, contenders

    async def broken(self, n, count, batch):
        raise RuntimeError("rank 1 fails on purpose")

    if os.environ.get("PMI_RANK") == "1":
        contenders.RawGrpc.prepare = broken
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--sizes", "1K", "--samples", "2", "--contenders", "mpi,grpc", "--out", out])
    sys.exit(cli.run(args))


if __name__ == "__main__":
    if sys.argv[1] == "fail":
        _failing_rank(sys.argv[2])


@pytest.mark.timeout(10)
def test_gpu_target_against_the_slower_of_its_two_bounds():
    raw = _raw()
    for size in SIZES:
        mpi_us = 5 + size / 5000
        raw["samples"].setdefault("gpu_staged", {})[size] = [int(mpi_us * 2000)] * 5  # 0.5x raw MPI
        raw["samples"].setdefault("gpu_serial", {})[size] = [int(mpi_us * 4000)] * 5  # 0.25x
        raw["samples"].setdefault("d2h", {})[size] = [int(mpi_us * 500)] * 5  # 2x raw MPI: MPI is the bound
    raw["contenders"].update(gpu_staged="rendezvous GPU->GPU", gpu_serial="1 chunk", d2h="device -> host")
    doc = results.build(raw, quick=True, args={}, now=NOW)
    results.validate(doc)
    t = _target(doc, f"gpu_staged_{16 * MiB}")
    assert t["measured"] == pytest.approx(0.5) and t["ok"] is False
    assert "2.00x the bandwidth with one chunk in flight" in t["note"]
    assert not any(t["id"] == f"gpu_staged_{MiB}" for t in doc["targets"])  # from 16 MiB up
    assert not any(t["id"].startswith("gpu_") for t in _doc()["targets"])  # not measured: not listed


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_tiny_run_of_the_gpu_contenders_on_the_fake_gpu(tmp_path):
    _needs_mpiexec()
    done = _bench(tmp_path, "--gpu", "fake", "--contenders", "mpi,gpu_staged,gpu_serial,d2h", "--no-rss",
                  "--gpu-staging", "4K:1,8K:3")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    doc = report.load(tmp_path / JSON_NAME)
    assert {"gpu_staged", "gpu_serial", "d2h", "gpu_staged_4K_x1", "gpu_staged_8K_x3"} <= set(doc["contenders"])
    assert doc["contenders"]["gpu_staged_8K_x3"] == "rendezvous GPU->GPU, 8 KiB chunks x 3"
    assert any("fake GPU" in n for n in doc["notes"])
    cells = {(t["contender"], t["size"]) for t in doc["transfers"]}
    assert {("gpu_staged", 65536), ("gpu_serial", 1024), ("d2h", 65536), ("gpu_staged_4K_x1", 65536),
            ("gpu_staged_8K_x3", 1024)} <= cells


@pytest.mark.timeout(10)
def test_staging_settings_are_read_from_their_names():
    from rendezvous.bench.gpu import is_gpu_contender, staging_name, staging_setting

    assert staging_name("4m:4") == "gpu_staged_4M_x4" and staging_setting("gpu_staged_4M_x4") == (4 << 20, 4)
    assert staging_setting("gpu_staged") is None and is_gpu_contender("gpu_staged_16M_x2")
    assert not is_gpu_contender("optimal")
    for bad in ("4M", "4M:0", "1K:2", "x:2"):
        with pytest.raises(ValueError):
            staging_name(bad)


@pytest.mark.timeout(10)
def test_model_shapes_match_the_published_architectures():
    from rendezvous.bench import models

    assert len(models.shapes("resnet50")) == 161
    assert sum(math.prod(s) for s in models.shapes("resnet50")) == 25_557_032  # torchvision's count
    assert len(models.shapes("bert-base")) == 199
    assert sum(math.prod(s) for s in models.shapes("bert-base")) == 109_482_240  # with the pooler
    small = models.shapes("many-small")
    assert len(small) == 2000 and all(16 <= 4 * s[0] <= 64 << 10 for s in small)
    with pytest.raises(ValueError, match="unknown model"):
        models.shapes("vgg")


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tiny_step_exchange_run_writes_its_table(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rendezvous", "bench-steps", "--steps", "1", "--models",
                          "resnet50,many-small", "--contenders",
                          "mpi,optimal,default,optimal_many,daemon_many,blocking,blocking_many,blocking_mr_many,grpc",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    doc = json.loads((tmp_path / "steps.json").read_text())
    assert set(doc["models"]) == {"resnet50", "many-small"}
    for model in doc["models"].values():
        assert set(model["seconds"]) == {"mpi", "optimal", "default", "optimal_many", "daemon_many", "blocking",
                                         "blocking_many", "blocking_mr_many", "grpc"}
        assert all(len(t) == 1 and t[0] > 0 for t in model["seconds"].values())
        cpu = model["cpu_us_per_tensor"]  # the loop's contenders, on each rank
        assert set(cpu) == {"mpi", "optimal", "default", "optimal_many", "daemon_many", "grpc"}
        assert all(c["consumer"] > 0 and c["producer"] > 0 for c in cpu.values()), cpu
    table = (tmp_path / "steps.md").read_text()
    assert "**resnet50**: 161 tensors, 97.5 MiB per step" in table and "| optimal |" in table
    assert "CPU µs per tensor (consumer / producer)" in table


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tiny_step_exchange_with_the_consumer_first(tmp_path):
    """The order training runs in: the consumer's receives posted first, the
    producer's sends inside the clock; the waiting contenders' ratios are to
    raw MPI and gloo timed the same way."""
    names = ["mpi_waiting", "optimal_many_waiting", "optimal_many_waiting_each", "optimal_mr_many_waiting",
             "blocking_many_waiting"]
    out = subprocess.run([sys.executable, "-m", "rendezvous", "bench-steps", "--steps", "1", "--models",
                          "many-small", "--contenders", ",".join(names), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    doc = json.loads((tmp_path / "steps.json").read_text())
    seconds = doc["models"]["many-small"]["seconds"]
    assert set(seconds) == set(names) and all(len(t) == 1 and t[0] > 0 for t in seconds.values())
    table = (tmp_path / "steps.md").read_text()
    assert "ratios are to `mpi_waiting`" in table and "| optimal_many_waiting |" in table
    assert "| mpi_waiting | " in table and "| 1.00 |" in table  # raw MPI against itself


def test_rest_puts_a_servers_mpi_engine_to_its_idle_pace():
    """Between batches the bench rests every contender's MPI engine (one left
    attentive spins beside the contender being measured). It reaches the
    engine through the server's link; a server whose every byte goes over
    gRPC has nothing to rest.

    Checked to fail: with rest() looking for the engine where the server no
    longer keeps it, the engine was never rested (and the quick matrix's
    1 KiB cells measured half their speed beside attentive engines)."""
    import types

    from rendezvous.bench.contenders import rest
    from rendezvous.mpi.rank import MpiRank
    from rendezvous.transport.link import GrpcOnly

    class Engine:
        rested = 0

        def rest(self) -> None:
            self.rested += 1

    link = MpiRank.__new__(MpiRank)
    link.engine = Engine()
    rest(types.SimpleNamespace(link=link))
    assert link.engine.rested == 1
    rest(types.SimpleNamespace(link=GrpcOnly()))
    rest(None)
