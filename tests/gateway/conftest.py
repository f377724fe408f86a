"""Gateway fixtures: the local model servers (real HTTP on 127.0.0.1, the providers' real wire
formats) behind a runtime whose settings point the providers at them, with canary keys."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from ephemeral.engine.runtime import Runtime
from ephemeral.settings import Settings
from ephemeral.testing.providers import FakeAnthropicServer, FakeOpenAIServer
from tests import runlevel
from tests.egress.conftest import isolation  # noqa: F401  (a fixture)
from tests.run.conftest import make_cassette  # noqa: F401  (a fixture)

OPENAI_KEY = "sk-canary-openai-7d41f09b2c6e4a58"
ANTHROPIC_KEY = "sk-ant-canary-anthropic-3b9e1c5d7f20"
OPENROUTER_KEY = "sk-or-canary-openrouter-51c0e7"


@pytest.fixture
def openai_server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(api_key=OPENAI_KEY) as server:
        yield server


@pytest.fixture
def anthropic_server() -> Iterator[FakeAnthropicServer]:
    with FakeAnthropicServer(api_key=ANTHROPIC_KEY) as server:
        yield server


@pytest.fixture
def broker_settings(
    tmp_path: Path,
    cassettes: Path,
    openai_server: FakeOpenAIServer,
    anthropic_server: FakeAnthropicServer,
) -> Settings:
    return Settings.load(
        state_dir=tmp_path / "state",
        cassettes_dir=cassettes,
        executor="plain",
        openai_base_url=openai_server.base_url,
        openai_api_key=OPENAI_KEY,
        anthropic_base_url=anthropic_server.base_url,
        anthropic_api_key=ANTHROPIC_KEY,
        # OpenRouter speaks the OpenAI wire format: the same local server answers for it
        openrouter_base_url=openai_server.base_url,
        openrouter_api_key=OPENROUTER_KEY,
    )


@pytest.fixture
async def runtime(broker_settings: Settings) -> AsyncIterator[Runtime]:
    async with runlevel.started(broker_settings, check=True) as rt:
        yield rt


from tests.sessions.conftest import http, member  # noqa: E402, F401  (fixtures, over our runtime)
