"""The Prefect executor: each run is an ``agent-run`` flow run (entry points choose it).

Importing this module does not import Prefect; the flow is imported on the first run, so
``executor_for`` is cheap for the plain path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from ephemeral.executor import Executor, PlainExecutor
from ephemeral.service import brief_error

if TYPE_CHECKING:
    from ephemeral.service import Runtime
    from ephemeral.settings import Settings

log = logging.getLogger("ephemeral.flows.executor")

FLOW_START_ATTEMPTS = 4  # tries to start a run's Prefect flow before the run fails
FLOW_START_BACKOFF_SECONDS = 1.0


def executor_for(settings: Settings) -> Executor:
    """The executor the settings ask for: dispatch to workers (``executor=prefect``), the
    ``agent-run`` flow in this process (``use_prefect``), or plain steps."""
    if settings.executor == "prefect":
        from ephemeral.flows.dispatch import DispatchExecutor

        return DispatchExecutor()
    return PrefectExecutor() if settings.use_prefect else PlainExecutor()


class PrefectExecutor:
    """Runs each admitted run as an ``agent-run`` flow run on the runtime's loop."""

    def __init__(self) -> None:
        # Creating a Prefect flow run is a burst of writes to Prefect's database; one at a time
        # keeps the embedded SQLite server from answering 503 under load (docs/deploy.md).
        # Made on first use: an asyncio lock belongs to the loop that first awaits it.
        self._starts: asyncio.Semaphore | None = None

    async def close(self) -> None:
        return None

    async def execute(self, runtime: Runtime, run_id: str) -> None:
        """Start the run's flow, retrying while its body has not begun.

        Flow starts are serialised; the run stays ``queued`` until its turn to start, and only
        then is its slot granted (so waiting for the start lock is queue time, not run time).
        Until the flow body builds the run nothing has happened that a retry could repeat
        (no sandbox, no step), so Prefect API errors there are retried; once it has begun, the
        flow's own ``drive`` settles the run whatever happens.
        """
        from ephemeral.flows.agent_run import agent_run

        if self._starts is None:
            self._starts = asyncio.Semaphore(1)
        for attempt in range(1, FLOW_START_ATTEMPTS + 1):
            started = runtime.build_signal(run_id)
            runner: asyncio.Task[str] | None = None
            try:
                async with self._starts:
                    if attempt == 1 and not await runtime.grant(run_id):
                        return
                    runner = asyncio.create_task(agent_run(run_id), name=f"flow-{run_id}")
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
                    run_id,
                    attempt,
                    FLOW_START_ATTEMPTS,
                    brief_error(exc),
                )
                await asyncio.sleep(FLOW_START_BACKOFF_SECONDS * 2 ** (attempt - 1))
