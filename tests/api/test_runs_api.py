"""DESIGN §3 over the real app and a real runtime (SQLite file, real sandboxes)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from ephemeral.client import SSEParser
from ephemeral.engine.runtime import Runtime
from ephemeral.events import MAX_SEQ
from tests.api.conftest import SAMPLE_BODY, Member, new_member

pytestmark = pytest.mark.sandbox


async def start(http: httpx.AsyncClient, member: Member, **over: object) -> dict:
    r = await http.post("/v1/runs", json={**SAMPLE_BODY, **over}, headers=member.headers)
    assert r.status_code == 201, r.text
    return r.json()


async def test_create_run_returns_the_run_and_it_succeeds(
    http: httpx.AsyncClient, member: Member, runtime: Runtime
) -> None:
    r = await http.post("/v1/runs", json=SAMPLE_BODY, headers=member.headers)
    assert r.status_code == 201
    run = r.json()
    assert r.headers["location"] == f"/v1/runs/{run['id']}"
    assert "idempotent-replayed" not in r.headers
    assert run["status"] in ("queued", "provisioning", "running")
    assert run["policy"]["max_cost_micros"] == 40_000
    assert run["policy"]["timeout_seconds"] == 60
    assert run["cost"]["reserved_micros"] == 40_000
    assert run["links"]["page"].endswith(f"/runs/{run['id']}")
    await runtime.wait(run["id"], 60)

    got = (await http.get(f"/v1/runs/{run['id']}", headers=member.headers)).json()
    assert got["status"] == "succeeded"
    assert got["termination"] == {"reason": "completed", "detail": None}
    cost = got["cost"]
    assert cost["charged_micros"] + cost["refunded_micros"] == cost["reserved_micros"]
    assert got["usage"]["model_calls"] == 2
    assert "Ran `whoami`" in got["output"]
    # the runtime the host measured, the same line as in sandbox.ready
    assert got["isolation"] in ("gvisor", "namespaces")
    binary = "runsc" if got["isolation"] == "gvisor" else "bubblewrap"
    assert got["runtime"] and got["runtime"].startswith(binary), got["runtime"]

    events = (await http.get(f"/v1/runs/{run['id']}/events", headers=member.headers)).json()
    types = [e["type"] for e in events]
    assert types[0] == "run.queued" and types[-1] == "run.settled"
    assert "shell.executed" in types and "sandbox.ready" in types
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    shell = next(e for e in events if e["type"] == "shell.executed")
    assert shell["data"]["stdout"] == "hello\nworker\n"
    after = (
        await http.get(
            f"/v1/runs/{run['id']}/events",
            params={"after": events[-2]["seq"]},
            headers=member.headers,
        )
    ).json()
    assert [e["type"] for e in after] == ["run.settled"]


def parse_sse(text: str) -> list[tuple[str | None, str | None, dict]]:
    parser = SSEParser()
    out = []
    for line in text.split("\n"):
        msg = parser.feed(line)
        if msg is not None:
            out.append((parser.last_id, msg[0], json.loads(msg[1])))
    return out


async def test_sse_stream_follows_live_and_resumes_from_last_event_id(
    http: httpx.AsyncClient, member: Member
) -> None:
    run = await start(http, member)
    headers = {**member.headers, "Accept": "text/event-stream"}
    r = await http.get(f"/v1/runs/{run['id']}/events", headers=headers)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    frames = parse_sse(r.text)
    assert frames[-1][1] == "run.settled"  # the stream ended after the last event
    for last_id, kind, data in frames:
        assert last_id == str(data["seq"]) and kind == data["type"]

    resume_at = frames[3][2]["seq"]
    r2 = await http.get(
        f"/v1/runs/{run['id']}/events", headers={**headers, "Last-Event-ID": str(resume_at)}
    )
    resumed = parse_sse(r2.text)
    expected = [f[2]["seq"] for f in frames if f[2]["seq"] > resume_at]
    assert [f[2]["seq"] for f in resumed] == expected

    bad = await http.get(
        f"/v1/runs/{run['id']}/events", headers={**headers, "Last-Event-ID": "seven"}
    )
    assert bad.status_code == 422
    assert bad.json()["errors"][0]["field"] == "Last-Event-ID"


async def test_an_out_of_range_after_or_last_event_id_is_a_422_naming_it(
    http: httpx.AsyncClient, member: Member, runtime: Runtime
) -> None:
    """Issue 35, finding 9: ``?after=2^63`` was a 500 (the store cannot bind it); every seq
    bound is the store's (MAX_SEQ), and past it the request is a 422 naming the field."""
    run = await start(http, member)
    await runtime.wait(run["id"], 60)
    url = f"/v1/runs/{run['id']}/events"
    for after in (1 << 63, MAX_SEQ + 1, -1):
        r = await http.get(url, params={"after": after}, headers=member.headers)
        assert r.status_code == 422, (after, r.text)
        assert r.headers["content-type"].startswith("application/problem+json")
        assert [e["field"] for e in r.json()["errors"]] == ["after"], r.text
    edge = await http.get(url, params={"after": MAX_SEQ}, headers=member.headers)
    assert (edge.status_code, edge.json()) == (200, [])
    for sse in (False, True):
        accept = {"Accept": "text/event-stream"} if sse else {}
        r = await http.get(
            url, headers={**member.headers, **accept, "Last-Event-ID": str(MAX_SEQ + 1)}
        )
        assert r.status_code == 422, r.text
        assert r.json()["errors"][0]["field"] == "Last-Event-ID"


async def test_idempotency_replays_without_a_second_reservation(
    http: httpx.AsyncClient, member: Member, runtime: Runtime
) -> None:
    key = {"Idempotency-Key": "order-42 retry-safe"}
    first = await http.post("/v1/runs", json=SAMPLE_BODY, headers={**member.headers, **key})
    assert first.status_code == 201
    org_after_first = await runtime.store.orgs.get(member.org_id)
    # Same body with another key order and spacing: the canonical JSON is the same.
    body = json.dumps(dict(reversed(list(SAMPLE_BODY.items()))), indent=3)
    again = await http.post(
        "/v1/runs",
        content=body,
        headers={**member.headers, **key, "Content-Type": "application/json"},
    )
    assert again.status_code == 200
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    org = await runtime.store.orgs.get(member.org_id)
    assert org.reserved_micros <= org_after_first.reserved_micros  # no second hold
    assert org.balance_micros <= org_after_first.balance_micros

    changed = await http.post(
        "/v1/runs", json={**SAMPLE_BODY, "timeout_seconds": 61}, headers={**member.headers, **key}
    )
    assert changed.status_code == 422
    assert changed.headers["content-type"] == "application/problem+json"
    await runtime.wait(first.json()["id"], 60)


@pytest.mark.parametrize("bad", ["", "x" * 256, "caf\u00e9", "tab\there"])
async def test_idempotency_key_must_be_1_to_255_printable_ascii(
    http: httpx.AsyncClient, member: Member, bad: str
) -> None:
    r = await http.post(
        "/v1/runs",
        json=SAMPLE_BODY,
        headers=[
            ("Authorization", member.headers["Authorization"]),
            ("Idempotency-Key", bad.encode("utf-8")),
        ],
    )  # type: ignore[list-item]
    assert r.status_code == 422, r.text
    assert [e["field"] for e in r.json()["errors"]] == ["Idempotency-Key"]


async def test_balance_too_small_is_402_with_a_clear_detail(
    http: httpx.AsyncClient, runtime: Runtime
) -> None:
    poor = await new_member(runtime, "poor", usd_micros=10_000)
    r = await http.post("/v1/runs", json=SAMPLE_BODY, headers=poor.headers)
    assert r.status_code == 402
    body = r.json()
    assert body["status"] == 402 and body["detail"]
    assert (await runtime.store.runs.list(poor.org_id))[0] == []


async def test_another_orgs_run_is_404_everywhere(
    http: httpx.AsyncClient, member: Member, runtime: Runtime
) -> None:
    run = await start(http, member)
    other = await new_member(runtime, "globex")
    rid = run["id"]
    for method, path in [
        ("GET", f"/v1/runs/{rid}"),
        ("GET", f"/v1/runs/{rid}/events"),
        ("POST", f"/v1/runs/{rid}/cancel"),
        ("DELETE", f"/v1/runs/{rid}"),
    ]:
        r = await http.request(method, path, headers=other.headers)
        assert r.status_code == 404, (method, path, r.text)
        assert r.json()["title"] == "Not found"
    listed = (await http.get("/v1/runs", headers=other.headers)).json()
    assert listed == {"runs": [], "next_cursor": None}
    await runtime.wait(rid, 60)


async def test_list_pages_with_a_cursor_and_filters_by_status(
    http: httpx.AsyncClient, member: Member, runtime: Runtime
) -> None:
    ids = [(await start(http, member))["id"] for _ in range(3)]
    for rid in ids:
        await runtime.wait(rid, 60)
    page1 = (await http.get("/v1/runs", params={"limit": 2}, headers=member.headers)).json()
    assert len(page1["runs"]) == 2 and page1["next_cursor"]
    page2 = (
        await http.get(
            "/v1/runs", params={"limit": 2, "cursor": page1["next_cursor"]}, headers=member.headers
        )
    ).json()
    assert len(page2["runs"]) == 1 and page2["next_cursor"] is None
    seen = [r["id"] for r in page1["runs"] + page2["runs"]]
    assert sorted(seen) == sorted(ids)
    done = (
        await http.get("/v1/runs", params={"status": "succeeded"}, headers=member.headers)
    ).json()
    assert len(done["runs"]) == 3
    none = (
        await http.get("/v1/runs", params={"status": "cancelled"}, headers=member.headers)
    ).json()
    assert none["runs"] == []
    bad = await http.get("/v1/runs", params={"status": "done"}, headers=member.headers)
    assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "status"
    bad = await http.get("/v1/runs", params={"cursor": "nope"}, headers=member.headers)
    assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "cursor"


async def test_cancel_is_idempotent_and_settles_cancelled(
    http: httpx.AsyncClient, member: Member, runtime: Runtime
) -> None:
    run = await start(http, member, model="replay/api-slow")
    async for ev in runtime.events(run["id"], follow=True):
        if ev.type == "shell.executed" or ev.type == "model.called":
            break
    r = await http.post(f"/v1/runs/{run['id']}/cancel", headers=member.headers)
    assert r.status_code == 200
    settled = await runtime.wait(run["id"], 60)
    assert settled.status == "cancelled"
    again = await http.post(f"/v1/runs/{run['id']}/cancel", headers=member.headers)
    assert again.status_code == 200 and again.json()["status"] == "cancelled"
    events = (await http.get(f"/v1/runs/{run['id']}/events", headers=member.headers)).json()
    types = [e["type"] for e in events]
    assert "run.cancelled" in types and types[-1] == "run.settled"
    if "sandbox.ready" in types:
        assert "sandbox.destroyed" in types
    cost = again.json()["cost"]
    assert cost["charged_micros"] + cost["refunded_micros"] == cost["reserved_micros"]


async def test_delete_erases_content_and_keeps_billing(
    http: httpx.AsyncClient, member: Member, runtime: Runtime
) -> None:
    run = await start(http, member)
    await runtime.wait(run["id"], 60)
    before = (await http.get(f"/v1/runs/{run['id']}", headers=member.headers)).json()
    r = await http.delete(f"/v1/runs/{run['id']}", headers=member.headers)
    assert r.status_code == 200
    after = r.json()
    assert after["output"] is None
    assert after["cost"] == before["cost"]
    assert after["usage"] == before["usage"]
    events = (await http.get(f"/v1/runs/{run['id']}/events", headers=member.headers)).json()
    text = json.dumps(events)
    assert "whoami" not in text and "worker\\n" not in text and "Ran `whoami`" not in text
    assert [e["type"] for e in events][-1] == "run.settled"
    row = await runtime.store.runs.get(run["id"])
    assert row.prompt is None


async def test_auth_is_required_and_bad_keys_are_401(http: httpx.AsyncClient) -> None:
    r = await http.get("/v1/runs")
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert r.headers["content-type"] == "application/problem+json"
    r = await http.get("/v1/runs", headers={"Authorization": "Bearer eph_not_a_real_key"})
    assert r.status_code == 401
    r = await http.get("/v1/runs", headers={"Authorization": "Basic dXNlcjpwYXNz"})
    assert r.status_code == 401


async def test_healthz(http: httpx.AsyncClient) -> None:
    r = await http.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


@pytest.mark.slow  # probes every isolation level by starting one (microvm-tcg takes ~50 s)
async def test_isolation_reports_levels_and_auto(http: httpx.AsyncClient, member: Member) -> None:
    info = (await http.get("/v1/isolation", headers=member.headers)).json()
    assert set(info["levels"]) == {"microvm-kvm", "microvm-tcg", "gvisor", "namespaces"}
    assert info["auto"] in info["available"]
    for level in info["levels"].values():
        assert level["available"] == (level["reason"] is None)
        # an available level names the runtime that ran its probe
        assert not level["available"] or level["runtime"] not in (None, "missing", "unknown")
    if shutil.which("runsc"):
        assert info["levels"]["gvisor"]["runtime"].startswith("runsc version")
