"""The shipped coding suite end to end, offline, in real sandboxes of the python-dev image, and
its sample set exported as JSONL and Parquet, both read back by DuckDB."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest

from ephemeral.evals.plan import Evaluation
from ephemeral.evals.suite import run_evaluation
from ephemeral.recipes.recipe import load_recipe
from ephemeral.records.export import COLUMNS, export_suite_run
from ephemeral.settings import Settings
from tests import runlevel
from tests.drivers import built_image
from tests.evals.conftest import REPO, cli, write_cassette
from tests.recipes.helpers import write

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

CODING = str(REPO / "recipes" / "suites" / "coding.yaml")


def _obj(value: object) -> object:
    """A JSON column: DuckDB reads JSONL objects as structs, Parquet JSON as text."""
    return json.loads(value) if isinstance(value, str) else value


def test_coding_suite_passes_offline_and_exports_its_samples(
    state_dir: Path, tmp_path: Path
) -> None:
    built = built_image(Settings.load(state_dir=state_dir), "python-dev")
    run = cli(state_dir, "eval", CODING, "--no-prefect")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 runs: 3 pass · 0 fail · 0 error" in run.stdout and "PASSED" in run.stdout
    suite_run_id = run.stdout.rsplit("--compare ", 1)[1].split()[0]

    jsonl, parquet = tmp_path / "samples.jsonl", tmp_path / "samples.parquet"
    for fmt, out in (("jsonl", jsonl), ("parquet", parquet)):
        done = cli(state_dir, "export", suite_run_id, "--format", fmt, "--out", str(out))
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("3 runs")

    con = duckdb.connect()
    for source in (f"read_json('{jsonl}')", f"read_parquet('{parquet}')"):
        rel = con.sql(f"SELECT * FROM {source} ORDER BY cell->>'function'")
        assert tuple(rel.columns) == COLUMNS
        rows = [dict(zip(rel.columns, r, strict=True)) for r in rel.fetchall()]
        assert [_obj(r["cell"])["function"] for r in rows] == ["add", "mul", "sub"]
        for r in rows:
            assert (r["recipe"], r["model"], r["repeat"]) == (
                "fix-the-test",
                "replay/fix-the-test",
                0,
            )
            assert (r["status"], r["passed"]) == ("succeeded", True)
            assert (r["image"], r["image_hash"]) == ("python-dev", built.hash)
            assert r["host"] and r["suite_run_id"] == suite_run_id
            assert "3 passed" in r["output"] and "calc." in r["prompt"]
            verify = _obj(r["verify"])
            assert [v["exit_code"] for v in verify] == [0] and "3 passed" in verify[0]["stdout"]
            verdicts = _obj(r["verdicts"])
            assert len(verdicts) == 7 and all(v["passed"] for v in verdicts)
            assert r["input_tokens"] == 520 + 940 + 1130 + 1320
            assert 0 < r["charged_micros"] <= 20_000

    missing = cli(state_dir, "export", "suite_nope", "--out", str(tmp_path / "x.jsonl"))
    assert missing.returncode == 3 and "no recorded runs for suite run 'suite_nope'" in (
        missing.stderr
    )


async def test_a_zero_data_retention_run_exports_without_content(tmp_path: Path) -> None:
    cassettes = tmp_path / "cassettes"
    model = write_cassette(cassettes, "zdr-export", ["echo secret-stdout"], "secret-output")
    settings = Settings.load(
        state_dir=tmp_path / "state", cassettes_dir=cassettes, use_prefect=False
    )
    recipe = load_recipe(
        write(
            tmp_path,
            f"""
        name: zdr-export
        model: {model}
        prompt: secret-prompt
        verify: ["echo secret-verify; exit 4"]
        verify_timeout_seconds: 10
        policy: {{zero_data_retention: true, timeout_seconds: 60, max_cost_micros: 20000}}
        checks:
          - verify: {{exit_code: 4}}
    """,
        )
    )
    async with runlevel.started(settings) as runtime:
        report = await run_evaluation(runtime, Evaluation(name="zdr", recipes=[recipe]))
    [result] = report.results
    assert result.status == "succeeded" and result.passed  # judged on the exit code alone
    out = tmp_path / "zdr.jsonl"
    assert export_suite_run(settings.records_dir, report.suite_run_id, out) == 1
    text = out.read_text()
    assert "secret" not in text
    [row] = [json.loads(line) for line in text.splitlines()]
    assert row["prompt"] is None and row["output"] is None
    assert row["zero_data_retention"] is True and row["passed"] is True
    assert row["verify"] == [
        {"exit_code": 4, "duration_ms": row["verify"][0]["duration_ms"], "timed_out": False}
    ]
    assert row["verdicts"][0]["reason"] == "(removed)"  # the records keep no reason
