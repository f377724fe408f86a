"""Docs that cannot drift: generated references are current, and every name is documented."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from ephemeral import docsgen
from ephemeral.events import EVENT_TYPES
from ephemeral.lifecycle import STATUS_FOR_REASON
from ephemeral.money.amounts import parse_usd, usd
from ephemeral.settings import Settings

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_generated_references_are_current() -> None:
    assert docsgen.main(["--check"]) == 0, "run `python -m ephemeral.docsgen`"


def test_every_event_type_is_documented() -> None:
    design = (DOCS / "events.md").read_text()
    missing = [t for t in EVENT_TYPES if f"`{t}`" not in design]
    assert not missing


def test_every_setting_is_documented() -> None:
    text = (DOCS / "settings.md").read_text()
    for name in Settings.model_fields:
        assert name.upper() in text.upper(), name


def test_design_cli_commands_exist() -> None:
    """The command names DESIGN §10 promises are real commands."""
    commands = set(docsgen.cli_commands())
    promised = [
        "run",
        "serve",
        "sandbox exec",
        "sandbox shell",
        "sandbox reap",
        "isolation",
        "images build",
        "images list",
        "images rm",
        "orgs create",
        "orgs credit",
        "orgs show",
        "keys create",
        "keys revoke",
        "keys list",
        "recipes validate",
        "recipes show",
        "eval",
        "costs",
        "query",
        "records compact",
        "report costs",
        "record",
    ]
    missing = [c for c in promised if c not in commands]
    assert not missing, missing


# --------------------------------------------------------------------------- values, not names


def _table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of the first Markdown table after ``heading`` (header and rule left out)."""
    section = text.split(heading, 1)[1]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
        elif rows:
            break
    return rows[2:]


def test_documented_setting_defaults_are_the_settings_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for var in [v for v in os.environ if v.startswith("EPHEMERAL_")]:
        monkeypatch.delenv(var)
    actual = Settings.load()
    rows = _table_rows((DOCS / "settings.md").read_text(), "| variable |")
    checked = 0
    for variable, default, _ in rows:
        name = re.findall(r"`EPHEMERAL_(\w+)`", variable)
        if not name or not default.startswith("`") or "in the checkout" in default:
            continue
        field = name[0].lower()
        assert default.strip("`") == str(getattr(actual, field)), variable
        checked += 1
    assert checked >= 10  # port, host, max_turns, pool_size, ... are really compared


def test_exit_status_table_is_the_cli_exit_codes() -> None:
    from ephemeral.cli.exit_codes import FOR_STATUS, MEANING, ExitCode

    rows = _table_rows((DOCS / "cli.md").read_text(), "## Exit status")
    documented = {int(code): (name.strip("`"), status.strip("`")) for code, name, status, _ in rows}
    by_code = {int(c): s for s, c in FOR_STATUS.items()}
    assert documented == {int(e): (e.name, by_code.get(int(e), "")) for e in MEANING}
    assert ExitCode.USAGE not in by_code  # bad input is never a run's ending


def test_termination_reasons_are_what_the_code_writes() -> None:
    """docs/records.md lists every reason with its status; the code writes no other reason."""
    rows = _table_rows((DOCS / "records.md").read_text(), "## Termination reasons")
    documented = {reason.strip("`"): (status.strip("`"), when) for reason, status, when in rows}
    assert {r: s for r, (s, _) in documented.items()} == STATUS_FOR_REASON
    written = _reasons_written_by_the_code()
    assert written <= set(documented), written - set(documented)
    for reason, (_, when) in documented.items():
        # A reason the docs call unused must really be unused, and the others really written.
        assert (reason in written) == ("not written" not in when), reason


def _reasons_written_by_the_code() -> set[str]:
    root = DOCS.parent
    member = r"(?:TerminationReason|Reason)\.([A-Z_]+)\b"
    patterns = {
        "ephemeral/agent/loop.py": [member],
        "ephemeral/broker/broker.py": [member, r'StopRun\(\s*"(\w+)"'],
        "ephemeral/engine/exits.py": [member],  # the named exits (the others name these)
        "ephemeral/engine/runtime.py": [member],
    }
    found: set[str] = set()
    for path, regexes in patterns.items():
        text = (root / path).read_text()
        for rx in regexes:
            found |= {name.lower() for name in re.findall(rx, text)}
    assert {"completed", "timeout", "model_error", "infra_error"} <= found  # the scan still works
    return found


def test_money_examples_follow_the_one_rule() -> None:
    line = next(
        ln for ln in (DOCS / "records.md").read_text().splitlines() if ln.startswith("| money")
    )
    examples = re.findall(r"`(\$[0-9.]+)`", line)
    assert len(examples) >= 3
    for text in examples:
        assert usd(parse_usd(text, field="docs")) == text
