"""What every command prints besides its result: errors on stderr, one shape, one exit code.

:func:`report` prints ``error: <detail>`` and then ``  field: message`` for each field it names
(an error about one field prints ``error: field: message`` once); an error whose every item
names a file (a recipe's) prints one ``file:line: field: message`` line per problem instead,
like a compiler. ``flags`` maps the request fields a command fills from its options to the
flags the user typed (``max_cost_micros`` → ``--budget``), so errors name what the user wrote.
:func:`fail` reports and returns the :class:`typer.Exit` to raise, with the code
:mod:`ephemeral.cli.exit_codes` assigns to that kind of error.
:func:`print_event` prints one line of a run's timeline (local and remote runs alike).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from ephemeral import errors
from ephemeral.cli.exit_codes import ExitCode, for_error
from ephemeral.timeline import COMMAND_EVENTS, describe

out = Console(highlight=False, soft_wrap=True)
MAX_COMMAND_LINES = 20  # of a multi-line command (a heredoc) printed under its step
err = Console(stderr=True, highlight=False, soft_wrap=True)


def report(
    exc: errors.EphemeralError, *, prefix: str = "", flags: Mapping[str, str] | None = None
) -> None:
    """Print the error and every field it names on stderr, each once."""
    items = exc.errors or []
    if items and all(item.get("file") for item in items):
        for item in items:
            line = f"{item['file']}:{item['line']}: {item.get('field')}: {item.get('message')}"
            err.print(line, markup=False)
        return
    flags = flags or {}
    detail = exc.detail
    lines = []
    for item in items:
        field, message = str(item.get("field")), str(item.get("message"))
        shown = f"{flags.get(field, field)}: {message}"
        if detail == f"{field}: {message}":  # the detail is this item (InvalidRequest.field)
            detail = shown
        elif shown != detail:
            lines.append(shown)
    err.print(f"{escape(prefix)}[red]error:[/red] {escape(detail)}")
    for line in lines:
        err.print(f"  {line}", markup=False)


def fail(
    exc: errors.EphemeralError, *, prefix: str = "", flags: Mapping[str, str] | None = None
) -> typer.Exit:
    """:func:`report` the error and return the exit to raise."""
    report(exc, prefix=prefix, flags=flags)
    return typer.Exit(for_error(exc))


def usage(message: str) -> typer.Exit:
    """A usage mistake found by the command itself (click finds the others, also exit 2)."""
    err.print(f"[red]error:[/red] {escape(message)}")
    return typer.Exit(ExitCode.USAGE)


def print_event(ev: Any, index: int) -> None:
    stage, text = describe(ev)
    out.print(f"{index:>3}. [bold]{stage}[/bold]: {text}")
    if ev.type in COMMAND_EVENTS:
        cmd = (ev.data.get("command") or "").strip().splitlines()
        for line in cmd[1:MAX_COMMAND_LINES]:  # a heredoc keeps its lines
            out.print(f"       $ {line}", markup=False)
        if len(cmd) > MAX_COMMAND_LINES:
            out.print(f"       $ … ({len(cmd) - MAX_COMMAND_LINES} more lines)", markup=False)
        for stream in ("stdout", "stderr"):
            body = (ev.data.get(stream) or "").rstrip()
            if body:
                lines = body.splitlines()
                shown = lines[:8] + ([f"… ({len(lines) - 8} more lines)"] if len(lines) > 8 else [])
                for line in shown:
                    out.print(f"       {stream[3:]}| {line}", markup=False, style="dim")
