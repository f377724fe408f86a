"""A suite run's report, its saved JSON form and the content-free summary a flow returns."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from ephemeral.engine.outcomes import OUTCOMES
from ephemeral.evals.compare import Comparison
from ephemeral.evals.result import RunResult
from ephemeral.evals.stats import RecipeStat


class Report(BaseModel):
    suite: str
    suite_run_id: str
    min_pass_rate: float
    budget_micros: int | None
    wall_ms: int
    results: list[RunResult]
    recipes: list[RecipeStat]
    comparison: Comparison | None = None
    gate_failures: list[str] = Field(default_factory=list)

    @property
    def charged_micros(self) -> int:
        return sum(r.charged_micros for r in self.recipes)

    @property
    def passed(self) -> bool:
        return not self.gate_failures

    @property
    def outcomes(self) -> dict[str, int]:
        """How many planned runs ended in each outcome, over the whole suite run."""
        totals = dict.fromkeys((str(o) for o in OUTCOMES), 0)
        for r in self.results:
            totals[r.outcome] += 1
        return totals


def summary(report: Report) -> dict[str, Any]:
    """A content-free summary (what a flow returns)."""
    cmp = report.comparison
    return {
        "suite": report.suite,
        "suite_run_id": report.suite_run_id,
        "passed": report.passed,
        "runs": len(report.results),
        "passing": sum(1 for r in report.results if r.passed),
        "outcomes": report.outcomes,
        "charged_micros": report.charged_micros,
        "wall_ms": report.wall_ms,
        "gate_failures": report.gate_failures,
        "pass_rates": {s.recipe: s.pass_rate for s in report.recipes},
        "regressions": len(cmp.regressions) if cmp else None,
        "run_ids": [r.run_id for r in report.results if r.run_id],
    }


def report_json(report: Report) -> dict[str, Any]:
    data = report.model_dump(mode="json")
    data["passed"] = report.passed
    data["charged_micros"] = report.charged_micros
    data["outcomes"] = report.outcomes
    for s, raw in zip(report.recipes, data["recipes"], strict=True):
        raw["pass_rate"] = s.pass_rate
        raw["graded"] = s.graded
    return data
