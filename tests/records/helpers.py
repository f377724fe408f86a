"""Factories for recorded runs: realistic, valid, and easy to vary one field at a time."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from ephemeral.ids import new_run_id
from ephemeral.records import EventRecord, RunRecord, StepRecord

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
# make_run's check verdicts once content is gone: the reason quoted the output
REMOVED_CHECKS = json.dumps([{"check": "output_contains", "passed": True, "reason": "(removed)"}])


def make_run(
    *,
    days_ago: float = 0,
    steps: int = 2,
    content: str = "hello",
    **overrides: Any,
) -> tuple[RunRecord, list[StepRecord], list[EventRecord]]:
    run_id = overrides.pop("run_id", None) or new_run_id()
    created = overrides.pop("created_at", None) or NOW - timedelta(days=days_ago)
    fields: dict[str, Any] = {
        "run_id": run_id,
        "org_id": "org_a",
        "created_at": created,
        "started_at": created + timedelta(seconds=1),
        "ended_at": created + timedelta(seconds=9),
        "status": "succeeded",
        "termination_reason": None,
        "model": "openai/gpt-6-luna",
        "isolation": "gvisor",
        "recipe": "sandbox-proof",
        "recipe_cell": json.dumps({"n": 1}),
        "repeat_index": 0,
        "suite_run_id": None,
        "zero_data_retention": False,
        "prompt": f"prompt {content}",
        "output": f"output {content}",
        "model_calls": 2,
        "input_tokens": 1200,
        "output_tokens": 300,
        "reserved_micros": 40000,
        "charged_micros": 3530,
        "refunded_micros": 36470,
        "model_micros": 3000,
        "web_micros": 30,
        "compute_micros": 500,
        "duration_ms": 8000,
        "checks": json.dumps(
            [{"check": "output_contains", "passed": True, "reason": f"found {content}"}]
        ),
        "host": "h1",
    }
    fields.update(overrides)
    run = RunRecord(**fields)
    step_records = [
        StepRecord(
            run_id=run_id,
            seq=2 * i + 1,
            kind="shell" if i % 2 else "model",
            at=created + timedelta(seconds=2 + i),
            duration_ms=40,
            command=f"echo {content}",
            exit_code=0,
            stdout=f"{content}\n",
            stderr=f"warn {content}",
            truncated=False,
            model=None,
            input_tokens=None,
            output_tokens=None,
            cost_micros=10 * (i + 1),
        )
        for i in range(steps)
    ]
    events = [
        EventRecord(
            run_id=run_id,
            seq=1,
            type="run.queued",
            at=created,
            data=json.dumps({"reserved_micros": 40000}),
        ),
        EventRecord(
            run_id=run_id,
            seq=2,
            type="shell.executed",
            at=created + timedelta(seconds=3),
            data=json.dumps(
                {
                    "command": f"echo {content}",
                    "stdout": content,
                    "stderr": "",
                    "exit_code": 0,
                    "duration_ms": 4,
                    "truncated": False,
                }
            ),
        ),
        EventRecord(
            run_id=run_id,
            seq=3,
            type="web.requested",
            at=created + timedelta(seconds=4),
            data=json.dumps(
                {
                    "method": "GET",
                    "url": f"https://example.test/{content}",
                    "status": 200,
                    "cost_micros": 30,
                }
            ),
        ),
    ]
    return run, step_records, events
