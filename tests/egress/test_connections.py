"""Connections from code: ``http://NAME.connections.internal/PATH`` through the sandbox's proxy.

The broker checks method and path like ``connection_call``, drops what the guest sent that looks
like a credential, adds the stored headers, and never lets the secret into the sandbox.
"""

from __future__ import annotations

import json

import pytest

from ephemeral.engine.runtime import Runtime
from tests.broker.conftest import CANARY, Upstream, add_connection, events_of, state_bytes_contain
from tests.egress.conftest import Names, provisioned, sh
from tests.egress.servers import echo_site

pytestmark = [pytest.mark.sandbox]

GRANT = [{"name": "svc", "methods": ["GET"], "paths": ["/repos/*"]}]
URL = "http://svc.connections.internal"


async def test_code_calls_a_connection_with_the_stored_credential_only(
    runtime: Runtime, upstream: Upstream, names: Names, isolation: str
) -> None:
    await add_connection(
        runtime, "svc", f"{upstream.base}/api", {"Authorization": f"Bearer {CANARY}"}
    )
    async with provisioned(runtime, isolation, web=False, connections=GRANT) as agent:
        prompt = agent.messages[0].content or ""
        assert "http://NAME.connections.internal/PATH" in prompt and "svc (GET /repos/*)" in prompt
        res = await sh(
            agent,
            f"curl -sS -m 10 -H 'X-Trace: t1' -H 'Accept: application/json' "
            f"-H 'Authorization: Bearer guest-token' "
            f"-H 'X-Api-Key: guest-key' -H 'Cookie: s=guest' '{URL}/repos/acme/app?page=2'",
        )
        assert res.exit_code == 0, res.stderr
        echoed = json.loads(res.stdout)
        # the upstream echoes the credential back: the sandbox reads it redacted
        assert echoed["headers"]["Authorization"] == "[redacted]"
        assert echoed["path"] == "/api/repos/acme/app?page=2"
        assert CANARY not in res.stdout

        web = await sh(agent, f"curl -sS -m 10 -w ' code=%{{http_code}}' {upstream.base}/text")
        assert web.exit_code != 0  # 127.0.0.1 bypasses the proxy: no route, nothing there
        web = await sh(
            agent, f"curl -sS -m 10 -w ' code=%{{http_code}}' http://site.test:{upstream.port}/"
        )
        assert web.stdout.endswith("code=403") and "web access is off" in web.stdout

        # the secret is nowhere inside: environment, processes, files
        leak = await sh(
            agent,
            f"env; cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null; "
            f"grep -rl -- '{CANARY}' /tmp /home /etc /run /var /opt /root 2>/dev/null; true",
            timeout=20,
        )
        assert CANARY not in leak.stdout.replace(f"'{CANARY}'", "")
    seen = upstream.seen[0]
    assert seen.path == "/api/repos/acme/app?page=2"
    assert seen.headers["Authorization"] == f"Bearer {CANARY}"
    assert seen.headers["Accept"] == "application/json"
    assert "X-Trace" not in seen.headers  # not on the allow list
    assert "X-Api-Key" not in seen.headers and "Cookie" not in seen.headers
    assert len(upstream.seen) == 1
    requested = [e.data for e in await events_of(agent, "connection.requested")]
    assert requested == [{"name": "svc", "method": "GET", "path": "/repos/acme/app", "status": 200}]
    assert state_bytes_contain(runtime.settings.state_dir, CANARY.encode()) == []
    assert names.lookups == {}


DENIED = {
    "POST when only GET": ("-X POST -d x", "/repos/a/b", "method 'POST' is not allowed"),
    "outside the pattern": ("", "/user", "matches none of /repos/*"),
    "encoded dot-dot": ("--path-as-is", "/repos/%2e%2e/admin", "'.' or '..' segments"),
    "dot-dot": ("--path-as-is", "/repos/a/../../admin", "'.' or '..' segments"),
    "double slash": ("--path-as-is", "//repos/a", "single '/'"),
    "case trick": ("", "/REPOS/a", "matches none of /repos/*"),
    "path parameter": ("--path-as-is", "/repos/..;x/admin", "'.' or '..' segments"),
    "backslash": ("--path-as-is", "/repos/a%5c..%5cadmin", "'.' or '..' segments"),
}


async def test_connection_denials_are_403_inside_and_events_outside(
    runtime: Runtime, upstream: Upstream, isolation: str
) -> None:
    await add_connection(
        runtime, "svc", f"{upstream.base}/api", {"Authorization": f"Bearer {CANARY}"}
    )
    async with provisioned(runtime, isolation, connections=GRANT) as agent:
        for what, (flags, path, reason) in DENIED.items():
            res = await sh(agent, f"curl -sS -m 10 {flags} -w ' code=%{{http_code}}' '{URL}{path}'")
            assert res.stdout.endswith("code=403"), (what, res)
            assert reason in res.stdout, (what, res.stdout)
        other = await sh(
            agent, "curl -sS -m 10 -w ' %{http_code}' http://nope.connections.internal/"
        )
        assert "'nope' is not granted" in other.stdout and other.stdout.endswith("403")
        tunnel = await sh(agent, "curl -sS -m 10 https://svc.connections.internal/repos/a")
        assert tunnel.exit_code != 0
        port = await sh(
            agent, f"curl -sS -m 10 http://svc.connections.internal:{upstream.port}/repos/a"
        )
        assert "takes no port" in port.stdout
    assert upstream.seen == []
    denied = [e.data for e in await events_of(agent, "connection.denied")]
    assert len(denied) == len(DENIED) + 3
    assert denied[0] == {
        "name": "svc",
        "method": "POST",
        "path": "/repos/a/b",
        "reason": "method 'POST' is not allowed (allowed: GET)",
    }


DROPPED = {
    "X-HTTP-Method-Override": "DELETE",
    "X-Method-Override": "DELETE",
    "X-HTTP-Method": "DELETE",
    "X-Original-URL": "/admin",
    "X-Rewrite-URL": "/admin",
    "X-Forwarded-Host": "evil.example",
    "X-Forwarded-For": "10.0.0.1",
    "X-Forwarded-Proto": "https",
    "X-Forwarded-Prefix": "/admin",
    "Forwarded": "host=evil.example",
    "X-Real-IP": "10.0.0.1",
    "X-Host": "evil.example",
    "Range": "bytes=0-6",
    "If-Range": '"e"',
    "Accept-Encoding": "gzip",
    "TE": "gzip",
    "Via": "1.1 evil",
    "Origin": "http://evil.example",
    "Referer": "http://evil.example/",
    "X-Anything": "x",
}
KEPT = {
    "Accept": "application/json",
    "Accept-Language": "en",
    "Cache-Control": "no-cache",
    "Content-Type": "text/plain",
    "If-None-Match": '"abc"',
    "User-Agent": "probe/1",
}


async def test_only_allow_listed_headers_reach_the_upstream_and_framing_is_the_brokers(
    runtime: Runtime, isolation: str
) -> None:
    """Method-override, forwarding, Range and encoding headers are dropped; an upstream that
    compresses anyway, or answers a part, gets a 502 inside: its body is never relayed."""
    grant = [{"name": "svc", "methods": ["GET"], "paths": ["/echo/*"]}]
    with echo_site() as echo:
        await add_connection(
            runtime, "svc", f"http://127.0.0.1:{echo.port}/api", {"Authorization": CANARY}
        )
        async with provisioned(runtime, isolation, connections=grant) as agent:
            flags = " ".join(f"-H '{k}: {v}'" for k, v in {**DROPPED, **KEPT}.items())
            res = await sh(agent, f"curl -sS -m 10 --compressed {flags} '{URL}/echo/a'")
            assert res.exit_code == 0, res.stderr
            echoed = json.loads(res.stdout)["headers"]
            assert echoed["Authorization"] == "[redacted]"
            for why, query in {"compressed anyway": "enc=gzip", "a part": "part=0-6"}.items():
                out = await sh(
                    agent, f"curl -sS -m 10 -w ' code=%{{http_code}}' '{URL}/echo/b?{query}'"
                )
                assert out.stdout.endswith("code=502"), (why, out)
                assert CANARY[:7] not in out.stdout and "canary" not in out.stdout, why
            chunked = await sh(agent, f"curl -sS -m 10 '{URL}/echo/c?chunked=1&hdr=1' -D -")
            assert "x-echo: [redacted]" in chunked.stdout.lower() and CANARY not in chunked.stdout
    first = echo.seen[0]
    assert {k: first[k] for k in KEPT} == KEPT
    assert first["Accept-Encoding"] == "identity" and first["Authorization"] == CANARY
    assert not {k.lower() for k in first} & {k.lower() for k in DROPPED if k != "Accept-Encoding"}
    statuses = [e.data["status"] for e in await events_of(agent, "connection.requested")]
    assert statuses == [200, 502, 502, 200]
