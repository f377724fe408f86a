"""``ephemeral run`` tells how a run ended by its exit status (ephemeral/cli/exits.py).

Real runs in a real sandbox, replayed model turns: one per ending a script must tell apart.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ephemeral.cli import app
from ephemeral.cli.exits import FOR_STATUS, Exit
from ephemeral.lifecycle import TERMINAL_STATUSES

from .conftest import turn

pytestmark = [pytest.mark.sandbox]


@pytest.fixture
def run_cli(tmp_path: Path, cassettes: Path) -> Callable[..., tuple[int, str]]:
    env = {
        "EPHEMERAL_STATE_DIR": str(tmp_path / "state"),
        "EPHEMERAL_CASSETTES_DIR": str(cassettes),
        "EPHEMERAL_EXECUTOR": "plain",
        "EPHEMERAL_URL": "",
    }

    def invoke(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(app, ["run", *args], env=env)
        return result.exit_code, result.output

    return invoke


def test_every_terminal_status_has_its_own_code() -> None:
    assert set(FOR_STATUS) == TERMINAL_STATUSES
    codes = list(FOR_STATUS.values())
    assert len(set(codes)) == len(codes)
    assert Exit.USAGE not in codes and Exit.ERROR not in codes


def test_a_succeeded_run_exits_0(run_cli: Callable[..., tuple[int, str]]) -> None:
    code, output = run_cli("--prompt", "hello", "--model", "replay/sandbox-proof")
    assert code == Exit.OK == 0, output
    assert "Settled" in output


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--prompt", "hi", "--budget", "ten"], "--budget"),
        (["--prompt", "hi", "--budget", "0"], "--budget"),
        (["--prompt", "hi", "--timeout", "0"], "--timeout"),
        (["--prompt", "hi", "--isolation", "docker"], "--isolation"),
        ([], "--prompt"),
    ],
)
def test_bad_input_exits_2_naming_the_field(
    run_cli: Callable[..., tuple[int, str]], args: list[str], field: str
) -> None:
    code, output = run_cli(*args)
    assert code == Exit.USAGE == 2, output
    assert f"{field}:" in output
    assert output.count(f"{field}:") == 1, output  # printed once
    assert "_seconds" not in output and "_micros" not in output  # the flag, not the field
    assert "run_" not in output  # nothing was started


def test_a_budget_past_the_cap_names_the_flag_in_dollars(
    run_cli: Callable[..., tuple[int, str]],
) -> None:
    code, output = run_cli("--prompt", "hi", "--budget", "100000")
    assert code == Exit.USAGE, output
    assert output.strip() == "error: --budget: must be at most $100.00"


def _recipe(tmp_path: Path, extra: str, checks: str) -> Path:
    path = tmp_path / "proof.yaml"
    path.write_text(
        "name: proof\nmodel: replay/sandbox-proof\nprompt: prove it\n"
        f"{extra}"
        "policy: {shell: true, timeout_seconds: 60, max_cost_micros: 40000}\n"
        f"checks:\n{checks}"
    )
    return path


def test_a_recipe_run_is_judged_by_its_checks(
    run_cli: Callable[..., tuple[int, str]], tmp_path: Path
) -> None:
    recipe = _recipe(
        tmp_path, "", '  - status: succeeded\n  - output_contains: "not in any output"\n'
    )
    code, output = run_cli(str(recipe))
    assert "Settled" in output  # it ran, its timeline printed
    assert "PASS status: succeeded" in output and "FAIL output_contains" in output
    assert code == Exit.FAILED == 1, output  # the run succeeded, a check of its recipe did not


def test_a_recipe_run_never_passes_the_recipes_budget(
    run_cli: Callable[..., tuple[int, str]], tmp_path: Path
) -> None:
    # Two runs reserving $0.04 each under a $0.0401 cap: the first one's model calls alone
    # cost more than the $0.0001 the cap has left for the second.
    recipe = _recipe(tmp_path, "repeat: 2\nbudget_micros: 40100\n", "  - status: succeeded\n")
    code, output = run_cli(str(recipe))
    assert code == Exit.BUDGET_EXHAUSTED, output
    assert len(set(re.findall(r"run_[0-9a-f]{32}", output))) == 1, output
    assert "skipped proof" in output and "recipe proof has" in output


def test_a_timed_out_run_exits_4(
    run_cli: Callable[..., tuple[int, str]], make_cassette: Callable[..., str]
) -> None:
    model = make_cassette("sleepy", [turn("sleep 1000"), turn(final="never")])
    code, output = run_cli("--prompt", "sleep", "--model", model, "--timeout", "3")
    assert code == Exit.TIMED_OUT == 4, output
    assert code != Exit.USAGE


def test_a_budget_exhausted_run_exits_5(
    run_cli: Callable[..., tuple[int, str]], make_cassette: Callable[..., str]
) -> None:
    model = make_cassette(
        "loop", [turn("echo step", tokens=(20_000, 200)) for _ in range(10)] + [turn(final="done")]
    )
    code, output = run_cli("--prompt", "loop", "--model", model, "--budget", "0.003")
    assert code == Exit.BUDGET_EXHAUSTED == 5, output
