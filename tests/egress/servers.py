"""Local servers for the tools a user runs through egress: a package index (PEP 503 simple
API, one hand-built wheel) and a smart-HTTP git server (git's own ``http-backend`` as CGI)."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import subprocess
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

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
