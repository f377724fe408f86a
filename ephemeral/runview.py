"""The run object of DESIGN §3, and the fold that rebuilds a run from its event log.

The run object is rendered from the store's run row (the API, the pages and the records read
the row); :func:`fold_events` rebuilds status, usage and money from the events alone, and
tests/run/test_agent_run.py checks that both agree.
"""

from __future__ import annotations

from typing import Any

from ephemeral.events import TERMINAL_EVENT_FOR_STATUS, Event
from ephemeral.ids import rfc3339

_STATUS_FOR_TERMINAL_EVENT = {v: k for k, v in TERMINAL_EVENT_FOR_STATUS.items()}


def timestamp(value: Any) -> str | None:
    """A stored timestamp as RFC 3339; a string is taken as already formatted."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    return rfc3339(value)


def termination_view(row: Any) -> dict[str, Any] | None:
    """``termination`` of a run or session object: why it ended, once it has."""
    if not row.termination_reason:
        return None
    return {"reason": row.termination_reason, "detail": row.termination_detail}


def cost_view(row: Any) -> dict[str, Any]:
    """``cost`` of a run or session object: the reservation, its settlement and the split."""
    breakdown = row.breakdown or {}
    return {
        "reserved_micros": row.reserved_micros,
        "charged_micros": row.charged_micros,
        "refunded_micros": row.refunded_micros,
        "breakdown": {
            key: int(breakdown.get(key, 0))
            for key in ("model_micros", "web_micros", "compute_micros")
        },
    }


def run_object(row: Any, base_url: str | None = None) -> dict[str, Any]:
    """Render a stored run row as the public run object."""
    usage = row.usage or {}
    prefix = (base_url or "").rstrip("/")
    return {
        "id": row.id,
        "status": row.status,
        "created_at": timestamp(row.created_at),
        "started_at": timestamp(row.started_at),
        "ended_at": timestamp(row.ended_at),
        "model": row.model,
        "policy": row.policy,
        "isolation": row.isolation,
        "runtime": row.runtime,
        "image": getattr(row, "image", None),
        "image_hash": getattr(row, "image_hash", None),
        "host": getattr(row, "host", None),
        "termination": termination_view(row),
        "usage": {
            "model_calls": int(usage.get("model_calls", 0)),
            "input_tokens": int(usage.get("input_tokens", 0)),
            "output_tokens": int(usage.get("output_tokens", 0)),
        },
        "cost": cost_view(row),
        "output": row.output,
        "labels": row.labels or {},
        "links": {
            "self": f"{prefix}/v1/runs/{row.id}",
            "events": f"{prefix}/v1/runs/{row.id}/events",
            "page": f"{prefix}/runs/{row.id}",
        },
    }


def fold_events(events: list[Event]) -> dict[str, Any]:
    """Rebuild a run's status, usage and money from its events alone."""
    state: dict[str, Any] = {
        "status": None,
        "reason": None,
        "isolation": None,
        "runtime": None,  # the sandbox runtime's version line (absent from older logs)
        "usage": {"model_calls": 0, "input_tokens": 0, "output_tokens": 0},
        "cost": {
            "reserved_micros": 0,
            "charged_micros": None,
            "refunded_micros": None,
            "breakdown": None,
        },
        "shell_commands": 0,
        "output": None,
        "sandbox_alive": False,
    }
    last_seq = 0
    for ev in events:
        if ev.seq <= last_seq:
            raise ValueError(f"events out of order at seq {ev.seq}")
        last_seq = ev.seq
        d = ev.data
        if ev.type == "run.queued":
            state["status"] = "queued"
            state["cost"]["reserved_micros"] = d["reserved_micros"]
        elif ev.type == "sandbox.ready":
            state["status"] = "running"
            state["isolation"] = d["isolation"]
            state["runtime"] = d.get("runtime")
            state["sandbox_alive"] = True
        elif ev.type == "model.called":
            u = state["usage"]
            u["model_calls"] += 1
            u["input_tokens"] += d["input_tokens"]
            u["output_tokens"] += d["output_tokens"]
        elif ev.type == "shell.executed":
            state["shell_commands"] += 1
        elif ev.type == "sandbox.destroyed":
            state["sandbox_alive"] = False
        elif ev.type in _STATUS_FOR_TERMINAL_EVENT:
            state["status"] = _STATUS_FOR_TERMINAL_EVENT[ev.type]
            state["reason"] = d.get("reason")
        elif ev.type == "run.output":
            state["output"] = d.get("markdown")
        elif ev.type == "run.settled":
            state["cost"].update(
                charged_micros=d["charged_micros"],
                refunded_micros=d["refunded_micros"],
                breakdown=d["breakdown"],
            )
    return state
