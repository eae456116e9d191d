"""Multi-rank tests under mpiexec (scenarios in mpi_scenarios.py).

The launcher is `mpiexec` from the virtualenv (the `mpich` wheel) unless
RENDEZVOUS_MPIEXEC names another, e.g. RENDEZVOUS_MPIEXEC="mpirun --oversubscribe".
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from rendezvous.config import env_flag

pytestmark = pytest.mark.mpi
HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "mpi_scenarios.py")


def mpiexec() -> list[str]:
    custom = os.environ.get("RENDEZVOUS_MPIEXEC")
    if custom:
        return shlex.split(custom)
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec (pip install 'rendezvous[mpi]')")
    return [found]


def parse_results(text: str) -> list[dict]:
    """Every `RESULT {json}` record, even when the launcher glued two ranks'
    lines together."""
    decoder = json.JSONDecoder()
    found = []
    for part in text.split("RESULT ")[1:]:
        found.append(decoder.raw_decode(part)[0])
    return found


class Coordinator:
    """Hands each rank the list of all ranks' addresses (for runs without MPI,
    where no allgather can publish the ports the OS chose)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(100)
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conns, table = [], [""] * self.n
        try:
            while len(conns) < self.n:
                conn, _ = self.sock.accept()
                rank, address = json.loads(conn.makefile().readline())
                table[rank] = address
                conns.append(conn)
            for conn in conns:
                conn.sendall((json.dumps(table) + "\n").encode())
        except OSError:
            pass  # the job ended before every rank checked in
        finally:
            for conn in conns:
                conn.close()
            self.sock.close()


def launch(n: int, scenario: str, *args: str, env: dict | None = None, timeout: float = 120,
           check: bool = True, script: str = SCRIPT) -> tuple[int, list[dict], str]:
    cmd = [*mpiexec(), "-n", str(n), sys.executable, script, scenario, *args]
    coordinator = Coordinator(n)
    full_env = {**os.environ, **(env or {}), "RENDEZVOUS_TEST_COORD": coordinator.address}
    for var in ("MPI_DISABLED", "MPI_OPTIMAL_PATH"):
        if env is None or var not in env:
            full_env.pop(var, None)
    # stdout carries only RESULT lines; stderr is kept apart so the ranks'
    # log lines can never run into them.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{scenario} hung past {timeout}s:\n{stdout[-2000:]}{stderr[-4000:]}") from None
    results = parse_results(stdout)
    out = stdout + stderr
    if check:
        assert proc.returncode == 0, f"{scenario} failed ({proc.returncode}):\n{out[-6000:]}"
        assert len(results) == n, out[-4000:]
    return proc.returncode, results, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_all_sizes_on_the_optimal_path():
    _, results, out = launch(2, "sizes", "full", env={"MPI_OPTIMAL_PATH": "1"}, timeout=280)
    for r in results:
        assert r["stats"]["mpi"]["transfers"] == 5  # 1 KiB, 64 KiB, 1 MiB+7, 16 MiB, 256 MiB
        assert r["stats"]["grpc"]["transfers"] == 5  # 0, 1, 1023 B, the strings, the finish handshake
        assert r["stats"]["grpc"]["fallbacks"] == 1  # the string tensor
        assert r["stats"]["mpi"]["in_flight"] == 0
    assert "MPI_OPTIMAL_PATH=1 (env MPI_OPTIMAL_PATH)" in out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("nolocal", ["0", "1"], ids=["one-node", "every-rank-remote"])
def test_the_aio_servers_loop_polls_every_transfer_on_one_node_or_across_hosts(nolocal):
    """gRPC requests on the aio server: on one node no rank is remote, with
    ``MPIR_CVAR_NOLOCAL=1`` (MPI treats every rank as on another node, as on
    the namespace hosts) the other rank is; either way the loop polls every
    transfer (no ``loop_peers``: a large message moves as fast as it is
    polled). Every size crosses whole either way, over MPI."""
    _, results, _ = launch(2, "network_peers", env={"MPIR_CVAR_NOLOCAL": nolocal}, timeout=180)
    for r in results:
        other = 1 - r["rank"]
        expected = [other] if nolocal == "1" else []
        assert r["remote"] == expected and r["loop_peers"] is None and r["home"]
        assert r["mpi_transfers"] == 4  # all of them: the two small ones packed in one fusion buffer


@pytest.mark.timeout(200)
@pytest.mark.parametrize("requests", ["0", "1"], ids=["grpc-requests", "mpi-requests"])
def test_the_blocking_servers_loop_polls_only_remote_transfers_whatever_the_requests(requests):
    """The blocking Server (whose loop thread must leave the GIL to the
    caller's threads while they compute) polls on its loop only transfers
    with ranks MPI reaches over the network, with requests over gRPC or MPI
    alike; with requests over MPI it counts the callers waiting on a recv
    (while one does, its loop polls every transfer), and none is left
    counted once the recvs returned."""
    _, results, _ = launch(2, "network_peers", "blocking",
                           env={"MPIR_CVAR_NOLOCAL": "1", "RENDEZVOUS_MPI_REQUESTS": requests}, timeout=180)
    for r in results:
        assert r["remote"] == [1 - r["rank"]] and r["loop_peers"] == [1 - r["rank"]] and r["home"]
        assert r["attended"] == (0 if requests == "1" else None)
        assert r["mpi_transfers"] == (3 if requests == "1" else 2)  # over MPI requests, the handshake too


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_all_sizes_on_the_default_path():
    _, results, _ = launch(2, "sizes", "full", env={"MPI_OPTIMAL_PATH": "0"}, timeout=280)
    for r in results:
        assert r["stats"]["mpi"]["transfers"] == 0 and r["stats"]["grpc"]["transfers"] == 10


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimal", ["1", "0"], ids=["optimal", "default"])
def test_all_sizes_with_requests_over_mpi(optimal):
    """RENDEZVOUS_MPI_REQUESTS=1: asked and answered over MPI, on both paths;
    every size, its content and its path checked by the scenario."""
    _, results, out = launch(2, "sizes", "full", env={"MPI_OPTIMAL_PATH": optimal, "RENDEZVOUS_MPI_REQUESTS": "1"},
                             timeout=280)
    for r in results:
        assert r["stats"]["mpi"]["transfers"] == 10 and r["stats"]["grpc"]["transfers"] == 0, r["stats"]
    assert "requests over MPI (RENDEZVOUS_MPI_REQUESTS=1)" in out


TOGGLES = [
    ({}, "mpi"),
    ({"MPI_OPTIMAL_PATH": "1"}, "mpi"),
    ({"MPI_OPTIMAL_PATH": "0"}, "grpc"),
    ({"MPI_DISABLED": "0"}, "mpi"),
    ({"MPI_DISABLED": "0", "MPI_OPTIMAL_PATH": "0"}, "grpc"),
    ({"MPI_DISABLED": "1"}, "grpc"),
    ({"MPI_DISABLED": "1", "MPI_OPTIMAL_PATH": "1"}, "grpc"),
    ({"MPI_DISABLED": "1", "MPI_OPTIMAL_PATH": "0"}, "grpc"),
    # words read as written (once only a leading '1' meant on: "true" kept MPI on)
    ({"MPI_DISABLED": "true"}, "grpc"),
    ({"MPI_DISABLED": "no", "MPI_OPTIMAL_PATH": "false"}, "grpc"),
    ({"MPI_DISABLED": "Off", "MPI_OPTIMAL_PATH": "on"}, "mpi"),
    # requests over MPI: every transfer between the ranks is MPI's, even inline ones
    ({"RENDEZVOUS_MPI_REQUESTS": "1"}, "mpi"),
    ({"RENDEZVOUS_MPI_REQUESTS": "1", "MPI_OPTIMAL_PATH": "0"}, "mpi"),
    ({"RENDEZVOUS_MPI_REQUESTS": "1", "MPI_DISABLED": "1"}, "grpc"),  # no MPI: the setting has no effect
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env,large_path", TOGGLES, ids=[json.dumps(e) for e, _ in TOGGLES])
def test_toggles(env, large_path):
    _, results, out = launch(2, "sizes", "small", env=env, timeout=100)
    for r in results:
        s = r["stats"]
        assert s[large_path]["transfers"] >= 2, s  # 1024 B and 1 MiB
        if large_path == "grpc":
            assert s["mpi"]["transfers"] == 0
        disabled = env_flag(env.get("MPI_DISABLED", "0"))
        assert r["mpi_disabled"] is disabled
        assert r["mpi_imported"] is (not disabled), "MPI_DISABLED=1 must not import mpi4py"
    if env_flag(env.get("MPI_DISABLED", "0")):
        assert "MPI_DISABLED=1: MPI off" in out
    else:
        assert "MPI_OPTIMAL_PATH=" in out and "thread level MULTIPLE" in out


#: every path a recv can take between two ranks of one job
PATHS = {
    "grpc-requests-optimal": {"MPI_OPTIMAL_PATH": "1", "RENDEZVOUS_MPI_REQUESTS": "0"},
    "grpc-requests-default": {"MPI_OPTIMAL_PATH": "0", "RENDEZVOUS_MPI_REQUESTS": "0"},
    # a reply below one frame travels inside the request stream's messages: frames
    # of 64 KiB send the 256 KiB tensors as separate transfers
    "mpi-requests-optimal": {"MPI_OPTIMAL_PATH": "1", "RENDEZVOUS_MPI_REQUESTS": "1",
                             "RENDEZVOUS_CHUNK_BYTES": str(64 << 10)},
    "mpi-requests-default": {"MPI_OPTIMAL_PATH": "0", "RENDEZVOUS_MPI_REQUESTS": "1"},
    "mpi-disabled": {"MPI_DISABLED": "1"},
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("path,api", [*((p, "aio") for p in PATHS),
                                      # the blocking Server's recvs from a pool of 16 threads: the
                                      # same code below it, slower to drive (fewer tensors)
                                      ("grpc-requests-optimal", "blocking"), ("mpi-requests-optimal", "blocking"),
                                      # recv_many: batches under one deadline, all or none
                                      *((p, "batch") for p in PATHS)])
def test_racing_deadlines_deliver_every_tensor_exactly_once(path, api):
    """Short deadlines racing transfers on every path (tests/racing.py): each
    tensor arrives once with its own contents, asking every key again afterwards
    gets nothing, and nothing is left on either rank."""
    n = "300" if api == "blocking" else "1000"
    _, results, out = launch(2, "exactly_once", n, api, env=PATHS[path], timeout=130)
    consumer = next(r for r in results if r["rank"] == 0)
    producer = next(r for r in results if r["rank"] == 1)
    assert consumer["timed_out"] > 0, out[-2000:]  # the race was exercised
    assert not consumer["wrong"], consumer
    assert not consumer["twice"], f"{len(consumer['twice'])} tensors delivered twice: {consumer['twice'][:20]}"
    assert consumer["kept"] == 0 and consumer["unsettled"] == 0, consumer
    assert producer["left"] == 0, producer  # nothing left in the producer's table
    if api == "batch":  # small tensors ready together went in group replies (fused)
        assert producer["fused"] > 0, producer
    if path.startswith("mpi-disabled"):
        assert consumer["mpi"] == 0
    elif path != "grpc-requests-default":
        assert consumer["mpi"] > 0  # the path was taken


@pytest.mark.timeout(150)
@pytest.mark.parametrize("path,api", [("grpc-requests-optimal", "aio"), ("grpc-requests-optimal", "batch"),
                                      ("grpc-requests-default", "aio"), ("mpi-disabled", "batch")])
def test_connections_cut_mid_race_deliver_every_tensor_exactly_once(path, api):
    """The race above with the consumer's connection to the producer reset
    eight times while tensors are in flight (tests/cutting.py): replies and
    descriptors written into the dead connection never arrive, recvs ask
    again with their request ids on a new one. Each tensor still arrives
    once; asking every key again gets nothing, no request id is left in
    doubt, and nothing is left on either rank, MPI sends included (a
    descriptor lost with its connection is sent again for the retry, so its
    transfer is received: a second transfer would leave the first waiting
    forever)."""
    _, results, out = launch(2, "exactly_once", "1000", api, "8", env=PATHS[path], timeout=130)
    consumer = next(r for r in results if r["rank"] == 0)
    producer = next(r for r in results if r["rank"] == 1)
    assert consumer["cuts"] >= 4 and consumer["connections"] > consumer["cuts"], consumer  # cut, and reconnected
    assert not consumer["wrong"], consumer
    assert not consumer["twice"], f"{len(consumer['twice'])} tensors delivered twice: {consumer['twice'][:20]}"
    assert consumer["kept"] == 0 and consumer["unsettled"] == 0, consumer
    assert producer["left"] == 0, producer
    if path == "grpc-requests-optimal":
        assert consumer["mpi"] > 0
    else:
        assert consumer["mpi"] == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("requests", ["0", "1"], ids=["grpc-requests", "mpi-requests"])
def test_each_transfer_and_error_is_counted_under_the_path_it_took(requests):
    """A small tensor (inside the reply), a large one (the optimal path) and a
    recv that fails (its step aborted at the producer): counted on both ranks
    under the path each took. With requests over MPI the reply carrying the
    small tensor travelled by MPI too: it was counted under grpc by its
    producer, and every remote error under grpc whatever the path."""
    _, results, out = launch(2, "stats_paths", env={"MPI_OPTIMAL_PATH": "1", "RENDEZVOUS_MPI_REQUESTS": requests},
                             timeout=110)
    consumer = next(r for r in results if r["rank"] == 0)["stats"]
    producer = next(r for r in results if r["rank"] == 1)["stats"]
    small_path = "mpi" if requests == "1" else "grpc"
    # the finish handshake's 1-element tensors travel like the small one, each way
    expected = {"grpc": 0, "mpi": 1}
    expected[small_path] += 2  # "small" and the handshake's "finished"
    assert {p: consumer[p]["transfers"] for p in ("grpc", "mpi")} == expected, consumer
    assert {p: producer[p]["served"] for p in ("grpc", "mpi")} == expected, producer
    assert consumer[small_path]["errors"] == 1 and sum(consumer[p]["errors"] for p in ("grpc", "mpi")) == 1, consumer


@pytest.mark.timeout(60)
def test_control_messages_reach_their_listener_in_the_order_they_were_sent():
    """A large message and two small ones, 200 times, in bursts: the receives of a
    large and a small message complete in either order, and the MPI thread and
    the loop both hand messages over; a listener once got them reordered (with
    requests over MPI, a cancel before the request it cancels: that recv waited
    forever). Now they come in the order sent."""
    _, results, out = launch(2, "control_order", "200", timeout=50)
    consumer = next(r for r in results if r["rank"] == 0)
    assert consumer["in_order"], f"reordered from message {consumer['first_wrong']}"


@pytest.mark.timeout(120)
def test_an_idle_rank_still_lets_its_peers_sends_complete():
    """A send completes only once its receiver's MPI has said the bytes
    arrived, and that message may wait in the receiver until it calls MPI
    again (MPI's progress is weak): a rank whose receives were all done and
    whose engine then slept left its producer's sends waiting forever (the
    exactly-once race once hung so under load, its producer holding a dozen
    fused sends). Rank 1 sends two bursts without polling between them, so
    its queue for those messages fills; rank 0, idle once its receives are
    in, still calls MPI, and the sends complete."""
    _, results, out = launch(2, "owed_progress", timeout=100)
    receiver = next(r for r in results if r["rank"] == 0)
    sender = next(r for r in results if r["rank"] == 1)
    assert receiver["right"], out[-2000:]
    assert sender["complete"], f"rank 1's sends were still waiting {sender['seconds']:.1f}s after rank 0 went idle"


@pytest.mark.timeout(120)
def test_an_idle_listener_takes_a_message_at_its_first_wake_up():
    """With requests over MPI an idle rank probes for requests every so
    often. The first probe after a pause misses a message that arrived
    during it (its MPI pulls the message in, and only the next probe
    matches it), so a request to an idle rank waited one more pause, every
    time (16-19 ms at a 10 ms pace). The engine probes again at once when
    woken from an idle pause: the message is taken at the first wake-up
    after it arrived (at a 300 ms pace here; a wake-up between the message
    and rank 1's word takes it before the word, hence at most one)."""
    _, results, out = launch(2, "idle_listener", timeout=100)
    receiver = next(r for r in results if r["rank"] == 0)
    assert receiver["right"] and receiver["source"] == 1, out[-2000:]
    assert receiver["wakes_after"] <= 1, receiver


def _wait_for_files(proc: subprocess.Popen, paths: list, timeout: float) -> None:
    """Until every path exists (a rank's signal to the test), failing at once if
    the job ends first and after ``timeout`` seconds otherwise."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no {[str(p) for p in paths]} after {timeout:g}s"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_stopped_rank_fails_recvs_within_the_keepalive_bound_and_the_job_goes_on(tmp_path):
    cmd = [*mpiexec(), "-n", "2", sys.executable, SCRIPT, "stopped_producer", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k not in ("MPI_DISABLED", "MPI_OPTIMAL_PATH")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    pid = None
    try:
        _wait_for_files(proc, [tmp_path / "producer.pid", tmp_path / "consumer.ready"], 60)
        pid = int((tmp_path / "producer.pid").read_text())
        os.kill(pid, signal.SIGSTOP)
        (tmp_path / "stopped").write_text("1")
        _wait_for_files(proc, [tmp_path / "failed"], 30)
        os.kill(pid, signal.SIGCONT)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):  # never leave a rank stopped
                os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, stderr[-4000:]
    results = {r["rank"]: r for r in parse_results(stdout)}
    assert results[0]["error"] == "UNAVAILABLE" and results[0]["seconds"] < 15, results
    assert results[1]["go_on"] == 7  # continued, the stopped rank goes on with the job


@pytest.mark.timeout(120)
@pytest.mark.parametrize("requests", ["0", "1"], ids=["grpc-requests", "mpi-requests"])
def test_abort_before_and_during_a_transfer(requests):
    launch(2, "abort", timeout=100, env={"RENDEZVOUS_MPI_REQUESTS": requests})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("requests", ["0", "1"], ids=["grpc-requests", "mpi-requests"])
def test_idle_rank_uses_almost_no_cpu(requests):
    _, results, _ = launch(2, "idle", "4", timeout=100, env={"RENDEZVOUS_MPI_REQUESTS": requests})
    for r in results:
        assert r["stats"]["mpi"]["transfers"] >= 20
        # What the test holds is behaviour: with nothing in flight nothing is
        # tested for completion. The CPU an idle rank uses is a speed figure:
        # `make bench` measures and reports it.
        # (with requests over MPI a late control message, such as the other
        # rank's stream end, may still be received and completed: a poll or two)
        assert r["polls"] <= (0 if requests == "0" else 4), "polled while nothing was in flight"
        if requests == "0":
            # nobody listens: MPI is still called (its progress is weak: a peer's
            # send may wait on it, see test_an_idle_rank_still_lets_its_peers_sends_complete),
            # two seconds after traffic about every half second
            assert 0 < r["probes"] <= r["late_wall"] / 0.5 * 1.5 + 1, r
        else:
            # idle for two seconds: the two listeners (requests, replies) are probed
            # every 50 ms (a 32nd of the quiet, at most 50 ms), not every 10 ms;
            # twice each time (the first probe after a pause misses what arrived)
            bound = 2 * 2 * r["late_wall"] / 0.05 * 1.25 + 4
            assert 0 < r["probes"] <= bound, (r, bound)


@pytest.mark.timeout(120)
def test_failing_rank_aborts_the_job():
    # rank 0 waits 600 s for a tensor rank 1 never sends: only MPI_Abort ends
    # the job before launch()'s 100 s limit fails the test.
    started = time.monotonic()
    code, results, out = launch(2, "fail", timeout=100, check=False)
    # Ended by the failing rank's own MPI_Abort(1): the launcher exits with that
    # code (a crash, a signal or rank 0 giving up would give another), long before
    # rank 0's 600 s wait, and rank 0 reported nothing. (The ranks' last lines on
    # stderr, the traceback and MPICH's "Abort(1)" line, are usually there but not
    # always: the launcher may kill a rank before it forwards them.)
    assert code == 1, out[-3000:]
    assert time.monotonic() - started < 60
    assert results == []


@pytest.mark.timeout(180)
def test_task_outside_the_mpi_world_is_served_over_grpc():
    ps = subprocess.Popen([sys.executable, SCRIPT, "outside_ps"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env={**os.environ, "MPI_DISABLED": "1"},
                          start_new_session=True)
    try:
        line = ps.stdout.readline()
        assert line.startswith("ADDRESS "), line + ps.stderr.read()
        env = {"PS_ADDRESS": line.split()[1]}
        cmd = [*mpiexec(), "-n", "2", sys.executable, SCRIPT, "outside"]
        errors = tempfile.TemporaryFile("w+")  # kept apart: stderr lines would interleave
        job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True,
                               env={**os.environ, **env}, start_new_session=True)
        lines = []
        try:
            for out_line in job.stdout:
                lines.append(out_line)
                if out_line.startswith("CLUSTER "):
                    ps.stdin.write(out_line[8:])
                    ps.stdin.flush()
            if job.wait(timeout=150) != 0:
                errors.seek(0)
                raise AssertionError("".join(lines)[-3000:] + errors.read()[-5000:])
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
        ps_out, ps_err = ps.communicate(timeout=30)
        assert ps.returncode == 0, ps_err[-4000:]
        ps_result = parse_results(ps_out)[0]
        assert ps_result["mpi_imported"] is False
        assert ps_result["stats"]["grpc"]["transfers"] == 2
        workers = parse_results("".join(lines))
        assert len(workers) == 2
        for w in workers:
            s = w["stats"]
            assert s["mpi"]["transfers"] == 1, s  # the other worker, same MPI job
            assert s["grpc"]["transfers"] >= 2, s  # from the ps, outside the job
            assert s["grpc"]["fallbacks"] >= 1, s  # what it served to the ps went by gRPC
    finally:
        if ps.poll() is None:
            os.killpg(ps.pid, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_without_a_single_copy_path_a_node_s_large_transfers_are_polled():
    """The start-up probe: with MPICH's CMA turned off a large message between
    two ranks of this node moves only as both sides poll, and every rank's
    engine polls such transfers (spinning when they stall); with the
    library's default, both ranks agree on what the probe found, and where it
    found a single copy the engine leaves the node's transfers unpolled."""
    _, off, out = launch(2, "single_copy", env={"MPIR_CVAR_CH4_CMA_ENABLE": "0"}, timeout=100)
    assert [r["single_copy"] for r in off] == [False, False] and all(r["copied"] == [] for r in off)
    assert out.count("no single-copy path") == 2, out  # each rank's start-up line says so
    _, default, _ = launch(2, "single_copy", timeout=100)
    found = {r["single_copy"] for r in default}
    assert len(found) == 1 and found <= {True, False}, default
    assert sorted(r["copied"] for r in default) == ([[0], [1]] if found == {True} else [[], []])


@pytest.mark.timeout(120)
def test_long_task_names_and_duplicate_tasks():
    _, results, _ = launch(2, "names", timeout=100)
    long_job = "j" + "x" * 299
    for r in results:
        assert r["ranks"] == {f"/job:{long_job}/replica:0/task:0": 0, f"/job:{long_job}/replica:0/task:1": 1}
        assert r["duplicate_error"] and "claimed by MPI ranks 0 and 1" in r["duplicate_error"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("requests", ["0", "1"], ids=["grpc-requests", "mpi-requests"])
def test_incarnations_are_exchanged_and_a_stale_one_is_aborted(requests):
    _, results, _ = launch(2, "incarnations", timeout=100, env={"RENDEZVOUS_MPI_REQUESTS": requests})
    for r in results:
        assert r["known"] in r["refusal"] and r["stale"] in r["refusal"], r
        assert "restarted" in r["refusal"] and r["pending"] == 0


@pytest.mark.huge
@pytest.mark.timeout(600)
@pytest.mark.parametrize("requests", ["0", "1"], ids=["grpc-requests", "mpi-requests"])
def test_over_two_gib_over_mpi(requests):
    launch(2, "huge", timeout=580, env={"RENDEZVOUS_MPI_REQUESTS": requests})
