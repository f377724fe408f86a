"""Scale-out: how fast Prefect hands a run to another process, and runs across workers.

    .venv/bin/python bench/scaleout.py [--first-step 30] [--throughput 200] [--clients 16]
    .venv/bin/python bench/scaleout.py --mechanisms [--n 20]
    .venv/bin/python bench/scaleout.py --sessions 30 [--session-burst 100] [--level namespaces]

Default: one real cluster on this machine (``tests/cluster/harness.py``: PostgreSQL 15 holding
the store, one ``prefect server start`` on SQLite, ``ephemeral serve`` and ``ephemeral worker``
processes, replay model ``replay/sandbox-proof``, warm pools of 2). Prints:

- **time to first step**, accepted (the run's ``created_at``) → ``worker.started`` (the moment
  the agent can act), p50 / p99 over sequential runs (a pause between runs lets warm pools
  refill), for ``ephemeral serve`` in local mode with Prefect (``agent-run`` flow in-process,
  against the same Prefect server) and in dispatch mode (``EPHEMERAL_EXECUTOR=dispatch``, one
  worker), in the same run;
- **throughput**: N runs through the API from C concurrent clients, with 1 worker and with 2
  workers (``--limit 4`` each): runs/s, failures, settle mismatches (charged + refunded ≠
  reserved), overshoot (more runs executing at once on a host than its limit, from the runs'
  ``started_at``/``ended_at``), and the org's reserved money at the end (must be 0).

``--sessions N`` measures sandbox sessions placed on worker hosts (docs/deploy.md, "Sessions on
worker hosts"), with ``bench/tti.py``'s probe (create, then exec ``python3 -V``; 5 % trimmed):
create → first exec reply over N sequential sessions through ``ephemeral serve`` in local mode
(the session in the API process) and through the cluster (API → internal channel → one of two
workers), then a burst of ``--session-burst`` sessions at once through each (time until all
are interactive). Floors, in the same run: the bare driver's warm acquire + exec in this
process (sequential) and that many bare creates + exec at once (burst).

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
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.evals.prefect_server import PREFECT, PrefectServer  # noqa: E402
from tests.sample import SAMPLE_PROMPT  # noqa: E402

EPHEMERAL_CMD = [sys.executable, "-m", "ephemeral.cli"]


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


BODY = {
    "prompt": SAMPLE_PROMPT,  # the one prompt replay/sandbox-proof answers
    "model": "replay/sandbox-proof",
    "shell": True,
    "timeout_seconds": 120,
    "max_cost_micros": 40000,
}


def _at(value: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


class Client:
    def __init__(self, url: str, key: str) -> None:
        import httpx

        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120
        )

    def run(self, body: dict[str, object] = BODY) -> dict[str, object]:
        """Submit (honouring 429) and poll until settled; returns the run and its events."""
        while True:
            res = self.http.post("/v1/runs", json=body)
            if res.status_code != 429:
                break
            time.sleep(float(res.headers.get("Retry-After", "1")))
        res.raise_for_status()
        run_id = res.json()["id"]
        while True:
            events = self.http.get(f"/v1/runs/{run_id}/events").json()
            if any(e["type"] == "run.settled" for e in events):
                obj = self.http.get(f"/v1/runs/{run_id}").json()
                return {"run": obj, "events": events}
            time.sleep(0.1)


def first_step(client: Client, n: int, phases: dict[str, list[float]]) -> list[float]:
    """Accepted → ``worker.started`` per run; ``phases`` gets the parts (dispatch: accepted →
    ``run.claimed`` → ``sandbox.ready`` → ``worker.started``)."""
    out = []
    for i in range(n + 1):  # run 0 warms caches up
        got = client.run()
        run, events = got["run"], got["events"]
        assert isinstance(run, dict) and isinstance(events, list)
        at = {e["type"]: _at(e["at"]) for e in events}
        if i:
            out.append(at["worker.started"] - _at(str(run["created_at"])))
            if "run.claimed" in at:
                phases.setdefault("accepted -> run.claimed", []).append(
                    at["run.claimed"] - _at(str(run["created_at"]))
                )
                phases.setdefault("run.claimed -> sandbox.ready", []).append(
                    at["sandbox.ready"] - at["run.claimed"]
                )
        time.sleep(1.5)  # the warm pool refills, as on a server that is not saturated
    return out


def throughput(client: Client, runs: int, clients: int) -> dict[str, object]:
    t0 = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(lambda _: client.run()["run"], range(runs)))
    wall = time.monotonic() - t0
    mismatches = 0
    per_host: dict[str, list[tuple[float, int]]] = {}
    for r in done:
        assert isinstance(r, dict)
        cost = r["cost"]
        assert isinstance(cost, dict)
        if cost["charged_micros"] + cost["refunded_micros"] != cost["reserved_micros"]:
            mismatches += 1
        if r.get("started_at") and r.get("ended_at"):
            edges = per_host.setdefault(str(r["host"]), [])
            edges += [(_at(str(r["started_at"])), 1), (_at(str(r["ended_at"])), -1)]
    peaks = {}
    for host, edges in per_host.items():
        live = peak = 0
        for _, step in sorted(edges, key=lambda e: (e[0], e[1])):
            live += step
            peak = max(peak, live)
        peaks[host] = peak
    return {
        "wall": wall,
        "runs_per_s": runs / wall,
        "failures": sum(1 for r in done if isinstance(r, dict) and r["status"] != "succeeded"),
        "mismatches": mismatches,
        "by_host": {
            h: sum(1 for r in done if isinstance(r, dict) and r["host"] == h) for h in peaks
        },
        "peaks": peaks,
    }


def cluster_bench(args: argparse.Namespace) -> None:
    from tests.cluster.harness import Cluster
    from tests.fixtures_pg import PgCluster

    pg = PgCluster()
    reason = pg.unavailable()
    if reason:
        raise SystemExit(reason)
    pg.start()
    root = Path(tempfile.mkdtemp(prefix="scaleout-bench-"))
    prefect_db = None
    if args.prefect_db == "postgres":
        prefect_db = pg.url(pg.create_database("prefect"))
    c = Cluster(
        root, pg.url(pg.create_database("bench")), lease_seconds=30, prefect_db_url=prefect_db
    )
    try:
        c.start()
        key = c.make_key("bench", 1_000_000_000)
        # local mode with Prefect: the agent-run flow inside `serve`, same Prefect server
        local = c.spawn(
            "local",
            *EPHEMERAL_CMD,
            "serve",
            "--port",
            str(port := _free_port()),
            "--pool",
            "2",
            EPHEMERAL_EXECUTOR="flow",
        )
        _wait_http(f"http://127.0.0.1:{port}", local)
        phases: dict[str, list[float]] = {}
        local_lat = first_step(Client(f"http://127.0.0.1:{port}", key), args.first_step, {})
        c.kill("local", 15)
        url = c.start_api()
        c.start_worker("w1", limit=4, pool=2)
        api = Client(url, key)
        dispatch_lat = first_step(api, args.first_step, phases)
        print(
            f"Prefect server on {args.prefect_db}; time to first step "
            f"(accepted -> worker.started), {args.first_step} sequential runs"
        )
        for name, lat in (
            ("local mode with Prefect", local_lat),
            ("dispatch, 1 worker", dispatch_lat),
        ):
            print(
                f"  {name:26s} p50 {pct(lat, 0.5) * 1000:6.0f} ms   "
                f"p99 {pct(lat, 0.99) * 1000:6.0f} ms"
            )
        print(
            f"  dispatch adds p50 {(pct(dispatch_lat, 0.5) - pct(local_lat, 0.5)) * 1000:+.0f} ms"
        )
        for name, lat in phases.items():
            print(
                f"    {name:30s} p50 {pct(lat, 0.5) * 1000:6.0f} ms   "
                f"p99 {pct(lat, 0.99) * 1000:6.0f} ms"
            )
        if args.throughput:
            one = throughput(api, args.throughput, args.clients)
            c.start_worker("w2", limit=4, pool=2)
            two = throughput(api, args.throughput, args.clients)
            reserved = c.org_reserved("bench")
            print(f"throughput, {args.throughput} runs, {args.clients} clients, limit 4 per worker")
            for name, r in (("1 worker", one), ("2 workers", two)):
                print(
                    f"  {name:10s} {r['runs_per_s']:.2f} runs/s  wall {r['wall']:.0f} s  "
                    f"failures {r['failures']}  settle mismatches {r['mismatches']}  "
                    f"runs by host {r['by_host']}  peak at once {r['peaks']} (limit 4)"
                )
            ratio = float(str(two["runs_per_s"])) / float(str(one["runs_per_s"]))
            print(f"  2 workers / 1 worker = {ratio:.2f}x;  org reserved at the end: {reserved}")
        sys.stdout.flush()
    finally:
        c.stop()
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


def sessions_bench(args: argparse.Namespace) -> None:
    from bench.served import pct as pct100
    from bench.served import trimmed
    from bench.tti import (
        burst_line,
        client_for,
        floor_burst,
        floor_sequential,
        seq_line,
        sessions_burst,
        sessions_sequential,
    )
    from tests.cluster.harness import Cluster
    from tests.fixtures_pg import PgCluster

    level, n, burst = args.level, args.sessions, args.session_burst
    pg = PgCluster()
    reason = pg.unavailable()
    if reason:
        raise SystemExit(reason)
    pg.start()
    root = Path(tempfile.mkdtemp(prefix="scaleout-sessions-"))
    slots = str(max(32, burst))  # per host: one host could take the whole burst
    c = Cluster(
        root,
        pg.url(pg.create_database("bench")),
        lease_seconds=30,
        isolation=level,
        extra_env={"EPHEMERAL_HOST_SESSIONS": slots},
    )

    async def measure(url: str, key: str) -> tuple[list[float], tuple[list[float], int]]:
        async with client_for(url, key, burst) as client:
            seq = await sessions_sequential(client, level, n, args.pause)
        async with client_for(url, key, burst) as client:
            got = await sessions_burst(client, level, burst) if burst else ([], 0)
        return seq, got

    try:
        print(f"== sessions, {level}: create -> first exec reply", flush=True)
        floor = asyncio.run(floor_sequential(level, n, 2, args.pause))
        print(seq_line("floor: warm pool acquire + exec", floor), flush=True)
        c.start()
        key = c.make_key("bench", 1_000_000_000)
        port = _free_port()
        local = c.spawn(
            "local",
            *EPHEMERAL_CMD,
            "serve",
            "--port",
            str(port),
            "--pool",
            "2",
            EPHEMERAL_EXECUTOR="plain",
        )
        _wait_http(f"http://127.0.0.1:{port}", local)
        local_seq, local_burst = asyncio.run(measure(f"http://127.0.0.1:{port}", key))
        c.kill("local", 15)
        url = c.start_api()
        c.start_worker("w1", limit=2, pool=2)
        c.start_worker("w2", limit=2, pool=2)
        time.sleep(2)  # the pools fill
        placed_seq, placed_burst = asyncio.run(measure(url, key))
        print(seq_line("local: session in the API process", local_seq))
        print(seq_line("cluster: API -> channel -> worker", placed_seq))
        p_seq, l_seq = trimmed(placed_seq), trimmed(local_seq)
        print(
            f"  cluster adds p50 {pct100(p_seq, 50) - pct100(l_seq, 50):+.1f} ms, "
            f"p99 {pct100(p_seq, 99) - pct100(l_seq, 99):+.1f} ms (target p50 <= 50 ms)"
        )
        if burst:
            floor_b, floor_failed = asyncio.run(floor_burst(level, burst))
            print(burst_line("floor: bare create + exec at once", floor_b, floor_failed, burst))
            print(burst_line("local burst: -> exec reply", *local_burst, burst))
            print(burst_line("cluster burst, 2 workers", *placed_burst, burst))
        hosts = asyncio.run(_session_hosts(c.db_url))
        print(f"  sessions by host: {hosts};  org reserved at the end: {c.org_reserved('bench')}")
        sys.stdout.flush()
    finally:
        c.stop()
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


async def _session_hosts(db_url: str) -> dict[str, int]:
    import sqlalchemy as sa

    from ephemeral.store import Store
    from ephemeral.store.schema import runs

    store = await Store.open(db_url)
    try:
        async with store.engine.connect() as conn:
            got = await conn.execute(
                sa.select(runs.c.host, sa.func.count())
                .where(runs.c.kind == "session")
                .group_by(runs.c.host)
            )
            return {str(h): int(k) for h, k in got}
    finally:
        await store.close()


# -- the control plane's ceiling (--ceiling) ----------------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK")
FAKE_CMD = [sys.executable, "-m", "bench.fake_sandboxes"]
# replay/sandbox-proof on the fake double: the same two model turns and four shell calls as the
# real sample run, interpreted in memory (no sandbox boots)
CEILING_BODY = BODY


def _proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds of it and of its children it has reaped)."""
    out: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        # after the name: state ppid … utime(12) stime(13) cutime(14) cstime(15)
        ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))
        out[int(entry)] = (int(fields[1]), ticks / CLK_TCK)
    return out


def tree_cpu(roots: list[int], table: dict[int, tuple[int, float]] | None = None) -> float:
    """CPU seconds of the processes ``roots`` and every live descendant, with what each has
    reaped (a PostgreSQL backend that exited is in the postmaster's ``cutime``)."""
    table = table if table is not None else _proc_table()
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    total, todo, seen = 0.0, list(roots), set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in table:
            continue
        seen.add(pid)
        total += table[pid][1]
        todo += kids.get(pid, [])
    return total


class Meters:
    """Per-component CPU seconds, read from /proc before and after a load."""

    def __init__(self, parts: dict[str, list[int]]) -> None:
        self.parts = parts

    def read(self) -> dict[str, float]:
        table = _proc_table()
        got = {name: tree_cpu(pids, table) for name, pids in self.parts.items()}
        me = os.times()
        got["bench clients"] = me.user + me.system
        return got


def _postmaster(pg: Any) -> int:
    return int((Path(pg.dir) / "data" / "postmaster.pid").read_text().split()[0])


async def _submit_all(
    url: str, key: str, n: int, clients: int, failed: list[int]
) -> tuple[list[str], float]:
    """POST ``n`` runs from ``clients`` concurrent clients (a 429 waits its Retry-After; a
    5xx answer goes into ``failed``)."""
    import httpx

    ids: list[str] = []
    todo = iter(range(n))
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300
    ) as http:

        async def one() -> None:
            for _ in todo:
                while True:
                    res = await http.post("/v1/runs", json=CEILING_BODY)
                    if res.status_code != 429:
                        break
                    await asyncio.sleep(float(res.headers.get("Retry-After", "1")))
                if res.status_code >= 500:  # counted, not retried: the run may be admitted
                    failed.append(res.status_code)
                    continue
                res.raise_for_status()
                ids.append(res.json()["id"])

        t0 = time.monotonic()
        await asyncio.gather(*(one() for _ in range(clients)))
    return ids, time.monotonic() - t0


async def _org_rows(db_url: str, org: str) -> list[dict[str, Any]]:
    import sqlalchemy as sa

    from ephemeral.store import Store
    from ephemeral.store.schema import runs

    store = await Store.open(db_url)
    try:
        made = await store.orgs.get(org)
        async with store.engine.connect() as conn:
            got = await conn.execute(
                sa.select(
                    runs.c.status,
                    runs.c.created_at,
                    runs.c.settled_at,
                    runs.c.host,
                    runs.c.termination_reason,
                    runs.c.termination_detail,
                ).where(runs.c.org_id == made.id)
            )
            return [dict(r._mapping) for r in got]
    finally:
        await store.close()


def ceiling_load(
    name: str, url: str, key: str, org: str, db_url: str, meters: Meters, args: argparse.Namespace
) -> dict[str, Any]:
    """``args.ceiling_runs`` runs admitted through ``url``, until every one has settled: the
    admitted → settled rate and latency, and each component's CPU seconds per run."""
    idle_a = meters.read()
    time.sleep(args.idle)
    idle_b = meters.read()
    before = meters.read()
    t0 = time.monotonic()
    failed: list[int] = []
    ids, submit_wall = asyncio.run(_submit_all(url, key, args.ceiling_runs, args.clients, failed))
    deadline = time.monotonic() + 900
    while True:
        rows = asyncio.run(_org_rows(db_url, org))
        # every admitted run, also one whose POST answered 5xx (the outbox hands it over)
        if len(rows) >= len(ids) and all(r["settled_at"] is not None for r in rows):
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"{name}: runs did not settle: {len(rows)} rows")
        time.sleep(0.5)
    after = meters.read()
    created = sorted(float(r["created_at"].timestamp()) for r in rows)
    settled = sorted(float(r["settled_at"].timestamp()) for r in rows)
    lat = [float(r["settled_at"].timestamp() - r["created_at"].timestamp()) for r in rows]
    span = settled[-1] - created[0]
    n = len(rows)
    cpu = {k: (after[k] - before[k]) / n for k in after}
    idle = {k: (idle_b[k] - idle_a[k]) / args.idle for k in idle_b}
    by_host: dict[str, int] = {}
    for r in rows:
        by_host[str(r["host"])] = by_host.get(str(r["host"]), 0) + 1
    return {
        "name": name,
        "n": n,
        "wall": time.monotonic() - t0,
        "submit_wall": submit_wall,
        "runs_per_s": n / span,
        "admitted_per_s": n / max(1e-9, created[-1] - created[0]),
        "p50": pct(lat, 0.5),
        "p90": pct(lat, 0.9),
        "p99": pct(lat, 0.99),
        "failures": sum(1 for r in rows if r["status"] != "succeeded"),
        "server_errors": failed,
        "statuses": sorted({str(r["status"]) for r in rows}),
        "why": sorted(
            {
                f"{r['termination_reason']}: {str(r['termination_detail'])[:160]}"
                for r in rows
                if r["status"] != "succeeded"
            }
        ),
        "cpu": cpu,
        "cpu_total": sum(cpu.values()),
        "idle": idle,
        "by_host": by_host,
    }


def _print_load(r: dict[str, Any]) -> None:
    cpu = r["cpu"]
    idle = r["idle"]
    assert isinstance(cpu, dict) and isinstance(idle, dict)
    print(
        f"  {r['name']:22s} {r['runs_per_s']:6.2f} runs/s admitted->settled "
        f"(admitted {r['admitted_per_s']:.2f}/s)  latency p50 {r['p50']:.2f} s  "
        f"p90 {r['p90']:.2f} s  p99 {r['p99']:.2f} s  failures {r['failures']} "
        f"{r['statuses']}  runs by host {r['by_host']}  "
        f"POSTs answered 5xx: {len(r['server_errors'])}"
    )
    for why in r["why"]:
        print(f"    not succeeded: {why}")
    parts = "  ".join(f"{k} {v * 1000:.0f}" for k, v in cpu.items() if v > 0.0005)
    print(f"    CPU ms per run: {parts}  = {r['cpu_total'] * 1000:.0f} ms")
    busy = "  ".join(f"{k} {v:.2f}" for k, v in idle.items() if v > 0.005)
    print(f"    idle CPU (cores, {r['name']} before the load): {busy or '~0'}")


def ceiling_bench(args: argparse.Namespace) -> None:
    from tests.cluster.harness import Cluster
    from tests.fixtures_pg import PgCluster

    pg = PgCluster()
    reason = pg.unavailable()
    if reason:
        raise SystemExit(reason)
    pg.start()
    root = Path(tempfile.mkdtemp(prefix="scaleout-ceiling-"))
    prefect_db = pg.url(pg.create_database("prefect")) if args.prefect_db == "postgres" else None
    db_url = pg.url(pg.create_database("bench"))
    c = Cluster(
        root,
        db_url,
        lease_seconds=30,
        prefect_db_url=prefect_db,
        command=FAKE_CMD,
        extra_env={"EPHEMERAL_MAX_QUEUED_RUNS": "100000"},
    )
    workers = [int(w) for w in args.ceiling_workers.split(",")]
    results: list[dict[str, Any]] = []
    print(
        f"== the control plane's ceiling: {args.ceiling_runs} runs of replay/sandbox-proof on the "
        f"fake sandbox double, {args.clients} clients, store on PostgreSQL 15, Prefect server on "
        f"{args.prefect_db}; {os.cpu_count()} cores shared with other work "
        f"(load average at start {os.getloadavg()[0]:.1f})",
        flush=True,
    )
    try:
        c.start()
        pgpid = _postmaster(pg)
        # floor: the same runs, EPHEMERAL_EXECUTOR=plain, in one process (no Prefect)
        floor_db = pg.url(pg.create_database("floor"))
        floor_env = {
            "EPHEMERAL_DATABASE_URL": floor_db,
            "EPHEMERAL_EXECUTOR": "plain",
            "EPHEMERAL_MAX_CONCURRENT_RUNS": str(args.limit * 2),
        }
        port = _free_port()
        proc = c.spawn("plain", *FAKE_CMD, "serve", "--port", str(port), "--pool", "2", **floor_env)
        _wait_http(f"http://127.0.0.1:{port}", proc)
        floor_key = _make_key(floor_db, "floor")
        meters = Meters({"ephemeral serve (plain)": [proc.pid], "PostgreSQL": [pgpid]})
        results.append(
            ceiling_load(
                "floor: plain, 1 process",
                f"http://127.0.0.1:{port}",
                floor_key,
                "floor",
                floor_db,
                meters,
                args,
            )
        )
        _print_load(results[-1])
        c.kill("plain", 15)
        url = c.start_api()
        started = 0
        for w in workers:
            while started < w:
                started += 1
                c.start_worker(f"w{started}", limit=args.limit, pool=2)
            org = f"ceiling-{w}"
            key = c.make_key(org, 10_000_000_000)
            meters = Meters(
                {
                    "API": [c.procs["api"].pid],
                    "Prefect server": [p.pid for p in c.server.procs],
                    "PostgreSQL": [pgpid],
                    "workers": [c.procs[f"w{i}"].pid for i in range(1, started + 1)],
                }
            )
            results.append(
                ceiling_load(f"dispatch, {w} workers", url, key, org, db_url, meters, args)
            )
            _print_load(results[-1])
            if results[-1]["server_errors"]:  # why, from the API's log
                lines = c.tail("api", 200_000).splitlines()
                for line in [x for x in lines if "Error" in x or "Exception" in x][-6:]:
                    print(f"    api.log: {line[:300]}")
        _summary(results, args)
        print(f"  org reserved at the end: {[c.org_reserved(f'ceiling-{w}') for w in workers]}")
        sys.stdout.flush()
    finally:
        c.stop()
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


def _make_key(db_url: str, org: str) -> str:
    from ephemeral.store import Store

    async def go() -> str:
        store = await Store.open(db_url)
        try:
            made = await store.orgs.ensure(org)
            await store.orgs.credit(made.id, 10_000_000_000, note="ceiling")
            return (await store.keys.create(made.id, f"{org}@ceiling.test"))[1]
        finally:
            await store.close()

    return asyncio.run(go())


def _summary(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    floor, dispatched = results[0], results[1:]
    print("  ratios (dispatch / floor):")
    for r in dispatched:
        print(
            f"    {r['name']:22s} runs/s x{r['runs_per_s'] / floor['runs_per_s']:.2f}"
            f"  CPU per run x{r['cpu_total'] / floor['cpu_total']:.2f}"
            f"  p50 latency x{r['p50'] / floor['p50']:.2f}"
        )
    # one core per component: the runs/s it could carry alone (1 / CPU-s per run)
    print("  runs/s one core of each shared part could carry (1 / its CPU-s per run):")
    for r in dispatched:
        cpu = r["cpu"]
        assert isinstance(cpu, dict)
        parts = "  ".join(
            f"{k} {1 / v:.1f}" for k, v in cpu.items() if k != "bench clients" and v > 0
        )
        print(f"    {r['name']:22s} {parts}")


def _free_port() -> int:
    from tests.evals.prefect_server import free_port

    return free_port()


def _wait_http(url: str, proc: object) -> None:
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit(f"{url} never answered")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mechanisms", action="store_true")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--first-step", type=int, default=30)
    ap.add_argument("--throughput", type=int, default=200)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument(
        "--prefect-db",
        choices=("sqlite", "postgres"),
        default="sqlite",
        help="Prefect server's database (PostgreSQL: minutes of migrations first)",
    )
    ap.add_argument("--sessions", type=int, default=0, help="sequential sandbox sessions")
    ap.add_argument("--session-burst", type=int, default=100, help="sessions at once (0: none)")
    ap.add_argument("--level", default="namespaces", help="the sessions' isolation")
    ap.add_argument("--pause", type=float, default=0.5, help="between sequential sessions (s)")
    ap.add_argument("--ceiling", action="store_true", help="the control plane's ceiling")
    ap.add_argument("--ceiling-runs", type=int, default=200, help="runs per configuration")
    ap.add_argument("--ceiling-workers", default="2,4,8", help="worker processes, in turn")
    ap.add_argument("--limit", type=int, default=4, help="runs at once per worker (--ceiling)")
    ap.add_argument("--idle", type=float, default=5.0, help="idle CPU sample before a load (s)")
    args = ap.parse_args()
    if args.ceiling:
        ceiling_bench(args)
    elif args.sessions:
        sessions_bench(args)
    elif args.mechanisms:
        mechanisms(args.n)
    else:
        cluster_bench(args)


if __name__ == "__main__":
    main()
