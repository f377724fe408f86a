"""``ephemeral eval`` knobs end to end (real sandboxes, replayed turns, the CLI in a subprocess):
``--limit``, ``--filter``, ``--model``, ``--concurrency``, ``--repeat`` with pass@k in the
table, the report and the export, ``--compare last``, and where the suite run is printed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.evals.conftest import cli, write_cassette
from tests.recipes.helpers import write

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]


def _where(stderr: str) -> tuple[str, Path]:
    """The suite run id and the report path ``eval`` printed on stderr."""
    lines = stderr.splitlines()
    suite_run_id = next(line for line in lines if line.startswith("suite run: ")).split()[-1]
    report = next(line for line in lines if line.startswith("report: ")).split()[1]
    return suite_run_id, Path(report)


def test_limit_filter_model_repeat_compare_last_and_the_export(
    tmp_path: Path, state_dir: Path
) -> None:
    cassettes = tmp_path / "cassettes"
    first = write_cassette(cassettes, "knob-a", ["echo a number"], "said a number")
    other = write_cassette(cassettes, "knob-b", ["echo from b"], "from b")
    recipe = write(
        tmp_path,
        f"""
        name: knobs
        model: {first}
        prompt: "say {{{{ n }}}}"
        matrix: {{n: [1, 2, 3]}}
        policy: {{shell: true, isolation: namespaces, timeout_seconds: 60, max_cost_micros: 20000}}
        checks:
          - status: succeeded
    """,
        name="knobs.yaml",
    )
    env = {"EPHEMERAL_CASSETTES_DIR": str(cassettes)}

    a = cli(state_dir, "eval", str(recipe), "--no-prefect", "--json", "--limit", "2",
            "--concurrency", "1", **env)  # fmt: skip
    assert a.returncode == 0, a.stdout + a.stderr
    report_a = json.loads(a.stdout)  # --json: stdout is the report alone
    assert [r["cell"] for r in report_a["results"]] == [{"n": 1}, {"n": 2}]  # the first two
    a_id, a_path = _where(a.stderr)
    assert a_id == report_a["suite_run_id"] and a_path.is_file()
    assert json.loads(a_path.read_text())["suite_run_id"] == a_id

    b = cli(state_dir, "eval", str(recipe), "--no-prefect", "--json", "--filter", "n=2",
            "--repeat", "3", "--model", other, "--compare", "last", **env)  # fmt: skip
    assert b.returncode == 0, b.stdout + b.stderr
    report_b = json.loads(b.stdout)
    results = report_b["results"]
    assert [(r["cell"], r["repeat_index"]) for r in results] == [({"n": 2}, i) for i in range(3)]
    assert all(r["model"] == other and r["status"] == "succeeded" for r in results), results
    [stat] = report_b["recipes"]
    assert (stat["epochs"], stat["cells"], stat["cells_passing"]) == (3, 1, 1)
    assert report_b["comparison"]["previous_suite_run_id"] == a_id  # --compare last
    assert report_b["comparison"]["paired"] == 1  # n=2 repeat 0 ran in both
    b_id, _ = _where(b.stderr)

    table = cli(state_dir, "eval", str(recipe), "--no-prefect", "--filter", "n=3",
                "--repeat", "2", **env)  # fmt: skip
    assert table.returncode == 0, table.stdout + table.stderr
    assert "pass@2 (cells)" in table.stdout and "1/1" in table.stdout

    # a suite filtered to one recipe gates that recipe alone (the others ran nothing)
    suite = write(tmp_path, f"name: two\nrecipes: [{recipe}, {other_recipe(tmp_path, other)}]\n",
                  name="two.yaml")  # fmt: skip
    one = cli(state_dir, "eval", str(suite), "--no-prefect", "--json", "--filter",
              "recipe=other", **env)  # fmt: skip
    assert one.returncode == 0, one.stdout + one.stderr
    assert [s["recipe"] for s in json.loads(one.stdout)["recipes"]] == ["other"]

    out = tmp_path / "b.jsonl"
    exported = cli(state_dir, "export", b_id, "--format", "jsonl", "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["cell"], r["repeat"], r["model"]) for r in rows] == [
        ({"n": 2}, i, other) for i in range(3)
    ]
    assert all(r["epochs"] == 3 and r["cell_pass_at_k"] is True for r in rows), rows


def other_recipe(tmp_path: Path, model: str) -> Path:
    return write(
        tmp_path,
        f"name: other\nmodel: {model}\nprompt: hi\n"
        "policy: {shell: true, isolation: namespaces, timeout_seconds: 60}\n",
        name="other.yaml",
    )


def test_bad_knobs_are_refused_naming_the_flag(tmp_path: Path, state_dir: Path) -> None:
    recipe = write(
        tmp_path,
        "name: k\nmodel: replay/sandbox-proof\nprompt: hi\n",
        name="k.yaml",
    )
    bad_filter = cli(state_dir, "eval", str(recipe), "--no-prefect", "--filter", "n")
    assert bad_filter.returncode == 2 and "--filter: 'n' is not KEY=VALUE" in bad_filter.stderr
    bad_model = cli(state_dir, "eval", str(recipe), "--no-prefect", "--model", "nobody/x")
    assert bad_model.returncode == 2 and "--model:" in bad_model.stderr, bad_model.stderr
    no_last = cli(state_dir, "eval", str(recipe), "--no-prefect", "--compare", "last")
    assert no_last.returncode == 2
    assert "no earlier suite run of 'k' on this host" in no_last.stderr
