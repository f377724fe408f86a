"""Replay: the shipped sample cassette, playback order, recording a cassette from a run."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ephemeral.errors import InvalidRequest, ModelError, UnknownModel
from ephemeral.money.pricing import PriceBook
from ephemeral.providers.anthropic import AnthropicProvider
from ephemeral.providers.base import Message, ModelReply, Provider, ToolSpec
from ephemeral.providers.openai import OpenAIProvider
from ephemeral.providers.replay import (
    ReplayProvider,
    cassette_from_transcript,
    cassette_path,
    load_cassette,
    save_cassette,
)
from ephemeral.settings import REPO_ROOT, Settings
from ephemeral.testing.providers import FakeAnthropicServer, FakeOpenAIServer
from tests.sample import SAMPLE_PROMPT

from .conftest import SHELL

SAMPLE = REPO_ROOT / "recipes" / "cassettes" / "sandbox-proof.json"
PRIMES = "2 3 5 7 11 13 17 19 23 29 31 37 41 43 47"


async def _play(
    provider: Provider, tools: list[ToolSpec], prompt: str = SAMPLE_PROMPT
) -> list[ModelReply]:
    """Drive a conversation the way the agent loop does, answering every tool call."""
    messages = [
        Message(role="system", content="You are an agent in a sandbox."),
        Message(role="user", content=prompt),
    ]
    replies = []
    while True:
        reply = await provider.complete(
            model="gpt-6-luna", messages=messages, tools=tools, max_tokens=4096, timeout=10
        )
        replies.append(reply)
        messages.append(reply.message)
        if not reply.message.tool_calls:
            return replies
        for call in reply.message.tool_calls:
            messages.append(Message(role="tool", tool_call_id=call.id, content="(output)"))


async def test_sample_cassette_reproduces_the_product_page() -> None:
    replies = await _play(ReplayProvider.from_file(SAMPLE), [SHELL])

    assert len(replies) == 3  # "3 model calls"
    commands = [c.arguments["command"] for r in replies for c in r.message.tool_calls]
    assert commands[0] == "pwd; whoami"
    assert commands[1] == "command -v curl && curl -sS -m 8 https://example.com"
    assert commands[2].startswith(
        "printf '%s\\n' '#!/usr/bin/env python3' 'primes = []' 'n = 2' 'while len(primes) < 15:'"
    )
    assert commands[3] == "printf 'sandbox proof\\n' > /tmp/proof.txt && ls -l /tmp/proof.txt"
    assert all(c.name == "shell" for r in replies for c in r.message.tool_calls)
    assert [r.stop_reason for r in replies] == ["tool_use", "tool_use", "end"]

    answer = replies[-1].message.content or ""
    assert len(answer.split()) <= 120
    assert PRIMES in answer
    assert "curl: (6) Could not resolve host: example.com" in answer
    assert "/tmp/proof.txt" in answer
    assert answer.strip().splitlines()[-1].startswith("The network call did not succeed")

    assert sum(r.usage.input_tokens for r in replies) == 4800
    assert sum(r.usage.output_tokens for r in replies) == 414  # 5,214 tokens on the page
    book = PriceBook.load(Settings.load())
    costs = [book.model_cost("replay/sandbox-proof", r.usage) for r in replies]
    assert sum(costs) == 330  # model $0.00033


def test_sample_primes_script_is_real(tmp_path: Path) -> None:
    """The recorded script prints the primes the page shows when a shell runs it."""
    if shutil.which("python3") is None:
        pytest.skip("python3 is not on PATH")
    cassette = load_cassette(SAMPLE)
    command = cassette.turns[1].message.tool_calls[0].arguments["command"]
    done = subprocess.run(
        ["/bin/sh", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == PRIMES


async def test_turn_is_chosen_by_the_conversation_so_a_retry_gets_the_same_turn() -> None:
    provider = ReplayProvider.from_file(SAMPLE)
    start = [Message(role="user", content=SAMPLE_PROMPT)]
    a = await provider.complete(model="x", messages=start, tools=[SHELL], max_tokens=999, timeout=1)
    b = await ReplayProvider.from_file(SAMPLE).complete(
        model="x", messages=start, tools=[SHELL], max_tokens=999, timeout=1
    )
    assert a == b
    a.message.tool_calls.clear()  # the loop mutating a reply must not change the cassette
    again = await provider.complete(
        model="x", messages=start, tools=[SHELL], max_tokens=999, timeout=1
    )
    assert len(again.message.tool_calls) == 2


async def test_a_replay_answers_only_the_prompt_it_recorded() -> None:
    """Asked anything else, the sample's cassette refuses, naming both prompts; it never plays
    the primes transcript for `uname -a`."""
    provider = ReplayProvider.from_file(SAMPLE)
    with pytest.raises(ModelError) as caught:
        await _play(provider, [SHELL], prompt="Run uname -a and report it.")
    assert "replay/sandbox-proof answers only the prompt it recorded" in caught.value.detail
    assert "'Run uname -a and report it.'" in caught.value.detail
    assert "'This is a sandbox test. Do these steps" in caught.value.detail
    # The same prompt with its lines folded differently (a YAML `|` block) is the same prompt.
    wrapped = SAMPLE_PROMPT.replace(" 1) ", "\n1) ").replace(" 2) ", "\n  2) ") + "\n"
    assert len(await _play(provider, [SHELL], prompt=wrapped)) == 3


async def test_a_cassette_without_a_prompt_answers_none_unless_written_for_any(
    tmp_path: Path,
) -> None:
    doc = json.loads(SAMPLE.read_text())
    del doc["prompt"]
    (tmp_path / "bare.json").write_text(json.dumps(doc))
    with pytest.raises(ModelError, match=r'records no prompt, so it answers none.*"any_prompt"'):
        await _play(ReplayProvider.from_file(tmp_path / "bare.json"), [SHELL])
    (tmp_path / "script.json").write_text(json.dumps({**doc, "any_prompt": True}))
    replies = await _play(ReplayProvider.from_file(tmp_path / "script.json"), [SHELL], "hi")
    assert len(replies) == 3


async def test_a_hand_written_cassette_may_answer_a_few_prompts(tmp_path: Path) -> None:
    doc = json.loads(SAMPLE.read_text())
    (tmp_path / "rows.json").write_text(json.dumps({**doc, "prompt": ["row one", "row two"]}))
    provider = ReplayProvider.from_file(tmp_path / "rows.json")
    assert len(await _play(provider, [SHELL], prompt="row two")) == 3
    with pytest.raises(ModelError, match=r"\('row one' and 1 more\), not this run's"):
        await _play(provider, [SHELL], prompt="row three")


async def test_exhausted_cassette_is_a_model_error() -> None:
    provider = ReplayProvider.from_file(SAMPLE)
    history = [Message(role="user", content=SAMPLE_PROMPT)] + [
        Message(role="assistant", content="x") for _ in range(3)
    ]
    with pytest.raises(ModelError, match="cassette exhausted"):
        await provider.complete(model="x", messages=history, tools=[SHELL], max_tokens=9, timeout=1)


async def test_unoffered_tool_is_still_returned() -> None:
    # shell not granted: the loop, not the cassette, refuses the call
    provider = ReplayProvider.from_file(SAMPLE)
    out = await provider.complete(
        model="x",
        messages=[Message(role="user", content=SAMPLE_PROMPT)],
        tools=[],
        max_tokens=99,
        timeout=1,
    )
    assert [c.name for c in out.message.tool_calls] == ["shell", "shell"]


async def test_output_never_billed_past_max_tokens() -> None:
    provider = ReplayProvider.from_file(SAMPLE)
    out = await provider.complete(
        model="x",
        messages=[Message(role="user", content=SAMPLE_PROMPT)],
        tools=[SHELL],
        max_tokens=10,
        timeout=1,
    )
    assert out.usage.output_tokens == 10
    assert out.stop_reason == "max_tokens"


async def test_record_then_replay_round_trip(tmp_path: Path) -> None:
    transcript: list[dict[str, Any]] = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "prompt"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "name": "shell", "arguments": {"command": "date"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Sun Nov 29"},
        {"role": "assistant", "content": "It is Sunday.", "tool_calls": []},
    ]
    usages = [
        {"input_tokens": 100, "output_tokens": 10, "cached_input_tokens": 0},
        {"input_tokens": 130, "output_tokens": 8, "cached_input_tokens": 64},
    ]
    doc = cassette_from_transcript("anthropic/claude-haiku-4-5", transcript, usages, [300, 250])
    assert doc["version"] == 1 and doc["model"] == "anthropic/claude-haiku-4-5"
    assert doc["recorded_at"].endswith("Z")
    assert "Sun Nov 29" not in json.dumps(doc)  # tool output is not kept; replay reruns tools
    path = save_cassette(tmp_path, "mine", doc)
    assert path == tmp_path / "mine.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.json"]

    assert doc["prompt"] == "prompt"  # the turns answer this prompt, and only it
    replies = await _play(ReplayProvider.from_file(path), [SHELL], prompt="prompt")
    assert [r.message.content for r in replies] == [None, "It is Sunday."]
    assert replies[0].message.tool_calls[0].arguments == {"command": "date"}
    assert replies[1].usage.cached_input_tokens == 64
    assert [r.latency_ms for r in replies] == [300, 250]

    book = PriceBook.load(Settings.load(cassettes_dir=tmp_path))
    assert book.model_price("replay/mine") == book.model_price("anthropic/claude-haiku-4-5")


def test_transcript_errors_name_the_field() -> None:
    msgs = [{"role": "assistant", "content": "hi"}]
    with pytest.raises(InvalidRequest) as info:
        cassette_from_transcript("openai/gpt-4o", msgs, [], [1])
    assert info.value.errors == [
        {"field": "usages", "message": "0 usages for 1 assistant messages"}
    ]
    with pytest.raises(InvalidRequest) as info:
        cassette_from_transcript("openai/gpt-4o", msgs, [{}], [])
    assert info.value.errors and info.value.errors[0]["field"] == "latencies"
    with pytest.raises(InvalidRequest) as info:
        cassette_from_transcript("replay/sandbox-proof", msgs, [{}], [1])
    assert info.value.errors and info.value.errors[0]["field"] == "model"
    with pytest.raises(InvalidRequest) as info:
        cassette_from_transcript("openai/gpt-4o", [{"role": "robot"}], [], [])
    assert info.value.errors and info.value.errors[0]["field"] == "messages"


@pytest.mark.parametrize("name", ["../etc/passwd", "a/b", "", ".hidden", "x" * 101])
def test_cassette_names_cannot_leave_the_directory(tmp_path: Path, name: str) -> None:
    with pytest.raises(UnknownModel) as info:
        cassette_path(tmp_path, name)
    assert info.value.errors and info.value.errors[0]["field"] == "model"


def test_missing_or_invalid_cassette_is_an_unknown_model(tmp_path: Path) -> None:
    with pytest.raises(UnknownModel, match="no cassette"):
        load_cassette(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {
                "version": 1,
                "model": "openai/x",
                "recorded_at": "t",
                "turns": [{"message": {"role": "user"}, "usage": {}}],
            }
        )
    )
    with pytest.raises(UnknownModel, match=r"turns\.0\.message"):
        load_cassette(bad)
    loop = tmp_path / "loop.json"
    loop.write_text(
        json.dumps({"version": 1, "model": "replay/loop", "recorded_at": "t", "turns": []})
    )
    with pytest.raises(UnknownModel, match="model"):
        load_cassette(loop)


@pytest.mark.parametrize("flavour", ["openai", "anthropic"])
async def test_fake_servers_serve_a_cassette_like_replay_does(flavour: str) -> None:
    """The HTTP paths and the replay path give the loop the same replies."""
    replayed = await _play(ReplayProvider.from_file(SAMPLE), [SHELL])
    provider: OpenAIProvider | AnthropicProvider
    if flavour == "openai":
        with FakeOpenAIServer.from_cassette(SAMPLE) as server:
            provider = OpenAIProvider(base_url=server.base_url, api_key=None)
            served = await _play(provider, [SHELL])
    else:
        with FakeAnthropicServer.from_cassette(SAMPLE) as server:
            provider = AnthropicProvider(base_url=server.base_url, api_key=None)
            served = await _play(provider, [SHELL])
    assert [r.message for r in served] == [r.message for r in replayed]
    assert [r.usage for r in served] == [r.usage for r in replayed]
    assert [r.stop_reason for r in served] == [r.stop_reason for r in replayed]
