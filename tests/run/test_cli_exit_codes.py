"""``ephemeral run`` tells how a run ended by its exit status (ephemeral/cli/exit_codes.py).

Real runs in a real sandbox, replayed model turns: one per ending a script must tell apart.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ephemeral.cli import app
from ephemeral.cli.exit_codes import FOR_STATUS, ExitCode
from ephemeral.lifecycle import TERMINAL_STATUSES
from tests.sample import SAMPLE_MODEL, SAMPLE_PROMPT

from .conftest import turn

pytestmark = [pytest.mark.sandbox]


@pytest.fixture
def run_cli(tmp_path: Path, cassettes: Path) -> Callable[..., tuple[int, str]]:
    base = {
        "EPHEMERAL_STATE_DIR": str(tmp_path / "state"),
        "EPHEMERAL_CASSETTES_DIR": str(cassettes),
        "EPHEMERAL_EXECUTOR": "plain",
        "EPHEMERAL_URL": "",
        # no provider key: the default, where a test wants one, is named
        **dict.fromkeys(("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "OPENROUTER_API_KEY"), ""),
    }

    def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
        result = CliRunner().invoke(app, ["run", *args], env={**base, **(env or {})})
        return result.exit_code, result.output

    return invoke


def test_every_terminal_status_has_its_own_code() -> None:
    assert set(FOR_STATUS) == TERMINAL_STATUSES
    codes = list(FOR_STATUS.values())
    assert len(set(codes)) == len(codes)
    assert ExitCode.USAGE not in codes and ExitCode.ERROR not in codes


def test_a_succeeded_run_exits_0(run_cli: Callable[..., tuple[int, str]]) -> None:
    code, output = run_cli("--prompt", SAMPLE_PROMPT, "--model", "replay/sandbox-proof")
    assert code == ExitCode.OK == 0, output
    assert "Settled" in output


def test_a_prompt_is_never_answered_by_another_prompts_transcript(
    run_cli: Callable[..., tuple[int, str]],
) -> None:
    """The sample's replay asked for `uname -a` fails saying why; it plays none of the
    sample's commands (primes, whoami, curl) and never says succeeded."""
    code, output = run_cli("--prompt", "Run uname -a and report it.", "--model", SAMPLE_MODEL)
    assert code == ExitCode.FAILED, output
    flat = " ".join(output.split())
    assert "replay/sandbox-proof answers only the prompt it recorded" in flat, output
    assert "'Run uname -a and report it.'" in flat, output
    assert "Shell:" not in output and "Model:" not in output, output  # nothing was played
    assert "0 model calls" in output and "model_error" in output, output
    for played in ("whoami", "curl", "2 3 5 7", "proof.txt"):
        assert played not in output, output
    assert "succeeded" not in output.lower(), output


def test_no_model_and_no_default_is_refused_naming_how_to_configure_one(
    run_cli: Callable[..., tuple[int, str]],
) -> None:
    code, output = run_cli("--prompt", "hello", env={"EPHEMERAL_DEFAULT_MODEL": ""})
    assert code == ExitCode.USAGE, output
    flat = " ".join(output.split())
    assert flat.startswith("error: --model: no model named, and this server has no default"), flat
    assert "OPENAI_API_KEY" in flat and "EPHEMERAL_DEFAULT_MODEL" in flat, flat
    assert "run_" not in output  # nothing was admitted


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
    assert code == ExitCode.USAGE == 2, output
    assert f"{field}:" in output
    assert output.count(f"{field}:") == 1, output  # printed once
    assert "_seconds" not in output and "_micros" not in output  # the flag, not the field
    assert "run_" not in output  # nothing was started


def test_a_budget_past_the_cap_names_the_flag_in_dollars(
    run_cli: Callable[..., tuple[int, str]],
) -> None:
    code, output = run_cli("--prompt", "hi", "--budget", "100000")
    assert code == ExitCode.USAGE, output
    assert output.strip() == "error: --budget: must be at most $100.00"


def _recipe(tmp_path: Path, extra: str, checks: str) -> Path:
    path = tmp_path / "proof.yaml"
    path.write_text(
        f"name: proof\nmodel: {SAMPLE_MODEL}\nprompt: {json.dumps(SAMPLE_PROMPT)}\n"
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
    assert code == ExitCode.FAILED == 1, output  # the run succeeded, a check of its recipe did not


def test_a_recipe_run_never_passes_the_recipes_budget(
    run_cli: Callable[..., tuple[int, str]], tmp_path: Path
) -> None:
    # Two runs reserving $0.04 each under a $0.0401 cap: the first one's model calls alone
    # cost more than the $0.0001 the cap has left for the second.
    recipe = _recipe(tmp_path, "repeat: 2\nbudget_micros: 40100\n", "  - status: succeeded\n")
    code, output = run_cli(str(recipe))
    assert code == ExitCode.BUDGET_EXHAUSTED, output
    assert len(set(re.findall(r"run_[0-9a-f]{32}", output))) == 1, output
    assert "skipped proof" in output and "recipe proof has" in output


def test_a_timed_out_run_exits_4(
    run_cli: Callable[..., tuple[int, str]], make_cassette: Callable[..., str]
) -> None:
    model = make_cassette("sleepy", [turn("sleep 1000"), turn(final="never")])
    code, output = run_cli("--prompt", "sleep", "--model", model, "--timeout", "3")
    assert code == ExitCode.TIMED_OUT == 4, output
    assert code != ExitCode.USAGE


def test_a_budget_exhausted_run_exits_5(
    run_cli: Callable[..., tuple[int, str]], make_cassette: Callable[..., str]
) -> None:
    model = make_cassette(
        "loop", [turn("echo step", tokens=(20_000, 200)) for _ in range(10)] + [turn(final="done")]
    )
    code, output = run_cli("--prompt", "loop", "--model", model, "--budget", "0.003")
    assert code == ExitCode.BUDGET_EXHAUSTED == 5, output
