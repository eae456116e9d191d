"""Securing the control plane (rendezvous/auth.py): the shared token, its
interceptor against a real grpc.aio server, and TLS credentials from files."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest

from rendezvous import auth
from rendezvous.config import Config
from rendezvous.errors import InvalidArgument

from conftest import run

pytestmark = pytest.mark.timeout(30)

SERVICE = "test.Echo"
HEALTH_CHECK = auth.HEALTH_PREFIX + "Check"


def _config(**values) -> Config:
    return Config.load(values, env={})


# --- load_token / token_metadata ----------------------------------------------------------

def test_load_token_none():
    assert auth.load_token(_config()) == ""


def test_load_token_from_setting_is_kept_as_given():
    assert auth.load_token(_config(token="s3cret")) == "s3cret"


def test_load_token_file_is_stripped(tmp_path):
    path = tmp_path / "token"
    path.write_text("  from-file\n\n")
    assert auth.load_token(_config(token_file=str(path))) == "from-file"


def test_load_token_file_wins_over_token(tmp_path):
    path = tmp_path / "token"
    path.write_text("file-token\n")
    assert auth.load_token(_config(token="setting-token", token_file=str(path))) == "file-token"


@pytest.mark.parametrize("content", ["", "\n", "  \t\n"])
def test_load_token_empty_file_is_refused(tmp_path, content):
    path = tmp_path / "token"
    path.write_text(content)
    # an empty file must not silently fall back to `token` (or to no token at all)
    with pytest.raises(InvalidArgument, match=r"token_file '.*token' is empty"):
        auth.load_token(_config(token="fallback", token_file=str(path)))


def test_load_token_missing_file(tmp_path):
    path = tmp_path / "absent"
    with pytest.raises(InvalidArgument) as info:
        auth.load_token(_config(token="fallback", token_file=str(path)))
    assert info.value.message == f"cannot read token_file {str(path)!r}: No such file or directory"


def test_load_token_unreadable_file(tmp_path):
    # a directory cannot be read as a file even by root (file modes would not stop root)
    with pytest.raises(InvalidArgument) as info:
        auth.load_token(_config(token_file=str(tmp_path)))
    assert info.value.message == f"cannot read token_file {str(tmp_path)!r}: Is a directory"


def test_token_metadata():
    assert auth.token_metadata("abc") == (("authorization", "Bearer abc"),)
    assert auth.token_metadata("") == ()


def test_interceptor_needs_a_token():
    with pytest.raises(InvalidArgument, match="non-empty token"):
        auth.TokenInterceptor("")


# --- the interceptor on a real server -------------------------------------------------------

class _Calls:
    def __init__(self) -> None:
        self.handled: list[str] = []   # methods whose real handler ran
        self.parsed: list[bytes] = []  # requests the real handlers' deserializer saw

    def parse(self, raw: bytes) -> bytes:
        self.parsed.append(raw)
        return raw


def _handlers(calls: _Calls) -> list[grpc.GenericRpcHandler]:
    async def unary(request, context):
        calls.handled.append("Unary")
        return b"echo:" + request

    async def server_stream(request, context):
        calls.handled.append("ServerStream")
        for i in range(3):
            yield b"%d:" % i + request

    async def client_stream(requests, context):
        calls.handled.append("ClientStream")
        return b"+".join([r async for r in requests])

    async def bidi(requests, context):
        calls.handled.append("Bidi")
        async for r in requests:
            yield b"re:" + r

    async def health(request, context):
        calls.handled.append("Health")
        return b"SERVING"

    p = calls.parse
    return [
        grpc.method_handlers_generic_handler(SERVICE, {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, request_deserializer=p),
            "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream, request_deserializer=p),
            "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream, request_deserializer=p),
            "Bidi": grpc.stream_stream_rpc_method_handler(bidi, request_deserializer=p),
        }),
        grpc.method_handlers_generic_handler("grpc.health.v1.Health", {
            "Check": grpc.unary_unary_rpc_method_handler(health, request_deserializer=p),
        }),
    ]


async def _serve(interceptor, calls: _Calls, credentials=None):
    server = grpc.aio.server(interceptors=[interceptor] if interceptor else None)
    server.add_generic_rpc_handlers(_handlers(calls))
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    assert port > 0
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _call(channel, kind: str, metadata=None) -> tuple[grpc.StatusCode, object, str]:
    """(status, reply, details) of one call of ``kind`` on the test service."""
    method = f"/{SERVICE}/{kind}" if kind != "Health" else HEALTH_CHECK
    try:
        if kind in ("Unary", "Health"):
            reply = await channel.unary_unary(method)(b"hi", metadata=metadata, timeout=10)
        elif kind == "ServerStream":
            reply = [r async for r in channel.unary_stream(method)(b"hi", metadata=metadata, timeout=10)]
        elif kind == "ClientStream":
            reply = await channel.stream_unary(method)(iter([b"a", b"b"]), metadata=metadata, timeout=10)
        else:
            reply = [r async for r in channel.stream_stream(method)(iter([b"x", b"y"]), metadata=metadata,
                                                                    timeout=10)]
    except grpc.aio.AioRpcError as exc:
        return exc.code(), None, exc.details() or ""
    return grpc.StatusCode.OK, reply, ""


async def _refusal_status(channel, kind: str, metadata=None) -> tuple[grpc.StatusCode, str]:
    """(status, details) of a call expected to be refused. Calls that stream
    requests send none: grpcio itself sometimes ends a bidi call with INTERNAL
    ("Internal error from Core") instead of the server's status when the server
    aborts while the client is still writing, with or without an interceptor.
    A handler that wrongly ran would wait for requests and hit the deadline."""
    if kind in ("Unary", "ServerStream", "Health"):
        code, _, details = await _call(channel, kind, metadata)
        return code, details
    method = f"/{SERVICE}/{kind}"
    make = channel.stream_unary if kind == "ClientStream" else channel.stream_stream
    call = make(method)(metadata=metadata, timeout=5)
    return await call.code(), await call.details()


EXPECTED = {
    "Unary": b"echo:hi",
    "ServerStream": [b"0:hi", b"1:hi", b"2:hi"],
    "ClientStream": b"a+b",
    "Bidi": [b"re:x", b"re:y"],
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_interceptor_accepts_the_right_token_and_refuses_others(kind):
    async def main():
        calls = _Calls()
        rejected: list[str] = []
        server, target = await _serve(auth.TokenInterceptor("tok-1", on_reject=rejected.append), calls)
        try:
            async with grpc.aio.insecure_channel(target) as ch:
                # no token at all
                code, details = await _refusal_status(ch, kind)
                assert code == grpc.StatusCode.UNAUTHENTICATED, (code, details)
                assert details == "missing or wrong token (authorization: Bearer ...)"
                # a wrong token, a token of the wrong scheme, a token that is a prefix of the right one
                for md in ((("authorization", "Bearer tok-2"),), (("authorization", "tok-1"),),
                           (("authorization", "Basic tok-1"),), (("authorization", "Bearer tok-"),),
                           (("authorization", "Bearer tok-1 "),), (("x-token", "Bearer tok-1"),)):
                    code, details = await _refusal_status(ch, kind, metadata=md)
                    assert code == grpc.StatusCode.UNAUTHENTICATED, (md, code, details)
                assert calls.handled == [] and calls.parsed == []  # refused before anything was parsed
                assert rejected == [f"/{SERVICE}/{kind}"] * 7
                # the right one
                code, reply, details = await _call(ch, kind, metadata=auth.token_metadata("tok-1"))
                assert code == grpc.StatusCode.OK, (code, details)
                assert reply == EXPECTED[kind]
                assert calls.handled == [kind]
                assert len(rejected) == 7
        finally:
            await server.stop(0)
    run(main())


def test_token_among_other_metadata_is_found():
    async def main():
        calls = _Calls()
        server, target = await _serve(auth.TokenInterceptor("abc"), calls)
        try:
            async with grpc.aio.insecure_channel(target) as ch:
                md = (("x-request", "1"),) + auth.token_metadata("abc") + (("x-other", "2"),)
                code, reply, _ = await _call(ch, "Unary", metadata=md)
                assert (code, reply) == (grpc.StatusCode.OK, b"echo:hi")
        finally:
            await server.stop(0)
    run(main())


def test_health_service_is_exempt():
    async def main():
        calls = _Calls()
        rejected: list[str] = []
        server, target = await _serve(auth.TokenInterceptor("tok", on_reject=rejected.append), calls)
        try:
            async with grpc.aio.insecure_channel(target) as ch:
                code, reply, _ = await _call(ch, "Health")
                assert (code, reply) == (grpc.StatusCode.OK, b"SERVING")
                code, reply, _ = await _call(ch, "Health", metadata=(("authorization", "Bearer wrong"),))
                assert (code, reply) == (grpc.StatusCode.OK, b"SERVING")
                assert calls.handled == ["Health", "Health"] and rejected == []
        finally:
            await server.stop(0)
    run(main())


def test_custom_exempt_prefixes_replace_the_default():
    async def main():
        calls = _Calls()
        rejected: list[str] = []
        interceptor = auth.TokenInterceptor("tok", on_reject=rejected.append, exempt=(f"/{SERVICE}/Unary",))
        server, target = await _serve(interceptor, calls)
        try:
            async with grpc.aio.insecure_channel(target) as ch:
                assert (await _call(ch, "Unary"))[:2] == (grpc.StatusCode.OK, b"echo:hi")
                assert (await _call(ch, "Health"))[0] == grpc.StatusCode.UNAUTHENTICATED
                assert rejected == [HEALTH_CHECK]
        finally:
            await server.stop(0)
    run(main())


def test_unknown_method_is_unimplemented_not_refused():
    async def main():
        calls = _Calls()
        rejected: list[str] = []
        server, target = await _serve(auth.TokenInterceptor("tok", on_reject=rejected.append), calls)
        try:
            async with grpc.aio.insecure_channel(target) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await ch.unary_unary(f"/{SERVICE}/Nope")(b"", timeout=10)
                assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
                assert rejected == []
        finally:
            await server.stop(0)
    run(main())


# --- TLS credentials ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA and a certificate it signed for 127.0.0.1 (server and client use),
    and a self-signed certificate of nobody the CA knows."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder = tmp_path_factory.mktemp("auth-pki")
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def save(stem: str, key, cert) -> None:
        (folder / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        (folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def build(stem: str, issuer_key, issuer_name, is_ca: bool):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(stem))
                   .issuer_name(issuer_name or name(stem))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(days=1))
                   .not_valid_after(now + datetime.timedelta(days=1)))
        if is_ca:
            builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        else:
            builder = (builder.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
        cert = builder.sign(issuer_key or key, hashes.SHA256())
        save(stem, key, cert)
        return key, cert

    ca_key, ca_cert = build("ca", None, None, True)
    build("node", ca_key, ca_cert.subject, False)
    other_key, other_cert = build("other-ca", None, None, True)
    build("stranger", other_key, other_cert.subject, False)
    return folder


def _tls(pki: Path, mutual: bool = False, node: str = "node") -> dict:
    return dict(tls_cert=str(pki / f"{node}.pem"), tls_key=str(pki / f"{node}.key"), tls_ca=str(pki / "ca.pem"),
                tls_client_auth=mutual)


def test_no_tls_settings_give_no_credentials():
    cfg = _config()
    assert auth.server_credentials(cfg) is None
    assert auth.channel_credentials(cfg) is None
    # a CA alone does not turn TLS on
    cfg = _config(tls_ca="/nonexistent/ca.pem")
    assert auth.server_credentials(cfg) is None
    assert auth.channel_credentials(cfg) is None


@pytest.mark.parametrize("missing,side", [
    ("tls_key", "server"), ("tls_cert", "server"), ("tls_ca", "server"),
    ("tls_ca", "channel"), ("tls_key", "channel-mutual"), ("tls_cert", "channel-mutual"),
])
def test_missing_files_are_named(pki, tmp_path, missing, side):
    values = _tls(pki, mutual=side == "channel-mutual")
    gone = str(tmp_path / f"{missing}.pem")
    values[missing] = gone
    cfg = _config(**values)
    make = auth.server_credentials if side == "server" else auth.channel_credentials
    with pytest.raises(InvalidArgument) as info:
        make(cfg)
    assert info.value.message == f"cannot read {missing} {gone!r}: No such file or directory"


def test_channel_without_client_auth_reads_only_the_ca(pki, tmp_path):
    # without mutual TLS the channel presents no certificate, so its own key is never read
    values = _tls(pki)
    values["tls_key"] = str(tmp_path / "absent.key")
    assert isinstance(auth.channel_credentials(_config(**values)), grpc.ChannelCredentials)


def _tls_round_trip(server_cfg: Config, client_cfg: Config, metadata=None, interceptor=None):
    async def main():
        calls = _Calls()
        server, target = await _serve(interceptor, calls, auth.server_credentials(server_cfg))
        try:
            async with grpc.aio.secure_channel(target, auth.channel_credentials(client_cfg)) as ch:
                return await _call(ch, "Unary", metadata=metadata)
        finally:
            await server.stop(0)
    return run(main())


def test_tls_round_trip(pki):
    cfg = _config(**_tls(pki))
    code, reply, details = _tls_round_trip(cfg, cfg)
    assert (code, reply) == (grpc.StatusCode.OK, b"echo:hi"), details


def test_tls_with_token(pki):
    cfg = _config(**_tls(pki), token="t0k")
    interceptor = auth.TokenInterceptor(auth.load_token(cfg))
    assert _tls_round_trip(cfg, cfg, interceptor=interceptor)[0] == grpc.StatusCode.UNAUTHENTICATED
    code, reply, _ = _tls_round_trip(cfg, cfg, metadata=auth.token_metadata("t0k"), interceptor=interceptor)
    assert (code, reply) == (grpc.StatusCode.OK, b"echo:hi")


def test_tls_client_refuses_a_server_of_another_ca(pki):
    server_cfg = _config(**_tls(pki, node="stranger"))
    client_cfg = _config(**_tls(pki))
    assert _tls_round_trip(server_cfg, client_cfg)[0] == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls(pki):
    mutual = _config(**_tls(pki, mutual=True))
    code, reply, details = _tls_round_trip(mutual, mutual)
    assert (code, reply) == (grpc.StatusCode.OK, b"echo:hi"), details
    # a client presenting no certificate is refused by the server
    assert _tls_round_trip(mutual, _config(**_tls(pki)))[0] == grpc.StatusCode.UNAVAILABLE
    # and so is one whose certificate another CA signed
    stranger = _config(**{**_tls(pki, mutual=True, node="stranger"), "tls_ca": str(pki / "ca.pem")})
    assert _tls_round_trip(mutual, stranger)[0] == grpc.StatusCode.UNAVAILABLE
