"""Whole runs against local servers speaking the providers' real wire formats (127.0.0.1 only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ephemeral.policy import RunRequest
from ephemeral.providers.replay import load_cassette
from ephemeral.settings import Settings
from ephemeral.testing.providers import (
    FakeAnthropicServer,
    FakeOpenAIServer,
    FakeReply,
    openai_chat_response,
)
from tests import runlevel

pytestmark = [pytest.mark.sandbox]

SAMPLE = Path(__file__).resolve().parents[2] / "recipes" / "cassettes" / "sandbox-proof.json"
KEY = "sk-test-secret-4242"


async def _run(settings: Settings, model: str) -> tuple:
    async with runlevel.started(settings, check=True) as runtime:
        org = await runtime.local_org()
        row, _ = await runtime.admit(org, RunRequest(prompt="sample", model=model))
        row = await runtime.execute(row.id)
        return row, await runtime.store.events.list(row.id)


async def test_openai_wire_with_transient_errors_is_retried(tmp_path: Path) -> None:
    # Two transient failures before the first real answer: a 429 with Retry-After, a 503.
    script = [
        FakeReply(
            status=429,
            body={"error": {"message": "slow down", "type": "rate_limit"}},
            headers={"retry-after": "0"},
        ),
        FakeReply(status=503, body={"error": {"message": "busy", "type": "server_error"}}),
    ]
    for t in load_cassette(SAMPLE).turns:
        script.append(
            FakeReply(
                body=openai_chat_response(
                    content=t.message.content,
                    tool_calls=[(c.id, c.name, c.arguments) for c in t.message.tool_calls],
                    prompt_tokens=t.usage.input_tokens,
                    completion_tokens=t.usage.output_tokens,
                )
            )
        )
    with FakeOpenAIServer(script, api_key=KEY) as server:
        settings = Settings.load(
            state_dir=tmp_path / "s",
            use_prefect=False,
            openai_base_url=server.base_url,
            openai_api_key=KEY,
        )
        row, events = await _run(settings, "openai/gpt-6-luna")
        requests = list(server.requests)
    assert row.status == "succeeded", row.termination_detail
    assert row.usage["model_calls"] == 3
    assert len(requests) == 5  # 2 failures + 3 answers
    body = requests[-1].json()
    assert body["tools"][0]["function"]["name"] == "shell"
    assert any(m["role"] == "tool" for m in body["messages"])
    outs = "".join(e.data["stdout"] for e in events if e.type == "shell.executed")
    assert "worker" in outs
    # The key went to the provider and nowhere else.
    assert requests[0].headers["authorization"] == f"Bearer {KEY}"
    for path in (tmp_path / "s").rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path


async def test_persistent_server_errors_fail_the_run_as_model_error(tmp_path: Path) -> None:
    failures = [
        FakeReply(status=500, body={"error": {"message": "boom", "type": "server_error"}})
        for _ in range(10)
    ]
    with FakeOpenAIServer(failures, api_key=KEY) as server:
        settings = Settings.load(
            state_dir=tmp_path / "s",
            use_prefect=False,
            openai_base_url=server.base_url,
            openai_api_key=KEY,
        )
        row, events = await _run(settings, "openai/gpt-6-luna")
    assert row.status == "failed"
    assert row.termination_reason == "model_error"
    assert row.charged_micros + row.refunded_micros == row.reserved_micros
    assert [e.type for e in events][-3:] == ["sandbox.destroyed", "run.failed", "run.settled"]


async def test_anthropic_wire_runs_the_sample(tmp_path: Path) -> None:
    with FakeAnthropicServer.from_cassette(SAMPLE, api_key=KEY) as server:
        settings = Settings.load(
            state_dir=tmp_path / "s",
            use_prefect=False,
            anthropic_base_url=server.base_url,
            anthropic_api_key=KEY,
        )
        row, _ = await _run(settings, "anthropic/claude-sonnet-4-5")
    assert row.status == "succeeded", row.termination_detail
    assert row.usage["model_calls"] == 3
