"""What can be tested of the multi-host set-up on one box (docs/deploy.md, "Scale-out").

A real ``prefect server start`` on a fresh PostgreSQL 15 database (the harness's cluster), the
per-host global concurrency limit with ``strict=True``, and the heartbeat automation exactly as
documented in ``docs/deploy.md``.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.evals.prefect_server import PREFECT, REPO, PrefectServer

pytestmark = [pytest.mark.prefect, pytest.mark.postgres, pytest.mark.slow]

CLIENT = r"""
import json, threading, time
from prefect import flow
from prefect.concurrency.sync import concurrency

active = peak = 0
lock = threading.Lock()

def hold():
    global active, peak
    with concurrency("microvm:host-a", occupy=1, strict=True, timeout_seconds=60):
        with lock:
            active += 1
            peak = max(peak, active)
        time.sleep(0.3)
        with lock:
            active -= 1

threads = [threading.Thread(target=hold) for _ in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join()

def try_missing(strict):
    try:
        with concurrency("microvm:no-such-host", occupy=1, strict=strict, timeout_seconds=5):
            return "ran unlimited"
    except Exception as exc:
        return type(exc).__name__

@flow(name="pg-hello")
def hello():
    return 42

state = hello(return_state=True)
print(json.dumps({"peak": peak, "strict": try_missing(True), "lax": try_missing(False),
                  "flow": state.type.value}))
"""


def documented_automation() -> dict:
    text = (REPO / "docs" / "deploy.md").read_text()
    blocks = re.findall(r"```json\n(.*?)```", text, flags=re.S)
    [block] = [b for b in blocks if "crash-zombie-flows" in b]
    return json.loads(re.sub(r"^ {3}", "", block, flags=re.M))


@pytest.fixture
def pg_server(tmp_path: Path, postgres_db_url: str) -> Iterator[PrefectServer]:
    srv = PrefectServer(tmp_path / "prefect", database_url=postgres_db_url)
    try:
        yield srv.start(timeout=240)  # migrations on an empty database
    finally:
        srv.stop()


def test_prefect_server_on_postgres_with_strict_limits_and_zombie_automation(
    pg_server: PrefectServer,
) -> None:
    health = pg_server.api("GET", "/admin/version")
    assert health
    pg_server.prefect("gcl", "create", "microvm:host-a", "--limit", "1")

    automation = pg_server.api("POST", "/automations/", json=documented_automation())
    listed = pg_server.api("POST", "/automations/filter", json={})
    [stored] = [a for a in listed if a["id"] == automation["id"]]
    assert stored["trigger"]["posture"] == "Proactive"
    assert stored["trigger"]["within"] == 90
    assert stored["actions"][0]["type"] == "change-flow-run-state"

    res = subprocess.run(
        [*PREFECT[:1], "-c", CLIENT],
        cwd=REPO,
        env=pg_server.env(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["peak"] == 1  # three holders, limit 1: never two at once
    assert out["strict"] == "ConcurrencySlotAcquisitionError"
    assert out["lax"] == "ran unlimited"  # why docs/deploy.md insists on strict=True
    assert out["flow"] == "COMPLETED"
    runs = pg_server.api("POST", "/flow_runs/filter", json={})
    assert [r["state_type"] for r in runs] == ["COMPLETED"]
