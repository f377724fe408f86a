"""Fixtures for whole runs: a runtime on a fresh state dir, cassettes written by the test."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from ephemeral.engine.runtime import Runtime
from ephemeral.settings import Settings
from tests import runlevel


def turn(*commands: str, final: str | None = None, tokens: tuple[int, int] = (1000, 50)) -> dict:
    """One recorded model turn: shell tool calls, or a final Markdown answer."""
    message: dict[str, Any] = {"role": "assistant", "content": final, "tool_calls": []}
    for i, cmd in enumerate(commands):
        message["tool_calls"].append(
            {"id": f"call_{i}", "name": "shell", "arguments": {"command": cmd}}
        )
    return {
        "message": message,
        "usage": {"input_tokens": tokens[0], "output_tokens": tokens[1], "cached_input_tokens": 0},
        "latency_ms": 5,
    }


@pytest.fixture
def make_cassette(cassettes: Path) -> Callable[..., str]:
    def make(name: str, turns: list[dict], model: str = "openai/gpt-6-luna") -> str:
        (cassettes / f"{name}.json").write_text(
            json.dumps(
                {
                    "version": 1,
                    "model": model,
                    "recorded_at": "2026-11-29T00:00:00Z",
                    "any_prompt": True,  # a script written by hand, for any prompt
                    "turns": turns,
                }
            )
        )
        return f"replay/{name}"

    return make


@pytest.fixture
def run_settings(tmp_path: Path, cassettes: Path) -> Settings:
    return Settings.load(state_dir=tmp_path / "state", cassettes_dir=cassettes, use_prefect=False)


@pytest.fixture
async def runtime(run_settings: Settings) -> AsyncIterator[Runtime]:
    async with runlevel.started(run_settings, check=True) as rt:
        yield rt
