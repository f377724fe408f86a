"""CLI: ``ephemeral worker``: execute dispatched runs on this host (docs/deploy.md)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import Annotated

import typer

from ephemeral import errors
from ephemeral.cli.output import fail
from ephemeral.settings import Settings


def register(app: typer.Typer) -> None:
    @app.command("worker")
    def worker(
        limit: Annotated[
            int,
            typer.Option(
                min=1, max=512, help="Runs this host executes at once (its Prefect limit too)."
            ),
        ] = 4,
        total: Annotated[
            int,
            typer.Option(
                min=1,
                help="The microvm-total limit, if no host created it yet (an existing one stays).",
            ),
        ] = 64,
        sessions: Annotated[
            int | None,
            typer.Option(
                min=0,
                max=512,
                help="Sandbox sessions this host hosts at once, 0 for none "
                "(default: EPHEMERAL_HOST_SESSIONS, else 32).",
            ),
        ] = None,
        pool: Annotated[
            int | None,
            typer.Option(help="Warm sandboxes kept ready (default: EPHEMERAL_POOL_SIZE, else 0)."),
        ] = None,
        drain: Annotated[
            bool,
            typer.Option(
                "--drain",
                help="Drain the worker running on this state dir (it takes no new runs, lets "
                "running ones finish up to EPHEMERAL_DRAIN_SECONDS) and wait until it exits.",
            ),
        ] = False,
    ) -> None:
        """Take runs from Prefect and execute them here: sandboxes, leases, reaper, warm pool;
        host the sandbox sessions API processes place here (over the internal channel).

        One per host. Needs PREFECT_API_URL (the shared Prefect server) and, for several hosts,
        a shared EPHEMERAL_DATABASE_URL, records root and seal key (checked at start);
        EPHEMERAL_HOST_ID names the host. SIGTERM drains it (docs/deploy.md).
        """
        from ephemeral.flows.embedded_server import configure

        base = Settings.load()
        if drain:
            try:
                drain_worker(base)
            except errors.EphemeralError as exc:
                raise fail(exc) from exc
            return
        size = pool if pool is not None else base.pool_size
        if not 0 <= size <= 64:
            raise typer.BadParameter("must be between 0 and 64", param_hint="--pool")
        settings = Settings.load(
            executor="prefect", pool_size=size, max_concurrent_runs=max(limit, 1)
        )
        try:
            from ephemeral.sessions.link import check_bind_address

            check_bind_address(settings.link_address)  # refused before anything starts
            configure(settings)  # before Prefect is imported: it reads its settings once
            from ephemeral.flows.worker import serve

            with contextlib.suppress(KeyboardInterrupt):
                slots = sessions if sessions is not None else settings.host_sessions
                asyncio.run(serve(settings, limit=limit, total=total, sessions=slots))
        except errors.EphemeralError as exc:
            raise fail(exc) from exc


def drain_worker(settings: Settings) -> None:
    """SIGTERM the worker whose pid file is in this state dir, then wait for it to exit."""
    from ephemeral.flows.worker import PID_FILE
    from ephemeral.owner import is_alive

    pid_file = settings.state_dir / PID_FILE
    try:
        owner = pid_file.read_text().strip()
    except OSError:
        owner = ""
    if not is_alive(owner):
        raise errors.NotFound(f"no worker is running on {settings.state_dir} (no live {pid_file})")
    pid = int(owner.rsplit(":", 2)[1])
    os.kill(pid, signal.SIGTERM)
    typer.echo(f"draining the worker {owner} (up to {settings.drain_seconds:.0f} s)", err=True)
    deadline = time.monotonic() + settings.drain_seconds + 60
    while is_alive(owner) and not _exited(pid):
        if time.monotonic() > deadline:
            raise errors.EphemeralError(f"the worker {owner} is still running after its drain")
        time.sleep(0.2)
    typer.echo("drained", err=True)


def _exited(pid: int) -> bool:
    """A zombie has exited; only its parent (a supervisor) has not collected it yet."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode(errors="replace")
    except OSError:
        return True
    return raw[raw.rfind(")") + 2 :].startswith(("Z", "X"))
