"""The ASGI app: ``create_app(settings, runtime=None)``.

Without a runtime the app starts its own in the lifespan (warm pool and reaper included, as
``ephemeral serve`` does); with one (tests, embedding) it uses it and leaves closing it to the
caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from ephemeral import progress
from ephemeral.api import problems
from ephemeral.api.limits import BodyLimits
from ephemeral.api.pages import pages
from ephemeral.api.runs import router, v1
from ephemeral.api.sandboxes import sandboxes
from ephemeral.api.schemas import Problem, ProblemItem
from ephemeral.api.viewer import viewer
from ephemeral.engine.runtime import Runtime, freeze_startup_heap
from ephemeral.settings import Settings

log = logging.getLogger("ephemeral.serve")
STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
API_VERSION = "1.0.0"
DESCRIPTION = (
    "Run AI agents on untrusted code in disposable sandboxes under a hard money cap. "
    "Errors are `application/problem+json`; money is integer micro-dollars."
)


def start_prefect_server() -> None:
    """Start Prefect's local server now, off the event loop.

    Otherwise the first flow run starts it from inside the loop (Prefect's ``get_client`` does a
    blocking ``SubprocessASGIServer().start()``), freezing every request for 7-30 s. Callers
    configure Prefect first (:func:`ephemeral.prefect_setup.configure`). With ``PREFECT_API_URL``
    set there is nothing to start.
    """
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    progress.stage("starting Prefect's embedded server")
    from prefect.server.api.server import SubprocessASGIServer

    SubprocessASGIServer().start()


async def start_runtime(settings: Settings, *, warm_pool: bool) -> Runtime:
    """The server's runtime, with the executor ``EPHEMERAL_EXECUTOR`` names, on this loop: the
    one runtime, engine and slot semaphore of every run this process executes. Under ``flow``
    each run is an ``agent-run`` flow run awaited here, beside the HTTP handlers (Prefect's
    engine calls are async; what used to block, a client and an SSL context per flow run and a
    result-storage request, is gone: ``ephemeral.flows.executor.FlowExecutor``)."""
    from ephemeral.flows.executor import executor_for

    executor = executor_for(settings)
    if settings.executor == "dispatch":
        # This process admits, streams and cancels; workers execute. No warm pool.
        from ephemeral.flows.dispatch import DispatchExecutor, mark_crashed
        from ephemeral.sessions.placement import install

        assert isinstance(executor, DispatchExecutor)
        runtime = await Runtime.start(settings, executor=executor, recover=True)
        runtime.lease_expired_hooks.append(mark_crashed)
        executor.redrive(runtime.store)  # runs another API process admitted and did not hand over
        install(runtime)  # sandbox sessions are placed on worker hosts too
        return runtime
    if settings.executor != "plain":
        await asyncio.to_thread(start_prefect_server)
    return await Runtime.start(settings, executor=executor, warm_pool=warm_pool, recover=True)


def create_app(
    settings: Settings, runtime: Runtime | None = None, *, warm_pool: bool = True
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if runtime is not None:
            app.state.runtime = runtime
            yield
            return
        own = await start_runtime(settings, warm_pool=warm_pool)
        freeze_startup_heap()
        app.state.runtime = own
        base = f"http://{settings.host}:{settings.port}"
        log.info("ready: API %s/v1 (GET %s/healthz), runs %s/runs", base, base, base)
        try:
            yield
        finally:
            app.state.runtime = None
            await own.close()

    app = FastAPI(
        title="Ephemeral",
        version=API_VERSION,
        description=DESCRIPTION,
        lifespan=lifespan,
        # Swagger UI would load its script from a CDN: none is reachable offline/air-gapped.
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.runtime = runtime
    app.state.isolation_cache = {}
    problems.install(app)
    app.add_middleware(BodyLimits)
    app.include_router(router)
    app.include_router(v1)
    app.include_router(sandboxes)
    app.include_router(viewer)  # before pages: /runs is the list, /runs/{id} a run
    app.include_router(pages)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components["ProblemItem"] = ProblemItem.model_json_schema()
            problem = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
            problem.pop("$defs", None)
            components["Problem"] = problem
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
