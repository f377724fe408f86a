"""Cost of the namespaces seccomp allowlist: the same driver with the filter and with an
allow-everything filter, interleaved in one process (no asserts).

    .venv/bin/python bench/seccomp.py [--n 20]

Prints cold start (create -> hello) and exec round trip of `true` and of a python3 start, p50 and
p95, and the ratio allowlist / no filter.
"""

from __future__ import annotations

import argparse
import asyncio
import struct
import sys
import tempfile
import time

from ephemeral.sandbox import registry, seccomp
from ephemeral.sandbox.base import Limits
from ephemeral.settings import Settings

ALLOW_ALL = struct.pack("<HBBI", 0x06, 0, 0, 0x7FFF0000)  # ret SECCOMP_RET_ALLOW


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


async def sample(settings: Settings, n: int) -> dict[str, list[float]]:
    driver = registry.get_driver("namespaces", settings)
    out: dict[str, list[float]] = {"cold": [], "exec true": [], "exec python3": []}
    for _ in range(n):
        t0 = time.perf_counter()
        sbx = await driver.create(owner="bench", limits=Limits())
        out["cold"].append((time.perf_counter() - t0) * 1000)
        try:
            for _ in range(10):
                t0 = time.perf_counter()
                await sbx.exec(["true"])
                out["exec true"].append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            await sbx.exec(["python3", "-c", "import json, subprocess"])
            out["exec python3"].append((time.perf_counter() - t0) * 1000)
        finally:
            await sbx.destroy()
    return out


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20)
    args = ap.parse_args()
    allowlist = seccomp.program()
    with tempfile.TemporaryDirectory(prefix="ephemeral-bench-") as state:
        settings = Settings.load(state_dir=state, use_prefect=False)
        why = await registry.probe_level("namespaces", settings)
        if why is not None:
            raise SystemExit(f"namespaces: {why}")
        runs: dict[str, dict[str, list[float]]] = {"allowlist": {}, "no filter": {}}
        for _ in range(4):  # interleaved, so drift on a shared host hits both alike
            for name, prog in (("allowlist", allowlist), ("no filter", ALLOW_ALL)):
                setattr(seccomp, "program", lambda prog=prog: prog)  # noqa: B010
                got = await sample(settings, max(1, args.n // 4))
                for k, v in got.items():
                    runs[name].setdefault(k, []).extend(v)
    print(f"namespaces, seccomp allowlist ({len(allowlist) // 8} BPF instructions) vs none")
    for k in runs["allowlist"]:
        a, b = runs["allowlist"][k], runs["no filter"][k]
        print(
            f"  {k:<13} allowlist p50={pct(a, 50):7.2f}ms p95={pct(a, 95):7.2f}ms   "
            f"none p50={pct(b, 50):7.2f}ms p95={pct(b, 95):7.2f}ms   "
            f"ratio p50 {pct(a, 50) / pct(b, 50):.2f}x  (n={len(a)})"
        )


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
