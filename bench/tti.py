"""Time to interactive through the public API: sandbox sessions and runs, sequential and burst.

    .venv/bin/python bench/tti.py [--levels gvisor,namespaces] [--n 30] [--burst 100]
                                  [--what sessions,runs] [--pool 2] [--no-prefect]

Measured the way the public cross-provider sandbox benchmark does it, on loopback:

- **sessions, sequential**: ``POST /v1/sandboxes`` (isolation named explicitly) then
  ``POST /v1/sandboxes/{id}/exec`` of ``python3 -V``; the time from sending the create to the
  exec's reply, p50 / p95 / p99 with 5 % trimmed at each end; the session is deleted and the
  warm pool given ``--pause`` s to refill before the next.
- **sessions, burst**: ``--burst`` creates sent at once, each followed by its exec: p50 and max
  ("all interactive") of the time from the burst's start to each exec reply, and failures
  (create not 201 running, exec not 200 with exit 0).
- **runs, sequential**: accepted (the run's ``created_at``) → ``worker.started`` (the moment the
  agent can act), over the seed-shaped request followed on its SSE stream.
- **runs, burst**: ``--burst`` runs POSTed at once: burst start → each ``worker.started``.

The floors, measured in this process in the same sitting: the bare runtime (``runsc do true``
for gvisor, ``bwrap ... true`` for namespaces: p50 of ``--n`` one after another, and
``--burst`` of them at once), an exec on the in-process fake driver (the cost of the host side
of an exec with no sandbox), the bare driver with a warm pool of the same size (acquire + exec
``python3 -V``, sequential), and ``--burst`` bare creates + exec at once, each failure's reason
printed. One ``ephemeral serve`` subprocess per level (Prefect on unless
``--no-prefect``; slots and queue sized to the burst). Asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.measure import timed_proc
from bench.served import (
    SEED_BODY,
    at,
    event_at,
    follow,
    make_key,
    pct,
    post_run,
    serve,
    trimmed,
)
from ephemeral.sandbox.base import Limits
from ephemeral.sandbox.pool import WarmPool
from ephemeral.sandbox.registry import get_driver
from ephemeral.settings import Settings

PROBE = ["python3", "-V"]


def seq_line(label: str, ms: list[float]) -> str:
    t = trimmed(ms)
    return (
        f"  {label:<34} n={len(ms):<3} p50 {pct(t, 50):7.1f}  p95 {pct(t, 95):7.1f}  "
        f"p99 {pct(t, 99):7.1f} ms"
    )


def burst_line(label: str, ms: list[float], failures: int, n: int) -> str:
    return (
        f"  {label:<34} n={n:<3} p50 {pct(ms, 50) / 1000:6.2f} s  all interactive "
        f"{(max(ms) if ms else float('nan')) / 1000:6.2f} s  failures {failures}/{n}"
    )


# the floor: the bare driver in this process ------------------------------------------------
async def floor_sequential(level: str, n: int, pool_size: int, pause: float) -> list[float]:
    state = Path(tempfile.mkdtemp(prefix=f"ephemeral-tti-floor-{level}-"))
    driver = get_driver(level, Settings.load(state_dir=state))
    pool = WarmPool(driver, pool_size, Limits(lifetime_seconds=130))
    await pool.start()
    out = []
    try:
        for _ in range(n):
            await pool.wait_ready(120)
            t0 = time.monotonic()
            sbx = await pool.acquire("floor", Limits(lifetime_seconds=130))
            res = await sbx.exec(PROBE, timeout=30)
            out.append((time.monotonic() - t0) * 1000)
            assert res.exit_code == 0, res
            await sbx.destroy()
            await asyncio.sleep(pause)
    finally:
        await pool.close()
    return out


async def floor_burst(level: str, n: int) -> tuple[list[float], int]:
    state = Path(tempfile.mkdtemp(prefix=f"ephemeral-tti-floorburst-{level}-"))
    driver = get_driver(level, Settings.load(state_dir=state))
    t0 = time.monotonic()

    whys: dict[str, int] = {}

    def failed(why: str) -> None:
        whys[why[:160]] = whys.get(why[:160], 0) + 1

    async def one() -> float | None:
        try:
            sbx = await driver.create(owner="floor", limits=Limits(lifetime_seconds=300))
        except Exception as exc:
            failed(f"create: {exc}")
            return None
        try:
            res = await sbx.exec(PROBE, timeout=120)
            if res.exit_code != 0:
                failed(f"exec exit {res.exit_code}")
            return (time.monotonic() - t0) * 1000 if res.exit_code == 0 else None
        except Exception as exc:
            failed(f"exec: {exc}")
            return None
        finally:
            try:
                await sbx.destroy()
            except Exception as exc:  # a teardown slowed past its deadline by the load
                failed(f"destroy: {exc}")

    got = await asyncio.gather(*(one() for _ in range(n)))
    for why, count in whys.items():
        print(f"    floor burst failures: {count} x {why}")
    ok = [g for g in got if g is not None]
    return ok, n - len(ok)


def bare_argv(level: str, rootfs: Path, root: str) -> list[str]:
    """The runtime alone starting ``true``: the floor of a cold start on ``level``."""
    if level == "gvisor":
        return ["runsc", f"--root={root}", "--network=none", "--platform=ptrace", "do", "true"]
    return [
        *("bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"),
        *("--ro-bind", str(rootfs), "/", "--proc", "/proc", "--dev", "/dev", "--", "/bin/true"),
    ]


async def floor_bare(level: str, n: int, burst: int) -> tuple[list[float], list[float]]:
    """(ms of ``n`` bare runtime starts one after another, ms to each of ``burst`` at once)."""
    from ephemeral.sandbox import images

    settings = Settings.load()
    rootfs = await images.ensure_image(settings, settings.image)
    with tempfile.TemporaryDirectory() as root:
        argv = bare_argv(level, rootfs, root)
        seq = [await timed_proc(argv) for _ in range(n)]
        t0 = time.monotonic()

        async def one() -> float:
            await timed_proc(argv)
            return (time.monotonic() - t0) * 1000

        at_once = list(await asyncio.gather(*(one() for _ in range(burst)))) if burst else []
    return seq, at_once


async def floor_fake_exec(n: int) -> list[float]:
    """An exec on the in-process fake driver: the host side of an exec without a sandbox."""
    from ephemeral.testing.sandbox import FakeDriver

    sbx = await FakeDriver().create(owner="floor", limits=Limits(lifetime_seconds=60))
    out = []
    try:
        for _ in range(n):
            t0 = time.monotonic()
            await sbx.exec(PROBE, timeout=30)
            out.append((time.monotonic() - t0) * 1000)
    finally:
        await sbx.destroy()
    return out


# sessions through the API ------------------------------------------------------------------
async def session_once(
    client: httpx.AsyncClient, level: str, t0: float
) -> tuple[float | None, str | None, str | None]:
    """(ms from t0 to the exec reply or None, the session id, why it failed)."""
    try:
        return await _session_once(client, level, t0)
    except httpx.HTTPError as exc:
        return None, None, f"transport {type(exc).__name__}"


async def _session_once(
    client: httpx.AsyncClient, level: str, t0: float
) -> tuple[float | None, str | None, str | None]:
    r = await client.post(
        "/v1/sandboxes",
        json={"isolation": level, "timeout_seconds": 120, "max_cost_micros": 40000},
        headers={"Idempotency-Key": f"tti-{uuid.uuid4().hex}"},
    )
    if r.status_code != 201:
        return None, None, f"create {r.status_code}"
    session = r.json()
    if session["status"] != "running":
        return None, session["id"], f"create {session['status']}"
    e = await client.post(f"/v1/sandboxes/{session['id']}/exec", json={"command": PROBE})
    done = (time.monotonic() - t0) * 1000
    if e.status_code != 200:
        return None, session["id"], f"exec {e.status_code}: {e.text[:200]}"
    if e.json()["exit_code"] != 0:
        return None, session["id"], f"exec exit {e.json()['exit_code']}"
    return done, session["id"], None


async def sessions_sequential(
    client: httpx.AsyncClient, level: str, n: int, pause: float
) -> list[float]:
    out = []
    for _ in range(n + 1):  # the first warms caches and the pool (not counted)
        ms, sid, why = await session_once(client, level, time.monotonic())
        if sid is not None:
            await client.delete(f"/v1/sandboxes/{sid}")
        if why is not None:
            print(f"    session failed: {why}")
        elif ms is not None:
            out.append(ms)
        await asyncio.sleep(pause)
    return out[1:]


async def sessions_burst(client: httpx.AsyncClient, level: str, n: int) -> tuple[list[float], int]:
    t0 = time.monotonic()
    got = await asyncio.gather(*(session_once(client, level, t0) for _ in range(n)))
    whys: dict[str, int] = {}
    for _, _, why in got:
        if why is not None:
            whys[why.split(":")[0]] = whys.get(why.split(":")[0], 0) + 1
    if whys:
        print(f"    burst failures: {whys}; first: {next(w for _, _, w in got if w)}")
    await asyncio.gather(*(client.delete(f"/v1/sandboxes/{sid}") for _, sid, _ in got if sid))
    ok = [ms for ms, _, why in got if why is None and ms is not None]
    return ok, n - len(ok)


# runs through the API ----------------------------------------------------------------------
async def run_once(
    client: httpx.AsyncClient, body: dict[str, Any], t0_wall: float | None
) -> tuple[float | None, str]:
    """(ms to worker.started: from accepted, or from ``t0_wall`` when given; final status)."""
    try:
        return await _run_once(client, body, t0_wall)
    except httpx.HTTPError as exc:
        return None, f"transport {type(exc).__name__}"


async def _run_once(
    client: httpx.AsyncClient, body: dict[str, Any], t0_wall: float | None
) -> tuple[float | None, str]:
    """(ms to worker.started: from accepted, or from ``t0_wall`` when given; final status)."""
    run, _ = await post_run(client, body, f"tti-{uuid.uuid4().hex}")
    if run is None:
        return None, "never-admitted"
    events = await follow(client, run["id"])
    status = (await client.get(f"/v1/runs/{run['id']}")).json().get("status", "?")
    started = event_at(events, "worker.started")
    if started is None:
        return None, status
    origin = t0_wall if t0_wall is not None else at(run["created_at"]).timestamp()  # type: ignore[union-attr]
    return (started.timestamp() - origin) * 1000, status


async def runs_sequential(
    client: httpx.AsyncClient, body: dict[str, Any], n: int, pause: float
) -> list[float]:
    out = []
    for i in range(n + 1):
        ms, status = await run_once(client, body, None)
        if status != "succeeded":
            print(f"    run ended {status}")
        if ms is not None and i > 0:
            out.append(ms)
        await asyncio.sleep(pause)
    return out


async def runs_burst(
    client: httpx.AsyncClient, body: dict[str, Any], n: int
) -> tuple[list[float], int]:
    t0 = time.time()
    got = await asyncio.gather(*(run_once(client, body, t0) for _ in range(n)))
    ok = [ms for ms, status in got if ms is not None and status == "succeeded"]
    bad = [status for ms, status in got if ms is None or status != "succeeded"]
    if bad:
        print(f"    burst runs not succeeded: {bad[:5]}")
    return ok, n - len(ok)


def client_for(url: str, key: str, burst: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=url,
        timeout=httpx.Timeout(300),
        limits=httpx.Limits(max_connections=burst * 2 + 8, max_keepalive_connections=burst + 8),
        headers={"Authorization": f"Bearer {key}"},
    )


async def level_bench(args: argparse.Namespace, level: str) -> None:
    print(f"== {level}", flush=True)
    bare_seq, bare_burst = await floor_bare(level, args.n, args.burst)
    bare = "runsc do true" if level == "gvisor" else "bwrap true"
    print(seq_line(f"floor: bare {bare}", bare_seq), flush=True)
    print(seq_line("floor: fake driver exec (in process)", await floor_fake_exec(args.n)))
    floor_seq = await floor_sequential(level, args.n, args.pool, args.pause)
    print(seq_line("floor: warm pool acquire + exec", floor_seq), flush=True)
    state = Path(tempfile.mkdtemp(prefix=f"ephemeral-tti-{level}-"))
    key = await make_key(Settings.load(state_dir=state))
    env = {
        "EPHEMERAL_EXECUTOR": "plain" if args.no_prefect else "flow",
        "EPHEMERAL_ISOLATION": level,
        "EPHEMERAL_MAX_CONCURRENT_RUNS": str(max(8, args.burst)),
        "EPHEMERAL_MAX_QUEUED_RUNS": str(max(64, args.burst * 2)),
    }
    served = serve(state, pool=args.pool, env=env)
    try:
        async with client_for(served.url, key, args.burst) as client:
            if "sessions" in args.what:
                seq = await sessions_sequential(client, level, args.n, args.pause)
                print(seq_line("sessions: create → first exec reply", seq), flush=True)
            if "runs" in args.what:
                body = {**SEED_BODY, "isolation": level}
                seq = await runs_sequential(client, body, args.n, args.pause)
                print(seq_line("runs: accepted → worker.started", seq), flush=True)
        # A fresh client for the bursts: a keep-alive connection the server timed out while
        # the floor ran would fail the first request sent on it.
        async with client_for(served.url, key, args.burst) as client:
            if args.burst:
                print(
                    burst_line(
                        f"floor: {args.burst} bare {bare} at once", bare_burst, 0, args.burst
                    )
                )
                ms, failed = await floor_burst(level, args.burst)
                print(burst_line("floor: bare create + exec at once", ms, failed, args.burst))
                await asyncio.sleep(3)
                if "sessions" in args.what:
                    ms, failed = await sessions_burst(client, level, args.burst)
                    print(burst_line("sessions burst: → exec reply", ms, failed, args.burst))
                    await asyncio.sleep(3)
                if "runs" in args.what:
                    ms, failed = await runs_burst(
                        client, {**SEED_BODY, "isolation": level}, args.burst
                    )
                    print(burst_line("runs burst: → worker.started", ms, failed, args.burst))
        fails = served.log.read_text(errors="replace").count("execution failed")
        if fails:
            print(f"    server log: {fails} 'execution failed' lines ({served.log})")
    finally:
        served.stop()


async def main_async(args: argparse.Namespace) -> None:
    for level in args.levels:
        await level_bench(args, level)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--levels", default="gvisor,namespaces")
    ap.add_argument("--n", type=int, default=30, help="sequential samples")
    ap.add_argument("--burst", type=int, default=100, help="sessions/runs at once (0: none)")
    ap.add_argument("--what", default="sessions,runs")
    ap.add_argument("--pool", type=int, default=2, help="warm sandboxes")
    ap.add_argument("--pause", type=float, default=1.0, help="s between sequential samples")
    ap.add_argument("--no-prefect", action="store_true")
    args = ap.parse_args()
    args.levels = args.levels.split(",")
    args.what = args.what.split(",")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
