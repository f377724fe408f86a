"""Soak: many runs at C concurrent clients through the public API of a real ``ephemeral serve``.

    .venv/bin/python bench/soak.py [--runs 500] [--levels 16,64] [--pool 2] [--slots 8]

One ``ephemeral serve`` subprocess (embedded Prefect on SQLite, replay model
``replay/sandbox-proof``, a fresh state directory, an org with credit and a key made through the
store as the admin CLI does). For each level, C clients each POST a run (honouring 429 +
``Retry-After``), poll it to its terminal status and ``run.settled``, then take the next. Prints,
per level: statuses, stuck runs (not settled within ``--stuck-after`` s; must be 0), runs charged
while queued (must be 0), p50/p99 of the queue wait (``created_at`` → ``started_at``, the slot
grant), of slot grant → ``worker.started`` and of end to end, runs/s, 429s seen; the server's
RSS, fds and threads before and after; and records = ledger (DuckDB over the Parquet records vs
the store's sums). Asserts nothing: the numbers are the output.

"Charged while queued": a run that never got a slot but was charged anything, or whose compute
charge exceeds what its sandbox could have accrued after the slot grant
(rate * ceil(ended_at - started_at) + 1 micro).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.served import SEED_BODY, at, make_key, pct, serve
from ephemeral.lifecycle import TERMINAL_STATUSES
from ephemeral.pricing import PriceBook
from ephemeral.sandbox.base import Limits
from ephemeral.settings import Settings
from ephemeral.store import Store

MAX_POST_ATTEMPTS = 200  # 429s are expected under load: the client waits Retry-After each time
BODY = SEED_BODY


@dataclass
class Outcome:
    run: dict[str, Any] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    e2e_s: float = 0.0
    throttled: int = 0
    error: str | None = None

    @property
    def settled(self) -> bool:
        return bool(self.events) and self.events[-1]["type"] == "run.settled"


async def one_run(
    client: httpx.AsyncClient, stuck_after: float, body: dict[str, Any] = BODY
) -> Outcome:
    out = Outcome()
    t0 = time.monotonic()
    key = f"soak-{uuid.uuid4().hex}"
    run = None
    for _ in range(MAX_POST_ATTEMPTS):
        try:
            r = await client.post("/v1/runs", json=body, headers={"Idempotency-Key": key})
        except httpx.TransportError as exc:
            out.error = f"POST: {type(exc).__name__}"
            await asyncio.sleep(0.5)
            continue
        if r.status_code in (409, 429, 502, 503):
            out.throttled += r.status_code == 429
            await asyncio.sleep(float(r.headers.get("retry-after", "1")))
            continue
        r.raise_for_status()
        run = r.json()
        break
    if run is None:
        out.error = out.error or "never admitted"
        return out
    deadline = time.monotonic() + stuck_after
    while time.monotonic() < deadline:
        try:
            run = (await client.get(f"/v1/runs/{run['id']}")).raise_for_status().json()
            if run["status"] in TERMINAL_STATUSES:
                out.events = (
                    (await client.get(f"/v1/runs/{run['id']}/events")).raise_for_status().json()
                )
                if out.settled:
                    break
        except httpx.HTTPError as exc:
            out.error = f"poll: {type(exc).__name__}"
        await asyncio.sleep(0.25)
    out.run, out.e2e_s = run, time.monotonic() - t0
    return out


async def drive(
    url: str, key: str, runs: int, concurrency: int, stuck_after: float = 600
) -> tuple[list[Outcome], float]:
    """``runs`` runs at ``concurrency`` clients; returns the outcomes and the wall time."""
    todo = iter(range(runs))
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=url,
        timeout=httpx.Timeout(60.0),
        limits=limits,
        headers={"Authorization": f"Bearer {key}"},
    ) as client:

        async def worker() -> None:
            for _ in todo:
                outcomes.append(await one_run(client, stuck_after))

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return outcomes, time.monotonic() - t0


def compute_rate(settings: Settings) -> int:
    limits = Limits()
    return PriceBook.load(settings).compute_micros(
        vcpu_seconds=limits.cpus, gib_seconds=limits.memory_mib / 1024
    )


def charged_while_queued(outcome: Outcome, rate: int) -> bool:
    run = outcome.run or {}
    cost = run.get("cost") or {}
    started, ended = at(run.get("started_at")), at(run.get("ended_at"))
    if started is None:
        return int(cost.get("charged_micros") or 0) > 0
    if ended is None:
        return False
    compute = int((cost.get("breakdown") or {}).get("compute_micros") or 0)
    return compute > rate * math.ceil((ended - started).total_seconds()) + 1


def analyse(outcomes: list[Outcome], rate: int) -> dict[str, Any]:
    statuses: dict[str, int] = {}
    queue_ms: list[float] = []
    first_step_ms: list[float] = []
    e2e_ms: list[float] = []
    stuck, queued_charged, unbalanced = [], [], []
    for o in outcomes:
        run = o.run or {}
        status = run.get("status", "never-admitted")
        statuses[status] = statuses.get(status, 0) + 1
        if not o.settled:
            stuck.append(run.get("id", "?"))
            continue
        cost = run["cost"]
        if cost["charged_micros"] + cost["refunded_micros"] != cost["reserved_micros"]:
            unbalanced.append(run["id"])
        if charged_while_queued(o, rate):
            queued_charged.append(run["id"])
        created, started = at(run["created_at"]), at(run.get("started_at"))
        if created and started:
            queue_ms.append((started - created).total_seconds() * 1000)
            worker = next((e for e in o.events if e["type"] == "worker.started"), None)
            if worker is not None:
                first_step_ms.append((at(worker["at"]) - started).total_seconds() * 1000)  # type: ignore[operator]
        e2e_ms.append(o.e2e_s * 1000)
    return {
        "statuses": statuses,
        "stuck": stuck,
        "charged_while_queued": queued_charged,
        "unbalanced": unbalanced,
        "queue_ms": queue_ms,
        "first_step_ms": first_step_ms,
        "e2e_ms": e2e_ms,
        "throttled": sum(o.throttled for o in outcomes),
        "errors": [o.error for o in outcomes if o.error],
    }


async def records_vs_ledger(settings: Settings) -> tuple[tuple[int, int], tuple[int, int]]:
    """(runs, charged) from the Parquet records via DuckDB, and from the store's ledger."""
    import duckdb

    glob = str(settings.records_dir / "v1" / "kind=runs" / "**" / "*.parquet")
    con = duckdb.connect()
    try:
        rec = con.execute(
            "SELECT count(*), coalesce(sum(charged_micros), 0) FROM "
            f"read_parquet('{glob}', hive_partitioning=true, union_by_name=true)"
        ).fetchone()
    finally:
        con.close()
    store = await Store.open(settings.db_url)
    try:
        rows = await store._runs_where()  # every run (the bench may look inside)
    finally:
        await store.close()
    ledger = (len(rows), sum(int(r.charged_micros or 0) for r in rows))
    assert rec is not None
    return (int(rec[0]), int(rec[1])), ledger


def report(level: int, stats: dict[str, Any], wall: float, n: int) -> None:
    def line(name: str, values: list[float]) -> str:
        return f"  {name:<28} p50={pct(values, 50):8.0f} ms  p99={pct(values, 99):8.0f} ms"

    print(f"== {n} runs at {level} concurrent clients: {wall:.1f} s, {n / wall:.2f} runs/s")
    print(f"  statuses {json.dumps(stats['statuses'], sort_keys=True)}")
    print(
        f"  stuck={len(stats['stuck'])}  charged_while_queued={len(stats['charged_while_queued'])}"
        f"  unbalanced={len(stats['unbalanced'])}  429s={stats['throttled']}"
        f"  client errors={len(stats['errors'])}"
    )
    if stats["errors"]:
        kinds: dict[str, int] = {}
        for e in stats["errors"]:
            kinds[e] = kinds.get(e, 0) + 1
        print(f"  client errors (retried): {kinds}")
    print(line("queue wait", stats["queue_ms"]))
    print(line("slot grant → worker.started", stats["first_step_ms"]))
    print(line("end to end (client)", stats["e2e_ms"]))


async def main_async(args: argparse.Namespace) -> None:
    state = Path(tempfile.mkdtemp(prefix="ephemeral-soak-"))
    settings = Settings.load(state_dir=state)
    key = await make_key(settings, org="soak")
    env = {"EPHEMERAL_MAX_CONCURRENT_RUNS": str(args.slots)}
    if args.max_queued is not None:
        env["EPHEMERAL_MAX_QUEUED_RUNS"] = str(args.max_queued)
    served = serve(state, pool=args.pool, env=env)
    rate = compute_rate(settings)
    try:
        async with httpx.AsyncClient(
            base_url=served.url, headers={"Authorization": f"Bearer {key}"}, timeout=120
        ) as client:
            warm = await one_run(client, 300)  # Prefect's first flow run pays its start-up
            print(f"warm-up run: {(warm.run or {}).get('status')} in {warm.e2e_s:.1f} s")
        print(f"server before: {served.stats()}")
        for level in args.levels:
            outcomes, wall = await drive(served.url, key, args.runs, level, args.stuck_after)
            report(level, analyse(outcomes, rate), wall, args.runs)
            print(f"  server after: {served.stats()}")
        rec, ledger = await records_vs_ledger(served.settings)
        verdict = "equal" if rec == ledger else "DIFFER"
        print(f"records (runs, charged µ$) = {rec}; ledger = {ledger}: {verdict}")
        fails = served.log.read_text(errors="replace").count("execution failed")
        print(f"server log: {fails} 'execution failed' lines; state dir {state}")
    finally:
        served.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=500, help="runs per concurrency level")
    ap.add_argument("--levels", default="16,64", help="concurrent clients, comma-separated")
    ap.add_argument("--pool", type=int, default=2)
    ap.add_argument("--slots", type=int, default=8, help="EPHEMERAL_MAX_CONCURRENT_RUNS")
    ap.add_argument("--max-queued", type=int, default=None, help="EPHEMERAL_MAX_QUEUED_RUNS")
    ap.add_argument("--stuck-after", type=float, default=600, help="s before a run is stuck")
    args = ap.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
