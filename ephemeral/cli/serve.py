"""CLI: ``ephemeral serve``: the API, the pages, the runtime (warm pool, reaper) in one process."""

from __future__ import annotations

import asyncio
import copy
from typing import Annotated, Any

import typer

from ephemeral import errors
from ephemeral.cli.output import fail
from ephemeral.settings import Settings

DEFAULT_POOL = 2


def pool_size(flag: int | None, base: Settings) -> int:
    """The flag, else ``EPHEMERAL_POOL_SIZE`` when it is set (0 included: no pool), else 2."""
    if flag is not None:
        return flag
    return base.pool_size if "pool_size" in base.model_fields_set else DEFAULT_POOL


# Our lines in uvicorn's log, formatted as its own: start-up stages (ephemeral.progress), where
# the server is once healthy (ephemeral.serve), one line per closed run (ephemeral.runs).
LOGGERS = ("ephemeral.progress", "ephemeral.serve", "ephemeral.runs")


def log_config() -> dict[str, Any]:
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    for name in LOGGERS:
        config["loggers"][name] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


def register(app: typer.Typer) -> None:
    @app.command("serve")
    def serve(
        host: Annotated[
            str | None,
            typer.Option(help="Address to listen on (default: EPHEMERAL_HOST, else 127.0.0.1)."),
        ] = None,
        port: Annotated[
            int | None, typer.Option(help="TCP port (default: EPHEMERAL_PORT, else 8000).")
        ] = None,
        pool: Annotated[
            int | None,
            typer.Option(
                help="Warm sandboxes kept ready, 0 for none "
                "(default: EPHEMERAL_POOL_SIZE if set, else 2)."
            ),
        ] = None,
    ) -> None:
        """Serve the HTTP API and the run pages (embedded stores, Prefect, warm pool, reaper).

        Its log names each start-up stage (Prefect's server, the store, the warm pool), then
        "ready: API <url>/v1 (GET <url>/healthz), runs <url>/runs" (the runs list) once it
        answers, and one line per run this process ends: id, status, reason, charge.
        """
        import uvicorn

        from ephemeral.api import create_app

        size = pool_size(pool, Settings.load())
        if not 0 <= size <= 64:
            raise typer.BadParameter("must be between 0 and 64", param_hint="--pool")
        # A flag overrides the environment; an absent flag leaves Settings' own value.
        given = {k: v for k, v in {"host": host, "port": port}.items() if v is not None}
        settings = Settings.load(pool_size=size, **given)
        if settings.executor != "plain":
            from ephemeral.flows.embedded_server import configure

            configure(settings)
        if settings.executor == "dispatch":
            from ephemeral.cluster import sharing

            try:  # a records root or seal key the cluster's other processes do not share
                asyncio.run(sharing.check(settings))
            except errors.EphemeralError as exc:
                raise fail(exc) from exc
        app = create_app(settings, warm_pool=size > 0)
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_config=log_config(),
            log_level="info",
            proxy_headers=False,
            timeout_graceful_shutdown=10,
        )
        uvicorn.Server(config).run()


def register_view(app: typer.Typer) -> None:
    @app.command("view")
    def view(
        port: Annotated[
            int, typer.Option(help="TCP port on 127.0.0.1 (0: any free one).", min=0, max=65535)
        ] = 0,
        browser: Annotated[
            bool, typer.Option("--browser/--no-browser", help="Open the runs list in a browser.")
        ] = True,
    ) -> None:
        """Browse the local results: the runs list, suite runs and compare pages, on 127.0.0.1.

        Serves this state directory's records (no warm pool, no Prefect) with a member key of
        the local org made for this session and revoked when it stops; sign in with the key
        it prints.
        """
        import socket
        import webbrowser

        import uvicorn

        from ephemeral.api import create_app

        settings = Settings.load(host="127.0.0.1", pool_size=0, executor="plain")
        if port == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        key_id, key = asyncio.run(_view_key(settings))
        url = f"http://127.0.0.1:{port}/runs"
        typer.echo(f"Results at {url}\nSign in with this key (revoked when view stops): {key}")
        if browser:
            webbrowser.open(f"http://127.0.0.1:{port}/login?next=/runs")
        config = uvicorn.Config(
            create_app(settings, warm_pool=False),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
        try:
            uvicorn.Server(config).run()
        finally:
            asyncio.run(_revoke(settings, key_id))


async def _view_key(settings: Settings) -> tuple[str, str]:
    from ephemeral.engine.runtime import LOCAL_ORG, LOCAL_ORG_CREDIT_MICROS
    from ephemeral.store import Store

    store = await Store.open(settings.db_url)
    try:  # the local org as `run` and `eval` make it, if they have not yet
        org = await store.orgs.ensure(LOCAL_ORG, initial_credit_micros=LOCAL_ORG_CREDIT_MICROS)
        key, plaintext = await store.keys.create(org.id, "view@localhost")
        return key.id, plaintext
    finally:
        await store.close()


async def _revoke(settings: Settings, key_id: str) -> None:
    from ephemeral.store import Store

    store = await Store.open(settings.db_url)
    try:
        await store.keys.revoke(key_id)
    finally:
        await store.close()
