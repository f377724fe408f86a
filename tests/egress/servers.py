"""Local servers for egress tests: a package index (PEP 503 simple API, one hand-built wheel),
a smart-HTTP git server (git's own ``http-backend`` as CGI) and an echoing API upstream that
does everything a redactor must survive (:func:`echo_site`)."""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import subprocess
import threading
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote_from_bytes, urlsplit

PACKAGE = "ephemeral-egress-probe"
MODULE = "ephemeral_egress_probe"
VERSION = "1.0"
WHEEL = f"{MODULE}-{VERSION}-py3-none-any.whl"


def build_wheel() -> bytes:
    """A minimal pure-Python wheel whose module prints a known line."""
    files = {
        f"{MODULE}/__init__.py": b'ANSWER = "egress-probe-ok"\n',
        f"{MODULE}-{VERSION}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {VERSION}\n"
        ).encode(),
        f"{MODULE}-{VERSION}.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{MODULE}-{VERSION}.dist-info/RECORD,,")
    files[f"{MODULE}-{VERSION}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


def serve(handler: type[BaseHTTPRequestHandler], port: int = 0) -> Iterator[int]:
    """Serve ``handler`` on 127.0.0.1 in a thread; yields the port, then shuts it down."""
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextmanager
def package_index(port: int = 0) -> Iterator[tuple[int, list[str]]]:
    """``/simple/<name>/`` and the wheel; yields (port, paths requested)."""
    wheel = build_wheel()
    sha = hashlib.sha256(wheel).hexdigest()
    seen: list[str] = []

    class Index(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            seen.append(self.path)
            if self.path.rstrip("/") == f"/simple/{PACKAGE}":
                body = (
                    f'<!DOCTYPE html><html><body><a href="/files/{WHEEL}#sha256={sha}">'
                    f"{WHEEL}</a></body></html>"
                ).encode()
                ctype = "text/html"
            elif self.path == f"/files/{WHEEL}":
                body, ctype = wheel, "application/octet-stream"
            else:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    for p in serve(Index, port):
        yield p, seen


def make_repo(root: Path) -> Path:
    """A bare repository ``root/probe.git`` with one commit holding README."""
    work = root / "work"
    work.mkdir()
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
        "GIT_CONFIG_GLOBAL": "/dev/null",
    }

    def git(*args: str, cwd: Path = work) -> None:
        subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True)

    git("init", "-q", "-b", "main")
    (work / "README").write_text("cloned through the broker\n")
    git("add", "README")
    git("commit", "-q", "-m", "first")
    git("clone", "-q", "--bare", str(work), str(root / "probe.git"), cwd=root)
    return root / "probe.git"


@contextmanager
def git_http(root: Path) -> Iterator[tuple[int, list[str]]]:
    """``git http-backend`` (smart HTTP) for the repositories under ``root``, as CGI."""
    seen: list[str] = []

    class Git(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _cgi(self) -> None:
            seen.append(f"{self.command} {self.path}")
            path, _, query = self.path.partition("?")
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            env = {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "GIT_PROJECT_ROOT": str(root),
                "GIT_HTTP_EXPORT_ALL": "1",
                "REQUEST_METHOD": self.command,
                "PATH_INFO": path,
                "QUERY_STRING": query,
                "CONTENT_TYPE": self.headers.get("Content-Type", ""),
                "CONTENT_LENGTH": str(length),
                "GIT_PROTOCOL": self.headers.get("Git-Protocol", ""),
                "REMOTE_ADDR": "127.0.0.1",
            }
            out = subprocess.run(
                ["git", "http-backend"], input=body, env=env, capture_output=True, check=False
            ).stdout
            head, _, payload = out.partition(b"\r\n\r\n")
            status = 200
            headers = []
            for line in head.split(b"\r\n"):
                name, _, value = line.decode("latin-1").partition(":")
                if name.lower() == "status":
                    status = int(value.strip().split()[0])
                elif name:
                    headers.append((name, value.strip()))
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = _cgi

    for p in serve(Git):
        yield p, seen


@dataclass
class Echo:
    """What :func:`echo_site` heard: each request's headers, in order."""

    port: int = 0
    seen: list[dict[str, str]] = field(default_factory=list)


def _encoded(body: bytes, coding: str) -> bytes:
    if coding == "gzip":
        return gzip.compress(body)
    if coding == "deflate":
        return zlib.compress(body)
    return body


_FORMS = {
    "raw": lambda b: b,
    "upper": lambda b: b.upper(),
    "b64": base64.b64encode,
    "b64url": base64.urlsafe_b64encode,
    "hex": lambda b: b.hex().encode(),
    "HEX": lambda b: b.hex().upper().encode(),
    "url": lambda b: quote_from_bytes(b, safe="").encode(),
    "json": lambda b: json.dumps(b.decode("latin-1"), ensure_ascii=True).encode(),
}
ECHO_FORMS = sorted(_FORMS)


@contextmanager
def echo_site() -> Iterator[Echo]:
    """An upstream as hostile as an API can be to a redactor: it echoes the request's headers
    in the body, in the form ``?form=`` names (raw, upper case, base64, hex, URL-encoded,
    JSON-escaped) and into a response header (``?hdr=1``); compresses as ``Accept-Encoding``
    allows or regardless (``?enc=gzip|deflate``); answers ``Range`` (or ``?part=a-b``) with a
    206 slice; and sends the body in 7-byte chunks (``?chunked=1``)."""
    echo = Echo()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            headers = dict(self.headers.items())
            echo.seen.append(headers)
            query = {k: v[0] for k, v in parse_qs(urlsplit(self.path).query).items()}
            text = json.dumps({"path": self.path, "headers": headers}).encode()
            body = _FORMS.get(query.get("form", "raw"), _FORMS["raw"])(text)
            status = 200
            extra: list[tuple[str, str]] = []
            wanted = query.get("part") or (self.headers.get("Range") or "").removeprefix("bytes=")
            if wanted and "-" in wanted:
                a, _, b = wanted.partition("-")
                start = int(a) if a.isdigit() else 0
                end = min(int(b) if b.isdigit() else len(body) - 1, len(body) - 1)
                extra.append(("Content-Range", f"bytes {start}-{end}/{len(body)}"))
                body, status = body[start : end + 1], 206
            accepted = self.headers.get("Accept-Encoding", "")
            coding = query.get("enc") or next(
                (c for c in ("gzip", "deflate") if c in accepted.lower()), ""
            )
            if coding:
                body = _encoded(body, coding)
                extra.append(("Content-Encoding", coding))
            if query.get("hdr"):
                extra.append(("X-Echo", headers.get("Authorization", "")))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            for k, v in extra:
                self.send_header(k, v)
            if query.get("chunked"):
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i in range(0, len(body), 7):
                    piece = body[i : i + 7]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.write(b"0\r\n\r\n")
            else:
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        do_GET = do_POST = _handle

    for p in serve(Handler):
        echo.port = p
        yield echo
