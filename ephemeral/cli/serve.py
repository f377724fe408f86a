"""CLI: ``ephemeral serve``: the API, the pages, the runtime (warm pool, reaper) in one process."""

from __future__ import annotations

from typing import Annotated

import typer

from ephemeral.settings import Settings

DEFAULT_POOL = 2


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
            typer.Option(help="Warm sandboxes kept ready (default: pool_size or 2; 0 = off)."),
        ] = None,
    ) -> None:
        """Serve the HTTP API and the run pages (embedded stores, Prefect, warm pool, reaper)."""
        import uvicorn

        from ephemeral.api import create_app

        base = Settings.load()
        size = pool if pool is not None else (base.pool_size or DEFAULT_POOL)
        if not 0 <= size <= 64:
            raise typer.BadParameter("must be between 0 and 64", param_hint="--pool")
        # A flag overrides the environment; an absent flag leaves Settings' own value.
        given = {k: v for k, v in {"host": host, "port": port}.items() if v is not None}
        settings = Settings.load(pool_size=size, **given)
        if settings.use_prefect or settings.executor == "prefect":
            from ephemeral.prefect_setup import configure

            configure(settings)
        app = create_app(settings, warm_pool=size > 0)
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level="info",
            proxy_headers=False,
            timeout_graceful_shutdown=10,
        )
        uvicorn.Server(config).run()
