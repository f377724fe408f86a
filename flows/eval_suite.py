"""The ``eval-suite`` flow: several recipes, pass rates, cost, duration, gate and comparison.

One scheduler runs every recipe's runs, so the suite's ``concurrency`` and ``budget_micros``
hold across recipes while each recipe's own budget still applies (``ephemeral.evals``).
``compare`` names a previous suite run, read back from the records by its id.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from ephemeral.engine.runtime import current
from ephemeral.evals.plan import evaluation_for
from ephemeral.evals.report import summary
from ephemeral.flows.recipe_run import run_and_publish
from ephemeral.settings import Settings


@flow(name="eval-suite", persist_result=False, log_prints=False)
async def eval_suite(
    suite: str = "smoke",
    compare: str | None = None,
    suite_run_id: str | None = None,
    knobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run a suite (a path or a shipped suite's name); returns a content-free summary.
    ``knobs``: ``ephemeral eval``'s ``limit``, ``filters``, ``model``, ``repeat``,
    ``concurrency`` (names and numbers, never content)."""
    runtime = current()
    settings = runtime.settings if runtime is not None else Settings.load()
    given = dict(knobs or {})
    if given.get("filters"):
        given["filters"] = [tuple(f) for f in given["filters"]]
    evaluation = evaluation_for(
        suite, settings, compare_with=compare, suite_run_id=suite_run_id, **given
    )
    return summary(await run_and_publish(evaluation))
