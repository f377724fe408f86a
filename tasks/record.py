"""Write the settled run's analysis records (Parquet, one file per run and kind)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect import task

from ephemeral.tasks._common import TASK_OPTIONS

if TYPE_CHECKING:
    from ephemeral.service import Runtime


@task(name="record", **TASK_OPTIONS)
async def record(runtime: Runtime, run_id: str) -> None:
    await runtime.record(run_id)
