"""Egress fixtures: real sandboxes (namespaces, gvisor), real HTTP and HTTPS servers on
127.0.0.1, a test CA (trustme) and test host names.

Names under ``.test`` are answered by the ``names`` table instead of DNS (the host has no
resolver for them), through the event loop's ``getaddrinfo`` the broker calls: the table counts
lookups, and may answer differently the second time (DNS rebinding).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any

import pytest

from ephemeral.agent.loop import AgentRun
from ephemeral.broker import Broker
from ephemeral.engine.runtime import Runtime
from ephemeral.sandbox.base import ExecResult
from ephemeral.settings import Settings
from tests.broker import conftest as _broker
from tests.broker.conftest import Upstream, _handler, build_run
from tests.drivers import unavailable
from tests.run.conftest import make_cassette  # noqa: F401  (a fixture)
from tests.sandbox.conftest import _availability_of

ISOLATIONS = ["namespaces", "gvisor", pytest.param("microvm-tcg", marks=pytest.mark.slow)]
# the broker tests' fixtures: a runtime whose broker may reach 127.0.0.1, and an HTTP upstream
broker_settings = _broker.broker_settings
runtime = _broker.runtime
upstream = _broker.upstream


@dataclass
class Names:
    """Answers for ``*.test`` names; a list of answers is served one lookup at a time."""

    answers: dict[str, list[list[str]]] = field(default_factory=dict)
    lookups: Counter[str] = field(default_factory=Counter)

    def set(self, name: str, *addresses: str) -> None:
        self.answers[name] = [list(addresses)]

    def sequence(self, name: str, *answers: list[str]) -> None:
        self.answers[name] = [list(a) for a in answers]

    def answer(self, name: str) -> list[str]:
        seq = self.answers.get(name.lower())
        if not seq:
            return []
        n = self.lookups[name.lower()]
        return seq[min(n, len(seq) - 1)]


@pytest.fixture
def names(monkeypatch: pytest.MonkeyPatch) -> Names:
    table = Names()
    original = asyncio.base_events.BaseEventLoop.getaddrinfo

    async def getaddrinfo(self: Any, host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and host.lower().endswith(".test"):
            answers = table.answer(host)
            table.lookups[host.lower()] += 1
            if not answers:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            out = []
            for a in answers:
                if ":" in a:
                    out.append((socket.AF_INET6, socket.SOCK_STREAM, 6, "", (a, port, 0, 0)))
                else:
                    out.append((socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)))
            return out
        return await original(self, host, port, *args, **kwargs)

    monkeypatch.setattr(asyncio.base_events.BaseEventLoop, "getaddrinfo", getaddrinfo)
    return table


@pytest.fixture
def strict_broker(runtime: Runtime) -> Callable[..., Broker]:
    """Brokers as an operator runs them: ``broker_allow_private_hosts`` off (this folder's
    runtime turns it on so that its brokers reach the 127.0.0.1 upstream), with the given
    ``egress_allow_private`` entries, validated as the operator's environment would be."""

    def make(*allowed: str) -> Broker:
        entries = Settings.load(egress_allow_private=list(allowed)).egress_allow_private
        return Broker(
            runtime.settings.model_copy(
                update={"broker_allow_private_hosts": False, "egress_allow_private": entries}
            )
        )

    return make


@pytest.fixture(params=ISOLATIONS)
def isolation(request: pytest.FixtureRequest, broker_settings: Settings) -> str:
    iso: str = request.param
    why = _availability_of(iso, broker_settings)
    if why is not None:
        unavailable(f"{iso} cannot run here: {why}", iso)
    return iso


@dataclass
class Tls:
    ca_pem: bytes
    port: int
    upstream: Upstream


@pytest.fixture
def tls_site() -> Iterator[Tls]:
    """An HTTPS server on 127.0.0.1 for ``site.test`` and ``other.test``, signed by a test CA."""
    yield from _tls_server(0)


@pytest.fixture
def tls_site_443() -> Iterator[Tls]:
    """The same on 127.0.0.1:443, HTTPS's default port (the tests run as root)."""
    try:
        yield from _tls_server(443)
    except PermissionError as exc:
        pytest.skip(f"cannot bind 127.0.0.1:443: {exc}")
    except OSError as exc:
        pytest.skip(f"127.0.0.1:443 is taken: {exc}")


def _tls_server(port: int) -> Iterator[Tls]:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("site.test", "other.test")
    up = Upstream()
    server = ThreadingHTTPServer(("127.0.0.1", port), _handler(up))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ctx)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    up.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Tls(ca_pem=ca.cert_pem.bytes(), port=up.port, upstream=up)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@dataclass
class Listeners:
    """A TCP and a UDP listener on the host's 127.0.0.1; ``heard`` is what reached them."""

    tcp_port: int
    udp_port: int
    heard: list[str] = field(default_factory=list)


@pytest.fixture
def host_listeners() -> Iterator[Listeners]:
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    tcp.settimeout(0.2)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.2)
    found = Listeners(tcp.getsockname()[1], udp.getsockname()[1])
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, addr = tcp.accept()
                found.heard.append(f"tcp from {addr}")
                conn.close()
            with contextlib.suppress(OSError):
                data, addr = udp.recvfrom(100)
                found.heard.append(f"udp {data!r} from {addr}")

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield found
    finally:
        stop.set()
        thread.join(timeout=5)
        tcp.close()
        udp.close()


@contextlib.asynccontextmanager
async def provisioned(
    runtime: Runtime, isolation: str, broker: Broker | None = None, **policy: Any
) -> AsyncIterator[AgentRun]:
    """A run provisioned in a real sandbox (shell on); torn down and settled at the end."""
    policy.setdefault("shell", True)
    agent = await build_run(runtime, isolation=isolation, **policy)
    if broker is not None:
        agent.broker = broker
    task = asyncio.current_task()
    assert task is not None
    runtime.engine.state(agent.run_id).task = task  # this test executes the run (not the watchdog)
    try:
        await agent.provision()
        yield agent
    finally:
        await agent.teardown()
        if agent.exit is None:
            from ephemeral.engine import exits

            agent.exit = exits.succeeded()
        await agent.settle()
        # this task executed the run: let the engine forget it, as a launched run's task does
        # when it ends (the run-level check holds the engine to keeping no run it settled)
        held = runtime.engine.runs.get(agent.run_id)
        if held is not None and held.task is task:
            del runtime.engine.runs[agent.run_id]


async def sh(agent: AgentRun, command: str, timeout: float = 30.0) -> ExecResult:
    """A command as the run's shell tool runs it (with the run's proxy variables)."""
    assert agent.sandbox is not None
    return await agent.sandbox.exec(
        command, env=agent.egress_env or None, timeout=timeout, max_output=1 << 20
    )
