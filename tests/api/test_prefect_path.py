"""End to end through the default path: `serve`'s app (Prefect on, warm pool, reaper at
startup) on loopback, driven by the client with the product page's request."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ephemeral.client import Client
from ephemeral.settings import Settings
from tests.api.server import live_server
from tests.browser.test_pages_in_chromium import PRODUCT_REQUEST

pytestmark = [pytest.mark.sandbox, pytest.mark.prefect, pytest.mark.slow]


def flow_run_names(names: list[str]) -> list[tuple[str, bool]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    async def read() -> list[tuple[str, bool]]:
        async with get_client() as client:
            runs = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=names))
            )
            return [(r.name, bool(r.state and r.state.is_completed())) for r in runs]

    out: list[list[tuple[str, bool]]] = []
    t = threading.Thread(target=lambda: out.append(asyncio.run(read())))
    t.start()
    t.join(120)
    return out[0]


def test_product_page_request_through_prefect_with_the_warm_pool(api_settings: Settings) -> None:
    settings = api_settings.model_copy(
        update={"executor": "flow", "pool_size": 1, "default_model": "replay/sandbox-proof"}
    )
    with live_server(settings, warm_pool=True) as srv:
        key = srv.member("acme")
        with Client(Settings.load(url=srv.url, api_key=key)) as client:
            run = client.runs.create(**PRODUCT_REQUEST)
            types = [e.type for e in client.runs.events(run["id"], stream=True)]
            final = client.runs.get(run["id"])
            zdr = client.runs.create(
                prompt="zdr", model="replay/api-quick", zero_data_retention=True
            )
            first = client.runs.wait(zdr["id"], timeout=120)
            second = client.runs.get(zdr["id"])
        names = flow_run_names([run["id"]])
    assert final["status"] == "succeeded", final["termination"]
    assert types.count("shell.executed") == 4 and types[-1] == "run.settled"
    assert final["isolation"] in ("gvisor", "microvm-kvm", "namespaces")
    assert "Could not resolve host" in (final["output"] or "")
    assert names == [(run["id"], True)]  # a Prefect flow run per run, visible in Prefect
    # zero data retention: the output is handed out once, then it is gone
    assert first["status"] == "succeeded" and "Done" in (first["output"] or "")
    assert second["output"] is None
