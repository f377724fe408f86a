"""Recipe runs and eval suites without Prefect: planning, money caps, verdicts, comparison, summary.

The flows (``flows/recipe_run.py``, ``flows/eval_suite.py``), ``ephemeral eval`` and
``ephemeral run RECIPE`` all call :func:`run_evaluation`; Prefect only wraps it (subflow per
run, artifacts).

Money: a recipe (and a suite) has a cap like a run has. Before a run starts, its whole
``max_cost_micros`` is committed against every cap it falls under; when it settles, the
refund is given back, so a cap's committed amount is "worst case of the runs in flight plus
what finished runs were charged" and can never pass the cap. A run that does not fit waits
for runs in flight to settle; when nothing is in flight and it still does not fit, it is
skipped (``skipped``, reason ``budget``). A run whose settlement is unknown (an error after
admission) keeps its whole reservation committed.

Verdicts: every planned run ends in one outcome (``ephemeral.outcomes``): ``pass`` when every
check of its recipe passes (a recipe without checks: when it succeeded), ``fail``, ``error``
(the infrastructure's: a sandbox that died or was wrecked, a failed setup, a provider or
internal failure, a refused admission), ``cancelled`` or ``budget`` (skipped or stopped for
money). Only pass and fail are graded: a recipe's pass rate is passes over graded runs, so an
infrastructure error never counts as the model's failure nor as its success. The runs that
were not graded are counted apart in the table and the export, and fail the gate on a line of
their own (a gate cannot pass on runs that never ran or were never judged).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from ephemeral import errors
from ephemeral.checks import CheckResult, evaluate
from ephemeral.ids import new_id
from ephemeral.models import NO_MODEL, default_model
from ephemeral.money import usd
from ephemeral.outcomes import GRADED, OUTCOMES, Outcome, outcome_of
from ephemeral.recipes import PlannedRun, Recipe, expand, iter_planned, validate_recipe

if TYPE_CHECKING:
    from ephemeral.records import Records
    from ephemeral.service import Runtime
    from ephemeral.settings import Settings

ZDR_REASON = "(withheld: zero data retention)"
MAX_SHOWN_FAILURES = 20


def pair_key(recipe: str, cell: dict[str, Any], repeat_index: int) -> str:
    """The key :meth:`PlannedRun.pair_key` gives, rebuilt from what the records keep."""
    text = json.dumps(cell, sort_keys=True, default=str, separators=(",", ":"))
    return f"{recipe}/{text}/{repeat_index}"


def new_suite_run_id() -> str:
    return new_id("suite")


# --------------------------------------------------------------------------- money caps


@dataclass
class Cap:
    """A money cap over a group of runs (a recipe, a suite); ``limit`` None means uncapped."""

    name: str
    limit: int | None
    committed: int = 0

    def fits(self, amount: int) -> bool:
        return self.limit is None or self.committed + amount <= self.limit

    @property
    def left(self) -> int | None:
        return None if self.limit is None else self.limit - self.committed


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


@dataclass
class Progress:
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


Start = Callable[[PlannedRun], Awaitable[RunResult]]


async def run_planned(
    planned: Iterable[PlannedRun],
    caps_for: Callable[[PlannedRun], Sequence[Cap]],
    start: Start,
    *,
    concurrency: int,
    on_result: Callable[[RunResult], None] | None = None,
) -> list[RunResult]:
    """Run the plan in order, at most ``concurrency`` at a time, never passing any cap.

    ``start`` runs one planned run to the end. Results come back in plan order. The plan is
    consumed as runs start, so a streamed plan is never held whole.
    """
    if concurrency < 1:
        raise errors.InvalidRequest.field("concurrency", "must be at least 1")
    results: dict[int, RunResult] = {}
    changed = asyncio.Condition()
    in_flight = 0
    tasks: list[asyncio.Task[None]] = []

    async def one(i: int, p: PlannedRun, caps: Sequence[Cap], amount: int) -> None:
        nonlocal in_flight
        try:
            result = await start(p)
            # Not admitted: nothing was spent. Ran: give back what was not charged.
            refund = amount if result.run_id is None else max(0, amount - result.charged_micros)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one broken run must not stop the others
            detail = exc.detail if isinstance(exc, errors.EphemeralError) else repr(exc)
            result = unrun(p, "error", detail)
            refund = 0  # admitted or not, spent or not: unknown, so it stays committed
        for cap in caps:
            cap.committed -= refund
        results[i] = result
        async with changed:
            in_flight -= 1
            changed.notify_all()
        if on_result is not None:
            on_result(result)

    for i, p in enumerate(planned):
        caps = caps_for(p)
        amount = p.policy.max_cost_micros
        async with changed:
            while True:
                fits = all(c.fits(amount) for c in caps)
                if in_flight < concurrency and fits:
                    break
                if not fits and in_flight == 0:
                    break
                await changed.wait()
            if not fits:
                tight = next(c for c in caps if not c.fits(amount))
                result = unrun(
                    p,
                    "skipped",
                    (f"budget: {tight.name} has {tight.left} micros left, the run needs {amount}"),
                )
                results[i] = result
                if on_result is not None:
                    on_result(result)
                continue
            for cap in caps:
                cap.committed += amount
            in_flight += 1
        tasks.append(asyncio.create_task(one(i, p, caps, amount)))
        tasks = [t for t in tasks if not t.done()]  # finished ones: nothing left to hold
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
    return [results[i] for i in sorted(results)]


# --------------------------------------------------------------------------- one run


def run_view_output(row: Any, zdr_output: str | None) -> dict[str, Any]:
    from ephemeral.runview import run_object

    obj = run_object(row)
    if obj.get("output") is None and zdr_output is not None:
        obj["output"] = zdr_output
    return obj


@dataclass
class Watchers:
    """What a caller in this process sees of each run as it happens (``ephemeral run RECIPE``
    prints its timeline live): the run id once admitted, then the judged run with its
    output, a zero-data-retention one included (delivered here once, never stored)."""

    admitted: Callable[[str], None] | None = None
    judged: Callable[[Any, str | None, list[CheckResult]], None] | None = None


async def execute_planned(
    runtime: Runtime,
    org_id: str,
    planned: PlannedRun,
    recipe: Recipe,
    suite_run_id: str,
    watchers: Watchers | None = None,
) -> RunResult:
    """Admit, run, judge and record one planned run."""
    from ephemeral.policy import RunRequest

    base = unrun(planned, "refused", "")
    labels = {
        "recipe": planned.recipe,
        "cell": planned.cell,
        "repeat_index": planned.repeat_index,
        "suite_run_id": suite_run_id,
    }
    model = None if planned.model == NO_MODEL else planned.model
    request = RunRequest(
        prompt=planned.prompt, model=model, labels=recipe.labels, **planned.policy.model_dump()
    )
    try:
        row, _ = await runtime.admit(org_id, request, labels=labels)
    except errors.EphemeralError as exc:
        return base.model_copy(update={"detail": exc.detail})
    if watchers is not None and watchers.admitted is not None:
        watchers.admitted(row.id)
    try:
        row = await runtime.execute(row.id)
    finally:
        # The output of a zero-data-retention run exists once, here; judge it now or never.
        zdr_output = runtime.take_zdr_output(row.id)
    events = [e.model_dump(mode="json") for e in await runtime.store.list_events(row.id)]
    verdicts = evaluate(recipe.checks, run_view_output(row, zdr_output), events)
    if planned.policy.zero_data_retention:
        verdicts = [v.model_copy(update={"reason": ZDR_REASON}) for v in verdicts]
    row = await runtime.store.update_run(
        row.id, labels={**row.labels, "checks": [v.model_dump() for v in verdicts]}
    )
    await runtime.record(row.id)  # rewrites the run's records, now with the verdicts
    if watchers is not None and watchers.judged is not None:
        watchers.judged(row, row.output if row.output is not None else zdr_output, verdicts)
    duration = None
    if row.started_at and row.ended_at:
        duration = int((row.ended_at - row.started_at).total_seconds() * 1000)
    settled = row.settled_at is not None
    return base.model_copy(
        update={
            "run_id": row.id,
            "status": row.status,
            "termination_reason": row.termination_reason,
            "detail": row.termination_detail,
            "reserved_micros": row.reserved_micros,
            "charged_micros": row.charged_micros if settled else row.reserved_micros,
            "duration_ms": duration,
            "checks": verdicts,
        }
    )


# --------------------------------------------------------------------------- report


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


class Flip(BaseModel):
    pair_key: str
    check: str
    was: bool
    now: bool


class Comparison(BaseModel):
    previous_suite_run_id: str
    paired: int
    new: int  # runs with no twin in the previous suite run
    missing: int  # runs of the previous suite run with no twin now
    flips: list[Flip]
    cost_delta_micros: int  # over paired runs: now minus before
    previous_charged_micros: int

    @property
    def regressions(self) -> list[Flip]:
        return [f for f in self.flips if f.was and not f.now]

    @property
    def fixes(self) -> list[Flip]:
        return [f for f in self.flips if not f.was and f.now]


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


def compare(
    current: Sequence[RunResult], previous: Sequence[RunResult], previous_id: str
) -> Comparison:
    """Pair runs by :func:`pair_key`: which checks flipped, and the cost delta of the pairs."""
    before = {r.pair_key: r for r in previous}
    now = {r.pair_key: r for r in current if r.run_id is not None}
    flips: list[Flip] = []
    delta = 0
    paired = 0
    for key, run in now.items():
        old = before.get(key)
        if old is None or old.run_id is None:
            continue
        paired += 1
        delta += run.charged_micros - old.charged_micros
        old_checks = {c.check: c.passed for c in old.checks}
        for c in run.checks:
            if c.check in old_checks and old_checks[c.check] != c.passed:
                flips.append(
                    Flip(pair_key=key, check=c.check, was=old_checks[c.check], now=c.passed)
                )
    return Comparison(
        previous_suite_run_id=previous_id,
        paired=paired,
        new=sum(1 for k in now if k not in before),
        missing=sum(1 for k in before if k not in now),
        flips=flips,
        cost_delta_micros=delta,
        previous_charged_micros=sum(r.charged_micros for r in previous),
    )


def load_previous(records: Records, suite_run_id: str) -> list[RunResult]:
    """A previous suite run's results, read back from the recorded runs (DuckDB over Parquet)."""
    import duckdb

    sql = (
        "SELECT run_id, recipe, recipe_cell, repeat_index, status, termination_reason, "
        "reserved_micros, charged_micros, duration_ms, checks "
        "FROM runs WHERE suite_run_id = $1 ORDER BY run_id"
    )
    con = records.connect()
    try:
        rows = con.execute(sql, [suite_run_id]).fetchall()
    except duckdb.Error as exc:
        raise errors.InvalidRequest.field("compare", f"cannot read the records: {exc}") from exc
    finally:
        con.close()
    if not rows:
        raise errors.InvalidRequest.field(
            "compare", f"no recorded runs for suite run {suite_run_id!r}"
        )
    out = []
    for run_id, recipe, cell_text, rep, status, reason, reserved, charged, duration, checks in rows:
        cell = json.loads(cell_text) if cell_text else {}
        out.append(
            RunResult(
                pair_key=pair_key(recipe or "", cell, rep or 0),
                recipe=recipe or "",
                cell=cell,
                repeat_index=rep or 0,
                run_id=run_id,
                status=status,
                termination_reason=reason,
                reserved_micros=reserved,
                charged_micros=charged,
                duration_ms=duration,
                checks=[CheckResult.model_validate(c) for c in json.loads(checks or "[]")],
            )
        )
    return out


# --------------------------------------------------------------------------- the whole thing


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


def evaluation_for(path: str, settings: Settings, **kw: Any) -> Evaluation:
    """A suite file, a recipe file, or the name of a shipped suite or recipe."""
    from ephemeral.recipes import Suite, load_any

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


def last_suite_run(settings: Settings, suite: str) -> str:
    """The latest earlier suite run of ``suite`` on this host (``--compare last``): its report
    in ``<state>/evals``."""
    best: tuple[float, str] | None = None
    for path in (settings.state_dir / "evals").glob("suite_*.json"):
        try:
            doc = json.loads(path.read_text())
            stamp = path.stat().st_mtime
        except (OSError, ValueError):
            continue
        if (
            isinstance(doc, dict)
            and doc.get("suite") == suite
            and (best is None or stamp > best[0])
        ):
            best = (stamp, path.stem)
    if best is None:
        raise errors.InvalidRequest.field(
            "--compare", f"no earlier suite run of {suite!r} on this host to compare with"
        )
    return best[1]


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


# --------------------------------------------------------------------------- rendering


def table_rows(report: Report) -> list[dict[str, Any]]:
    """One row per recipe and check: the pass table (content-free: labels, counts, money).
    ``passed``/``runs`` are over graded runs; ``error``, ``cancelled`` and ``budget`` count the
    recipe's runs that were not graded."""
    rows = []
    for s in report.recipes:
        rows.append(
            {
                "recipe": s.recipe,
                "check": "(all checks)",
                "passed": s.passed,
                "runs": s.graded,
                "pass_rate": round(s.pass_rate, 4),
                "failed": s.outcomes.get(Outcome.FAIL, 0),
                "error": s.outcomes.get(Outcome.ERROR, 0),
                "cancelled": s.outcomes.get(Outcome.CANCELLED, 0),
                "budget": s.outcomes.get(Outcome.BUDGET, 0),
                "charged_micros": s.charged_micros,
                "duration_ms": s.duration_ms,
            }
        )
        if s.epochs > 1:
            rows.append(
                {
                    "recipe": s.recipe,
                    "check": f"pass@{s.epochs} (cells)",
                    "passed": s.cells_passing,
                    "runs": s.cells,
                    "pass_rate": round(s.cells_passing / s.cells, 4) if s.cells else 0.0,
                    "failed": s.cells - s.cells_passing,
                    "error": None,
                    "cancelled": None,
                    "budget": None,
                    "charged_micros": None,
                    "duration_ms": None,
                }
            )
        for c in s.checks:
            rows.append(
                {
                    "recipe": s.recipe,
                    "check": c.check,
                    "passed": c.passed,
                    "runs": c.total,
                    "pass_rate": round(c.rate, 4),
                    "failed": c.total - c.passed,
                    "error": None,
                    "cancelled": None,
                    "budget": None,
                    "charged_micros": None,
                    "duration_ms": None,
                }
            )
    return rows


def render_markdown(report: Report, *, reasons: bool = True) -> str:
    """The summary. ``reasons=False`` leaves out check reasons (they quote run output), for
    places that are not our system of record, such as Prefect artifacts."""
    verdict = "PASSED" if report.passed else "FAILED"
    lines = [
        f"# Eval `{report.suite}`: {verdict}",
        "",
        f"Suite run `{report.suite_run_id}` · {sum(s.planned for s in report.recipes)} runs · "
        f"charged {usd(report.charged_micros)}"
        + (f" of a {usd(report.budget_micros)} budget" if report.budget_micros else "")
        + f" · {report.wall_ms / 1000:.1f} s · gate min_pass_rate {report.min_pass_rate:.0%}",
        "",
        "| recipe | check | passed | rate | error | cancelled | budget | charged | run time |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in table_rows(report):
        charged = usd(row["charged_micros"]) if row["charged_micros"] is not None else ""
        took = f"{row['duration_ms'] / 1000:.1f} s" if row["duration_ms"] is not None else ""
        check = row["check"].replace("|", "\\|")
        apart = " | ".join(
            "" if row[k] is None else str(row[k]) for k in ("error", "cancelled", "budget")
        )
        lines.append(
            f"| {row['recipe']} | {check} | {row['passed']}/{row['runs']} | "
            f"{row['pass_rate']:.0%} | {apart} | {charged} | {took} |"
        )
    lines.append("")
    for failure in report.gate_failures:
        lines.append(f"- gate failed: {failure}")
    failing = [(r, c) for r in report.results if r.graded for c in r.checks if not c.passed]
    not_run = [r for r in report.results if not r.graded]
    if not_run:
        lines += ["", "## Not graded", ""]
        lines += [
            f"- `{r.pair_key}`: {r.outcome} ({r.status}"
            + (f", `{r.run_id}`" if r.run_id else "")
            + f"): {r.detail}"
            for r in not_run
        ]
    if failing:
        lines += ["", "## Failing checks", ""]
        for r, c in failing[:MAX_SHOWN_FAILURES]:
            why = f": {c.reason}" if reasons else ""
            lines.append(f"- `{r.run_id}` ({r.pair_key}) {c.check}{why}")
        if len(failing) > MAX_SHOWN_FAILURES:
            lines.append(f"- … and {len(failing) - MAX_SHOWN_FAILURES} more")
    lines += ["", *render_comparison(report.comparison)]
    return "\n".join(lines).rstrip() + "\n"


def render_comparison(cmp: Comparison | None) -> list[str]:
    if cmp is None:
        return ["Not compared with a previous suite run (use `--compare SUITE_RUN_ID`)."]
    lines = [
        f"## Compared with `{cmp.previous_suite_run_id}`",
        "",
        f"{cmp.paired} paired runs ({cmp.new} new, {cmp.missing} missing); "
        f"cost of the paired runs {usd(cmp.cost_delta_micros, signed=True)} "
        f"(previous suite run charged "
        f"{usd(cmp.previous_charged_micros)}).",
        "",
    ]
    if not cmp.flips:
        lines.append("No check changed its verdict.")
    for f in cmp.regressions:
        lines.append(f"- REGRESSED `{f.pair_key}` {f.check}: passed before, fails now")
    for f in cmp.fixes:
        lines.append(f"- FIXED `{f.pair_key}` {f.check}: failed before, passes now")
    return lines


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


def purge_reports(settings: Settings, retention_days: int, *, now: float | None = None) -> int:
    """Delete suite summaries older than retention: their check reasons quote run output.

    Pass rates and costs stay answerable from the records, which keep billing figures.
    """
    import time

    cutoff = (now if now is not None else time.time()) - retention_days * 86_400
    removed = 0
    for path in (settings.state_dir / "evals").glob("*.*"):
        if path.suffix in (".json", ".md") and path.stat().st_mtime < cutoff:
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def write_report(report: Report, settings: Settings) -> Path:
    """Keep the summary next to the records: ``<state>/evals/<suite_run_id>.{json,md}``."""
    import os

    out = settings.state_dir / "evals"
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{report.suite_run_id}.json"
    for path, text in (
        (target, json.dumps(report_json(report), indent=2) + "\n"),
        (target.with_suffix(".md"), render_markdown(report)),
    ):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return target
