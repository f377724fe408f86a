"""What to run: an evaluation from a suite or recipe file, its knobs, filters and the plan."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ephemeral import errors
from ephemeral.evals.execute import Watchers
from ephemeral.evals.store import last_suite_run
from ephemeral.ids import new_id
from ephemeral.models import default_model
from ephemeral.recipes.recipe import PlannedRun, Recipe, expand, iter_planned, validate_recipe

if TYPE_CHECKING:
    from ephemeral.settings import Settings


def new_suite_run_id() -> str:
    return new_id("suite")


@dataclass
class Evaluation:
    """What to run: a suite (or one recipe as a suite of one) with its caps and gate."""

    name: str
    recipes: list[Recipe]
    budget_micros: int | None = None
    concurrency: int = 2
    min_pass_rate: float = 1.0
    suite_run_id: str = field(default_factory=new_suite_run_id)
    compare_with: str | None = None
    watchers: Watchers | None = None
    # Run-time knobs (``ephemeral eval --limit/--filter``): which planned runs run at all.
    limit: int | None = None
    filters: list[tuple[str, str]] = field(default_factory=list)


FILTER_KEYS = ("recipe", "model")  # besides a cell's own keys (matrix, dataset columns)


def parse_filter(expr: str) -> tuple[str, str]:
    """``KEY=VALUE`` (``recipe=exit-codes``, ``model=…``, a matrix or dataset column of the
    cell, ``function=add``); refused naming ``--filter`` otherwise."""
    key, sep, value = expr.partition("=")
    if not sep or not key.strip():
        raise errors.InvalidRequest.field(
            "--filter",
            f"{expr!r} is not KEY=VALUE (a cell's matrix or dataset column, "
            f"or {' or '.join(FILTER_KEYS)})",
        )
    return key.strip(), value.strip()


def _matches(planned: PlannedRun, filters: list[tuple[str, str]]) -> bool:
    for key, value in filters:
        if key == "recipe":
            got: Any = planned.recipe
        elif key == "model":
            got = planned.model
        else:
            got = planned.cell.get(key)
        if got is None or str(got) != value:
            return False
    return True


def with_knobs(
    recipes: list[Recipe], *, model: str | None = None, repeat: int | None = None
) -> list[Recipe]:
    """The recipes with ``--model`` (replaces each recipe's model and models axis) and
    ``--repeat`` (epochs: runs per cell) applied."""
    update: dict[str, Any] = {}
    if model is not None:
        update |= {"model": model, "models": []}
    if repeat is not None:
        update["repeat"] = repeat
    return [r.model_copy(update=update) for r in recipes] if update else recipes


def plan(evaluation: Evaluation, settings: Settings) -> list[tuple[PlannedRun, Recipe]]:
    """Every run of every recipe, in suite order; a bad recipe stops everything before a run."""
    for recipe in evaluation.recipes:
        validate_recipe(recipe, settings)
    out: list[tuple[PlannedRun, Recipe]] = []
    for recipe in evaluation.recipes:
        out.extend((p, recipe) for p in expand(recipe, default_model=default_model(settings)))
    return out


def iter_plan(evaluation: Evaluation, settings: Settings) -> Iterator[PlannedRun]:
    """:func:`plan` streamed: the recipes were test-rendered when loaded, so this only renders
    each run as it is about to start (a 100,000-row dataset is never held whole)."""
    for recipe in evaluation.recipes:
        validate_recipe(recipe, settings)
    yield from _selected(evaluation, settings)


def _selected(evaluation: Evaluation, settings: Settings) -> Iterator[PlannedRun]:
    every = (
        p
        for recipe in evaluation.recipes
        for p in iter_planned(recipe, default_model=default_model(settings))
        if _matches(p, evaluation.filters)
    )
    yield from itertools.islice(every, evaluation.limit)


def planned_count(evaluation: Evaluation, settings: Settings | None = None) -> int:
    """How many runs will run: every planned one, or with ``--filter`` those that match
    (counted by planning them once) and at most ``--limit``."""
    if evaluation.filters and settings is not None:
        return sum(1 for _ in _selected(evaluation, settings))
    total = sum(r.run_count() for r in evaluation.recipes)
    return total if evaluation.limit is None else min(total, evaluation.limit)


def evaluation_for(path: str, settings: Settings, **kw: Any) -> Evaluation:
    """A suite file, a recipe file, or the name of a shipped suite or recipe."""
    from ephemeral.recipes.recipe import Suite, load_any

    item = load_any(resolve_path(path, settings))
    if isinstance(item, Suite):
        base: dict[str, Any] = {
            "name": item.name,
            "recipes": item.loaded_recipes,
            "budget_micros": item.budget_micros,
            "concurrency": item.concurrency,
            "min_pass_rate": item.gates.min_pass_rate,
        }
    else:
        base = {"name": item.name, "recipes": [item], "budget_micros": None}
    model, repeat = kw.pop("model", None), kw.pop("repeat", None)
    if kw.get("compare_with") == "last":
        kw["compare_with"] = last_suite_run(settings, base["name"])
    base["recipes"] = with_knobs(base["recipes"], model=model, repeat=repeat)
    return Evaluation(**{**base, **{k: v for k, v in kw.items() if v is not None}})


def resolve_path(path: str, settings: Settings) -> Path:
    p = Path(path)
    if p.is_file():
        return p
    for candidate in (
        settings.recipes_dir / "suites" / f"{path}.yaml",
        settings.recipes_dir / f"{path}.yaml",
    ):
        if "/" not in path and candidate.is_file():
            return candidate
    raise errors.InvalidRequest.field(
        "recipe", f"{path!r} is neither a file nor a shipped recipe or suite name"
    )
