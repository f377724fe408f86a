"""Prebuild benchmark: N Harbor tasks with Dockerfiles of their own, made by ``prebuild`` with
one worker, then N others with the host's worker count (prints figures, no asserts).

    PYTHONPATH=. .venv/bin/python bench/prebuild.py [--n 6]

The issue's figure of merit: the parallel wall time against the sum of the single builds
divided by the workers (1.0 is perfect use of them; the builds share the host's disk and the
shared package layer, so some serialisation is expected). Every Dockerfile is new (a random
marker), so each is really built; a second parallel pass shows what ``cached`` costs.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from ephemeral.recipes import prebuild
from ephemeral.settings import Settings

DOCKERFILE = "FROM debian:bookworm\nCOPY data.txt /opt/\nRUN echo {m} > /built && id\n"


def _dataset(root: Path, n: int) -> Path:
    for i in range(n):
        env = root / f"task-{i}" / "environment"
        env.mkdir(parents=True)
        (env.parent / "task.toml").write_text("[environment]\n")
        (env / "Dockerfile").write_text(DOCKERFILE.format(m=uuid.uuid4().hex))
        (env / "data.txt").write_text(f"{i}\n")
    return root


def _pass(settings: Settings, dataset: Path, jobs: int) -> tuple[float, list[prebuild.Outcome]]:
    found = prebuild.find(settings, [dataset])
    t0 = time.monotonic()
    out = asyncio.run(prebuild.ensure_all(settings, found, jobs=jobs))
    return time.monotonic() - t0, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=6)
    args = parser.parse_args()
    settings = Settings.load()
    workers = prebuild.workers(settings)
    root = Path(tempfile.mkdtemp(prefix="bench-prebuild-"))
    try:
        serial_wall, serial = _pass(settings, _dataset(root / "serial", args.n), 1)
        wall, parallel = _pass(settings, _dataset(root / "parallel", args.n), workers)
        cached_wall, cached = _pass(settings, root / "parallel", workers)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for name, outs in (("serial", serial), ("parallel", parallel), ("cached", cached)):
        statuses = sorted({o.status for o in outs})
        print(f"{name:<9} statuses {statuses}")
    singles = sum(o.seconds for o in serial)
    print(f"{args.n} builds, one worker: {serial_wall:.1f} s (sum of builds {singles:.1f} s)")
    print(f"{args.n} builds, {workers} workers: {wall:.1f} s")
    print(f"ratio wall / (sum / workers): {wall / (singles / workers):.2f}")
    print(f"{args.n} cached, {workers} workers: {cached_wall:.2f} s")


if __name__ == "__main__":
    main()
