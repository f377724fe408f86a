"""Small builders shared by the recipe tests: files on disk and a realistic run with its events."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from ephemeral.errors import RecipeError
from ephemeral.recipes.recipe import load_recipe


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def recipe_errors(path: Path) -> list[dict[str, Any]]:
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    errors = info.value.errors or []
    assert errors, "a RecipeError must list its problems"
    for err in errors:
        assert set(err) == {"field", "message", "file", "line"}
        assert err["file"] == str(path)
    return errors


def only(errors: list[dict[str, Any]], field: str) -> dict[str, Any]:
    hits = [e for e in errors if e["field"] == field]
    assert len(hits) == 1, f"expected one error for {field!r}, got {errors}"
    return hits[0]


def event(seq: int, type_: str, **data: Any) -> dict[str, Any]:
    return {
        "seq": seq,
        "run_id": RUN_ID,
        "type": type_,
        "at": f"2026-10-07T15:02:{seq:02d}.000Z",
        "data": data,
    }


RUN_ID = "run_de9af30ebaaa50ab76819bb536239c61"

OUTPUT = (
    "- Prime script output: 2 3 5 7 11 13 17 19 23 29 31 37 41 43 47\n"
    "- whoami: worker; pwd: /tmp/ephemeral-run-s2TPIy/scratch\n"
    "- curl error: `curl: (6) Could not resolve host: example.com`\n"
    "- /tmp/proof.txt created\n"
    "- The network call did not succeed."
)


def product_page_run() -> dict[str, Any]:
    """The run object of the product page sample (DESIGN §3)."""
    return {
        "id": RUN_ID,
        "status": "succeeded",
        "created_at": "2026-10-07T15:01:58.120Z",
        "started_at": "2026-10-07T15:01:58.500Z",
        "ended_at": "2026-10-07T15:02:21.750Z",
        "model": "openai/gpt-6-luna",
        "policy": {"web": False, "shell": True},
        "isolation": "gvisor",
        "termination": {"reason": "completed", "detail": None},
        "usage": {"model_calls": 3, "input_tokens": 4800, "output_tokens": 414},
        "cost": {
            "reserved_micros": 40000,
            "charged_micros": 3530,
            "refunded_micros": 36470,
            "breakdown": {"model_micros": 330, "web_micros": 0, "compute_micros": 3200},
        },
        "output": OUTPUT,
    }


def product_page_events() -> list[dict[str, Any]]:
    return [
        event(1, "run.queued", reserved_micros=40000),
        event(2, "sandbox.ready", isolation="gvisor", image="default", boot_ms=310),
        event(3, "worker.started", shell=True, web=False, connections=[], files=[]),
        event(
            4,
            "model.called",
            model="openai/gpt-6-luna",
            input_tokens=1500,
            output_tokens=120,
            cost_micros=100,
            latency_ms=800,
        ),
        event(
            5,
            "shell.executed",
            command="pwd; whoami",
            exit_code=0,
            stdout="/tmp/ephemeral-run-s2TPIy/scratch\nworker\n",
            stderr="",
            duration_ms=12,
            truncated=False,
        ),
        event(
            6,
            "shell.executed",
            command="command -v curl && curl -sS -m 8 https://example.com",
            exit_code=6,
            stdout="/usr/bin/curl\n",
            stderr="curl: (6) Could not resolve host: example.com\n",
            duration_ms=40,
            truncated=False,
        ),
        event(
            7,
            "shell.executed",
            command="printf 'sandbox proof\\n' > /tmp/proof.txt && ls -l /tmp/proof.txt",
            exit_code=0,
            stdout="-rw-r--r-- 1 worker worker 14 Oct  7 15:02 /tmp/proof.txt\n",
            stderr="",
            duration_ms=9,
            truncated=False,
        ),
        event(8, "sandbox.destroyed", lifetime_ms=23000),
        event(9, "run.succeeded", model_calls=3, tokens=5214, reason="completed"),
        event(10, "run.output", markdown=OUTPUT),
        event(
            11,
            "run.settled",
            charged_micros=3530,
            refunded_micros=36470,
            breakdown={"model_micros": 330, "web_micros": 0, "compute_micros": 3200},
        ),
    ]
