"""The gateway in a sandbox session (``POST /v1/sandboxes`` with ``models``): the session's
code calls the model, the session pays, and a budget the calls use up ends the session."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from ephemeral.engine.runtime import Runtime
from ephemeral.providers.base import Usage
from ephemeral.testing.providers import (
    CapturedRequest,
    FakeOpenAIServer,
    FakeReply,
    openai_chat_response,
)
from tests.api.conftest import Member
from tests.gateway.test_gateway import GPT, _post, _split
from tests.patience import PATIENCE

pytestmark = [pytest.mark.sandbox]


async def _create(http: httpx.AsyncClient, who: Member, **body: Any) -> str:
    body.setdefault("timeout_seconds", 120)
    r = await http.post("/v1/sandboxes", json=body, headers=who.headers)
    assert r.status_code == 201, r.text
    assert r.json()["status"] == "running", r.json()
    return str(r.json()["id"])


async def _exec(http: httpx.AsyncClient, who: Member, sid: str, command: str) -> dict[str, Any]:
    r = await http.post(f"/v1/sandboxes/{sid}/exec", json={"command": command}, headers=who.headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def test_a_session_with_a_model_granted_calls_it_and_pays_for_it(
    http: httpx.AsyncClient,
    runtime: Runtime,
    member: Member,
    openai_server: FakeOpenAIServer,
    isolation: str,
) -> None:
    openai_server.push(
        FakeReply(body=openai_chat_response(content="hi", prompt_tokens=90, completion_tokens=11))
    )
    sid = await _create(http, member, isolation=isolation, models=[GPT], max_cost_micros=40_000)
    body = {"model": "gpt-6-luna", "messages": [{"role": "user", "content": "hello"}]}
    res = await _exec(http, member, sid, _post("/chat/completions", body))
    out, code = _split(res["stdout"])
    assert code == 200, res
    assert json.loads(out)["choices"][0]["message"]["content"] == "hi"
    r = await http.delete(f"/v1/sandboxes/{sid}", headers=member.headers)
    ended = r.json()
    cost = ended["cost"]
    want = runtime.price_book.model_cost(GPT, Usage(input_tokens=90, output_tokens=11))
    assert cost["breakdown"]["model_micros"] == want
    assert cost["breakdown"]["web_micros"] == 0
    assert cost["charged_micros"] + cost["refunded_micros"] == cost["reserved_micros"]
    row = await runtime.store.runs.get(sid)
    assert row.usage["model_calls"] == 1 and row.usage["input_tokens"] == 90
    (called,) = [e.data for e in await runtime.store.events.list(sid) if e.type == "model.called"]
    assert called["cost_micros"] == want and called["via"] == "gateway"


async def test_an_unpriced_model_grant_is_refused_at_admission(
    http: httpx.AsyncClient, member: Member, isolation: str
) -> None:
    r = await http.post(
        "/v1/sandboxes",
        json={"isolation": isolation, "models": ["openai/no-such-model"]},
        headers=member.headers,
    )
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == "models[0]"


async def test_a_model_that_never_stops_ends_the_session_budget_exhausted(
    http: httpx.AsyncClient,
    runtime: Runtime,
    member: Member,
    openai_server: FakeOpenAIServer,
    isolation: str,
) -> None:
    """Every answer asks for more; the guest loops forever. The holds stop the calls inside the
    reservation, the session ends ``budget_exhausted`` and its sandbox (and loop) is gone."""

    def more(req: CapturedRequest) -> FakeReply:
        # as a provider does: never more output than the max_tokens it was sent (the gateway
        # lowers it as the budget runs low), no more input tokens than the body has bytes / 3;
        # more would be an overrun (tests/gateway/test_fields.py)
        out = min(900, req.json()["max_tokens"])
        return FakeReply(
            body=openai_chat_response(content="keep going", prompt_tokens=20, completion_tokens=out)
        )

    openai_server.push(*([more] * 200))
    sid = await _create(
        http, member, isolation=isolation, models=["openai/gpt-4o"], max_cost_micros=60_000
    )
    body = {"model": "gpt-4o", "max_tokens": 1000, "messages": [{"role": "user", "content": "go"}]}
    loop = f"while true; do {_post('/chat/completions', body)} >> /tmp/calls.log; done"
    res = await _exec(http, member, sid, f"({loop}) >/dev/null 2>&1 & echo started")
    assert "started" in res["stdout"]
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        row = await runtime.store.runs.get(sid)
        if row.status not in ("queued", "provisioning", "running"):
            break
        await asyncio.sleep(0.1)
    row = await runtime.store.runs.get(sid)
    assert row.status == "budget_exhausted", (row.status, row.termination_detail)
    assert row.termination_detail == "model calls used up the budget"
    assert row.charged_micros + row.refunded_micros == row.reserved_micros
    assert row.charged_micros <= row.reserved_micros
    events = await runtime.store.events.list(sid)
    called = [e.data for e in events if e.type == "model.called"]
    assert len(called) >= 3
    assert row.breakdown["model_micros"] == sum(c["cost_micros"] for c in called)
    assert any(e.type == "sandbox.destroyed" for e in events)
    # every call the provider saw is on the timeline and in the ledger (one cut as the session
    # ended is charged its hold)
    assert len(openai_server.requests) <= len(called)


async def test_a_gateway_session_recorded_as_a_cassette_replays_offline(
    http: httpx.AsyncClient,
    runtime: Runtime,
    member: Member,
    openai_server: FakeOpenAIServer,
    isolation: str,
) -> None:
    """``ephemeral record`` of a session whose code called the model makes a cassette; a new
    session granted ``replay/NAME`` gets the same answers without the provider."""
    from ephemeral.engine.record import cassette_of_run
    from ephemeral.providers.replay import load_cassette, save_cassette
    from ephemeral.testing.providers import openai_chat_stream

    openai_server.push(
        FakeReply(
            body=openai_chat_response(content="first answer", prompt_tokens=20, completion_tokens=2)
        ),
        FakeReply(
            stream=openai_chat_stream(["second ", "answer"], prompt_tokens=30, completion_tokens=2)
        ),
    )
    user = {"role": "user", "content": "q"}
    first = {"model": "gpt-6-luna", "messages": [user]}
    second = {
        "model": "gpt-6-luna",
        "messages": [user, {"role": "assistant", "content": "first answer"}, user],
        "stream": True,
    }
    script = f"{_post('/chat/completions', first)}; echo; {_post('/chat/completions', second)}"
    sid = await _create(http, member, isolation=isolation, models=[GPT], max_cost_micros=40_000)
    live = await _exec(http, member, sid, script)
    await http.delete(f"/v1/sandboxes/{sid}", headers=member.headers)
    assert "first answer" in live["stdout"] and "second " in live["stdout"]

    doc = await cassette_of_run(runtime.store, sid)
    assert doc["model"] == GPT and len(doc["turns"]) == 2
    assert doc["description"] == f"recorded from {sid}"
    save_cassette(runtime.settings.cassettes_dir, "recorded-gw", doc)
    assert [
        t.message.content
        for t in load_cassette(runtime.settings.cassettes_dir / "recorded-gw.json").turns
    ] == [
        "first answer",
        "second answer",
    ]
    before = len(openai_server.requests)
    sid2 = await _create(
        http, member, isolation=isolation, models=["replay/recorded-gw"], max_cost_micros=40_000
    )
    script2 = script.replace('"gpt-6-luna"', '"replay/recorded-gw"')
    replayed = await _exec(http, member, sid2, script2)
    await http.delete(f"/v1/sandboxes/{sid2}", headers=member.headers)
    assert "first answer" in replayed["stdout"] and "second " in replayed["stdout"]
    assert len(openai_server.requests) == before  # offline: the provider was not called
    called = [e.data for e in await runtime.store.events.list(sid2) if e.type == "model.called"]
    assert sorted((c["input_tokens"], c["output_tokens"]) for c in called) == [(20, 2), (30, 2)]
