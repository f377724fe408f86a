"""The analysis commands, run through the real ``ephemeral`` app."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ephemeral.cli import app
from ephemeral.records import write_run
from ephemeral.settings import Settings
from tests.records.helpers import make_run


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    state = tmp_path / "state"
    records_dir = Settings.load(state_dir=state).records_dir
    # runs dated now, so the default 30-day window of the commands includes them
    for model, charged, days in (
        ("openai/a", 3530, 0),
        ("anthropic/b", 1200, 0),
        ("openai/a", 10, 3),
    ):
        write_run(
            records_dir, *make_run(model=model, charged_micros=charged, created_at=_now_minus(days))
        )
    return {"EPHEMERAL_STATE_DIR": str(state)}


def _now_minus(days: int):  # type: ignore[no-untyped-def]
    from datetime import timedelta

    from ephemeral.ids import utcnow

    return utcnow() - timedelta(days=days)


def _run(args: list[str], env: dict[str, str]):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, args, env=env)


def test_costs_table_prints_usd(env: dict[str, str]) -> None:
    result = _run(["costs", "--by", "model"], env)
    assert result.exit_code == 0, result.output
    assert "openai/a" in result.output and "$0.00354" in result.output  # 3540 micros
    assert "anthropic/b" in result.output and "$0.0012" in result.output
    assert "$0.00474" in result.output  # the total row


def test_costs_csv_and_json_carry_raw_micros(env: dict[str, str]) -> None:
    result = _run(["costs", "--by", "model", "--format", "csv"], env)
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    by_key = {r["key"]: r for r in rows}
    assert by_key["openai/a"]["charged_micros"] == "3540"
    assert by_key["openai/a"]["charged_usd"] == "$0.00354"
    result = _run(["costs", "--by", "day", "--since", "2d", "--format", "json"], env)
    assert result.exit_code == 0, result.output
    items = json.loads(result.stdout)
    assert [i["runs"] for i in items] == [2] and items[0]["charged_micros"] == 4730


def test_costs_rejects_bad_input_naming_the_field(env: dict[str, str]) -> None:
    result = _run(["costs", "--by", "colour"], env)
    assert result.exit_code == 2
    assert "by: must be one of model, recipe, day, org, status" in result.output
    result = _run(["costs", "--by", "model", "--since", "yesterday"], env)
    assert result.exit_code == 2 and "since:" in result.output


def test_query_formats_and_errors(env: dict[str, str]) -> None:
    result = _run(
        [
            "query",
            "SELECT model, count(*) AS n FROM runs GROUP BY 1 ORDER BY 1",
            "--format",
            "json",
        ],
        env,
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [
        {"model": "anthropic/b", "n": 1},
        {"model": "openai/a", "n": 2},
    ]
    result = _run(["query", "SELECT count(*) AS n FROM steps"], env)
    assert result.exit_code == 0 and "6" in result.output
    result = _run(["query", "SELECT FROM WHERE"], env)
    assert result.exit_code == 2 and "error: sql:" in result.output


def test_records_compact_purge_and_report(env: dict[str, str], tmp_path: Path) -> None:
    result = _run(["records", "compact"], env)
    assert result.exit_code == 0 and "compacted 3 files" in result.output
    result = _run(["records", "purge", "--retention-days", "1"], env)
    assert result.exit_code == 0 and "purged content of" in result.output
    out = tmp_path / "costs.html"
    result = _run(["report", "costs", "--html", str(out), "--since", "30d"], env)
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert 'id="total-charged">$0.00474<' in page
    assert "https://" not in page and "http://" not in page
