"""A whole run through the runtime: replayed model turns call ``web_fetch`` and
``connection_call`` against a real server on 127.0.0.1, in a real sandbox with no network."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from ephemeral.engine.runtime import Runtime
from ephemeral.policy import RunRequest
from ephemeral.runview import fold_events
from tests.broker.conftest import CANARY, Upstream, add_connection, state_bytes_contain

pytestmark = [pytest.mark.sandbox]


def tool_turn(*calls: tuple[str, dict[str, Any]]) -> dict:
    return {
        "message": {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": f"call_{i}", "name": name, "arguments": args}
                for i, (name, args) in enumerate(calls)
            ],
        },
        "usage": {"input_tokens": 1000, "output_tokens": 50, "cached_input_tokens": 0},
        "latency_ms": 5,
    }


def final(text: str) -> dict:
    return {
        "message": {"role": "assistant", "content": text, "tool_calls": []},
        "usage": {"input_tokens": 1000, "output_tokens": 50, "cached_input_tokens": 0},
        "latency_ms": 5,
    }


async def test_a_run_uses_the_broker_and_no_secret_lands_anywhere(
    runtime: Runtime, upstream: Upstream, make_cassette: Callable[..., str]
) -> None:
    await add_connection(
        runtime, "github", f"{upstream.base}/api", {"Authorization": f"Bearer {CANARY}"}
    )
    model = make_cassette(
        "broker-run",
        [
            tool_turn(
                ("web_fetch", {"url": f"{upstream.base}/text?sig=QUERYSECRET"}),
                ("connection_call", {"name": "github", "method": "GET", "path": "/repos/a/b"}),
            ),
            tool_turn(
                ("connection_call", {"name": "github", "method": "GET", "path": "/user"}),
                ("web_fetch", {"url": "http://169.254.169.254/latest/meta-data/"}),
                ("shell", {"command": f"env; curl -sS -m 3 {upstream.base}/text; echo rc=$?"}),
            ),
            final("Fetched the page and the repo."),
        ],
    )
    request = RunRequest(
        prompt="Use the broker.",
        model=model,
        web=True,
        shell=True,
        connections=[{"name": "github", "methods": ["GET"], "paths": ["/repos/*"]}],
    )
    row, _ = await runtime.admit(await runtime.local_org(), request)
    agent = await runtime.engine.build(row.id)
    row = await runtime.engine.handle(agent.run_id).drive(agent)

    assert row.status == "succeeded", row.termination_detail
    events = await runtime.store.events.list(row.id)
    by_type = {e.type: e.data for e in events}
    assert by_type["worker.started"]["web"] is True
    assert by_type["worker.started"]["connections"] == ["github"]
    assert by_type["web.requested"] == {
        "method": "GET",
        "url": f"{upstream.base}/text",
        "status": 200,
        "cost_micros": 1000,
    }
    assert by_type["connection.requested"]["status"] == 200
    assert by_type["connection.denied"]["path"] == "/user"
    assert "link-local" in by_type["web.denied"]["reason"]
    # The sandbox itself still has no network and no credential.
    shell = by_type["shell.executed"]
    assert "rc=0" not in shell["stdout"] and CANARY not in shell["stdout"]
    assert [s.path for s in upstream.seen] == ["/text?sig=QUERYSECRET", "/api/repos/a/b"]
    assert upstream.seen[1].headers["Authorization"] == f"Bearer {CANARY}"

    assert row.breakdown["web_micros"] == 1000
    assert row.charged_micros + row.refunded_micros == row.reserved_micros
    assert fold_events(events)["cost"]["charged_micros"] == row.charged_micros

    tool_results = [m.content or "" for m in agent.messages if m.role == "tool"]
    assert any("hello from upstream" in t for t in tool_results)
    assert any("[redacted]" in t for t in tool_results)
    assert not any(CANARY in t for t in tool_results)
    transcript = await runtime.store.transcripts.get(row.id)
    assert transcript and CANARY not in json.dumps(transcript)
    assert "QUERYSECRET" not in json.dumps([e.data for e in events])

    state = runtime.settings.state_dir
    assert list(runtime.settings.records_dir.rglob("*.parquet"))  # the run was recorded
    assert state_bytes_contain(state, CANARY.encode()) == []
