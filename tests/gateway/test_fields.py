"""Issue 35, findings 3 and 5: what a guest's body can make a provider bill or fetch.

The gateway forwards an allow list of fields per wire format (``ephemeral.broker.gateway_fields``);
every case of the red team's reproduction is refused inside a real sandbox, in the provider's
own error shape, before anything reaches the local upstream. And a provider that reports more
than was held is charged (as far as the run's reservation goes), alarmed with ``budget.overrun``
and ends the run ``budget_exhausted``: never a silent cap at the hold.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from ephemeral.broker.gateway_fields import ALLOW_LISTS, Refused, check_body, check_headers
from ephemeral.engine.runtime import Runtime
from ephemeral.money.amounts import usd
from ephemeral.policy import RunRequest
from ephemeral.providers.base import Usage
from ephemeral.testing.providers import (
    CapturedRequest,
    FakeAnthropicServer,
    FakeOpenAIServer,
    FakeReply,
    openai_chat_response,
)
from ephemeral.timeline import describe
from tests.broker.conftest import events_of
from tests.egress.conftest import provisioned, sh
from tests.run.test_agent_run import assert_settled, run_to_end, types

DOCS = Path(__file__).resolve().parents[2] / "docs"
GPT = "openai/gpt-6-luna"
PRICEY = "openai/gpt-4o"
CLAUDE = "anthropic/claude-sonnet-4-5"
ROUTED = "openrouter/openai/gpt-4o-mini"

MSGS = [{"role": "user", "content": "hi"}]
URL = "http://attacker.test/leak?data=SECRET"
PNG = (  # a 1x1 PNG
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5ErkJggg=="
)


# -- the docs print the code's allow lists ---------------------------------------------------------
def test_the_docs_print_the_gateways_allow_lists() -> None:
    text = (DOCS / "broker.md").read_text()
    section = text.split("| allow list | what passes |", 1)[1]
    documented: dict[str, tuple[str, ...]] = {}
    for line in section.splitlines()[2:]:
        if not line.startswith("|"):
            break
        name, names = (c.strip() for c in line.strip().strip("|").split(" | "))
        documented[name] = tuple(re.findall(r"`([^`]+)`", names))
    assert documented == ALLOW_LISTS


# -- bodies real clients send pass; the reproduction's do not (no sandbox) -------------------------
CLIENT_BODIES: list[tuple[str, str, dict[str, Any]]] = [
    # litellm / the OpenAI SDK: tools, tool results, JSON output, a data: image, usage on a stream
    (
        "chat.completions",
        "openai",
        {
            "model": "gpt-6-luna",
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this"},
                        {
                            "type": "image_url",
                            "image_url": {"url": f"data:image/png;base64,{PNG}", "detail": "low"},
                        },
                    ],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "bash", "arguments": '{"command": "ls"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "bash", "parameters": {"type": "object"}},
                }
            ],
            "tool_choice": "auto",
            "temperature": 0.0,
            "max_completion_tokens": 100,
            "stream": True,
            "stream_options": {"include_usage": True},
            "response_format": {"type": "json_object"},
            "n": 1,
            "service_tier": "auto",
            "seed": 1,
            "stop": ["\n\n"],
        },
    ),
    # the Responses API as the Codex CLI sends it (stateless: store false, encrypted reasoning)
    (
        "responses",
        "openai",
        {
            "model": "gpt-6-luna",
            "instructions": "you are a coding agent",
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "x"}],
                },
                {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"},
                {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                {"role": "user", "content": "go on"},
            ],
            "tools": [{"type": "function", "name": "shell", "parameters": {}, "strict": False}],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"},
            "store": False,
            "stream": True,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "k",
        },
    ),
    # Anthropic's SDK and Claude Code: cached system blocks, thinking, a base64 image and PDF
    (
        "messages",
        "anthropic",
        {
            "model": "claude-sonnet-4-5",
            "max_tokens": 2000,
            "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": PNG},
                        },
                        {
                            "type": "document",
                            "source": {
                                "type": "base64",
                                "media_type": "application/pdf",
                                "data": "JVBERi0=",
                            },
                        },
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "s"},
                        {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"c": "ls"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "a.py"}],
                        }
                    ],
                },
            ],
            "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "auto"},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "metadata": {"user_id": "u"},
            "stream": True,
            "temperature": 1,
        },
    ),
    # OpenRouter's own sampling and usage accounting
    (
        "chat.completions",
        "openrouter",
        {
            "model": "openai/gpt-4o-mini",
            "messages": MSGS,
            "top_k": 40,
            "usage": {"include": True},
            "reasoning": {"effort": "low"},
        },
    ),
]


@pytest.mark.parametrize(("api", "provider", "body"), CLIENT_BODIES)
def test_what_real_clients_send_passes(api: str, provider: str, body: dict[str, Any]) -> None:
    found = check_body(api, provider, body)
    assert found.tools == ("tools" in body)
    check_headers(
        api,
        {
            "anthropic-version": "2023-06-01",
            "anthropic-beta": (
                "interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14"
            ),
        }.get,
    )


def test_media_parts_are_counted_for_the_hold() -> None:
    body = CLIENT_BODIES[2][2]
    assert check_body("messages", "anthropic", body).media == 2


def test_deep_nesting_is_refused_not_a_crash() -> None:
    block: dict[str, Any] = {"type": "text", "text": "x"}
    for _ in range(400):
        block = {"type": "tool_result", "tool_use_id": "t", "content": [block]}
    with pytest.raises(Refused):
        check_body("messages", "anthropic", {"messages": [{"role": "user", "content": [block]}]})


# -- the reproduction, inside real sandboxes -------------------------------------------------------
def _chat(**extra: Any) -> tuple[str, dict[str, Any]]:
    return "/chat/completions", {"model": "gpt-6-luna", "messages": MSGS, **extra}


def _routed(**extra: Any) -> tuple[str, dict[str, Any]]:
    return "/chat/completions", {"model": "openai/gpt-4o-mini", "messages": MSGS, **extra}


def _responses(**extra: Any) -> tuple[str, dict[str, Any]]:
    return "/responses", {"model": "gpt-6-luna", "input": "hi", **extra}


def _messages(content: Any = "hi", **extra: Any) -> tuple[str, dict[str, Any]]:
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }
    return "/v1/messages", body


# (name, (path, body), extra headers, the field the refusal names, the provider's shape)
REPRODUCTION: list[tuple[str, tuple[str, dict[str, Any]], str, str, str]] = [
    ("n 128", _chat(n=128), "", "n", "openai"),
    ("priority tier", _chat(service_tier="priority"), "", "service_tier", "openai"),
    (
        "priority tier (responses)",
        _responses(service_tier="priority"),
        "",
        "service_tier",
        "openai",
    ),
    (
        "http image_url",
        _chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "describe"},
                        {"type": "image_url", "image_url": {"url": URL}},
                    ],
                }
            ]
        ),
        "",
        "messages[0].content[1].image_url.url",
        "openai",
    ),
    ("web_search_options", _chat(web_search_options={}), "", "web_search_options", "openai"),
    ("an unknown field", _chat(frobnicate=True), "", "frobnicate", "openai"),
    ("web search tool", _responses(tools=[{"type": "web_search"}]), "", "tools[0].type", "openai"),
    (
        "code interpreter",
        _responses(tools=[{"type": "code_interpreter", "container": {"type": "auto"}}]),
        "",
        "tools[0].type",
        "openai",
    ),
    (
        "image generation",
        _responses(tools=[{"type": "function", "name": "f"}, {"type": "image_generation"}]),
        "",
        "tools[1].type",
        "openai",
    ),
    (
        "MCP tool",
        _responses(tools=[{"type": "mcp", "server_label": "x", "server_url": URL}]),
        "",
        "tools[0].type",
        "openai",
    ),
    (
        "http input_image",
        _responses(
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": URL}]}]
        ),
        "",
        "input[0].content[0].image_url",
        "openai",
    ),
    (
        "stored state",
        _responses(previous_response_id="resp_other_tenant"),
        "",
        "previous_response_id",
        "openai",
    ),
    (
        "url document",
        _messages([{"type": "document", "source": {"type": "url", "url": URL}}]),
        "",
        "messages[0].content[0].source.type",
        "anthropic",
    ),
    (
        "url image",
        _messages([{"type": "image", "source": {"type": "url", "url": URL}}]),
        "",
        "messages[0].content[0].source.type",
        "anthropic",
    ),
    (
        "mcp_servers",
        _messages(mcp_servers=[{"type": "url", "url": URL, "name": "x"}]),
        "",
        "mcp_servers",
        "anthropic",
    ),
    (
        "web_fetch tool",
        _messages(tools=[{"type": "web_fetch_20250910", "name": "web_fetch"}]),
        "",
        "tools[0].type",
        "anthropic",
    ),
    (
        "web_search tool",
        _messages(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        "",
        "tools[0].type",
        "anthropic",
    ),
    (
        "anthropic-beta",
        _messages(),
        "-H 'anthropic-beta: mcp-client-2025-04-04'",
        "anthropic-beta",
        "anthropic",
    ),
    ("OpenRouter fallbacks", _routed(models=["openai/gpt-4o"]), "", "models", "openrouter"),
    ("OpenRouter route", _routed(route="fallback"), "", "route", "openrouter"),
    (
        "OpenRouter provider routing",
        _routed(provider={"order": ["x"]}),
        "",
        "provider",
        "openrouter",
    ),
    ("OpenRouter plugins", _routed(plugins=[{"id": "web"}]), "", "plugins", "openrouter"),
]


def _curl(path: str, body: dict[str, Any], headers: str) -> str:
    base = "$ANTHROPIC_BASE_URL" if path.startswith("/v1/") else "$OPENAI_BASE_URL"
    payload = json.dumps(body).replace("'", "'\\''")
    auth = "-H 'anthropic-version: 2023-06-01' -H \"x-api-key: $ANTHROPIC_API_KEY\""
    if base == "$OPENAI_BASE_URL":
        auth = '-H "Authorization: Bearer $OPENAI_API_KEY"'
    return (
        f"curl -sS -m 20 -w '\\ncode=%{{http_code}}' -H 'Content-Type: application/json' "
        f"{auth} {headers} -d '{payload}' \"{base}{path}\""
    )


def _assert_shape(error: dict[str, Any], shape: str, field: str) -> None:
    if shape == "anthropic":  # {"type": "error", "error": {"type", "message"}}
        assert error["type"] == "error", error
        assert error["error"]["type"] == "invalid_request_error", error
        assert error["error"]["message"].startswith(f"{field}: "), error
    elif shape == "openrouter":  # {"error": {"code": 400, "message"}}
        assert error["error"]["code"] == 400, error
        assert error["error"]["message"].startswith(f"{field}: "), error
    else:  # {"error": {"message", "type", "param", "code"}}
        assert error["error"]["type"] == "invalid_request_error", error
        assert error["error"]["param"] == field, error
        assert error["error"]["code"] in ("unknown_parameter", "unsupported_value"), error
        assert error["error"]["message"].startswith(f"{field}: "), error


@pytest.mark.sandbox
async def test_the_reproduction_is_refused_before_anything_reaches_the_upstream(
    runtime: Runtime,
    openai_server: FakeOpenAIServer,
    anthropic_server: FakeAnthropicServer,
    isolation: str,
) -> None:
    async with provisioned(
        runtime, isolation, models=[GPT, CLAUDE, ROUTED], max_cost_micros=200_000
    ) as agent:
        for name, (path, body), headers, field, shape in REPRODUCTION:
            res = await sh(agent, _curl(path, body, headers))
            out, _, code = res.stdout.rpartition("\ncode=")
            assert code == "400", (name, res.stdout, res.stderr)
            _assert_shape(json.loads(out), shape, field)
    # nothing went upstream, nothing was charged, every refusal is on the timeline
    assert openai_server.requests == [] and anthropic_server.requests == []
    denied = [e.data for e in await events_of(agent, "model.denied")]
    assert [d["field"] for d in denied] == [case[3] for case in REPRODUCTION]
    assert all(d["reason"].startswith(f"{d['field']}: ") for d in denied)
    assert await events_of(agent, "model.called") == []
    row = await runtime.store.runs.get(agent.run_id)
    assert row.breakdown["model_micros"] == 0


@pytest.mark.sandbox
async def test_an_allowed_call_still_goes_through_with_only_allowed_fields(
    runtime: Runtime, openai_server: FakeOpenAIServer, isolation: str
) -> None:
    openai_server.push(FakeReply(body=openai_chat_response(content="ok", completion_tokens=2)))
    body = {
        "model": "gpt-6-luna",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what"},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                ],
            }
        ],
        "n": 1,
        "service_tier": "default",
        "max_tokens": 10,
    }
    async with provisioned(runtime, isolation, models=[GPT]) as agent:
        res = await sh(agent, _curl("/chat/completions", body, ""))
        assert res.stdout.endswith("code=200"), res.stdout
    (sent,) = openai_server.requests
    assert set(sent.json()) == {"model", "messages", "n", "service_tier", "max_tokens"}
    (called,) = [e.data for e in await events_of(agent, "model.called")]
    # the image is held for beyond its bytes: MEDIA_TOKENS at the input price
    assert called["reserved_micros"] >= runtime.price_book.worst_case(GPT, 2_500, 10)


# -- a provider that reports more than was held ----------------------------------------------------
def _twenty_five_times(req: CapturedRequest) -> FakeReply:
    """25x what the gateway held: its input estimate and the max tokens it sent."""
    body = req.json()
    held_in, held_out = len(req.body) // 3 + 16, body["max_tokens"]
    return FakeReply(
        body=openai_chat_response(
            content="I did 25 times the work",
            prompt_tokens=25 * held_in,
            completion_tokens=25 * held_out,
        )
    )


@pytest.mark.sandbox
@pytest.mark.parametrize(
    ("model", "max_cost", "beyond"),
    [(GPT, 200_000, False), (PRICEY, 200_000, True)],
    ids=["within-the-reservation", "past-the-reservation"],
)
async def test_a_provider_reporting_25x_the_hold_is_charged_alarmed_and_ends_the_run(
    runtime: Runtime,
    openai_server: FakeOpenAIServer,
    isolation: str,
    model: str,
    max_cost: int,
    beyond: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    openai_server.push(_twenty_five_times)
    call = json.dumps(
        {"model": model.partition("/")[2], "max_tokens": 1000, "messages": MSGS}
    ).replace("'", "'\\''")
    command = (
        f"curl -sS -m 20 -H 'Content-Type: application/json' -d '{call}' "
        '"$OPENAI_BASE_URL/chat/completions" > /tmp/answer.md; sleep 100'
    )
    request = RunRequest.model_validate(
        {
            "prompt": "call the model once",
            "model": model,
            "isolation": isolation,
            "agent": {"command": command, "output": "/tmp/answer.md"},
            "timeout_seconds": 120,
            "max_cost_micros": max_cost,
        }
    )
    row, events = await run_to_end(runtime, request)
    assert row.status == "budget_exhausted", row.termination_detail
    assert row.termination_detail == "a model call cost more than was held for it (budget.overrun)"
    assert_settled(row, events)
    (overrun,) = [e.data for e in events if e.type == "budget.overrun"]
    (called,) = [e.data for e in events if e.type == "model.called"]
    reported = runtime.price_book.model_cost(
        model, Usage(input_tokens=called["input_tokens"], output_tokens=called["output_tokens"])
    )
    assert overrun["model"] == model and overrun["reported_micros"] == reported
    assert overrun["held_micros"] == called["reserved_micros"]
    assert reported >= 20 * overrun["held_micros"]  # 25x, less the forwarded body's extra bytes
    assert called["cost_micros"] == overrun["charged_micros"] == row.breakdown["model_micros"]
    assert overrun["charged_micros"] + overrun["unbilled_micros"] == reported
    if beyond:  # the real cost passes the reservation: the run is charged all of it, no more
        assert reported > max_cost
        assert row.charged_micros == row.reserved_micros == max_cost
        assert overrun["charged_micros"] == max_cost and overrun["unbilled_micros"] > 0
        assert row.breakdown["compute_micros"] == 0
    else:  # the real cost, not the hold
        assert overrun["charged_micros"] == reported and overrun["unbilled_micros"] == 0
    assert types(events).index("budget.overrun") < types(events).index("run.budget_exhausted")
    exited = next(e.data for e in events if e.type == "agent.exited")
    assert exited["killed"] == row.termination_detail
    assert "ALARM" in caplog.text and str(reported) in caplog.text
    # the CLI's timeline and the run page say it
    label, line = describe(next(e for e in events if e.type == "budget.overrun"))
    assert label == "Budget" and line.startswith("OVERRUN") and usd(reported) in line
