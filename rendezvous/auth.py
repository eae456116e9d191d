"""Securing the gRPC control plane: TLS credentials and the shared token.

* TLS: :func:`server_credentials` and :func:`channel_credentials` build gRPC
  credentials from the config's ``tls_cert``, ``tls_key`` and ``tls_ca``
  paths; with ``tls_client_auth`` the server demands a client certificate
  chaining to ``tls_ca`` (mutual TLS) and peers present their own certificate.
* Token: :class:`TokenInterceptor` refuses every call whose metadata lacks
  ``authorization: Bearer <token>`` with ``UNAUTHENTICATED``; peers send it
  through :func:`token_metadata`. The gRPC health service is exempt, so probes
  that cannot send headers (Kubernetes' gRPC probe) still work: it tells only
  SERVING or NOT_SERVING.

The MPI data plane is not covered: it is trusted (see the README).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from rendezvous.config import Config
from rendezvous.errors import InvalidArgument

__all__ = ["TokenInterceptor", "token_metadata", "load_token", "server_credentials", "channel_credentials",
           "HEALTH_PREFIX"]

log = logging.getLogger("rendezvous.daemon")
HEALTH_PREFIX = "/grpc.health.v1.Health/"
_REFUSAL_LOG_INTERVAL_S = 10.0
_HEADER = "authorization"


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read {what} {path!r}: {exc.strerror or exc}") from None


def read_token(token: str, token_file: str, what: str = "token_file") -> str:
    """The shared token: ``token_file``'s content (stripped) if set, else ``token``;
    '' for none. ``what`` names the setting in errors (a flag, a config field)."""
    if token_file:
        read = _read(token_file, what).decode("utf-8", "replace").strip()
        if not read:
            raise InvalidArgument(f"{what} {token_file!r} is empty")
        return read
    return token


def load_token(config: Config) -> str:
    """The configured token (``token_file`` wins over ``token``); '' for none."""
    return read_token(config.token, config.token_file)


def _bearer(token: str) -> str:
    return f"Bearer {token}"


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """What a caller sends so a server with this token accepts its calls."""
    return ((_HEADER, _bearer(token)),) if token else ()


def server_credentials(config: Config) -> grpc.ServerCredentials | None:
    """TLS for a server, or None when ``tls_cert`` is not set."""
    if not config.tls_cert:
        return None
    pair = (_read(config.tls_key, "tls_key"), _read(config.tls_cert, "tls_cert"))
    ca = _read(config.tls_ca, "tls_ca") if config.tls_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca,
                                       require_client_auth=bool(config.tls_client_auth))


def channel_credentials(config: Config) -> grpc.ChannelCredentials | None:
    """TLS for channels to peers, or None when ``tls_cert`` is not set. Under mutual
    TLS the channel presents this task's own certificate."""
    if not config.tls_cert:
        return None
    if config.tls_client_auth:
        return tls_channel_credentials(config.tls_ca, config.tls_cert, config.tls_key)
    return tls_channel_credentials(config.tls_ca, "", "")


def tls_channel_credentials(ca: str, cert: str, key: str,
                            names: tuple[str, str, str] = ("tls_ca", "tls_cert", "tls_key")
                            ) -> grpc.ChannelCredentials | None:
    """TLS for a channel from PEM files: the CA bundle (empty: the system's roots)
    and, for mutual TLS, this side's certificate and key (both or neither); None
    when none is given. ``names`` name the three settings in errors."""
    if bool(cert) != bool(key):
        raise InvalidArgument(f"{names[1]} and {names[2]} go together")
    if not (ca or cert):
        return None
    return grpc.ssl_channel_credentials(_read(ca, names[0]) if ca else None,
                                        _read(key, names[2]) if key else None,
                                        _read(cert, names[1]) if cert else None)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the shared token (``UNAUTHENTICATED``), except health checks."""

    def __init__(self, token: str, on_reject: Callable[[str], None] | None = None,
                 exempt: tuple[str, ...] = (HEALTH_PREFIX,)) -> None:
        if not token:
            raise InvalidArgument("a token interceptor needs a non-empty token")
        self._expected = _bearer(token).encode()
        self._exempt = exempt
        self._on_reject = on_reject
        self._refused = 0
        self._quiet_until = 0.0

    def _accepts(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == _HEADER:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._expected)
        return False

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(self._exempt) or self._accepts(details.invocation_metadata):
            return handler
        self._refused += 1
        now = time.monotonic()
        if now >= self._quiet_until:  # one line per interval, however many are refused
            log.warning("refused %s: missing or wrong token (%d refused since the last report)",
                        details.method, self._refused)
            self._refused = 0
            self._quiet_until = now + _REFUSAL_LOG_INTERVAL_S
        if self._on_reject is not None:
            self._on_reject(details.method)
        return _refusal(handler)


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token (authorization: Bearer ...)")


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that only refuses."""
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(_refuse)  # raw bytes in: nothing of a refused caller's request is parsed
