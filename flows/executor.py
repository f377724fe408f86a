"""The one place an entry point's executor is picked (:func:`executor_for`), and the flow
executor: each run an ``agent-run`` flow run in this process.

Importing this module does not import Prefect; the flow is imported on the first run, so
``executor_for`` is cheap for the plain path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

from ephemeral.engine.executor import Executor, PlainExecutor
from ephemeral.engine.exits import brief_error

if TYPE_CHECKING:
    from ephemeral.engine.executor import RunHandle
    from ephemeral.settings import Settings

log = logging.getLogger("ephemeral.flows.executor")

FLOW_START_ATTEMPTS = 4  # tries to start a run's Prefect flow before the run fails
FLOW_START_BACKOFF_SECONDS = 1.0


def flow_starts_at_once() -> int:
    """Flow-run creations in flight at once: one per core (at least two).

    A creation is a burst of writes to Prefect's database. One at a time (issue 12) capped the
    whole host at one start per creation latency (~1.5 s here) whatever its cores; unbounded, a
    burst of them made the embedded SQLite server answer 503. Per core keeps both away.
    """
    return max(2, os.cpu_count() or 2)


def executor_for(settings: Settings) -> Executor:
    """The executor ``EPHEMERAL_EXECUTOR`` names: ``plain`` (the steps, no Prefect),
    ``flow`` (an ``agent-run`` flow run in this process) or ``dispatch`` (a Prefect task
    worker on some host). Every entry point asks here."""
    if settings.executor == "dispatch":
        from ephemeral.flows.dispatch import DispatchExecutor

        return DispatchExecutor()
    return FlowExecutor() if settings.executor == "flow" else PlainExecutor()


class FlowExecutor:
    """Runs each admitted run as an ``agent-run`` flow run on the runtime's loop."""

    def __init__(self, starts_at_once: int | None = None) -> None:
        # Made on first use: an asyncio semaphore belongs to the loop that first awaits it.
        self._starts: asyncio.Semaphore | None = None
        self._starts_at_once = starts_at_once or flow_starts_at_once()
        # One Prefect client for every flow run of this executor. Without it each flow run
        # opens its own (an SSL context of ~30 ms CPU, an API version check round trip, a new
        # connection pool) and closes it at the end.
        self._client: Any = None  # prefect.context.AsyncClientContext, entered once
        self._sync_client: Any = None  # prefect.context.SyncClientContext, the same
        self._client_lock: asyncio.Lock | None = None

    async def close(self) -> None:
        if self._sync_client is not None:
            sync_client, self._sync_client = self._sync_client.client, None
            sync_client.__exit__(None, None, None)
        if self._client is not None:
            client, self._client = self._client.client, None
            await client.__aexit__(None, None, None)

    async def _client_contexts(self) -> tuple[Any, Any]:
        from prefect.context import AsyncClientContext, SyncClientContext

        if self._client_lock is None:
            self._client_lock = asyncio.Lock()
        async with self._client_lock:
            if self._client is None:
                from ephemeral.flows.prefect_client import retry_when_busy
                from ephemeral.prefect_setup import embedded

                ctx = AsyncClientContext()
                if embedded():
                    retry_when_busy(ctx.client)
                # Only the client is entered: the context variable is set per run (below), in
                # the run's own task, so no task resets a token another task's context made.
                await ctx.client.__aenter__()
                await ctx.client.raise_for_api_version_mismatch_once()
                # The flow engine also makes a synchronous client per flow run to resolve its
                # result storage (a path: no request); this one serves them all.
                sync = SyncClientContext()
                sync.client.__enter__()
                self._client, self._sync_client = ctx, sync
            return self._client, self._sync_client

    async def execute(self, run: RunHandle) -> None:
        """Start the run's flow, retrying while its body has not begun.

        At most :func:`flow_starts_at_once` flow runs are being created at once; the run stays
        ``queued`` until its turn to start, and only then is its slot granted (so waiting for a
        start turn is queue time, not run time).
        Until the flow body builds the run nothing has happened that a retry could repeat
        (no sandbox, no step), so Prefect API errors there are retried; once it has begun, the
        flow's own ``drive`` settles the run whatever happens.
        """
        from prefect.context import AsyncClientContext, SyncClientContext

        from ephemeral.flows.agent_run import RunId, agent_run

        if self._starts is None:
            self._starts = asyncio.Semaphore(self._starts_at_once)
        starts = self._starts
        # The flow engine takes the client from this context variable (get_or_create); set in
        # this task's context it reaches the flow's task and its task runs, and nothing else.
        # A private touch of Prefect, checked at start (ephemeral.flows.prefect_private).
        client, sync_client = await self._client_contexts()
        token = AsyncClientContext.__var__.set(client)
        sync_token = SyncClientContext.__var__.set(sync_client)
        try:
            for attempt in range(1, FLOW_START_ATTEMPTS + 1):
                run.restart()
                started = run.started
                runner: asyncio.Task[str] | None = None
                try:
                    async with starts:
                        if attempt == 1 and not await run.grant():
                            return
                        runner = asyncio.create_task(
                            agent_run(RunId(run)), name=f"flow-{run.run_id}"
                        )
                        waiter = asyncio.create_task(started.wait())
                        await asyncio.wait({runner, waiter}, return_when=asyncio.FIRST_COMPLETED)
                        waiter.cancel()
                    await runner
                    return
                except asyncio.CancelledError:
                    if runner is not None:
                        runner.cancel()
                        with contextlib.suppress(BaseException):
                            await runner
                    raise
                except Exception as exc:
                    if started.is_set() or attempt == FLOW_START_ATTEMPTS:
                        raise
                    log.warning(
                        "run %s: starting its flow failed (attempt %d of %d): %s",
                        run.run_id,
                        attempt,
                        FLOW_START_ATTEMPTS,
                        brief_error(exc),
                    )
                    await asyncio.sleep(FLOW_START_BACKOFF_SECONDS * 2 ** (attempt - 1))
        finally:
            SyncClientContext.__var__.reset(sync_token)
            AsyncClientContext.__var__.reset(token)
