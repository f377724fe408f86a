"""A report as the pass table and as Markdown (the saved summary, the Prefect artifact)."""

from __future__ import annotations

from typing import Any

from ephemeral.engine.outcomes import Outcome
from ephemeral.evals.compare import Comparison
from ephemeral.evals.report import Report
from ephemeral.money.amounts import usd

MAX_SHOWN_FAILURES = 20


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
