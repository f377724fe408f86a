"""No stored credential reaches code in the sandbox, whatever the guest asks for (issue 18).

A property test through a real sandbox (namespaces, gvisor): Hypothesis draws batches of
requests to ``http://svc.connections.internal/…`` with arbitrary guest headers (compression,
``Range``, method override, forwarding headers, credentials of its own, random ones) against
an upstream that echoes the stored ``Authorization`` in every way it can (``servers.echo_site``:
raw, upper case, base64, hex, URL-encoded, JSON-escaped, in a response header; compressed on
request or regardless; sliced into 206 ranges; in 7-byte chunks). Code inside sends them over
raw sockets, decompresses every body it can and joins the bodies back together; none of it, nor
the events, the run page's rows, the logs, the state dir's files (SQLite WAL included) or the
Parquet records, holds the canary in any form.

Hypothesis runs in a worker thread (the sandbox lives on the test's event loop; each example
is one command in it), so the checks after the last example see the whole run.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ephemeral.agent.loop import AgentRun
from ephemeral.api import create_app
from ephemeral.api.pages import PAGE_COOKIE
from ephemeral.engine.runtime import Runtime
from ephemeral.records import Records
from tests.broker.conftest import CANARY, add_connection, events_of
from tests.broker.test_redact import leaks
from tests.egress.conftest import provisioned, sh
from tests.egress.servers import ECHO_FORMS, Echo, echo_site

pytestmark = [pytest.mark.sandbox]

STORED = {"Authorization": f"Bearer {CANARY}"}
GRANT = [{"name": "svc", "methods": ["GET"], "paths": ["/echo/*"]}]
EXAMPLES = 15

# Runs inside the sandbox: each request over a raw socket to the proxy, the whole answer kept,
# every body decompressed as far as it goes, and all bodies joined (ranges put back together).
GUEST = r"""
import base64, json, socket, zlib
out, bodies = [], []
for r in json.load(open("/tmp/reqs.json")):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    head = "GET http://svc.connections.internal%s HTTP/1.1\r\n" % r["path"]
    head += "Host: svc.connections.internal\r\n"
    head += "".join("%s: %s\r\n" % (k, v) for k, v in r["headers"])
    s.sendall((head + "\r\n").encode("latin-1"))
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    s.close()
    out.append(data)
    body = data.partition(b"\r\n\r\n")[2]
    bodies.append(body)
    for wbits in (31, 15, -15):
        try:
            out.append(zlib.decompress(body, wbits))
        except Exception:
            pass
joined = b"".join(bodies)
out.append(joined)
for wbits in (31, 15, -15):
    try:
        out.append(zlib.decompress(joined, wbits))
    except Exception:
        pass
for o in out:
    print(base64.b64encode(o).decode())
"""

_value = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(str.strip)
_range = st.tuples(st.integers(0, 400), st.integers(0, 60)).map(lambda t: f"{t[0]}-{t[0] + t[1]}")
HEADERS = st.one_of(
    st.tuples(
        st.just("Accept-Encoding"),
        st.sampled_from(
            ["gzip", "deflate", "gzip, deflate, br", "*", "gzip;q=1, identity;q=0", "x-gzip"]
        ),
    ),
    st.tuples(st.sampled_from(["Range", "range"]), _range.map(lambda r: f"bytes={r}")),
    st.tuples(st.just("If-Range"), st.sampled_from(['"etag"', "Mon, 01 Jan 2024 00:00:00 GMT"])),
    st.tuples(st.just("TE"), st.sampled_from(["gzip", "trailers, deflate"])),
    st.tuples(
        st.sampled_from(
            [
                "X-HTTP-Method-Override",
                "X-Method-Override",
                "X-Original-URL",
                "X-Rewrite-URL",
                "X-Forwarded-Host",
                "X-Forwarded-For",
                "Forwarded",
                "Authorization",
                "Cookie",
                "Accept",
                "User-Agent",
                "Content-Type",
                "Cache-Control",
                "Via",
            ]
        ),
        _value,
    ),
    st.tuples(st.from_regex(r"\AX-[A-Za-z0-9-]{1,20}\Z"), _value),
)
QUERY = st.fixed_dictionaries(
    {},
    optional={
        "form": st.sampled_from(ECHO_FORMS),
        "enc": st.sampled_from(["gzip", "deflate"]),
        "part": _range,
        "hdr": st.just("1"),
        "chunked": st.just("1"),
    },
)
REQUEST = st.fixed_dictionaries(
    {"query": QUERY, "headers": st.lists(HEADERS, max_size=6), "leaf": st.integers(0, 9)}
)
BATCH = st.lists(REQUEST, min_size=1, max_size=5)


def _as_guest(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in batch:
        query = "&".join(f"{k}={v}" for k, v in r["query"].items())
        out.append({"path": f"/echo/{r['leaf']}?{query}", "headers": r["headers"]})
    return out


def _run_examples(loop: asyncio.AbstractEventLoop, agent: AgentRun, received: list[bytes]) -> None:
    """Hypothesis, in this (worker) thread; each example runs on the test's loop."""
    assert agent.sandbox is not None
    sandbox = agent.sandbox

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(batch=BATCH)
    def example(batch: list[dict[str, Any]]) -> None:
        async def go() -> bytes:
            await sandbox.put_file("/tmp/reqs.json", json.dumps(_as_guest(batch)).encode())
            res = await sh(agent, "python3 /tmp/guest.py", timeout=60)
            assert res.exit_code == 0, res.stderr
            return b"\n".join(base64.b64decode(line) for line in res.stdout.split())

        got = asyncio.run_coroutine_threadsafe(go(), loop).result(timeout=120)
        received.append(got)
        assert b"HTTP/1.1" in got  # every request was answered
        assert not leaks(got, CANARY.encode()), got[:2000]

    example()


async def test_the_stored_credential_never_reaches_the_guest_in_any_form(
    runtime: Runtime, isolation: str, caplog: pytest.LogCaptureFixture
) -> None:
    received: list[bytes] = []
    with echo_site() as echo, caplog.at_level(logging.DEBUG):
        await add_connection(runtime, "svc", f"http://127.0.0.1:{echo.port}/api", STORED)
        async with provisioned(runtime, isolation, web=False, connections=GRANT) as agent:
            assert agent.sandbox is not None
            await agent.sandbox.put_file("/tmp/guest.py", GUEST.encode())
            loop = asyncio.get_running_loop()
            await asyncio.to_thread(_run_examples, loop, agent, received)
        _upstream_saw_only_allowed_headers(echo)
    assert len(received) >= EXAMPLES
    # the echo did carry the credential: what the guest got was redacted, not empty
    assert any(b"[redacted]" in r for r in received)

    needle = CANARY.encode()
    events = await runtime.store.events.list(agent.run_id)
    assert events and not leaks(json.dumps([e.data for e in events]).encode(), needle)
    requested = [e.data for e in await events_of(agent, "connection.requested")]
    assert requested and {r["status"] for r in requested} <= {200, 502}
    row = await runtime.store.runs.get(agent.run_id)
    assert not leaks(await _run_page(runtime, row.org_id, agent.run_id), needle)
    assert not leaks(caplog.text.encode(), needle)

    # the Parquet records (written at settle, as the service writes them)
    from ephemeral.engine.record import record_run

    await asyncio.to_thread(record_run, runtime.settings, row, events)
    recs = Records(runtime.settings.records_dir)
    for table in ("runs", "steps", "events"):
        _, rows = recs.query(f"select * from {table} where run_id = '{agent.run_id}'")
        if table != "steps":
            assert rows, table
        assert not leaks(json.dumps(rows, default=str).encode(), needle), table
    for path in runtime.settings.state_dir.rglob("*"):
        if path.is_file():
            assert not leaks(path.read_bytes(), needle), path  # SQLite, its WAL, the key file


async def _run_page(runtime: Runtime, org_id: str, run_id: str) -> bytes:
    """The run's page as its org's member reads it (the real app)."""
    _, key = await runtime.store.keys.create(org_id, "reader@local.test")
    app = create_app(runtime.settings, runtime)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        client.cookies.set(PAGE_COOKIE, key)
        page = await client.get(f"/runs/{run_id}")
    assert page.status_code == 200 and "connection.requested" in page.text, page.text[:500]
    return page.content


def _upstream_saw_only_allowed_headers(echo: Echo) -> None:
    from ephemeral.broker.egress import CONNECTION_REQUEST_HEADERS

    assert echo.seen
    allowed = CONNECTION_REQUEST_HEADERS | {
        "host",
        "authorization",
        "accept-encoding",
        "connection",
        "content-length",
    }
    for seen in echo.seen:
        names = {k.lower() for k in seen}
        assert names <= allowed, names - allowed
        assert seen["Accept-Encoding"] == "identity"
        assert seen["Authorization"] == STORED["Authorization"]
