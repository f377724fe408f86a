"""Run by the Harbor venv's python (tests/harbor/test_storage.py): a task's ``storage_mb`` as
the session's ``disk_mib``, and the root a trial's sandbox gets from it, printed as JSON."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from harbor.models.task.config import EnvironmentConfig, NetworkPolicy
from harbor.models.trial.paths import TrialPaths

from ephemeral.harbor import EphemeralEnvironment, request


def env(storage_mb: int | None, isolation: str, **ek: Any) -> EphemeralEnvironment:
    d = Path(tempfile.mkdtemp())
    (d / "env").mkdir()
    return EphemeralEnvironment(
        environment_dir=d / "env",
        environment_name="probe",
        session_id="probe__x__disk",
        trial_paths=TrialPaths(d / "trial"),
        task_env_config=EnvironmentConfig(docker_image="debian:bookworm", storage_mb=storage_mb),
        network_policy=NetworkPolicy(network_mode="no-network"),
        isolation=isolation,
        **ek,
    )


async def main(isolation: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, storage, ek in [
        ("task", 2048, {}),
        ("unset", None, {}),
        ("past_job_max", 100_000, {}),
        ("tiny", 1, {}),
        ("job_max_raised", 20_000, {"max_storage_mb": 50_000}),
    ]:
        e = env(storage, isolation, **ek)
        limits = e._limits()
        asked = request.session_request(e.config, e.network_policy, "default", limits.disk_mib)
        out[name] = [limits.disk_mib, asked.disk_mib]
    trial = env(2048, isolation)
    await trial.start(False)
    try:
        r = await trial.exec("df -m --output=size / | tail -1")
        out["df_root_mib"] = int(r.stdout)
    finally:
        await trial.stop(True)
    past = env(20_000, isolation, max_storage_mb=50_000)  # past the host's disk_max_mib
    try:
        await past.start(False)
        out["past_host_cap"] = "started"
        await past.stop(True)
    except Exception as exc:
        out["past_host_cap"] = f"{type(exc).__name__}: {exc}"
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
