"""Run by the Harbor venv's python (tests/harbor/test_hostile_files.py): a sandbox whose root
replaced ``tar`` with a script that prints the CVE-2025-4517 archive, then Harbor's three
directory downloads into the trial. Prints what it saw as JSON."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from harbor.models.task.config import EnvironmentConfig, NetworkPolicy
from harbor.models.trial.paths import TrialPaths

from ephemeral.harbor import EphemeralEnvironment
from tests.sandbox.hostile_tar import Member, archive, bad_entries, cve_2025_4517

# what the sandbox's root puts in place of tar: the hostile archive, on stdout or in the file
# Harbor's own helpers name (tar czf FILE ...)
EVIL_TAR = """#!/bin/sh
if [ "$2" = "-" ] || [ -z "$2" ]; then cat /opt/evil.tgz; else cat /opt/evil.tgz > "$2"; fi
"""


def _env(d: Path, env_dir: Path, isolation: str, name: str) -> EphemeralEnvironment:
    return EphemeralEnvironment(
        environment_dir=env_dir,
        environment_name=name,
        session_id=f"{name}__x__env",
        trial_paths=TrialPaths(d / "trial"),
        task_env_config=EnvironmentConfig(docker_image="debian:bookworm", workdir="/srv/app"),
        network_policy=NetworkPolicy(network_mode="no-network"),
        isolation=isolation,
    )


async def _outcome(call: Any) -> str:
    try:
        await call
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


async def downloads(d: Path, isolation: str) -> dict[str, object]:
    (d / "env").mkdir()
    trial = d / "trial"
    trial.mkdir()
    (trial / "flag").write_text("canary")
    # three targets of one length beside the canary: the same archive reaches it from each
    targets = {k: trial / k for k in ("plain", "excl0", "filtd")}
    (d / "evil.tgz").write_bytes(archive(cve_2025_4517(str(targets["plain"]))))
    (d / "dotdot.tgz").write_bytes(archive([Member("../dotdot", data=b"x", mode=0o755)]))
    env = _env(d, d / "env", isolation, "hostile")
    out: dict[str, object] = {}
    await env.start(False)
    try:
        await env.upload_file(d / "evil.tgz", "/opt/evil.tgz")
        await env.upload_file(d / "dotdot.tgz", "/opt/dotdot.tgz")
        (d / "tar.sh").write_text(EVIL_TAR)
        await env.upload_file(d / "tar.sh", "/opt/tar.sh")
        r = await env.exec(
            "mkdir -p /logs/agent && echo hi > /logs/agent/x.txt && "
            'install -m 755 /opt/tar.sh "$(command -v tar)" && tar czf - | cmp - /opt/evil.tgz',
            user="root",
        )
        out["tar_replaced"] = r.return_code == 0
        out["plain"] = await _outcome(env.download_dir("/logs/agent", targets["plain"]))
        out["excl0"] = await _outcome(
            env.download_dir_with_exclusions(
                source_dir="/logs/agent", target_dir=targets["excl0"], exclude=["*.log"]
            )
        )
        out["filtd"] = await _outcome(
            env.download_dir_filtered(
                source_dir="/logs/agent", target_dir=targets["filtd"], include=["**"]
            )
        )
        await env.exec("cp /opt/dotdot.tgz /opt/evil.tgz", user="root")
        out["dotdot"] = await _outcome(env.download_dir("/logs/agent", trial / "dots"))
    finally:
        await env.stop(True)
    out["flag"] = (trial / "flag").read_text()
    out["outside"] = sorted(p.name for p in trial.iterdir())
    out["bad"] = {k: bad_entries(t) for k, t in targets.items() if t.exists()}
    out["newfile"] = {k: (t / "escape" / "newfile").exists() for k, t in targets.items()}
    return out


async def main(isolation: str, part: str) -> dict[str, object]:
    d = Path(tempfile.mkdtemp())
    os.chmod(d, 0o755)
    return await {"downloads": downloads}[part](d, isolation)


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
