"""``ephemeral worker``: one host's share of a scale-out deployment (docs/deploy.md).

One process per host: a Prefect task worker serving ``execute-run``, with this host's runtime
on the same event loop (its warm pool, its leases and cancel watch, its watchdog, and the
reaper that ran at start). Before serving it makes sure the global concurrency limits exist:
``microvm:<host>`` at ``--limit`` (created or updated) and ``microvm-total`` (created if
missing; an operator sets its real value).
"""

from __future__ import annotations

import contextlib
import logging

from ephemeral.flows.dispatch import TOTAL_LIMIT, execute_run, host_limit, mark_crashed
from ephemeral.service import Runtime
from ephemeral.settings import Settings

log = logging.getLogger("ephemeral.flows.worker")


async def ensure_limits(host: str, limit: int, total: int) -> None:
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    async with get_client() as client:
        await client.upsert_global_concurrency_limit_by_name(host_limit(host), limit)
        try:
            await client.read_global_concurrency_limit_by_name(TOTAL_LIMIT)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):  # another host made it first
                await client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=TOTAL_LIMIT, limit=total)
                )


async def serve(settings: Settings, *, limit: int, total: int, sessions: int = 32) -> None:
    """Serve runs (and, over the internal channel, up to ``sessions`` sandbox sessions) until
    interrupted; the runtime closes (sandboxes torn down) on the way out."""
    from prefect.task_worker import TaskWorker

    from ephemeral.session_host import SessionHost

    await ensure_limits(settings.host_id, limit, total)
    # recover=True: sandboxes left by this host's previous (killed) worker are reaped now.
    runtime = await Runtime.start(settings, warm_pool=settings.pool_size > 0, recover=True)
    runtime.hold_leases(settings.lease_seconds)
    runtime.lease_expired_hooks.append(mark_crashed)
    host = await SessionHost.start(runtime, slots=sessions) if sessions else None
    log.warning("worker %s serving execute-run (limit %d)", settings.host_id, limit)
    try:
        await TaskWorker(execute_run, limit=limit).astart()
    finally:
        if host is not None:
            await host.close()
        await runtime.close()
