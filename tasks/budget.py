"""Budget tasks: confirm the run's hold at the start, settle it at the end."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect import task

from ephemeral.agent import AgentRun
from ephemeral.tasks._common import TASK_OPTIONS

if TYPE_CHECKING:
    from ephemeral.service import Runtime
    from ephemeral.store import RunRow


@task(name="reserve_budget", **TASK_OPTIONS)
async def reserve_budget(runtime: Runtime, run_id: str) -> AgentRun | None:
    """Load the admitted run and its reservation; None if it is not waiting to run.

    The org-level hold of ``max_cost_micros`` is taken atomically at admission, so a run
    that reaches this task always has its money set aside; the task builds the in-run budget
    that guards each step.
    """
    row = await runtime.store.get_run(run_id)
    # Granted: the runtime gave it an execution slot and is waiting for this flow to build it.
    waiting = row.status == "queued" or runtime.granted(run_id)
    if not waiting or row.reserved_micros <= 0:
        return None
    return await runtime.build(run_id)


@task(name="settle", **TASK_OPTIONS)
async def settle(run: AgentRun) -> RunRow:
    return await run.settle()
