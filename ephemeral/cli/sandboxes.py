"""``ephemeral sandboxes``: sandbox sessions on a server (``EPHEMERAL_URL``), from the shell.

A session lives in the server that created it, so these commands always talk to a server; a
session in the CLI's own process would die with the command.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

from ephemeral import errors
from ephemeral.cli.output import fail, out
from ephemeral.client import Client
from ephemeral.money.amounts import parse_usd, usd
from ephemeral.settings import Settings

sandboxes_app = typer.Typer(
    no_args_is_help=True, help="Sandbox sessions on a server: create, exec, put, get, end."
)


def _client() -> Client:
    settings = Settings.load()
    if not settings.url:
        raise fail(
            errors.InvalidRequest.field(
                "EPHEMERAL_URL", "sandbox sessions live in a server: set EPHEMERAL_URL"
            )
        )
    try:
        return Client(settings)
    except errors.EphemeralError as exc:
        raise fail(exc) from exc


def _show(obj: dict[str, Any], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(obj, indent=2) + "\n")
        return
    cost = obj["cost"]
    out.print(
        f"[bold]{obj['id']}[/bold] · {obj['status']} · {obj.get('isolation')} · "
        f"{obj['usage']['execs']} commands · {usd(cost['charged_micros'] or 0)} of "
        f"{usd(cost['reserved_micros'])}",
        highlight=False,
    )


@sandboxes_app.command("create")
def create(
    isolation: str = typer.Option("auto", "--isolation", help="auto, gvisor, namespaces, …"),
    timeout: int = typer.Option(600, "--timeout", help="Time limit of the session, seconds."),
    budget: str | None = typer.Option(
        None,
        "--budget",
        help="Hard cap in dollars, e.g. 0.50 (reserved up front); default: the sandbox's "
        "compute for the whole --timeout (the server's default, as for the API and client).",
    ),
    zdr: bool = typer.Option(False, "--zdr", help="Zero data retention."),
    web: bool = typer.Option(
        False, "--web/--no-web", help="Commands reach the web through the broker's proxy."
    ),
    allow: list[str] = typer.Option(
        [], "--allow", help="Limit web to this host pattern (repeat; implies --web)."
    ),
    disk_mib: int | None = typer.Option(
        None,
        "--disk-mib",
        help="The sandbox's writable root (/ and /tmp) in MiB, up to the server's "
        "EPHEMERAL_DISK_MAX_MIB; default 256.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the session object."),
) -> None:
    """Start a sandbox session; prints its id (the other commands take it)."""
    flags = {
        "isolation": "--isolation",
        "timeout_seconds": "--timeout",
        "max_cost_micros": "--budget",
        "disk_mib": "--disk-mib",
    }
    asked: dict[str, Any] = {} if disk_mib is None else {"disk_mib": disk_mib}
    try:
        if budget is not None:
            asked["max_cost_micros"] = parse_usd(budget, field="--budget")
    except errors.EphemeralError as exc:
        raise fail(exc) from exc
    with _client() as client:
        try:
            obj = client.sandboxes.create(
                isolation=isolation,
                timeout_seconds=timeout,
                zero_data_retention=zdr,
                web={"allow": allow} if allow else web,
                **asked,
            )
        except errors.EphemeralError as exc:
            raise fail(exc, flags=flags) from exc
    if as_json:
        _show(obj, True)
    else:
        sys.stdout.write(obj["id"] + "\n")


@sandboxes_app.command(
    "exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def exec_cmd(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., help="The session id."),
    user: str | None = typer.Option(
        None, "--user", help="A user of the image (default: worker, the sandbox user)."
    ),
    cwd: str | None = typer.Option(None, "--cwd", help="Working directory in the sandbox."),
    timeout: float | None = typer.Option(None, "--timeout", help="Seconds before it is killed."),
) -> None:
    """Run `-- argv…` (or one shell string) in the session; stdin is passed through, the exit
    status is the command's (124 when killed at its timeout)."""
    argv = list(ctx.args)
    if not argv:
        raise typer.BadParameter("give the command after --", param_hint="COMMAND")
    command: list[str] | str = argv[0] if len(argv) == 1 else argv
    stdin = b"" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.buffer.read()
    fields: dict[str, Any] = {"user": user, "cwd": cwd, "timeout_seconds": timeout}
    with _client() as client:
        try:
            res = client.sandboxes.exec(
                sandbox_id,
                command,
                stdin=stdin,
                **{k: v for k, v in fields.items() if v is not None},
            )
        except errors.EphemeralError as exc:
            raise fail(exc) from exc
    sys.stdout.write(res["stdout"])
    sys.stderr.write(res["stderr"])
    raise typer.Exit(124 if res["timed_out"] else int(res["exit_code"]) & 0xFF)


@sandboxes_app.command("put")
def put(
    sandbox_id: str = typer.Argument(..., help="The session id."),
    local: Path = typer.Argument(..., help="A local file.", exists=True, dir_okay=False),
    path: str = typer.Argument(..., help="Where in the sandbox (relative: its scratch dir)."),
) -> None:
    """Copy a local file into the session (owned by the sandbox user worker)."""
    with _client() as client:
        try:
            client.sandboxes.write_file(sandbox_id, path, local.read_bytes())
        except errors.EphemeralError as exc:
            raise fail(exc) from exc


@sandboxes_app.command("get")
def get(
    sandbox_id: str = typer.Argument(..., help="The session id."),
    path: str = typer.Argument(..., help="A file in the sandbox."),
) -> None:
    """Print a file of the session to stdout (bytes as they are)."""
    with _client() as client:
        try:
            data = client.sandboxes.read_file(sandbox_id, path)
        except errors.EphemeralError as exc:
            raise fail(exc) from exc
    sys.stdout.buffer.write(data)


@sandboxes_app.command("show")
def show(
    sandbox_id: str = typer.Argument(..., help="The session id."),
    as_json: bool = typer.Option(False, "--json", help="Print the session object."),
) -> None:
    """The session's status, commands run and money."""
    with _client() as client:
        try:
            _show(client.sandboxes.get(sandbox_id), as_json)
        except errors.EphemeralError as exc:
            raise fail(exc) from exc


@sandboxes_app.command("end")
def end(
    sandbox_id: str = typer.Argument(..., help="The session id."),
    as_json: bool = typer.Option(False, "--json", help="Print the session object."),
) -> None:
    """End the session: destroy its sandbox and settle (prints what it cost)."""
    with _client() as client:
        try:
            _show(client.sandboxes.delete(sandbox_id), as_json)
        except errors.EphemeralError as exc:
            raise fail(exc) from exc


def register(app: typer.Typer) -> None:
    """Add this group's commands to the main app."""
    app.add_typer(sandboxes_app, name="sandboxes")
