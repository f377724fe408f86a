"""Scale-out: how fast Prefect hands a run to another process, and runs across workers.

    .venv/bin/python bench/scaleout.py --mechanisms [--n 20]

``--mechanisms`` chooses the dispatch mechanism (docs/deploy.md, "Scale-out"): one real
``prefect server start`` (SQLite, the pre-migrated template) and, in turn, (a) a ``process``
work-pool worker running flow runs of a deployment, and (b) a task worker
(``prefect.task_worker.serve``) running ``task.delay()`` submissions. Each body is a no-op that
writes the moment it starts; the figure is submit → body start, p50 / p99 over ``--n``
sequential submissions (sequential: the latency a lone run sees, not a queue).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.evals.prefect_server import PREFECT, PrefectServer  # noqa: E402


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _marks(path: Path) -> dict[int, float]:
    if not path.exists():
        return {}
    out: dict[int, float] = {}
    for line in path.read_text().splitlines():
        i, at = line.split()
        out[int(i)] = float(at)
    return out


async def _wait_mark(path: Path, i: int, timeout: float = 120) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = _marks(path).get(i)
        if got is not None:
            return got
        await asyncio.sleep(0.005)
    raise TimeoutError(f"submission {i} never started")


def mechanisms(n: int) -> None:
    from ephemeral.prefect_setup import ensure_template
    from ephemeral.settings import Settings

    with tempfile.TemporaryDirectory(prefix="scaleout-mech-") as tmp:
        root = Path(tmp)
        marks = root / "marks"
        srv = PrefectServer(root / "prefect", template=ensure_template(Settings.load()))
        env = {
            "SCALEOUT_MARKS": str(marks),
            "PREFECT_LOCAL_STORAGE_PATH": str(root / "storage"),
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PYTHONPATH": str(REPO),
        }
        os.environ.update(srv.env(**env))
        try:
            srv.start()
            # (a) deployment flow runs on a process pool
            srv.prefect("work-pool", "create", "bench", "--type", "process")
            deploy = (
                "from prefect import flow\n"
                f"flow.from_source(source={str(REPO)!r}, "
                "entrypoint='bench/scaleout_targets.py:noop_flow').deploy("
                "name='noop', work_pool_name='bench', build=False, push=False, "
                "print_next_steps=False)"
            )
            import subprocess

            subprocess.run([sys.executable, "-c", deploy], env=srv.env(**env), check=True)
            srv.spawn("pool-worker", *PREFECT, "worker", "start", "--pool", "bench", **env)
            flow_lat = asyncio.run(_flows(marks, n))
            # (b) a task worker
            srv.spawn(
                "task-worker",
                sys.executable,
                "-c",
                "from prefect.task_worker import serve\n"
                "from bench.scaleout_targets import noop_task\n"
                "serve(noop_task, limit=4)",
                **env,
            )
            task_lat = asyncio.run(_tasks(marks, n))
        finally:
            srv.stop()
    for name, lat in (("deployment on a process pool", flow_lat), ("task worker", task_lat)):
        print(
            f"{name:32s} submit -> body start  p50 {pct(lat, 0.5) * 1000:7.0f} ms  "
            f"p99 {pct(lat, 0.99) * 1000:7.0f} ms  mean {statistics.mean(lat) * 1000:7.0f} ms"
        )


async def _flows(marks: Path, n: int) -> list[float]:
    from prefect.deployments import run_deployment

    out = []
    for i in range(n):
        t0 = time.time()
        await run_deployment("scaleout-noop/noop", parameters={"i": i}, timeout=0)
        out.append(await _wait_mark(marks, i) - t0)
    return out


async def _tasks(marks: Path, n: int) -> list[float]:
    from bench.scaleout_targets import noop_task

    out = []
    await asyncio.sleep(2)  # the task worker subscribes
    for i in range(1000, 1000 + n):
        t0 = time.time()
        noop_task.delay(i)
        out.append(await _wait_mark(marks, i) - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mechanisms", action="store_true")
    ap.add_argument("--n", type=int, default=20)
    args = ap.parse_args()
    if args.mechanisms:
        mechanisms(args.n)


if __name__ == "__main__":
    main()
