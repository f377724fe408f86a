"""Prefect's own floor: what a no-op flow of a run's shape costs on the embedded server.

    .venv/bin/python bench/prefect_floor.py [--runs 40] [--clients 8,32] [--tasks 7]

The Prefect path of ``bench/throughput.py`` adds CPU to every run; this measures how much of
that Prefect itself needs, with nothing of ours in the flow. In a fresh state directory, Prefect
configured exactly as ``ephemeral serve`` configures it (``ephemeral.prefect_setup``: the
embedded server on SQLite from the pre-migrated template, events persister and triggers off, no
logs to the API, no results), one process runs ``--runs`` flow runs of a no-op flow with
``--tasks`` no-op async tasks each (an ``agent-run`` of the seed request is 7 task runs: load,
provision, three turns, teardown, settle) and the same options as ``agent-run`` and our tasks
(no cache, no persisted result, a local result path, one shared client with the executor's
transport: ``ephemeral.flows.prefect_client``), ``C`` at a time; ``--prefect-transport`` uses
Prefect's default transport instead (a 503 waits ``2 ** attempt`` seconds).

Prints, per client count: flow runs/s and CPU seconds per flow run of this process and of
Prefect's server (from /proc), the floor beside our ``serve + Prefect server - plain serve``
figure in ``bench/throughput.py``. Asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.served import prefect_server_pid, proc_cpu, self_cpu
from ephemeral.flows.prefect_client import RetryWhenBusy, retry_when_busy
from ephemeral.prefect_setup import configure
from ephemeral.settings import Settings


def prefect_server_cpu() -> float:
    """CPU seconds of the embedded Prefect server this process started (0 before it runs)."""
    pid = prefect_server_pid(os.getpid())
    return proc_cpu(pid)[0] if pid is not None else 0.0


def _retried(transport: RetryWhenBusy | None) -> int:
    return transport.retried if transport is not None else 0


async def main_async(args: argparse.Namespace) -> None:
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.context import AsyncClientContext, SyncClientContext
    from prefect.settings import get_current_settings

    @task(name="noop", cache_policy=NO_CACHE, persist_result=False, log_prints=False)
    async def noop(i: int) -> int:
        return i

    @flow(
        name="floor-run",
        flow_run_name="{run_id}",
        persist_result=False,
        result_storage=Path(get_current_settings().results.local_storage_path),
        log_prints=False,
    )
    async def floor_run(run_id: str) -> str:
        for i in range(args.tasks):
            await noop(i)
        return run_id

    # one client for every flow run, as FlowExecutor does
    ctx = AsyncClientContext()
    transport = None if args.prefect_transport else retry_when_busy(ctx.client)
    await ctx.client.__aenter__()
    sync = SyncClientContext()
    sync.client.__enter__()
    AsyncClientContext.__var__.set(ctx)
    SyncClientContext.__var__.set(sync)
    try:
        await floor_run("warm-up")  # starts the embedded server, warms caches
        await asyncio.sleep(2)
        for clients in args.clients:
            todo = iter(range(args.runs))

            async def worker(todo: Any = todo, label: str = f"floor-{clients}") -> None:
                for i in todo:
                    await floor_run(f"{label}-{i}")

            retried0 = _retried(transport)
            own0, server0, t0 = self_cpu(), prefect_server_cpu(), time.monotonic()
            await asyncio.gather(*(worker() for _ in range(clients)))
            wall = time.monotonic() - t0
            own, server = self_cpu() - own0, prefect_server_cpu() - server0
            print(
                f"prefect floor ({'prefect' if args.prefect_transport else 'our'} transport): "
                f"{args.tasks} no-op tasks a flow run, clients={clients}: "
                f"{args.runs / wall:.2f} flow runs/s  CPU-s per flow run: this process "
                f"{own / args.runs:.3f} + Prefect server {server / args.runs:.3f} = "
                f"{(own + server) / args.runs:.3f}  503s sent again: "
                f"{_retried(transport) - retried0}",
                flush=True,
            )
            await asyncio.sleep(2)
    finally:
        sync.client.__exit__(None, None, None)
        await ctx.client.__aexit__(None, None, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=40, help="flow runs per client count")
    ap.add_argument("--clients", default="8,32", help="flow runs at once, comma-separated")
    ap.add_argument("--tasks", type=int, default=7, help="no-op task runs per flow run")
    ap.add_argument(
        "--prefect-transport",
        action="store_true",
        help="Prefect's default transport, not the executor's (ephemeral.flows.prefect_client)",
    )
    args = ap.parse_args()
    args.clients = [int(x) for x in args.clients.split(",")]
    with tempfile.TemporaryDirectory(prefix="ephemeral-prefect-floor-") as state:
        configure(Settings.load(state_dir=Path(state)))
        asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
