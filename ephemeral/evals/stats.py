"""Per-recipe pass rates over graded runs, pass@k over cells, and the gate."""

from __future__ import annotations

import json
from collections.abc import Sequence

from pydantic import BaseModel, Field

from ephemeral.engine.outcomes import GRADED, OUTCOMES, Outcome
from ephemeral.evals.result import RunResult
from ephemeral.recipes.recipe import Recipe


class CheckStat(BaseModel):
    check: str
    passed: int
    total: int  # graded runs

    @property
    def rate(self) -> float:
        return self.passed / self.total if self.total else 0.0


class RecipeStat(BaseModel):
    recipe: str  # the recipe's name; with a models axis "name [model]"
    model: str | None = None  # set for a recipe with a models axis
    planned: int
    ran: int
    passed: int
    skipped: int
    charged_micros: int
    duration_ms: int  # sum over the recipe's runs
    checks: list[CheckStat]
    # With repeats (``--repeat K``, epochs): runs per cell, the cells, and the cells at least one
    # of whose runs passed (pass@k, k = epochs).
    epochs: int = 1
    cells: int = 0
    cells_passing: int = 0
    # How many runs ended in each outcome (every outcome present): pass + fail are graded.
    outcomes: dict[str, int] = Field(default_factory=dict)

    @property
    def graded(self) -> int:
        return self.outcomes.get(Outcome.PASS, 0) + self.outcomes.get(Outcome.FAIL, 0)

    @property
    def not_graded(self) -> dict[str, int]:
        return {o: n for o, n in self.outcomes.items() if o not in GRADED and n}

    @property
    def pass_rate(self) -> float:
        return self.passed / self.graded if self.graded else 0.0


def recipe_stats(recipes: Sequence[Recipe], results: Sequence[RunResult]) -> list[RecipeStat]:
    """One row per recipe; a recipe with a ``models:`` axis gets one row per model
    (``recipe [model]``), so the pass table and the gate compare the models."""
    stats = []
    groups: list[tuple[Recipe, str | None]] = []
    for recipe in recipes:
        groups += [(recipe, m) for m in recipe.models] if recipe.models else [(recipe, None)]
    for recipe, model in groups:
        mine = [
            r
            for r in results
            if r.recipe == recipe.name and (model is None or r.cell.get("model") == model)
        ]
        ran = [r for r in mine if r.run_id is not None]
        graded = [r for r in mine if r.graded]
        by_cell: dict[str, list[RunResult]] = {}
        for r in mine:
            by_cell.setdefault(json.dumps(r.cell, sort_keys=True, default=str), []).append(r)
        labels = [c.label() for c in recipe.checks]
        checks = [
            CheckStat(
                check=label,
                total=len(graded),
                passed=sum(1 for r in graded for v in r.checks if v.check == label and v.passed),
            )
            for label in labels
        ]
        outcomes = dict.fromkeys(OUTCOMES, 0)
        for r in mine:
            outcomes[r.outcome] += 1
        stats.append(
            RecipeStat(
                recipe=recipe.name if model is None else f"{recipe.name} [{model}]",
                model=model,
                planned=len(mine),
                ran=len(ran),
                passed=sum(1 for r in mine if r.passed),
                skipped=sum(1 for r in mine if r.status == "skipped"),
                charged_micros=sum(r.charged_micros for r in mine),
                duration_ms=sum(r.duration_ms or 0 for r in ran),
                checks=checks,
                outcomes={str(k): v for k, v in outcomes.items()},
                epochs=max((len(rs) for rs in by_cell.values()), default=1),
                cells=len(by_cell),
                cells_passing=sum(1 for rs in by_cell.values() if any(r.passed for r in rs)),
            )
        )
    return stats


def not_graded_text(counts: dict[str, int]) -> str:
    """``2 error, 1 budget``: the runs the gate did not grade, by outcome."""
    return ", ".join(f"{n} {o}" for o, n in counts.items() if n)


def gate_failures(stats: Sequence[RecipeStat], min_pass_rate: float) -> list[str]:
    """The gate. A recipe's pass rate is over its graded runs (an infrastructure error is not
    the model's failure), and it fails below ``min_pass_rate``; it fails too, on a line of its
    own, when some of its planned runs were not graded (error, cancelled, budget): a gate
    cannot pass on runs that never ran or were never judged."""
    failures = []
    for s in stats:
        if s.graded and s.pass_rate < min_pass_rate:
            failures.append(
                f"{s.recipe}: pass rate {s.pass_rate:.0%} ({s.passed}/{s.graded} graded) "
                f"below min_pass_rate {min_pass_rate:.0%}"
            )
        if s.not_graded:
            failures.append(
                f"{s.recipe}: {not_graded_text(s.not_graded)} not graded "
                f"({s.graded}/{s.planned} runs graded)"
            )
    return failures
