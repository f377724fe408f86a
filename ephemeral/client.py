"""The Python client of the HTTP API (DESIGN §3), over httpx.

    client = Client(Settings.load())           # EPHEMERAL_URL, EPHEMERAL_API_KEY
    run = client.runs.create(prompt="…", shell=True, max_cost_micros=40_000)
    for ev in client.runs.events(run["id"], stream=True):
        print(ev.type)
    run = client.runs.wait(run["id"])

Errors come back as the classes of :mod:`ephemeral.errors` (problem+json → ``error_for``).
``runs.create`` sends an ``Idempotency-Key`` (generated unless given) and retries connection
errors, 429, 502 and 503, and 409 (the first attempt still being admitted) with the same key, so a
retry can never start a second run or reserve twice. A GET is sent again after a connection
error (it changes nothing). The event stream resumes with ``Last-Event-ID`` after a dropped
connection.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from ephemeral import errors
from ephemeral.events import Event
from ephemeral.policy import RunRequest
from ephemeral.settings import Settings

RETRY_STATUSES = frozenset({409, 429, 502, 503})
MAX_ATTEMPTS = 5
# A read is sent again on a connection error: a busy server may close an idle keep-alive
# connection just as the client reuses it (the soak's 64 clients met this), and a GET
# changes nothing, so sending it again is safe. Other methods go through post_idempotent.
SAFE_METHODS = frozenset({"GET", "HEAD"})
RETRIED_ERRORS = (httpx.NetworkError, httpx.RemoteProtocolError)
MAX_STREAM_RECONNECTS = 20
DEFAULT_TIMEOUT = httpx.Timeout(30.0, read=60.0)
STREAM_TIMEOUT = httpx.Timeout(30.0, read=None)  # a quiet shell step may last minutes


# -- wire helpers shared by the sync and async clients ---------------------------------------------


def raise_for_problem(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        body = response.json()
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    slug = str(body.get("type", "")).rsplit("/", 1)[-1] or None
    cls = errors.error_for(response.status_code, slug)
    detail = str(body.get("detail") or f"HTTP {response.status_code} from {response.request.url}")
    items = body.get("errors") if isinstance(body.get("errors"), list) else None
    exc = cls(detail, errors=items)
    exc.status_code = response.status_code  # type: ignore[attr-defined]
    raise exc


def _retry_delay(attempt: int, response: httpx.Response | None) -> float:
    if response is not None:
        header = response.headers.get("retry-after", "")
        if header.isdigit():
            return min(float(header), 30.0)
    return min(0.25 * 2**attempt, 5.0)


def _body(prompt: str | None, request: RunRequest | None, fields: dict[str, Any]) -> dict[str, Any]:
    if request is not None:
        if prompt is not None or fields:
            raise errors.InvalidRequest.field("request", "give a RunRequest or fields, not both")
        return request.model_dump(mode="json", exclude_unset=True)
    if prompt is None:
        raise errors.InvalidRequest.field("prompt", "is required")
    return {"prompt": prompt, **fields}


@dataclass
class SSEParser:
    """Server-Sent Events, line by line (the subset the API sends: id, event, data, comments)."""

    data: list[str] = field(default_factory=list)
    event: str | None = None
    last_id: str | None = None

    def feed(self, line: str) -> tuple[str | None, str] | None:
        """One line without its newline; returns (event, data) when a message is complete."""
        if line == "":
            if not self.data:
                self.event = None
                return None
            message = (self.event, "\n".join(self.data))
            self.data, self.event = [], None
            return message
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self.data.append(value)
        elif name == "event":
            self.event = value
        elif name == "id" and "\0" not in value:
            self.last_id = value
        return None


def _event(data: str) -> Event:
    return Event.model_validate(json.loads(data))


def _settings(
    settings: Settings | None, base_url: str | None, api_key: str | None
) -> tuple[str, str]:
    settings = settings or Settings.load()
    url = base_url or settings.url
    key = api_key or (settings.api_key.get_secret_value() if settings.api_key else None)
    if not url:
        raise errors.InvalidRequest.field("EPHEMERAL_URL", "is not set")
    if not key:
        raise errors.InvalidRequest.field("EPHEMERAL_API_KEY", "is not set")
    return url.rstrip("/"), key


# -- sync ----------------------------------------------------------------------------------------


class Client:
    def __init__(
        self,
        settings: Settings | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        transport: httpx.BaseTransport | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
    ) -> None:
        url, key = _settings(settings, base_url, api_key)
        self.http = httpx.Client(
            base_url=url,
            transport=transport,
            timeout=timeout,
            headers={"Authorization": f"Bearer {key}", "User-Agent": "ephemeral-client/1"},
        )
        self.runs = Runs(self)
        self.sandboxes = Sandboxes(self)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One request; a GET or HEAD is sent again on a connection error (MAX_ATTEMPTS)."""
        for attempt in range(MAX_ATTEMPTS):
            try:
                response = self.http.request(method, path, **kw)
                break
            except RETRIED_ERRORS:
                if method.upper() not in SAFE_METHODS or attempt == MAX_ATTEMPTS - 1:
                    raise
                time.sleep(_retry_delay(attempt, None) if attempt else 0.0)
        raise_for_problem(response)
        return response

    def post_idempotent(self, path: str, body: Any, idempotency_key: str | None) -> dict[str, Any]:
        """POST a create request, retried on transport errors and 429/5xx with one
        ``Idempotency-Key``, so a retry never creates a second run or session."""
        headers = {"Idempotency-Key": idempotency_key or str(uuid.uuid4())}
        for attempt in range(MAX_ATTEMPTS):
            response: httpx.Response | None = None
            try:
                response = self.http.post(path, json=body, headers=headers)
            except httpx.TransportError:
                if attempt == MAX_ATTEMPTS - 1:
                    raise
            if response is not None and (
                response.status_code not in RETRY_STATUSES or attempt == MAX_ATTEMPTS - 1
            ):
                raise_for_problem(response)
                result: dict[str, Any] = response.json()
                return result
            time.sleep(_retry_delay(attempt, response))
        raise AssertionError("unreachable")  # pragma: no cover

    def isolation(self) -> dict[str, Any]:
        result: dict[str, Any] = self.request("GET", "/v1/isolation").json()
        return result

    def costs(self, by: str = "model", since: str = "30d") -> dict[str, Any]:
        """Your org's spend grouped by ``by`` over ``since`` (``30d``, ``12h``, ``all``)."""
        params = {"by": by, "since": since}
        result: dict[str, Any] = self.request("GET", "/v1/costs", params=params).json()
        return result


class Runs:
    def __init__(self, client: Client) -> None:
        self._c = client

    def create(
        self,
        prompt: str | None = None,
        *,
        request: RunRequest | None = None,
        idempotency_key: str | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        body = _body(prompt, request, fields)
        return self._c.post_idempotent("/v1/runs", body, idempotency_key)

    def get(self, run_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._c.request("GET", f"/v1/runs/{run_id}").json()
        return result

    def list(
        self, *, status: str | None = None, limit: int = 20, cursor: str | None = None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if status:
            params["status"] = status
        if cursor:
            params["cursor"] = cursor
        result: dict[str, Any] = self._c.request("GET", "/v1/runs", params=params).json()
        return result

    def iter_all(
        self, *, status: str | None = None, page_size: int = 100
    ) -> Iterator[dict[str, Any]]:
        cursor: str | None = None
        while True:
            page = self.list(status=status, limit=page_size, cursor=cursor)
            yield from page["runs"]
            cursor = page["next_cursor"]
            if not cursor:
                return

    def events(self, run_id: str, *, stream: bool = False, after: int = 0) -> Iterable[Event]:
        if not stream:
            data = self._c.request("GET", f"/v1/runs/{run_id}/events", params={"after": after})
            return [Event.model_validate(e) for e in data.json()]
        return self._stream(run_id, after)

    def _stream(self, run_id: str, after: int) -> Iterator[Event]:
        last = after
        failures = 0
        while True:
            parser = SSEParser()
            try:
                with self._c.http.stream(
                    "GET",
                    f"/v1/runs/{run_id}/events",
                    timeout=STREAM_TIMEOUT,
                    headers={"Accept": "text/event-stream", "Last-Event-ID": str(last)},
                ) as response:
                    if response.status_code >= 400:
                        response.read()
                        raise_for_problem(response)
                    for line in response.iter_lines():
                        message = parser.feed(line)
                        if message is None:
                            continue
                        ev = _event(message[1])
                        if ev.seq <= last:
                            continue
                        last = ev.seq
                        failures = 0
                        yield ev
                        if ev.type == "run.settled":
                            return
            except httpx.TransportError:
                pass  # dropped: resume after the last event we saw
            failures += 1
            if failures > MAX_STREAM_RECONNECTS:
                raise errors.EphemeralError(f"the event stream of {run_id} keeps dropping")
            time.sleep(_retry_delay(min(failures, 4), None))

    def cancel(self, run_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._c.request("POST", f"/v1/runs/{run_id}/cancel").json()
        return result

    def delete(self, run_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._c.request("DELETE", f"/v1/runs/{run_id}").json()
        return result

    def wait(self, run_id: str, timeout: float | None = None) -> dict[str, Any]:
        """Block until the run has settled; returns the final run object (for a
        zero-data-retention run, the only read that carries its output)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            events = self.events(run_id)
            if any(e.type == "run.settled" for e in events):
                return self.get(run_id)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id} did not settle within {timeout} s")
            time.sleep(0.2)


# -- async ---------------------------------------------------------------------------------------


class AsyncClient:
    def __init__(
        self,
        settings: Settings | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
    ) -> None:
        url, key = _settings(settings, base_url, api_key)
        self.http = httpx.AsyncClient(
            base_url=url,
            transport=transport,
            timeout=timeout,
            headers={"Authorization": f"Bearer {key}", "User-Agent": "ephemeral-client/1"},
        )
        self.runs = AsyncRuns(self)
        self.sandboxes = AsyncSandboxes(self)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One request; a GET or HEAD is sent again on a connection error (MAX_ATTEMPTS)."""
        for attempt in range(MAX_ATTEMPTS):
            try:
                response = await self.http.request(method, path, **kw)
                break
            except RETRIED_ERRORS:
                if method.upper() not in SAFE_METHODS or attempt == MAX_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(_retry_delay(attempt, None) if attempt else 0.0)
        raise_for_problem(response)
        return response

    async def post_idempotent(
        self, path: str, body: Any, idempotency_key: str | None
    ) -> dict[str, Any]:
        """POST a create request, retried on transport errors and 429/5xx with one
        ``Idempotency-Key``, so a retry never creates a second run or session."""
        headers = {"Idempotency-Key": idempotency_key or str(uuid.uuid4())}
        for attempt in range(MAX_ATTEMPTS):
            response: httpx.Response | None = None
            try:
                response = await self.http.post(path, json=body, headers=headers)
            except httpx.TransportError:
                if attempt == MAX_ATTEMPTS - 1:
                    raise
            if response is not None and (
                response.status_code not in RETRY_STATUSES or attempt == MAX_ATTEMPTS - 1
            ):
                raise_for_problem(response)
                result: dict[str, Any] = response.json()
                return result
            await asyncio.sleep(_retry_delay(attempt, response))
        raise AssertionError("unreachable")  # pragma: no cover

    async def isolation(self) -> dict[str, Any]:
        result: dict[str, Any] = (await self.request("GET", "/v1/isolation")).json()
        return result

    async def costs(self, by: str = "model", since: str = "30d") -> dict[str, Any]:
        """Your org's spend grouped by ``by`` over ``since`` (``30d``, ``12h``, ``all``)."""
        params = {"by": by, "since": since}
        result: dict[str, Any] = (await self.request("GET", "/v1/costs", params=params)).json()
        return result


class AsyncRuns:
    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    async def create(
        self,
        prompt: str | None = None,
        *,
        request: RunRequest | None = None,
        idempotency_key: str | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        body = _body(prompt, request, fields)
        return await self._c.post_idempotent("/v1/runs", body, idempotency_key)

    async def get(self, run_id: str) -> dict[str, Any]:
        result: dict[str, Any] = (await self._c.request("GET", f"/v1/runs/{run_id}")).json()
        return result

    async def list(
        self, *, status: str | None = None, limit: int = 20, cursor: str | None = None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if status:
            params["status"] = status
        if cursor:
            params["cursor"] = cursor
        result: dict[str, Any] = (await self._c.request("GET", "/v1/runs", params=params)).json()
        return result

    async def events(self, run_id: str, *, after: int = 0) -> builtins.list[Event]:
        data = await self._c.request("GET", f"/v1/runs/{run_id}/events", params={"after": after})
        return [Event.model_validate(e) for e in data.json()]

    async def stream(self, run_id: str, *, after: int = 0) -> AsyncIterator[Event]:
        """Live events until ``run.settled``, resuming after a dropped connection."""
        last = after
        failures = 0
        while True:
            parser = SSEParser()
            try:
                async with self._c.http.stream(
                    "GET",
                    f"/v1/runs/{run_id}/events",
                    timeout=STREAM_TIMEOUT,
                    headers={"Accept": "text/event-stream", "Last-Event-ID": str(last)},
                ) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        raise_for_problem(response)
                    async for line in response.aiter_lines():
                        message = parser.feed(line)
                        if message is None:
                            continue
                        ev = _event(message[1])
                        if ev.seq <= last:
                            continue
                        last = ev.seq
                        failures = 0
                        yield ev
                        if ev.type == "run.settled":
                            return
            except httpx.TransportError:
                pass
            failures += 1
            if failures > MAX_STREAM_RECONNECTS:
                raise errors.EphemeralError(f"the event stream of {run_id} keeps dropping")
            await asyncio.sleep(_retry_delay(min(failures, 4), None))

    async def cancel(self, run_id: str) -> dict[str, Any]:
        result: dict[str, Any] = (await self._c.request("POST", f"/v1/runs/{run_id}/cancel")).json()
        return result

    async def delete(self, run_id: str) -> dict[str, Any]:
        result: dict[str, Any] = (await self._c.request("DELETE", f"/v1/runs/{run_id}")).json()
        return result

    async def wait(self, run_id: str, timeout: float | None = None) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            async for _ev in self.stream(run_id):
                pass
            return await self.get(run_id)


# -- sandbox sessions (docs/integrations.md) ----------------------------------------------------


def _exec_body(command: list[str] | str, fields: dict[str, Any]) -> dict[str, Any]:
    from ephemeral.sessions.requests import ExecRequest

    stdin = fields.pop("stdin", None)
    if stdin is not None:
        fields["stdin_base64"] = base64.b64encode(stdin).decode()
    # validated here too, so a bad field fails before a round trip, naming the field
    return ExecRequest.model_validate({"command": command, **fields}).model_dump(
        mode="json", exclude_defaults=True
    ) | {"command": command}


class Sandboxes:
    """``client.sandboxes``: create a session, exec, move files, end it."""

    def __init__(self, client: Client) -> None:
        self._c = client

    def create(self, *, idempotency_key: str | None = None, **policy: Any) -> dict[str, Any]:
        """Policy fields as for a run (isolation, timeout_seconds, max_cost_micros, …);
        retried with one ``Idempotency-Key`` like ``runs.create``."""
        return self._c.post_idempotent("/v1/sandboxes", policy, idempotency_key)

    def get(self, sandbox_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._c.request("GET", f"/v1/sandboxes/{sandbox_id}").json()
        return result

    def exec(self, sandbox_id: str, command: list[str] | str, **fields: Any) -> dict[str, Any]:
        """Fields: ``stdin`` (bytes), ``stdin_path``, ``env``, ``cwd``, ``user``,
        ``timeout_seconds``, ``max_output_bytes``. Returns ``{exit_code, stdout, stderr,
        duration_ms, truncated, timed_out}``."""
        body = _exec_body(command, fields)
        timeout = httpx.Timeout(30.0, read=float(body.get("timeout_seconds", 3600)) + 30.0)
        result: dict[str, Any] = self._c.request(
            "POST", f"/v1/sandboxes/{sandbox_id}/exec", json=body, timeout=timeout
        ).json()
        return result

    def write_file(self, sandbox_id: str, path: str, data: bytes) -> None:
        self._c.request(
            "PUT",
            f"/v1/sandboxes/{sandbox_id}/files",
            params={"path": path},
            content=data,
            headers={"Content-Type": "application/octet-stream"},
        )

    def read_file(self, sandbox_id: str, path: str, max_bytes: int | None = None) -> bytes:
        params: dict[str, Any] = {"path": path}
        if max_bytes is not None:
            params["max_bytes"] = max_bytes
        return self._c.request("GET", f"/v1/sandboxes/{sandbox_id}/files", params=params).content

    def delete(self, sandbox_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._c.request("DELETE", f"/v1/sandboxes/{sandbox_id}").json()
        return result


class AsyncSandboxes:
    """``AsyncClient.sandboxes``: the same methods as :class:`Sandboxes`, awaited."""

    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    async def create(self, *, idempotency_key: str | None = None, **policy: Any) -> dict[str, Any]:
        return await self._c.post_idempotent("/v1/sandboxes", policy, idempotency_key)

    async def get(self, sandbox_id: str) -> dict[str, Any]:
        response = await self._c.request("GET", f"/v1/sandboxes/{sandbox_id}")
        result: dict[str, Any] = response.json()
        return result

    async def exec(
        self, sandbox_id: str, command: list[str] | str, **fields: Any
    ) -> dict[str, Any]:
        body = _exec_body(command, fields)
        timeout = httpx.Timeout(30.0, read=float(body.get("timeout_seconds", 3600)) + 30.0)
        response = await self._c.request(
            "POST", f"/v1/sandboxes/{sandbox_id}/exec", json=body, timeout=timeout
        )
        result: dict[str, Any] = response.json()
        return result

    async def write_file(self, sandbox_id: str, path: str, data: bytes) -> None:
        await self._c.request(
            "PUT",
            f"/v1/sandboxes/{sandbox_id}/files",
            params={"path": path},
            content=data,
            headers={"Content-Type": "application/octet-stream"},
        )

    async def read_file(self, sandbox_id: str, path: str, max_bytes: int | None = None) -> bytes:
        params: dict[str, Any] = {"path": path}
        if max_bytes is not None:
            params["max_bytes"] = max_bytes
        response = await self._c.request("GET", f"/v1/sandboxes/{sandbox_id}/files", params=params)
        return response.content

    async def delete(self, sandbox_id: str) -> dict[str, Any]:
        response = await self._c.request("DELETE", f"/v1/sandboxes/{sandbox_id}")
        result: dict[str, Any] = response.json()
        return result
