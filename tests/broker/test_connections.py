"""``connection_call``: policy enforcement, credential injection and secrets kept out of sight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ephemeral import errors
from ephemeral.broker import Broker
from ephemeral.broker.connections import Denied, check_path, join
from ephemeral.engine.runtime import Runtime
from ephemeral.policy import Connection, Policy, RunRequest
from ephemeral.testing.broker import FakeContext, ask
from tests.broker.conftest import (
    CANARY,
    Upstream,
    add_connection,
    build_run,
    call,
    events_of,
    state_bytes_contain,
)

GITHUB = {"name": "github", "methods": ["GET", "POST"], "paths": ["/repos/*"]}


@pytest.fixture
async def github(runtime: Runtime, upstream: Upstream) -> str:
    await add_connection(
        runtime, "github", f"{upstream.base}/api", {"Authorization": f"Bearer {CANARY}"}
    )
    return f"{upstream.base}/api"


async def test_credentials_are_injected_upstream_and_redacted_from_the_answer(
    runtime: Runtime, upstream: Upstream, github: str
) -> None:
    agent = await build_run(runtime, connections=[GITHUB])
    assert [t.name for t in agent.tools()] == ["connection_call"]
    out = await call(
        agent, "connection_call", name="github", method="GET", path="/repos/acme/app?page=2"
    )
    assert out.startswith("status: 200\n")
    [seen] = upstream.seen
    assert seen.path == "/api/repos/acme/app?page=2"
    assert seen.headers["Authorization"] == f"Bearer {CANARY}"  # the broker added it
    assert CANARY not in out  # the echo endpoint sent it back; the model never reads it
    assert "[redacted]" in out
    echoed = json.loads(out.split("body:\n", 1)[1])
    assert echoed["path"] == "/api/repos/acme/app?page=2"
    [ev] = await events_of(agent, "connection.requested")
    assert ev.data == {"name": "github", "method": "GET", "path": "/repos/acme/app", "status": 200}
    events = await agent.store.events.list(agent.run_id)
    assert CANARY not in json.dumps([e.data for e in events])
    assert agent.sandbox is None  # nothing was sent into a sandbox for this


async def test_post_sends_the_body_as_json(broker: Broker, upstream: Upstream) -> None:
    ctx = FakeContext(Policy(connections=[Connection(**GITHUB)]))
    ctx.connect(broker.sealer, "github", f"{upstream.base}/api", {"Authorization": CANARY})
    out = await ask(
        broker,
        ctx,
        "connection_call",
        name="github",
        method="post",
        path="/repos/acme/app/issues",
        body='{"title": "hi"}',
    )
    assert "status: 200" in out
    assert upstream.seen[0].method == "POST"
    assert upstream.seen[0].body == b'{"title": "hi"}'
    assert upstream.seen[0].headers["Content-Type"] == "application/json"


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ({"name": "gitlab", "method": "GET", "path": "/repos/x"}, "not granted"),
        ({"name": "github", "method": "DELETE", "path": "/repos/x"}, "not allowed"),
        ({"name": "github", "method": "GET", "path": "/user/emails"}, "matches none"),
        ({"name": "github", "method": "GET", "path": "/repos/../admin"}, "'..'"),
        ({"name": "github", "method": "GET", "path": "/repos/%2e%2e/admin"}, "'..'"),
        ({"name": "github", "method": "GET", "path": "/repos/a/%2E%2E%2F..%2Fadmin"}, "'..'"),
        ({"name": "github", "method": "GET", "path": "/repos/..;/admin"}, "'..'"),
        ({"name": "github", "method": "GET", "path": "/repos/x/.%3Bjsessionid/y"}, "'..'"),
        ({"name": "github", "method": "GET", "path": "//evil.example/repos/x"}, "single '/'"),
        ({"name": "github", "method": "GET", "path": "repos/x"}, "single '/'"),
        ({"name": "github", "method": "GET", "path": "/repos/x\\..\\y"}, "single '/'"),
        ({"name": "github", "method": "GET", "path": "/repos/x y"}, "whitespace"),
        ({"name": "github", "method": "GET", "path": "/repos/x", "body": "b"}, "body"),
        (
            {"name": "github", "method": "GET", "path": "/repos/x", "headers": {"A": "b"}},
            "unknown argument",
        ),
    ],
)
async def test_policy_is_enforced_before_any_call(
    broker: Broker, upstream: Upstream, args: dict, why: str
) -> None:
    ctx = FakeContext(Policy(connections=[Connection(**GITHUB)]))
    ctx.connect(broker.sealer, "github", f"{upstream.base}/api", {"Authorization": CANARY})
    out = await ask(broker, ctx, "connection_call", **args)
    assert out.startswith("error: connection call refused") and why in out, out
    [denied] = ctx.of("connection.denied")
    assert set(denied) == {"name", "method", "path", "reason"}
    assert upstream.seen == []
    assert CANARY not in str(ctx.events)


async def test_no_connections_means_no_tool(broker: Broker, upstream: Upstream) -> None:
    policy = Policy(shell=True)
    assert broker.tools(policy) == []
    ctx = FakeContext(policy)
    out = await ask(broker, ctx, "connection_call", name="github", method="GET", path="/repos/x")
    assert out.startswith("error:") and "not granted" in out
    assert len(ctx.of("connection.denied")) == 1
    assert upstream.seen == []


async def test_admission_refuses_an_unknown_connection(runtime: Runtime, github: str) -> None:
    org = await runtime.local_org()
    request = RunRequest(
        prompt="x",
        model="replay/sandbox-proof",
        isolation="namespaces",
        connections=[GITHUB, {"name": "stripe"}],
    )
    with pytest.raises(errors.InvalidRequest) as info:
        await runtime.admit(org, request)
    assert info.value.status == 422
    assert info.value.errors == [
        {
            "field": "connections[1].name",
            "message": "this org has no connection named 'stripe' (ephemeral connections add)",
        }
    ]


async def test_another_orgs_connection_is_not_yours(runtime: Runtime, github: str) -> None:
    other = await runtime.store.orgs.create("other")
    await runtime.store.orgs.credit(other.id, 1_000_000)
    request = RunRequest(prompt="x", model="replay/sandbox-proof", connections=[GITHUB])
    with pytest.raises(errors.InvalidRequest):
        await runtime.admit(other.id, request)


async def test_secrets_are_sealed_at_rest(runtime: Runtime, github: str) -> None:
    state = runtime.settings.state_dir
    assert state_bytes_contain(state, CANARY.encode()) == []
    assert state_bytes_contain(state, b"Authorization")  # header names are kept in clear
    key = state / "broker.key"
    assert key.stat().st_mode & 0o077 == 0


async def test_removed_connection_is_denied_mid_run(
    runtime: Runtime, upstream: Upstream, github: str
) -> None:
    agent = await build_run(runtime, connections=[GITHUB])
    await runtime.store.connections.remove(await runtime.local_org(), "github")
    out = await call(agent, "connection_call", name="github", method="GET", path="/repos/x")
    assert "no longer exists" in out
    assert upstream.seen == []


async def test_credentials_reach_only_the_upstream(broker: Broker, upstream: Upstream) -> None:
    ctx = FakeContext(Policy(connections=[Connection(**GITHUB)]))
    ctx.connect(
        broker.sealer, "github", f"{upstream.base}/api", {"Authorization": f"Bearer {CANARY}"}
    )
    out = await ask(broker, ctx, "connection_call", name="github", method="GET", path="/repos/a")
    assert upstream.seen[0].headers["Authorization"] == f"Bearer {CANARY}"
    assert CANARY not in out and "[redacted]" in out
    assert CANARY not in str(ctx.events)
    assert ctx.of("connection.requested") == [
        {"name": "github", "method": "GET", "path": "/repos/a", "status": 200}
    ]


def test_globs_use_fnmatch_on_the_path_only() -> None:
    allowed = Connection(name="c", methods=["GET"], paths=["/repos/*/issues", "/rate_limit"])
    assert check_path("/repos/a/issues?state=open", allowed)
    assert check_path("/rate_limit", allowed)
    for bad in ("/rate_limit/x", "/repos/a/pulls", "/Rate_limit"):
        with pytest.raises(Denied):
            check_path(bad, allowed)


def test_join_never_leaves_the_base() -> None:
    assert str(join("https://api.example.com/v1", "/x?y=1")) == "https://api.example.com/v1/x?y=1"
    for bad in ("@evil.example/x", ":8080/x"):
        with pytest.raises(Denied):
            join("https://api.example.com", bad)


def test_state_grep_helper_finds_what_is_there(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"xx" + CANARY.encode())
    assert state_bytes_contain(tmp_path, CANARY.encode()) == [tmp_path / "f"]


async def test_the_api_answers_422_naming_the_connection(runtime: Runtime, github: str) -> None:
    import httpx

    from ephemeral.api import create_app

    org = await runtime.store.orgs.create("acme")
    await runtime.store.orgs.credit(org.id, 1_000_000)
    _, key = await runtime.store.keys.create(org.id, "me@acme.test")
    app = create_app(runtime.settings, runtime)
    body = {
        "prompt": "x",
        "model": "replay/sandbox-proof",
        "connections": [{"name": "github", "methods": ["GET"], "paths": ["/repos/*"]}],
    }
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://testserver"
    ) as http:
        # "github" belongs to the local org, not to acme.
        r = await http.post("/v1/runs", json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["errors"][0]["field"] == "connections[0].name"
    assert (await runtime.store.orgs.get(org.id)).reserved_micros == 0  # nothing was held
