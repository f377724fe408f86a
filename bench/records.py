"""Benchmark the recorded-runs store at 1,000,000 runs. Prints numbers; asserts nothing.

    .venv/bin/python bench/records.py [--runs 1000000] [--days 60] [--hosts 4] [--fresh 1000]

1. Generates N synthetic runs (and their steps) in the real layout the way compaction leaves
   them: one zstd ``compacted.parquet`` per (kind, date, host). Writing a million tiny files
   would only measure the file system.
2. Writes ``--fresh`` runs (3 files each) through the real ``write_run``, two thirds into last
   week's partitions and the rest into today's, and times the aggregate before compaction.
3. Compacts old partitions, then today's too, and times "cost by model and recipe for the last
   30 days" (p50 over ``--repeat`` runs through ``Records.query``) and point lookups by run_id.
4. Baseline in the same process: the same aggregate over an in-memory DuckDB table.

Everything lives in a temp directory that is deleted at the end (unless ``--keep``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb

from ephemeral.ids import new_run_id
from ephemeral.records import EventRecord, Records, RunRecord, StepRecord, write_run
from ephemeral.records.schema import columns, partition_dir

MODELS = [
    "openai/gpt-6-luna",
    "openai/gpt-6-mini",
    "anthropic/claude-sonnet-5",
    "openrouter/llama-4-70b",
    "replay/sandbox-proof",
]

# SQL for each stored column of a generated run; ``g`` is the global run number, ``i`` the
# number within the partition, ``$1`` the partition's day start, ``$2`` its run count.
RUN_EXPR = {
    "run_id": "'run_' || md5(g::VARCHAR)",
    "org_id": "'org_' || (g % 17)",
    "created_at": "$1::TIMESTAMPTZ + to_microseconds((i * (86400000000 // $2))::BIGINT)",
    "started_at": "$1::TIMESTAMPTZ + to_microseconds((i * (86400000000 // $2))::BIGINT + 900000)",
    "ended_at": "$1::TIMESTAMPTZ + to_microseconds((i * (86400000000 // $2))::BIGINT + 900000 "
    "+ 1000 * (2000 + g % 60000))",
    "status": "CASE g % 20 WHEN 0 THEN 'failed' WHEN 1 THEN 'timed_out' "
    "WHEN 2 THEN 'budget_exhausted' ELSE 'succeeded' END",
    "termination_reason": "CASE g % 20 WHEN 0 THEN 'infra_error' ELSE NULL END",
    "model": f"({MODELS!r})[1 + g % {len(MODELS)}]",
    "isolation": "'gvisor'",
    "recipe": "CASE WHEN g % 4 = 0 THEN NULL ELSE 'recipe-' || (g % 25) END",
    "recipe_cell": "'{\"n\": ' || (g % 7) || '}'",
    "repeat_index": "g % 3",
    "suite_run_id": "NULL",
    "zero_data_retention": "g % 10 = 0",
    "prompt": "CASE WHEN g % 10 = 0 THEN NULL ELSE 'List the primes below ' || (g % 1000) END",
    "output": "CASE WHEN g % 10 = 0 THEN NULL "
    "ELSE 'The primes below ' || (g % 1000) || ' are …' END",
    "model_calls": "1 + g % 7",
    "input_tokens": "800 + (g * 7919) % 6000",
    "output_tokens": "100 + (g * 104729) % 900",
    "reserved_micros": "40000",
    "model_micros": "((800 + (g * 7919) % 6000) * 2 + (100 + (g * 104729) % 900) * 8) // 10",
    "web_micros": "CASE WHEN g % 5 = 0 THEN 30 ELSE 0 END",
    "compute_micros": "(2000 + g % 60000) // 40",
    "charged_micros": "((800 + (g * 7919) % 6000) * 2 + (100 + (g * 104729) % 900) * 8) // 10 "
    "+ CASE WHEN g % 5 = 0 THEN 30 ELSE 0 END + (2000 + g % 60000) // 40",
    "refunded_micros": "40000 - (((800 + (g * 7919) % 6000) * 2 "
    "+ (100 + (g * 104729) % 900) * 8) // 10 "
    "+ CASE WHEN g % 5 = 0 THEN 30 ELSE 0 END + (2000 + g % 60000) // 40)",
    "duration_ms": "2000 + g % 60000",
    "checks": "NULL",
    "host": "$3",
    "schema_version": "1",
}
STEP_EXPR = {
    "run_id": "'run_' || md5(g::VARCHAR)",
    "seq": "2 + s * 2",
    "step_kind": "CASE WHEN s % 2 = 0 THEN 'model' ELSE 'shell' END",
    "at": "$1::TIMESTAMPTZ "
    "+ to_microseconds((i * (86400000000 // $2))::BIGINT + 1000000 * (s + 1))",
    "duration_ms": "40 + (g + s) % 900",
    "command": "CASE WHEN s % 2 = 1 AND g % 10 <> 0 THEN 'python3 primes.py ' || (g % 1000) END",
    "exit_code": "CASE WHEN s % 2 = 1 THEN (g % 9 = 0)::INTEGER END",
    "stdout": "CASE WHEN s % 2 = 1 AND g % 10 <> 0 THEN '2 3 5 7 11 13 …' END",
    "stderr": "CASE WHEN s % 2 = 1 AND g % 10 <> 0 THEN '' END",
    "truncated": "CASE WHEN s % 2 = 1 THEN false END",
    "model": f"CASE WHEN s % 2 = 0 THEN ({MODELS!r})[1 + g % {len(MODELS)}] END",
    "input_tokens": "CASE WHEN s % 2 = 0 THEN 400 + (g * 31) % 3000 END",
    "output_tokens": "CASE WHEN s % 2 = 0 THEN 50 + (g * 17) % 450 END",
    "cost_micros": "CASE WHEN s % 2 = 0 THEN 100 + (g * 13) % 2000 ELSE 0 END",
    "schema_version": "1",
}


def _select(kind: str, exprs: dict[str, str]) -> str:
    return ", ".join(f'CAST({exprs[phys]} AS {typ}) AS "{phys}"' for _, phys, typ in columns(kind))


def generate(root: Path, runs: int, days: int, hosts: int, steps_per_run: int, today: date) -> None:
    con = duckdb.connect()
    con.execute("SET preserve_insertion_order = false")
    partitions = [
        (today - timedelta(days=d), f"host{h}") for d in range(days) for h in range(hosts)
    ]
    per, extra = divmod(runs, len(partitions))
    offset = 0
    run_sql = _select("runs", RUN_EXPR)
    step_sql = _select("steps", STEP_EXPR)
    for n, (day, host) in enumerate(partitions):
        count = per + (1 if n < extra else 0)
        start = datetime(day.year, day.month, day.day, tzinfo=UTC)
        params = [start, count, host]
        for kind, sql, source, order in (
            ("runs", run_sql, f"(SELECT i, {offset} + i AS g FROM range({count}) r(i))", "run_id"),
            (
                "steps",
                step_sql,
                f"(SELECT j // {steps_per_run} AS i, j % {steps_per_run} AS s, "
                f"{offset} + j // {steps_per_run} AS g FROM range({count * steps_per_run}) r(j))",
                "run_id, seq",
            ),
        ):
            target = partition_dir(root, kind, day, host)
            target.mkdir(parents=True, exist_ok=True)
            con.execute(
                f"COPY (SELECT {sql} FROM {source} ORDER BY {order}) TO "
                f"'{target / 'compacted.parquet'}' (FORMAT parquet, COMPRESSION zstd)",
                params if kind == "runs" else params[:2],
            )
        offset += count
    con.close()


def fresh_run(
    created: datetime, host: str
) -> tuple[RunRecord, list[StepRecord], list[EventRecord]]:
    run_id = new_run_id()
    run = RunRecord(
        run_id=run_id,
        org_id="org_1",
        created_at=created,
        started_at=created,
        ended_at=created + timedelta(seconds=8),
        status="succeeded",
        termination_reason=None,
        model=MODELS[hash(run_id) % len(MODELS)],
        isolation="gvisor",
        recipe="recipe-1",
        zero_data_retention=False,
        prompt="List the primes below 20",
        output="2 3 5 7 11 13 17 19",
        model_calls=2,
        input_tokens=1500,
        output_tokens=200,
        reserved_micros=40000,
        charged_micros=3530,
        refunded_micros=36470,
        model_micros=3000,
        web_micros=30,
        compute_micros=500,
        duration_ms=8000,
        host=host,
    )
    steps = [
        StepRecord(
            run_id=run_id,
            seq=2 + 2 * s,
            kind="model" if s % 2 == 0 else "shell",
            at=created + timedelta(seconds=s),
            duration_ms=50,
            command="python3 p.py",
            exit_code=0,
            stdout="2 3 5 7",
            stderr="",
            truncated=False,
            model=None,
            input_tokens=None,
            output_tokens=None,
            cost_micros=100,
        )
        for s in range(3)
    ]
    events = [
        EventRecord(
            run_id=run_id,
            seq=k,
            type="shell.executed",
            at=created + timedelta(seconds=k),
            data='{"command": "python3 p.py"}',
        )
        for k in range(1, 9)
    ]
    return run, steps, events


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float, Any]:
    """(p50 seconds, max seconds, last result)."""
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), max(times), result


def report(label: str, p50: float, worst: float, extra: str = "") -> None:
    print(f"{label:<33}{p50 * 1000:7.0f} ms p50 (max {worst * 1000:.0f})   {extra}")


def tree_size(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*.parquet")]
    return len(files), sum(p.stat().st_size for p in files)


AGG = (
    "SELECT model, coalesce(recipe, '(none)') AS recipe, count(*) AS runs, "
    "sum(charged_micros) AS charged_micros, sum(model_micros) AS model_micros, "
    "sum(web_micros) AS web_micros, sum(compute_micros) AS compute_micros "
    "FROM {table} WHERE \"date\" >= DATE '{cutoff_date}' AND created_at >= TIMESTAMPTZ '{cutoff}' "
    "GROUP BY 1, 2 ORDER BY charged_micros DESC"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1_000_000)
    ap.add_argument("--days", type=int, default=60)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--steps-per-run", type=int, default=3)
    ap.add_argument("--fresh", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="ephemeral-bench-records-", dir=args.dir))
    now = datetime.now(UTC)
    cutoff = now - timedelta(days=30)
    agg = AGG.format(table="{table}", cutoff_date=cutoff.date(), cutoff=cutoff.isoformat())
    print(
        f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())} "
        f"on {os.cpu_count()} CPUs"
    )
    print(
        f"records bench: {args.runs:,} runs, {args.days} days x {args.hosts} hosts, "
        f"{args.steps_per_run} steps/run, {args.fresh:,} fresh runs; dir {root}"
    )
    try:
        t0 = time.perf_counter()
        generate(root, args.runs, args.days, args.hosts, args.steps_per_run, now.date())
        files, size = tree_size(root)
        print(
            f"generate (compacted layout)      {time.perf_counter() - t0:7.1f} s   "
            f"{files} files, {size / 1e6:.0f} MB"
        )

        t0 = time.perf_counter()
        for k in range(args.fresh):
            # two thirds land in last week's (already compacted) partitions, the rest today
            days_back = 1 + k % 7 if k % 3 else 0
            created = now - timedelta(days=days_back, seconds=k)
            write_run(root, *fresh_run(created, f"host{k % args.hosts}"))
        elapsed = time.perf_counter() - t0
        print(
            f"write_run x {args.fresh:<6}               {elapsed:7.1f} s   "
            f"{1000 * elapsed / max(args.fresh, 1):.1f} ms/run (3 files)"
        )

        records = Records(root)

        def aggregate() -> list[tuple[Any, ...]]:
            return records.query(agg.format(table="runs"))[1]

        p50, worst, rows = timed(aggregate, max(3, args.repeat // 2))
        report("aggregate before compaction", p50, worst, f"{tree_size(root)[0]} files")

        t0 = time.perf_counter()
        merged = records.compact(older_than_days=1)
        print(
            f"compact --older-than-days 1      {time.perf_counter() - t0:7.1f} s   "
            f"{merged} files merged, {tree_size(root)[0]} files left (today's stay fresh)"
        )
        p50, worst, rows = timed(aggregate, max(3, args.repeat // 2))
        report("aggregate, today's runs fresh", p50, worst)

        t0 = time.perf_counter()
        merged = records.compact(older_than_days=0)
        print(
            f"compact --older-than-days 0      {time.perf_counter() - t0:7.1f} s   "
            f"{merged} files merged, {tree_size(root)[0]} files left"
        )

        p50, worst, rows = timed(aggregate, args.repeat)
        runs_30d = sum(r[2] for r in rows)
        report(
            "cost by model+recipe, 30 days",
            p50,
            worst,
            f"{len(rows)} groups, {runs_30d:,} runs   [target <= 1000 ms]",
        )
        cp50, cworst, _ = timed(lambda: records.costs("model", timedelta(days=30)), args.repeat)
        report("Records.costs('model', 30d)", cp50, cworst)

        _, ids = records.query('SELECT run_id FROM runs WHERE "date" = current_date - 12 LIMIT 1')
        run_id = ids[0][0]
        lp50, lworst, hit = timed(
            lambda: records.query(f"SELECT * FROM runs WHERE run_id = '{run_id}'")[1],
            args.repeat,
        )
        report("point lookup runs by run_id", lp50, lworst, f"{len(hit)} row")
        sp50, sworst, hit = timed(
            lambda: records.query(f"SELECT * FROM steps WHERE run_id = '{run_id}'")[1],
            args.repeat,
        )
        report("point lookup steps by run_id", sp50, sworst, f"{len(hit)} rows")
        con = records.connect()
        dp50, dworst, hit = timed(
            lambda: con.execute(
                f"SELECT * FROM runs WHERE \"date\" = current_date - 12 AND run_id = '{run_id}'"
            ).fetchall(),
            args.repeat,
        )
        report("point lookup with date, warm con", dp50, dworst)

        t0 = time.perf_counter()
        con.execute("CREATE TABLE runs_mem AS SELECT * FROM runs")
        print(f"baseline: load into DuckDB table {time.perf_counter() - t0:7.1f} s")
        bp50, bworst, brows = timed(
            lambda: con.execute(agg.format(table="runs_mem")).fetchall(), args.repeat
        )
        agrees = "same rows" if sorted(brows) == sorted(rows) else "DIFFERENT ROWS"
        report("baseline aggregate, memory table", bp50, bworst, agrees)
        print(f"ratio records / baseline         {p50 / bp50:7.1f} x")
        bl50, _, _ = timed(
            lambda: con.execute(f"SELECT * FROM runs_mem WHERE run_id = '{run_id}'").fetchall(),
            args.repeat,
        )
        print(f"baseline point lookup            {bl50 * 1000:7.0f} ms p50")
        con.close()
        print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
