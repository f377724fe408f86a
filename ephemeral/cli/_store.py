"""Run one coroutine against the operational store, for the CLI's short-lived commands.

The store (SQLAlchemy) is imported only when a command needs it: importing it costs ~0.5 s,
which every ``ephemeral --help`` would otherwise pay.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from ephemeral import errors
from ephemeral.cli.output import fail
from ephemeral.settings import Settings

if TYPE_CHECKING:
    from ephemeral.store import Store

T = TypeVar("T")


def with_store(fn: Callable[[Store], Awaitable[T]], settings: Settings | None = None) -> T:
    """Open the store, run ``fn``, close it; an EphemeralError exits through :func:`fail`."""
    settings = settings or Settings.load()

    async def go() -> T:
        from ephemeral.store import Store

        store = await Store.open(settings.db_url)
        try:
            return await fn(store)
        finally:
            await store.close()

    try:
        return asyncio.run(go())
    except errors.EphemeralError as exc:
        raise fail(exc) from exc
