"""`ephemeral recipes validate|show` through Typer's runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from ephemeral.cli.recipes import register

from .helpers import write

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> typer.Typer:
    monkeypatch.setenv("EPHEMERAL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("EPHEMERAL_DEFAULT_MODEL", raising=False)
    monkeypatch.delenv("EPHEMERAL_PRICE_BOOK", raising=False)
    app = typer.Typer()
    register(app)
    return app


def run(app: typer.Typer, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["recipes", *args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


GRID = """
    name: grid
    model: replay/sandbox-proof
    prompt: |
      Check {{ os }} run {{ repeat_index }}.
      {% for i in range(30) %}line {{ i }}
      {% endfor %}
    matrix: {os: [linux, freebsd]}
    repeat: 2
    policy: {max_cost_micros: 25000, files: [{path: data.csv, content_base64: "YQo="}]}
    budget_micros: 60000
"""


def test_validate_ok(app: typer.Typer, tmp_path: Path) -> None:
    a = write(tmp_path, GRID, "a.yaml")
    code, out, err = run(app, "validate", str(a), str(REPO / "recipes/sandbox-proof.yaml"))
    assert code == 0, err
    assert out.splitlines() == [
        f"{a}: ok (recipe)",
        f"{REPO / 'recipes/sandbox-proof.yaml'}: ok (recipe)",
    ]


def test_validate_prints_every_error_and_fails(app: typer.Typer, tmp_path: Path) -> None:
    good = write(tmp_path, GRID, "good.yaml")
    bad = write(
        tmp_path,
        """
        name: bad
        prompt: "{{ missing }}"
        policy: {timeout_seconds: -1}
        checks:
          - output_matches: "("
    """,
        "bad.yaml",
    )
    code, out, err = run(app, "validate", str(bad), str(good))
    assert code == 1
    assert err.splitlines() == [
        f"{bad}:3: policy.timeout_seconds: Input should be greater than or equal to 1",
        f"{bad}:5: checks[0].output_matches: invalid regular expression: "
        "missing ), unterminated subpattern at position 0",
    ]
    assert out.splitlines() == [f"{good}: ok (recipe)"]


def test_validate_refuses_an_unknown_model(app: typer.Typer, tmp_path: Path) -> None:
    pytest.importorskip("ephemeral.money.pricing", reason="the price book is not in this build")
    path = write(tmp_path, "name: m\nprompt: hi\nmodel: openai/no-such-model\n")
    code, _, err = run(app, "validate", str(path))
    assert code == 1
    assert err.startswith(f"{path}:3: model: ")
    assert "no-such-model" in err


def test_show_prints_runs_costs_and_budget(app: typer.Typer, tmp_path: Path) -> None:
    path = write(tmp_path, GRID)
    code, out, err = run(app, "show", str(path))
    assert code == 0, err
    assert f"{path}: grid: 4 run(s)" in out
    assert '#1 cell {"os": "linux"} · repeat 0 · model replay/sandbox-proof' in out
    assert '#4 cell {"os": "freebsd"} · repeat 1' in out
    assert "files data.csv" in out and "cap $0.025" in out and "web off" in out
    assert "│ Check freebsd run 1." in out
    assert "chars in all; --json prints it whole" in out  # 30 template lines are cut
    assert "line 29" not in out
    assert "worst case $0.10 · recipe budget $0.06" in out


def test_show_json(app: typer.Typer, tmp_path: Path) -> None:
    code, out, _ = run(app, "show", "--json", str(write(tmp_path, GRID)))
    assert code == 0
    runs = json.loads(out)
    assert [(r["cell"], r["repeat_index"]) for r in runs] == [
        ({"os": "linux"}, 0),
        ({"os": "linux"}, 1),
        ({"os": "freebsd"}, 0),
        ({"os": "freebsd"}, 1),
    ]
    assert runs[0]["prompt"].startswith("Check linux run 0.\nline 0\n")
    assert runs[0]["policy"]["max_cost_micros"] == 25000
    assert runs[0]["model"] == "replay/sandbox-proof"


def test_show_a_suite(app: typer.Typer) -> None:
    code, out, err = run(app, "show", str(REPO / "recipes/suites/smoke.yaml"))
    assert code == 0, err
    assert "sandbox-proof: 1 run(s)" in out
    assert "suite smoke: worst case $0.08 · suite budget $0.20" in out


def test_show_a_bad_recipe_fails(app: typer.Typer, tmp_path: Path) -> None:
    path = write(tmp_path, "name: x\nprompt: '{{ 1 +'\n")
    code, out, err = run(app, "show", str(path))
    assert code == 2  # bad input (ephemeral/cli/exit_codes.py)
    assert out == ""
    assert err.startswith(f"{path}:2: prompt: template syntax:")
