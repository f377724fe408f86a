"""Server-Sent Events framing for a run's events.

``id:`` is the event ``seq`` so a client resumes with ``Last-Event-ID``; a comment line is sent
while nothing happens so proxies and clients can tell a quiet run from a dead connection. The
stream ends after ``run.settled``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import Query

from ephemeral import errors
from ephemeral.events import MAX_SEQ, Event

KEEPALIVE_SECONDS = 15.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def frame(data: Any, *, id: int | None = None, event: str | None = None) -> str:
    lines = []
    if id is not None:
        lines.append(f"id: {id}")
    if event is not None:
        lines.append(f"event: {event}")
    # JSON never contains a raw newline, so one data line carries one event.
    lines.append("data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False))
    return "\n".join(lines) + "\n\n"


# `?after=`: the seq to resume after, bounded like every seq (a 422 past it, not a 500)
After = Annotated[int, Query(ge=0, le=MAX_SEQ, description="Only events with seq > after")]


def parse_last_event_id(value: str | None) -> int | None:
    if value is None or value.strip() == "":
        return None
    text = value.strip()
    if not text.isdigit() or len(text) > 18 or int(text) > MAX_SEQ:
        raise errors.InvalidRequest.field(
            "Last-Event-ID", f"must be the seq of an event (an integer, at most {MAX_SEQ})"
        )
    return int(text)


async def stream(
    events: AsyncIterator[Event],
    render: Callable[[Event], str],
    keepalive: float = KEEPALIVE_SECONDS,
) -> AsyncIterator[str]:
    """Frames for ``events`` with keep-alive comments in between; ends when ``events`` ends."""
    queue: asyncio.Queue[Event | None] = asyncio.Queue(maxsize=256)

    async def pump() -> None:
        try:
            async for ev in events:
                await queue.put(ev)
        finally:
            await queue.put(None)

    task = asyncio.create_task(pump())
    try:
        yield ": stream open\n\n"
        while True:
            try:
                ev = await asyncio.wait_for(queue.get(), keepalive)
            except TimeoutError:
                yield ": keep-alive\n\n"
                continue
            if ev is None:
                break
            yield render(ev)
        await task  # surface an error of the event source instead of ending silently
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
