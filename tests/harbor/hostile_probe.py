"""Run by the Harbor venv's python (tests/harbor/test_hostile_files.py): a sandbox whose root
replaced ``tar`` with a script that prints the CVE-2025-4517 archive, then Harbor's three
directory downloads into the trial; and tasks whose ``environment/`` or a member is a link to a
host directory holding a 0600 key. Prints what it saw as JSON."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from harbor.models.task.config import EnvironmentConfig, NetworkPolicy
from harbor.models.trial.paths import TrialPaths

from ephemeral.harbor import EphemeralEnvironment
from tests.sandbox.hostile_tar import Member, archive, bad_entries, cve_2025_4517, snapshot

# what the sandbox's root puts in place of tar: the hostile archive, on stdout or in the file
# Harbor's own helpers name (tar czf FILE ...)
EVIL_TAR = """#!/bin/sh
if [ "$2" = "-" ] || [ -z "$2" ]; then cat /opt/evil.tgz; else cat /opt/evil.tgz > "$2"; fi
"""
KEY = "-----BEGIN OPENSSH PRIVATE KEY----- host key\n"


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


async def uploads(d: Path, isolation: str) -> dict[str, object]:
    host = d / "host-secret"
    host.mkdir()
    (host / "id_rsa").write_text(KEY)
    (host / "id_rsa").chmod(0o600)
    out: dict[str, object] = {}
    # 1. environment/ is a link to the host directory (a prebuilt image, no Dockerfile)
    task1 = d / "task1"
    task1.mkdir()
    (task1 / "environment").symlink_to(host)
    try:
        env = _env(task1, task1 / "environment", isolation, "linked")
    except ValueError as exc:
        out["linked_dir"] = f"refused: {exc}"
    else:
        await env.start(False)
        try:
            r = await env.exec("cat /srv/app/id_rsa", user="root")
            out["linked_dir"] = f"in the sandbox: {r.stdout!r}"
        finally:
            await env.stop(True)
    # 2. a real environment/ with a link member; tests/ with a linked directory; a linked file
    task2 = d / "task2"
    (task2 / "environment").mkdir(parents=True)
    (task2 / "environment" / "ok.txt").write_text("ok")
    (task2 / "environment" / "id_rsa").symlink_to(host / "id_rsa")
    (task2 / "tests").mkdir()
    (task2 / "tests" / "data").symlink_to(host)
    (task2 / "solution").mkdir()
    (task2 / "solution" / "solve.sh").symlink_to(host / "id_rsa")
    env = _env(task2, task2 / "environment", isolation, "member")
    out["member"] = await _outcome(env.start(False))
    try:
        r = await env.exec("ls -A /srv/app; cat /srv/app/id_rsa 2>&1", user="root")
        out["member_sandbox"] = r.stdout
        out["tests"] = await _outcome(env.upload_dir(task2 / "tests", "/tests"))
        out["solve"] = await _outcome(env.upload_file(task2 / "solution" / "solve.sh", "/s.sh"))
        r = await env.exec("cat /tests/data/id_rsa /s.sh 2>&1; true", user="root")
        out["after"] = r.stdout
    finally:
        await env.stop(True)
    return out


async def names(d: Path, isolation: str) -> dict[str, object]:
    """Two tasks of one name whose environments differ only in .git: two images."""
    out: dict[str, object] = {}
    for which in ("one", "two"):
        env_dir = d / which / "environment"
        (env_dir / ".git").mkdir(parents=True)
        (env_dir / ".git" / "HEAD").write_text(f"ref: {which}\n")
        (env_dir / "Dockerfile").write_text("FROM debian:bookworm-slim\nCOPY . /ctx/\n")
        env = EphemeralEnvironment(
            environment_dir=env_dir,
            environment_name="same-name",
            session_id=f"{which}__x__env",
            trial_paths=TrialPaths(d / which / "trial"),
            task_env_config=EnvironmentConfig(),
            network_policy=NetworkPolicy(network_mode="no-network"),
            isolation=isolation,
        )
        await env.start(False)
        try:
            r = await env.exec("cat /ctx/.git/HEAD", user="root")
            assert env._image is not None
            out[which] = [env.environment_id, env._image.name, env._image.hash, r.stdout]
        finally:
            await env.stop(True)
    return out


async def host_writers(d: Path, isolation: str) -> dict[str, object]:
    """Harbor's host-side writers themselves, on this Python (3.12.1: the filter the CVE
    bypasses): each hostile archive through ``_unpack``, and ``_write_file`` over a link."""
    from ephemeral.harbor.environment import _unpack, _write_file

    (d / "canary").write_text("canary")
    (d / "t").mkdir()  # the target's parent, as a trial's directory is
    cases = {
        "cve": cve_2025_4517(str(d / "t" / "target")),
        "dotdot": [Member("../canary", data=b"x")],
        "absolute": [Member(str(d / "canary"), data=b"x")],
        "links": [
            Member("out", "symlink", link="../../canary"),
            Member("hard", "hardlink", link="../../canary"),
            Member("out/x", data=b"x"),
        ],
        "devices": [Member("null", "chr"), Member("pipe", "fifo"), Member("f", data=b"ok")],
        "file_then_dir": [Member("f", data=b"x"), Member("f/g", data=b"y")],
        "setuid": [Member("s", data=b"x", mode=0o6777)],
    }
    out: dict[str, object] = {}
    for name, members in cases.items():
        target = d / "t" / "target"
        target.mkdir()
        before = snapshot(d, skip=target)
        try:
            report = _unpack(archive(members), target)
            result = f"ok, skipped {len(report.skipped)}"
        except Exception as exc:
            result = f"{type(exc).__name__}: {exc}"[:200]
        out[name] = [result, snapshot(d, skip=target) == before, bad_entries(target)]
        shutil.rmtree(target)
    (d / "link").symlink_to(d / "canary")
    _write_file(d / "link", b"downloaded")
    out["write_file"] = [(d / "canary").read_text(), (d / "link").is_symlink()]
    return out


async def main(isolation: str, part: str) -> dict[str, object]:
    d = Path(tempfile.mkdtemp())
    os.chmod(d, 0o755)
    parts = {"downloads": downloads, "uploads": uploads, "names": names, "host": host_writers}
    return await parts[part](d, isolation)


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
