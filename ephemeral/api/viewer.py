"""The results viewer: the recorded runs (``/runs``), a suite run (``/suites/{id}``) and two
suite runs side by side (``/suites/{a}/compare/{b}``).

Read from the records (DuckDB over Parquet), so they show what was recorded: settled runs,
with their outcome, verdicts and verify output. Only the signed-in member's org is shown. A
suite run's gate comes from its saved report (``<state>/evals/<id>.json``) when it is there.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from ephemeral.api.auth import get_runtime, page_principal
from ephemeral.api.pages import _login_redirect, render
from ephemeral.evals.compare import compare
from ephemeral.evals.render import table_rows
from ephemeral.evals.report import Report
from ephemeral.evals.result import RunResult, pair_key
from ephemeral.records import Records
from ephemeral.store import Principal

PAGE_SIZE = 50
OUTPUT_TAIL = 2_000  # characters of a failing verify command's stdout/stderr shown
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_SUITE_ID = re.compile(r"^suite_[0-9a-z]{1,64}$")
_FAILURE_ORDER = {"error": 0, "fail": 1, "budget": 2, "cancelled": 3, "pass": 4}

viewer = APIRouter(include_in_schema=False)


def _query(runtime: Any, sql: str, params: list[Any]) -> list[dict[str, Any]]:
    records = Records(runtime.settings.records_dir)
    try:
        columns, rows = records.select(sql, params)
    finally:
        records.close()
    return [dict(zip(columns, r, strict=True)) for r in rows]


def _not_found(request: Request, who: Principal, detail: str) -> Response:
    return render(request, "error.html.j2", 404, title="Not found", detail=detail, signed_in=who)


@viewer.get("/runs")
async def runs_list(
    request: Request,
    status: Annotated[str | None, Query(max_length=32)] = None,
    recipe: Annotated[str | None, Query(max_length=128)] = None,
    model: Annotated[str | None, Query(max_length=200)] = None,
    suite: Annotated[str | None, Query(max_length=80)] = None,
    date: Annotated[str | None, Query(max_length=10)] = None,
    page: Annotated[int, Query(ge=1, le=10_000)] = 1,
) -> Response:
    """The recorded runs, newest first, filtered and paged."""
    who = await page_principal(request)
    if who is None:
        return _login_redirect(request)
    asked = {"status": status, "recipe": recipe, "model": model, "suite": suite, "date": date}
    filters: dict[str, str] = {k: v for k, v in asked.items() if v}
    if "date" in filters and not _DATE.match(filters["date"]):
        return render(
            request,
            "error.html.j2",
            422,
            title="Bad filter",
            detail="date: YYYY-MM-DD",
            signed_in=who,
        )
    where: list[str] = ["org_id = $1"]
    params: list[Any] = [who.org_id]
    columns = {"status": "status", "recipe": "recipe", "model": "model", "suite": "suite_run_id"}
    for name, value in filters.items():
        params.append(value)
        if name == "date":
            where.append(f'"date" = CAST(${len(params)} AS DATE)')
        else:
            where.append(f"{columns[name]} = ${len(params)}")
    sql = (
        "SELECT run_id, created_at, status, outcome, model, recipe, suite_run_id, kind, "
        f"charged_micros, duration_ms FROM runs WHERE {' AND '.join(where)} "
        f"ORDER BY created_at DESC, run_id LIMIT {PAGE_SIZE + 1} OFFSET {(page - 1) * PAGE_SIZE}"
    )
    rows = await asyncio.to_thread(_query, get_runtime(request), sql, params)
    more = len(rows) > PAGE_SIZE

    def link(**change: Any) -> str:
        from urllib.parse import urlencode

        return "/runs?" + urlencode({**filters, **change})

    return render(
        request,
        "runs.html.j2",
        signed_in=who,
        runs=rows[:PAGE_SIZE],
        filters=filters,
        page=page,
        next_link=link(page=page + 1) if more else None,
        prev_link=link(page=page - 1) if page > 1 else None,
    )


_SUITE_SQL = (
    "SELECT run_id, recipe, recipe_cell, repeat_index, model, status, termination_reason, "
    "outcome, charged_micros, model_micros, web_micros, compute_micros, duration_ms, checks, "
    "verify, created_at FROM runs WHERE suite_run_id = $1 AND org_id = $2 "
    "ORDER BY recipe, recipe_cell, repeat_index, run_id"
)


def _tail(text: Any) -> str:
    return text[-OUTPUT_TAIL:] if isinstance(text, str) else ""


def _suite_runs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        checks = json.loads(r["checks"] or "[]")
        verify = [
            {
                "command": v.get("command"),  # None under zero data retention
                "exit_code": v.get("exit_code"),
                "timed_out": bool(v.get("timed_out")),
                "skipped": v.get("skipped"),
                "stdout": _tail(v.get("stdout")),
                "stderr": _tail(v.get("stderr")),
            }
            for v in json.loads(r["verify"] or "[]")
        ]
        outcome = r["outcome"] or "?"
        out.append({**r, "checks": checks, "verify": verify, "outcome": outcome})
    return out


def _saved_report(runtime: Any, suite_run_id: str) -> Report | None:
    path = runtime.settings.state_dir / "evals" / f"{suite_run_id}.json"
    try:
        return Report.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None


@viewer.get("/suites/{suite_run_id}")
async def suite_page(request: Request, suite_run_id: str) -> Response:
    """One suite run: the pass table, the gate, failures first with their verify output, the
    cost split, and a link to each run's page."""
    who = await page_principal(request)
    if who is None:
        return _login_redirect(request)
    runtime = get_runtime(request)
    if not _SUITE_ID.match(suite_run_id):
        return _not_found(request, who, f"no suite run {suite_run_id!r}")
    rows = await asyncio.to_thread(_query, runtime, _SUITE_SQL, [suite_run_id, who.org_id])
    if not rows:
        return _not_found(request, who, f"no recorded runs for suite run {suite_run_id!r}")
    runs = _suite_runs(rows)
    report = _saved_report(runtime, suite_run_id)
    failures = sorted(
        (r for r in runs if r["outcome"] != "pass"), key=lambda r: _FAILURE_ORDER[r["outcome"]]
    )
    split = {
        k: sum(r[f"{k}_micros"] or 0 for r in runs) for k in ("charged", "model", "web", "compute")
    }
    counts = {o: sum(1 for r in runs if r["outcome"] == o) for o in _FAILURE_ORDER}
    return render(
        request,
        "suite.html.j2",
        signed_in=who,
        suite_run_id=suite_run_id,
        report=report,
        table=table_rows(report) if report is not None else [],
        runs=runs,
        failures=failures,
        split=split,
        counts=counts,
    )


@viewer.get("/suites/{before}/compare/{after}")
async def compare_page(request: Request, before: str, after: str) -> Response:
    """Two suite runs, paired run by run: verdicts that changed, cost and time deltas."""
    who = await page_principal(request)
    if who is None:
        return _login_redirect(request)
    runtime = get_runtime(request)
    sides = []
    for suite_run_id in (before, after):
        if not _SUITE_ID.match(suite_run_id):
            return _not_found(request, who, f"no suite run {suite_run_id!r}")
        rows = await asyncio.to_thread(_query, runtime, _SUITE_SQL, [suite_run_id, who.org_id])
        if not rows:
            return _not_found(request, who, f"no recorded runs for suite run {suite_run_id!r}")
        sides.append(_results(rows))
    old, new = sides
    cmp = compare(new, old, before)
    was = {r.pair_key: r for r in old}
    changed = [
        {"pair_key": r.pair_key, "was": was[r.pair_key], "now": r}
        for r in new
        if r.pair_key in was and was[r.pair_key].outcome != r.outcome
    ]
    time_before = sum(r.duration_ms or 0 for r in old)
    time_after = sum(r.duration_ms or 0 for r in new)
    return render(
        request,
        "compare.html.j2",
        signed_in=who,
        before=before,
        after=after,
        cmp=cmp,
        changed=changed,
        cost_before=sum(r.charged_micros for r in old),
        cost_after=sum(r.charged_micros for r in new),
        time_before=time_before,
        time_after=time_after,
    )


def _results(rows: list[dict[str, Any]]) -> list[RunResult]:
    from ephemeral.recipes.checks import CheckResult

    out = []
    for r in rows:
        cell = json.loads(r["recipe_cell"]) if r["recipe_cell"] else {}
        out.append(
            RunResult(
                pair_key=pair_key(r["recipe"] or "", cell, r["repeat_index"] or 0),
                recipe=r["recipe"] or "",
                cell=cell,
                repeat_index=r["repeat_index"] or 0,
                run_id=r["run_id"],
                status=r["status"],
                termination_reason=r["termination_reason"],
                charged_micros=r["charged_micros"] or 0,
                duration_ms=r["duration_ms"],
                checks=[CheckResult.model_validate(c) for c in json.loads(r["checks"] or "[]")],
            )
        )
    return out
