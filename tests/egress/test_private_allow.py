"""The operator's allow list past the SSRF rule (``egress_allow_private``, issue 36 item 6): an
internal mirror or proxy on a private address is reachable from a sandbox whose run has
``web``, by network or by name, and nothing else changes: unlisted private addresses are still
refused naming their class, and a run without ``web`` still has no way out.

The "mirror" is an HTTP server on the host's 127.0.0.1 (``upstream``) reached as
``mirror.test`` through the broker, on each isolation level this host starts. Every broker
here has ``broker_allow_private_hosts`` off (the egress tests' runtime turns it on)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ephemeral.broker import Broker
from ephemeral.engine.runtime import Runtime
from tests.broker.conftest import Upstream, call, events_of
from tests.egress.conftest import Names, provisioned, sh
from tests.sandbox.test_localhost import SERVE

pytestmark = [pytest.mark.sandbox]


async def test_a_listed_network_or_name_is_reachable_where_web_is_granted(
    runtime: Runtime,
    upstream: Upstream,
    names: Names,
    isolation: str,
    strict_broker: Callable[..., Broker],
) -> None:
    names.set("mirror.test", "127.0.0.1")
    names.set("other.test", "127.0.0.1")
    names.set("lan.test", "10.1.2.3")
    mirror = f"http://mirror.test:{upstream.port}/text"
    async with provisioned(runtime, isolation, strict_broker("127.0.0.1/32"), web=True) as a:
        got = await sh(a, f"curl -sS -m 10 {mirror}")
        assert (got.exit_code, got.stdout) == (0, "hello from upstream"), got
        assert "hello from upstream" in await call(a, "web_fetch", url=mirror)
        # a network of the same class that is not listed stays refused, naming the class
        lan = await sh(a, "curl -sS -m 10 http://lan.test/")
        assert "host 'lan.test' resolves to a private address" in lan.stdout, lan
        # a server a command starts on localhost answers the run's later commands, with the
        # proxy variables set (no_proxy keeps localhost inside the sandbox); the microVM's
        # root is its guest's own, without the container /etc (tests/sandbox/test_localhost.py)
        if not isolation.startswith("microvm"):
            local = await sh(a, SERVE.format(port=8765, bind="127.0.0.1"), timeout=60)
            assert (local.exit_code, local.stdout) == (0, "served-here\n" * 2), local.stderr
    async with provisioned(runtime, isolation, strict_broker("mirror.test"), web=True) as b:
        got = await sh(b, f"curl -sS -m 10 {mirror}")
        assert (got.exit_code, got.stdout) == (0, "hello from upstream"), got
        # the same address under another name is not the listed host
        other = await sh(b, f"curl -sS -m 10 http://other.test:{upstream.port}/text")
        assert "host 'other.test' resolves to a loopback address" in other.stdout, other
    assert [s.path for s in upstream.seen] == ["/text"] * 3
    assert [e.data["host"] for e in await events_of(b, "web.requested")] == ["mirror.test"]


async def test_without_the_list_or_without_web_the_mirror_is_refused(
    runtime: Runtime,
    upstream: Upstream,
    names: Names,
    isolation: str,
    strict_broker: Callable[..., Broker],
) -> None:
    names.set("mirror.test", "127.0.0.1")
    mirror = f"http://mirror.test:{upstream.port}/text"
    async with provisioned(runtime, isolation, strict_broker(), web=True) as a:
        got = await sh(a, f"curl -sS -m 10 {mirror}")
        assert "host 'mirror.test' resolves to a loopback address" in got.stdout, got
        refused = await call(a, "web_fetch", url=mirror)
        assert "resolves to a loopback address" in refused, refused
    listed = strict_broker("127.0.0.1/32", "mirror.test")
    async with provisioned(runtime, isolation, listed, web=False) as b:
        assert b.egress is None and b.egress_env == {}
        for command in (
            f"curl -sS -m 5 {mirror}",
            f"curl -sS -m 5 -x http://127.0.0.1:3128 {mirror}",
            f"curl -sS -m 5 http://127.0.0.1:{upstream.port}/text",
        ):
            res = await sh(b, command, timeout=20)
            assert res.exit_code != 0 and "hello" not in res.stdout, (command, res)
        assert "web is off" in await call(b, "web_fetch", url=mirror)
    assert upstream.seen == []
    assert names.lookups["mirror.test"] == 2  # the first run's two refusals; none without web
