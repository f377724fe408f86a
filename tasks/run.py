"""Run tasks: load the admitted run at the start, close it at the end."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect import task

from ephemeral.agent.loop import AgentRun
from ephemeral.tasks._common import TASK_OPTIONS

if TYPE_CHECKING:
    from ephemeral.engine.executor import RunHandle


@task(name="load_run", **TASK_OPTIONS)
async def load_run(run: RunHandle) -> AgentRun | None:
    """Build the admitted run's agent (its row, its zero-data-retention prompt, its in-run
    budget); None if it is not waiting to run. Its money was reserved at admission."""
    return await run.build()


# The run's one close (``ephemeral.engine.close.close``) and its record: the task is the method
# itself, so nothing stands between Prefect's task run and the close.
settle = task(name="settle", **TASK_OPTIONS)(AgentRun.settle)
