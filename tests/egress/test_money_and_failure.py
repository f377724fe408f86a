"""Whole runs (replayed model turns, real sandbox): egress stops at the budget, and a broker
that fails mid-run leaves egress closed and ends the run."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from ephemeral.broker import egress
from ephemeral.engine.runtime import Runtime
from ephemeral.policy import RunRequest
from ephemeral.runview import fold_events
from tests.broker.test_run import final, tool_turn
from tests.egress.conftest import Names
from tests.egress.servers import serve

pytestmark = [pytest.mark.sandbox]

MIB = 1 << 20
HUGE = 200 * MIB


class _Zeros(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        size = HUGE if self.path == "/huge" else 1000
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size))
        self.end_headers()
        chunk = b"\0" * (256 * 1024)
        sent = 0
        try:
            while sent < size:
                piece = chunk[: size - sent]
                self.wfile.write(piece)
                sent += len(piece)
        except OSError:
            pass


@pytest.fixture
def zeros() -> Iterator[int]:
    yield from serve(_Zeros)


@pytest.fixture
def broker_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker raises once a tunnel has carried 5 MiB in (a broker failing mid-run)."""
    real_take = egress._Meter.take

    async def failing_take(self: egress._Meter, n: int, *, out: bool) -> None:
        await real_take(self, n, out=out)
        if self.bytes_in > 5 * MIB:
            raise RuntimeError("the broker broke")

    monkeypatch.setattr(egress._Meter, "take", failing_take)


def _download(port: int, path: str) -> str:
    return (
        f"curl -sS -m 60 -o /dev/null -w 'got=%{{size_download}}\\n' "
        f"http://site.test:{port}{path}; echo rc=$?"
    )


async def test_a_byte_heavy_download_stops_at_the_budget(
    runtime: Runtime, names: Names, isolation: str, zeros: int, make_cassette: Callable[..., str]
) -> None:
    names.set("site.test", "127.0.0.1")
    model = make_cassette(
        "egress-budget",
        [
            tool_turn(("shell", {"command": _download(zeros, "/huge")})),
            final("downloaded"),
        ],
    )
    request = RunRequest(
        prompt="Download it.",
        model=model,
        web=True,
        shell=True,
        isolation=isolation,
        max_cost_micros=8_000,
    )
    row, _ = await runtime.admit(await runtime.local_org(), request)
    agent = await runtime.engine.build(row.id)
    row = await runtime.engine.handle(agent.run_id).drive(agent)

    assert row.termination_reason == "budget_exhausted", row.termination_detail
    assert row.termination_detail == "egress traffic used up the budget"
    events = await runtime.store.events.list(row.id)
    shell = next(e.data for e in events if e.type == "shell.executed")
    got = int(shell["stdout"].split("got=")[1].split()[0])
    assert 10 * MIB < got < 80 * MIB  # cut well before the 200 MiB were through
    requested = [e.data for e in events if e.type == "web.requested"]
    assert len(requested) == 1
    event = requested[0]
    assert event["cut"] == "the run's budget is used up"
    assert event["bytes_in"] >= got
    # one request, then one MiB ahead at a time: never more MiB charged than moved, plus one
    mibs = (event["cost_micros"] - 1000) // 100
    assert mibs == -(-(event["bytes_in"] + event["bytes_out"]) // MIB)
    assert row.breakdown["web_micros"] == event["cost_micros"]
    assert row.charged_micros <= row.reserved_micros
    assert row.charged_micros + row.refunded_micros == row.reserved_micros
    assert fold_events(events)["cost"]["charged_micros"] == row.charged_micros


async def test_a_failing_broker_closes_egress_and_ends_the_run(
    runtime: Runtime,
    names: Names,
    isolation: str,
    zeros: int,
    make_cassette: Callable[..., str],
    broker_breaks: None,
) -> None:
    names.set("site.test", "127.0.0.1")
    script = "; ".join(
        [
            _download(zeros, "/small"),
            _download(zeros, "/huge"),  # the broker fails mid-tunnel
            _download(zeros, "/small"),  # egress is closed now
            "sleep 0.2; cat /proc/net/tcp | wc -l",
        ]
    )
    model = make_cassette(
        "egress-broker-fails",
        [tool_turn(("shell", {"command": script})), final("never reached")],
    )
    request = RunRequest(prompt="Go.", model=model, web=True, shell=True, isolation=isolation)
    row, _ = await runtime.admit(await runtime.local_org(), request)
    agent = await runtime.engine.build(row.id)
    row = await runtime.engine.handle(agent.run_id).drive(agent)

    assert row.termination_reason == "infra_error"
    assert row.termination_detail == "the egress broker failed: RuntimeError"
    assert row.output is None  # the model was never asked again
    events = await runtime.store.events.list(row.id)
    shell = next(e.data for e in events if e.type == "shell.executed")
    lines = shell["stdout"].split("\n")
    assert lines[0:2] == ["got=1000", "rc=0"]
    got = int(lines[2].removeprefix("got="))
    assert 4 * MIB < got < 50 * MIB and lines[3] != "rc=0"
    assert lines[4] == "got=0" and lines[5] != "rc=0"
    requested = [e.data for e in events if e.type == "web.requested"]
    assert len(requested) == 2  # the third request was never served
    assert agent.sandbox is None and row.status == "failed"
    assert row.charged_micros + row.refunded_micros == row.reserved_micros
