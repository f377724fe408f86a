"""``--help`` is written for the user: every command's help renders without RST markup, module
docstrings or the code's own names, and every argument and option says what it is."""

from __future__ import annotations

import importlib
import pkgutil
import re
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

import ephemeral.cli
from ephemeral.cli import app
from ephemeral.settings import Settings

# RST roles and literals, directives, and what a module docstring says about the code.
MARKUP = re.compile(r"``|:(class|meth|func|mod|data|attr|exc):|^\s*\.\. |CLI group|CLI:", re.M)
# A settings field named the way the code spells it, not as the EPHEMERAL_ variable a user sets.
FIELDS = re.compile(
    r"(?<![A-Za-z_])(" + "|".join(f for f in Settings.model_fields if "_" in f) + r")(?![A-Za-z_])"
)


def _commands(group: Any, prefix: list[str]) -> list[tuple[list[str], Any]]:
    found = [(prefix, group)]
    ctx = group.context_class(group)
    for name in sorted(group.list_commands(ctx)):
        cmd = group.get_command(ctx, name)
        if hasattr(cmd, "list_commands"):
            found += _commands(cmd, [*prefix, name])
        else:
            found.append(([*prefix, name], cmd))
    return found


COMMANDS = _commands(typer.main.get_command(app), [])


def _module_docstrings() -> list[str]:
    docs = []
    for info in pkgutil.iter_modules(ephemeral.cli.__path__, "ephemeral.cli."):
        if info.name.endswith("__main__"):  # importing it runs the command
            continue
        doc = importlib.import_module(info.name).__doc__
        if doc:
            docs.append(doc.strip().splitlines()[0])
    return [d for d in [*docs, (ephemeral.cli.__doc__ or "").strip().splitlines()[0]] if d]


def test_every_command_is_walked() -> None:
    names = {" ".join(argv) for argv, _ in COMMANDS}
    assert {"", "run", "eval", "sandboxes exec", "images list", "recipes validate"} <= names
    assert len(COMMANDS) > 40


@pytest.mark.parametrize(
    ("argv", "cmd"), COMMANDS, ids=[" ".join(argv) or "ephemeral" for argv, _ in COMMANDS]
)
def test_help_is_written_for_users(argv: list[str], cmd: Any) -> None:
    result = CliRunner().invoke(app, [*argv, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = result.output
    assert not MARKUP.search(text), f"markup or code talk in `{' '.join(argv)} --help`:\n{text}"
    assert not FIELDS.search(text), f"a settings field, not its EPHEMERAL_ variable:\n{text}"
    for doc in _module_docstrings():
        assert doc not in text, f"a module docstring in --help: {doc!r}"
    assert (cmd.help or "").strip(), f"`{' '.join(argv)}` has no help"
    for param in cmd.params:
        if param.name != "help":
            assert (getattr(param, "help", None) or "").strip(), (
                f"`{' '.join(argv)}`: {param.name} has no help"
            )


def test_the_checks_catch_what_they_name() -> None:
    assert MARKUP.search("settles ``cancelled``") and MARKUP.search("see :class:`Store`")
    assert MARKUP.search("x\n.. note:: y") and MARKUP.search("CLI group: recipes.")
    assert FIELDS.search("default: pool_size or 2") and not FIELDS.search("EPHEMERAL_POOL_SIZE")
