"""``inspect eval examples/inspect/task.py --sandbox ephemeral`` runs offline, end to end, and
its sessions are in ``ephemeral costs --by kind``; an eval cut short leaves no sandbox behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("inspect_ai", reason="the inspect extra is not installed")

from inspect_ai.log import read_eval_log

from ephemeral.inspect_provider import EphemeralSandboxConfig, EphemeralSandboxEnvironment
from ephemeral.settings import Settings
from tests import costs, runlevel

pytestmark = pytest.mark.sandbox
REPO = Path(__file__).resolve().parents[2]
INSPECT = Path(sys.executable).with_name("inspect")


def test_example_task_runs_offline_in_ephemeral_sandboxes(tmp_path: Path) -> None:
    state, logs = tmp_path / "state", tmp_path / "logs"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPHEMERAL_URL", "INSPECT_"))}
    env |= {"PYTHONPATH": str(REPO), "EPHEMERAL_STATE_DIR": str(state), "COLUMNS": "200"}
    done = subprocess.run(
        [str(INSPECT), "eval", "examples/inspect/task.py", "--sandbox", "ephemeral",
         "--log-dir", str(logs), "--display", "plain"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (log_file,) = logs.glob("*.eval")
    log = read_eval_log(str(log_file))
    assert log.status == "success" and log.results is not None
    assert log.results.scores[0].metrics["accuracy"].value == 1.0
    assert log.samples is not None and len(log.samples) == 3

    rows = costs.by_kind(env)
    assert rows["session"]["runs"] == 3 and rows["session"]["compute_micros"] > 0
    assert list((state / "sandboxes").glob("*.json")) == []
    # Each sample's session is labelled with its task and sample: spend per sample.
    per_sample = costs.grouped(env, "label:inspect_task,label:inspect_sample")
    assert {r["label:inspect_task"] for r in per_sample} == {log.eval.task}
    assert sorted(r["label:inspect_sample"] for r in per_sample) == sorted(
        str(s.id) for s in log.samples
    )


async def test_task_cleanup_ends_sessions_a_sample_left_open(
    tmp_path: Path, isolation: str
) -> None:
    mp = pytest.MonkeyPatch()
    mp.setenv("EPHEMERAL_STATE_DIR", str(tmp_path / "state"))
    mp.delenv("EPHEMERAL_URL", raising=False)
    config = EphemeralSandboxConfig(isolation=isolation, pool_size=0)
    try:
        await EphemeralSandboxEnvironment.task_init("cut", config)
        envs = await EphemeralSandboxEnvironment.sample_init("cut", config, {})
        sandbox = envs["default"].as_type(EphemeralSandboxEnvironment)
        assert (await sandbox.exec(["true"])).success
        # the sample never reaches sample_cleanup (an interrupted eval): task_cleanup ends it
        await EphemeralSandboxEnvironment.task_cleanup("cut", config, True)
    finally:
        mp.undo()
    settings = Settings.load(state_dir=tmp_path / "state", use_prefect=False)
    async with runlevel.started(settings, recover=False) as runtime:
        row = await runtime.sessions.get(sandbox.session_id)
    assert row.status == "succeeded" and row.settled
    assert list(settings.sandboxes_dir.glob("*.json")) == []
