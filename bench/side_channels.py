"""Side-channel flood benchmark: host CPU share and a bystander's exec latency (no asserts).

    .venv/bin/python bench/side_channels.py [--driver namespaces] [--n 200] [--flooders 3]

Three phases in one process, each with one real bystander sandbox of ``--driver`` running
`true` ``--n`` times: no flooders; ``--flooders`` scripted agents writing their stderr as fast as
they can, read at the shipped rate limit; the same flooders read with the limit lifted (the
code before the limit). Prints the host process's CPU share (process CPU time / wall time, in %
of one core) and the bystander's exec p50/p99, and the ratios against the quiet phase.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from ephemeral.sandbox import handles, registry, sidechannel
from ephemeral.sandbox.base import Limits, Sandbox
from ephemeral.sandbox.process import ProcessSandbox, new_handle
from ephemeral.settings import Settings

HOSTILE = Path(__file__).parents[1] / "tests" / "sandbox" / "hostile_agent.py"


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


async def flooder(settings: Settings) -> ProcessSandbox:
    handle = new_handle("fake", "bench")
    sbx = ProcessSandbox(
        sandbox_id=handle.id,
        isolation="fake",
        image="hostile",
        handle=handle,
        handle_file=handles.write(settings.sandboxes_dir, handle),
        cgroups=None,
        limits=Limits(),
        runtime="hostile_agent.py",
    )
    await sbx._start([sys.executable, str(HOSTILE), "flood_stderr"])
    return sbx


async def phase(bystander: Sandbox, settings: Settings, flooders: int, n: int) -> dict[str, float]:
    made = [await flooder(settings) for _ in range(flooders)]
    try:
        await asyncio.sleep(1.0)  # past the burst
        c0, t0 = time.process_time(), time.monotonic()
        lat = []
        for _ in range(n):
            s = time.perf_counter()
            await bystander.exec(["true"])
            lat.append((time.perf_counter() - s) * 1000)
        share = (time.process_time() - c0) / (time.monotonic() - t0)
        # the same window without the bystander's own work: what the floods alone cost
        c1, t1 = time.process_time(), time.monotonic()
        await asyncio.sleep(2.0)
        idle = (time.process_time() - c1) / (time.monotonic() - t1)
    finally:
        for f in made:
            await f.destroy()
    return {"share": share * 100, "idle": idle * 100, "p50": pct(lat, 50), "p99": pct(lat, 99)}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--driver", default="namespaces")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--flooders", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ephemeral-bench-") as state:
        settings = Settings.load(state_dir=state, use_prefect=False)
        why = await registry.probe_level(args.driver, settings)
        if why is not None:
            raise SystemExit(f"{args.driver}: {why}")
        bystander = await registry.get_driver(args.driver, settings).create(
            owner="bench", limits=Limits()
        )
        try:
            for _ in range(20):
                await bystander.exec(["true"])
            rows = {"quiet": await phase(bystander, settings, 0, args.n)}
            rows["flooded, limited"] = await phase(bystander, settings, args.flooders, args.n)
            rate = sidechannel.RATE_BYTES_PER_SECOND
            sidechannel.RATE_BYTES_PER_SECOND = 1 << 40  # read as fast as the guest writes
            try:
                rows["flooded, unlimited"] = await phase(bystander, settings, args.flooders, args.n)
            finally:
                sidechannel.RATE_BYTES_PER_SECOND = rate
        finally:
            await bystander.destroy()
    base = rows["quiet"]
    print(f"{args.driver} bystander, {args.flooders} stderr flooders, n={args.n}")
    print(f"  {'phase':<20} {'host CPU (floods only)':>22} {'exec p50':>10} {'exec p99':>10}")
    for name, r in rows.items():
        print(
            f"  {name:<20} {r['idle']:>20.1f} % {r['p50']:>8.2f}ms {r['p99']:>8.2f}ms"
            f"   p50 x{r['p50'] / base['p50']:.2f}  p99 x{r['p99'] / base['p99']:.2f}"
        )


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
