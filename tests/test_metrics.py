"""Units of rendezvous.daemon.metrics: the live counters and the collector
over a snapshot taken on the event loop (scraped over HTTP end to end in
test_daemon.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("prometheus_client")

from rendezvous.daemon.metrics import DaemonMetrics  # noqa: E402

pytestmark = pytest.mark.timeout(30)

SNAPSHOT = {
    "stats": {"local": {"transfers": 3, "bytes": 30, "served": 0, "served_bytes": 0, "fallbacks": 0, "errors": 1},
              "grpc": {"transfers": 5, "bytes": 500, "served": 7, "served_bytes": 700, "fallbacks": 2, "errors": 0},
              "mpi": {"transfers": 2, "bytes": 2 << 20, "served": 1, "served_bytes": 1 << 20, "fallbacks": 0,
                      "errors": 0, "in_flight": 4}},
    "tensors": 6, "waiters": 2, "keys": 5, "oldest": 1.5, "local_waits": 1, "local_oldest": 0.25,
    "sessions": 3, "pool": {"segments": 2, "bytes": 1 << 20, "free_bytes": 1 << 19, "held": 1}, "draining": True,
}


def _value(metrics: DaemonMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels or None)


def test_live_counters_by_op_path_and_code():
    m = DaemonMetrics()
    m.local_op("send", "shm", 1 << 20)
    m.local_op("send", "inline", 100)
    m.local_op("recv", "inline", 40)
    m.recv_done("grpc", 0.003)
    m.recv_done("grpc", 0.5)
    m.error("UNAVAILABLE")
    m.error("UNAVAILABLE")
    assert _value(m, "rendezvous_local_ops_total", op="send", path="shm") == 1
    assert _value(m, "rendezvous_local_bytes_total", op="send", path="shm") == 1 << 20
    assert _value(m, "rendezvous_local_bytes_total", op="recv", path="inline") == 40
    assert _value(m, "rendezvous_recv_seconds_count", path="grpc") == 2
    assert _value(m, "rendezvous_recv_seconds_bucket", path="grpc", le="0.005") == 1  # only the fast one
    assert _value(m, "rendezvous_recv_seconds_sum", path="grpc") == pytest.approx(0.503)
    assert _value(m, "rendezvous_errors_total", code="UNAVAILABLE") == 2


def test_the_snapshot_is_taken_on_the_loop_and_reported_by_path_and_gauge():
    loop = asyncio.new_event_loop()
    on_loop: list[bool] = []
    ready = threading.Event()

    def snapshot():
        on_loop.append(asyncio.get_running_loop() is loop)
        return SNAPSHOT

    runner = threading.Thread(target=lambda: (loop.call_soon(ready.set), loop.run_forever()), daemon=True)
    runner.start()
    ready.wait(10)
    try:
        m = DaemonMetrics()
        m.bind(loop, snapshot)
        assert _value(m, "rendezvous_transfers_total", path="grpc") == 5
        assert _value(m, "rendezvous_served_bytes_total", path="mpi") == 1 << 20
        assert _value(m, "rendezvous_fallbacks_total", path="grpc") == 2
        assert _value(m, "rendezvous_path_errors_total", path="local") == 1
        assert _value(m, "rendezvous_mpi_in_flight") == 4
        assert _value(m, "rendezvous_waiting_tensors") == 6 and _value(m, "rendezvous_waiting_oldest_seconds") == 1.5
        assert _value(m, "rendezvous_local_clients") == 3 and _value(m, "rendezvous_draining") == 1
        assert on_loop and all(on_loop)  # read where the loop owns the state
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()


def test_a_gone_loop_reports_only_the_live_counters():
    loop = asyncio.new_event_loop()
    loop.close()  # nobody will take the snapshot
    m = DaemonMetrics()
    m.bind(loop, lambda: SNAPSHOT)
    m.error("INTERNAL")
    assert _value(m, "rendezvous_transfers_total", path="grpc") is None
    assert _value(m, "rendezvous_errors_total", code="INTERNAL") == 1
