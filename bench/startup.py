"""A start that talks, measured: the first line of a piped ``ephemeral run`` and a healthy serve.

    .venv/bin/python bench/startup.py [--n 3] [--what run,serve] [--pool 0]

- **run**: ``ephemeral run recipes/sandbox-proof.yaml`` piped (stdout and stderr to pipes, a
  fresh state dir each time): seconds to its first line on either stream (target ≤ 1 s), to
  the run's first timeline line, and to its exit. Beside it, the same with ``--no-prefect``.
- **serve**: ``ephemeral serve --pool N`` (a fresh state dir, a free loopback port): seconds to
  the first ``200`` of ``GET /healthz``, with the embedded Prefect server
  (``EPHEMERAL_EXECUTOR=flow``, the default) and without Prefect (``EPHEMERAL_EXECUTOR=plain``:
  the floor, the app and its runtime alone).

Each figure is the p50 (and min/max) of ``--n`` starts, one after another. Asserts nothing;
docs/deploy.md ("How long a start takes") says where the gap goes.
"""

from __future__ import annotations

import argparse
import os
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "ephemeral.cli"]


def _env(state: Path, executor: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "EPHEMERAL_STATE_DIR": str(state),
        "EPHEMERAL_EXECUTOR": executor,
        "EPHEMERAL_URL": "",
    }


def time_run(state: Path, no_prefect: bool) -> tuple[float, float, float]:
    """(first line, first timeline line, exit) in seconds of one piped run."""
    argv = [*CLI, "run", str(REPO / "recipes" / "sandbox-proof.yaml")]
    argv += ["--no-prefect"] if no_prefect else []
    start = time.monotonic()
    proc = subprocess.Popen(
        argv,
        env=_env(state, "flow"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = timeline = None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    streams = 2
    while streams:
        for key, _ in sel.select():
            line = key.fileobj.readline()  # type: ignore[union-attr]
            if not line:
                sel.unregister(key.fileobj)
                streams -= 1
                continue
            now = time.monotonic() - start
            first = now if first is None else first
            if timeline is None and line.startswith(b"  1. "):
                timeline = now
    code = proc.wait()
    if code != 0:
        raise SystemExit(f"ephemeral run exited {code}")
    return first or 0.0, timeline or 0.0, time.monotonic() - start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def time_serve(state: Path, executor: str, pool: int) -> float:
    """Seconds from the start of ``ephemeral serve`` to its first healthy ``/healthz``."""
    port = _free_port()
    start = time.monotonic()
    proc = subprocess.Popen(
        [*CLI, "serve", "--port", str(port), "--pool", str(pool)],
        env=_env(state, executor),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"ephemeral serve exited {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - start
            except OSError:
                pass
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _stats(xs: list[float]) -> str:
    return (
        f"p50 {statistics.median(xs):6.2f} s  (min {min(xs):.2f}, max {max(xs):.2f}, n {len(xs)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3)
    parser.add_argument("--what", default="run,serve")
    parser.add_argument("--pool", type=int, default=0)
    args = parser.parse_args()
    what = set(args.what.split(","))
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        root = Path(tmp)
        if "run" in what:
            for no_prefect in (False, True):
                rows = [time_run(root / f"run-{no_prefect}-{i}", no_prefect) for i in range(args.n)]
                label = "run --no-prefect" if no_prefect else "run (Prefect)"
                print(f"{label:18} first line      {_stats([r[0] for r in rows])}")
                print(f"{label:18} first event     {_stats([r[1] for r in rows])}")
                print(f"{label:18} exit            {_stats([r[2] for r in rows])}")
        if "serve" in what:
            for executor in ("flow", "plain"):
                xs = [
                    time_serve(root / f"serve-{executor}-{i}", executor, args.pool)
                    for i in range(args.n)
                ]
                label = "serve (Prefect)" if executor == "flow" else "serve plain (floor)"
                print(f"{label:20} healthy /healthz, pool {args.pool}  {_stats(xs)}")


if __name__ == "__main__":
    main()
