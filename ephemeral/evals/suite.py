"""A whole evaluation end to end: plan, run under the caps, judge, compare, gate."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ephemeral.evals.compare import compare
from ephemeral.evals.execute import execute_planned
from ephemeral.evals.plan import Evaluation, iter_plan, planned_count
from ephemeral.evals.report import Report
from ephemeral.evals.result import RunResult
from ephemeral.evals.schedule import Cap, run_planned
from ephemeral.evals.stats import gate_failures, recipe_stats
from ephemeral.evals.store import load_previous
from ephemeral.recipes.recipe import validate_recipe

if TYPE_CHECKING:
    from ephemeral.engine.runtime import Runtime


@dataclass
class Progress:
    """How far a suite run is: what a :func:`watch` observer is called with after each run."""

    total: int
    done: int = 0
    passing: int = 0
    spent_micros: int = 0
    last: RunResult | None = None


Observer = Callable[[Progress], None]
_observers: dict[str, Observer] = {}


@contextlib.contextmanager
def watch(suite_run_id: str, observer: Observer) -> Iterator[None]:
    """Call ``observer`` as runs of this suite run finish (in this process; for the CLI)."""
    _observers[suite_run_id] = observer
    try:
        yield
    finally:
        _observers.pop(suite_run_id, None)


async def run_evaluation(runtime: Runtime, evaluation: Evaluation) -> Report:
    """Run an evaluation end to end and return its report (not yet written anywhere)."""
    from ephemeral.records import Records

    previous = None
    if evaluation.compare_with:  # read first: a bad id should fail before money is spent
        previous = load_previous(Records(runtime.settings.records_dir), evaluation.compare_with)
    for recipe in evaluation.recipes:  # before anything runs: an unknown model stops it all
        validate_recipe(recipe, runtime.settings)
    planned = iter_plan(evaluation, runtime.settings)
    recipe_of = {r.name: r for r in evaluation.recipes}
    suite_cap = Cap(f"suite {evaluation.name}", evaluation.budget_micros)
    caps = {
        r.name: [suite_cap, Cap(f"recipe {r.name}", r.budget_micros)] for r in evaluation.recipes
    }
    progress = Progress(total=planned_count(evaluation, runtime.settings))

    def on_result(result: RunResult) -> None:
        progress.done += 1
        progress.passing += int(result.passed)
        progress.spent_micros += result.charged_micros
        progress.last = result
        observer = _observers.get(evaluation.suite_run_id)
        if observer is not None:
            observer(progress)

    org_id = await runtime.local_org()
    t0 = time.monotonic()
    results = await run_planned(
        planned,
        lambda p: caps[p.recipe],
        lambda p: execute_planned(
            runtime,
            org_id,
            p,
            recipe_of[p.recipe],
            evaluation.suite_run_id,
            evaluation.watchers,
        ),
        concurrency=evaluation.concurrency,
        on_result=on_result,
    )
    judged = evaluation.recipes
    if evaluation.filters or evaluation.limit is not None:  # a recipe left out is not gated
        judged = [r for r in judged if any(res.recipe == r.name for res in results)]
    stats = recipe_stats(judged, results)
    return Report(
        suite=evaluation.name,
        suite_run_id=evaluation.suite_run_id,
        min_pass_rate=evaluation.min_pass_rate,
        budget_micros=evaluation.budget_micros,
        wall_ms=int((time.monotonic() - t0) * 1000),
        results=results,
        recipes=stats,
        comparison=(
            compare(results, previous, evaluation.compare_with or "")
            if previous is not None
            else None
        ),
        gate_failures=gate_failures(stats, evaluation.min_pass_rate),
    )
