"""``model`` strings (``provider/name``) to a provider adapter and the provider's model name.

| prefix        | adapter            | endpoint and key (from Settings)                  |
|---------------|--------------------|---------------------------------------------------|
| `openai/`     | Chat Completions   | `openai_base_url` (or vLLM, Ollama, llama.cpp)    |
| `openrouter/` | Chat Completions   | `openrouter_base_url`, `OPENROUTER_API_KEY`       |
| `anthropic/`  | Anthropic Messages | `anthropic_base_url`, `ANTHROPIC_API_KEY`         |
| `replay/`     | cassette playback  | `cassettes_dir/<name>.json`                       |

`openai/` uses `OPENAI_API_KEY`, which a local server may not need.
"""

from __future__ import annotations

from typing import Final
from urllib.parse import urlsplit

import httpx
from pydantic import SecretStr

from ephemeral.errors import UnknownModel
from ephemeral.providers.anthropic import AnthropicProvider
from ephemeral.providers.base import Provider
from ephemeral.providers.openai import OpenAIProvider
from ephemeral.providers.replay import PREFIX as REPLAY_PREFIX
from ephemeral.providers.replay import ReplayProvider, cassette_path, load_cassette
from ephemeral.settings import Settings

PROVIDERS: Final = ("openai", "openrouter", "anthropic", "replay")

# The official endpoints need a key; the same prefix pointed at a local server may not.
_OFFICIAL_HOSTS: Final = {"api.openai.com", "openrouter.ai", "api.anthropic.com"}


def _unknown(message: str) -> UnknownModel:
    return UnknownModel(f"model: {message}", errors=[{"field": "model", "message": message}])


def _secret(value: SecretStr | None) -> str | None:
    return value.get_secret_value() if value is not None else None


def _require_key(prefix: str, base_url: str, key: str | None, env: str) -> None:
    host = urlsplit(base_url).hostname or ""
    if key is None and host in _OFFICIAL_HOSTS:
        raise _unknown(f"provider {prefix!r} is not configured on this server ({env} is not set)")


def provider_for(
    model: str, settings: Settings, *, transport: httpx.AsyncBaseTransport | None = None
) -> tuple[Provider, str]:
    """The adapter for ``model`` and the name to send to it: ``openai/gpt-x`` ->
    (OpenAIProvider, ``gpt-x``). An unknown prefix or a missing name is refused naming ``model``."""
    prefix, sep, name = model.partition("/")
    if not sep or not name:
        raise _unknown(
            f"{model!r} is not of the form provider/name (providers: {', '.join(PROVIDERS)})"
        )
    if prefix == "openai":
        key = _secret(settings.openai_api_key)
        _require_key(prefix, settings.openai_base_url, key, "OPENAI_API_KEY")
        return OpenAIProvider(
            base_url=settings.openai_base_url, api_key=key, name="openai", transport=transport
        ), name
    if prefix == "openrouter":
        key = _secret(settings.openrouter_api_key)
        _require_key(prefix, settings.openrouter_base_url, key, "OPENROUTER_API_KEY")
        return OpenAIProvider(
            base_url=settings.openrouter_base_url,
            api_key=key,
            name="openrouter",
            transport=transport,
            extra_headers={"x-title": "Ephemeral"},
            # Ask for usage.cost explicitly; newer OpenRouter sends it regardless.
            extra_body={"usage": {"include": True}},
        ), name
    if prefix == "anthropic":
        key = _secret(settings.anthropic_api_key)
        _require_key(prefix, settings.anthropic_base_url, key, "ANTHROPIC_API_KEY")
        return AnthropicProvider(
            base_url=settings.anthropic_base_url, api_key=key, transport=transport
        ), name
    if prefix + "/" == REPLAY_PREFIX:
        path = cassette_path(settings.cassettes_dir, name)
        return ReplayProvider(load_cassette(path), name=name), name
    raise _unknown(f"unknown provider {prefix!r} (providers: {', '.join(PROVIDERS)})")
