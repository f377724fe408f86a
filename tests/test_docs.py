"""Docs that cannot drift: generated references are current, and every name is documented."""

from __future__ import annotations

from pathlib import Path

from ephemeral import docsgen
from ephemeral.events import EVENT_TYPES
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
