"""HTTPS from the broker: it dials the checked address but sends the name in SNI and verifies
the certificate against it, so a server with an untrusted certificate is refused."""

from __future__ import annotations

import datetime
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ephemeral.broker import Broker
from ephemeral.policy import Policy
from ephemeral.testing.broker import FakeContext, ask


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


class _Quiet(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[int, list[str | None]]]:
    cert, key = _self_signed(tmp_path)
    snis: list[str | None] = []
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)

    def on_sni(_sock: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
        snis.append(name)

    ctx.sni_callback = on_sni
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
    server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], snis
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


async def test_tls_sends_the_name_and_verifies_the_certificate(
    broker: Broker, tls_server: tuple[int, list[str | None]]
) -> None:
    port, snis = tls_server
    ctx = FakeContext(Policy(web=True))
    out = await ask(broker, ctx, "web_fetch", url=f"https://localhost:{port}/x")
    assert out.startswith("error: the web request failed: ConnectError"), out
    assert snis == ["localhost"]  # connected to 127.0.0.1, but TLS was for the name
    [ev] = ctx.of("web.requested")
    assert ev["status"] is None and ev["url"] == f"https://localhost:{port}/x"
