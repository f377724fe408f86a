"""Start of a sandbox from a pulled image against the same bytes built as ``default``, beside
the bare runtime's floor, in the same sitting (prints; asserts nothing). Issue 36's goal:
pulled / default <= 1.1x, cold and warm.

    .venv/bin/python bench/pulled_start.py [--levels gvisor,namespaces] [--n 10]

The pulled image is the ``default`` image's rootfs split in three gzip layers (as
``bench/oci_pull.py``), pushed with skopeo to a ``docker-registry`` on 127.0.0.1 and pulled
once; so both sides hold the same files and differ only in how the root is made (the built
rootfs as one lower directory, or the pulled layers stacked under the agent's).

Per level, ``--n`` rounds, the two images alternated inside each round (so the load's drift
touches both alike). Each sample is the wall time until a sandbox has run ``true``:

- cold: a sandbox created by a new driver (what a run naming the image gets without a warm
  pool: the image is looked up, its root assembled, the runtime spawned, the agent's hello);
- warm: a sandbox taken from a full warm pool of that image (one of size 1, refilled and
  waited for between samples), as a run of the pool's image gets it;
- floor: a bare ``runsc do true`` (gvisor) or ``bwrap ... true`` (namespaces).

Then p50 / p95 / min / max and the ratios pulled / default and to the floor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.agent_runtime import floors
from bench.measure import floor_table, missing_tool, timed_proc
from bench.oci_pull import three_layers
from ephemeral.oci import pull as oci_pull
from ephemeral.sandbox import agent_runtime, images, registry
from ephemeral.sandbox.base import Limits, Sandbox
from ephemeral.sandbox.pool import WarmPool
from ephemeral.settings import Settings
from tests.oci import layouts as L
from tests.oci.conftest import serve_registry
from tests.sandbox.image_cache import link_runtime_source


async def ready(take: Callable[[], Awaitable[Sandbox]]) -> float:
    """Milliseconds until the sandbox ``take`` returns has run ``true``; then destroyed."""
    t0 = time.perf_counter()
    sbx = await take()
    try:
        res = await sbx.exec("true")
        elapsed = (time.perf_counter() - t0) * 1000
        if res.exit_code != 0:
            raise SystemExit(f"{sbx.isolation} {sbx.image}: true exited {res.exit_code}")
        return elapsed
    finally:
        await sbx.destroy()


def default_layout(work: Path, root: Path) -> Path:
    """An OCI layout of ``root`` in three gzip layers (tag ``t``), as ``bench/oci_pull.py``."""
    layout = L.Layout(work / "layout")
    desc = layout.image(three_layers(root), config={"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"]})
    layout.tag(desc, "t")
    layout.close()
    return layout.root


async def level_bench(settings: Settings, pulled: str, level: str, n: int) -> None:
    variants = {"default": settings, "pulled": settings.model_copy(update={"image": pulled})}
    limits = Limits()

    def cold(s: Settings) -> Callable[[], Awaitable[Sandbox]]:
        return lambda: registry.get_driver(level, s).create(owner="bench", limits=limits)

    def warm(pool: WarmPool) -> Callable[[], Awaitable[Sandbox]]:
        return lambda: pool.acquire("bench", limits)

    rootfs = await images.ensure_image(settings)
    runtime = await agent_runtime.ensure_runtime(settings)
    pools = {k: WarmPool(registry.get_driver(level, s), 1, limits) for k, s in variants.items()}
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-runsc-") as state:
        bare = floors(level, rootfs, state, runtime.root)
        try:
            for pool in pools.values():
                await pool.start()
            for s in variants.values():  # warm-up: each image's first use
                await ready(cold(s))
            for _ in range(n):
                for name, s in variants.items():
                    times.setdefault(f"cold {name}", []).append(await ready(cold(s)))
                for name, pool in pools.items():
                    await pool.wait_ready(120)
                    times.setdefault(f"warm {name}", []).append(await ready(warm(pool)))
                for name, argv in bare.items():
                    times.setdefault(name, []).append(await timed_proc(argv))
        finally:
            for pool in pools.values():
                await pool.close()
    floor_table(f"{level} (n={n}, ms until a sandbox has run `true`)", times, 95, width=14)
    for kind in ("cold", "warm"):
        ratio = statistics.median(times[f"{kind} pulled"]) / statistics.median(
            times[f"{kind} default"]
        )
        print(f"  {kind}: pulled / default p50 = {ratio:.2f}  (goal <= 1.1)")


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="gvisor,namespaces")
    ap.add_argument("--n", type=int, default=10)
    args = ap.parse_args()
    if (why := missing_tool("docker-registry", "skopeo")) is not None:
        print(why)
        return 1
    work = Path(tempfile.mkdtemp(prefix="bench-pulled-start-"))
    try:
        settings = Settings.load(state_dir=work / "state", cache_dir=work / "cache")
        link_runtime_source(settings)  # the shared default build, not rebuilt here
        root = await images.ensure_image(settings)
        layout = default_layout(work, root)
        (work / "reg").mkdir()
        with serve_registry(work / "reg", tls=False) as reg:
            reg.push(layout, "t", "bench/default:1")
            ref = f"{reg.host}/bench/default:1"
            settings = settings.model_copy(update={"registry_private_hosts": [reg.host]})
            pulled = await oci_pull.pull(settings, ref)
            sizes = [layer.size for layer in pulled.layers]
            print(f"image: {root} as built, and {ref} pulled ({len(sizes)} layers, "
                  f"{json.dumps([round(s / 1e6, 1) for s in sizes])} MB compressed)")  # fmt: skip
            for level in args.levels.split(","):
                why = await registry.probe_level(level, settings)
                if why is not None:
                    print(f"\n{level}: cannot run here: {why}")
                    continue
                await level_bench(settings, ref, level, args.n)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
