"""The events of a run (DESIGN §4): the timeline every view of a run is folded from."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

# A setup or verify command's result (verify adds ``skipped``).
_COMMAND_FIELDS = (
    "command",
    "exit_code",
    "stdout",
    "stderr",
    "duration_ms",
    "timed_out",
    "truncated",
)

# type -> the keys its data carries. Docs and tests are checked against this table.
EVENT_TYPES: dict[str, tuple[str, ...]] = {
    "run.queued": ("reserved_micros",),
    "run.claimed": ("host",),
    "sandbox.ready": ("isolation", "image", "boot_ms", "runtime", "image_hash"),
    "worker.started": ("shell", "web", "connections", "files"),
    "model.called": ("model", "input_tokens", "output_tokens", "cost_micros", "latency_ms"),
    "model.denied": ("model", "api", "reason"),
    "shell.executed": ("command", "exit_code", "stdout", "stderr", "duration_ms", "truncated"),
    "web.requested": ("method", "url", "status", "cost_micros"),
    "web.denied": ("method", "url", "reason", "cost_micros"),
    "connection.requested": ("name", "method", "path", "status"),
    "connection.denied": ("name", "method", "path", "reason"),
    "setup.executed": _COMMAND_FIELDS,
    "verify.executed": (*_COMMAND_FIELDS, "skipped"),
    "budget.warning": ("spent_micros", "remaining_micros"),
    # A provider reported more usage than the gateway held for the call: an alarm.
    "budget.overrun": (
        "model",
        "held_micros",
        "reported_micros",
        "charged_micros",
        "unbilled_micros",
    ),
    "sandbox.exec": (
        "command",
        "user",
        "exit_code",
        "stdout",
        "stderr",
        "duration_ms",
        "truncated",
        "timed_out",
    ),
    # An agent run's program (ephemeral.agent.command): its start and its end.
    "agent.started": ("command", "image", "models", "prompt_file"),
    "agent.exited": (
        "exit_code",
        "duration_ms",
        "stderr",
        "stdout_bytes",
        "truncated",
        "timed_out",
    ),
    "sandbox.destroyed": ("lifetime_ms",),
    "run.succeeded": ("model_calls", "tokens", "reason"),
    "run.failed": ("model_calls", "tokens", "reason"),
    "run.timed_out": ("model_calls", "tokens", "reason"),
    "run.cancelled": ("model_calls", "tokens", "reason"),
    "run.budget_exhausted": ("model_calls", "tokens", "reason"),
    "run.output": ("markdown",),
    "run.settled": ("charged_micros", "refunded_micros", "breakdown"),
}

TERMINAL_EVENT_FOR_STATUS = {
    "succeeded": "run.succeeded",
    "failed": "run.failed",
    "timed_out": "run.timed_out",
    "cancelled": "run.cancelled",
    "budget_exhausted": "run.budget_exhausted",
}

# Keys whose values are content: dropped from stored events under zero_data_retention.
CONTENT_KEYS = frozenset(
    {"command", "stdout", "stderr", "url", "path", "markdown", "files", "host"}
)


# The largest event seq a store holds: run_events.seq is an INTEGER (32 bits on PostgreSQL).
# A query past it (`after`, `Last-Event-ID`) is a 422 naming the field, never a store error.
MAX_SEQ = (1 << 31) - 1


class Event(BaseModel):
    model_config = ConfigDict(frozen=True)

    seq: int
    run_id: str
    type: str
    at: str  # RFC 3339 with milliseconds
    data: dict[str, Any]


def redact_for_zdr(data: dict[str, Any]) -> dict[str, Any]:
    """Keep types, times, sizes and money; replace content by its size."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in CONTENT_KEYS:
            if isinstance(value, str):
                out[f"{key}_bytes"] = len(value.encode())
            elif isinstance(value, list):
                out[f"{key}_count"] = len(value)
        else:
            out[key] = value
    return out
