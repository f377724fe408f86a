"""One planned run's result, and the key that pairs it with its twin in another suite run."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from ephemeral.engine.outcomes import GRADED, Outcome, outcome_of
from ephemeral.recipes.checks import CheckResult
from ephemeral.recipes.recipe import PlannedRun


def pair_key(recipe: str, cell: dict[str, Any], repeat_index: int) -> str:
    """The key :meth:`PlannedRun.pair_key` gives, rebuilt from what the records keep."""
    text = json.dumps(cell, sort_keys=True, default=str, separators=(",", ":"))
    return f"{recipe}/{text}/{repeat_index}"


class RunResult(BaseModel):
    """One planned run's outcome: ran (with verdicts), skipped for budget, or refused/errored."""

    model_config = ConfigDict(extra="forbid")

    pair_key: str
    recipe: str
    cell: dict[str, Any] = Field(default_factory=dict)
    repeat_index: int = 0
    model: str | None = None  # the model it was planned on (``--model`` replaces the recipe's)
    run_id: str | None = None
    status: str  # a run status, or "skipped" / "refused" / "error"
    detail: str | None = None
    reserved_micros: int = 0
    charged_micros: int = 0
    duration_ms: int | None = None
    checks: list[CheckResult] = Field(default_factory=list)
    termination_reason: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _derived(cls, data: Any) -> Any:
        # A saved report carries the outcome it computed; it is derived again, never trusted.
        if isinstance(data, dict) and "outcome" in data:
            data = {k: v for k, v in data.items() if k != "outcome"}
        return data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def outcome(self) -> Outcome:
        if self.run_id is None:
            return outcome_of(self.status, None)
        return outcome_of(self.status, self.termination_reason, [c.passed for c in self.checks])

    @property
    def passed(self) -> bool:
        return self.outcome is Outcome.PASS

    @property
    def graded(self) -> bool:
        return self.outcome in GRADED


def unrun(planned: PlannedRun, status: str, detail: str) -> RunResult:
    return RunResult(
        pair_key=planned.pair_key(),
        recipe=planned.recipe,
        cell=planned.cell,
        repeat_index=planned.repeat_index,
        model=planned.model,
        status=status,
        detail=detail,
    )
