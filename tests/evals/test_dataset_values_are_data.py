"""Dataset values are data: a row cannot change what setup or verify runs (issue 18).

A recipe whose rows hold shell syntax (`; exit 0`, `$(…)`, backticks, quotes, newlines) runs end
to end with the replay model in a real sandbox: setup writes the value to a file, the first
verify command writes it again and exits 7 whatever the row says, the second checks that both
files hold the row's exact bytes and that no injected command created `pwned`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ephemeral.evals.plan import Evaluation
from ephemeral.evals.suite import run_evaluation
from ephemeral.recipes.recipe import load_recipe
from ephemeral.sandbox.registry import probe_level
from ephemeral.settings import Settings
from tests import runlevel
from tests.drivers import unavailable
from tests.evals.conftest import write_cassette
from tests.recipes.helpers import write

pytestmark = pytest.mark.sandbox

HOSTILE = {
    "semicolon": "x; exit 0",
    "subst": "$(touch pwned; echo 0)",
    "backticks": "`touch pwned`",
    "newline": "a\ntouch pwned\nexit 0",
    "single": "'; touch pwned; exit 0; '",
    "double": '"; touch pwned; exit 0; "',
    "dollar": "${HOME:+$(touch pwned)} & touch pwned",
}


@pytest.mark.parametrize("isolation", ["namespaces", "gvisor"])
async def test_hostile_rows_cannot_change_what_verify_runs(tmp_path: Path, isolation: str) -> None:
    cassettes = tmp_path / "cassettes"
    model = write_cassette(cassettes, "rows-are-data", ["ls"], "done")
    settings = Settings.load(
        state_dir=tmp_path / "state", cassettes_dir=cassettes, use_prefect=False
    )
    if why := await probe_level(isolation, settings):
        unavailable(f"{isolation} unavailable: {why}", isolation)
    root = tmp_path / "recipe"
    for name, value in HOSTILE.items():
        (root / "files" / "expected").mkdir(parents=True, exist_ok=True)
        (root / "files" / "expected" / name).write_text(value)
    (root / "rows.jsonl").write_text(
        "".join(json.dumps({"name": n, "value": v}) + "\n" for n, v in HOSTILE.items())
    )
    recipe = load_recipe(
        write(
            root,
            f"""
        name: rows-are-data
        model: {model}
        prompt: "row {{{{ name }}}}"
        dataset: rows.jsonl
        files_from: files
        setup: ["printf %s {{{{ value }}}} > setup.txt"]
        verify:
          - printf %s {{{{ value }}}} > verify.txt; exit 7
          - >-
            test ! -e pwned && cmp setup.txt expected/{{{{ name }}}}
            && cmp verify.txt expected/{{{{ name }}}} && echo same
        verify_timeout_seconds: 20
        policy: {{isolation: {isolation}, timeout_seconds: 90, max_cost_micros: 20000}}
        checks:
          - status: succeeded
          - verify: {{command_matches: "exit 7$", exit_code: 7}}
          - verify: {{command_matches: "cmp", exit_code: 0, stdout_contains: same}}
    """,
        )
    )
    async with runlevel.started(settings) as runtime:
        report = await run_evaluation(runtime, Evaluation(name="rows", recipes=[recipe]))
    assert [r.cell["name"] for r in report.results] == list(HOSTILE)
    for result in report.results:
        assert result.passed, (result.cell, result.status, result.detail, result.checks)
