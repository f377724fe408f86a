"""The admission outbox of dispatch mode: no admitted run is left without a Prefect task run.

The run row is the outbox entry. A dispatched run is born ``queued`` with no owner and
``dispatched_at`` NULL; the admitting process creates its task run and then sets
``dispatched_at``. A process killed anywhere in between leaves a run that every live API
process and worker finds here (:func:`redrive`, every ``REDRIVE_SECONDS``) once it is
``GRACE_SECONDS`` old, and hands over again. The hand-over is idempotent: the task run's id is
derived from the run id and the hand-over number (``dispatches``), so a second creation of the
same task run is refused by Prefect (409) instead of making a duplicate, whoever makes it and
however the first attempt ended. A draining worker hands the runs it took but never started
back under the next number (``store.outbox.release``), which gives them a fresh task run.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta

from ephemeral.ids import utcnow
from ephemeral.store import RunRow, Store

log = logging.getLogger("ephemeral.cluster.outbox")

# How long the admitting process has to hand its run over itself before others step in: its
# Prefect call takes ~50 ms, seconds on a loaded box. A re-drive before that is harmless
# (idempotent), only wasted.
GRACE_SECONDS = 3.0
REDRIVE_SECONDS = 1.0
_NAMESPACE = uuid.UUID("5b7e0f0e-9d1c-4f43-8a55-0e2d6c1f0a77")

# create(run_id, task_run_id): make the deferred task run with that id; an existing one is a
# success (Prefect answered 409), anything else raises.
Create = Callable[[str, uuid.UUID], Awaitable[None]]


def task_run_id(run_id: str, generation: int) -> uuid.UUID:
    """The Prefect task run of hand-over ``generation`` of a run: the same in every process."""
    return uuid.uuid5(_NAMESPACE, f"{run_id}/{generation}")


async def hand_over(store: Store, row: RunRow, create: Create) -> None:
    """Create the run's task run (or find it made) and mark the run dispatched."""
    generation = row.dispatches or 0
    await create(row.id, task_run_id(row.id, generation))
    await store.outbox.mark_dispatched(row.id, generation)


async def redrive(store: Store, create: Create) -> list[str]:
    """Hand over every run a dead process left undispatched; returns their ids."""
    done = []
    for row in await store.outbox.undispatched(utcnow() - timedelta(seconds=GRACE_SECONDS)):
        try:
            await hand_over(store, row, create)
        except Exception:
            log.exception("run %s: re-driving its hand-over to Prefect failed", row.id)
            continue
        log.warning("run %s: handed over to Prefect by the outbox", row.id)
        done.append(row.id)
    return done


async def redrive_forever(store: Store, create: Create) -> None:
    """:func:`redrive` every ``REDRIVE_SECONDS`` until cancelled (API processes, workers)."""
    while True:
        await asyncio.sleep(REDRIVE_SECONDS)
        try:
            await redrive(store, create)
        except Exception:
            log.exception("outbox: re-drive failed")
