"""Run by the Harbor venv's python (tests/harbor/test_environment.py): drives one
EphemeralEnvironment directly, as Harbor's trial does, and prints what it saw as JSON."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from harbor.models.task.config import EnvironmentConfig, NetworkPolicy
from harbor.models.trial.paths import TrialPaths

from ephemeral.harbor import EphemeralEnvironment


async def main(isolation: str) -> dict[str, object]:
    d = Path(tempfile.mkdtemp())
    (d / "env").mkdir()
    env = EphemeralEnvironment(
        environment_dir=d / "env",
        environment_name="probe",
        session_id="probe__x__env",
        trial_paths=TrialPaths(d / "trial"),
        task_env_config=EnvironmentConfig(docker_image="debian:bookworm", workdir="/srv/app"),
        network_policy=NetworkPolicy(network_mode="no-network"),
        isolation=isolation,
    )
    out: dict[str, object] = {}
    await env.start(False)
    try:
        r = await env.exec("pwd; id -un; echo $FOO", env={"FOO": "bar"})
        out["default"] = [r.stdout, r.return_code]
        r = await env.exec("id -u; pwd", user=1000, cwd="/tmp")
        out["uid"] = [r.stdout, r.return_code]
        r = await env.exec("echo out; echo err >&2; exit 7")
        out["status"] = [r.stdout, r.stderr, r.return_code]
        r = await env.exec("true", user="nobody-here")
        out["unknown_user"] = r.return_code
        try:
            await env.exec("sleep 300", timeout_sec=1)
            out["timeout"] = "returned"
        except RuntimeError as exc:
            out["timeout"] = str(exc)
        task = asyncio.create_task(env.exec("sleep 301"))
        seen = time.monotonic() + 60
        while (await env.exec("pgrep -c -x sleep || true")).stdout.strip() != "1":
            assert time.monotonic() < seen, "sleep 301 never started"
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            out["cancelled"] = True
        # live ones only: a killed command's zombie waits for the sandbox's init to reap it
        r = await env.exec("pgrep -c -x -r D,R,S,T sleep || true")
        out["left"] = r.stdout.strip()
        src = d / "up"
        (src / "sub").mkdir(parents=True)
        (src / "a.txt").write_text("A")
        (src / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
        (src / "sub" / "run.sh").chmod(0o755)
        await env.upload_dir(src, "/srv/dst")
        r = await env.exec("stat -c '%U %a %n' a.txt sub/run.sh && sub/run.sh", cwd="/srv/dst")
        out["upload_dir"] = r.stdout
        big = bytes(range(256)) * (5 << 12)  # 5 MiB: past the inline download size
        (d / "big").write_bytes(big)
        await env.upload_file(d / "big", "/srv/new/dir/big.bin")
        await env.download_file("/srv/new/dir/big.bin", d / "back.bin")
        out["big_roundtrip"] = (d / "back.bin").read_bytes() == big
        await env.download_dir("/srv/dst", d / "down")
        out["download_dir"] = sorted(
            str(p.relative_to(d / "down")) for p in (d / "down").rglob("*")
        )
        r = await env.exec("ls -A /tmp | grep -c '^.ephemeral-exec-' || true")
        out["exec_files"] = int(r.stdout.strip() or 0)
    finally:
        await env.stop(True)
        await env.stop(True)  # idempotent
    out["stopped"] = True
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
