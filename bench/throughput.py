"""Throughput through the public API: runs/s and CPU seconds per run, plain steps vs Prefect.

    .venv/bin/python bench/throughput.py [--runs 40] [--clients 8,32] [--levels namespaces,gvisor]
                                         [--executors plain,prefect] [--slots 8] [--pool 2]

For each isolation level, executor and slot count: one ``ephemeral serve`` subprocess on a
loopback port (fresh state directory, ``EPHEMERAL_EXECUTOR=plain`` for ``plain``, the default
embedded Prefect for ``prefect``; ``EPHEMERAL_ISOLATION`` and the request's ``isolation`` both
the level; ``EPHEMERAL_MAX_CONCURRENT_RUNS`` the slots). After one warm-up run, for each client
count C: ``--runs`` runs of the seed-shaped request (replay model ``replay/sandbox-proof``: 3
model calls, 4 shell commands), C clients each POSTing a run and following its SSE stream to
``run.settled``, then the next. Prints runs/s and CPU seconds per run from /proc: the machine
(every process), ``serve`` itself, Prefect's embedded server, the sandboxes (``serve``'s reaped
children) and this bench client; and accepted (``created_at``) → ``worker.started``.

The floor beside every machine figure is the box's background load, measured for 3 s before
each ``serve`` starts (other work shares these 2 cores); ``machine - floor`` is what the runs
cost. The summary puts Prefect beside plain (the floor of the Prefect path) from the same
sitting: the ratio of runs/s and the CPU-s per run Prefect adds. Asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.served import (
    SEED_BODY,
    at,
    background_cpu,
    event_at,
    follow,
    make_key,
    pct,
    post_run,
    serve,
)
from ephemeral.lifecycle import TERMINAL_STATUSES
from ephemeral.settings import Settings


@dataclass
class Row:
    level: str
    executor: str
    slots: int
    clients: int
    runs: int
    wall: float
    ok: int
    statuses: dict[str, int]
    cpu: dict[str, float]
    floor: float  # the machine's background CPU-s per second
    first_step_ms: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.runs / self.wall

    def per_run(self, key: str) -> float:
        return self.cpu[key] / self.runs

    @property
    def machine_net(self) -> float:
        """Machine CPU-s per run less the background the box had before serve started."""
        return (self.cpu["machine"] - self.floor * self.wall) / self.runs


async def get_json(client: httpx.AsyncClient, path: str, attempts: int = 5) -> Any:
    """A GET, tried again after a dropped connection: a keep-alive connection the server closed
    just as this client reused it ends in ``RemoteProtocolError`` (seen under load), and one
    such drop must not end the whole bench."""
    for attempt in range(attempts):
        try:
            return (await client.get(path)).json()
        except httpx.TransportError:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(0.5)
    return None


async def one(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[str, float | None]:
    run, _ = await post_run(client, body, f"tp-{uuid.uuid4().hex}")
    if run is None:
        return "never-admitted", None
    events = await follow(client, run["id"])
    final = await get_json(client, f"/v1/runs/{run['id']}")
    status = final.get("status", "?")
    if status not in TERMINAL_STATUSES or not events or events[-1]["type"] != "run.settled":
        status = f"stuck:{status}"
    started, created = event_at(events, "worker.started"), at(run["created_at"])
    first = (started - created).total_seconds() * 1000 if started and created else None
    return status, first


async def drive(url: str, key: str, body: dict[str, Any], runs: int, clients: int) -> list[Any]:
    todo = iter(range(runs))
    out: list[tuple[str, float | None]] = []
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients * 2)
    async with httpx.AsyncClient(
        base_url=url, timeout=120, limits=limits, headers={"Authorization": f"Bearer {key}"}
    ) as client:

        async def worker() -> None:
            for _ in todo:
                out.append(await one(client, body))

        await asyncio.gather(*(worker() for _ in range(clients)))
    return out


async def config(
    args: argparse.Namespace, level: str, executor: str, slots: int, prefect_db: str = "sqlite"
) -> list[Row]:
    state = Path(tempfile.mkdtemp(prefix=f"ephemeral-tp-{level}-{executor}-"))
    key = await make_key(Settings.load(state_dir=state))
    floor = await asyncio.to_thread(background_cpu, 3.0)
    env = {
        "EPHEMERAL_EXECUTOR": "flow" if executor == "prefect" else "plain",
        "EPHEMERAL_ISOLATION": level,
        "EPHEMERAL_MAX_CONCURRENT_RUNS": str(slots),
        "EPHEMERAL_MAX_QUEUED_RUNS": str(max(args.clients) * 2),
    }
    if executor == "prefect" and prefect_db == "postgres":
        # Prefect's own server on a fresh PostgreSQL database (its first start migrates it)
        env["EPHEMERAL_PREFECT_DATABASE_URL"] = args.pg.url(args.pg.create_database(f"p{slots}"))
        executor = "prefect/pg"
    served = serve(state, pool=args.pool, env=env)
    body = {**SEED_BODY, "isolation": level}
    rows = []
    try:
        await drive(served.url, key, body, 1, 1)  # warm-up: Prefect's first flow run, caches
        await asyncio.sleep(2)
        for clients in args.clients:
            c0, t0 = served.cpu(), time.monotonic()
            results = await drive(served.url, key, body, args.runs, clients)
            wall, c1 = time.monotonic() - t0, served.cpu()
            statuses: dict[str, int] = {}
            for status, _ in results:
                statuses[status] = statuses.get(status, 0) + 1
            row = Row(
                level=level,
                executor=executor,
                slots=slots,
                clients=clients,
                runs=args.runs,
                wall=wall,
                ok=statuses.get("succeeded", 0),
                statuses=statuses,
                cpu={k: c1[k] - c0[k] for k in c0},
                floor=floor,
                first_step_ms=[f for _, f in results if f is not None],
            )
            print(line(row), flush=True)
            rows.append(row)
            await asyncio.sleep(2)  # let the pool refill before the next level
        fails = served.log.read_text(errors="replace").count("execution failed")
        if fails:
            print(f"    server log: {fails} 'execution failed' lines ({served.log})")
    finally:
        served.stop()
    return rows


def line(r: Row) -> str:
    return (
        f"{r.level:<10} {r.executor:<7} slots={r.slots:<2} clients={r.clients:<3} "
        f"ok={r.ok}/{r.runs} {r.rate:5.2f} runs/s  CPU-s/run: machine {r.per_run('machine'):.2f} "
        f"(floor {r.floor * r.wall / r.runs:.2f}, net {r.machine_net:.2f}) "
        f"serve {r.per_run('serve'):.2f} prefect {r.per_run('prefect'):.2f} "
        f"sandboxes {r.per_run('sandboxes'):.2f} bench {r.per_run('bench'):.2f}  "
        f"accepted→worker.started p50 {pct(r.first_step_ms, 50):.0f} "
        f"p99 {pct(r.first_step_ms, 99):.0f} ms"
        + ("" if r.ok == r.runs else f"  statuses {r.statuses}")
    )


def summary(rows: list[Row]) -> None:
    print(
        "\n| isolation | slots | clients | executor | runs/s | CPU-s/run machine (net of floor) "
        "| serve | Prefect server | sandboxes | floor (background CPU-s/run) "
        "| accepted→worker.started p50 / p99 ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.level} | {r.slots} | {r.clients} | {r.executor} | {r.rate:.2f} "
            f"| {r.per_run('machine'):.2f} ({r.machine_net:.2f}) | {r.per_run('serve'):.2f} "
            f"| {r.per_run('prefect'):.2f} | {r.per_run('sandboxes'):.2f} "
            f"| {r.floor * r.wall / r.runs:.2f} "
            f"| {pct(r.first_step_ms, 50):.0f} / {pct(r.first_step_ms, 99):.0f} |"
        )
    print()
    for r in rows:
        if not r.executor.startswith("prefect"):
            continue
        plain = next(
            (
                p
                for p in rows
                if p.executor == "plain"
                and (p.level, p.slots, p.clients) == (r.level, r.slots, r.clients)
            ),
            None,
        )
        if plain is None:
            continue
        print(
            f"{r.level} slots={r.slots} clients={r.clients}: {r.executor} {r.rate:.2f} runs/s = "
            f"{r.rate / plain.rate:.2f}x plain ({plain.rate:.2f}); Prefect adds "
            f"{r.machine_net - plain.machine_net:+.2f} CPU-s/run on the machine (net of floors), "
            f"{r.per_run('serve') + r.per_run('prefect') - plain.per_run('serve'):+.2f} in "
            "serve + Prefect's server"
        )


async def main_async(args: argparse.Namespace) -> None:
    rows: list[Row] = []
    for level in args.levels:
        for slots in args.slots:
            for executor in args.executors:
                for db in args.prefect_db if executor == "prefect" else ["sqlite"]:
                    rows += await config(args, level, executor, slots, db)
    summary(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=40, help="runs per client count")
    ap.add_argument("--clients", default="8,32", help="concurrent clients, comma-separated")
    ap.add_argument("--levels", default="namespaces,gvisor", help="isolation levels")
    ap.add_argument("--executors", default="plain,prefect", help="plain and/or prefect")
    ap.add_argument("--slots", default="8", help="EPHEMERAL_MAX_CONCURRENT_RUNS, comma-separated")
    ap.add_argument("--pool", type=int, default=2, help="warm sandboxes")
    ap.add_argument(
        "--prefect-db",
        default="sqlite",
        help="the embedded Prefect server's database: sqlite and/or postgres (a throwaway "
        "PostgreSQL 15 from tests/fixtures_pg.py), comma-separated",
    )
    args = ap.parse_args()
    args.prefect_db = args.prefect_db.split(",")
    args.clients = [int(x) for x in args.clients.split(",")]
    args.levels = args.levels.split(",")
    args.executors = args.executors.split(",")
    args.slots = [int(x) for x in args.slots.split(",")]
    args.pg = None
    if "postgres" in args.prefect_db:
        from tests.fixtures_pg import PgCluster

        args.pg = PgCluster().start()
    try:
        asyncio.run(main_async(args))
    finally:
        if args.pg is not None:
            args.pg.stop()


if __name__ == "__main__":
    main()
