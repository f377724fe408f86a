"""The writable root on disk against the tmpfs one: sandbox start and what a task's writes cost,
in the same sitting (prints percentiles and the disk/tmpfs ratio of p50s; asserts nothing).

    .venv/bin/python bench/writable_disk.py [--levels gvisor,namespaces] [--n 8]

Per level, ``--n`` rounds; each round starts one sandbox of each variant in turn (alternated,
so the load's drift touches both alike), both with 1024 MiB of memory:

- ``tmpfs``: ``disk_mib=256`` (the default; a tmpfs, ``disk_tmpfs_max_mib``);
- ``disk``: ``disk_mib=1024``, an ext4 file on a loop device (``writable_root.make_disk``).

and measures, in it: its start (``create`` until the agent's hello, host side), a 128 MiB
sequential write (``dd bs=1M``, as a task sees it: no fsync), the same with ``conv=fsync``
(what reaches the disk), a tree of small files (``cp -a /usr/share/perl5 /var/c``: a
compile-like metadata load), and its destroy.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.measure import pct
from ephemeral.sandbox import images, registry
from ephemeral.sandbox.base import Limits, Sandbox
from ephemeral.settings import Settings

VARIANTS = {
    "tmpfs": Limits(memory_mib=1024, disk_mib=256),
    "disk": Limits(memory_mib=1024, disk_mib=1024),
}
MS = r"(\d+)"


async def elapsed_ms(sbx: Sandbox, command: str) -> float:
    """``command``'s time inside the sandbox (its own clock: no exec round trip counted)."""
    res = await sbx.exec(
        f"s=$(date +%s%N); {command} >/dev/null 2>&1; e=$(date +%s%N); echo $(((e-s)/1000))",
        user="root",
        timeout=300,
    )
    if res.exit_code != 0 or not re.fullmatch(r"\d+\n", res.stdout):
        raise SystemExit(f"{command!r} failed: {res}")
    return int(res.stdout) / 1000


async def one(driver: object, limits: Limits, seen: dict[str, list[float]]) -> None:
    t0 = time.perf_counter()
    sbx: Sandbox = await driver.create(owner="bench", limits=limits)  # type: ignore[attr-defined]
    seen["start ms"].append((time.perf_counter() - t0) * 1000)
    try:
        for name, cmd in [
            ("write 128 MiB ms", "dd if=/dev/zero of=/var/w bs=1M count=128; rm /var/w"),
            ("write+fsync 128 MiB ms", "dd if=/dev/zero of=/var/w bs=1M count=128 conv=fsync"),
            ("cp -a perl5 ms", "cp -a /usr/share/perl5 /var/c && rm -r /var/c"),
        ]:
            seen[name].append(await elapsed_ms(sbx, cmd))
    finally:
        t0 = time.perf_counter()
        await sbx.destroy()
        seen["destroy ms"].append((time.perf_counter() - t0) * 1000)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="gvisor,namespaces")
    ap.add_argument("--n", type=int, default=8)
    args = ap.parse_args()
    settings = Settings.load(state_dir=Path(tempfile.mkdtemp(prefix="bench-disk-")))
    await images.ensure_image(settings)
    for level in args.levels.split(","):
        why = await registry.probe_level(level, settings)
        if why is not None:
            print(f"{level}: skipped ({why})")
            continue
        driver = registry.get_driver(level, settings)
        await one(driver, VARIANTS["disk"], {k: [] for k in _METRICS})  # warm: helper, caches
        results = {v: {k: [] for k in _METRICS} for v in VARIANTS}
        for _ in range(args.n):
            for variant, limits in VARIANTS.items():
                await one(driver, limits, results[variant])
        print(f"\n{level} (n={args.n}; p50 / p90 / max, ms; ratio = disk p50 / tmpfs p50)")
        for metric in _METRICS:
            row = [f"  {metric:24}"]
            for variant in VARIANTS:
                xs = results[variant][metric]
                row.append(f"{variant} {pct(xs, 50):8.1f} {pct(xs, 90):8.1f} {max(xs):8.1f}")
            ratio = pct(results["disk"][metric], 50) / pct(results["tmpfs"][metric], 50)
            print("  |  ".join(row) + f"  |  ratio {ratio:5.2f}")
        for variant in VARIANTS:
            mib_s = 128 / (pct(results[variant]["write 128 MiB ms"], 50) / 1000)
            print(f"  {variant}: sequential write p50 {mib_s:7.0f} MiB/s")


_METRICS = ["start ms", "write 128 MiB ms", "write+fsync 128 MiB ms", "cp -a perl5 ms",
            "destroy ms"]  # fmt: skip

if __name__ == "__main__":
    asyncio.run(main())
