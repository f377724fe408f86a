"""kill -9 of the process running a run: the next start reaps the sandbox and settles the run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from ephemeral.ids import new_run_id
from ephemeral.records import Records
from ephemeral.settings import Settings
from ephemeral.store import Store
from tests import runlevel
from tests.patience import PATIENCE
from tests.run.conftest import turn
from tests.store.storehelp import force_status, policy

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _sandbox_pids(settings: Settings) -> list[int]:
    """Every pid recorded in persisted sandbox handles (whatever the driver calls them)."""
    pids: list[int] = []

    def walk(value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                if isinstance(v, int) and "pid" in k:
                    pids.append(v)
                else:
                    walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    for handle in settings.sandboxes_dir.glob("*.json"):
        walk(json.loads(handle.read_text()))
    return pids


async def test_kill_9_mid_run_is_recovered(
    run_settings: Settings, make_cassette: Callable[..., str]
) -> None:
    model = make_cassette("crashy", [turn("sleep 1000"), turn(final="never")])
    env = {
        **os.environ,
        "EPHEMERAL_STATE_DIR": str(run_settings.state_dir),
        "EPHEMERAL_CASSETTES_DIR": str(run_settings.cassettes_dir),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ephemeral.cli",
            "run",
            "--prompt",
            "x",
            "--model",
            model,
            "--timeout",
            "300",
            "--no-prefect",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        # Wait until the run is inside its sleep step: the sandbox is up and persisted.
        deadline = time.monotonic() + PATIENCE
        run_id = None
        while time.monotonic() < deadline:
            store = await Store.open(run_settings.db_url)
            try:
                rows = await store.runs.open()
                if rows:
                    run_id = rows[0].id
                    if "worker.started" in [e.type for e in await store.events.list(run_id)]:
                        break
            finally:
                await store.close()
            await asyncio.sleep(0.2)
        assert run_id, "the run never started"
        await asyncio.sleep(0.5)
        sandbox_pids = _sandbox_pids(run_settings)
        assert sandbox_pids and any(_alive(p) for p in sandbox_pids)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    async with runlevel.started(run_settings) as runtime:  # recovery runs at start-up
        row = await runtime.store.runs.get(run_id)
        events = await runtime.store.events.list(run_id)
    assert row.status == "failed"
    assert row.termination_reason == "infra_error"
    assert row.charged_micros + row.refunded_micros == row.reserved_micros
    assert [e.type for e in events][-3:] == ["sandbox.destroyed", "run.failed", "run.settled"]
    deadline = time.monotonic() + PATIENCE
    while any(_alive(p) for p in sandbox_pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not any(_alive(p) for p in sandbox_pids), "sandbox processes survived the reaper"
    assert not list(run_settings.sandboxes_dir.glob("*.json"))
    org = await _org_reserved(run_settings)
    assert org == 0, "the reservation is still held"


async def _org_reserved(settings: Settings) -> int:
    store = await Store.open(settings.db_url)
    try:
        return (await store.orgs.get("local")).reserved_micros
    finally:
        await store.close()


# Where a run's process dies, and the status the run is left in before recovery.
BOUNDARIES = {
    "admitted": "queued",
    "provisioning": "provisioning",
    "sandbox.ready": "running",
    "model_step": "running",
    "tool_step": "running",
    "teardown": "running",
    "closed": "succeeded",
    "recorded": "succeeded",
}


async def test_kill_9_at_every_step_boundary_is_recovered(
    run_settings: Settings, make_cassette: Callable[..., str]
) -> None:
    """One run per boundary, each in a process that SIGKILLs itself there (crash_child.py)."""
    model = make_cassette("boundaries", [turn("echo hi"), turn(final="done")])
    children = {
        boundary: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.run.crash_child",
                boundary,
                str(run_settings.state_dir),
                str(run_settings.cassettes_dir),
                model,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for boundary in BOUNDARIES
    }
    for boundary, child in children.items():
        out, _ = child.communicate(timeout=90)
        assert child.returncode == -signal.SIGKILL, f"{boundary}: {out.decode()[-2000:]}"

    store = await Store.open(run_settings.db_url)
    try:
        page, _ = await store.runs.list((await store.orgs.get("local")).id)
        rows = {r.id: r for r in page}
        by_status = sorted(r.status for r in rows.values())
    finally:
        await store.close()
    assert by_status == sorted(BOUNDARIES.values())
    # Killed with their sandboxes up: the handles are left for the reaper (the sandbox itself may
    # already have gone with its parent's pipes; the existing test above covers a live one).
    sandbox_pids = _sandbox_pids(run_settings)
    assert len(list(run_settings.sandboxes_dir.glob("*.json"))) == 3, sandbox_pids

    async with runlevel.started(
        run_settings, watchdog=False
    ) as runtime:  # recovery runs at start-up
        for run_id in rows:
            # The whole point: nothing is left for Runtime.wait to poll on forever.
            row = await runtime.wait(run_id, timeout=PATIENCE)
            events = [e.type for e in await runtime.store.events.list(run_id)]
            assert row.settled and row.status in ("failed", "succeeded"), (row.status, events)
            assert row.charged_micros + row.refunded_micros == row.reserved_micros
            assert events[-1] == "run.settled" and events.count("run.settled") == 1, events
            assert events.count(f"run.{row.status}") == 1, events
            assert events.count("sandbox.destroyed") == events.count("sandbox.ready"), events
            charged = await runtime.store.money.charged(run_id)
            assert sum(charged.values()) == row.charged_micros
            # Recorded exactly once, also when the process died between close and record
            # ("closed") or between the record's files and its marker ("recorded").
            assert row.recorded_at is not None, run_id
            _, found = Records(run_settings.records_dir).query(
                f"SELECT count(*) FROM runs WHERE run_id = '{run_id}'"
            )
            assert found == [(1,)], (run_id, found)
        org = await runtime.store.orgs.get("local")
    assert org.reserved_micros == 0, "a reservation is still held"
    deadline = time.monotonic() + PATIENCE
    while any(_alive(p) for p in sandbox_pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not any(_alive(p) for p in sandbox_pids), "sandbox processes survived the reaper"
    assert not list(run_settings.sandboxes_dir.glob("*.json"))


async def test_recovery_settles_a_run_left_terminal_but_unsettled(run_settings: Settings) -> None:
    """An older version ended a run in several transactions; a crash could stop between them."""
    store = await Store.open(run_settings.db_url)
    try:
        org = await store.orgs.ensure("local", initial_credit_micros=1_000_000)
        row, _ = await store.runs.admit(
            org_id=org.id,
            run_id=new_run_id(),
            model="replay/x",
            prompt="p",
            policy=policy(10_000),
            owner=f"{socket.gethostname()}:1:0",  # pid 1 never started at tick 0: a dead owner
        )
        await store.money.charge(row.id, "model", 700, key=f"{row.id}:model:0")
        await force_status(store, row.id, "failed", "infra_error")
    finally:
        await store.close()

    async with runlevel.started(run_settings, watchdog=False) as runtime:
        done = await runtime.wait(row.id, timeout=PATIENCE)
        events = [e.type for e in await runtime.store.events.list(row.id)]
        org = await runtime.store.orgs.get("local")
    assert (done.status, done.termination_reason) == ("failed", "infra_error")
    assert (done.charged_micros, done.refunded_micros) == (700, 9_300)
    assert events == ["run.queued", "run.settled"]
    assert (org.reserved_micros, org.balance_micros) == (0, 1_000_000 - 700)
