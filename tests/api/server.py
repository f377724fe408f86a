"""A real uvicorn on 127.0.0.1 (random port) in a thread, with the runtime in its lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn

from ephemeral.api import create_app
from ephemeral.settings import Settings
from ephemeral.store import Store


@dataclass
class LiveServer:
    url: str
    settings: Settings

    def member(self, org: str, usd_micros: int = 10_000_000) -> str:
        """A fresh org with credit and a member key (through the store, as the admin CLI does)."""

        async def make() -> str:
            store = await Store.open(self.settings.db_url)
            try:
                created = await store.orgs.create(org)
                await store.orgs.credit(created.id, usd_micros, note="test")
                _, key = await store.keys.create(created.id, f"me@{org}.test")
                return key
            finally:
                await store.close()

        # In a thread of its own: the caller may be inside a running loop (Playwright's sync API).
        result: list[str] = []
        worker = threading.Thread(target=lambda: result.append(asyncio.run(make())))
        worker.start()
        worker.join(60)
        return result[0]


START_PATIENCE = 900.0


@contextlib.contextmanager
def live_server(settings: Settings, *, warm_pool: bool = False) -> Iterator[LiveServer]:
    app = create_app(settings, warm_pool=warm_pool)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    # the start boots the warm pool and, under `flow`, Prefect's embedded server: more than
    # 60 s at load 40 here. The bound only stops a server that never comes up (a start that
    # fails ends the thread, which fails the test at once)
    deadline = time.monotonic() + START_PATIENCE
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield LiveServer(url=f"http://127.0.0.1:{port}", settings=settings)
    finally:
        server.should_exit = True
        thread.join(30)
