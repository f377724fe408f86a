"""``ephemeral run`` tells how a run ended by its exit status (ephemeral/cli/exits.py).

Real runs in a real sandbox, replayed model turns: one per ending a script must tell apart.
"""

from __future__ import annotations

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
        "EPHEMERAL_USE_PREFECT": "false",
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
        (["--prompt", "hi", "--timeout", "0"], "timeout_seconds"),
        (["--prompt", "hi", "--isolation", "docker"], "isolation"),
        ([], "prompt"),
    ],
)
def test_bad_input_exits_2_naming_the_field(
    run_cli: Callable[..., tuple[int, str]], args: list[str], field: str
) -> None:
    code, output = run_cli(*args)
    assert code == Exit.USAGE == 2, output
    assert f"{field}:" in output
    assert "run_" not in output  # nothing was started


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
