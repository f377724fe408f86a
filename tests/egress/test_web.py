"""Web from code inside the sandbox, through the forwarder and the broker's proxy.

Every test runs on each isolation level this host starts (namespaces, gvisor), against servers
on 127.0.0.1 that the test starts (``broker_allow_private_hosts`` lets them through; link-local
and metadata addresses stay refused even then).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ephemeral.broker import Broker
from ephemeral.engine.runtime import Runtime
from ephemeral.runview import fold_events
from tests.broker.conftest import (
    BIG,
    CANARY,
    Upstream,
    add_connection,
    events_of,
    state_bytes_contain,
)
from tests.egress.conftest import Listeners, Names, Tls, provisioned, sh

pytestmark = [pytest.mark.sandbox]

WEB_OFF_ATTEMPTS = {
    "curl by name": "curl -sS -m 3 http://site.test:{port}/text",
    "curl by IP": "curl -sS -m 3 http://127.0.0.1:{tcp}/",
    "curl IPv6": "curl -sS -m 3 'http://[::1]:{tcp}/'",
    "curl via a proxy port": "curl -sS -m 3 -x http://127.0.0.1:3128 http://site.test:{port}/",
    "python urllib": (
        "python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:{tcp}/', timeout=3)\""
    ),
    "getent hosts": "getent hosts example.org",
    "bash /dev/tcp": "bash -c 'echo hi > /dev/tcp/127.0.0.1/{tcp}'",
    "bash /dev/tcp IPv6": "bash -c 'echo hi > /dev/tcp/::1/{tcp}'",
    "UDP": (
        'python3 -c "import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); '
        "s.sendto(b'leak', ('127.0.0.1', {udp})); s.sendto(b'leak', ('192.0.2.1', {udp}))\""
    ),
    "raw IP literal, other net": "curl -sS -m 3 http://192.0.2.1:{tcp}/",
}


async def test_web_off_means_no_forwarder_and_no_way_out(
    runtime: Runtime, upstream: Upstream, names: Names, isolation: str, host_listeners: Listeners
) -> None:
    names.set("site.test", "127.0.0.1")
    async with provisioned(runtime, isolation, web=False) as agent:
        assert agent.egress is None and agent.egress_env == {}
        env = await sh(agent, "env")
        assert "proxy" not in env.stdout.lower()
        failures = {}
        for what, template in WEB_OFF_ATTEMPTS.items():
            command = template.format(
                port=upstream.port, tcp=host_listeners.tcp_port, udp=host_listeners.udp_port
            )
            res = await sh(agent, command, timeout=15)
            failures[what] = res.exit_code
        # UDP to its own loopback "succeeds" inside (nobody listens there); the other
        # address has no route, so the command fails on the second send.
        assert all(code != 0 for code in failures.values()), failures
        resolve = await sh(agent, "curl -sS -m 3 http://site.test/ 2>&1")
        assert "Could not resolve host" in resolve.stdout
    assert upstream.seen == [] and host_listeners.heard == []
    assert names.lookups == {}
    assert await events_of(agent, "web.requested", "web.denied") == []


async def test_connect_without_a_port_dials_https_default_port(
    runtime: Runtime, tls_site_443: Tls, names: Names, isolation: str
) -> None:
    """``https://site.test/`` is ``CONNECT site.test:443``: dialled to 443, recorded as 443
    (httpx drops a default port, and the proxy used to dial 80 for it)."""
    names.set("site.test", "127.0.0.1")
    async with provisioned(runtime, isolation, web=True) as agent:
        assert agent.sandbox is not None
        await agent.sandbox.put_file("/tmp/ca.pem", tls_site_443.ca_pem)
        for url in ("https://site.test/text", "https://site.test:443/text"):
            res = await sh(agent, f"curl -sS -m 10 --cacert /tmp/ca.pem {url}")
            assert (res.exit_code, res.stdout) == (0, "hello from upstream"), (url, res.stderr)
    assert [s.path for s in tls_site_443.upstream.seen] == ["/text", "/text"]
    connects = [e.data for e in await events_of(agent, "web.requested")]
    assert [(c["method"], c["host"], c["port"], c["status"]) for c in connects] == [
        ("CONNECT", "site.test", 443, 200)
    ] * 2


async def test_web_on_reaches_http_and_https_and_is_charged(
    runtime: Runtime, upstream: Upstream, tls_site: Tls, names: Names, isolation: str
) -> None:
    names.set("site.test", "127.0.0.1")
    async with provisioned(runtime, isolation, web=True) as agent:
        assert agent.egress is not None
        assert agent.egress_env["https_proxy"] == "http://127.0.0.1:3128"
        assert "http://NAME.connections.internal" not in agent.messages[0].content
        assert "proxy" in (agent.messages[0].content or "")
        assert agent.sandbox is not None
        await agent.sandbox.put_file("/tmp/ca.pem", tls_site.ca_pem)
        plain = await sh(agent, f"curl -sS -m 10 'http://site.test:{upstream.port}/text?q=SECRETQ'")
        assert (plain.exit_code, plain.stdout) == (0, "hello from upstream"), plain.stderr
        tls = await sh(
            agent, f"curl -sS -m 10 --cacert /tmp/ca.pem https://site.test:{tls_site.port}/text"
        )
        assert (tls.exit_code, tls.stdout) == (0, "hello from upstream"), tls.stderr
        py = await sh(
            agent,
            'SSL_CERT_FILE=/tmp/ca.pem python3 -c "import urllib.request as u; '
            f"print(u.urlopen('https://site.test:{tls_site.port}/text', timeout=10).read())\"",
        )
        assert py.stdout.strip() == "b'hello from upstream'", py.stderr
        post = await sh(agent, f"curl -sS -m 10 -d 'a=1' http://site.test:{upstream.port}/echo")
        assert '"body": "a=1"' in post.stdout and '"method": "POST"' in post.stdout
    assert [s.path for s in upstream.seen] == ["/text?q=SECRETQ", "/echo"]
    assert upstream.seen[0].headers["Host"] == f"site.test:{upstream.port}"
    assert upstream.seen[0].headers["Connection"] == "close"
    assert not any(k.lower().startswith("proxy-") for k in upstream.seen[0].headers)
    assert [s.path for s in tls_site.upstream.seen] == ["/text", "/text"]

    events = await events_of(agent, "web.requested", "web.denied")
    assert [e.type for e in events] == ["web.requested"] * 4
    first = events[0].data
    assert {k: first[k] for k in ("method", "host", "port", "path", "status")} == {
        "method": "GET",
        "host": "site.test",
        "port": upstream.port,
        "path": "/text",
        "status": 200,
    }
    assert first["bytes_in"] > len("hello from upstream") and first["bytes_out"] > 0
    connects = [e.data for e in events if e.data["method"] == "CONNECT"]
    assert len(connects) == 2 and all(c["status"] == 200 for c in connects)
    assert all(c["port"] == tls_site.port for c in connects)
    assert all("path" not in c for c in connects)
    # one request price plus one MiB ahead, per request or tunnel
    assert all(e.data["cost_micros"] == 1000 + 100 for e in events)
    assert "SECRETQ" not in str([e.data for e in events])
    row = await runtime.store.runs.get(agent.run_id)
    assert row.breakdown["web_micros"] == sum(e.data["cost_micros"] for e in events)
    all_events = await runtime.store.events.list(agent.run_id)
    assert fold_events(all_events)["cost"]["charged_micros"] == row.charged_micros
    assert row.charged_micros <= row.reserved_micros


async def test_allow_list(
    runtime: Runtime, upstream: Upstream, tls_site: Tls, names: Names, isolation: str
) -> None:
    names.set("site.test", "127.0.0.1")
    names.set("other.test", "127.0.0.1")
    names.set("sub.site.test", "127.0.0.1")
    async with provisioned(runtime, isolation, web={"allow": ["SITE.test"]}) as agent:
        assert agent.sandbox is not None
        await agent.sandbox.put_file("/tmp/ca.pem", tls_site.ca_pem)
        ok = await sh(agent, f"curl -sS -m 10 http://Site.Test:{upstream.port}/text")
        assert ok.stdout == "hello from upstream", ok.stderr
        ok_tls = await sh(
            agent, f"curl -sS -m 10 --cacert /tmp/ca.pem https://site.test:{tls_site.port}/text"
        )
        assert ok_tls.stdout == "hello from upstream", ok_tls.stderr
        refused = {
            "other name": f"curl -sS -m 10 http://other.test:{upstream.port}/text",
            "subdomain": f"curl -sS -m 10 http://sub.site.test:{upstream.port}/text",
            "suffix": f"curl -sS -m 10 http://evilsite.test:{upstream.port}/text",
            "IP literal": f"NO_PROXY= no_proxy= curl -sS -m 10 http://127.0.0.1:{upstream.port}/",
            "CONNECT other": (
                f"curl -sS -m 10 --cacert /tmp/ca.pem https://other.test:{tls_site.port}/text"
            ),
            "CONNECT IP literal": (
                f"NO_PROXY= no_proxy= curl -sS -m 10 -k https://127.0.0.1:{tls_site.port}/"
            ),
        }
        for what, command in refused.items():
            res = await sh(agent, command + " -w ' code=%{http_code}'")
            assert res.exit_code != 0 or "code=403" in res.stdout, (what, res)
            assert "hello from upstream" not in res.stdout, what
        shown = await sh(agent, f"curl -sS -m 10 http://other.test:{upstream.port}/text")
        assert shown.stdout == "host 'other.test' is not in the run's web allow list\n"
        assert "for these hosts only: site.test" in (agent.messages[0].content or "")
    assert [s.path for s in upstream.seen] == ["/text"]
    assert [s.path for s in tls_site.upstream.seen] == ["/text"]
    denied = [e.data for e in await events_of(agent, "web.denied")]
    assert len(denied) == len(refused) + 1
    assert all(d["cost_micros"] == 0 for d in denied)
    started = [e.data for e in await events_of(agent, "worker.started")]
    assert started[0]["web"] == {"allow": ["site.test"]}


async def test_metadata_private_rebinding_and_literals_are_refused(
    runtime: Runtime, upstream: Upstream, names: Names, isolation: str
) -> None:
    # link-local stays refused even though this broker may reach loopback
    names.set("metadata.test", "169.254.169.254")
    names.set("mixed.test", "127.0.0.1", "169.254.169.254")
    names.set("mapped.test", "::ffff:169.254.169.254")
    names.sequence("rebind.test", ["127.0.0.1"], ["169.254.169.254"])
    async with provisioned(runtime, isolation, web=True) as agent:
        always = {
            "metadata IP": "curl -sS -m 10 http://169.254.169.254/latest/meta-data/",
            "metadata decimal": "curl -sS -m 10 http://2852039166/",
            "metadata name": "curl -sS -m 10 http://metadata.test/",
            "one bad address": f"curl -sS -m 10 http://mixed.test:{upstream.port}/text",
            "v4-mapped v6 name": "curl -sS -m 10 http://mapped.test/",
            "v4-mapped v6 literal": "curl -sS -m 10 'http://[::ffff:a9fe:a9fe]/'",
            "CONNECT metadata": "curl -sS -m 10 -k https://169.254.169.254/",
            "CONNECT unspecified": f"curl -sS -m 10 -k https://0.0.0.0:{upstream.port}/",
            "CONNECT multicast": "curl -sS -m 10 -k https://224.0.0.1/",
        }
        for what, command in always.items():
            res = await sh(agent, command)
            assert res.exit_code != 0 or "refused" in res.stdout or "resolves to" in res.stdout, (
                what,
                res,
            )
            assert "hello" not in res.stdout, what
        # DNS rebinding: the broker resolves once and dials the address it checked
        res = await sh(agent, f"curl -sS -m 10 http://rebind.test:{upstream.port}/text")
        assert res.stdout == "hello from upstream"
        assert names.lookups["rebind.test"] == 1
    denied = [e.data for e in await events_of(agent, "web.denied")]
    assert len(denied) == len(always)
    assert all("address" in d["reason"] for d in denied), denied
    assert [s.path for s in upstream.seen] == ["/text"]


async def test_private_addresses_are_refused_without_the_test_setting(
    runtime: Runtime,
    upstream: Upstream,
    names: Names,
    isolation: str,
    strict_broker: Callable[..., Broker],
) -> None:
    names.set("site.test", "127.0.0.1")
    names.set("lan.test", "10.1.2.3")
    names.set("cgnat.test", "100.64.0.1")
    async with provisioned(runtime, isolation, broker=strict_broker(), web=True) as agent:
        for url in (
            f"http://site.test:{upstream.port}/text",
            "http://lan.test/",
            "http://cgnat.test/",
            "http://10.0.0.1/",
            "http://0x7f.1/",
            "http://[fd00::1]/",
        ):
            res = await sh(agent, f"NO_PROXY= no_proxy= curl -sS -m 10 '{url}'")
            assert "resolves to a" in res.stdout and "address" in res.stdout, (url, res)
        tunnel = await sh(agent, f"curl -sS -m 10 -k https://site.test:{upstream.port}/")
        assert tunnel.exit_code != 0
    assert upstream.seen == []
    reasons = [e.data["reason"] for e in await events_of(agent, "web.denied")]
    assert len(reasons) == 7 and all(("loopback" in r or "private" in r) for r in reasons), reasons


RAW = r"""
import socket, sys
def ask(data):
    s = socket.create_connection(("127.0.0.1", 3128))
    s.sendall(data)
    out = b""
    while True:
        b = s.recv(65536)
        if not b:
            break
        out += b
    print(out.split(b"\r\n", 1)[0].decode(), "|", out.rsplit(b"\r\n\r\n", 1)[-1].decode().strip())
port = sys.argv[1]
u = f"http://site.test:{port}"
ask(b"GET /text HTTP/1.1\r\nHost: site.test\r\n\r\n")
ask(f"POST {u}/echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".encode())
ask(f"POST {u}/echo HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab".encode())
ask(b"GET http://site.test/ HTTP/1.1\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
ask(b"GET http://site.test/ HTTP/2.0\r\n\r\n")
ask(b"GET ftp://site.test/ HTTP/1.1\r\n\r\n")
ask(f"GET http://user:pw@site.test:{port}/text HTTP/1.1\r\n\r\n".encode())
smuggled = b"GET http://other.test/ HTTP/1.1\r\n\r\n"
ask(f"POST {u}/echo HTTP/1.1\r\nContent-Length: 2\r\n\r\nab".encode() + smuggled)
"""


async def test_malformed_and_smuggled_requests_are_refused(
    runtime: Runtime, upstream: Upstream, names: Names, isolation: str
) -> None:
    names.set("site.test", "127.0.0.1")
    async with provisioned(runtime, isolation, web=True) as agent:
        assert agent.sandbox is not None
        await agent.sandbox.put_file("raw.py", RAW.encode())
        res = await sh(agent, f"python3 raw.py {upstream.port}")
        lines = res.stdout.splitlines()
    assert lines[0].startswith("HTTP/1.1 400 Bad Request | send plain HTTP as an absolute-form")
    assert lines[1] == (
        "HTTP/1.1 411 Length Required | chunked request bodies are not supported; "
        "send Content-Length"
    )
    assert lines[2] == "HTTP/1.1 400 Bad Request | conflicting Content-Length headers"
    assert lines[3] == "HTTP/1.1 400 Bad Request | request head larger than 16384 bytes"
    assert lines[4] == "HTTP/1.1 400 Bad Request | not an HTTP/1.x request line"
    assert lines[5].startswith("HTTP/1.1 400 Bad Request | send plain HTTP as an absolute-form")
    assert lines[6] == (
        "HTTP/1.1 400 Bad Request | credentials in the url (user:password@) are not allowed"
    )
    # the body by its Content-Length, then the stream ends: the pipelined request never leaves
    assert lines[7].startswith("HTTP/1.1 200 OK")
    assert [(s.method, s.path, s.body) for s in upstream.seen] == [("POST", "/echo", b"ab")]
    assert names.lookups == {"site.test": 1}


LIMITS = r"""
import socket, sys, time
port = int(sys.argv[1])
def dial():
    s = socket.create_connection(("127.0.0.1", 3128))
    s.settimeout(5)
    return s
def closed(s):
    try:
        return s.recv(1) == b""
    except socket.timeout:
        return False
    except OSError:
        return True
# three connections at once, cap 2: the third is closed inside, unanswered
a, b, c = dial(), dial(), dial()
t = time.monotonic()
print("third closed", closed(c), round(time.monotonic() - t, 1) < 2)
# an idle tunnel is cut after the idle time
a.sendall(f"CONNECT site.test:{port} HTTP/1.1\r\n\r\n".encode())
print("tunnel", a.recv(100).split(b"\r\n")[0].decode())
t = time.monotonic()
print("idle cut", closed(a), 0.5 < time.monotonic() - t < 4)
b.close()
# bytes past the run's cap are never delivered
d = dial()
d.sendall(f"GET http://site.test:{port}/big HTTP/1.1\r\n\r\n".encode())
got = 0
while True:
    try:
        chunk = d.recv(65536)
    except OSError:
        break
    if not chunk:
        break
    got += len(chunk)
print("big got", got)
"""


async def test_stream_cap_idle_cut_and_byte_cap(
    runtime: Runtime, upstream: Upstream, names: Names, isolation: str
) -> None:
    names.set("site.test", "127.0.0.1")
    limited = Broker(
        runtime.settings.model_copy(
            update={
                "egress_max_streams": 2,
                "egress_idle_seconds": 1.0,
                "egress_max_bytes": 100_000,
            }
        )
    )
    async with provisioned(runtime, isolation, broker=limited, web=True) as agent:
        assert agent.sandbox is not None
        await agent.sandbox.put_file("limits.py", LIMITS.encode())
        res = await sh(agent, f"python3 limits.py {upstream.port}", timeout=60)
        lines = res.stdout.splitlines()
    assert lines[0] == "third closed True True", res
    assert lines[1] == "tunnel HTTP/1.1 200 Connection established"
    assert lines[2] == "idle cut True True"
    got = int(lines[3].removeprefix("big got "))
    assert got < 100_000 < BIG
    # Each stream's event is written when the host ends it; the idle cut reaches the guest
    # before its event is stored, so on a loaded host the GET's event may be stored first.
    events = [e.data for e in await events_of(agent, "web.requested")]
    assert sorted(r["method"] for r in events) == ["CONNECT", "GET"]
    requested = {r["method"]: r for r in events}
    assert requested["CONNECT"]["cut"] == "idle for 1 s"
    assert requested["GET"]["cut"] == "the run's egress byte cap (100000 bytes) is used up"
    assert requested["GET"]["bytes_in"] == got


async def test_zero_data_retention_keeps_only_sizes(
    runtime: Runtime, upstream: Upstream, names: Names, isolation: str
) -> None:
    names.set("site.test", "127.0.0.1")
    async with provisioned(runtime, isolation, web=True, zero_data_retention=True) as agent:
        ok = await sh(agent, f"curl -sS -m 10 http://site.test:{upstream.port}/text")
        assert ok.stdout == "hello from upstream"
        await sh(agent, "curl -sS -m 10 http://169.254.169.254/x")
    # A request's event is stored when the host ends its stream, which can be after curl has
    # exited and the next command's denial was stored (seen on a loaded host): match by type.
    events = await events_of(agent, "web.requested", "web.denied")
    assert sorted(e.type for e in events) == ["web.denied", "web.requested"]
    requested = next(e.data for e in events if e.type == "web.requested")
    denied = next(e.data for e in events if e.type == "web.denied")
    assert "host" not in requested and "path" not in requested
    assert requested["host_bytes"] == len("site.test") and requested["path_bytes"] == 5
    assert requested["bytes_in"] > 0 and requested["status"] == 200
    assert denied["host_bytes"] == len("169.254.169.254") and "host" not in denied


async def test_zero_data_retention_keeps_no_host_or_path_in_a_denial_reason(
    runtime: Runtime, upstream: Upstream, names: Names, isolation: str
) -> None:
    names.set("hidden-host-zdr.test", "127.0.0.1")
    grant = [{"name": "svc", "methods": ["GET"], "paths": ["/repos/*"]}]
    await add_connection(runtime, "svc", f"{upstream.base}/api", {"Authorization": CANARY})
    async with provisioned(
        runtime,
        isolation,
        web={"allow": ["allowed.test"]},
        connections=grant,
        zero_data_retention=True,
    ) as agent:
        web = await sh(agent, f"curl -sS -m 10 http://hidden-host-zdr.test:{upstream.port}/p")
        assert "'hidden-host-zdr.test' is not in the run's web allow list" in web.stdout
        conn = await sh(agent, "curl -sS -m 10 http://svc.connections.internal/hidden-path-zdr")
        assert "'/hidden-path-zdr' matches none of /repos/*" in conn.stdout
    denied = [e.data for e in await events_of(agent, "web.denied", "connection.denied")]
    assert [d["reason"] for d in denied] == [
        "host '…' is not in the run's web allow list",
        "path '…' matches none of /repos/*",
    ]
    for needle in (b"hidden-host-zdr", b"hidden-path-zdr"):
        assert state_bytes_contain(runtime.settings.state_dir, needle) == []
    assert upstream.seen == []
