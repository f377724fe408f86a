"""docs/records.md cannot drift from the schema: every stored column is documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ephemeral.records.schema import KINDS, columns

DOC = Path(__file__).resolve().parents[2] / "docs" / "records.md"


def _table(kind: str) -> dict[str, str]:
    text = DOC.read_text()
    section = text.split(f"## Table `{kind}`", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(\w+)` \| (\w+) \|", section, re.M))


@pytest.mark.parametrize("kind", KINDS)
def test_every_column_is_documented_with_its_type(kind: str) -> None:
    documented = _table(kind)
    stored = {name: typ for name, _, typ in columns(kind)}
    stored["date"] = "DATE"
    if kind != "runs":
        stored["host"] = "VARCHAR"
    assert documented == stored


def test_cli_commands_are_documented() -> None:
    text = DOC.read_text()
    for command in (
        "ephemeral query",
        "ephemeral costs",
        "ephemeral records compact",
        "ephemeral records purge",
        "ephemeral report costs",
    ):
        assert command in text
