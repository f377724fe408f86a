"""A token service like Docker Hub's and GHCR's (the distribution token protocol), for a
``docker-registry`` configured with ``auth: token``: it hands anyone a JWT (ES256, signed by
a key whose certificate chains to the registry's ``rootcertbundle``) granting pull and push on
the scopes asked, and records what it was asked (scope, service, whether Basic credentials
came), so a test can see the client's side of the challenge."""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

SERVICE, ISSUER = "test-registry", "test-issuer"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenServer:
    def __init__(self, key_pem: bytes, cert_pem: bytes) -> None:
        key = serialization.load_pem_private_key(key_pem, password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        self.key = key
        cert = x509.load_pem_x509_certificate(cert_pem)
        self.x5c = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()
        self.asked: list[dict[str, Any]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                query = parse_qs(urlparse(self.path).query)
                scopes = query.get("scope", [])
                server.asked.append(
                    {
                        "scope": scopes,
                        "service": query.get("service", [None])[0],
                        "basic": str(self.headers.get("Authorization", "")).startswith("Basic "),
                    }
                )
                body = json.dumps({"token": server.token(scopes)}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.httpd.server_address[1])
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def token(self, scopes: list[str]) -> str:
        access = []
        for scope in scopes:
            kind, _, rest = scope.partition(":")
            name, _, _actions = rest.rpartition(":")
            access.append({"type": kind, "name": name, "actions": ["pull", "push"]})
        now = int(time.time())
        header = {"typ": "JWT", "alg": "ES256", "x5c": [self.x5c]}
        claims = {
            "iss": ISSUER, "sub": "", "aud": SERVICE, "exp": now + 600, "nbf": now - 60,
            "iat": now, "jti": uuid.uuid4().hex, "access": access,
        }  # fmt: skip
        signing = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        r, s = decode_dss_signature(self.key.sign(signing.encode(), ec.ECDSA(hashes.SHA256())))
        return f"{signing}.{_b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"

    def __enter__(self) -> TokenServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
