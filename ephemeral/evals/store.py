"""Where suite runs are kept: reports in ``<state>/evals``, earlier results read back from the
records (for ``--compare``), and retention."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ephemeral import errors
from ephemeral.evals.render import render_markdown
from ephemeral.evals.report import Report, report_json
from ephemeral.evals.result import RunResult, pair_key
from ephemeral.recipes.checks import CheckResult

if TYPE_CHECKING:
    from ephemeral.records import Records
    from ephemeral.settings import Settings


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
