"""Fixtures for the broker: a real HTTP upstream on 127.0.0.1 and runs built by a real runtime."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from ephemeral.agent.loop import AgentRun
from ephemeral.broker import Broker, Sealer
from ephemeral.engine.runtime import Runtime
from ephemeral.events import Event
from ephemeral.policy import RunRequest
from ephemeral.providers.base import ToolCall
from ephemeral.settings import Settings
from tests import runlevel
from tests.run.conftest import make_cassette  # noqa: F401  (a fixture the run test uses)

CANARY = "canary-5f3a9c1e7b2d4068-secret"
BIG = 300 * 1024


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Upstream:
    """A small HTTP server; every request it receives is kept in ``seen``."""

    port: int = 0
    seen: list[Seen] = field(default_factory=list)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _handler(up: Upstream) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _reply(self, status: int, body: bytes, ctype: str, extra: dict | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            up.seen.append(Seen(self.command, self.path, dict(self.headers.items()), body))
            parts = urlsplit(self.path)
            query = parse_qs(parts.query)
            path = parts.path
            if path.startswith("/api/"):
                path = path[len("/api") :]
            if path == "/text":
                self._reply(200, b"hello from upstream", "text/plain; charset=utf-8")
            elif path == "/big":
                self._reply(200, b"x" * BIG, "text/plain")
            elif path == "/binary":
                self._reply(200, bytes(range(256)), "application/octet-stream")
            elif path == "/redirect":
                self._reply(302, b"", "text/plain", {"Location": query["to"][0]})
            elif path.startswith("/chain/"):
                n = int(path.rsplit("/", 1)[1])
                if n == 0:
                    self._reply(200, b"end of chain", "text/plain")
                else:
                    self._reply(302, b"", "text/plain", {"Location": f"/chain/{n - 1}"})
            elif path.startswith("/echo") or path.startswith("/repos/"):
                echoed = {
                    "method": self.command,
                    "path": self.path,
                    "headers": dict(self.headers.items()),
                    "body": body.decode(errors="replace"),
                }
                self._reply(200, json.dumps(echoed).encode(), "application/json")
            else:
                self._reply(404, b"not found", "text/plain")

        do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

    return Handler


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(up))
    up.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield up
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def broker_settings(tmp_path: Path, cassettes: Path) -> Settings:
    return Settings.load(
        state_dir=tmp_path / "state",
        cassettes_dir=cassettes,
        use_prefect=False,
        broker_allow_private_hosts=True,
    )


# Runs that build_run built and no test drives to its end: each runtime's own, cancelled before
# the run-level check, which then holds them to what any run must leave (nothing).
_BUILT: dict[int, list[str]] = {}


@pytest.fixture
async def runtime(broker_settings: Settings) -> AsyncIterator[Runtime]:
    async with runlevel.started(broker_settings, check=True) as rt:
        yield rt
        for run_id in _BUILT.pop(id(rt), []):
            await rt.cancel(run_id)


_ids = itertools.count()


async def build_run(runtime: Runtime, **policy: Any) -> AgentRun:
    """A run admitted for the local org and built (not provisioned: tools run on the host)."""
    policy.setdefault("isolation", "namespaces")
    policy.setdefault("shell", False)
    org = await runtime.local_org()
    row, _ = await runtime.admit(
        org, RunRequest(prompt="broker test", model="replay/sandbox-proof", **policy)
    )
    _BUILT.setdefault(id(runtime), []).append(row.id)
    return await runtime.engine.build(row.id)


async def call(agent: AgentRun, tool: str, /, **arguments: Any) -> str:
    """Ask for one tool call the way the loop does; returns what the model would read."""
    await agent.tool_step(ToolCall(id=f"call_{next(_ids)}", name=tool, arguments=arguments))
    content = agent.messages[-1].content
    assert content is not None
    return content


async def events_of(agent: AgentRun, *types: str) -> list[Event]:
    return [e for e in await agent.store.events.list(agent.run_id) if e.type in types]


async def add_connection(
    runtime: Runtime, name: str, base_url: str, headers: dict[str, str]
) -> None:
    org = await runtime.local_org()
    await runtime.store.connections.add(
        org,
        name,
        base_url=base_url,
        header_names=list(headers),
        sealed_headers=Sealer.for_settings(runtime.settings).seal(headers),
    )


def state_bytes_contain(state_dir: Path, needle: bytes) -> list[Path]:
    """Every file under the state dir whose bytes contain ``needle``."""
    return [p for p in state_dir.rglob("*") if p.is_file() and needle in p.read_bytes()]


@pytest.fixture
def broker(broker_settings: Settings) -> Broker:
    """A broker that may reach 127.0.0.1 (the upstream), for tests with a FakeContext."""
    return Broker(broker_settings)
