"""Admission of a sandbox session checks what a run's admission checks, with the same error
shape: a named connection must exist for the org, and the web allow list takes host names only.
Nothing is reserved or started for a refused request."""

from __future__ import annotations

import httpx
import pytest

from ephemeral.engine.runtime import Runtime
from tests.api.conftest import Member


async def _balance(runtime: Runtime, member: Member) -> int:
    return (await runtime.store.orgs.get(member.org_id)).balance_micros


async def test_an_unknown_connection_is_a_422_naming_the_field(
    http: httpx.AsyncClient, runtime: Runtime, member: Member
) -> None:
    org = await runtime.store.orgs.get(member.org_id)
    await runtime.store.connections.add(
        org.id, "known", base_url="http://127.0.0.1:9", header_names=[], sealed_headers="x"
    )
    before = await _balance(runtime, member)
    body = {
        "isolation": "namespaces",
        "timeout_seconds": 60,
        "max_cost_micros": 10_000,
        "connections": [{"name": "known"}, {"name": "stripe"}],
    }
    r = await http.post("/v1/sandboxes", json=body, headers=member.headers)
    assert r.status_code == 422, r.text
    assert r.json()["errors"] == [
        {
            "field": "connections[1].name",
            "message": "this org has no connection named 'stripe' (ephemeral connections add)",
        }
    ]
    # the run's admission answers the same, field and message
    run = await http.post(
        "/v1/runs",
        json={"prompt": "x", "model": "replay/sandbox-proof", **body},
        headers=member.headers,
    )
    assert run.status_code == 422 and run.json()["errors"] == r.json()["errors"]
    assert await _balance(runtime, member) == before  # nothing reserved


async def test_an_ip_literal_in_the_allow_list_is_a_422_naming_web(
    http: httpx.AsyncClient, member: Member
) -> None:
    for pattern in ("0x7f.0.0.1", "2130706433", "0177.1", "[::1]"):
        r = await http.post(
            "/v1/sandboxes",
            json={"isolation": "namespaces", "web": {"allow": [pattern]}},
            headers=member.headers,
        )
        assert r.status_code == 422, r.text
        [error] = r.json()["errors"]
        assert error["field"] == "web" and "is an IP address" in error["message"], error


@pytest.mark.sandbox
async def test_a_session_naming_no_budget_gets_one_covering_its_time_limit(
    http: httpx.AsyncClient, runtime: Runtime, member: Member
) -> None:
    """The docs' Python example (timeout_seconds=600, no budget) used to end budget_exhausted
    after ~50 s on the $0.04 default: the default now covers the sandbox's compute for the
    whole time limit; a budget the request names is kept."""
    rate = runtime.sessions.sandboxes.compute_rate(
        runtime.sessions.sandboxes.limits(600), runtime.price_book
    )
    r = await http.post(
        "/v1/sandboxes",
        json={"isolation": "namespaces", "timeout_seconds": 600},
        headers=member.headers,
    )
    assert r.status_code == 201, r.text
    session = r.json()
    assert session["cost"]["reserved_micros"] == rate * 600 > 40_000
    assert session["policy"]["max_cost_micros"] == rate * 600
    await http.delete(f"/v1/sandboxes/{session['id']}", headers=member.headers)
    named = await http.post(
        "/v1/sandboxes",
        json={"isolation": "namespaces", "timeout_seconds": 600, "max_cost_micros": 20_000},
        headers=member.headers,
    )
    assert named.status_code == 201, named.text
    assert named.json()["cost"]["reserved_micros"] == 20_000
    await http.delete(f"/v1/sandboxes/{named.json()['id']}", headers=member.headers)
