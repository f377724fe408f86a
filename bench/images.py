"""Image and planning benchmark: prints figures and ratios (no asserts).

    .venv/bin/python bench/images.py [--n 10] [--rows 100000] [--drivers gvisor,namespaces]

1. Image build: a definition change on a cached mmdebstrap layer (a copy of python-dev under
   another name, so the real one is untouched: layer copy, agent, build steps, microVM ext4)
   against a cached build of the same definition (hashing only).
2. Cold start (create -> agent hello, then destroy) of python-dev against default, per driver,
   in the same process: a larger image should cost nothing at start.
3. Planning a recipe over a dataset of --rows rows: load (DuckDB read + test-render of every
   row) and streaming the plan, with the peak of Python memory while it streams.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import resource
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from ephemeral.recipes.recipe import iter_planned, load_recipe
from ephemeral.sandbox import images, microvm_image, registry
from ephemeral.sandbox.base import Limits
from ephemeral.settings import REPO_ROOT, Settings


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def fmt(xs: list[float]) -> str:
    return f"p50={pct(xs, 50):8.1f}ms p95={pct(xs, 95):8.1f}ms (n={len(xs)})"


async def build_times() -> None:
    settings = Settings.load()
    if images.built_image(settings, "python-dev") is None:
        print("image build: python-dev not built (make setup); skipped")
        return
    with tempfile.TemporaryDirectory(prefix="bench-images-") as tmp:
        defs = Path(tmp)
        for name in ("default", "python-dev"):
            shutil.copytree(settings.images_dir / name, defs / name)
        # a changed definition under its own name: new hash, same mmdebstrap layer
        dev = defs / "python-dev"
        dev.rename(defs / "bench-dev")
        text = (defs / "bench-dev" / "image.yaml").read_text()
        text = text.replace("name: python-dev", "name: bench-dev")
        (defs / "bench-dev" / "image.yaml").write_text(text + f"# bench {time.time()}\n")
        bench = settings.model_copy(update={"images_dir": defs})
        try:
            t0 = time.perf_counter()
            await images.ensure_image(bench, "bench-dev")
            changed = time.perf_counter() - t0
            cached = []
            for _ in range(5):
                t0 = time.perf_counter()
                await images.ensure_image(bench, "bench-dev")
                cached.append((time.perf_counter() - t0) * 1000)
        finally:
            images.remove_images(bench, "bench-dev")
            for ext4 in (microvm_image.microvm_cache(bench) / "rootfs").glob("bench-dev-*"):
                ext4.unlink(missing_ok=True)
    print("image build (python-dev definition, mmdebstrap layer cached)")
    print(f"  after a definition change: {changed:8.2f} s (copy layer, agent, build steps, ext4)")
    print(f"  cached (same definition):  {fmt(cached)}")
    print(f"  ratio changed/cached p50:  {changed * 1000 / pct(cached, 50):8.0f}x")


async def cold_starts(drivers: list[str], n: int) -> None:
    base = Settings.load()
    print(f"cold start, create -> agent hello (n={n} each, alternating images)")
    for iso in drivers:
        results: dict[str, list[float]] = {"default": [], "python-dev": []}
        skip = None
        for image in results:
            settings = base.model_copy(update={"image": image})
            if images.built_image(settings, image) is None:
                skip = f"image {image} not built"
                break
            why = await registry.probe_level(iso, settings)
            if why:
                skip = why
                break
        if skip:
            print(f"  {iso:<11} skipped: {skip}")
            continue
        for _ in range(n):
            for image, times in results.items():
                driver = registry.get_driver(iso, base.model_copy(update={"image": image}))
                t0 = time.perf_counter()
                sbx = await driver.create(owner="bench-images", limits=Limits())
                times.append((time.perf_counter() - t0) * 1000)
                await sbx.destroy()
        d, p = results["default"], results["python-dev"]
        print(f"  {iso:<11} default    {fmt(d)}")
        print(f"  {iso:<11} python-dev {fmt(p)}")
        print(f"  {iso:<11} ratio python-dev/default p50: {pct(p, 50) / pct(d, 50):5.2f}")


def planning(rows: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        d = Path(tmp)
        with (d / "rows.jsonl").open("w") as f:
            for i in range(rows):
                f.write(json.dumps({"task_id": i, "question": f"what is {i} + {i}?"}) + "\n")
        (d / "r.yaml").write_text(
            "name: plan\nmodel: replay/sandbox-proof\ndataset: rows.jsonl\n"
            "prompt: 'Task {{ task_id }}: {{ question }}'\nverify: ['test {{ task_id }} -ge 0']\n"
            "policy: {timeout_seconds: 60, max_cost_micros: 1000}\n"
        )
        t0 = time.perf_counter()
        recipe = load_recipe(d / "r.yaml")
        loaded = time.perf_counter() - t0
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        count = sum(1 for _ in iter_planned(recipe, default_model="unused/m"))
        streamed = time.perf_counter() - t0
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # what holding the plan would cost instead, measured on a tenth of it
        tracemalloc.start()
        plan = iter_planned(recipe, default_model="u/m")
        held = list(itertools.islice(plan, rows // 10))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del held
    print(f"planning a {rows}-row dataset (jsonl)")
    print(f"  load (DuckDB read + test-render every row): {loaded:6.2f} s")
    print(f"  stream the plan ({count} runs):            {streamed:6.2f} s")
    print(f"  max RSS growth while streaming:           {(rss1 - rss0) / 1024:6.1f} MB")
    print(f"  holding {rows // 10} planned runs instead would take {peak / 1e6:6.1f} MB")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--drivers", default="gvisor,namespaces")
    args = ap.parse_args()
    print(f"images bench ({REPO_ROOT.name}, python {sys.version.split()[0]})")
    await build_times()
    await cold_starts([d for d in args.drivers.split(",") if d], args.n)
    planning(args.rows)


if __name__ == "__main__":
    asyncio.run(main())
