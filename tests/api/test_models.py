"""An honest default model: none unless configured, GET /v1/models, the playground's choices.

A server with no provider key and no EPHEMERAL_DEFAULT_MODEL has no default: a run naming no
model is a 422 naming ``model`` (nothing reserved), never the sample's transcript.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from ephemeral.api import create_app
from ephemeral.api.auth import PAGE_COOKIE
from ephemeral.engine.runtime import Runtime
from ephemeral.models import NO_MODEL, PROVIDER_DEFAULTS, default_model, resolve_model
from ephemeral.settings import Settings
from tests import runlevel
from tests.api.conftest import SAMPLE_BODY, new_member
from tests.sample import SAMPLE_MODEL, SAMPLE_PROMPT

NO_KEYS = dict.fromkeys(("openai_api_key", "anthropic_api_key", "openrouter_api_key"))


@pytest.fixture
async def bare(tmp_path: Path, cassettes: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The real app on a server with no provider key and no default model configured."""
    settings = Settings.load(
        state_dir=tmp_path / "bare", cassettes_dir=cassettes, use_prefect=False, **NO_KEYS
    ).model_copy(update={"default_model": None})
    async with runlevel.started(settings, check=True) as runtime:
        member = await new_member(runtime, "acme")
        transport = httpx.ASGITransport(app=create_app(settings, runtime))
        async with httpx.AsyncClient(
            transport=transport,
            base_url="http://testserver",
            headers={"Authorization": f"Bearer {member.key}"},
        ) as client:
            client.runtime = runtime  # type: ignore[attr-defined]
            client.org_id = member.org_id  # type: ignore[attr-defined]
            yield client


def test_the_default_is_configured_or_a_keyed_providers_or_none() -> None:
    base = Settings.load(**NO_KEYS).model_copy(update={"default_model": None})
    assert default_model(base) is None
    with pytest.raises(Exception, match="no model named, and this server has no default"):
        resolve_model(None, base)
    assert resolve_model(None, base, agent=True) == NO_MODEL  # an agent run calls none itself
    for field, model in PROVIDER_DEFAULTS:
        keyed = base.model_copy(update={field: SecretStr("sk-test")})
        assert default_model(keyed) == model
        assert resolve_model(None, keyed) == model
    empty = base.model_copy(update={"openai_api_key": SecretStr("")})
    assert default_model(empty) is None  # an empty key configures nothing
    named = base.model_copy(update={"default_model": SAMPLE_MODEL})
    assert default_model(named) == SAMPLE_MODEL  # an explicit setting still works


async def test_a_run_naming_no_model_without_a_default_is_a_422_naming_model(
    bare: httpx.AsyncClient,
) -> None:
    runtime: Runtime = bare.runtime  # type: ignore[attr-defined]
    before = await runtime.store.orgs.get(bare.org_id)  # type: ignore[attr-defined]
    r = await bare.post("/v1/runs", json=SAMPLE_BODY)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    problem = r.json()
    assert set(problem) >= {"type", "title", "status", "detail", "errors"}
    [item] = problem["errors"]
    assert item["field"] == "model"
    assert "no default model" in item["message"] and "OPENAI_API_KEY" in item["message"]
    assert "EPHEMERAL_DEFAULT_MODEL" in item["message"] and SAMPLE_MODEL in item["message"]
    after = await runtime.store.orgs.get(bare.org_id)  # type: ignore[attr-defined]
    assert after.balance_micros == before.balance_micros  # nothing reserved
    runs = await bare.get("/v1/runs")
    assert runs.json()["runs"] == []


async def test_models_lists_replays_with_prices_and_no_unkeyed_provider(
    bare: httpx.AsyncClient,
) -> None:
    r = await bare.get("/v1/models")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["default"] is None and body["price_book"]
    ids = [m["id"] for m in body["models"]]
    assert SAMPLE_MODEL in ids and "replay/exit-codes" in ids
    # no OPENAI_API_KEY / ANTHROPIC_API_KEY / OPENROUTER_API_KEY here: none of theirs is usable
    assert not [i for i in ids if i.startswith(("openai/", "anthropic/", "openrouter/"))], ids
    sample = next(m for m in body["models"] if m["id"] == SAMPLE_MODEL)
    assert sample["replays"] == "openai/gpt-6-luna" and sample["prompt"] == SAMPLE_PROMPT
    assert sample["price"] == {  # the price book's: same_as openai/gpt-6-luna
        "input_per_mtok": 45000,
        "output_per_mtok": 275000,
        "cached_input_per_mtok": 4500,
    }
    assert (await bare.get("/v1/models", headers={"Authorization": ""})).status_code == 401


async def test_models_with_a_key_lists_that_providers_priced_models(
    tmp_path: Path, cassettes: Path
) -> None:
    settings = Settings.load(
        state_dir=tmp_path / "keyed",
        cassettes_dir=cassettes,
        use_prefect=False,
        **{**NO_KEYS, "anthropic_api_key": "sk-ant-test"},
    ).model_copy(update={"default_model": None})
    async with runlevel.started(settings, check=True) as runtime:
        member = await new_member(runtime, "acme")
        transport = httpx.ASGITransport(app=create_app(settings, runtime))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            r = await http.get("/v1/models", headers={"Authorization": f"Bearer {member.key}"})
    body = r.json()
    assert body["default"] == "anthropic/claude-sonnet-4-5"
    by_id = {m["id"]: m for m in body["models"]}
    assert by_id["anthropic/claude-sonnet-4-5"]["default"] is True
    assert by_id["anthropic/claude-haiku-4-5"]["price"]["output_per_mtok"] == 5_000_000
    assert not [i for i in by_id if i.startswith(("openai/", "openrouter/"))]
    assert "sk-ant-test" not in r.text


async def test_the_playground_offers_the_models_and_refuses_a_blank_one(
    bare: httpx.AsyncClient,
) -> None:
    page = await bare.get("/playground")
    assert "this server has no default: pick one" in page.text
    assert f'<option value="{SAMPLE_MODEL}">' in page.text
    sample = await bare.get("/playground", params={"sample": "sandbox-proof"})
    assert f'name="model" value="{SAMPLE_MODEL}"' in sample.text  # the sample's own model
    bare.cookies.set(PAGE_COOKIE, bare.headers["Authorization"].removeprefix("Bearer "))
    r = await bare.post(
        "/playground",
        data={"prompt": "uname -a", "model": "", "shell": "on", "timeout": "60", "budget": "0.04"},
    )
    assert r.status_code == 422
    assert 'data-field="model"' in r.text and "no default model" in r.text
