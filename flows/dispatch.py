"""Dispatch mode (``EPHEMERAL_EXECUTOR=dispatch``): each admitted run is a Prefect task run of
``execute-run``, executed by a task worker (``ephemeral worker``) on whichever host takes it.

Chosen over flow runs of a deployment on a process work pool by measurement (docs/deploy.md,
``bench/scaleout.py --mechanisms``): a task worker is one long-lived process that receives its
task runs over a websocket, where a process worker polls and spawns a fresh Python per run.
The only parameter is the run id: Prefect keeps parameters (in its task-parameter storage), so
prompts and outputs never go there; zero-data-retention content crosses sealed in our store.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any
from uuid import UUID

from prefect import Task, task

from ephemeral.cluster import outbox
from ephemeral.engine import exits

if TYPE_CHECKING:
    from ephemeral.engine.executor import RunHandle
    from ephemeral.engine.runtime import Runtime
    from ephemeral.store import Store

log = logging.getLogger("ephemeral.flows.dispatch")

TOTAL_LIMIT = "microvm-total"
SLOT_TIMEOUT_SECONDS = 300


def host_limit(host: str) -> str:
    """The global concurrency limit of one host's sandboxes (docs/deploy.md)."""
    return f"microvm:{host}"


def execute_run_task(runtime: Runtime | None) -> Task[[str], Coroutine[Any, Any, str]]:
    """The ``execute-run`` task, executing its runs on ``runtime`` (a worker's, which it built
    at its start and hands in here: the body looks nothing up).

    Every call makes the same task to Prefect: one code object, so one ``task_key``. A task run
    created from :data:`execute_run` (no runtime: a dispatching process only creates runs) is
    served by the worker's own ``execute_run_task(runtime)``."""

    @task(name="execute-run", task_run_name="{run_id}", retries=0, log_prints=False)
    async def execute_run(run_id: str) -> str:
        """Execute one admitted run on this worker; returns its status (no content)."""
        if runtime is None:
            raise RuntimeError("execute-run runs inside `ephemeral worker` only")
        return await _execute(runtime, run_id)

    return execute_run


execute_run = execute_run_task(None)


async def _execute(runtime: Runtime, run_id: str) -> str:
    from prefect.concurrency.asyncio import concurrency

    if runtime.draining:  # this host takes no new runs: another one will
        await hand_back(runtime, run_id)
        return (await runtime.store.runs.get(run_id)).status
    if not await runtime.take(run_id):
        return (await runtime.store.runs.get(run_id)).status  # cancelled while it waited
    # The code that starts sandboxes takes a slot of this host's limit and of the total, and
    # strict: a missing limit fails loudly instead of limiting nothing.
    try:
        async with concurrency(
            [host_limit(runtime.host), TOTAL_LIMIT],
            occupy=1,
            strict=True,
            timeout_seconds=SLOT_TIMEOUT_SECONDS,
        ):
            row = await runtime.execute(run_id)
    except Exception as exc:  # no slot (a missing limit, a timeout): the run must not wait on
        await runtime.engine.end(run_id, exits.crashed(exc), release=True)
        raise
    return row.status


async def create_task_run(run_id: str, task_run_id: UUID, client: Any = None) -> None:
    """One deferred task run of ``execute-run`` with this id, which one task worker picks up;
    one that exists already (Prefect answers 409) is left as it is (ephemeral.cluster.outbox).

    ``create_run`` is the async core of ``execute_run.delay`` (``delay`` would block this
    event loop while it waits for Prefect's API). It is named for the run from the start, so a
    worker that receives it knows the run before it reads the parameters.
    """
    from prefect.exceptions import PrefectHTTPStatusError

    named = copy.copy(execute_run)  # 5 µs; ``with_options`` rebuilds the task (3 ms, measured)
    named.name = run_id
    try:
        await named.create_run(
            client=client, id=task_run_id, parameters={"run_id": run_id}, deferred=True
        )
    except PrefectHTTPStatusError as exc:
        if exc.response.status_code != 409:
            raise


async def dispatch(store: Store, run_id: str, client: Any = None) -> None:
    """Hand an admitted run to the pool through the outbox (idempotent: ephemeral.cluster.outbox).
    ``client``: an open Prefect client to reuse."""
    await outbox.hand_over(
        store, await store.runs.get(run_id), lambda r, t: create_task_run(r, t, client)
    )


async def hand_back(runtime: Runtime, run_id: str) -> bool:
    """Give a run this worker took but never started back to the queue, under a fresh task
    run (a drain). False if it no longer waits here. If the new task run cannot be made now,
    the outbox of any live process makes it."""
    if await runtime.store.outbox.release(run_id, runtime.owner) is None:
        return False
    try:
        await outbox.hand_over(runtime.store, await runtime.store.runs.get(run_id), create_task_run)
    except Exception:
        log.exception("run %s: handing it back to Prefect failed (the outbox retries)", run_id)
    return True


async def mark_crashed(run_id: str) -> None:
    """Mark the Prefect task run of a run whose host died CRASHED (its lease expired)."""
    from prefect import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName
    from prefect.states import Crashed

    async with get_client() as client:
        task_runs = await client.read_task_runs(
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=[run_id]))
        )
        for task_run in task_runs:
            if task_run.state is not None and not task_run.state.is_final():
                await client.set_task_run_state(
                    task_run.id,
                    Crashed(message="the host executing the run stopped renewing its lease"),
                    force=True,
                )


class DispatchExecutor:
    """For processes that wait for their runs (``ephemeral run``/``eval``): dispatch the run,
    then wait here until a worker settled it. The runtime's scheduler (suite concurrency and
    budgets) stays in this process; the sandboxes are on the workers."""

    def __init__(self) -> None:
        self._client: Any = None  # one Prefect client for every dispatch, opened on first use
        self._outbox: asyncio.Task[None] | None = None

    def redrive(self, store: Store) -> None:
        """Re-drive the outbox from this process too, until :meth:`close` (API processes)."""
        self._outbox = asyncio.create_task(
            outbox.redrive_forever(store, create_task_run), name="outbox"
        )

    async def dispatch(self, store: Store, run_id: str) -> None:
        if self._client is None:
            from prefect import get_client

            client = get_client()
            await client.__aenter__()
            self._client = client
        await dispatch(store, run_id, self._client)

    async def execute(self, run: RunHandle) -> None:
        await run.dispatch()
        try:
            # A zero-data-retention output the worker sealed comes into this process's
            # custody, for its one reader: this process's caller.
            await run.done()
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(run.cancel())
            raise

    async def close(self) -> None:
        if self._outbox is not None:
            self._outbox.cancel()
            with contextlib.suppress(BaseException):
                await self._outbox
        if self._client is not None:
            client, self._client = self._client, None
            await client.__aexit__(None, None, None)
