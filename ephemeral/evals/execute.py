"""One planned run: admit, run, judge against its recipe's checks, record."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ephemeral import errors
from ephemeral.evals.result import RunResult, unrun
from ephemeral.models import NO_MODEL
from ephemeral.recipes.checks import CheckResult, evaluate
from ephemeral.recipes.recipe import PlannedRun, Recipe

if TYPE_CHECKING:
    from ephemeral.engine.runtime import Runtime

ZDR_REASON = "(withheld: zero data retention)"


def run_view_output(row: Any, zdr_output: str | None) -> dict[str, Any]:
    from ephemeral.runview import run_object

    obj = run_object(row)
    if obj.get("output") is None and zdr_output is not None:
        obj["output"] = zdr_output
    return obj


@dataclass
class Watchers:
    """What a caller in this process sees of each run as it happens (``ephemeral run RECIPE``
    prints its timeline live): the run id once admitted, then the judged run with its
    output, a zero-data-retention one included (delivered here once, never stored)."""

    admitted: Callable[[str], None] | None = None
    judged: Callable[[Any, str | None, list[CheckResult]], None] | None = None


async def execute_planned(
    runtime: Runtime,
    org_id: str,
    planned: PlannedRun,
    recipe: Recipe,
    suite_run_id: str,
    watchers: Watchers | None = None,
) -> RunResult:
    """Admit, run, judge and record one planned run."""
    from ephemeral.policy import RunRequest

    base = unrun(planned, "refused", "")
    labels = {
        "recipe": planned.recipe,
        "cell": planned.cell,
        "repeat_index": planned.repeat_index,
        "suite_run_id": suite_run_id,
    }
    model = None if planned.model == NO_MODEL else planned.model
    request = RunRequest(
        prompt=planned.prompt, model=model, labels=recipe.labels, **planned.policy.model_dump()
    )
    try:
        row, _ = await runtime.admit(org_id, request, labels=labels)
    except errors.EphemeralError as exc:
        return base.model_copy(update={"detail": exc.detail})
    if watchers is not None and watchers.admitted is not None:
        watchers.admitted(row.id)
    try:
        row = await runtime.execute(row.id)
    finally:
        # The output of a zero-data-retention run exists once, here; judge it now or never.
        zdr_output = runtime.take_zdr_output(row.id)
    events = [e.model_dump(mode="json") for e in await runtime.store.events.list(row.id)]
    verdicts = evaluate(recipe.checks, run_view_output(row, zdr_output), events)
    if planned.policy.zero_data_retention:
        verdicts = [v.model_copy(update={"reason": ZDR_REASON}) for v in verdicts]
    row = await runtime.store.runs.update(
        row.id, labels={**row.labels, "checks": [v.model_dump() for v in verdicts]}
    )
    await runtime.record(row.id)  # rewrites the run's records, now with the verdicts
    if watchers is not None and watchers.judged is not None:
        watchers.judged(row, row.output if row.output is not None else zdr_output, verdicts)
    duration = None
    if row.started_at and row.ended_at:
        duration = int((row.ended_at - row.started_at).total_seconds() * 1000)
    settled = row.settled_at is not None
    return base.model_copy(
        update={
            "run_id": row.id,
            "status": row.status,
            "termination_reason": row.termination_reason,
            "detail": row.termination_detail,
            "reserved_micros": row.reserved_micros,
            "charged_micros": row.charged_micros if settled else row.reserved_micros,
            "duration_ms": duration,
            "checks": verdicts,
        }
    )
