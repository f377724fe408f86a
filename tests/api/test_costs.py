"""GET /v1/costs: an org sees its own spend only; the client and `ephemeral costs` use it."""

from __future__ import annotations

import time

import httpx
import pytest
from fastapi import FastAPI
from typer.testing import CliRunner

from ephemeral import errors
from ephemeral.cli import app as cli_app
from ephemeral.client import AsyncClient
from ephemeral.engine.runtime import Runtime
from ephemeral.settings import Settings
from tests.api.conftest import SAMPLE_BODY, Member, new_member
from tests.api.server import live_server
from tests.patience import PATIENCE

pytestmark = pytest.mark.sandbox


def client_for(app: FastAPI, member: Member) -> AsyncClient:
    return AsyncClient(
        Settings.load(url="http://testserver", api_key=member.key),
        transport=httpx.ASGITransport(app=app),
    )


async def test_costs_are_scoped_to_the_callers_org(
    app: FastAPI, runtime: Runtime, member: Member
) -> None:
    other = await new_member(runtime, "globex")
    async with client_for(app, member) as acme, client_for(app, other) as globex:
        mine = [await acme.runs.create(**SAMPLE_BODY) for _ in range(2)]
        theirs = await globex.runs.create(**SAMPLE_BODY)
        for run in mine:
            await acme.runs.wait(run["id"], timeout=PATIENCE)
        await globex.runs.wait(theirs["id"], timeout=PATIENCE)

        page = await acme.costs(by="model", since="all")
        assert page["by"] == "model"
        assert sum(r["runs"] for r in page["rows"]) == 2
        settled = [await acme.runs.get(r["id"]) for r in mine]
        charged = sum(r["cost"]["charged_micros"] for r in settled)
        assert sum(r["charged_micros"] for r in page["rows"]) == charged
        assert sum(r["runs"] for r in (await globex.costs(by="status"))["rows"]) == 1

        with pytest.raises(errors.InvalidRequest) as bad:
            await acme.costs(by="colour")
        assert [e["field"] for e in bad.value.errors or []] == ["by"]
        with pytest.raises(errors.InvalidRequest):
            await acme.costs(since="yesterday")


def test_cli_costs_asks_the_server_when_a_url_is_set(api_settings: Settings) -> None:
    with live_server(api_settings) as server:
        key = server.member("initech")
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}) as c:
            run = c.post("/v1/runs", json=SAMPLE_BODY).json()
            deadline = time.monotonic() + 240  # a loaded host: the run still has to finish
            while c.get(f"/v1/runs/{run['id']}").json()["status"] != "succeeded":
                assert time.monotonic() < deadline, c.get(f"/v1/runs/{run['id']}").json()
                time.sleep(0.1)
        result = CliRunner().invoke(
            cli_app,
            ["costs", "--by", "status", "--since", "all", "--format", "json"],
            env={
                "EPHEMERAL_URL": server.url,
                "EPHEMERAL_API_KEY": key,
                # Local records are elsewhere: the numbers can only come from the server.
                "EPHEMERAL_STATE_DIR": str(api_settings.state_dir.parent / "elsewhere"),
            },
        )
    assert result.exit_code == 0, result.output
    assert '"succeeded"' in result.output and '"runs": 1' in result.output
