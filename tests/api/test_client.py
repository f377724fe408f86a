"""The Python client against the real app: in process (ASGI) and over loopback HTTP."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from typer.testing import CliRunner

from ephemeral import errors
from ephemeral.cli import app as cli_app
from ephemeral.cli.exit_codes import ExitCode
from ephemeral.client import AsyncClient, Client, SSEParser
from ephemeral.policy import RunRequest
from ephemeral.settings import Settings
from tests.api.conftest import SAMPLE_BODY, Member
from tests.api.server import LiveServer, live_server
from tests.patience import PATIENCE

pytestmark = pytest.mark.sandbox


def async_client(app: FastAPI, member: Member, **kw: object) -> AsyncClient:
    return AsyncClient(
        Settings.load(url="http://testserver", api_key=member.key),
        transport=httpx.ASGITransport(app=app),
        **kw,
    )  # type: ignore[arg-type]


async def test_async_client_create_stream_wait_get(app: FastAPI, member: Member) -> None:
    async with async_client(app, member) as client:
        run = await client.runs.create(**SAMPLE_BODY)
        seen = [ev.type async for ev in client.runs.stream(run["id"])]
        assert seen[0] == "run.queued" and seen[-1] == "run.settled"
        done = await client.runs.wait(run["id"], timeout=PATIENCE)
        assert done["status"] == "succeeded"
        assert [e.type for e in await client.runs.events(run["id"])] == seen
        page = await client.runs.list(limit=5)
        assert [r["id"] for r in page["runs"]] == [run["id"]]
        erased = await client.runs.delete(run["id"])
        assert erased["output"] is None


async def test_async_client_maps_problems_to_error_classes(app: FastAPI, member: Member) -> None:
    async with async_client(app, member) as client:
        with pytest.raises(errors.InvalidRequest) as bad:
            await client.runs.create(prompt="x", timeout_seconds=0)
        assert [e["field"] for e in bad.value.errors or []] == ["timeout_seconds"]
        with pytest.raises(errors.NotFound):
            await client.runs.get("run_" + "0" * 32)
        with pytest.raises(errors.UnknownModel):
            await client.runs.create(prompt="x", model="replay/none-such")
        with pytest.raises(errors.PaymentRequired):
            await client.runs.create(prompt="x", max_cost_micros=99_000_000)
    bad_key = AsyncClient(
        Settings.load(url="http://testserver", api_key="eph_nope"),
        transport=httpx.ASGITransport(app=app),
    )
    async with bad_key:
        with pytest.raises(errors.Unauthorized):
            await bad_key.runs.list()


async def test_create_retries_with_the_same_idempotency_key(app: FastAPI, member: Member) -> None:
    """The first answer is lost (503 from a proxy): the retry replays, never a second run."""
    inner = httpx.ASGITransport(app=app)
    keys: list[str] = []

    class FlakyProxy(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            response = await inner.handle_async_request(request)
            if request.method == "POST" and request.url.path == "/v1/runs":
                keys.append(request.headers["idempotency-key"])
                if len(keys) == 1:
                    await response.aread()
                    return httpx.Response(503, headers={"Retry-After": "0"})
            return response

    client = AsyncClient(
        Settings.load(url="http://testserver", api_key=member.key), transport=FlakyProxy()
    )
    async with client:
        run = await client.runs.create(**SAMPLE_BODY)
        assert len(keys) == 2 and keys[0] == keys[1]
        page = await client.runs.list()
        assert [r["id"] for r in page["runs"]] == [run["id"]]  # one run, one reservation
        await client.runs.wait(run["id"], timeout=PATIENCE)


async def test_a_read_is_sent_again_after_a_connection_error_a_write_is_not(
    app: FastAPI, member: Member
) -> None:
    """The server closed the connection the client reused (an idle keep-alive, under load): a
    GET changes nothing and is sent again; a POST is not (it may have been carried out)."""
    inner = httpx.ASGITransport(app=app)
    dropped: list[str] = []

    class DropsTheFirstOfEach(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            key = f"{request.method} {request.url.path}"
            if request.url.path.startswith("/v1/runs/") and key not in dropped:
                dropped.append(key)
                raise httpx.ReadError("the server closed the connection", request=request)
            return await inner.handle_async_request(request)

    client = AsyncClient(
        Settings.load(url="http://testserver", api_key=member.key),
        transport=DropsTheFirstOfEach(),
    )
    async with client:
        run = await client.runs.create(**SAMPLE_BODY)
        assert (await client.runs.get(run["id"]))["id"] == run["id"]
        assert dropped == [f"GET /v1/runs/{run['id']}"]
        with pytest.raises(httpx.ReadError):
            await client.runs.cancel(run["id"])
        assert dropped[-1] == f"POST /v1/runs/{run['id']}/cancel"
        done = await client.runs.wait(run["id"], timeout=PATIENCE)
        assert done["status"] == "succeeded"  # the cancel never reached the server


def test_the_sync_client_sends_a_read_again_after_a_connection_error(
    server: LiveServer,
) -> None:
    inner = httpx.HTTPTransport()
    dropped: list[str] = []

    class DropsTheFirstGet(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            if request.method == "GET" and not dropped:
                dropped.append(request.url.path)
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
            return inner.handle_request(request)

    key = server.member("sync-reads")
    with Client(Settings.load(url=server.url, api_key=key), transport=DropsTheFirstGet()) as c:
        assert c.isolation()  # sent twice, answered once
        assert dropped == ["/v1/isolation"]


def test_sse_parser_handles_multiline_comments_and_ids() -> None:
    parser = SSEParser()
    lines = [": hello", "id: 7", "event: x", 'data: {"a":', "data: 1}", "", "", "data: 2", ""]
    messages = [m for m in map(parser.feed, lines) if m is not None]
    assert messages == [("x", '{"a":\n1}'), (None, "2")]
    assert parser.last_id == "7"


@pytest.fixture
def server(api_settings: Settings) -> Iterator[LiveServer]:
    with live_server(api_settings) as srv:
        yield srv


def test_sync_client_over_loopback_and_stream_resume(server: LiveServer) -> None:
    key = server.member("sync")
    with Client(Settings.load(url=server.url, api_key=key)) as client:
        run = client.runs.create(request=RunRequest(**SAMPLE_BODY))  # type: ignore[arg-type]
        events = list(client.runs.events(run["id"], stream=True))
        assert events[-1].type == "run.settled"
        # resume from the middle, as after a dropped connection
        tail = list(client.runs.events(run["id"], stream=True, after=events[3].seq))
        assert [e.seq for e in tail] == [e.seq for e in events[4:]]
        assert client.runs.wait(run["id"], timeout=PATIENCE)["status"] == "succeeded"
        assert client.runs.cancel(run["id"])["status"] == "succeeded"  # idempotent, settled
        assert [r["id"] for r in client.runs.iter_all(page_size=1)] == [run["id"]]


def test_sync_stream_reconnects_after_a_dropped_connection(server: LiveServer) -> None:
    """A proxy that cuts the first stream after two events: the client resumes with
    Last-Event-ID and sees every event exactly once."""
    key = server.member("drops")
    real = httpx.HTTPTransport()
    resumes: list[str | None] = []

    class CuttingTransport(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            response = real.handle_request(request)
            if request.headers.get("accept") != "text/event-stream":
                return response
            resumes.append(request.headers.get("last-event-id"))
            if len(resumes) > 1:
                return response
            stream = response.stream

            class Cut(httpx.SyncByteStream):
                def __iter__(self) -> Iterator[bytes]:
                    frames = 0
                    for chunk in stream:  # type: ignore[union-attr]
                        yield chunk
                        frames += chunk.count(b"\n\nid:") + chunk.startswith(b"id:")
                        if frames >= 2:
                            raise httpx.ReadError("connection reset by proxy")

            return httpx.Response(response.status_code, headers=response.headers, stream=Cut())

    with Client(Settings.load(url=server.url, api_key=key), transport=CuttingTransport()) as c:
        run = c.runs.create(**SAMPLE_BODY)
        seqs = [e.seq for e in c.runs.events(run["id"], stream=True)]
    assert len(resumes) >= 2 and resumes[0] == "0" and resumes[1] != "0"
    assert seqs == list(range(1, len(seqs) + 1))


def test_cli_run_and_cancel_against_a_server(server: LiveServer) -> None:
    key = server.member("cli")
    env = {"EPHEMERAL_URL": server.url, "EPHEMERAL_API_KEY": key}
    result = CliRunner().invoke(cli_app, ["run", "--prompt", "hello", "--budget", "0.04"], env=env)
    assert result.exit_code == 0, result.output
    assert "Shell" in result.output and "$ echo hello; whoami" in result.output
    assert "Settled" in result.output and "charged" in result.output
    run_id = result.output.split()[0]
    again = CliRunner().invoke(cli_app, ["cancel", run_id], env=env)
    assert again.exit_code == 0 and "succeeded" in again.output


def test_cli_exit_code_for_a_cancelled_run(server: LiveServer) -> None:
    key = server.member("cli2")
    env = {"EPHEMERAL_URL": server.url, "EPHEMERAL_API_KEY": key}
    with Client(Settings.load(url=server.url, api_key=key)) as client:
        holder: dict[str, int] = {}

        def run_cli() -> None:
            res = CliRunner().invoke(
                cli_app, ["run", "--prompt", "slow", "--model", "replay/api-slow"], env=env
            )
            holder["code"] = res.exit_code

        t = threading.Thread(target=run_cli)
        t.start()
        run_id = None
        for _ in range(600):
            page = client.runs.list()
            if page["runs"]:
                run_id = page["runs"][0]["id"]
                if any(
                    e.type == "shell.executed" or e.type == "model.called"
                    for e in client.runs.events(run_id)
                ):
                    break
            threading.Event().wait(0.05)
        assert run_id is not None
        client.runs.cancel(run_id)
        t.join(60)
    assert holder["code"] == ExitCode.CANCELLED
