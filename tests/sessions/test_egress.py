"""Egress from a sandbox session: ``web`` and ``connections`` on ``POST /v1/sandboxes``, and
commands run through ``/exec`` reaching out through the broker's proxy as a run's commands do.

The real app over httpx's ASGI transport, a real runtime whose broker may reach 127.0.0.1
(``broker_allow_private_hosts``), real sandboxes and real HTTP servers on 127.0.0.1 (the egress
tests' fixtures: ``upstream`` and the ``*.test`` name table).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from ephemeral.broker import Sealer
from ephemeral.engine.runtime import Runtime
from tests.api.conftest import Member
from tests.broker.conftest import CANARY, state_bytes_contain
from tests.egress.conftest import Names, Upstream, broker_settings, names, runtime, upstream
from tests.egress.test_money_and_failure import MIB, _download, broker_breaks, zeros

# fixtures: the egress tests', reused
__all__ = ["broker_breaks", "broker_settings", "names", "runtime", "upstream", "zeros"]

pytestmark = pytest.mark.sandbox

PROXY_VARS = {"http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "no_proxy"}


async def _create(http: httpx.AsyncClient, who: Member, **body: Any) -> str:
    body.setdefault("timeout_seconds", 120)
    body.setdefault("max_cost_micros", 50_000)
    r = await http.post("/v1/sandboxes", json=body, headers=who.headers)
    assert r.status_code == 201, r.text
    assert r.json()["status"] == "running", r.json()
    return str(r.json()["id"])


async def _exec(
    http: httpx.AsyncClient, who: Member, sid: str, command: str, **body: Any
) -> dict[str, Any]:
    r = await http.post(
        f"/v1/sandboxes/{sid}/exec", json={"command": command, **body}, headers=who.headers
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


async def _end(http: httpx.AsyncClient, who: Member, sid: str) -> dict[str, Any]:
    r = await http.delete(f"/v1/sandboxes/{sid}", headers=who.headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def _events(runtime: Runtime, sid: str, *types: str) -> list[dict[str, Any]]:
    return [e.data for e in await runtime.store.events.list(sid) if e.type in types]


def _env(stdout: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in stdout.splitlines() if "=" in line)


def _settled(obj: dict[str, Any]) -> None:
    cost = obj["cost"]
    assert cost["charged_micros"] + cost["refunded_micros"] == cost["reserved_micros"]
    assert cost["charged_micros"] == sum(cost["breakdown"].values())


async def test_web_off_has_no_forwarder_and_no_proxy_variables(
    http: httpx.AsyncClient,
    runtime: Runtime,
    member: Member,
    upstream: Upstream,
    names: Names,
    isolation: str,
) -> None:
    names.set("site.test", "127.0.0.1")
    sid = await _create(http, member, isolation=isolation)
    port = runtime.settings.egress_port
    env = await _exec(http, member, sid, "env")
    assert PROXY_VARS.isdisjoint(_env(env["stdout"]))
    curl = await _exec(http, member, sid, f"curl -sS -m 5 http://site.test:{upstream.port}/text")
    assert curl["exit_code"] != 0 and "Could not resolve host" in curl["stderr"]
    # nothing listens where the forwarder would be
    direct = await _exec(
        http, member, sid, f"curl -sS -m 5 -x http://127.0.0.1:{port} http://site.test/text"
    )
    assert direct["exit_code"] != 0 and "hello" not in direct["stdout"]
    ended = await _end(http, member, sid)
    _settled(ended)
    assert ended["cost"]["breakdown"]["web_micros"] == 0
    assert upstream.seen == [] and names.lookups == {}
    assert await _events(runtime, sid, "web.requested", "web.denied") == []


async def test_web_on_reaches_a_local_site_through_exec_and_is_charged(
    http: httpx.AsyncClient,
    runtime: Runtime,
    member: Member,
    upstream: Upstream,
    names: Names,
    isolation: str,
) -> None:
    names.set("site.test", "127.0.0.1")
    sid = await _create(http, member, isolation=isolation, web=True)
    proxy = f"http://127.0.0.1:{runtime.settings.egress_port}"
    # the proxy variables sit under the caller's env: the caller's own variables stay
    env = _env((await _exec(http, member, sid, "env", env={"MINE": "1"}))["stdout"])
    assert {k: env[k] for k in PROXY_VARS - {"no_proxy"}} == dict.fromkeys(
        PROXY_VARS - {"no_proxy"}, proxy
    )
    assert env["no_proxy"] == "localhost,127.0.0.1,::1" and env["MINE"] == "1"
    for _ in range(2):
        res = await _exec(
            http, member, sid, f"curl -sS -m 10 http://site.test:{upstream.port}/text"
        )
        assert (res["exit_code"], res["stdout"]) == (0, "hello from upstream"), res["stderr"]
    assert [s.path for s in upstream.seen] == ["/text", "/text"]
    ended = await _end(http, member, sid)
    assert (ended["status"], ended["termination"]["reason"]) == ("succeeded", "completed")
    requested = await _events(runtime, sid, "web.requested")
    assert [(e["method"], e["host"], e["path"], e["status"]) for e in requested] == [
        ("GET", "site.test", "/text", 200)
    ] * 2
    web = ended["cost"]["breakdown"]["web_micros"]
    assert web == sum(e["cost_micros"] for e in requested) > 0
    _settled(ended)
    started = await _events(runtime, sid, "worker.started")
    assert started[0]["web"] is True


async def test_the_allow_list_refuses_another_host(
    http: httpx.AsyncClient,
    runtime: Runtime,
    member: Member,
    upstream: Upstream,
    names: Names,
    isolation: str,
) -> None:
    names.set("site.test", "127.0.0.1")
    names.set("other.test", "127.0.0.1")
    sid = await _create(http, member, isolation=isolation, web={"allow": ["site.test"]})
    ok = await _exec(http, member, sid, f"curl -sS -m 10 http://site.test:{upstream.port}/text")
    assert ok["stdout"] == "hello from upstream", ok["stderr"]
    refused = await _exec(
        http,
        member,
        sid,
        f"curl -sS -m 10 -w ' code=%{{http_code}}' http://other.test:{upstream.port}/text",
    )
    assert refused["stdout"].endswith("code=403") and "hello" not in refused["stdout"]
    ended = await _end(http, member, sid)
    denied = await _events(runtime, sid, "web.denied")
    assert [(d["host"], d["cost_micros"]) for d in denied] == [("other.test", 0)]
    assert "allow" in denied[0]["reason"]
    assert [s.path for s in upstream.seen] == ["/text"]
    assert names.lookups["other.test"] == 0
    _settled(ended)


async def test_code_calls_a_connection_and_never_sees_its_secret(
    http: httpx.AsyncClient,
    runtime: Runtime,
    member: Member,
    upstream: Upstream,
    isolation: str,
) -> None:
    await runtime.store.connections.add(
        member.org_id,
        "svc",
        base_url=f"{upstream.base}/api",
        header_names=["Authorization"],
        sealed_headers=Sealer.for_settings(runtime.settings).seal(
            {"Authorization": f"Bearer {CANARY}"}
        ),
    )
    grant = [{"name": "svc", "methods": ["GET"], "paths": ["/repos/*"]}]
    sid = await _create(http, member, isolation=isolation, connections=grant)
    res = await _exec(
        http,
        member,
        sid,
        "curl -sS -m 10 -H 'Authorization: Bearer guest' "
        "http://svc.connections.internal/repos/acme/app",
    )
    assert res["exit_code"] == 0, res["stderr"]
    echoed = json.loads(res["stdout"])
    assert echoed["path"] == "/api/repos/acme/app"
    assert echoed["headers"]["Authorization"] == "[redacted]"  # echoed back, redacted
    post = await _exec(
        http,
        member,
        sid,
        "curl -sS -m 10 -X POST -d x -w ' code=%{http_code}' "
        "http://svc.connections.internal/repos/a",
    )
    assert post["stdout"].endswith("code=403")
    leak = await _exec(
        http,
        member,
        sid,
        # the needle is split in the command: the command itself is recorded (sandbox.exec)
        f"env; cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null; "
        f"grep -rl -- '{CANARY[:8]}''{CANARY[8:]}' /tmp /home /etc /run /var /opt /root "
        "2>/dev/null; true",
    )
    assert leak["exit_code"] == 0 and "PATH=" in leak["stdout"]
    assert CANARY not in leak["stdout"]
    ended = await _end(http, member, sid)
    assert [(s.method, s.headers["Authorization"]) for s in upstream.seen] == [
        ("GET", f"Bearer {CANARY}")
    ]
    requested = await _events(runtime, sid, "connection.requested")
    assert requested == [{"name": "svc", "method": "GET", "path": "/repos/acme/app", "status": 200}]
    denied = await _events(runtime, sid, "connection.denied")
    assert len(denied) == 1 and "POST" in denied[0]["reason"]
    _settled(ended)
    assert state_bytes_contain(runtime.settings.state_dir, CANARY.encode()) == []


async def test_a_byte_heavy_download_ends_the_session_at_its_budget(
    http: httpx.AsyncClient,
    runtime: Runtime,
    member: Member,
    names: Names,
    zeros: int,
    isolation: str,
) -> None:
    names.set("site.test", "127.0.0.1")
    sid = await _create(http, member, isolation=isolation, web=True, max_cost_micros=8_000)
    res = await _exec(http, member, sid, _download(zeros, "/huge"))
    got = int(res["stdout"].split("got=")[1].split()[0])
    assert 0 < got < 80 * MIB  # the tunnel was cut well before the 200 MiB were through
    r = await http.get(f"/v1/sandboxes/{sid}", headers=member.headers)
    obj = r.json()
    assert obj["termination"] == {
        "reason": "budget_exhausted",
        "detail": "egress traffic used up the budget",
    }
    again = await http.post(
        f"/v1/sandboxes/{sid}/exec", json={"command": "true"}, headers=member.headers
    )
    assert again.status_code == 409 and "budget_exhausted" in again.text
    requested = await _events(runtime, sid, "web.requested")
    assert len(requested) == 1 and requested[0]["cut"] == "the run's budget is used up"
    assert obj["cost"]["breakdown"]["web_micros"] == requested[0]["cost_micros"]
    assert obj["cost"]["charged_micros"] <= obj["cost"]["reserved_micros"]
    _settled(obj)


async def test_zero_data_retention_keeps_only_the_sizes_of_web_requests(
    http: httpx.AsyncClient,
    runtime: Runtime,
    member: Member,
    upstream: Upstream,
    names: Names,
    isolation: str,
) -> None:
    names.set("site.test", "127.0.0.1")
    sid = await _create(http, member, isolation=isolation, web=True, zero_data_retention=True)
    res = await _exec(http, member, sid, f"curl -sS -m 10 http://site.test:{upstream.port}/text")
    assert res["stdout"] == "hello from upstream", res["stderr"]
    ended = await _end(http, member, sid)
    requested = await _events(runtime, sid, "web.requested")
    assert len(requested) == 1
    event = requested[0]
    assert "host" not in event and "path" not in event
    assert (event["host_bytes"], event["path_bytes"]) == (len("site.test"), len("/text"))
    assert ended["cost"]["breakdown"]["web_micros"] == event["cost_micros"] > 0
    assert "site.test" not in str(await runtime.store.events.list(sid))


async def test_a_failing_broker_closes_egress_and_ends_the_session(
    http: httpx.AsyncClient,
    runtime: Runtime,
    member: Member,
    names: Names,
    zeros: int,
    isolation: str,
    broker_breaks: None,
) -> None:
    names.set("site.test", "127.0.0.1")
    sid = await _create(http, member, isolation=isolation, web=True)
    script = "; ".join(
        [
            _download(zeros, "/small"),
            _download(zeros, "/huge"),  # the broker fails mid-tunnel
            _download(zeros, "/small"),  # egress is closed now
        ]
    )
    res = await _exec(http, member, sid, script)
    lines = res["stdout"].split("\n")
    assert lines[0:2] == ["got=1000", "rc=0"]
    assert 4 * MIB < int(lines[2].removeprefix("got=")) < 50 * MIB and lines[3] != "rc=0"
    assert lines[4] == "got=0" and lines[5] != "rc=0"
    obj = (await http.get(f"/v1/sandboxes/{sid}", headers=member.headers)).json()
    assert obj["status"] == "failed"
    assert obj["termination"] == {
        "reason": "infra_error",
        "detail": "the egress broker failed: RuntimeError",
    }
    assert len(await _events(runtime, sid, "web.requested")) == 2  # the third was never served
    _settled(obj)
