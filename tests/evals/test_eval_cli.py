"""``ephemeral eval``: the smoke suite end to end in real sandboxes, gates, budgets, compare."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.evals.conftest import REPO, cli
from tests.recipes.helpers import write
from tests.sample import SAMPLE_PROMPT

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

SMOKE = str(REPO / "recipes" / "suites" / "smoke.yaml")
RECIPES = ("sandbox-proof", "exit-codes", "file-roundtrip")


def test_smoke_suite_runs_records_and_compares(state_dir: Path) -> None:
    first = cli(state_dir, "eval", SMOKE, "--no-prefect")
    assert first.returncode == 0, first.stdout + first.stderr
    out = first.stdout
    assert "3 runs: 3 pass · 0 fail · 0 error · 0 cancelled · 0 budget" in out
    for name in RECIPES:
        assert f"{name}/{{}}/0  PASS" in out
        assert name in out
    assert "PASSED" in out
    suite_run_id = out.rsplit("--compare ", 1)[1].split()[0]
    assert suite_run_id.startswith("suite_")
    assert (state_dir / "evals" / f"{suite_run_id}.md").is_file()
    assert f"page: /suites/{suite_run_id} (ephemeral view" in first.stderr

    costs = cli(state_dir, "costs", "--by", "recipe", "--format", "json")
    assert costs.returncode == 0, costs.stderr
    by_recipe = {row["key"]: row for row in json.loads(costs.stdout)}
    assert set(by_recipe) == set(RECIPES)
    assert all(row["runs"] == 1 and row["charged_micros"] > 0 for row in by_recipe.values())

    checks = cli(
        state_dir, "query", "SELECT recipe, checks, suite_run_id FROM runs", "--format", "json"
    )
    assert checks.returncode == 0, checks.stderr
    for row in json.loads(checks.stdout):
        verdicts = json.loads(row["checks"])
        assert row["suite_run_id"] == suite_run_id
        assert len(verdicts) == 9 and all(v["passed"] for v in verdicts), verdicts

    second = cli(state_dir, "eval", SMOKE, "--no-prefect", "--json", "--compare", suite_run_id)
    assert second.returncode == 0, second.stderr
    report = json.loads(second.stdout)
    assert report["passed"] is True
    cmp = report["comparison"]
    assert cmp["previous_suite_run_id"] == suite_run_id
    assert (cmp["paired"], cmp["new"], cmp["missing"], cmp["flips"]) == (3, 0, 0, [])
    assert "[3/3]" in second.stderr  # live progress goes to stderr under --json

    unknown = cli(state_dir, "eval", SMOKE, "--no-prefect", "--compare", "suite_nope")
    assert unknown.returncode == 2
    assert "no recorded runs for suite run 'suite_nope'" in unknown.stderr


def test_failing_gate_and_recipe_budget(tmp_path: Path, state_dir: Path) -> None:
    # Two runs of the sample under a recipe budget that holds exactly one worst case: the
    # second cannot start even after the first settles (its charge stays committed).
    recipe = write(
        tmp_path,
        """
        name: proof-twice
        model: replay/sandbox-proof
        prompt: SAMPLE
        repeat: 2
        budget_micros: 40000
        policy: {max_cost_micros: 40000, timeout_seconds: 60}
        checks:
          - status: succeeded
          - output_contains: "this is not in the output"
    """.replace("SAMPLE", json.dumps(SAMPLE_PROMPT)),
        name="proof-twice.yaml",
    )
    suite = write(
        tmp_path,
        f"""
        name: gated
        recipes: [{recipe}]
        gates: {{min_pass_rate: 0.5}}
    """,
        name="suite.yaml",
    )
    res = cli(state_dir, "eval", str(suite), "--no-prefect", "--json")
    assert res.returncode == 1, res.stdout + res.stderr
    report = json.loads(res.stdout)
    first, second = report["results"]
    assert first["status"] == "succeeded" and first["run_id"]
    assert [c["passed"] for c in first["checks"]] == [True, False]
    assert "not in the output" in first["checks"][1]["reason"]
    assert second["status"] == "skipped" and second["run_id"] is None
    assert "budget: recipe proof-twice" in second["detail"]
    assert [r["outcome"] for r in report["results"]] == ["fail", "budget"]
    assert report["outcomes"] == {"pass": 0, "fail": 1, "error": 0, "cancelled": 0, "budget": 1}
    assert report["gate_failures"] == [
        "proof-twice: pass rate 0% (0/1 graded) below min_pass_rate 50%",
        "proof-twice: 1 budget not graded (1/2 runs graded)",
    ]
    assert report["charged_micros"] <= 40_000


def test_a_bad_recipe_starts_nothing(tmp_path: Path, state_dir: Path) -> None:
    recipe = write(
        tmp_path,
        """
        name: bad
        model: nobody/unknown-model
        prompt: hi
    """,
        name="bad.yaml",
    )
    suite = write(tmp_path, f"name: s\nrecipes: [{recipe}]\n", name="s.yaml")
    res = cli(state_dir, "eval", str(suite), "--no-prefect")
    assert res.returncode == 2
    assert "model" in res.stderr
    assert not list(state_dir.rglob("*.parquet"))


@pytest.mark.prefect
def test_smoke_suite_through_embedded_prefect(state_dir: Path) -> None:
    """The default path: each run an agent-run subflow of eval-suite, Prefect in the state dir."""
    res = cli(state_dir, "eval", SMOKE)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "3 runs: 3 pass · 0 fail · 0 error · 0 cancelled · 0 budget" in res.stdout
    suite_run_id = res.stdout.rsplit("--compare ", 1)[1].split()[0]
    report = json.loads((state_dir / "evals" / f"{suite_run_id}.json").read_text())
    assert [r["status"] for r in report["results"]] == ["succeeded"] * 3
    assert (state_dir / "prefect" / "prefect.db").is_file()  # embedded Prefect, in the state dir
    costs = cli(state_dir, "costs", "--by", "recipe", "--format", "json")
    assert {row["key"] for row in json.loads(costs.stdout)} == set(RECIPES)
