"""Harbor ``download_dir``: the host-side writer of issue 35 against tarfile's filter (no asserts).

    PYTHONPATH=. .venv-harbor/bin/python -m bench.harbor_download [--isolation namespaces]

(as a module: bench/harbor.py would shadow the harbor package of a script run from bench/).

Run by the Harbor venv (Python 3.12). One sandbox; in it a directory of 200 files of 1 KiB and
one file of 20 MiB (random bytes, so gzip gains nothing). Per run, medians printed:

- ``fetch``: the sandbox's ``tar czf`` and the bytes to the host (the same before and after);
- ``unpack``: the host writing the archive: ``ephemeral.sandbox.hostwrite`` (now) against
  ``tarfile.extractall(filter=transfer_tar_filter)`` (before), on the same bytes;
- ``download_dir``: the whole call as Harbor makes it (fetch + our unpack).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

from harbor.environments.base import transfer_tar_filter
from harbor.models.task.config import EnvironmentConfig, NetworkPolicy
from harbor.models.trial.paths import TrialPaths

from ephemeral.harbor import EphemeralEnvironment
from ephemeral.harbor.environment import _unpack

SETUP = (
    "mkdir -p /data/small && for i in $(seq 200); do head -c 1024 /dev/urandom > "
    "/data/small/f$i; done && head -c 20971520 /dev/urandom > /data/big"
)


def _old_unpack(data: bytes, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(path=target, filter=transfer_tar_filter)


async def main(isolation: str, runs: int) -> None:
    d = Path(tempfile.mkdtemp())
    (d / "env").mkdir()
    env = EphemeralEnvironment(
        environment_dir=d / "env",
        environment_name="bench",
        session_id="bench__x__env",
        trial_paths=TrialPaths(d / "trial"),
        task_env_config=EnvironmentConfig(docker_image="debian:bookworm"),
        network_policy=NetworkPolicy(network_mode="no-network"),
        isolation=isolation,
        storage_mb=2048,
    )
    times: dict[str, list[float]] = {"fetch": [], "new": [], "old": [], "download_dir": []}
    await env.start(False)
    try:
        assert (await env.exec(SETUP, user="root")).return_code == 0
        for i in range(runs):
            t0 = time.perf_counter()
            data = await env._live().fetch("tar czf - --hard-dereference -C /data .", "/data")
            times["fetch"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await asyncio.to_thread(_unpack, data, d / f"new{i}")
            times["new"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await asyncio.to_thread(_old_unpack, data, d / f"old{i}")
            times["old"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await env.download_dir("/data", d / f"whole{i}")
            times["download_dir"].append(time.perf_counter() - t0)
    finally:
        await env.stop(True)
    print(f"{isolation}, {runs} runs, archive {len(data) / 2**20:.1f} MiB; medians (min-max) in ms")
    for k, v in times.items():
        lo, hi = 1000 * min(v), 1000 * max(v)
        print(f"  {k:13s} {1000 * statistics.median(v):8.1f}  ({lo:.1f}-{hi:.1f})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--isolation", default="namespaces")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    asyncio.run(main(args.isolation, args.runs))
