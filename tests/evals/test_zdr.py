"""Zero data retention: checks judge the output before it is dropped; reasons are not kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ephemeral.evals.execute import ZDR_REASON
from ephemeral.evals.plan import Evaluation
from ephemeral.evals.store import write_report
from ephemeral.evals.suite import run_evaluation
from ephemeral.recipes.recipe import load_recipe
from ephemeral.records import Records
from ephemeral.settings import Settings
from tests import runlevel
from tests.evals.conftest import write_cassette
from tests.recipes.helpers import write

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

CANARY = "CANARY-zdr-eval-5e1f"  # the checks match it without spelling it out


async def test_zdr_output_is_judged_once_and_not_kept(tmp_path: Path) -> None:
    cassettes = tmp_path / "cassettes"
    model = write_cassette(cassettes, "zdr-eval", [f"echo {CANARY}"], f"done: {CANARY}")
    settings = Settings.load(
        state_dir=tmp_path / "state", cassettes_dir=cassettes, use_prefect=False
    )
    recipe = load_recipe(
        write(
            tmp_path,
            f"""
        name: zdr
        model: {model}
        prompt: say the canary
        policy: {{zero_data_retention: true, timeout_seconds: 60, max_cost_micros: 20000}}
        checks:
          - output_matches: "CANARY-zdr-eval-[0-9a-f]{{4}}"
          - output_matches: "absent-CANARY"
          - shell: {{command_matches: "echo", exit_code: 0}}
    """,
        )
    )
    async with runlevel.started(settings) as runtime:
        report = await run_evaluation(runtime, Evaluation(name="zdr", recipes=[recipe]))
        [r] = report.results
        # The output existed once, in this process: the check saw it.
        assert [c.passed for c in r.checks] == [True, False, False]
        assert all(c.reason == ZDR_REASON for c in r.checks)
        assert runtime.take_zdr_output(r.run_id or "") is None
        row = await runtime.store.runs.get(r.run_id or "")
        assert row.output is None
        assert [c["passed"] for c in row.labels["checks"]] == [True, False, False]
    write_report(report, settings)
    for path in (settings.state_dir).rglob("*"):
        if path.is_file() and path.suffix in (".json", ".md", ".parquet", ".db"):
            assert CANARY.encode() not in path.read_bytes(), path
    _, rows = Records(settings.records_dir).query("SELECT checks FROM runs")
    assert [c["passed"] for c in json.loads(rows[0][0])] == [True, False, False]
