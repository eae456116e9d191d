"""gRPC names and settings, in one place: every server and channel of the
product takes its options from here."""

from __future__ import annotations

from typing import Any

__all__ = ["SERVICE", "TF_SERVICE", "UNARY_METHOD", "STREAM_METHOD", "server_options",
           "peer_channel_options", "local_channel_options", "MAX_GRPC_MESSAGE"]

SERVICE = "rendezvous.v1.Rendezvous"
TF_SERVICE = "tensorflow.WorkerService"  # TensorFlow's stubs call RecvTensor here
UNARY_METHOD = f"/{SERVICE}/RecvTensor"
STREAM_METHOD = f"/{SERVICE}/RecvTensorStream"

#: gRPC's message size settings are signed 32-bit
MAX_GRPC_MESSAGE = (1 << 31) - 1


def server_options(max_receive_bytes: int, keepalive_time: float = 0.0,
                   keepalive_timeout: float = 10.0) -> list[tuple[str, Any]]:
    """Options of every gRPC server we run: requests up to ``max_receive_bytes``,
    replies of any size, a port that no other process may share, and peers'
    keepalive pings accepted as often as every ``keepalive_time`` seconds (a
    server refuses pings more frequent than it allows by closing the
    connection). With ``keepalive_time`` the server pings its consumers as
    well, every ``keepalive_time`` seconds, and drops a connection whose ping
    goes unanswered for ``keepalive_timeout``: the recvs of a consumer behind
    a pulled cable stop waiting for tensors (which then stay in the table for
    the consumer's next recv) instead of taking them into a dead stream."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", min(max_receive_bytes, MAX_GRPC_MESSAGE)),
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 0),
    ]
    if keepalive_time > 0:
        options += [
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", int(keepalive_time * 1000 / 2)),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.keepalive_time_ms", int(keepalive_time * 1000)),
            ("grpc.keepalive_timeout_ms", int(keepalive_timeout * 1000)),
            ("grpc.http2.max_pings_without_data", 0),
        ]
    return options


def peer_channel_options(keepalive_time: float = 0.0, keepalive_timeout: float = 10.0) -> list[tuple[str, Any]]:
    """A rank's channel to another rank: replies of any size, no transparent
    retries (a recv is re-sent by the peer client, with its request_id), quick
    reconnects while the job's ranks come up at different times, and a ping
    every ``keepalive_time`` seconds that must be answered within
    ``keepalive_timeout`` (0: no pings), so a silent peer is noticed."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", -1),
        ("grpc.max_send_message_length", -1),
        ("grpc.initial_reconnect_backoff_ms", 50),
        ("grpc.min_reconnect_backoff_ms", 50),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.enable_retries", 0),
    ]
    if keepalive_time > 0:
        options += [
            ("grpc.keepalive_time_ms", int(keepalive_time * 1000)),
            ("grpc.keepalive_timeout_ms", int(keepalive_timeout * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # gRPC's core also times every ping out on its own (a minute by default)
            ("grpc.http2.ping_timeout_ms", int(keepalive_timeout * 1000)),
            # A connection attempt into a partition (a SYN nobody answers) gives
            # up after the keepalive bound, not gRPC's 20 s, so the channel
            # tries again soon after the network is back.
            ("grpc.min_connect_timeout_ms", int((keepalive_time + keepalive_timeout) * 1000)),
        ]
    return options


def local_channel_options() -> list[tuple[str, Any]]:
    """A local client's channel to its daemon (and ``rendezvous get``'s)."""
    return [
        ("grpc.max_receive_message_length", -1),
        ("grpc.max_send_message_length", -1),
        ("grpc.enable_retries", 0),
    ]
