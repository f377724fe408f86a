"""Sandbox benchmark: prints percentiles per driver next to the raw runtime floor (no asserts).

    .venv/bin/python bench/sandbox.py [--drivers namespaces,gvisor] [--n 20] [--tcg]

Per driver: cold start (create -> agent hello), warm-pool acquire, exec round trip of `true`,
PSS per idle sandbox (sum of /proc/PID/smaps_rollup over its host processes), destroy.
Raw floor, measured in the same run: a bare `bwrap ... true`, a bare `runsc do true`, each
again starting `python3 -I -S -c pass` (the floor of a python agent), and the host's own
fork+exec of `true` (the least any exec can cost).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.measure import pct, timed_proc
from ephemeral.sandbox import images, registry
from ephemeral.sandbox.base import Limits, Sandbox
from ephemeral.sandbox.pool import WarmPool
from ephemeral.settings import Settings


def fmt(xs: list[float], *ps: float) -> str:
    return " ".join(f"p{p:g}={pct(xs, p):8.2f}ms" for p in ps) + f"  (n={len(xs)})"


def pss_kib(pids: set[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


async def raw_floor(rootfs: Path, n: int) -> dict[str, list[float]]:
    bwrap = [
        "bwrap",
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--uid",
        "1000",
        "--gid",
        "1000",
        "--ro-bind",
        str(rootfs),
        "/",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",
        "/tmp",
        "--",
        "/bin/true",
    ]
    with tempfile.TemporaryDirectory() as root:
        runsc = ["runsc", f"--root={root}", "--network=none", "--platform=ptrace", "do", "true"]
        out = {
            "host fork+exec true": [await timed_proc(["/bin/true"]) for _ in range(n * 5)],
            "bare bwrap true": [await timed_proc(bwrap) for _ in range(n)],
            # the same plus the interpreter the agent needs: the floor of any python agent
            "bare bwrap python3": [
                await timed_proc([*bwrap[:-1], "/usr/bin/python3", "-I", "-S", "-c", "pass"])
                for _ in range(n)
            ],
            "bare runsc do true": [await timed_proc(runsc) for _ in range(max(5, n // 2))],
            # gVisor's floor for a python agent: the host's interpreter, started in the Sentry
            "bare runsc do python3": [
                await timed_proc([*runsc[:-1], "/usr/bin/python3", "-I", "-S", "-c", "pass"])
                for _ in range(max(5, n // 2))
            ],
        }
    return out


async def bench_driver(iso: str, settings: Settings, n: int) -> dict[str, list[float]]:
    driver = registry.get_driver(iso, settings)
    limits = Limits()
    res: dict[str, list[float]] = {
        "cold": [],
        "exec": [],
        "destroy": [],
        "pss": [],
        "warm": [],
        "acquire": [],
    }
    res["first"] = []  # create -> first exec reply (microVM: snapshot restore -> first answer)
    await (await driver.create(owner="bench", limits=limits)).destroy()  # page cache warm
    for _ in range(n):
        t0 = time.perf_counter()
        sbx = await driver.create(owner="bench", limits=limits)
        res["cold"].append((time.perf_counter() - t0) * 1000)
        await sbx.exec(["true"])
        res["first"].append((time.perf_counter() - t0) * 1000)
        await asyncio.sleep(0.05)
        res["pss"].append(pss_kib(getattr(sbx, "host_pids", set())) / 1024)
        t0 = time.perf_counter()
        await sbx.destroy()
        res["destroy"].append((time.perf_counter() - t0) * 1000)
    sbx = await driver.create(owner="bench", limits=limits)
    for _ in range(10):
        await sbx.exec(["true"])
    for _ in range(n * 10):
        t0 = time.perf_counter()
        await sbx.exec(["true"])
        res["exec"].append((time.perf_counter() - t0) * 1000)
    await sbx.destroy()
    pool = WarmPool(driver, size=2, limits=limits)
    await pool.start()
    try:
        for _ in range(n):
            await pool.wait_ready(timeout=120)
            t0 = time.perf_counter()
            got: Sandbox = await pool.acquire("bench")
            res["acquire"].append((time.perf_counter() - t0) * 1000)
            r = await got.exec(["true"])  # time to ready = acquire + first answer
            res["warm"].append((time.perf_counter() - t0) * 1000)
            assert r.exit_code == 0
            await got.destroy()
    finally:
        await pool.close()
    return res


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drivers", default="namespaces,gvisor")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--tcg", action="store_true", help="also microvm-tcg (slow)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ephemeral-bench-") as state:
        settings = Settings.load(state_dir=state, use_prefect=False)
        rootfs = await images.ensure_image(settings)
        floor = await raw_floor(rootfs, args.n)
        print("raw runtime floor")
        for k, v in floor.items():
            print(f"  {k:<22} {fmt(v, 50, 95)}")
        host = pct(floor["host fork+exec true"], 50)
        # namespaces: against bwrap alone and against bwrap + the interpreter the agent needs
        raw_start = {
            "namespaces": [
                ("bare bwrap true", pct(floor["bare bwrap true"], 50)),
                ("bare bwrap python3", pct(floor["bare bwrap python3"], 50)),
            ],
            "gvisor": [
                ("bare runsc do true", pct(floor["bare runsc do true"], 50)),
                ("bare runsc do python3", pct(floor["bare runsc do python3"], 50)),
            ],
        }
        drivers = args.drivers.split(",") + (["microvm-tcg"] if args.tcg else [])
        for iso in drivers:
            why = await registry.probe_level(iso, settings)
            if why is not None:
                print(f"\n{iso}: skipped ({why})")
                continue
            r = await bench_driver(iso, settings, args.n)
            print(f"\n{iso}")
            print(f"  cold start (to hello)  {fmt(r['cold'], 50, 95)}")
            print(f"  cold + first exec      {fmt(r['first'], 50, 95)}")
            print(f"  warm acquire           {fmt(r['acquire'], 50, 99)}")
            print(f"  warm acquire + exec    {fmt(r['warm'], 50, 99)}")
            print(f"  exec `true` round trip {fmt(r['exec'], 50, 95)}")
            print(f"  destroy                {fmt(r['destroy'], 50, 95)}")
            print(f"  PSS per idle sandbox   median={statistics.median(r['pss']):.1f} MiB")
            for label, raw in raw_start.get(iso, []):
                print(f"  ratio cold/{label:<18} {pct(r['cold'], 50) / raw:.2f}x")
            print(f"  ratio exec/host exec   {pct(r['exec'], 50) / host:.2f}x")


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
