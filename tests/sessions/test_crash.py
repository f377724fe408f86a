"""kill -9 of the process serving a session: the next start reaps its sandbox and settles it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ephemeral.settings import Settings
from tests import runlevel
from tests.patience import PATIENCE
from tests.run.test_crash import _alive, _sandbox_pids

pytestmark = pytest.mark.sandbox
REPO = Path(__file__).resolve().parents[2]


async def test_kill_9_with_an_open_session_is_recovered(isolation: str, tmp_path: Path) -> None:
    settings = Settings.load(state_dir=tmp_path / "state", use_prefect=False)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.sessions.crash_child", str(settings.state_dir), isolation],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        session_id = line.strip()
        assert session_id.startswith("run_"), line
        pids = _sandbox_pids(settings)
        assert pids and any(_alive(p) for p in pids)
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    async with runlevel.started(settings) as runtime:  # recovery runs at start-up
        row = await runtime.sessions.get(session_id)
        events = [e.type for e in await runtime.store.events.list(session_id)]
        org = await runtime.store.orgs.get("local")
    assert (row.status, row.termination_reason) == ("failed", "infra_error")
    assert row.charged_micros + row.refunded_micros == row.reserved_micros
    assert events[-3:] == ["sandbox.destroyed", "run.failed", "run.settled"]
    assert org.reserved_micros == 0
    deadline = time.monotonic() + PATIENCE
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not any(_alive(p) for p in pids), "sandbox processes survived the reaper"
    assert not list(settings.sandboxes_dir.glob("*.json"))


async def test_kill_9_of_the_server_settles_its_sessions(isolation: str, tmp_path: Path) -> None:
    """The contract over HTTP: a session created through ``POST /v1/sandboxes`` of a real
    ``ephemeral serve`` that is then SIGKILLed is settled and reaped by the next start."""
    from tests.api.test_serve import _free_port, _reach, _serve

    settings = Settings.load(state_dir=tmp_path / "state", use_prefect=False)
    async with runlevel.started(settings) as runtime:
        org = await runtime.store.orgs.create("acme")
        await runtime.store.orgs.credit(org.id, 1_000_000, note="test")
        _, key = await runtime.store.keys.create(org.id, "me@acme.test")
    port = _free_port()
    with _serve(tmp_path, {}, "--port", str(port)) as proc:
        await asyncio.to_thread(_reach, proc, port, tmp_path / "serve.log")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            r = await http.post(
                "/v1/sandboxes",
                json={"isolation": isolation, "timeout_seconds": 300, "max_cost_micros": 50_000},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert r.status_code == 201, r.text
            session_id = r.json()["id"]
        pids = _sandbox_pids(settings)
        assert pids and any(_alive(p) for p in pids)
        proc.kill()
        proc.wait(10)

    async with runlevel.started(settings) as runtime:
        row = await runtime.sessions.get(session_id)
        acme = await runtime.store.orgs.get("acme")
    assert (row.status, row.termination_reason) == ("failed", "infra_error")
    assert row.charged_micros + row.refunded_micros == 50_000 and acme.reserved_micros == 0
    deadline = time.monotonic() + PATIENCE
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not any(_alive(p) for p in pids), "sandbox processes survived the reaper"
