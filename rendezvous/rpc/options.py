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


def server_options(max_receive_bytes: int) -> list[tuple[str, Any]]:
    """Options of every gRPC server we run: requests up to ``max_receive_bytes``,
    replies of any size, and a port that no other process may share."""
    return [
        ("grpc.max_receive_message_length", min(max_receive_bytes, MAX_GRPC_MESSAGE)),
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 0),
    ]


def peer_channel_options() -> list[tuple[str, Any]]:
    """A rank's channel to another rank: replies of any size, no transparent
    retries (a recv is re-sent by the peer client, with its request_id), and
    quick reconnects while the job's ranks come up at different times."""
    return [
        ("grpc.max_receive_message_length", -1),
        ("grpc.max_send_message_length", -1),
        ("grpc.initial_reconnect_backoff_ms", 50),
        ("grpc.min_reconnect_backoff_ms", 50),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.enable_retries", 0),
    ]


def local_channel_options() -> list[tuple[str, Any]]:
    """A local client's channel to its daemon (and ``rendezvous get``'s)."""
    return [
        ("grpc.max_receive_message_length", -1),
        ("grpc.max_send_message_length", -1),
        ("grpc.enable_retries", 0),
    ]
