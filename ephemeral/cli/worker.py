"""CLI: ``ephemeral worker``: execute dispatched runs on this host (docs/deploy.md)."""

from __future__ import annotations

import asyncio
import contextlib
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
    ) -> None:
        """Take runs from Prefect and execute them here: sandboxes, leases, reaper, warm pool;
        host the sandbox sessions API processes place here (over the internal channel).

        One per host. Needs PREFECT_API_URL (the shared Prefect server) and, for several hosts,
        a shared EPHEMERAL_DATABASE_URL and records root; EPHEMERAL_HOST_ID names the host.
        """
        from ephemeral.prefect_setup import configure

        base = Settings.load()
        size = pool if pool is not None else base.pool_size
        if not 0 <= size <= 64:
            raise typer.BadParameter("must be between 0 and 64", param_hint="--pool")
        settings = Settings.load(
            executor="prefect", pool_size=size, max_concurrent_runs=max(limit, 1)
        )
        try:
            from ephemeral.hostlink import check_bind_address

            check_bind_address(settings.link_address)  # refused before anything starts
            configure(settings)  # before Prefect is imported: it reads its settings once
            from ephemeral.flows.worker import serve

            with contextlib.suppress(KeyboardInterrupt):
                slots = sessions if sessions is not None else settings.host_sessions
                asyncio.run(serve(settings, limit=limit, total=total, sessions=slots))
        except errors.EphemeralError as exc:
            raise fail(exc) from exc
