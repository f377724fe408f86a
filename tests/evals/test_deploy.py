"""prefect.yaml deployed to a real Prefect server, run by a real process worker.

The harness starts ``prefect server start`` on 127.0.0.1 with its own PREFECT_HOME (the
pre-migrated template database copied in), creates the ``process`` pool, runs
``prefect --no-prompt deploy --all`` from the repository, triggers each deployment and waits for
the worker to run them to completion. Every process is killed by process group at teardown.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ephemeral.policy import RunRequest
from ephemeral.prefect_setup import ensure_template
from ephemeral.records import Records
from ephemeral.settings import Settings
from ephemeral.store import Store
from tests import runlevel
from tests.evals.prefect_server import PREFECT, REPO, PrefectServer
from tests.sample import SAMPLE_PROMPT

pytestmark = [pytest.mark.sandbox, pytest.mark.prefect, pytest.mark.slow]

POOL = "ephemeral-local"
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[PrefectServer]:
    srv = PrefectServer(tmp_path / "prefect", template=ensure_template(Settings.load()))
    try:
        yield srv.start()
    finally:
        srv.stop()


def wait_for_runs(server: PrefectServer, ids: dict[str, str], timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        states = {
            name: server.api("GET", f"/flow_runs/{fid}")["state"]["type"]
            for name, fid in ids.items()
        }
        if all(s in TERMINAL for s in states.values()):
            return states
        time.sleep(1)
    raise AssertionError(f"flow runs not finished after {timeout} s: {states}\n{server.tail()}")


async def test_deployments_run_on_a_process_worker(server: PrefectServer, tmp_path: Path) -> None:
    t0 = time.monotonic()
    state_dir = tmp_path / "state"
    settings = Settings.load(state_dir=state_dir, use_prefect=False)
    # The API (here: the test) admits the run and hands the worker nothing but its id.
    # Left queued for the deployment's worker: no leftover check here.
    async with runlevel.started(settings, check=False) as runtime:
        row, _ = await runtime.admit(
            await runtime.local_org(),
            RunRequest(prompt=SAMPLE_PROMPT, model="replay/sandbox-proof"),
        )

    server.prefect("work-pool", "create", POOL, "--type", "process")
    deployed = server.prefect("deploy", "--all", EPHEMERAL_PROJECT_DIR=str(REPO))
    t_deployed = time.monotonic()
    for name in ("agent-run", "recipe-run", "eval-suite-nightly"):
        assert name in deployed

    nightly = server.api("GET", "/deployments/name/eval-suite/eval-suite-nightly")
    [schedule] = nightly["schedules"]
    assert schedule["schedule"]["cron"] == "0 3 * * *" and schedule["active"] is True
    assert nightly["pull_steps"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}
    ]
    assert nightly["job_variables"]["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"

    triggers = {
        "agent-run/agent-run": {"run_id": row.id},
        "recipe-run/recipe-run": {},  # its default: the shipped sandbox-proof recipe
        "eval-suite/eval-suite-nightly": {},  # its default: the smoke suite
    }
    ids = {}
    for name, params in triggers.items():
        dep = server.api("GET", f"/deployments/name/{name}")
        ids[name] = server.api(
            "POST", f"/deployments/{dep['id']}/create_flow_run", json={"parameters": params}
        )["id"]
    server.spawn(
        "worker",
        *PREFECT,
        "worker",
        "start",
        "--pool",
        POOL,
        "--type",
        "process",
        EPHEMERAL_STATE_DIR=str(state_dir),
        EPHEMERAL_PROJECT_DIR=str(REPO),
        PREFECT_WORKER_QUERY_SECONDS="1",
        PREFECT_WORKER_PREFETCH_SECONDS="2",
    )
    states = wait_for_runs(server, ids, timeout=240)
    t_done = time.monotonic()
    assert states == dict.fromkeys(ids, "COMPLETED"), server.tail()

    store = await Store.open(settings.db_url)
    try:
        assert (await store.runs.get(row.id)).status == "succeeded"
    finally:
        await store.close()
    _, rows = Records(settings.records_dir).costs(by="recipe", since=None)
    runs_by_recipe = {key: n for key, n, *_ in rows}
    # agent-run's run has no recipe; recipe-run adds one sandbox-proof; the suite adds three.
    assert runs_by_recipe == {"(none)": 1, "sandbox-proof": 2, "exit-codes": 1, "file-roundtrip": 1}
    print(
        f"\ndeploy test: server+pool+deploy {t_deployed - t0:.1f} s, "
        f"trigger->3 flow runs completed {t_done - t_deployed:.1f} s"
    )
