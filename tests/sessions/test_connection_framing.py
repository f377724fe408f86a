"""Issue 18 through a sandbox session: ``curl --compressed`` and ``Range`` pieces against an
upstream that echoes the stored credential do not get it out, through ``/exec`` as through a
run (the real app, a real sandbox, ``servers.echo_site``)."""

from __future__ import annotations

import json

import httpx
import pytest

from ephemeral.broker import Sealer
from ephemeral.engine.runtime import Runtime
from tests.api.conftest import Member
from tests.broker.conftest import CANARY
from tests.broker.test_redact import leaks
from tests.egress.conftest import broker_settings, runtime
from tests.egress.servers import echo_site
from tests.sessions.test_egress import _create, _end, _events, _exec

__all__ = ["broker_settings", "runtime"]  # the egress tests' runtime: 127.0.0.1 reachable

pytestmark = pytest.mark.sandbox

URL = "http://svc.connections.internal/echo"


async def test_compressed_and_ranged_echoes_of_the_secret_stay_outside(
    http: httpx.AsyncClient, runtime: Runtime, member: Member, isolation: str
) -> None:
    with echo_site() as echo:
        await runtime.store.connections.add(
            member.org_id,
            "svc",
            base_url=f"http://127.0.0.1:{echo.port}/api",
            header_names=["Authorization"],
            sealed_headers=Sealer.for_settings(runtime.settings).seal(
                {"Authorization": f"Bearer {CANARY}"}
            ),
        )
        grant = [{"name": "svc", "methods": ["GET"], "paths": ["/echo/*"]}]
        sid = await _create(http, member, isolation=isolation, connections=grant)
        gz = await _exec(http, member, sid, f"curl -sS -m 10 --compressed {URL}/a")
        assert gz["exit_code"] == 0, gz["stderr"]
        assert json.loads(gz["stdout"])["headers"]["Authorization"] == "[redacted]"
        pieces = await _exec(
            http,
            member,
            sid,
            "for i in $(seq 0 7 420); do "
            f"curl -sS -m 10 -r $i-$((i+6)) '{URL}/b'; curl -sS -m 10 '{URL}/c?part=$i-$((i+6))'; "
            "done",
            timeout_seconds=60,
        )
        forced = await _exec(http, member, sid, f"curl -sS -m 10 '{URL}/d?enc=gzip' | gzip -dc")
        ended = await _end(http, member, sid)
    for out in (gz, pieces, forced):
        assert not leaks((out["stdout"] + out["stderr"]).encode(), CANARY.encode())
    assert "the upstream sent a partial response" in pieces["stdout"]
    assert "not in gzip format" in forced["stderr"]  # the 502 text, not the gzip body
    assert all(s.get("Range") is None and s["Accept-Encoding"] == "identity" for s in echo.seen)
    events = await _events(runtime, sid, "connection.requested")
    assert {e["status"] for e in events} == {200, 502}
    assert ended["status"] == "succeeded"
