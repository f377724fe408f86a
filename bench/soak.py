"""Soak: many runs at C concurrent clients through the public API of a real ``ephemeral serve``.

    .venv/bin/python bench/soak.py [--runs 500] [--levels 16,64] [--pool 2] [--slots 8]
                                   [--executor flow] [--isolation namespaces] [--floor-runs N]
                                   [--web]

One ``ephemeral serve`` subprocess (embedded Prefect on SQLite, replay model
``replay/sandbox-proof``, a fresh state directory, an org with credit and a key made through the
store as the admin CLI does). For each level, C clients each POST a run (honouring 429 +
``Retry-After``), poll it to its terminal status and ``run.settled``, then take the next. Prints,
per level: statuses, stuck runs (not settled within ``--stuck-after`` s; must be 0), runs charged
while queued (must be 0), p50/p99 of the queue wait (``created_at`` → ``started_at``, the slot
grant), of slot grant → ``worker.started`` and of end to end, runs/s, 429s seen; the server's
RSS, fds and threads before and after; and records = ledger (DuckDB over the Parquet records vs
the store's sums).

After each level and at the end it prints assert-style checks (``CHECK ok|FAIL``; the exit
status is 1 if any failed): every run terminal and settled; no open reservation (a run with
``settled_at`` unset) and the org's ``reserved_micros`` back to 0; nobody charged for queueing
(below); records = ledger with the same run ids and the same totals; while ``serve`` is idle,
no more live sandboxes under it than its warm pool; after it stops, no sandbox process
(``bwrap``/``runsc``) of ours left (new since the start and reparented to init, or naming a
sandbox id of ours), no sandbox handle file, no gVisor run directory and nothing in the
``TMPDIR`` the bench gives ``serve`` (a directory of its own in the state dir).

With ``--floor-runs N`` the same levels run first through a second ``serve`` with
``EPHEMERAL_EXECUTOR=plain`` (no Prefect), N runs each, in the same sitting: its runs/s is the
floor beside the figure, and the summary prints the ratio.

With ``--web`` the runs have ``web`` on and replay a cassette (written into the state dir
beside the shipped ones) whose two commands fetch from an HTTP upstream the bench starts on
127.0.0.1, a short answer and a 3 MiB one, through the egress proxy (``serve`` gets
``EPHEMERAL_BROKER_ALLOW_PRIVATE_HOSTS``, so the loopback upstream is reachable). One more check:
every settled run has two ``web.requested`` events, both 200, the big one whole, and its web
charge equals the sum of their ``cost_micros``.

"Charged while queued": a run that never got a slot but was charged anything; or charged
compute without a ``sandbox.ready`` event; or whose ``sandbox.ready`` is before its slot grant
(``started_at``); or whose sandbox lifetime (``sandbox.destroyed``'s ``lifetime_ms``, the
host's clock from attach to destroy) does not fit between the slot grant and ``ended_at``; or
whose compute charge exceeds rate * that lifetime. (``sandbox.ready``'s own timestamp is when
its store write landed, up to seconds after the attach under load, so it is no measure of the
lifetime.) The sum of compute charged is printed beside rate * the summed lifetimes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
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
    Served,
    at,
    children,
    make_key,
    pct,
    script_server,
    serve,
)
from ephemeral.lifecycle import TERMINAL_STATUSES
from ephemeral.money.pricing import PriceBook
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
    terminal_s: float | None = None  # first POST → terminal status seen by this client
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
                if out.terminal_s is None:
                    out.terminal_s = time.monotonic() - t0
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
    url: str,
    key: str,
    runs: int,
    concurrency: int,
    stuck_after: float = 600,
    body: dict[str, Any] = BODY,
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
                outcomes.append(await one_run(client, stuck_after, body))

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return outcomes, time.monotonic() - t0


# --web: each run's replayed turns fetch from an upstream on the host's loopback through the
# egress proxy, a small answer and a BLOB_MIB MiB one: requests, tunnels-worth of bytes and
# per-MiB charges under load, with nothing sent past 127.0.0.1.
BLOB_MIB = 3
UPSTREAM = r"""
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
BLOB = bytes(range(256)) * (int(sys.argv[1]) << 12)
class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        body = BLOB if self.path == "/blob" else b"soak upstream ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
server.daemon_threads = True
server.request_queue_size = 256
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def web_cassettes(state: Path, port: int) -> Path:
    """The shipped cassettes plus ``web-soak``: two fetches from the upstream, then an answer.
    ``--noproxy ''``: the sandbox's ``no_proxy`` names 127.0.0.1 (its own loopback), and this
    127.0.0.1 is the host's, reached only through the proxy."""
    folder = state / "cassettes"
    folder.mkdir()
    for shipped in Settings.load().cassettes_dir.glob("*.json"):
        (folder / shipped.name).write_bytes(shipped.read_bytes())
    base = f"http://127.0.0.1:{port}"
    usage = {"input_tokens": 900, "output_tokens": 40, "cached_input_tokens": 0}
    turns = [
        {
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_small",
                        "name": "shell",
                        "arguments": {"command": f"curl -sS -m 60 --noproxy '' {base}/small"},
                    },
                    {
                        "id": "call_blob",
                        "name": "shell",
                        "arguments": {
                            "command": "curl -sS -m 60 --noproxy '' -o /dev/null "
                            f"-w '%{{size_download}}' {base}/blob"
                        },
                    },
                ],
            },
            "usage": usage,
            "latency_ms": 300,
        },
        {
            "message": {"role": "assistant", "content": "Fetched both.", "tool_calls": []},
            "usage": usage,
            "latency_ms": 200,
        },
    ]
    cassette = {
        "version": 1,
        "model": "openai/gpt-6-luna",
        "recorded_at": "2026-12-04T00:00:00Z",
        "description": "bench/soak.py --web: two fetches through the egress proxy",
        "any_prompt": True,  # a script written by hand, for the soak's prompts
        "turns": turns,
    }
    (folder / "web-soak.json").write_text(json.dumps(cassette))
    return folder


def web_mismatches(outcomes: list[Outcome]) -> list[str]:
    """Settled web runs whose fetches did not both answer 200 with all their bytes, or whose
    web charge is not the sum of their ``web.requested`` events' costs."""
    bad = []
    for o in outcomes:
        if not o.settled or o.run is None:
            continue
        web = [e["data"] for e in o.events if e["type"] == "web.requested"]
        charged = int((o.run["cost"].get("breakdown") or {}).get("web_micros") or 0)
        ok = (
            len(web) == 2
            and all(w.get("status") == 200 for w in web)
            and max(w.get("bytes_in", 0) for w in web) > BLOB_MIB << 20
            and charged == sum(w.get("cost_micros", 0) for w in web)
        )
        if not ok:
            bad.append(o.run["id"])
    return bad


def compute_rate(settings: Settings) -> int:
    limits = Limits()
    return PriceBook.load(settings).compute_micros(
        vcpu_seconds=limits.cpus, gib_seconds=limits.memory_mib / 1024
    )


def sandbox_seconds(events: list[dict[str, Any]]) -> tuple[Any, float | None]:
    """(``sandbox.ready`` time, the sandbox's lifetime in s from ``sandbox.destroyed``)."""
    ready = next((e for e in events if e["type"] == "sandbox.ready"), None)
    gone = next((e for e in events if e["type"] == "sandbox.destroyed"), None)
    if ready is None:
        return None, None
    lifetime = (gone.get("data") or {}).get("lifetime_ms") if gone else None
    return at(ready["at"]), None if lifetime is None else int(lifetime) / 1000


def charged_while_queued(outcome: Outcome, rate: int) -> bool:
    run = outcome.run or {}
    cost = run.get("cost") or {}
    started, ended = at(run.get("started_at")), at(run.get("ended_at"))
    if started is None:
        return int(cost.get("charged_micros") or 0) > 0
    compute = int((cost.get("breakdown") or {}).get("compute_micros") or 0)
    ready_at, seconds = sandbox_seconds(outcome.events)
    if ready_at is None:
        return compute > 0
    if ready_at < started:
        return True  # a sandbox of this run before its slot grant
    if seconds is None or ended is None:
        return False
    if seconds > (ended - started).total_seconds() + 0.01:
        return True  # a sandbox lifetime that does not fit between slot grant and end
    return compute > math.ceil(rate * (seconds + 0.001)) + 1  # lifetime_ms is rounded down


def analyse(outcomes: list[Outcome], rate: int) -> dict[str, Any]:
    statuses: dict[str, int] = {}
    queue_ms: list[float] = []
    first_step_ms: list[float] = []
    e2e_ms: list[float] = []
    terminal_ms: list[float] = []
    compute_charged, compute_measured = 0, 0.0
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
        compute_charged += int((cost.get("breakdown") or {}).get("compute_micros") or 0)
        compute_measured += rate * (sandbox_seconds(o.events)[1] or 0.0)
        if o.terminal_s is not None:
            terminal_ms.append(o.terminal_s * 1000)
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
        "terminal_ms": terminal_ms,
        "compute_charged": compute_charged,
        "compute_measured": compute_measured,
        "throttled": sum(o.throttled for o in outcomes),
        "errors": [o.error for o in outcomes if o.error],
    }


# Server log lines worth counting after a soak; a lease that expired is logged by
# ephemeral/engine/runtime.py as "the lease of host … expired".
NEEDLES = ("execution failed", "database is locked", "Traceback", "lease of host", "renewal failed")
SANDBOX_COMMS = ("bwrap", "runsc", "runsc-gofer", "runsc-sandbox")


class Checks:
    """Assert-style lines: each check prints ``CHECK ok|FAIL name: detail``; any FAIL fails."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def __call__(self, name: str, ok: bool, detail: str = "") -> None:
        print(f"  CHECK {'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""))
        if not ok:
            self.failed.append(name)


async def records_vs_ledger(settings: Settings) -> tuple[dict[str, int], dict[str, int]]:
    """run id → charged µ$ from the Parquet records (via DuckDB), and from the store's ledger."""
    import duckdb

    glob = str(settings.records_dir / "v1" / "kind=runs" / "**" / "*.parquet")
    con = duckdb.connect()
    try:
        rows = con.execute(
            "SELECT run_id, coalesce(charged_micros, 0) FROM "
            f"read_parquet('{glob}', hive_partitioning=true, union_by_name=true)"
        ).fetchall()
    finally:
        con.close()
    rec: dict[str, int] = {}
    for run_id, charged in rows:
        rec[str(run_id)] = rec.get(str(run_id), 0) + int(charged)  # a duplicate shows as a sum
    if len(rows) != len(rec):
        rec["<duplicate records>"] = len(rows) - len(rec)
    store = await Store.open(settings.db_url)
    try:
        ledger = {r.id: int(r.charged_micros or 0) for r in await store._runs_where()}
    finally:
        await store.close()
    return rec, ledger


async def reservations(settings: Settings, org: str) -> tuple[list[str], list[str], int]:
    """(runs not terminal, runs not settled: an open reservation, the org's reserved µ$)."""
    store = await Store.open(settings.db_url)
    try:
        rows = await store._runs_where()
        reserved = (await store.orgs.get(org)).reserved_micros
    finally:
        await store.close()
    live = [r.id for r in rows if r.status not in TERMINAL_STATUSES]
    return live, [r.id for r in rows if r.settled_at is None], reserved


def stat_of(pid: int) -> tuple[str, int] | None:
    """(comm, ppid) of a live process, None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    return comm, int(raw[raw.rindex(")") + 2 :].split()[1])


def sandbox_pids() -> dict[int, tuple[str, int]]:
    """Every live bwrap/runsc process on the box: pid → (comm, ppid)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = stat_of(int(entry))
            if st is not None and st[0] in SANDBOX_COMMS:
                out[int(entry)] = st
    return out


def cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


async def idle_sandboxes(served: Served, pool: int, wait: float = 30) -> int:
    """Live sandboxes directly under ``serve`` once the pool settles (runs done): ≤ the pool."""
    deadline = time.monotonic() + wait
    while True:
        n = sum(1 for c in children(served.proc.pid) if (stat_of(c) or ("", 0))[0] in SANDBOX_COMMS)
        if n <= pool or time.monotonic() > deadline:
            return n
        await asyncio.sleep(1)


def leftovers(served: Served, before: dict[int, tuple[str, int]], ids: set[str]) -> dict[str, Any]:
    """After ``serve`` stopped: sandbox processes, handles, run dirs and temp files of ours."""
    time.sleep(2)  # SIGKILLed sandboxes are reaped asynchronously
    orphans = []
    for pid, (comm, ppid) in sandbox_pids().items():
        line = cmdline(pid)
        if (pid not in before and ppid == 1) or any(i in line for i in ids):
            orphans.append(f"{pid} {comm} {line[:160]}")
    state = served.settings.state_dir
    return {
        "processes": orphans,
        "handles": sorted(p.name for p in served.settings.sandboxes_dir.glob("*.json")),
        "run_dirs": sorted(p.name for p in (state / "run").glob("*")),
        "tmp": sorted(str(p.relative_to(state)) for p in (state / "tmp").rglob("*")),
    }


def report(level: int, stats: dict[str, Any], wall: float, n: int, label: str = "") -> None:
    def line(name: str, values: list[float]) -> str:
        return f"  {name:<28} p50={pct(values, 50):8.0f} ms  p99={pct(values, 99):8.0f} ms"

    print(f"== {label}{n} runs at {level} concurrent clients: {wall:.1f} s, {n / wall:.2f} runs/s")
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
    print(line("POST → terminal (client)", stats["terminal_ms"]))
    print(line("queue wait", stats["queue_ms"]))
    print(line("slot grant → worker.started", stats["first_step_ms"]))
    print(line("end to end (client)", stats["e2e_ms"]))
    measured = stats["compute_measured"]
    print(
        f"  compute charged {stats['compute_charged']} µ$; rate x measured sandbox time "
        f"{measured:.0f} µ$ ({stats['compute_charged'] / measured if measured else 0:.3f}x)"
    )


async def soak(
    args: argparse.Namespace, executor: str, runs: int, checks: Checks
) -> dict[int, float]:
    """One ``serve`` with ``executor``, every level; returns runs/s per level."""
    state = Path(tempfile.mkdtemp(prefix=f"ephemeral-soak-{executor}-"))
    (state / "tmp").mkdir()
    settings = Settings.load(state_dir=state)
    key = await make_key(settings, org="soak")
    env = {
        "EPHEMERAL_MAX_CONCURRENT_RUNS": str(args.slots),
        "EPHEMERAL_EXECUTOR": executor,
        "EPHEMERAL_ISOLATION": args.isolation,
        "TMPDIR": str(state / "tmp"),
    }
    if args.max_queued is not None:
        env["EPHEMERAL_MAX_QUEUED_RUNS"] = str(args.max_queued)
    # The request names the isolation: EPHEMERAL_ISOLATION alone sets only the warm pool's,
    # and a run asking "auto" takes the strongest level the host has.
    body: dict[str, Any] = {**BODY, "isolation": args.isolation}
    upstream = None
    if args.web:
        upstream, port = script_server(UPSTREAM, str(BLOB_MIB))
        env["EPHEMERAL_CASSETTES_DIR"] = str(web_cassettes(state, port))
        env["EPHEMERAL_BROKER_ALLOW_PRIVATE_HOSTS"] = "true"  # the upstream is on loopback
        body |= {"model": "replay/web-soak", "web": True, "max_cost_micros": 60000}
    before = sandbox_pids()
    served = serve(state, pool=args.pool, env=env)
    rate = compute_rate(settings)
    rates: dict[int, float] = {}
    label = f"{executor}, {args.isolation}, {args.slots} slots: "
    try:
        async with httpx.AsyncClient(
            base_url=served.url, headers={"Authorization": f"Bearer {key}"}, timeout=120
        ) as client:
            warm = await one_run(client, 300, body)  # Prefect's first flow run pays its start-up
            print(
                f"[{executor}] warm-up run: {(warm.run or {}).get('status')} in {warm.e2e_s:.1f} s"
            )
        print(f"  server before: {served.stats()}")
        for level in args.levels:
            outcomes, wall = await drive(served.url, key, runs, level, args.stuck_after, body)
            stats = analyse(outcomes, rate)
            report(level, stats, wall, runs, label)
            rates[level] = runs / wall
            print(f"  server after: {served.stats()}")
            live, open_, reserved = await reservations(served.settings, "soak")
            checks(
                "all runs terminal and settled",
                not stats["stuck"] and not live,
                f"{len(stats['stuck'])} not settled for the client, {len(live)} not terminal",
            )
            checks("no open reservations", not open_, f"{len(open_)} runs with settled_at unset")
            checks("org reserved back to 0", reserved == 0, f"{reserved} µ$")
            checks(
                "charged + refunded = reserved per run",
                not stats["unbalanced"],
                f"{len(stats['unbalanced'])} runs",
            )
            checks(
                "nobody charged for queueing",
                not stats["charged_while_queued"],
                f"{len(stats['charged_while_queued'])} runs {stats['charged_while_queued'][:5]}",
            )
            checks(
                "no 5xx / lost runs",
                stats["statuses"].get("never-admitted", 0) == 0,
                json.dumps(stats["statuses"], sort_keys=True),
            )
            if args.web:
                bad = web_mismatches(outcomes)
                checks(
                    "web runs: both fetches 200 and whole, web charged = their events' costs",
                    not bad,
                    f"{len(bad)} runs {bad[:5]}",
                )
            n = await idle_sandboxes(served, args.pool)
            checks(
                "live sandboxes under idle serve ≤ pool", n <= args.pool, f"{n} (pool {args.pool})"
            )
        rec, ledger = await records_vs_ledger(served.settings)
        checks(
            "records = ledger: same run ids",
            set(rec) == set(ledger),
            f"{len(rec)} records, {len(ledger)} ledger rows; only in records "
            f"{sorted(set(rec) - set(ledger))[:3]}, "
            f"only in ledger {sorted(set(ledger) - set(rec))[:3]}",
        )
        checks(
            "records = ledger: same totals",
            sum(rec.values()) == sum(ledger.values())
            and all(rec.get(k) == v for k, v in ledger.items()),
            f"{sum(rec.values())} µ$ vs {sum(ledger.values())} µ$",
        )
        log = served.log.read_text(errors="replace")
        for needle in NEEDLES:
            print(f"  server log: {log.count(needle)} {needle!r} lines")
        checks("no 'database is locked' in the server log", "database is locked" not in log)
        ids = set(ledger)
    finally:
        served.stop()
        if upstream is not None:
            upstream.kill()
            upstream.wait()
    sandbox_ids: set[str] = set()
    store = await Store.open(settings.db_url)
    try:
        sandbox_ids = {r.sandbox_id for r in await store._runs_where() if r.sandbox_id}
    finally:
        await store.close()
    left = leftovers(served, before, sandbox_ids)
    checks(
        "no sandbox processes left after stop",
        not left["processes"],
        "; ".join(left["processes"][:5]),
    )
    checks("no sandbox handles left", not left["handles"], str(left["handles"][:5]))
    checks("no gVisor run dirs left", not left["run_dirs"], str(left["run_dirs"][:5]))
    checks("no temp files left in serve's TMPDIR", not left["tmp"], str(left["tmp"][:5]))
    print(f"  state dir {state} ({len(ids)} runs)")
    return rates


async def main_async(args: argparse.Namespace) -> int:
    checks = Checks()
    floor: dict[int, float] = {}
    if args.floor_runs:
        floor = await soak(args, "plain", args.floor_runs, checks)
    rates = await soak(args, args.executor, args.runs, checks)
    for level, r in rates.items():
        if level in floor:
            print(
                f"{args.executor} at {level} clients: {r:.2f} runs/s = {r / floor[level]:.2f}x "
                f"plain ({floor[level]:.2f} runs/s, same sitting)"
            )
    print(f"checks: {'all ok' if not checks.failed else 'FAILED: ' + ', '.join(checks.failed)}")
    return 1 if checks.failed else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=500, help="runs per concurrency level")
    ap.add_argument("--levels", default="16,64", help="concurrent clients, comma-separated")
    ap.add_argument("--pool", type=int, default=2)
    ap.add_argument("--slots", type=int, default=8, help="EPHEMERAL_MAX_CONCURRENT_RUNS")
    ap.add_argument("--max-queued", type=int, default=None, help="EPHEMERAL_MAX_QUEUED_RUNS")
    ap.add_argument("--stuck-after", type=float, default=600, help="s before a run is stuck")
    ap.add_argument("--executor", default="flow", help="EPHEMERAL_EXECUTOR: flow or plain")
    ap.add_argument("--isolation", default="namespaces", help="EPHEMERAL_ISOLATION")
    ap.add_argument(
        "--web",
        action="store_true",
        help="runs fetch 2 URLs (one of 3 MiB) from a loopback upstream through the proxy",
    )
    ap.add_argument(
        "--floor-runs", type=int, default=0, help="runs per level of the plain floor (0: none)"
    )
    args = ap.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
