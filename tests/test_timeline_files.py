"""A timeline's file (rendezvous/timeline.py, rendezvous/trace_file.py): one per
rank by construction, never written through a planted link, bounded, and never
a reason for a send or a recv to fail; and a batch records every key."""

from __future__ import annotations

import json
import logging
import os
import stat

import numpy as np
import pytest

import rendezvous
from rendezvous import aio
from rendezvous.keys import TaskName
from rendezvous.timeline import Timeline, read_trace

from conftest import cluster, key, run, until
from test_timeline import load, spans

pytestmark = pytest.mark.timeout(60)


def warnings_about(caplog, path) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING and str(path) in r.getMessage()]


# -- one file per rank --------------------------------------------------------------


@pytest.mark.parametrize("spec,template", [
    ({"worker": ["127.0.0.1:0", "127.0.0.1:0"]}, "shared.json"),  # no {task_index}: both ranks, one file
    ({"worker": ["127.0.0.1:0", "127.0.0.1:0"]}, "{job_name}.json"),
    ({"ps": ["127.0.0.1:0"], "worker": ["127.0.0.1:0"]}, "t{task_index}.json"),  # ps 0 and worker 0
])
def test_a_template_that_names_one_file_for_two_ranks_is_refused(tmp_path, spec, template):
    job = sorted(spec)[-1]
    with pytest.raises(rendezvous.InvalidArgument, match=r"names one file.*\{task_index\}"):
        aio.Server(spec, job, 0, timeline=str(tmp_path / template))
    assert not (tmp_path / template.replace("{job_name}", job).replace("{task_index}", "0")).exists()


def test_a_template_without_placeholders_is_fine_for_a_single_rank(tmp_path):
    server = aio.Server({"worker": ["127.0.0.1:0"]}, "worker", 0, timeline=str(tmp_path / "only.json"))
    assert server.timeline is not None and server.timeline.path == str(tmp_path / "only.json")
    server.timeline.close()


def test_ranks_of_one_file_no_longer_truncate_each_other(tmp_path):
    """Each rank keeps every event of its own: two ranks given the same file
    (a template without {task_index}) once truncated it, each writing over
    the other."""
    path = tmp_path / "w.json"
    first = aio.Server({"worker": ["127.0.0.1:0"]}, "worker", 0, timeline=str(path))  # another job's rank 0
    with pytest.raises(rendezvous.InvalidArgument, match="another timeline is writing that file"):
        aio.Server({"worker": ["127.0.0.1:0"]}, "worker", 0, timeline=str(path))
    for i in range(5):
        first.table.send(1, key(0, 0, f"t{i}"), np.ones(2))
    first.timeline.close()
    events = load(path)
    assert [e["name"] for e in events if e.get("cat") == "send"] == [f"send t{i}" for i in range(5)]


# -- made safely --------------------------------------------------------------------


def test_a_link_planted_at_the_path_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.symlink(victim, tmp_path / "w0.json")

    async def main():
        async with cluster(1, timeline=str(tmp_path / "w{task_index}.json")) as (a,):
            a.send(key(0, 0, "x"), np.ones(2), step_id=1)
            await a.recv(key(0, 0, "x"), step_id=1, timeout=10)
    run(main())
    assert victim.read_text() == "precious\n"
    assert not os.path.islink(tmp_path / "w0.json")
    assert stat.S_IMODE(os.stat(tmp_path / "w0.json").st_mode) == 0o600
    assert len(spans(load(tmp_path / "w0.json"), "recv")) == 1


def test_an_old_file_at_the_path_is_replaced_and_a_folder_is_refused(tmp_path):
    old = tmp_path / "t.json"
    old.write_text("x" * 100_000)
    timeline = Timeline(str(old), TaskName("worker", 0, 0), 1)
    timeline.close()
    assert [e["name"] for e in json.loads(old.read_text())] [-1] == "timeline started"
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(rendezvous.InvalidArgument, match="cannot write the timeline"):
        Timeline(str(tmp_path / "dir.json"), TaskName("worker", 0, 0), 1)


# -- bounded ------------------------------------------------------------------------


def test_the_file_stops_at_its_cap_with_a_last_event_saying_so(tmp_path, caplog):
    path = tmp_path / "t.json"
    cap = 64 << 10
    timeline = Timeline(str(path), TaskName("worker", 0, 0), 1, max_bytes=cap, flush_events=16)
    sends = 2000  # some 300 KiB of events
    for i in range(sends):
        timeline.sent(key(0, 1, f"tensor{i}"), 1, np.ones(4), False)
    timeline.close()
    assert os.path.getsize(path) <= cap
    events = json.loads(path.read_text())  # closed: plain JSON
    last = events[-1]
    assert last["name"] == "timeline cut" and last["args"]["max_bytes"] == cap, last
    written = [e for e in events if e.get("cat") == "send"]
    assert [e["name"] for e in written] == [f"send tensor{i}" for i in range(len(written))]
    assert 100 < len(written) < sends and timeline.lost == sends - len(written)
    assert timeline.ended is not None and "cap" in timeline.ended
    assert len(warnings_about(caplog, path)) == 1


def test_a_servers_timeline_takes_its_cap_from_the_setting(tmp_path, monkeypatch):
    """RENDEZVOUS_TIMELINE_MAX_BYTES: a rank's file stops growing there (it grew
    without bound)."""
    monkeypatch.setenv("RENDEZVOUS_TIMELINE_MAX_BYTES", str(64 << 10))

    async def main():
        async with cluster(2, timeline=str(tmp_path / "w{task_index}.json")) as (a, b):
            for step in range(600):
                b.send(key(1, 0, "t"), np.ones(2), step_id=step)
                await a.recv(key(1, 0, "t"), step_id=step, timeout=10)
    run(main())
    for name in ("w0.json", "w1.json"):
        assert os.path.getsize(tmp_path / name) <= 64 << 10
        assert load(tmp_path / name)[-1]["name"] == "timeline cut"


# -- never an error for a send or a recv --------------------------------------------


def fill_disk(path) -> None:
    """Every later write to the open file ``path`` fails as on a full disk
    (ENOSPC): its descriptor now points at /dev/full."""
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")
               if os.path.realpath(f"/proc/self/fd/{fd}") == os.path.realpath(path)]
        assert fds, f"{path} is not open"
        for fd in fds:
            os.dup2(full, fd)
    finally:
        os.close(full)


@pytest.mark.parametrize("broken", ["consumer", "producer"])
def test_a_trace_write_that_fails_never_fails_a_send_or_a_recv(tmp_path, caplog, broken):
    """A full disk under the timeline: every send and recv still does what it
    did, each tensor delivered exactly once; the timeline counts what it could
    not write and says so once. (A send once raised with its tensor in the
    table, and a recv raised with its tensor taken: lost.)"""
    template = str(tmp_path / "w{task_index}.json")

    async def main():
        async with cluster(2, timeline=template) as (a, b):
            victim = a if broken == "consumer" else b
            for server in (a, b):
                server.timeline.flush_events = 1  # every event written at once
            fill_disk(victim.timeline.path)
            remote = [key(1, 0, f"r{i}") for i in range(4)]
            for i, k in enumerate(remote):
                b.send(k, np.full(3, i), step_id=1)
            assert [int((await a.recv(k, step_id=1, timeout=10))[0]) for k in remote[:2]] == [0, 1]
            assert [int(v[0]) for v in await a.recv_many(remote[2:], step_id=1, timeout=10)] == [2, 3]
            mine = key(0, 0, "own")
            a.send(mine, np.ones(2), step_id=1)
            assert (await a.recv(mine, step_id=1, timeout=10)) is not None
            b.send_many({key(1, 0, f"m{i}"): np.full(2, i) for i in range(3)}, step_id=2)
            got = await a.recv_many([key(1, 0, f"m{i}") for i in range(3)], step_id=2, timeout=10)
            assert [int(v[0]) for v in got] == [0, 1, 2]
            # exactly once: every key asked again finds nothing, and nothing waits anywhere
            for k, step in [*((k, 1) for k in remote), (mine, 1), *((key(1, 0, f"m{i}"), 2) for i in range(3))]:
                with pytest.raises(rendezvous.DeadlineExceeded):
                    await a.recv(k, step_id=step, timeout=0.05)
            # (the producer drops a given-up recv's wait when its cancel arrives)
            await until(lambda: not a.pending() and not b.pending(), what="no recv to wait anywhere")
            assert victim.timeline.failures == 1 and victim.timeline.lost > 0
            assert "write failed" in victim.timeline.ended
        return victim.timeline.path
    path = run(main())
    assert len(warnings_about(caplog, path)) == 1
    read_trace(path)  # what was written before still reads


# -- batches ------------------------------------------------------------------------


def test_a_batch_records_a_recv_for_every_key_and_a_send_for_every_tensor(tmp_path):
    """recv_many and send_many with a timeline: every key's recv span in the
    consumer's file, every tensor's send (and serve) in the producer's."""
    names = [f"b{i}" for i in range(12)]

    async def main():
        async with cluster(2, timeline=str(tmp_path / "w{task_index}.json")) as (a, b):
            b.send_many({key(1, 0, n): np.full(4, i) for i, n in enumerate(names)}, step_id=1)
            a.send_many({key(0, 0, "own0"): np.ones(1), key(0, 0, "own1"): np.ones(1)}, step_id=1)
            keys = [key(1, 0, n) for n in names] + [key(0, 0, "own0"), key(0, 0, "own1")]
            got = await a.recv_many(keys, step_id=1, timeout=10)
            assert [int(v[0]) for v in got[:12]] == list(range(12))
    run(main())
    consumer, producer = load(tmp_path / "w0.json"), load(tmp_path / "w1.json")
    recvs = {e["args"]["key"]: e for e in spans(consumer, "recv")}
    for i, n in enumerate(names):
        e = recvs[key(1, 0, n)]
        assert e["args"]["outcome"] == "ok" and e["args"]["path"] == "grpc" and e["args"]["bytes"] == 32, e
        assert e["args"]["step_id"] == 1 and e["args"]["peer"] == "/job:worker/replica:0/task:1"
    for n in ("own0", "own1"):
        assert recvs[key(0, 0, n)]["args"]["path"] == "local"
    assert len(recvs) == 14
    sent = {e["args"]["key"] for e in producer if e.get("cat") == "send"}
    assert sent == {key(1, 0, n) for n in names}
    assert {e["args"]["key"] for e in spans(producer, "serve")} == sent
    assert {e["args"]["key"] for e in consumer if e.get("cat") == "send"} == {key(0, 0, "own0"), key(0, 0, "own1")}
