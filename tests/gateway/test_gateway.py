"""The model gateway from inside real sandboxes: ``$OPENAI_BASE_URL`` / ``$ANTHROPIC_BASE_URL``
answer through the egress proxy, metered against the run's budget, the key kept on the host."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ephemeral.agent.loop import AgentRun
from ephemeral.engine.runtime import Runtime
from ephemeral.testing.providers import (
    FakeAnthropicServer,
    FakeOpenAIServer,
    FakeReply,
    anthropic_message_response,
    anthropic_message_stream,
    openai_chat_response,
    openai_chat_stream,
    openai_responses_response,
    openai_responses_stream,
)
from tests.broker.conftest import events_of, state_bytes_contain
from tests.egress.conftest import provisioned, sh
from tests.gateway.conftest import ANTHROPIC_KEY, OPENAI_KEY

pytestmark = [pytest.mark.sandbox]

GPT = "openai/gpt-6-luna"
CLAUDE = "anthropic/claude-sonnet-4-5"


def _post(
    path: str, body: dict[str, Any], *, base: str = "$OPENAI_BASE_URL", extra: str = ""
) -> str:
    payload = json.dumps(body).replace("'", "'\\''")
    return (
        f"curl -sS -m 20 -N -w '\\ncode=%{{http_code}}' {extra} "
        f"-H 'Content-Type: application/json' -H \"Authorization: Bearer $OPENAI_API_KEY\" "
        f"-d '{payload}' \"{base}{path}\""
    )


def _split(stdout: str) -> tuple[str, int]:
    body, _, code = stdout.rpartition("\ncode=")
    return body, int(code)


async def _called(agent: AgentRun) -> list[dict[str, Any]]:
    return [e.data for e in await events_of(agent, "model.called")]


async def test_chat_completions_and_responses_plain_and_streamed(
    runtime: Runtime, openai_server: FakeOpenAIServer, isolation: str
) -> None:
    openai_server.push(
        FakeReply(
            body=openai_chat_response(content="hello", prompt_tokens=50, completion_tokens=7)
        ),
        FakeReply(
            stream=openai_chat_stream(
                ["one ", "two ", "three"], prompt_tokens=60, completion_tokens=3
            )
        ),
        FakeReply(body=openai_responses_response(text="r1", input_tokens=40, output_tokens=2)),
        FakeReply(stream=openai_responses_stream(["a", "b"], input_tokens=41, output_tokens=5)),
    )
    async with provisioned(runtime, isolation, models=[GPT]) as agent:
        env = await sh(agent, "env | grep -E '^(OPENAI|ANTHROPIC)_' | sort")
        assert "OPENAI_BASE_URL=http://model.internal/v1" in env.stdout
        assert "ANTHROPIC_BASE_URL=http://model.internal" in env.stdout
        assert OPENAI_KEY not in env.stdout

        msgs = [{"role": "user", "content": "hi"}]
        res = await sh(agent, _post("/chat/completions", {"model": "gpt-6-luna", "messages": msgs}))
        body, code = _split(res.stdout)
        assert code == 200, res.stdout + res.stderr
        assert json.loads(body)["choices"][0]["message"]["content"] == "hello"

        res = await sh(
            agent,
            _post("/chat/completions", {"model": GPT, "messages": msgs, "stream": True}),
        )
        body, code = _split(res.stdout)
        assert code == 200, res.stdout + res.stderr
        deltas = [
            json.loads(line[6:])["choices"][0]["delta"].get("content")
            for line in body.splitlines()
            if line.startswith("data: {")
        ]
        assert "".join(d for d in deltas if d) == "one two three"
        assert '"usage": {' not in body  # the usage chunk the client did not ask for is dropped
        assert body.rstrip().endswith("data: [DONE]")

        res = await sh(agent, _post("/responses", {"model": "gpt-6-luna", "input": "hi"}))
        body, code = _split(res.stdout)
        assert code == 200 and json.loads(body)["output"][0]["content"][0]["text"] == "r1"
        res = await sh(
            agent, _post("/responses", {"model": "gpt-6-luna", "input": "hi", "stream": True})
        )
        body, code = _split(res.stdout)
        assert code == 200 and "response.completed" in body

        models = await sh(agent, "curl -sS -m 10 $OPENAI_BASE_URL/models")
        assert [m["id"] for m in json.loads(models.stdout)["data"]] == [GPT]
    # what reached the provider: the real key, the provider's name, usage asked for on a stream
    sent = openai_server.requests
    assert [r.path for r in sent] == ["/v1/chat/completions"] * 2 + ["/v1/responses"] * 2
    assert all(r.headers["authorization"] == f"Bearer {OPENAI_KEY}" for r in sent)
    first, streamed = sent[0].json(), sent[1].json()
    assert first["model"] == "gpt-6-luna" and first["max_tokens"] > 0
    assert streamed["stream_options"] == {"include_usage": True}
    called = await _called(agent)
    # a call's event is written once its answer is out: the next call may come first
    seen = sorted((c["input_tokens"], c["output_tokens"], c["stream"], c["api"]) for c in called)
    assert seen == [
        (40, 2, False, "responses"),
        (41, 5, True, "responses"),
        (50, 7, False, "chat.completions"),
        (60, 3, True, "chat.completions"),
    ]
    book = runtime.price_book
    from ephemeral.providers.base import Usage

    for c in called:
        assert c["model"] == GPT
        want = book.model_cost(
            GPT, Usage(input_tokens=c["input_tokens"], output_tokens=c["output_tokens"])
        )
        assert c["cost_micros"] == want and c["reserved_micros"] >= want
    row = await runtime.store.runs.get(agent.run_id)
    assert row.breakdown["model_micros"] == sum(c["cost_micros"] for c in called)
    assert row.breakdown["web_micros"] == 0
    assert row.charged_micros + row.refunded_micros == row.reserved_micros
    assert state_bytes_contain(runtime.settings.state_dir, OPENAI_KEY.encode()) == []


async def test_anthropic_messages_plain_and_streamed(
    runtime: Runtime, anthropic_server: FakeAnthropicServer, isolation: str
) -> None:
    anthropic_server.push(
        FakeReply(
            body=anthropic_message_response(
                text="bonjour", input_tokens=30, cache_read_input_tokens=10, output_tokens=4
            )
        ),
        FakeReply(stream=anthropic_message_stream(["x", "y"], input_tokens=33, output_tokens=9)),
    )
    headers = "-H 'anthropic-version: 2023-06-01' -H \"x-api-key: $ANTHROPIC_API_KEY\""
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "hi"}],
    }
    async with provisioned(runtime, isolation, models=[CLAUDE]) as agent:
        res = await sh(
            agent, _post("/v1/messages", body, base="$ANTHROPIC_BASE_URL", extra=headers)
        )
        out, code = _split(res.stdout)
        assert code == 200, res.stdout + res.stderr
        assert json.loads(out)["content"][0]["text"] == "bonjour"
        res = await sh(
            agent,
            _post(
                "/v1/messages", {**body, "stream": True}, base="$ANTHROPIC_BASE_URL", extra=headers
            ),
        )
        out, code = _split(res.stdout)
        assert code == 200 and "event: message_stop" in out
    sent = anthropic_server.requests
    assert all(r.headers["x-api-key"] == ANTHROPIC_KEY for r in sent)
    called = await _called(agent)
    assert sorted(
        (c["input_tokens"], c["cached_input_tokens"], c["output_tokens"], c["stream"])
        for c in called
    ) == [
        (33, 0, 9, True),
        (40, 10, 4, False),
    ]
    # max_tokens 100 at the output price is what was held, at most
    assert all(c["reserved_micros"] >= c["cost_micros"] > 0 for c in called)


async def test_an_ungranted_model_is_refused_in_the_providers_shape(
    runtime: Runtime,
    openai_server: FakeOpenAIServer,
    anthropic_server: FakeAnthropicServer,
    isolation: str,
) -> None:
    headers = "-H 'anthropic-version: 2023-06-01' -H \"x-api-key: $ANTHROPIC_API_KEY\""
    msgs = [{"role": "user", "content": "hi"}]
    async with provisioned(runtime, isolation, models=[GPT]) as agent:
        res = await sh(agent, _post("/chat/completions", {"model": "gpt-4o", "messages": msgs}))
        body, code = _split(res.stdout)
        assert code == 403, res.stdout
        error = json.loads(body)["error"]
        assert error["code"] == "model_not_found" and "not granted" in error["message"]
        res = await sh(
            agent,
            _post(
                "/v1/messages",
                {"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": msgs},
                base="$ANTHROPIC_BASE_URL",
                extra=headers,
            ),
        )
        body, code = _split(res.stdout)
        assert code == 403 and json.loads(body)["error"]["type"] == "permission_error"
        assert json.loads(body)["type"] == "error"
    assert openai_server.requests == [] and anthropic_server.requests == []
    denied = [e.data for e in await events_of(agent, "model.denied")]
    assert [(d["model"], d["api"]) for d in denied] == [
        ("gpt-4o", "chat.completions"),
        ("claude-sonnet-4-5", "messages"),
    ]
    assert await _called(agent) == []
    row = await runtime.store.runs.get(agent.run_id)
    assert row.breakdown["model_micros"] == 0


async def test_a_client_that_hangs_up_mid_stream_is_charged_what_the_provider_reported(
    runtime: Runtime, openai_server: FakeOpenAIServer, isolation: str
) -> None:
    pieces = [f"tok{i} " for i in range(60)]
    openai_server.push(
        FakeReply(
            stream=openai_chat_stream(pieces, prompt_tokens=70, completion_tokens=60),
            chunk_delay=0.05,
        )
    )
    body = {"model": GPT, "stream": True, "messages": [{"role": "user", "content": "go"}]}
    async with provisioned(runtime, isolation, models=[GPT]) as agent:
        # head reads the first bytes and exits; curl dies on its next write; the stream closes
        res = await sh(agent, _post("/chat/completions", body) + " | head -c 300; echo")
        assert "chat.completion.chunk" in res.stdout and "tok59" not in res.stdout
        called = await _wait_called(agent, 1)
    (event,) = called
    assert event["stream"] is True and event["cut"].startswith("the client hung up")
    assert (event["input_tokens"], event["output_tokens"]) == (70, 60)
    from ephemeral.providers.base import Usage

    assert event["cost_micros"] == runtime.price_book.model_cost(
        GPT, Usage(input_tokens=70, output_tokens=60)
    )
    row = await runtime.store.runs.get(agent.run_id)
    assert row.breakdown["model_micros"] == event["cost_micros"]
    assert row.charged_micros + row.refunded_micros == row.reserved_micros


async def _wait_called(agent: AgentRun, n: int, seconds: float = 30.0) -> list[dict[str, Any]]:
    """The run's model.called events once there are ``n`` (a stream settles after its end)."""
    import asyncio
    import time

    deadline = time.monotonic() + seconds
    while True:
        called = await _called(agent)
        if len(called) >= n or time.monotonic() > deadline:
            return called
        await asyncio.sleep(0.05)


async def test_the_key_never_reaches_the_sandbox_even_when_the_provider_echoes_it(
    runtime: Runtime, openai_server: FakeOpenAIServer, isolation: str
) -> None:
    echo = f"invalid key: Bearer {OPENAI_KEY}"
    openai_server.push(
        FakeReply(status=401, body={"error": {"message": echo, "type": "invalid_request_error"}}),
        FakeReply(stream=openai_chat_stream([f"key={OPENAI_KEY}"], completion_tokens=3)),
    )
    msgs = [{"role": "user", "content": "hi"}]
    async with provisioned(runtime, isolation, models=[GPT]) as agent:
        res = await sh(agent, _post("/chat/completions", {"model": GPT, "messages": msgs}))
        body, code = _split(res.stdout)
        assert code == 401 and "[redacted]" in body
        res2 = await sh(
            agent, _post("/chat/completions", {"model": GPT, "messages": msgs, "stream": True})
        )
        assert "key=[redacted]" in res2.stdout
        leak = await sh(
            agent,
            "env; cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null; "
            f"grep -rl -- '{OPENAI_KEY}' /tmp /home /etc /run /var /opt 2>/dev/null; true",
        )
        assert OPENAI_KEY not in res.stdout + res2.stdout
        assert OPENAI_KEY not in leak.stdout.replace(f"'{OPENAI_KEY}'", "")
    called = await _called(agent)
    assert sorted(c["status"] for c in called) == [200, 401]
    (error,) = [c for c in called if c["status"] == 401]
    assert error["cost_micros"] == 0  # the provider answered an error: nothing to charge
    events = json.dumps([e.data for e in await runtime.store.events.list(agent.run_id)])
    assert OPENAI_KEY not in events
    assert state_bytes_contain(runtime.settings.state_dir, OPENAI_KEY.encode()) == []


async def test_zero_data_retention_keeps_sizes_and_money_only(
    runtime: Runtime, openai_server: FakeOpenAIServer, isolation: str
) -> None:
    openai_server.push(
        FakeReply(
            body=openai_chat_response(content="SECRET-ANSWER", prompt_tokens=5, completion_tokens=2)
        )
    )
    msgs = [{"role": "user", "content": "SECRET-PROMPT"}]
    async with provisioned(runtime, isolation, models=[GPT], zero_data_retention=True) as agent:
        res = await sh(agent, _post("/chat/completions", {"model": GPT, "messages": msgs}))
        assert "SECRET-ANSWER" in res.stdout
    (called,) = await _called(agent)
    assert called["output_tokens"] == 2 and called["cost_micros"] > 0
    assert await runtime.store.transcripts.get(agent.run_id) is None
    for needle in (b"SECRET-ANSWER", b"SECRET-PROMPT"):
        assert state_bytes_contain(runtime.settings.state_dir, needle) == []


async def test_replay_serves_the_cassettes_turns_in_both_formats(
    runtime: Runtime, make_cassette: Any, isolation: str
) -> None:
    turns = [
        {
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "name": "shell", "arguments": {"command": "ls"}}],
            },
            "usage": {"input_tokens": 100, "output_tokens": 20},
        },
        {
            "message": {"role": "assistant", "content": "all done here"},
            "usage": {"input_tokens": 150, "output_tokens": 5},
        },
    ]
    model = make_cassette("gw-replay", turns)
    user = {"role": "user", "content": "go"}
    assistant = {"role": "assistant", "content": "ok"}
    headers = "-H 'anthropic-version: 2023-06-01'"
    async with provisioned(runtime, isolation, models=[model]) as agent:
        res = await sh(agent, _post("/chat/completions", {"model": model, "messages": [user]}))
        body, code = _split(res.stdout)
        assert code == 200, res.stdout
        call = json.loads(body)["choices"][0]["message"]["tool_calls"][0]
        assert call["function"]["name"] == "shell"
        res = await sh(
            agent,
            _post(
                "/chat/completions",
                {"model": "gw-replay", "messages": [user, assistant, user], "stream": True},
            ),
        )
        body, code = _split(res.stdout)
        assert code == 200 and "all " in body and "done " in body
        res = await sh(
            agent,
            _post(
                "/v1/messages",
                {"model": model, "max_tokens": 50, "messages": [user, assistant, user]},
                base="$ANTHROPIC_BASE_URL",
                extra=headers,
            ),
        )
        body, code = _split(res.stdout)
        assert code == 200 and json.loads(body)["content"][0]["text"] == "all done here"
    called = await _called(agent)
    assert sorted((c["input_tokens"], c["output_tokens"]) for c in called) == [
        (100, 20),
        (150, 5),
        (150, 5),
    ]
    transcript = await runtime.store.transcripts.get(agent.run_id)
    assert transcript is not None and len(transcript) == 3
