"""A Harbor task's ``storage_mb`` is its sandbox's ``disk_mib`` (issue 36, item 7): the job's
``max_storage_mb`` at most, the host's ``disk_max_mib`` refusing more (an environment error,
never a graded 0), and the trial's root as large as asked, on disk (tests/harbor/storage_probe.py
drives EphemeralEnvironment from Harbor's venv)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.harbor import tasks

pytestmark = pytest.mark.sandbox


def test_storage_mb_is_the_sandboxs_disk(tmp_path: Path, isolation: str) -> None:
    why = tasks.harbor_missing()
    if why is not None:
        pytest.skip(why)
    done = subprocess.run(
        [str(tasks.HARBOR_VENV / "bin" / "python"),
         str(Path(__file__).with_name("storage_probe.py")), isolation],
        env=tasks.harbor_env(tmp_path / "state"), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["task"] == [2048, 2048]
    assert seen["unset"] == [1024, 1024]  # the job's storage_mb when the task names none
    assert seen["past_job_max"] == [4096, 4096]  # the job's max_storage_mb
    assert seen["tiny"] == [16, 16]  # the least a request may ask
    assert seen["job_max_raised"] == [20_000, 20_000]
    assert 1900 < seen["df_root_mib"] <= 2048  # an ext4 of 2048 MiB, a little of it metadata
    assert "SandboxBuildFailedError" in seen["past_host_cap"], seen
    assert "disk_mib" in seen["past_host_cap"] and "10240" in seen["past_host_cap"], seen
    assert list((tmp_path / "state" / "sandboxes").glob("*.json")) == []
