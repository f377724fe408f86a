"""The ``recipe-run`` flow: every run a recipe expands to, under the recipe's money cap.

Parameters are a recipe path or shipped name and ids, never prompts: Prefect's database keeps
flow parameters. Each run is an ``agent-run`` subflow (through ``Runtime.execute``). The summary
goes to our records (``<state>/evals/<suite_run_id>.{json,md}`` and each run's ``checks``) and,
without the check reasons (they quote run output), to Prefect as markdown and table artifacts.

The runtime is the caller's, handed in when the flow is made (:func:`recipe_run_flow`), never
looked up; :data:`recipe_run` (``prefect.yaml``'s entry point, run in a Prefect worker's fresh
process that has none) starts one of its own per flow run.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from prefect import Flow, flow
from prefect.artifacts import acreate_markdown_artifact, acreate_table_artifact

from ephemeral.engine.runtime import Runtime
from ephemeral.evals.plan import Evaluation, evaluation_for
from ephemeral.evals.render import render_markdown, table_rows
from ephemeral.evals.report import Report, summary
from ephemeral.evals.store import write_report
from ephemeral.evals.suite import run_evaluation
from ephemeral.flows.executor import executor_for
from ephemeral.settings import Settings

Summary = Flow[..., Coroutine[Any, Any, dict[str, Any]]]


def settings_of(runtime: Runtime | None) -> Settings:
    return runtime.settings if runtime is not None else Settings.load()


@contextlib.asynccontextmanager
async def runtime_for(runtime: Runtime | None, settings: Settings) -> AsyncIterator[Runtime]:
    """``runtime``, or one this flow run starts and closes (a worker's fresh process)."""
    if runtime is not None:
        yield runtime
        return
    # Each of the recipe's runs is then an ``agent-run`` subflow (under EPHEMERAL_EXECUTOR=flow).
    own = await Runtime.start(settings, executor=executor_for(settings), recover=False)
    try:
        yield own
    finally:
        await own.close()


def _artifact_key(prefix: str, name: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", f"{prefix}-{name}".lower()).strip("-")


async def publish(report: Report, settings: Settings) -> None:
    write_report(report, settings)
    await acreate_markdown_artifact(
        key=_artifact_key("eval", report.suite),
        markdown=render_markdown(report, reasons=False),
        description=f"suite run {report.suite_run_id}",
    )
    await acreate_table_artifact(
        key=_artifact_key("eval-table", report.suite),
        table=table_rows(report),
        description=f"pass table of suite run {report.suite_run_id}",
    )


async def run_and_publish(
    runtime: Runtime | None, settings: Settings, evaluation: Evaluation
) -> Report:
    async with runtime_for(runtime, settings) as running:
        report = await run_evaluation(running, evaluation)
        await publish(report, running.settings)
        return report


def recipe_run_flow(runtime: Runtime | None = None) -> Summary:
    """The ``recipe-run`` flow whose runs execute on ``runtime`` (None: each starts its own)."""

    @flow(name="recipe-run", persist_result=False, log_prints=False)
    async def recipe_run(
        recipe: str,
        suite_run_id: str | None = None,
        concurrency: int = 2,
        compare: str | None = None,
    ) -> dict[str, Any]:
        """Run a recipe (a path or a shipped recipe's name); returns a content-free summary."""
        settings = settings_of(runtime)
        evaluation = evaluation_for(
            recipe,
            settings,
            concurrency=concurrency,
            compare_with=compare,
            suite_run_id=suite_run_id,
        )
        return summary(await run_and_publish(runtime, settings, evaluation))

    return recipe_run


recipe_run = recipe_run_flow()
