"""The build's proxy on its own (``ephemeral/build_proxy.py``): in the network namespace it
makes, the host's ``curl`` (run there by ``nsenter``) reaches an allowed loopback HTTPS server
through ``CONNECT`` and a plain HTTP one in absolute form; a host outside the list and an IP
literal are refused with a 403 naming why; every request is recorded without its path or
query; the namespace has nothing but the proxy (the host's loopback servers are not there)."""

from __future__ import annotations

import asyncio
import http.server
import os
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ephemeral.build_proxy import PROXY, BuildProxy, for_build
from ephemeral.settings import Settings

BODY = b"through-the-proxy\n"


def _serve(context: ssl.SSLContext | None) -> tuple[http.server.ThreadingHTTPServer, int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, int(server.server_address[1])


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[int, int, Path]]:
    """A plain and a TLS server on 127.0.0.1; yields their ports and the CA file."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("localhost")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(context)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    plain, plain_port = _serve(None)
    tls, tls_port = _serve(context)
    try:
        yield plain_port, tls_port, ca_file
    finally:
        for s in (plain, tls):
            s.shutdown()
            s.server_close()


def test_the_proxy_admits_the_list_and_records_each_request(
    servers: tuple[int, int, Path],
) -> None:
    if os.geteuid() != 0 or shutil.which("curl") is None or shutil.which("nsenter") is None:
        pytest.skip("needs host root (a network namespace), curl and nsenter")
    plain, tls, ca_file = servers
    settings = Settings.load(build_allow_hosts=["localhost"], broker_allow_private_hosts=True)
    assert for_build(Settings.load()) is None  # no allow list: no network
    proxy = for_build(settings)
    assert isinstance(proxy, BuildProxy)

    async def go() -> list[tuple[int, str]]:
        netns = await proxy.start()
        try:
            runs = [
                ["--cacert", str(ca_file), f"https://localhost:{tls}/secret?token=abc"],
                [f"http://localhost:{plain}/plain?token=abc"],
                [f"http://127.0.0.1:{plain}/"],  # an IP literal never matches
                ["-k", "https://other.invalid:443/"],
                ["--noproxy", "*", f"http://127.0.0.1:{plain}/"],  # straight, no proxy
            ]
            return [await asyncio.to_thread(_curl_sync, netns, *r) for r in runs]
        finally:
            await proxy.stop()

    results = asyncio.run(go())
    assert results[0] == (0, BODY.decode())
    assert results[1] == (0, BODY.decode())
    assert (
        "ephemeral build proxy: host '127.0.0.1' is not in the build's allow list" in results[2][1]
    )
    assert results[3][0] != 0 and "403" in results[3][1]
    assert results[4][0] != 0  # nothing of the host's loopback in the namespace
    rows = [(r["method"], r["host"], r["port"], r["allowed"]) for r in proxy.records]
    assert sorted(rows) == sorted(
        [
            ("CONNECT", "localhost", tls, True),
            ("GET", "localhost", plain, True),
            ("GET", "127.0.0.1", plain, False),
            ("CONNECT", "other.invalid", 443, False),
        ]
    )
    assert all("token" not in repr(r) and "secret" not in repr(r) for r in proxy.records)
    denied = {r["host"]: r["reason"] for r in proxy.denied()}
    assert "not in the build's allow list" in denied["other.invalid"]
    assert proxy.records[0]["bytes_in"] > 0 and proxy.records[0]["bytes_out"] > 0


def _curl_sync(netns: str, *args: str) -> tuple[int, str]:
    done = subprocess.run(
        ["nsenter", f"--net={netns}", "--", "curl", "-sS", "--max-time", "10",
         "-x", f"http://{PROXY[0]}:{PROXY[1]}", *args],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr
