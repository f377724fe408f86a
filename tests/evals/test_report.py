"""Pairing and comparison, gates, and the summary rendering (no Prefect, no sandbox)."""

from __future__ import annotations

from ephemeral.evals.compare import compare
from ephemeral.evals.render import render_markdown, table_rows
from ephemeral.evals.report import Report
from ephemeral.evals.result import RunResult, pair_key
from ephemeral.evals.stats import gate_failures, recipe_stats
from ephemeral.recipes.checks import CheckResult
from ephemeral.recipes.recipe import load_recipe
from tests.recipes.helpers import write


def result(
    key_index: int,
    checks: dict[str, bool],
    charged: int,
    recipe: str = "r",
    cell: dict | None = None,
    status: str = "succeeded",
) -> RunResult:
    cell = cell or {}
    return RunResult(
        pair_key=pair_key(recipe, cell, key_index),
        recipe=recipe,
        cell=cell,
        repeat_index=key_index,
        run_id=f"run_{key_index:032x}",
        status=status,
        charged_micros=charged,
        reserved_micros=40_000,
        duration_ms=1000,
        checks=[CheckResult(check=k, passed=v, reason=f"why {k}") for k, v in checks.items()],
    )


def test_pair_key_matches_planned_runs(tmp_path) -> None:
    from ephemeral.recipes.recipe import expand

    path = write(
        tmp_path,
        """
        name: m
        prompt: "{{ lang }} {{ n }}"
        matrix: {lang: [py, sh], n: [1, 2.5]}
        repeat: 2
    """,
    )
    for p in expand(load_recipe(path), default_model="replay/x"):
        assert pair_key(p.recipe, p.cell, p.repeat_index) == p.pair_key()


def test_compare_finds_flips_and_cost_delta() -> None:
    before = [
        result(0, {"a": True, "b": True}, 1000),
        result(1, {"a": False}, 500),
        result(2, {"a": True}, 700),
    ]
    now = [
        result(0, {"a": True, "b": False}, 1500),
        result(1, {"a": True}, 400),
        result(3, {"a": True}, 900),
    ]
    cmp = compare(now, before, "suite_old")
    assert cmp.paired == 2 and cmp.new == 1 and cmp.missing == 1
    assert [(f.pair_key, f.check) for f in cmp.regressions] == [("r/{}/0", "b")]
    assert [(f.pair_key, f.check) for f in cmp.fixes] == [("r/{}/1", "a")]
    assert cmp.cost_delta_micros == (1500 - 1000) + (400 - 500)
    assert cmp.previous_charged_micros == 2200


def test_compare_pairs_by_cell_not_by_position() -> None:
    before = [
        result(0, {"a": True}, 10, cell={"lang": "py"}),
        result(0, {"a": False}, 10, cell={"lang": "sh"}),
    ]
    now = [
        result(0, {"a": False}, 10, cell={"lang": "sh"}),
        result(0, {"a": True}, 10, cell={"lang": "py"}),
    ]
    assert compare(now, before, "x").flips == []


def _recipe(tmp_path, checks: str = "", repeat: int = 4) -> object:
    return load_recipe(
        write(
            tmp_path,
            f"""
        name: r
        prompt: hi
        repeat: {repeat}
        checks:
          - status: succeeded
          - output_contains: "ok"
        {checks}
    """,
        )
    )


def test_pass_rate_is_over_graded_runs_and_the_rest_fail_the_gate_apart(tmp_path) -> None:
    recipe = _recipe(tmp_path, repeat=6)
    both = {"status: succeeded": True, "output_contains: ok": True}
    results = [
        result(0, both, 10),
        result(1, both, 10),
        result(2, {"status: succeeded": True, "output_contains: ok": False}, 10),
        RunResult(pair_key="r/{}/3", recipe="r", repeat_index=3, status="skipped", detail="budget"),
        # The sandbox died under the run: its checks fail, but the model is not to blame.
        result(
            4, {"status: succeeded": False, "output_contains: ok": False}, 10, status="failed"
        ).model_copy(update={"termination_reason": "sandbox_error"}),
        result(5, both, 10, status="cancelled").model_copy(
            update={"termination_reason": "cancelled"}
        ),
    ]
    assert [r.outcome for r in results] == ["pass", "pass", "fail", "budget", "error", "cancelled"]
    [stat] = recipe_stats([recipe], results)
    assert (stat.planned, stat.ran, stat.passed, stat.skipped, stat.graded) == (6, 5, 2, 1, 3)
    assert stat.outcomes == {"pass": 2, "fail": 1, "error": 1, "cancelled": 1, "budget": 1}
    assert stat.pass_rate == 2 / 3
    assert {c.check: (c.passed, c.total) for c in stat.checks} == {
        "status: succeeded": (3, 3),
        "output_contains: ok": (2, 3),
    }
    assert gate_failures([stat], 0.5) == [
        "r: 1 error, 1 cancelled, 1 budget not graded (3/6 runs graded)"
    ]
    rate, apart = gate_failures([stat], 0.75)
    assert rate == "r: pass rate 67% (2/3 graded) below min_pass_rate 75%"
    assert apart.startswith("r: 1 error")
    # Only graded runs pass the gate; a recipe with all runs graded and passing has no failure.
    [clean] = recipe_stats([recipe], results[:2])
    assert gate_failures([clean], 1.0) == []


def test_a_dead_sandbox_is_never_a_pass() -> None:
    # Every check passed, but the run ended on an infrastructure error: an error, not a pass.
    dead = result(0, {"output_contains: ok": True}, 1, status="failed").model_copy(
        update={"termination_reason": "sandbox_error"}
    )
    assert dead.outcome == "error" and not dead.passed and not dead.graded
    for reason in ("infra_error", "model_error", "setup_failed"):
        assert dead.model_copy(update={"termination_reason": reason}).outcome == "error"
    assert (
        result(0, {}, 1, status="timed_out")
        .model_copy(update={"termination_reason": "timeout"})
        .outcome
        == "fail"
    )
    assert RunResult(pair_key="k", recipe="r", status="refused").outcome == "error"
    assert RunResult(pair_key="k", recipe="r", status="error").outcome == "error"
    # A saved report's outcome is derived again on load, never taken from the file.
    saved = dead.model_dump(mode="json")
    assert saved["outcome"] == "error"
    assert RunResult.model_validate({**saved, "outcome": "pass"}).outcome == "error"


def test_a_run_without_checks_passes_when_it_succeeded() -> None:
    assert result(0, {}, 1).passed
    assert not result(0, {}, 1, status="failed").passed
    assert not RunResult(pair_key="k", recipe="r", status="refused").passed


def _report(tmp_path, comparison=None) -> Report:
    recipe = _recipe(tmp_path)
    results = [
        result(i, {"status: succeeded": True, "output_contains: ok": i != 1}, 100) for i in range(4)
    ]
    stats = recipe_stats([recipe], results)
    return Report(
        suite="smoke",
        suite_run_id="suite_abc",
        min_pass_rate=1.0,
        budget_micros=200_000,
        wall_ms=4200,
        results=results,
        recipes=stats,
        comparison=comparison,
        gate_failures=gate_failures(stats, 1.0),
    )


def test_summary_markdown_and_table(tmp_path) -> None:
    old = [
        result(i, {"status: succeeded": True, "output_contains: ok": True}, 50) for i in range(4)
    ]
    report = _report(tmp_path)
    report = report.model_copy(update={"comparison": compare(report.results, old, "suite_old")})
    md = render_markdown(report)
    assert md.startswith("# Eval `smoke`: FAILED")
    assert "| r | (all checks) | 3/4 | 75% | 0 | 0 | 0 | $0.0004 | 4.0 s |" in md
    assert "| r | output_contains: ok | 3/4 | 75% |  |  |  |" in md
    assert "gate failed: r: pass rate 75% (3/4 graded)" in md
    assert "why output_contains: ok" in md  # the reason, for our own records
    assert "## Compared with `suite_old`" in md
    assert "4 paired runs (0 new, 0 missing); cost of the paired runs +$0.0002" in md
    assert "REGRESSED `r/{}/1` output_contains: ok" in md
    rows = table_rows(report)
    assert rows[0] == {
        "recipe": "r",
        "check": "(all checks)",
        "passed": 3,
        "runs": 4,
        "pass_rate": 0.75,
        "failed": 1,
        "error": 0,
        "cancelled": 0,
        "budget": 0,
        "charged_micros": 400,
        "duration_ms": 4000,
    }
    # four repeats of one cell, three passing: the cell passes at pass@4
    assert rows[1] == {
        "recipe": "r",
        "check": "pass@4 (cells)",
        "passed": 1,
        "runs": 1,
        "pass_rate": 1.0,
        "failed": 0,
        "error": None,
        "cancelled": None,
        "budget": None,
        "charged_micros": None,
        "duration_ms": None,
    }
    assert len(rows) == 4


def test_summary_for_prefect_leaves_reasons_out(tmp_path) -> None:
    md = render_markdown(_report(tmp_path), reasons=False)
    assert "why" not in md
    assert "Not compared with a previous suite run" in md
