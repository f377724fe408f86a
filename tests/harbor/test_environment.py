"""EphemeralEnvironment driven directly from Harbor's venv (tests/harbor/env_probe.py), the
calls Harbor's trial makes: exec's user, cwd, env and status, its timeout and a cancel (the
command is gone), uploads and downloads of files and directories, an idempotent stop."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests import costs
from tests.harbor import tasks

pytestmark = pytest.mark.sandbox


def test_the_environment_as_harbor_calls_it(tmp_path: Path, isolation: str) -> None:
    why = tasks.harbor_missing()
    if why is not None:
        pytest.skip(why)
    done = subprocess.run(
        [str(tasks.HARBOR_VENV / "bin" / "python"), str(Path(__file__).with_name("env_probe.py")),
         isolation],
        env=tasks.harbor_env(tmp_path / "state"), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # the task's workdir (made at start), root (Docker's default user), Harbor's env
    assert seen["default"] == ["/srv/app\nroot\nbar\n", 0]
    assert seen["uid"] == ["1000\n/tmp\n", 0]
    assert seen["status"] == ["out\n", "err\n", 7]
    assert seen["unknown_user"] == 126
    assert seen["timeout"] == "Command timed out after 1 seconds"
    assert seen["cancelled"] is True and seen["left"] == "0"
    assert seen["upload_dir"] == "root 644 a.txt\nroot 755 sub/run.sh\nran\n"
    assert seen["big_roundtrip"] is True
    assert seen["download_dir"] == ["a.txt", "sub", "sub/run.sh"]
    assert seen["exec_files"] < 3 * 16 + 3  # finished commands' files go in batches
    assert seen["stopped"] is True
    assert list((tmp_path / "state" / "sandboxes").glob("*.json")) == []
    # The session's spend is labelled with Harbor's task and trial (its directory's name).
    rows = costs.grouped(
        tasks.harbor_env(tmp_path / "state"), "label:harbor_task,label:harbor_trial"
    )
    assert [(r["label:harbor_task"], r["label:harbor_trial"], r["runs"]) for r in rows] == [
        ("probe", "trial", 1)
    ]
