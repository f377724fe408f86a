"""``model`` strings to adapters; refusals name the field ``model``."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from ephemeral.errors import UnknownModel
from ephemeral.providers.anthropic import AnthropicProvider
from ephemeral.providers.openai import OpenAIProvider
from ephemeral.providers.registry import provider_for
from ephemeral.providers.replay import ReplayProvider
from ephemeral.settings import REPO_ROOT, Settings
from ephemeral.testing.providers import openai_chat_response

from .conftest import KEY, conversation


def _settings(tmp_path: Path, **kw: object) -> Settings:
    # Explicit None keys so a developer's own OPENAI_API_KEY cannot change the outcome.
    base: dict[str, object] = {
        "state_dir": tmp_path,
        "cassettes_dir": REPO_ROOT / "recipes" / "cassettes",
        "OPENAI_API_KEY": KEY,
        "OPENROUTER_API_KEY": KEY,
        "ANTHROPIC_API_KEY": KEY,
    }
    return Settings.load(**(base | kw))


@pytest.mark.parametrize(
    ("model", "cls", "name"),
    [
        ("openai/gpt-6-luna", OpenAIProvider, "gpt-6-luna"),
        (
            "openrouter/meta-llama/llama-3.1-8b-instruct",
            OpenAIProvider,
            "meta-llama/llama-3.1-8b-instruct",
        ),
        ("anthropic/claude-haiku-4-5", AnthropicProvider, "claude-haiku-4-5"),
        ("replay/sandbox-proof", ReplayProvider, "sandbox-proof"),
    ],
)
def test_prefix_picks_the_adapter(tmp_path: Path, model: str, cls: type, name: str) -> None:
    provider, provider_model = provider_for(model, _settings(tmp_path))
    assert isinstance(provider, cls)
    assert provider_model == name
    assert KEY not in repr(provider)


@pytest.mark.parametrize(
    "model", ["gpt-4o", "openai/", "/gpt-4o", "vertex/gemini", "", "replay/../../etc/passwd"]
)
def test_bad_model_is_refused_naming_the_field(tmp_path: Path, model: str) -> None:
    with pytest.raises(UnknownModel) as info:
        provider_for(model, _settings(tmp_path))
    assert info.value.errors and info.value.errors[0]["field"] == "model"


def test_missing_cassette_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnknownModel, match="no cassette"):
        provider_for("replay/never-recorded", _settings(tmp_path))


@pytest.mark.parametrize(
    ("model", "env"),
    [
        ("openai/gpt-4o", "OPENAI_API_KEY"),
        ("openrouter/openai/gpt-4o-mini", "OPENROUTER_API_KEY"),
        ("anthropic/claude-haiku-4-5", "ANTHROPIC_API_KEY"),
    ],
)
def test_official_endpoint_without_a_key_is_refused(tmp_path: Path, model: str, env: str) -> None:
    with pytest.raises(UnknownModel, match=env) as info:
        provider_for(model, _settings(tmp_path, **{env: None}))
    assert info.value.errors and info.value.errors[0]["field"] == "model"


async def test_local_openai_compatible_server_needs_no_key(tmp_path: Path) -> None:
    """vLLM/Ollama/llama.cpp: `openai/` pointed at a local base URL, no key; the transport
    seam lets a test (or an embedding app) serve it in process."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=openai_chat_response(content="local ok"))

    transport = httpx.MockTransport(handler)
    settings = _settings(tmp_path, OPENAI_API_KEY=None, openai_base_url="http://127.0.0.1:11434/v1")
    provider, name = provider_for("openai/qwen2.5-coder", settings, transport=transport)
    for _ in range(2):  # the transport is borrowed, not closed after the first call
        out = await provider.complete(
            model=name, messages=conversation()[:2], tools=[], max_tokens=16, timeout=5
        )
        assert out.message.content == "local ok"
    assert [str(r.url) for r in seen] == ["http://127.0.0.1:11434/v1/chat/completions"] * 2
    assert "authorization" not in seen[0].headers
