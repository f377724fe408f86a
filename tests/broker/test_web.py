"""``web_fetch`` against a real HTTP server on 127.0.0.1: the broker alone through a FakeContext,
and through a real runtime's run where the run's own side matters (ledger, budget stop, ZDR)."""

from __future__ import annotations

import pytest

from ephemeral.agent.loop import StopRun
from ephemeral.broker import Broker
from ephemeral.broker.outbound import BODY_CAP
from ephemeral.engine.runtime import Runtime
from ephemeral.policy import Policy
from ephemeral.settings import Settings
from ephemeral.testing.broker import PRICE, FakeContext, OutOfBudget, ask
from tests.broker.conftest import Upstream, build_run, call, events_of


async def test_fetch_returns_text_charges_and_strips_the_query(
    runtime: Runtime, upstream: Upstream
) -> None:
    agent = await build_run(runtime, web=True)
    assert [t.name for t in agent.tools()] == ["web_fetch"]
    out = await call(agent, "web_fetch", url=f"{upstream.base}/text?token=QUERYSECRET&x=1")
    assert out.startswith("status: 200\n")
    assert "hello from upstream" in out
    assert "truncated: false" in out
    assert upstream.seen[0].path == "/text?token=QUERYSECRET&x=1"  # the request had its query
    assert upstream.seen[0].headers["Host"] == f"127.0.0.1:{upstream.port}"
    [ev] = await events_of(agent, "web.requested")
    assert ev.data == {
        "method": "GET",
        "url": f"{upstream.base}/text",
        "status": 200,
        "cost_micros": PRICE,
    }
    all_events = await agent.store.events.list(agent.run_id)
    assert "QUERYSECRET" not in str([e.data for e in all_events])
    assert (await agent.store.money.charged(agent.run_id))["web_micros"] == PRICE
    assert agent.budget.charged["web_micros"] == PRICE


async def test_head_has_no_body(broker: Broker, upstream: Upstream) -> None:
    ctx = FakeContext(Policy(web=True))
    out = await ask(broker, ctx, "web_fetch", url=f"{upstream.base}/text", method="HEAD")
    assert "status: 200" in out and "hello" not in out
    assert upstream.seen[0].method == "HEAD"


async def test_body_is_capped_and_flagged(broker: Broker, upstream: Upstream) -> None:
    from ephemeral.broker import outbound
    from ephemeral.broker.ssrf import parse_url, resolve

    target = await resolve(parse_url(f"{upstream.base}/big"), allow_private=True)
    response = await outbound.send(target, "GET", timeout=10)
    assert len(response.body) == BODY_CAP < 300 * 1024
    assert response.truncated
    out = await ask(broker, FakeContext(Policy(web=True)), "web_fetch", url=f"{upstream.base}/big")
    assert "truncated: true" in out
    assert len(out) < 17_000  # what the model reads is capped too


async def test_binary_bodies_are_described_not_shown(broker: Broker, upstream: Upstream) -> None:
    ctx = FakeContext(Policy(web=True))
    out = await ask(broker, ctx, "web_fetch", url=f"{upstream.base}/binary")
    assert "256 bytes of application/octet-stream; not shown" in out


async def test_redirects_are_followed_and_each_hop_charged(
    broker: Broker, upstream: Upstream
) -> None:
    ctx = FakeContext(Policy(web=True))
    out = await ask(broker, ctx, "web_fetch", url=f"{upstream.base}/chain/3")
    assert "end of chain" in out
    hops = ctx.of("web.requested")
    assert [e["url"] for e in hops] == [f"{upstream.base}/chain/{n}" for n in (3, 2, 1, 0)]
    assert [e["status"] for e in hops] == [302, 302, 302, 200]
    assert ctx.charges == [(n, PRICE) for n in (1, 2, 3, 4)]  # each hop, numbered


async def test_more_than_five_redirects_are_refused(broker: Broker, upstream: Upstream) -> None:
    ctx = FakeContext(Policy(web=True))
    out = await ask(broker, ctx, "web_fetch", url=f"{upstream.base}/chain/9")
    assert out.startswith("error:") and "more than 5 redirects" in out
    assert len(upstream.seen) == 6  # the first request and five redirects, no more
    [denied] = ctx.of("web.denied")
    assert denied["url"] == f"{upstream.base}/chain/3"
    assert denied["cost_micros"] == 0


@pytest.mark.parametrize(
    ("to", "why"),
    [
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("http://[fe80::1]/", "link-local"),
        ("http://0.0.0.0:1/", "unspecified"),
        ("file:///etc/passwd", "scheme"),
        ("http://u:p@127.0.0.1/", "credentials"),
    ],
)
async def test_redirects_get_the_same_checks(
    broker: Broker, upstream: Upstream, to: str, why: str
) -> None:
    ctx = FakeContext(Policy(web=True))
    out = await ask(broker, ctx, "web_fetch", url=f"{upstream.base}/redirect?to={to}")
    assert out.startswith("error:") and why in out
    assert len(upstream.seen) == 1
    [denied] = ctx.of("web.denied")
    assert "redirect refused" in denied["reason"]
    assert "p@" not in denied["url"]
    assert ctx.charged == PRICE  # the first hop only


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ({"url": "file:///etc/passwd"}, "scheme"),
        ({"url": "http://user:SECRETPW@127.0.0.1/"}, "credentials"),
        ({"url": "http://169.254.169.254/"}, "link-local"),
        ({"url": "http://127.0.0.1/", "method": "POST"}, "GET or HEAD"),
        ({"url": "http://127.0.0.1/", "headers": {"X": "y"}}, "unknown argument"),
        ({"url": 42}, "non-empty string"),
    ],
)
async def test_refused_requests_cost_nothing(
    broker: Broker, upstream: Upstream, args: dict, why: str
) -> None:
    ctx = FakeContext(Policy(web=True))
    out = await ask(broker, ctx, "web_fetch", **args)
    assert out.startswith("error:") and why in out
    [denied] = ctx.of("web.denied")
    assert denied["cost_micros"] == 0
    assert "SECRETPW" not in str(denied)
    assert ctx.charges == []
    assert upstream.seen == []


async def test_default_settings_refuse_loopback(
    broker_settings: Settings, upstream: Upstream
) -> None:
    strict = Broker(broker_settings.model_copy(update={"broker_allow_private_hosts": False}))
    ctx = FakeContext(Policy(web=True))
    for url in (
        f"{upstream.base}/text",
        f"http://localhost:{upstream.port}/text",
        f"http://2130706433:{upstream.port}/text",
        f"http://[::ffff:127.0.0.1]:{upstream.port}/text",
    ):
        out = await ask(strict, ctx, "web_fetch", url=url)
        assert out.startswith("error:") and "loopback" in out, out
    assert upstream.seen == []  # nothing reached the server
    assert len(ctx.of("web.denied")) == 4
    assert ctx.charges == []


async def test_web_off_means_no_tool_and_a_tool_error(broker: Broker, upstream: Upstream) -> None:
    policy = Policy(web=False, shell=True)
    assert broker.tools(policy) == []
    ctx = FakeContext(policy)
    out = await ask(broker, ctx, "web_fetch", url=f"{upstream.base}/text")
    assert out.startswith("error:") and "web is off" in out
    [denied] = ctx.of("web.denied")
    assert denied["reason"] == "web access is off in this run's policy"
    assert upstream.seen == []


async def test_a_request_that_does_not_fit_stops_the_run(
    runtime: Runtime, upstream: Upstream
) -> None:
    agent = await build_run(runtime, web=True, max_cost_micros=2 * PRICE + 500)
    for _ in range(2):
        assert "status: 200" in await call(agent, "web_fetch", url=f"{upstream.base}/text")
    with pytest.raises(StopRun) as info:
        await call(agent, "web_fetch", url=f"{upstream.base}/text")
    assert info.value.reason == "budget_exhausted"
    assert len(upstream.seen) == 2  # the third request was never sent
    assert (await agent.store.money.charged(agent.run_id))["web_micros"] == 2 * PRICE


async def test_a_redirect_that_does_not_fit_stops_before_the_hop(
    broker: Broker, upstream: Upstream
) -> None:
    ctx = FakeContext(Policy(web=True), budget_micros=PRICE + 10)
    with pytest.raises(OutOfBudget):  # the context's stop propagates through the broker
        await ask(broker, ctx, "web_fetch", url=f"{upstream.base}/chain/1")
    assert len(upstream.seen) == 1


async def test_an_unreachable_host_is_charged_and_reported(broker: Broker) -> None:
    ctx = FakeContext(Policy(web=True))
    out = await ask(broker, ctx, "web_fetch", url="http://127.0.0.1:9/")  # discard port: refused
    assert out.startswith("error: the web request failed")
    [ev] = ctx.of("web.requested")
    assert ev["status"] is None and ev["cost_micros"] == PRICE


async def test_zero_data_retention_keeps_no_url(runtime: Runtime, upstream: Upstream) -> None:
    agent = await build_run(runtime, web=True, zero_data_retention=True)
    await call(agent, "web_fetch", url=f"{upstream.base}/text")
    [ev] = await events_of(agent, "web.requested")
    assert "url" not in ev.data and ev.data["url_bytes"] > 0
    assert ev.data["cost_micros"] == PRICE


async def test_zero_data_retention_keeps_no_host_or_path_in_a_denial_reason(
    runtime: Runtime, upstream: Upstream
) -> None:
    from tests.broker.conftest import CANARY, add_connection, state_bytes_contain

    await add_connection(runtime, "svc", f"{upstream.base}/api", {"Authorization": CANARY})
    agent = await build_run(
        runtime,
        web={"allow": ["allowed.example"]},
        connections=[{"name": "svc", "methods": ["GET"], "paths": ["/repos/*"]}],
        zero_data_retention=True,
    )
    out = await call(agent, "web_fetch", url="http://hidden-host-zdr.example/hidden-path-zdr")
    assert "'hidden-host-zdr.example' is not in the web allow list" in out  # the model sees it
    out = await call(agent, "connection_call", name="svc", method="GET", path="/hidden-path-zdr")
    assert "'/hidden-path-zdr' matches none of /repos/*" in out
    out = await call(agent, "connection_call", name="hidden-name-zdr", method="GET", path="/x")
    assert "not granted" in out
    denied = [e.data for e in await events_of(agent, "web.denied", "connection.denied")]
    assert [d["reason"] for d in denied] == [
        "host '…' is not in the web allow list",
        "path '…' matches none of /repos/*",
        "connection '…' is not granted to this run",
    ]
    stored = str([e.data for e in await agent.store.events.list(agent.run_id)])
    for needle in ("hidden-host-zdr", "hidden-path-zdr"):
        assert needle not in stored
        assert state_bytes_contain(runtime.settings.state_dir, needle.encode()) == []


async def test_the_system_prompt_names_the_hosted_tools(runtime: Runtime) -> None:
    agent = await build_run(runtime, web=True, shell=True)
    prompt = agent._system_prompt()
    assert "`shell` tool" in prompt and "`web_fetch` (run by the host" in prompt
    plain = await build_run(runtime, web=False, shell=True)
    assert "web_fetch" not in plain._system_prompt()


async def test_no_broker_url_reaches_the_logs(
    broker: Broker, upstream: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    ctx = FakeContext(Policy(web=True))
    with caplog.at_level(logging.DEBUG):
        assert "status: 200" in await ask(
            broker, ctx, "web_fetch", url=f"{upstream.base}/text?k=LOGSECRET"
        )
    assert "LOGSECRET" not in caplog.text
    assert not [r for r in caplog.records if r.name.startswith(("httpx", "httpcore"))]


async def test_the_allow_list_limits_every_hop(broker: Broker, upstream: Upstream) -> None:
    ctx = FakeContext(Policy.model_validate({"web": {"allow": ["localhost"]}}))
    out = await ask(broker, ctx, "web_fetch", url=f"http://LocalHost:{upstream.port}/text")
    assert "hello from upstream" in out
    out = await ask(broker, ctx, "web_fetch", url=f"{upstream.base}/text")
    assert out == "error: web request refused: host '127.0.0.1' is not in the web allow list"
    to = f"{upstream.base}/text"
    out = await ask(
        broker, ctx, "web_fetch", url=f"http://localhost:{upstream.port}/redirect?to={to}"
    )
    assert "not in the web allow list" in out
    assert [s.path for s in upstream.seen] == ["/text", f"/redirect?to={to}"]
    assert [e["reason"] for e in ctx.of("web.denied")] == [
        "host '127.0.0.1' is not in the web allow list"
    ] * 2
