"""Retries for transient model errors, inside the run's deadline.

Kept in our code rather than Prefect's ``retries=`` so the Prefect path and the plain path
behave the same, the provider's ``Retry-After`` is honoured, and no retry outlives the run.
Only model calls are retried: a shell step has side effects and is never repeated.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ephemeral import errors

T = TypeVar("T")

MAX_ATTEMPTS = 4
BASE_DELAY = 0.5
MAX_DELAY = 8.0
MAX_CALL_SECONDS = 120.0


async def call_with_retries(
    call: Callable[[float], Awaitable[T]],
    *,
    deadline: Callable[[], float],
    cancelled: asyncio.Event | None = None,
    attempts: int = MAX_ATTEMPTS,
) -> T:
    """Call ``call(timeout)``; on :class:`TransientModelError` back off and try again.

    ``deadline()`` returns the seconds left for the whole run; each attempt's timeout and
    each sleep are bounded by it.
    """
    last: errors.TransientModelError | None = None
    for attempt in range(attempts):
        left = deadline()
        if left <= 0:
            break
        try:
            return await asyncio.wait_for(call(min(left, MAX_CALL_SECONDS)), timeout=left)
        except TimeoutError as exc:
            last = errors.TransientModelError("the model call timed out", cause=exc)
        except errors.TransientModelError as exc:
            last = exc
        delay = min(MAX_DELAY, BASE_DELAY * 2**attempt) * (0.5 + random.random() / 2)
        if last.retry_after is not None:
            delay = max(delay, min(last.retry_after, MAX_DELAY * 4))
        if attempt + 1 >= attempts or delay >= deadline():
            break
        if cancelled is not None:
            try:
                await asyncio.wait_for(cancelled.wait(), timeout=delay)
                break
            except TimeoutError:
                pass
        else:
            await asyncio.sleep(delay)
    detail = last.detail if last else "no time left for the model call"
    raise errors.ModelError(f"model unavailable after retries: {detail}")
