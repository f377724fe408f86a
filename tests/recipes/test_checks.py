"""Each check passes and fails on realistic run objects and events, and says what it saw."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import TypeAdapter

from ephemeral.recipes.checks import Check, CheckResult, evaluate

from .helpers import product_page_events, product_page_run

CHECKS = TypeAdapter(list[Check])


def verdicts(
    checks: list[dict[str, Any]],
    run: dict[str, Any] | None = None,
    events: list[dict[str, Any]] | None = None,
) -> list[CheckResult]:
    return evaluate(
        CHECKS.validate_python(checks),
        product_page_run() if run is None else run,
        product_page_events() if events is None else events,
    )


def one(check: dict[str, Any], **kw: Any) -> CheckResult:
    [result] = verdicts([check], **kw)
    return result


def test_the_product_page_run_passes_its_recipe_checks() -> None:
    results = verdicts(
        [
            {"output_contains": "Could not resolve host"},
            {"output_matches": r"\b2 3 5 7\b"},
            {"shell": {"command_matches": "curl", "exit_code_not": 0}},
            {"shell": {"command_matches": "whoami", "exit_code": 0, "stdout_contains": "worker"}},
            {"max_cost_micros": 10000},
            {"max_duration_seconds": 60},
            {"status": "succeeded"},
        ]
    )
    assert all(r.passed for r in results), results
    assert [r.check for r in results] == [
        "output_contains: Could not resolve host",
        r"output_matches: /\b2 3 5 7\b/",
        "shell: command_matches /curl/, exit code not 0",
        "shell: command_matches /whoami/, exit code 0, stdout_contains 'worker'",
        "max_cost_micros: 10000",
        "max_duration_seconds: 60",
        "status: succeeded",
    ]


def test_output_contains() -> None:
    assert one({"output_contains": "2 3 5 7"}).passed
    miss = one({"output_contains": "Connection refused"})
    assert not miss.passed
    assert "not in the output" in miss.reason and "Prime script" in miss.reason
    none = one({"output_contains": "x"}, run={**product_page_run(), "output": None})
    assert (none.passed, none.reason) == (False, "the run has no output")


def test_output_matches() -> None:
    hit = one({"output_matches": r"^- whoami: (\w+)"})  # multiline: ^ is a line start
    assert hit.passed and "'- whoami: worker'" in hit.reason
    miss = one({"output_matches": r"\b4 6 8\b"})
    assert not miss.passed and "no match" in miss.reason


def test_shell_command_not_run() -> None:
    r = one({"shell": {"command_matches": "wget", "exit_code_not": 0}})
    assert not r.passed
    assert r.reason.startswith("no shell command matched /wget/ (ran 3,")


def test_shell_exit_code_wrong() -> None:
    r = one({"shell": {"command_matches": "curl", "exit_code": 0}})
    assert not r.passed
    assert "exit code 6, wanted 0" in r.reason
    r = one({"shell": {"command_matches": "whoami", "exit_code_not": 0}})
    assert not r.passed and "exit code 0, wanted not 0" in r.reason


def test_shell_any_of_several_matching_commands_may_satisfy() -> None:
    # Two commands mention /tmp: one exited 6, one 0; exit_code 0 is satisfied by the second.
    assert one({"shell": {"command_matches": r"https|/tmp/proof", "exit_code": 0}}).passed


def test_shell_stdout() -> None:
    assert one({"shell": {"command_matches": "ls -l", "stdout_contains": "worker worker"}}).passed
    r = one({"shell": {"command_matches": "whoami", "stdout_contains": "root"}})
    assert not r.passed and "stdout lacks 'root'" in r.reason and "worker" in r.reason


def test_shell_without_shell_events_and_under_zero_data_retention() -> None:
    no_shell = [e for e in product_page_events() if e["type"] != "shell.executed"]
    assert (
        one({"shell": {"command_matches": "."}}, events=no_shell).reason
        == "no shell command was run"
    )
    redacted = [
        {**e, "data": {"command_bytes": 11, "exit_code": 0}} if e["type"] == "shell.executed" else e
        for e in product_page_events()
    ]
    r = one({"shell": {"command_matches": "."}}, events=redacted)
    assert not r.passed and "zero data retention" in r.reason


def test_shell_killed_command_has_no_exit_code() -> None:
    events = [
        {
            "seq": 1,
            "run_id": "r",
            "type": "shell.executed",
            "at": "t",
            "data": {"command": "sleep 999", "exit_code": None},
        }
    ]
    killed = one({"shell": {"command_matches": "sleep", "exit_code_not": 0}}, events=events)
    assert not killed.passed
    assert one({"shell": {"command_matches": "sleep"}}, events=events).passed


def test_max_cost() -> None:
    r = one({"max_cost_micros": 3530})
    assert r.passed and r.reason == "charged 3530 micros ($0.00353) ≤ 3530"
    r = one({"max_cost_micros": 3000})
    assert not r.passed and r.reason == "charged 3530 micros ($0.00353) > 3000"
    unsettled = {**product_page_run(), "cost": {"reserved_micros": 40000}}
    assert not one({"max_cost_micros": 1}, run=unsettled).passed


def test_max_duration() -> None:
    r = one({"max_duration_seconds": 30})
    assert r.passed and r.reason == "took 23.250 s ≤ 30 s"
    r = one({"max_duration_seconds": 20})
    assert not r.passed and r.reason == "took 23.250 s > 20 s"
    queued = {**product_page_run(), "started_at": None, "ended_at": None}
    assert one({"max_duration_seconds": 20}, run=queued).reason == "the run never started"
    running = {**product_page_run(), "ended_at": None}
    assert one({"max_duration_seconds": 20}, run=running).reason == "the run has not ended"


def test_status() -> None:
    assert one({"status": "succeeded"}).reason == "status succeeded (completed)"
    failed = {
        **product_page_run(),
        "status": "budget_exhausted",
        "termination": {"reason": "budget_exhausted", "detail": None},
    }
    r = one({"status": "succeeded"}, run=failed)
    assert not r.passed
    assert r.reason == "status budget_exhausted (budget_exhausted), wanted succeeded"


@pytest.mark.parametrize("run", [{}, {"status": 3, "output": 5, "cost": "x", "started_at": 1}])
def test_malformed_runs_fail_without_raising(run: dict[str, Any]) -> None:
    results = verdicts(
        [
            {"output_contains": "x"},
            {"output_matches": "x"},
            {"max_cost_micros": 1},
            {"max_duration_seconds": 1},
            {"status": "succeeded"},
            {"shell": {"command_matches": "x"}},
        ],
        run=run,
        events=[{"type": "shell.executed"}, {}, {"type": "shell.executed", "data": "x"}],
    )
    assert [r.passed for r in results] == [False] * 6
