"""The ``eval-suite`` flow: several recipes, pass rates, cost, duration, gate and comparison.

One scheduler runs every recipe's runs, so the suite's ``concurrency`` and ``budget_micros``
hold across recipes while each recipe's own budget still applies (``ephemeral.evals``).
``compare`` names a previous suite run, read back from the records by its id. The runtime is
handed in as in ``recipe-run`` (:func:`eval_suite_flow`; :data:`eval_suite` starts its own).
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from ephemeral.engine.runtime import Runtime
from ephemeral.evals.plan import evaluation_for
from ephemeral.evals.report import summary
from ephemeral.flows.recipe_run import Summary, run_and_publish, settings_of


def eval_suite_flow(runtime: Runtime | None = None) -> Summary:
    """The ``eval-suite`` flow whose runs execute on ``runtime`` (None: each starts its own)."""

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
        settings = settings_of(runtime)
        given = dict(knobs or {})
        if given.get("filters"):
            given["filters"] = [tuple(f) for f in given["filters"]]
        evaluation = evaluation_for(
            suite, settings, compare_with=compare, suite_run_id=suite_run_id, **given
        )
        return summary(await run_and_publish(runtime, settings, evaluation))

    return eval_suite


eval_suite = eval_suite_flow()
