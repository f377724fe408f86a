"""Eval fixtures: suites and recipes written by the test next to the shipped ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def write_cassette(directory: Path, name: str, commands: list[str], final: str) -> str:
    """A replay cassette: one turn running ``commands``, then a final answer."""
    calls = [
        {"id": f"call_{i}", "name": "shell", "arguments": {"command": c}}
        for i, c in enumerate(commands)
    ]
    usage = {"input_tokens": 1000, "output_tokens": 50, "cached_input_tokens": 0}
    turns = [
        {
            "message": {"role": "assistant", "content": None, "tool_calls": calls},
            "usage": usage,
            "latency_ms": 5,
        },
        {
            "message": {"role": "assistant", "content": final, "tool_calls": []},
            "usage": usage,
            "latency_ms": 5,
        },
    ]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.json").write_text(
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


def cli(
    state_dir: Path, *args: str, timeout: float = 240, **env: str
) -> subprocess.CompletedProcess:
    """``ephemeral …`` in a subprocess on its own state dir (Prefect stays in that state dir)."""
    full_env = {**os.environ, "EPHEMERAL_STATE_DIR": str(state_dir), **env}
    for key in ("EPHEMERAL_URL", "PREFECT_API_URL", "PREFECT_HOME"):
        full_env.pop(key, None)
    return subprocess.run(
        [sys.executable, "-m", "ephemeral.cli", *args],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def shell_events(state_dir: Path) -> list[dict[str, Any]]:
    """Every recorded ``shell.executed`` event's data, in order, read through ``ephemeral query``
    (the records, as a data team reads them)."""
    shells = cli(
        state_dir,
        "query",
        "SELECT data FROM events WHERE type = 'shell.executed' ORDER BY seq",
        "--format",
        "json",
    )
    assert shells.returncode == 0, shells.stderr
    return [json.loads(r["data"]) for r in json.loads(shells.stdout)]


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"
