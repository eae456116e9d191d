"""The timeline (RENDEZVOUS_TIMELINE): every send, recv and serve as Chrome trace events.

What is checked of a file is what Perfetto and chrome://tracing need of the
Trace Event Format's JSON array form: after a clean stop the file is plain
JSON; every event has ``ph``, ``name``, ``pid``, ``tid`` and (but metadata)
``ts``, a complete event ``dur``; the complete events of one lane nest (a
viewer draws a lane's spans as a stack). After a crash the closing bracket
is missing: the file is then a prefix of such an array, which Perfetto's
JSON tokenizer reads event by event up to the end (an array left open at the
end of the file is accepted there, and so are a trailing comma and a partial
last event); :func:`rendezvous.timeline.read_trace` reads it the same way,
and the test of a killed process checks both: that the text is such a
prefix, and what read_trace finds in it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

import rendezvous
from rendezvous import aio
from rendezvous.keys import TaskName
from rendezvous.table import WaitingTable
from rendezvous.timeline import LANES, Timeline, merge, read_trace
from rendezvous.transport import Planes

from conftest import cluster, key, run, until

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def load(path: Path) -> list[dict]:
    """A cleanly closed timeline: plain JSON, every event well formed."""
    events = json.loads(path.read_text())
    assert isinstance(events, list) and events
    for e in events:
        assert {"ph", "name", "pid", "tid"} <= set(e), e
        assert isinstance(e["pid"], int) and e["pid"] >= 1 and isinstance(e["tid"], int) and e["tid"] > 0, e
        if e["ph"] != "M":
            assert isinstance(e["ts"], int) and "cat" in e, e
        if e["ph"] == "X":
            assert isinstance(e["dur"], int) and e["dur"] >= 0, e
        if e["ph"] == "i":
            assert e["s"] == "t", e
    assert_lanes_nest(events)
    return events


def assert_lanes_nest(events: list[dict]) -> None:
    """On each lane, a complete event starting inside another ends inside it."""
    lanes = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            lanes[(e["pid"], e["tid"])].append(e)
    for spans in lanes.values():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ends: list[int] = []
        for e in spans:
            while open_ends and open_ends[-1] <= e["ts"]:
                open_ends.pop()
            end = e["ts"] + e["dur"]
            if open_ends:
                assert end <= open_ends[-1], f"{e} overlaps the span it starts in"
            open_ends.append(end)


def spans(events: list[dict], cat: str, name: str | None = None) -> list[dict]:
    return [e for e in events if e["ph"] == "X" and e.get("cat") == cat and (name is None or e["name"] == name)]


def phases(events: list[dict], span: dict) -> dict[str, dict]:
    """The phases inside ``span``, by name."""
    end = span["ts"] + span["dur"]
    return {e["name"]: e for e in events
            if e["ph"] == "X" and e.get("cat") == "phase" and e["pid"] == span["pid"] and e["tid"] == span["tid"]
            and span["ts"] <= e["ts"] and e["ts"] + e["dur"] <= end and (e["ts"] < end or span["dur"] == 0)}


def lane_names(events: list[dict]) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}


@pytest.mark.timeout(60)
def test_every_recv_serve_and_send_is_in_the_producers_and_consumers_files(tmp_path):
    template = str(tmp_path / "{job_name}-{task_index}.json")

    async def main():
        async with cluster(2, timeline=template, chunk_bytes=1024) as (a, b):
            assert a.timeline is not None and a.timeline.path == str(tmp_path / "worker-0.json")
            small, big = np.arange(16, dtype=np.float32), np.arange(10_000, dtype=np.float32)
            b.send(key(1, 0, "small"), small, step_id=1)
            b.send(key(1, 0, "big"), big, step_id=1)  # chunked: its bytes come after the answer
            b.send(key(1, 0, "dead"), None, step_id=1, is_dead=True)
            np.testing.assert_array_equal(await a.recv(key(1, 0, "small"), step_id=1, timeout=10), small)
            np.testing.assert_array_equal(await a.recv(key(1, 0, "big"), step_id=1, timeout=10), big)
            assert (await a.recv_item(key(1, 0, "dead"), step_id=1, timeout=10)).is_dead
            early = asyncio.ensure_future(a.recv(key(1, 0, "early"), step_id=2, timeout=10))
            await until(b.pending, what="the request to wait at the producer")
            b.send(key(1, 0, "early"), small, step_id=2)
            await early
            a.send(key(0, 0, "own"), small, step_id=3)
            assert (await a.recv(key(0, 0, "own"), step_id=3, timeout=10)) is small
            with pytest.raises(rendezvous.DeadlineExceeded):
                await a.recv(key(1, 0, "never"), step_id=4, timeout=0.2)
    run(main())

    consumer, producer = load(tmp_path / "worker-0.json"), load(tmp_path / "worker-1.json")
    # one process per task, named after it, pid its place in the cluster (from 1)
    for events, pid, task in ((consumer, 1, "/job:worker/replica:0/task:0"),
                              (producer, 2, "/job:worker/replica:0/task:1")):
        assert {e["pid"] for e in events} == {pid}
        assert all(pid * LANES <= e["tid"] < (pid + 1) * LANES for e in events)
        names = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"]
        assert names == [task]
        started = [e for e in events if e["name"] == "timeline started"]
        assert len(started) == 1 and "clock" in started[0]["args"]

    recvs = {e["args"]["key"].split(";")[3]: e for e in spans(consumer, "recv")}
    assert set(recvs) == {"small", "big", "dead", "early", "own", "never"}
    assert all(len(spans(consumer, "recv", name)) == 1 for name in ("recv small", "recv big", "recv own"))
    lanes = lane_names(consumer)
    peer = "/job:worker/replica:0/task:1"
    for name, nbytes in (("small", 64), ("big", 40_000), ("early", 64)):
        e = recvs[name]
        assert e["name"] == f"recv {name}"
        assert e["args"] == {"key": key(1, 0, name), "step_id": 2 if name == "early" else 1, "peer": peer,
                             "path": "grpc", "bytes": nbytes, "outcome": "ok"}
        assert lanes[e["tid"]] == f"recv from {peer}"
        inside = phases(consumer, e)
        assert inside["wait"]["ts"] == e["ts"]  # from the call until the producer answered
    big_phases = phases(consumer, recvs["big"])
    assert big_phases["transfer grpc"]["ts"] >= big_phases["wait"]["ts"] + big_phases["wait"]["dur"]
    assert "transfer grpc" not in phases(consumer, recvs["small"])  # its bytes came with the answer
    assert recvs["dead"]["args"]["outcome"] == "dead" and recvs["dead"]["args"]["bytes"] == 0
    own = recvs["own"]
    assert own["args"]["path"] == "local" and own["args"]["peer"] == "/job:worker/replica:0/task:0"
    assert lanes[own["tid"]] == "recv (local)"
    never = recvs["never"]
    assert never["name"] == "recv never: DEADLINE_EXCEEDED" and never["cname"] == "terrible"
    assert never["args"]["outcome"] == "DEADLINE_EXCEEDED" and "timed out" in never["args"]["error"]
    assert never["dur"] >= 190_000
    assert phases(consumer, never)["wait"]["ts"] == never["ts"]  # it waited, and nothing came

    serves = {e["args"]["key"].split(";")[3]: e for e in spans(producer, "serve")}
    assert set(serves) == {"small", "big", "dead", "early", "never"}
    for name, nbytes in (("small", 64), ("big", 40_000)):
        assert serves[name]["args"] == {"key": key(1, 0, name), "step_id": 1, "peer": "/job:worker/replica:0/task:0",
                                        "path": "grpc", "bytes": nbytes, "outcome": "ok"}
        assert "wait" not in phases(producer, serves[name])  # produced before it was asked for
    early_wait = phases(producer, serves["early"])["wait"]  # asked for before it was produced
    assert early_wait["ts"] == serves["early"]["ts"] and early_wait["dur"] > 0
    assert serves["never"]["args"]["outcome"] == "CANCELLED"  # the consumer gave up
    assert lane_names(producer)[serves["small"]["tid"]] == "serve to /job:worker/replica:0/task:0"

    sends = {e["args"]["key"].split(";")[3]: e for e in producer if e.get("cat") == "send"}
    assert set(sends) == {"small", "big", "dead", "early"}
    assert sends["big"]["ph"] == "i" and sends["big"]["args"]["bytes"] == 40_000
    assert sends["dead"]["args"]["dead"] is True and sends["dead"]["args"]["bytes"] == 0
    assert sends["early"]["ts"] <= serves["early"]["ts"] + serves["early"]["dur"]
    assert [e["args"]["key"] for e in consumer if e.get("cat") == "send"] == [key(0, 0, "own")]

    # one trace of the whole job: both processes, every event
    merged = tmp_path / "job.json"
    assert merge([tmp_path / "worker-0.json", tmp_path / "worker-1.json"], merged) == len(consumer) + len(producer)
    assert {e["pid"] for e in load(merged)} == {1, 2}


@pytest.mark.timeout(60)
def test_recvs_that_overlap_take_lanes_of_their_own(tmp_path):
    async def main():
        async with cluster(2, timeline=str(tmp_path / "w{task_index}.json")) as (a, b):
            recvs = [asyncio.ensure_future(a.recv(key(1, 0, f"t{i}"), step_id=1, timeout=10)) for i in range(20)]
            await until(lambda: len(b.pending()) == 20, what="every request to wait at the producer")
            for i in reversed(range(20)):
                b.send(key(1, 0, f"t{i}"), np.full(4, i), step_id=1)
            assert [int(r[0]) for r in await asyncio.gather(*recvs)] == list(range(20))
    run(main())
    consumer, producer = load(tmp_path / "w0.json"), load(tmp_path / "w1.json")
    assert len(spans(consumer, "recv")) == 20 and len(spans(producer, "serve")) == 20
    names = lane_names(consumer)
    recv_lanes = {names[e["tid"]] for e in spans(consumer, "recv")}
    assert len(recv_lanes) > 1 and "recv from /job:worker/replica:0/task:1 #2" in recv_lanes


@pytest.mark.timeout(60)
def test_off_there_is_no_timeline_and_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    async def main():
        async with cluster(2) as (a, b):
            b.send(key(1, 0, "t"), np.ones(4), step_id=1)
            await a.recv(key(1, 0, "t"), step_id=1, timeout=10)
            for server in (a, b):
                assert server.timeline is None and server.servicer.timeline is None
                assert type(server.table) is WaitingTable and type(server.planes) is Planes
                # nothing wraps the recvs and serves: the plain methods run
                assert "fetch" not in vars(server.receiver) and "take" not in vars(server.servicer)
    run(main())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_the_file_name_takes_the_job_and_task_and_the_blocking_server_records_its_sends(tmp_path, monkeypatch):
    monkeypatch.setenv("RENDEZVOUS_TIMELINE", str(tmp_path / "tl" / "{job_name}.{task_index}.json"))
    spec = {"ps": ["127.0.0.1:0"], "worker": ["127.0.0.1:0", "127.0.0.1:0"]}
    with rendezvous.Server(spec, "worker", 1) as server:  # the blocking Server: sends go through its loop
        k = "/job:worker/replica:0/task:1/device:CPU:0;0000000000000000;/job:worker/replica:0/task:1/device:CPU:0;x;0:0"
        server.send(k, np.arange(3), step_id=5)
        assert list(server.recv(k, step_id=5, timeout=10)) == [0, 1, 2]
        assert server.aio.timeline.path == str(tmp_path / "tl" / "worker.1.json")
    events = load(tmp_path / "tl" / "worker.1.json")
    assert {e["pid"] for e in events} == {3}  # ps 0, worker 0, worker 1: the third task
    send, = [e for e in events if e.get("cat") == "send"]
    assert send["args"]["key"] == k and send["args"]["step_id"] == 5 and send["args"]["bytes"] == 24
    recv, = spans(events, "recv")
    assert recv["args"]["path"] == "local" and recv["ts"] >= send["ts"]
    assert os.listdir(tmp_path / "tl") == ["worker.1.json"]


@pytest.mark.timeout(60)
def test_an_unwritable_timeline_is_refused_at_construction(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(rendezvous.InvalidArgument, match="cannot write the timeline"):
        aio.Server({"worker": ["127.0.0.1:0"]}, "worker", 0, timeline=str(tmp_path / "file" / "x.json"))


@pytest.mark.timeout(30)
def test_events_are_written_a_moment_after_they_happen(tmp_path):
    async def main():
        timeline = Timeline(str(tmp_path / "t.json"), TaskName("worker", 0, 0), 1,
                            flush_interval=0.01)
        flushed = asyncio.Event()
        flush = timeline.flush

        def flush_and_tell() -> None:
            flush()
            flushed.set()
        timeline.flush = flush_and_tell  # type: ignore[method-assign]
        size = os.path.getsize(timeline.path)
        timeline.sent(key(0, 1, "x"), 1, np.ones(2), False)
        assert os.path.getsize(timeline.path) == size  # buffered...
        await asyncio.wait_for(flushed.wait(), 10)  # ...and written by the timer, not at close
        assert os.path.getsize(timeline.path) > size
        events = read_trace(timeline.path)
        assert [e["name"] for e in events if e.get("cat") == "send"] == ["send x"]
        timeline.close()
    run(main())


@pytest.mark.timeout(60)
def test_a_copy_onto_the_gpu_is_the_place_phase(tmp_path):
    from rendezvous.devices import Devices
    from rendezvous.testing.fakegpu import FakeBackend, FakeDeviceArray

    gpu_key = key(1, 0, "g").replace("task:0/device:CPU:0", "task:0/device:GPU:0")

    async def main():
        async with cluster(2, devices=Devices([FakeBackend()]), timeline=str(tmp_path / "w{task_index}.json")) \
                as (a, b):
            b.send(gpu_key, np.arange(1000, dtype=np.float32), step_id=1)  # host data, for a GPU
            assert isinstance(await a.recv(gpu_key, step_id=1, timeout=10), FakeDeviceArray)
    run(main())
    events = load(tmp_path / "w0.json")
    recv, = spans(events, "recv")
    inside = phases(events, recv)
    assert set(inside) == {"wait", "place"}
    assert inside["place"]["ts"] >= inside["wait"]["ts"] + inside["wait"]["dur"]


@pytest.mark.timeout(60)
def test_daemons_record_their_clients_sends_and_recvs_and_their_peer_traffic(tmp_path):
    from test_daemon import daemons, key as node_key

    from rendezvous.client.aio import Client

    sockdir = Path(tempfile.mkdtemp(prefix="tl", dir="/tmp"))  # short: a Unix socket's path is limited
    try:
        async def main():
            async with daemons(sockdir, 2, timeline=str(tmp_path / "{job_name}-{task_index}.json")) as (d0, d1), \
                    Client(d0.local_target) as a, Client(d1.local_target) as b:
                await a.send(node_key(0, 1, "x"), np.arange(10), step_id=1)
                assert list(await b.recv(node_key(0, 1, "x"), step_id=1, timeout=10)) == list(range(10))
        run(main())
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)
    producer, consumer = load(tmp_path / "node-0.json"), load(tmp_path / "node-1.json")
    send, = [e for e in producer if e.get("cat") == "send"]
    served, = spans(producer, "serve")
    recv, = spans(consumer, "recv")
    assert send["args"]["key"] == served["args"]["key"] == recv["args"]["key"] == node_key(0, 1, "x")
    assert recv["args"]["peer"] == "/job:node/replica:0/task:0" and recv["args"]["path"] == "grpc"
    assert served["args"]["peer"] == "/job:node/replica:0/task:1" and recv["args"]["bytes"] == 80


CHILD = r"""
import asyncio, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from conftest import cluster, key

async def main():
    async with cluster(2, timeline=sys.argv[2]) as (a, b):
        for i in range(20):
            b.send(key(1, 0, f"t{i}"), np.ones(8), step_id=1)
            await a.recv(key(1, 0, f"t{i}"), step_id=1, timeout=10)
        a.timeline.flush()
        b.timeline.flush()
        for i in range(5):  # buffered, never written: the process dies first
            b.send(key(1, 0, f"late{i}"), np.ones(8), step_id=2)
            await a.recv(key(1, 0, f"late{i}"), step_id=2, timeout=10)
        print("ready", flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.mark.timeout(60)
def test_a_killed_process_leaves_a_trace_that_still_loads(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(HERE), str(tmp_path / "w{task_index}.json")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    for path, cat in ((tmp_path / "w0.json", "recv"), (tmp_path / "w1.json", "serve")):
        text = path.read_text()
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)  # no closing bracket...
        # ...but a prefix of a valid array: "[", then one event per line, every line but the last ending in ","
        lines = text.split("\n")
        assert lines[0] == "[" and lines[-1].endswith("}")
        assert all(line.endswith("},") for line in lines[1:-1])
        parsed = [json.loads(line.removesuffix(",")) for line in lines[1:]]
        assert json.loads(text + "\n]") == parsed
        events = read_trace(path)
        assert events == parsed
        assert_lanes_nest(events)
        done = [e for e in events if e.get("cat") == cat]
        assert [e["args"]["key"].split(";")[3] for e in done] == [f"t{i}" for i in range(20)]
        # a partial last event (a write cut short) is left out, as Perfetto leaves it
        path.write_text(text + ',\n{"ph":"X","name":"cut sh')
        assert read_trace(path) == parsed


@pytest.mark.timeout(60)
def test_render_draws_the_lanes_of_a_trace(tmp_path):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(ROOT / "tools"))
    import render_timeline

    async def main():
        async with cluster(2, timeline=str(tmp_path / "w{task_index}.json")) as (a, b):
            for step in range(3):
                b.send(key(1, 0, "t"), np.ones(1000), step_id=step)
                await a.recv(key(1, 0, "t"), step_id=step, timeout=10)
    run(main())
    out = tmp_path / "t.png"
    rows = render_timeline.render([str(tmp_path / "w0.json"), str(tmp_path / "w1.json")], str(out), steps="1:2")
    assert rows == 3  # worker 0's recv lane; worker 1's send and serve lanes
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_an_mpi_job_records_its_transfers_over_mpi(tmp_path):
    from test_mpi import launch

    launch(2, "sizes", "small", env={"MPI_OPTIMAL_PATH": "1",
                                     "RENDEZVOUS_TIMELINE": str(tmp_path / "w{task_index}.json")}, timeout=120)
    for me in (0, 1):
        events = load(tmp_path / f"w{me}.json")
        recvs = {e["args"]["key"].split(";")[3]: e for e in spans(events, "recv")}
        # sizes small: 0, 100, 1023, 1024, 1 MiB; the MPI threshold is 1024 bytes
        for name, nbytes, path in (("t0", 0, "grpc"), ("t2", 1023, "grpc"), ("t3", 1024, "mpi"),
                                   ("t4", 1 << 20, "mpi")):
            e = recvs[name]
            assert e["args"]["path"] == path and e["args"]["bytes"] == nbytes, e
            inside = phases(events, e)
            assert ("transfer mpi" in inside) == (path == "mpi"), inside
        served = {e["args"]["key"].split(";")[3]: e["args"]["path"] for e in spans(events, "serve")}
        assert served["t4"] == "mpi" and served["t0"] == "grpc"
