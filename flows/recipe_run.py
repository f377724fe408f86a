"""The ``recipe-run`` flow: every run a recipe expands to, under the recipe's money cap.

Parameters are a recipe path or shipped name and ids, never prompts: Prefect's database keeps
flow parameters. Each run is an ``agent-run`` subflow (through ``Runtime.execute``). The summary
goes to our records (``<state>/evals/<suite_run_id>.{json,md}`` and each run's ``checks``) and,
without the check reasons (they quote run output), to Prefect as markdown and table artifacts.
"""

from __future__ import annotations

import re
from typing import Any

from prefect import flow
from prefect.artifacts import acreate_markdown_artifact, acreate_table_artifact

from ephemeral.engine.runtime import Runtime, current
from ephemeral.evals.plan import Evaluation, evaluation_for
from ephemeral.evals.render import render_markdown, table_rows
from ephemeral.evals.report import Report, summary
from ephemeral.evals.store import write_report
from ephemeral.evals.suite import run_evaluation
from ephemeral.flows.executor import executor_for
from ephemeral.settings import Settings


async def flow_runtime() -> tuple[Runtime, bool]:
    """The runtime of this process, or (in a worker's fresh flow process) a new one we own."""
    runtime = current()
    if runtime is not None:
        return runtime, False
    settings = Settings.load()
    # Each of the recipe's runs is then an ``agent-run`` subflow (under EPHEMERAL_EXECUTOR=flow).
    return await Runtime.start(settings, executor=executor_for(settings), recover=False), True


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


async def run_and_publish(evaluation: Evaluation) -> Report:
    runtime, owned = await flow_runtime()
    try:
        report = await run_evaluation(runtime, evaluation)
        await publish(report, runtime.settings)
        return report
    finally:
        if owned:
            await runtime.close()


@flow(name="recipe-run", persist_result=False, log_prints=False)
async def recipe_run(
    recipe: str,
    suite_run_id: str | None = None,
    concurrency: int = 2,
    compare: str | None = None,
) -> dict[str, Any]:
    """Run a recipe (a path or a shipped recipe's name); returns a content-free summary."""
    runtime = current()
    settings = runtime.settings if runtime is not None else Settings.load()
    evaluation = evaluation_for(
        recipe, settings, concurrency=concurrency, compare_with=compare, suite_run_id=suite_run_id
    )
    return summary(await run_and_publish(evaluation))
