"""The one close of a run, and its record, written once.

Every exit of a run (``ephemeral.engine.exits``) ends here, whoever takes it: a run's own agent
(``AgentRun.settle``), the engine for a run no agent drives (``Engine.end``: dead owner,
cancelled while waiting, an executor that raised) and a sandbox session's manager (``Sessions``):

    close     one store transaction (``store.runs.close``): the sandbox's compute charge with
              ``sandbox.destroyed``, the terminal status, ``run.<status>``, the settlement
              (``charged + refunded = reserved``), ``run.output``, ``run.settled``, the transcript
    record    the Parquet records (``recording.record_run``), then the ``recorded_at`` marker;
              a process that dies between the close and the marker leaves a settled,
              unrecorded run, which ``Runtime.recover`` records (rewriting the same files)

Before the close, a live owner (``AgentRun.settle``, ``Sessions``) awaits every charge still
landing (``broker.attach.WebCharges.flush``: egress charges, and a model call through the
gateway that was in flight when the owner ended, settled to what the provider reported), so
none lands after the books close and the close's usage and transcript count them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any

from ephemeral.engine.exits import Exit
from ephemeral.engine.record import record_run
from ephemeral.events import Event
from ephemeral.ids import rfc3339, utcnow
from ephemeral.lifecycle import OPEN_STATUSES, RunStatus, compute_charge
from ephemeral.money.amounts import usd
from ephemeral.settings import Settings
from ephemeral.store import RunRow, Store

# One INFO line per closed run or session (``ephemeral serve`` shows it in its log).
log = logging.getLogger("ephemeral.runs")


async def close(
    store: Store,
    settings: Settings | None,
    run_id: str,
    exit: Exit,
    *,
    usage: dict[str, Any],
    output: str | None,
    keep_output: bool = True,
    compute: tuple[int, int] | None = None,
    transcript: list[dict[str, Any]] | None = None,
    expect: Collection[RunStatus] = OPEN_STATUSES,
) -> RunRow:
    """End a run by ``exit`` in one transaction, then write its record (unless ``settings`` is None:
    the caller records it later).

    ``compute`` is ``(micros, lifetime_ms)`` of the run's sandbox, charged with
    ``sandbox.destroyed`` in the same transaction (skipped if charged already). A run that is
    closed already is returned as it is (settled, if a crash had left only that undone).
    """
    row, _ = await store.runs.close(
        run_id,
        reason=exit.reason,
        detail=exit.detail,
        usage=usage,
        output=output,
        keep_output=keep_output,
        expect=expect,
        compute=compute,
        transcript=transcript,
    )
    log.info(
        "%s %s (%s), charged %s",
        row.id,
        row.status,
        row.termination_reason,
        usd(row.charged_micros),
    )
    if settings is not None:
        return await record(store, settings, row)
    return row


async def record(
    store: Store, settings: Settings, run: str | RunRow, *, rewrite: bool = False
) -> RunRow:
    """Write a settled run's records unless its marker says they are written (``rewrite``:
    write them again, as after an eval added its verdicts); returns the row.

    The files are named by the run and its host's partition, so a rewrite after a crash
    (between the files and the marker) replaces them: one record per run.
    """
    row = await store.runs.get(run) if isinstance(run, str) else run
    if row.recorded_at is not None and not rewrite:
        return row
    events = await store.events.list(row.id)
    if row.host is not None and row.host != settings.host_id:
        # Recovered on another host: the record goes to the run's own host partition.
        settings = settings.model_copy(update={"host_id": row.host})
    await asyncio.to_thread(record_run, settings, row, events)
    await store.runs.mark_recorded(row.id)
    return row.model_copy(update={"recorded_at": utcnow()})


def abandoned_compute(
    row: RunRow, events: Sequence[Event], *, micros_per_second: float, charged: dict[str, int]
) -> tuple[int, int] | None:
    """The compute of a run whose agent is gone, from its events: its sandbox lived from
    ``sandbox.ready`` to the last thing the run recorded (or its host's last lease renewal).
    None when no sandbox came up or its ``sandbox.destroyed`` is written already."""
    types = [e.type for e in events]
    if "sandbox.ready" not in types or "sandbox.destroyed" in types:
        return None
    ready = next(e for e in events if e.type == "sandbox.ready")
    end = events[-1].at
    if row.lease_renewed_at is not None:
        end = max(end, rfc3339(row.lease_renewed_at), key=_parse_at)
    lifetime = _ms_between(ready.at, end)
    micros = compute_charge(
        micros_per_second=micros_per_second,
        seconds=lifetime / 1000,
        reserved_micros=row.reserved_micros,
        other_spent_micros=sum(charged.values()) - charged.get("compute_micros", 0),
    )
    return micros, lifetime


def _parse_at(at: str) -> datetime:
    return datetime.fromisoformat(at.replace("Z", "+00:00"))


def _ms_between(a: str, b: str) -> int:
    return max(0, int((_parse_at(b) - _parse_at(a)).total_seconds() * 1000))
