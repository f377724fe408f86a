"""Every {{ … }} in setup and verify is one shell-quoted word, and the places where a quoted
word would not be one word are recipe errors naming the command (issue 18)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from ephemeral.recipes.recipe import expand, load_recipe
from tests.recipes.helpers import only, recipe_errors, write

BASE = """
name: quoting
model: x/y
prompt: "row {{ v }}"
policy: {timeout_seconds: 60, max_cost_micros: 1000}
"""

ROWS = ["x; exit 0", "$(id)", "`id`", "a\nexit 0", "it's", 'say "hi"', "", "-n", "*", "~root"]


def test_values_render_as_one_word_each(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"v": v}) + "\n" for v in ROWS))
    extra = "dataset: rows.jsonl\nverify: [\"printf %s {{ v }} x{{ v }}y {{ v ~ '!' }}\"]\n"
    runs = expand(load_recipe(write(tmp_path, BASE + extra)), default_model="u/m")
    for run, value in zip(runs, ROWS, strict=True):
        [command] = run.policy.verify
        assert shlex.split(command) == ["printf", "%s", value, f"x{value}y", f"{value}!"]
        assert run.prompt == f"row {value}"  # prompts are text, not shell: not quoted


def test_template_text_and_loops_keep_their_shell_meaning(tmp_path: Path) -> None:
    extra = (
        "vars: {files: [a b, c]}\n"
        'setup: ["cd /tmp && ls {% for f in files %}{{ f }} {% endfor %}| wc -l"]\n'
    )
    [run] = expand(
        load_recipe(write(tmp_path, BASE.replace("{{ v }}", "x") + extra)), default_model="u/m"
    )
    assert run.policy.setup == ["cd /tmp && ls 'a b' c | wc -l"]


@pytest.mark.parametrize(
    ("command", "where"),
    [
        ("grep '{{ v }}' f", "inside single quotes"),
        ('grep "{{ v }}" f', "inside double quotes"),
        ("echo \\{{ v }}", "after a backslash"),
        ("true # {{ v }}", "in a comment"),
        ("cat <<EOF\n{{ v }}\nEOF", "in a here-document"),
        ("echo $(( {{ v }} + 1 ))", "inside $(( ))"),
        ("echo ${X:-{{ v }}}", "inside ${ }"),
        ("echo `echo {{ v }}`", "inside backticks"),
        ("{% filter lower %}echo {{ v }}{% endfilter %}", "{% filter %} block"),
    ],
)
def test_a_value_where_quoting_cannot_hold_is_an_error(
    tmp_path: Path, command: str, where: str
) -> None:
    verify = json.dumps(["true", command])
    text = BASE.replace("{{ v }}", "x") + f'vars: {{v: "1"}}\nverify: {verify}\n'
    err = only(recipe_errors(write(tmp_path, text)), "verify[1]")
    assert where in err["message"] and err["line"] == 6


@pytest.mark.parametrize(
    "command",
    ['echo "$(echo {{ v }})"', "cat <<EOF\nhi\nEOF\necho {{ v }}", "test $(( (1) )) = {{ v }}"],
)
def test_word_positions_inside_substitutions_are_fine(tmp_path: Path, command: str) -> None:
    text = BASE.replace("{{ v }}", "x") + f'vars: {{v: "a b"}}\nverify: {json.dumps([command])}\n'
    [run] = expand(load_recipe(write(tmp_path, text)), default_model="u/m")
    assert "'a b'" in run.policy.verify[0]
