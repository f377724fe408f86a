"""CLI: ``export`` (a suite run's sample set, one row per run, as JSONL or Parquet)."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated

import typer

from ephemeral.cli.output import fail
from ephemeral.errors import EphemeralError
from ephemeral.settings import Settings


class ExportFormat(enum.StrEnum):
    jsonl = "jsonl"
    parquet = "parquet"


def export(
    suite_run_id: Annotated[str, typer.Argument(help="The suite run (ephemeral eval prints it).")],
    fmt: Annotated[
        ExportFormat, typer.Option("--format", help="jsonl or parquet.")
    ] = ExportFormat.jsonl,
    out: Annotated[
        Path | None, typer.Option("--out", help="Output file; default SUITE_RUN_ID.FORMAT here.")
    ] = None,
) -> None:
    """Write a suite run's samples, one row per run: recipe, cell, model, repeat, status,
    output, verdicts, verify results, tokens, cost, image and host (ZDR runs without content).
    """
    from ephemeral.records.export import export_suite_run

    settings = Settings.load()
    target = out or Path(f"{suite_run_id}.{fmt.value}")
    try:
        rows = export_suite_run(settings.records_dir, suite_run_id, target, fmt.value)
    except EphemeralError as err:
        raise fail(err) from err
    typer.echo(f"{rows} runs → {target}")


def register(app: typer.Typer) -> None:
    """Add this group's commands to the main app."""
    app.command("export")(export)
