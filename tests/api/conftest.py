"""Fixtures for the API: a real runtime (SQLite file, real sandboxes) behind the real app,
reached in process through httpx's ASGI transport, and an org with a member key."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from ephemeral.api import create_app
from ephemeral.engine.runtime import Runtime
from ephemeral.settings import Settings
from tests import runlevel

QUICK = "replay/api-quick"


def turn(*commands: str, final: str | None = None, tokens: tuple[int, int] = (1000, 50)) -> dict:
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


def write_cassette(cassettes: Path, name: str, turns: list[dict]) -> str:
    (cassettes / f"{name}.json").write_text(
        json.dumps(
            {
                "version": 1,
                "model": "openai/gpt-6-luna",
                "recorded_at": "2026-11-29T00:00:00Z",
                "any_prompt": True,  # a script written by hand, for any prompt
                "turns": turns,
            }
        )
    )
    return f"replay/{name}"


@pytest.fixture
def api_settings(tmp_path: Path, cassettes: Path) -> Settings:
    write_cassette(
        cassettes,
        "api-quick",
        [
            turn("echo hello; whoami"),
            turn(final="## Done\n\nRan `whoami`. <script>alert(1)</script>"),
        ],
    )
    write_cassette(
        cassettes,
        "api-live",
        [
            turn("echo starting"),
            turn("sleep 2; echo still here"),
            turn(final="**Finished** after a short wait."),
        ],
    )
    write_cassette(
        cassettes,
        "api-slow",
        [
            turn("sleep 30"),
            turn(final="slept"),
        ],
    )
    return Settings.load(
        state_dir=tmp_path / "state",
        cassettes_dir=cassettes,
        use_prefect=False,
        default_model=QUICK,
    )


@dataclass
class Member:
    org_id: str
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@pytest.fixture
async def runtime(api_settings: Settings) -> AsyncIterator[Runtime]:
    async with runlevel.started(api_settings, check=True) as rt:
        yield rt


async def new_member(runtime: Runtime, org: str, usd_micros: int = 10_000_000) -> Member:
    created = await runtime.store.orgs.create(org)
    if usd_micros:
        await runtime.store.orgs.credit(created.id, usd_micros, note="test")
    _, key = await runtime.store.keys.create(created.id, f"me@{org}.test")
    return Member(org_id=created.id, key=key)


@pytest.fixture
async def member(runtime: Runtime) -> Member:
    return await new_member(runtime, "acme")


@pytest.fixture
def app(api_settings: Settings, runtime: Runtime) -> FastAPI:
    return create_app(api_settings, runtime)


@pytest.fixture
async def http(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        yield client


SAMPLE_BODY = {
    "prompt": "Say hello from the sandbox.",
    "web": False,
    "shell": True,
    "timeout_seconds": 60,
    "max_cost_micros": 40_000,
}
