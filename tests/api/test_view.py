"""``ephemeral view``: the viewer on 127.0.0.1 over the local state, signed in with a key made
for the session and revoked when it stops (issue 37, viewer)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ephemeral import errors
from ephemeral.settings import Settings
from ephemeral.store import Store

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


async def _authenticates(settings: Settings, key: str) -> bool:
    store = await Store.open(settings.db_url)
    try:
        await store.keys.authenticate(key)
        return True
    except errors.EphemeralError:
        return False
    finally:
        await store.close()


def test_view_serves_the_runs_list_and_revokes_its_key(tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPHEMERAL_URL", "PREFECT_"))}
    env |= {"EPHEMERAL_STATE_DIR": str(state), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ephemeral.cli", "view", "--no-browser"],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().split()[-1]
        key = proc.stdout.readline().split()[-1]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/runs")
        base = url.removesuffix("/runs")
        with httpx.Client(base_url=base, timeout=10) as http:
            for _ in range(600):  # until uvicorn listens
                try:
                    http.get("/healthz")
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            assert http.get("/runs").status_code == 303  # sign in first
            signed = http.post("/login", data={"api_key": key, "next": "/runs"})
            assert signed.status_code == 303, signed.text
            page = http.get("/runs")
            assert page.status_code == 200 and "No recorded runs match." in page.text
        settings = Settings.load(state_dir=state)
        assert asyncio.run(_authenticates(settings, key))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert not asyncio.run(_authenticates(settings, key)), "the session's key outlived view"
