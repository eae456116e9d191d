"""Prometheus metrics of one rendezvousd (``prometheus_client``, imported lazily).

Counters and histograms that the daemon's handlers update as they go
(local-hop operations and bytes, recv latency per path, errors by status
code) live in a registry of their own, one per daemon. Everything else is
read at scrape time from a snapshot taken on the event loop (the waiting
table and the transfer counters belong to the loop thread): the scrape thread
asks the loop for it and waits at most a few seconds.

The HTTP endpoint is prometheus_client's WSGI server on its own thread
(``GET /metrics``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc

from rendezvous.paths import Hop, Path

__all__ = ["DaemonMetrics", "LATENCY_BUCKETS"]

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class DaemonMetrics:
    """The daemon's metrics: live counters, plus a snapshot collector bound to a loop."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.local_ops = Counter("rendezvous_local_ops", "Sends and recvs of local clients, by how the "
                                 "tensor crossed the local hop", ["op", "path"], registry=r)
        self.local_bytes = Counter("rendezvous_local_bytes", "Payload bytes across the local hop",
                                   ["op", "path"], registry=r)
        self.recv_seconds = Histogram("rendezvous_recv_seconds", "Latency of local clients' recvs, from "
                                      "request to tensor, by the path that brought the tensor",
                                      ["path"], buckets=LATENCY_BUCKETS, registry=r)
        self.errors = Counter("rendezvous_errors", "Failed calls of local clients and refused calls, "
                              "by gRPC status code", ["code"], registry=r)
        self._children: dict[tuple[str, Hop], tuple[Any, Any]] = {}  # labelled once, not per tensor
        self._latency: dict[Path, Any] = {}
        self._httpd: Any = None
        self._thread: Any = None

    # -- updates (loop thread) --------------------------------------------------

    def local_op(self, op: str, hop: Hop, nbytes: int, count: int = 1) -> None:
        """``count`` tensors of a local client's send or recv (``nbytes`` in all)
        that crossed the local hop by ``hop``."""
        children = self._children.get((op, hop))
        if children is None:
            children = self._children[(op, hop)] = (self.local_ops.labels(op, str(hop)),
                                                     self.local_bytes.labels(op, str(hop)))
        children[0].inc(count)
        children[1].inc(nbytes)

    def recv_done(self, path: Path, seconds: float) -> None:
        """A local client's recv answered, its tensor brought by ``path`` (a batch:
        once for each path that brought some of its tensors)."""
        child = self._latency.get(path)
        if child is None:
            child = self._latency[path] = self.recv_seconds.labels(str(path))
        child.observe(seconds)

    def error(self, code: grpc.StatusCode | str) -> None:
        self.errors.labels(code if isinstance(code, str) else code.name).inc()

    # -- scrape-time values ---------------------------------------------------------

    def bind(self, loop: asyncio.AbstractEventLoop, snapshot: Callable[[], dict[str, Any]]) -> None:
        """Read ``snapshot()`` on ``loop`` at every scrape."""
        self.registry.register(_Snapshot(loop, snapshot))

    def serve(self, host: str, port: int) -> int:
        """Start ``GET /metrics`` on host:port (0: the OS picks); the bound port."""
        from prometheus_client import start_http_server

        self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._httpd.server_port)

    def close(self) -> None:
        if self._httpd is not None:
            httpd, self._httpd = self._httpd, None
            httpd.shutdown()
            httpd.server_close()
            self._thread.join(5)


class _Snapshot:
    """A prometheus_client collector over a snapshot taken on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.loop = loop
        self.snapshot = snapshot

    def collect(self):  # called on the HTTP thread
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        async def take() -> dict[str, Any]:
            return self.snapshot()

        coro = take()
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:  # the loop is closed: report what is live only
            coro.close()
            return
        try:
            snap = future.result(5)
        except Exception:  # the loop is busy or stopping: report what is live only
            future.cancel()
            return
        paths = snap["stats"]
        for name, counter, doc in (
            ("transfers", "transfers", "Tensors this rank received, by path (local, grpc, mpi)"),
            ("bytes", "bytes", "Payload bytes this rank received, by path"),
            ("served", "served", "Tensors this rank served to other ranks, by path"),
            ("served_bytes", "served_bytes", "Payload bytes this rank served, by path"),
            ("served_fused", "served_fused", "Tensors this rank served packed with others in one reply, by path"),
            ("fallbacks", "fallbacks", "Transfers that took a slower path than they could have"),
            ("path_errors", "errors", "Failed transfers, by path"),
        ):
            fam = CounterMetricFamily(f"rendezvous_{name}", doc, labels=["path"])
            for path in Path:
                fam.add_metric([path.value], paths.get(path, {}).get(counter, 0))
            yield fam
        gauges = (
            ("mpi_in_flight", "MPI operations posted and not complete", paths.get(Path.MPI, {}).get("in_flight", 0)),
            ("waiting_tensors", "Produced tensors in the waiting table, not consumed yet", snap["tensors"]),
            ("waiting_receivers", "Consumers waiting in this node's table", snap["waiters"]),
            ("waiting_keys", "Keys in the waiting table", snap["keys"]),
            ("waiting_oldest_seconds", "Age of the oldest entry of the waiting table", snap["oldest"]),
            ("local_recvs_waiting", "Recvs of local clients in progress", snap["local_waits"]),
            ("local_recvs_oldest_seconds", "Age of the oldest recv of a local client in progress",
             snap["local_oldest"]),
            ("local_clients", "Local clients attached", snap["sessions"]),
            ("shm_pool_segments", "Segments in the daemon's shared-memory pool", snap["pool"].get("segments", 0)),
            ("shm_pool_bytes", "Bytes of the shared-memory pool's segments", snap["pool"].get("bytes", 0)),
            ("shm_pool_free_bytes", "Bytes of pool segments free for reuse", snap["pool"].get("free_bytes", 0)),
            ("shm_pool_held", "Pool segments held by clients that received them", snap["pool"].get("held", 0)),
            ("draining", "1 while the daemon drains", int(snap["draining"])),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"rendezvous_{name}", doc, value=value)
