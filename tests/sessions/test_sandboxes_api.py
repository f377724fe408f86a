"""``/v1/sandboxes`` contract, as for runs: auth, other org 404, idempotency, 402, exec, files,
time limit, ZDR. The real app over httpx's ASGI transport, a real runtime and real sandboxes."""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest

from ephemeral.api.auth import PAGE_COOKIE
from ephemeral.engine.runtime import Runtime
from ephemeral.testing.clock import FakeClock
from tests.api.conftest import Member, new_member
from tests.drivers import built_image
from tests.patience import PATIENCE

pytestmark = pytest.mark.sandbox


async def _create(
    http: httpx.AsyncClient, who: Member, isolation: str, **body: object
) -> dict[str, object]:
    r = await http.post("/v1/sandboxes", json={"isolation": isolation, **body}, headers=who.headers)
    assert r.status_code == 201, r.text
    return dict(r.json())


async def test_auth_is_required(http: httpx.AsyncClient) -> None:
    assert (await http.post("/v1/sandboxes", json={})).status_code == 401
    bad = {"Authorization": "Bearer eph_nope"}
    assert (await http.get("/v1/sandboxes/run_" + "0" * 32, headers=bad)).status_code == 401


async def test_session_over_http(
    http: httpx.AsyncClient, runtime: Runtime, member: Member, isolation: str
) -> None:
    sbx = await _create(http, member, isolation, timeout_seconds=120, max_cost_micros=50_000)
    sid = sbx["id"]
    assert (sbx["status"], sbx["kind"], sbx["isolation"]) == ("running", "session", isolation)
    assert sbx["links"]["self"] == f"http://testserver/v1/sandboxes/{sid}"  # type: ignore[index]
    h = member.headers
    r = await http.post(f"/v1/sandboxes/{sid}/exec", json={"command": ["id", "-un"]}, headers=h)
    assert r.status_code == 200 and r.json()["stdout"] == "worker\n"
    stdin = base64.b64encode(b"line\n").decode()
    r = await http.post(
        f"/v1/sandboxes/{sid}/exec",
        json={
            "command": "cat; echo $X; pwd",
            "stdin_base64": stdin,
            "env": {"X": "y"},
            "cwd": "/tmp",
        },
        headers=h,
    )
    assert r.json()["stdout"] == "line\ny\n/tmp\n"
    r = await http.post(
        f"/v1/sandboxes/{sid}/exec", json={"command": ["whoami"], "user": "root"}, headers=h
    )
    assert r.json()["stdout"] == "root\n"
    r = await http.post(
        f"/v1/sandboxes/{sid}/exec",
        json={"command": "sleep 20", "timeout_seconds": 0.5},
        headers=h,
    )
    assert r.json()["timed_out"] is True
    r = await http.post(f"/v1/sandboxes/{sid}/exec", json={"command": "true", "shel": 1}, headers=h)
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "shel"

    blob = bytes(range(256)) * 64
    r = await http.put(
        f"/v1/sandboxes/{sid}/files",
        params={"path": "d/blob.bin"},
        content=blob,
        headers={**h, "Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 204, r.text
    r = await http.get(f"/v1/sandboxes/{sid}/files", params={"path": "d/blob.bin"}, headers=h)
    assert r.status_code == 200 and r.content == blob
    r = await http.get(f"/v1/sandboxes/{sid}/files", params={"path": "nope"}, headers=h)
    assert r.status_code == 404 and r.json()["type"].endswith("/file-not-found")
    r = await http.get(f"/v1/sandboxes/{sid}/files", params={"path": "/etc"}, headers=h)
    assert r.status_code == 409 and r.json()["type"].endswith("/is-a-directory")
    await http.post(f"/v1/sandboxes/{sid}/exec", json={"command": "chmod -r d/blob.bin"}, headers=h)
    r = await http.get(f"/v1/sandboxes/{sid}/files", params={"path": "d/blob.bin"}, headers=h)
    assert r.status_code == 403 and r.json()["type"].endswith("/file-permission-denied")
    r = await http.get(
        f"/v1/sandboxes/{sid}/files", params={"path": "/etc/passwd", "max_bytes": 10}, headers=h
    )
    assert r.status_code == 413

    # another org sees nothing of it
    other = await new_member(runtime, "other")
    for method, url in (
        ("GET", f"/v1/sandboxes/{sid}"),
        ("POST", f"/v1/sandboxes/{sid}/exec"),
        ("GET", f"/v1/sandboxes/{sid}/files?path=d/blob.bin"),
        ("DELETE", f"/v1/sandboxes/{sid}"),
    ):
        body = {"command": "true"} if method == "POST" else None
        r = await http.request(method, url, json=body, headers=other.headers)
        assert r.status_code == 404, (method, url, r.text)
    # sessions are not runs
    assert (await http.get("/v1/runs", headers=h)).json()["runs"] == []
    live = (await http.get(f"/v1/sandboxes/{sid}", headers=h)).json()
    assert live["status"] == "running"
    assert live["usage"]["execs"] == 5  # counted as they run, not only at the end

    r = await http.delete(f"/v1/sandboxes/{sid}", headers=h)
    ended = r.json()
    assert r.status_code == 200 and ended["status"] == "succeeded"
    cost = ended["cost"]
    assert cost["charged_micros"] + cost["refunded_micros"] == 50_000
    assert ended["usage"]["execs"] == 5
    assert (await http.delete(f"/v1/sandboxes/{sid}", headers=h)).json() == ended
    r = await http.post(f"/v1/sandboxes/{sid}/exec", json={"command": "true"}, headers=h)
    assert r.status_code == 409
    events = (await http.get(f"/v1/runs/{sid}/events", headers=h)).json()
    assert [e["type"] for e in events].count("sandbox.exec") == 5
    assert events[-1]["type"] == "run.settled"
    # the session's page: its commands and their output, like a run's shell steps
    http.cookies.set(PAGE_COOKIE, member.key)
    page = await http.get(f"/runs/{sid}")
    assert page.status_code == 200
    assert "$ id -un" in page.text and "worker" in page.text and "as root" in page.text


async def test_a_sessions_row_records_its_image_as_a_runs_does(
    http: httpx.AsyncClient, runtime: Runtime, member: Member, isolation: str
) -> None:
    # A session's running transition is a run's (ephemeral.run.Run.running): its row names the
    # image and the hash its sandbox booted, as sandbox.ready does (before: both null).
    built = built_image(runtime.settings, runtime.settings.image)
    sid = (await _create(http, member, isolation))["id"]
    h = member.headers
    row = (await http.get(f"/v1/runs/{sid}", headers=h)).json()
    events = (await http.get(f"/v1/runs/{sid}/events", headers=h)).json()
    ready = next(e["data"] for e in events if e["type"] == "sandbox.ready")
    assert (row["image"], row["image_hash"]) == (runtime.settings.image, built.hash)
    assert (ready["image"], ready["image_hash"]) == (row["image"], row["image_hash"])
    await http.delete(f"/v1/sandboxes/{sid}", headers=h)
    ended = (await http.get(f"/v1/runs/{sid}", headers=h)).json()
    assert (ended["image"], ended["image_hash"]) == (row["image"], row["image_hash"])


async def test_idempotency_and_402(
    http: httpx.AsyncClient, runtime: Runtime, member: Member, isolation: str
) -> None:
    h = {**member.headers, "Idempotency-Key": "sbx-1"}
    body = {"isolation": isolation, "max_cost_micros": 30_000}
    first = await http.post("/v1/sandboxes", json=body, headers=h)
    assert first.status_code == 201
    again = await http.post("/v1/sandboxes", json=dict(reversed(body.items())), headers=h)
    assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    assert (await runtime.store.orgs.get(member.org_id)).reserved_micros == 30_000  # once
    changed = await http.post("/v1/sandboxes", json={**body, "max_cost_micros": 1}, headers=h)
    assert changed.status_code == 422
    run_key = {**member.headers, "Idempotency-Key": "sbx-1"}
    as_run = await http.post("/v1/runs", json={"prompt": "hi"}, headers=run_key)
    assert as_run.status_code == 422  # a session's key does not replay as a run
    await http.delete(f"/v1/sandboxes/{first.json()['id']}", headers=member.headers)

    poor = await new_member(runtime, "poor", usd_micros=1_000)
    r = await http.post(
        "/v1/sandboxes",
        json={"isolation": isolation, "max_cost_micros": 5_000},
        headers=poor.headers,
    )
    assert r.status_code == 402 and r.json()["type"].endswith("/insufficient-balance")
    # web is granted as for a run (tests/sessions/test_egress.py); a bad allow list is refused
    bad = {"isolation": isolation, "web": {"allow": ["*"]}}
    r = await http.post("/v1/sandboxes", json=bad, headers=member.headers)
    assert r.status_code == 422 and r.json()["errors"][0]["field"].startswith("web")
    # setup/verify belong to runs: a session's client runs its commands with exec
    for field, value in (("setup", ["true"]), ("verify", ["true"])):
        body = {"isolation": isolation, field: value}
        r = await http.post("/v1/sandboxes", json=body, headers=member.headers)
        assert r.status_code == 422, (field, r.text)
        assert r.json()["errors"][0]["field"] == field
        assert "exec" in r.json()["errors"][0]["message"]


async def test_time_limit_and_zdr_over_http(
    runtime: Runtime, http: httpx.AsyncClient, member: Member, isolation: str
) -> None:
    clock = runtime.sessions.clock = FakeClock()  # the limit comes when the test says
    h = member.headers
    sbx = await _create(http, member, isolation, timeout_seconds=1, zero_data_retention=True)
    r = await http.post(
        f"/v1/sandboxes/{sbx['id']}/exec", json={"command": "echo private"}, headers=h
    )
    assert r.json()["stdout"] == "private\n"
    clock.advance(1)
    async with asyncio.timeout(PATIENCE):
        while (await http.get(f"/v1/sandboxes/{sbx['id']}", headers=h)).json()["status"] == (
            "running"
        ):
            await asyncio.sleep(0.1)
    done = (await http.get(f"/v1/sandboxes/{sbx['id']}", headers=h)).json()
    assert done["status"] == "timed_out"
    assert done["termination"]["reason"] == "timeout"
    events = (await http.get(f"/v1/runs/{sbx['id']}/events", headers=h)).json()
    assert "private" not in str(events)
