"""Harbor benchmark: trial wall time through ``ephemeral.harbor:EphemeralEnvironment`` (no asserts).

    .venv/bin/python bench/harbor.py [--isolation gvisor] [--attempts 3]

The tasks of tests/harbor (toolbox, fixbug, hidden), run by Harbor's ``oracle`` agent with the
real ``harbor`` command of ``.venv-harbor``:

1. image uncached: each task's image not built yet (a fresh file in its build context; the
   Debian package layer, shared by every Dockerfile of the same apt list, stays cached), -n 1;
2. image cached, -n 1 and -n 8 (``-k ATTEMPTS`` trials of each task).

Per phase, from each trial's result.json: environment start (build + sandbox + Harbor's dirs),
agent (solve.sh and its uploads), verifier (tests upload, test.sh, downloads), trial total;
median and max over the trials. The floor, measured in the same run: one session of the same
image started, one ``true`` exec'd and ended, in process (what a trial cannot go under).

Harbor's own ``docker`` environment is not measured: it runs ``docker compose`` (Compose v2),
which Debian bookworm does not package (``docker.io`` 20.10 and the v1 ``docker-compose`` only),
and no Docker daemon runs on this machine (see the closing note it prints).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harbor import tasks
from tests.harbor.tasks import Trial, run_harbor, trials

PHASES = ("environment_setup", "agent_execution", "verifier")


def _seconds(block: object) -> float | None:
    if not isinstance(block, dict) or not block.get("started_at") or not block.get("finished_at"):
        return None
    start = datetime.fromisoformat(str(block["started_at"]).replace("Z", "+00:00"))
    end = datetime.fromisoformat(str(block["finished_at"]).replace("Z", "+00:00"))
    return (end - start).total_seconds()


def _row(label: str, found: list[Trial], wall: float) -> str:
    cells = [label, str(len(found)), f"{sum(t.reward == 1.0 for t in found)}"]
    for phase in (*PHASES, None):
        xs = [
            s
            for t in found
            if (s := _seconds(t.result if phase is None else t.result.get(phase))) is not None
        ]
        cells.append(f"{statistics.median(xs):.1f} / {max(xs):.1f}" if xs else "-")
    cells.append(f"{wall:.1f}")
    return "| " + " | ".join(cells) + " |"


async def _floor(state: Path, isolation: str, image: str) -> float:
    from ephemeral.engine.runtime import Runtime
    from ephemeral.sandbox.base import Limits
    from ephemeral.sessions.requests import ExecRequest, SessionRequest
    from ephemeral.settings import Settings

    runtime = await Runtime.start(Settings.load(state_dir=state, pool_size=0), warm_pool=False)
    try:
        org = await runtime.local_org()
        t0 = time.monotonic()
        row, _ = await runtime.sessions.create(
            org,
            SessionRequest(isolation=isolation, image=image, timeout_seconds=120),  # type: ignore[arg-type]
            limits=Limits(cpus=1, memory_mib=1024, pids=1024, disk_mib=1024),
        )
        await runtime.sessions.exec(row.id, org, ExecRequest(command=["true"], user="root"))
        await runtime.sessions.end(row.id, org)
        return time.monotonic() - t0
    finally:
        await runtime.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--isolation", default="gvisor")
    ap.add_argument("--attempts", type=int, default=3, help="trials per task at -n 8")
    args = ap.parse_args()
    why = tasks.harbor_missing()
    if why is not None:
        sys.exit(f"bench/harbor.py: {why}")
    work = Path(tempfile.mkdtemp(prefix="bench-harbor-"))
    try:
        root, state, jobs = work / "tasks", work / "state", work / "jobs"
        for write in (tasks.toolbox, tasks.fixbug, tasks.hidden):
            write(root)
            (root / write.__name__ / "environment" / "nonce.txt").write_text(secrets.token_hex(8))
        ek = {"isolation": args.isolation}
        print(f"Harbor trials on {args.isolation}, oracle agent, tasks toolbox/fixbug/hidden")
        print("| run | trials | reward 1.0 | env start s (p50 / max) | agent s | verifier s "
              "| trial s | job wall s |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        runs = [
            ("uncached, -n 1", 1, 1, "uncached"),
            ("cached, -n 1", 1, 1, "n1"),
            (f"cached, -n 8 (-k {args.attempts})", 8, args.attempts, "n8"),
        ]
        for label, n, k, job in runs:
            t0 = time.monotonic()
            done = run_harbor(root, jobs, state, agents=["oracle"], ek=ek, n=n, job=job,
                              timeout=3600, extra=["-k", str(k)])  # fmt: skip
            wall = time.monotonic() - t0
            if done.returncode != 0:
                sys.exit(done.stdout[-2000:] + done.stderr[-2000:])
            print(_row(label, trials(jobs, job), wall), flush=True)
        floors = [asyncio.run(_floor(state, args.isolation, "default")) for _ in range(3)]
        print(f"\nfloor (same run): session start + exec true + end, default image: "
              f"{statistics.median(floors):.2f} s (median of 3)")  # fmt: skip
        print(
            "\nDocker: not measured. Harbor's docker environment runs `docker compose` (Compose "
            "v2); Debian bookworm packages docker.io 20.10 and docker-compose 1.29 (v1) only "
            "(no docker-compose-plugin), the docker CLI here has no compose plugin (`docker "
            "compose`: unknown command) and no daemon runs (no /var/run/docker.sock)."
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
