"""The Prefect client's transport to the embedded server: a 503 is retried in milliseconds.

The embedded server keeps its state in SQLite. Its ``create_flow_run`` reads, then writes, in one
deferred transaction; when another writer commits in between (the task-run recorder writing the
previous runs' task runs, another flow run's state), SQLite refuses the upgrade at once
(``SQLITE_BUSY``: no busy wait can help a stale snapshot), the server rolls the transaction back
and answers 503. Prefect's client retries that, but only after ``2 ** attempt`` seconds: two
seconds for nearly every flow start under load, measured (docs/deploy.md, "Fourth pass"). Nothing
was written, so the request can be sent again at once; this transport does that, with a short
jittered back-off, before Prefect's own retries ever see the 503.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx

from ephemeral import errors

FIRST_DELAY_SECONDS = 0.02
MAX_DELAY_SECONDS = 0.5
# Past this the 503 goes to Prefect's client, which retries it its own (slower) way.
RETRY_BUDGET_SECONDS = 10.0


class RetryWhenBusy(httpx.AsyncBaseTransport):
    """Sends a request again while the server answers 503, for up to ``budget`` seconds.

    Only for the embedded server (no ``PREFECT_API_URL``): a served Prefect server is left to
    Prefect's own back-off, since its 503s may mean an overloaded server that a fast retry would
    load further.
    """

    def __init__(
        self,
        inner: httpx.AsyncBaseTransport,
        *,
        first_delay: float = FIRST_DELAY_SECONDS,
        max_delay: float = MAX_DELAY_SECONDS,
        budget: float = RETRY_BUDGET_SECONDS,
    ) -> None:
        self._inner = inner
        self._first_delay = first_delay
        self._max_delay = max_delay
        self._budget = budget
        self.retried = 0  # 503s answered by sending again (read by the bench and the tests)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        delay = self._first_delay
        deadline = time.monotonic() + self._budget
        while True:
            response = await self._inner.handle_async_request(request)
            if response.status_code != 503 or time.monotonic() + delay > deadline:
                return response
            await response.aclose()
            self.retried += 1
            # jitter: writers that collided once must not collide again in lockstep
            await asyncio.sleep(delay * random.uniform(1.0, 1.5))
            delay = min(delay * 2, self._max_delay)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> RetryWhenBusy:
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self._inner.__aexit__(*exc_info)


def retry_when_busy(client: Any) -> RetryWhenBusy:
    """Wrap the transport of a Prefect client (before it is entered) in :class:`RetryWhenBusy`.

    The client's own transport stays inside (Prefect gives it 3 connection retries). Prefect
    offers ``httpx_settings={"transport": ...}`` for this, but a client made with settings is
    one the flow engine's ``get_client()`` (asking with none) does not match, so it would make
    a new client per flow run (an SSL context, a version check: 0.3 CPU-s a run, measured).
    """
    # Private touches of Prefect and httpx, checked at start (ephemeral.flows.prefect_private)
    # and here on the client itself.
    http = getattr(client, "_client", None)  # PrefectHttpxAsyncClient, an httpx.AsyncClient
    inner = getattr(http, "_transport", None)
    if not isinstance(http, httpx.AsyncClient) or not isinstance(inner, httpx.AsyncBaseTransport):
        raise errors.PrefectIncompatible(
            "PrefectClient._client._transport (used by retry_when_busy) is not an httpx client's "
            "transport in the installed Prefect (ephemeral/flows/prefect_private.py)"
        )
    wrapped = RetryWhenBusy(inner)
    http._transport = wrapped
    return wrapped
