"""Turn a settled run (its row and its event log) into the analysis records.

Steps are derived from the events, not kept separately: the event log already holds every
model call and shell command, so the records cannot disagree with the timeline.
"""

from __future__ import annotations

import json
import socket
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ephemeral import errors
from ephemeral.engine.outcomes import GRADED, outcome_of_labels
from ephemeral.events import Event
from ephemeral.ids import rfc3339, utcnow
from ephemeral.labels import string_labels
from ephemeral.lifecycle import RunKind, kind_of
from ephemeral.providers.replay import PREFIX as REPLAY_PREFIX
from ephemeral.records import EventRecord, RunRecord, StepRecord, write_run
from ephemeral.settings import Settings

if TYPE_CHECKING:
    from ephemeral.store import Store


def _dt(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


VERIFY_KEEP = ("command", "exit_code", "stdout", "stderr", "duration_ms", "timed_out", "skipped")


def _verify_column(events: list[Event], zdr: bool) -> str | None:
    """The run's verify results as JSON text (None when it had no verify step)."""
    found = [
        {k: ev.data.get(k) for k in VERIFY_KEEP if k in ev.data}
        for ev in events
        if ev.type == "verify.executed"
    ]
    if not found:
        return None
    if zdr:  # the events are redacted already; keep the figures only
        found = [
            {k: v for k, v in f.items() if k not in ("command", "stdout", "stderr")} for f in found
        ]
    return json.dumps(found)


def _outcome(row: Any, labels: dict[str, Any]) -> str | None:
    """The run's outcome. A sandbox session (Harbor, Inspect) is graded by its harness, not here:
    it records only what is known on this side (error, cancelled, budget), else nothing."""
    found = outcome_of_labels(row.status, row.termination_reason, labels)
    if kind_of(getattr(row, "kind", None)) == RunKind.SESSION and found in GRADED:
        return None
    return str(found)


def build_records(
    row: Any, events: list[Event], host: str | None = None
) -> tuple[RunRecord, list[StepRecord], list[EventRecord]]:
    policy = row.policy or {}
    zdr = bool(policy.get("zero_data_retention"))
    labels = row.labels or {}
    usage = row.usage or {}
    breakdown = row.breakdown or {}
    duration = None
    if row.started_at and row.ended_at:
        duration = int((row.ended_at - row.started_at).total_seconds() * 1000)
    run = RunRecord(
        run_id=row.id,
        org_id=row.org_id,
        created_at=row.created_at,
        started_at=row.started_at,
        ended_at=row.ended_at,
        status=row.status,
        termination_reason=row.termination_reason,
        model=row.model,
        isolation=row.isolation,
        recipe=labels.get("recipe"),
        recipe_cell=json.dumps(labels["cell"], sort_keys=True) if "cell" in labels else None,
        repeat_index=labels.get("repeat_index"),
        suite_run_id=labels.get("suite_run_id"),
        zero_data_retention=zdr,
        prompt=None if zdr else row.prompt,
        output=None if zdr else row.output,
        model_calls=int(usage.get("model_calls", 0)),
        input_tokens=int(usage.get("input_tokens", 0)),
        output_tokens=int(usage.get("output_tokens", 0)),
        reserved_micros=row.reserved_micros,
        charged_micros=row.charged_micros or 0,
        refunded_micros=row.refunded_micros or 0,
        model_micros=int(breakdown.get("model_micros", 0)),
        web_micros=int(breakdown.get("web_micros", 0)),
        compute_micros=int(breakdown.get("compute_micros", 0)),
        duration_ms=duration,
        checks=json.dumps(labels["checks"]) if "checks" in labels else None,
        outcome=_outcome(row, labels),
        labels=json.dumps(string_labels(labels), sort_keys=True),
        host=getattr(row, "host", None) or host or socket.gethostname(),
        image=getattr(row, "image", None),
        image_hash=getattr(row, "image_hash", None),
        verify=_verify_column(events, zdr),
        kind=kind_of(getattr(row, "kind", None)),
    )
    steps: list[StepRecord] = []
    for ev in events:
        d = ev.data
        if ev.type == "model.called":
            steps.append(
                StepRecord(
                    run_id=row.id,
                    seq=ev.seq,
                    kind="model",
                    at=_dt(ev.at),
                    duration_ms=int(d.get("latency_ms", 0)),
                    command=None,
                    exit_code=None,
                    stdout=None,
                    stderr=None,
                    truncated=None,
                    model=d.get("model"),
                    input_tokens=d.get("input_tokens"),
                    output_tokens=d.get("output_tokens"),
                    cost_micros=int(d.get("cost_micros", 0)),
                )
            )
        elif ev.type == "shell.executed":
            steps.append(
                StepRecord(
                    run_id=row.id,
                    seq=ev.seq,
                    kind="shell",
                    at=_dt(ev.at),
                    duration_ms=int(d.get("duration_ms", 0)),
                    command=None if zdr else d.get("command"),
                    exit_code=d.get("exit_code"),
                    stdout=None if zdr else d.get("stdout"),
                    stderr=None if zdr else d.get("stderr"),
                    truncated=d.get("truncated"),
                    model=None,
                    input_tokens=None,
                    output_tokens=None,
                    cost_micros=0,
                )
            )
        elif ev.type in (
            "web.requested",
            "web.denied",
            "connection.requested",
            "connection.denied",
        ):
            steps.append(
                StepRecord(
                    run_id=row.id,
                    seq=ev.seq,
                    kind=ev.type.split(".")[0],
                    at=_dt(ev.at),
                    duration_ms=0,
                    command=None,
                    exit_code=None,
                    stdout=None,
                    stderr=None,
                    truncated=None,
                    model=None,
                    input_tokens=None,
                    output_tokens=None,
                    cost_micros=int(d.get("cost_micros", 0) or 0),
                )
            )
    event_records = [
        EventRecord(
            run_id=row.id,
            seq=e.seq,
            type=e.type,
            at=_dt(e.at),
            data=json.dumps(e.data, sort_keys=True),
        )
        for e in events
    ]
    return run, steps, event_records


async def cassette_of_run(store: Store, run_id: str) -> dict[str, Any]:
    """A finished run's model turns as a replay cassette (``ephemeral record``).

    The turns are our loop's, or, for a run or session whose sandbox code called the model
    through the gateway, the gateway's; the cassette's model is then the one those calls used.
    """
    row = await store.runs.get(run_id)
    turns = await store.transcripts.get(run_id)
    if not turns:
        raise errors.NotFound(
            f"run {run_id} has no recorded model turns (zero data retention or erased)"
        )
    model = row.model
    calls = [e.data for e in await store.events.list(run_id) if e.type == "model.called"]
    through = [c.get("model") for c in calls if c.get("via") == "gateway"]
    if calls and len(through) == len(calls):
        models = sorted({str(m) for m in through})
        if len(models) > 1:
            raise errors.InvalidRequest.field(
                "run_id", f"its gateway calls used several models ({', '.join(models)})"
            )
        model = str(through[0])
    if model.startswith(REPLAY_PREFIX):
        raise errors.InvalidRequest.field("run_id", "a replayed run is already a cassette")
    doc: dict[str, Any] = {
        "version": 1,
        "model": model,
        "recorded_at": rfc3339(utcnow()),
        # A cassette takes no other field (replay refuses unknown ones): the source goes here.
        "description": f"recorded from {run_id}",
        "turns": turns,
    }
    if model == row.model and row.prompt is not None:
        doc["prompt"] = row.prompt  # our loop's turns answer the run's prompt, and only it
    return doc


def record_run(settings: Settings, row: Any, events: list[Event]) -> None:
    run, steps, event_records = build_records(row, events, host=settings.host_id)
    write_run(settings.records_dir, run, steps, event_records)
