"""Image build benchmark: what the build's bounds cost (prints figures, no asserts).

    PYTHONPATH=. .venv/bin/python bench/image_builds.py [--n 3] [--layers 1]

1. A small Dockerfile (``FROM debian:bookworm``, a ``COPY`` and two ``RUN``s) built --n times
   into a fresh cache holding a link to the shared mmdebstrap layer: layer copy, steps, result.
2. The ``default`` image's mmdebstrap layer built --layers times into a fresh cache (asks the
   host's Debian mirror; 0 skips it).

Run it against two checkouts (``PYTHONPATH=<checkout>``) to compare them.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from ephemeral.sandbox import dockerfile as df
from ephemeral.sandbox import images
from ephemeral.settings import Settings

DOCKERFILE = "FROM debian:bookworm\nCOPY data.txt /opt/\nRUN echo built > /built\nRUN id\n"


def _settings(root: Path) -> Settings:
    return Settings.load(state_dir=root / "state", cache_dir=root / "cache")


def dockerfile_builds(n: int) -> list[float]:
    out: list[float] = []
    shared = Settings.load()
    images.build_with_image = lambda *_: None  # type: ignore[assignment]  # microVM: not measured
    for i in range(n):
        root = Path(tempfile.mkdtemp(prefix="bench-build-"))
        try:
            settings = _settings(root)
            ctx = root / "ctx"
            ctx.mkdir()
            (ctx / "Dockerfile").write_text(DOCKERFILE)
            (ctx / "data.txt").write_text(f"run {i}\n")
            plan, _, _ = df.load(ctx / "Dockerfile", None, {}, settings)
            layers = images.chain(images.definition_dir(settings, plan.base))
            spec = images._layer_spec([d for _, d in layers], tuple(plan.packages))
            digest = images._base_hash(spec)[:16]
            link = settings.image_cache_dir / "base" / digest
            link.parent.mkdir(parents=True)
            link.symlink_to(shared.image_cache_dir / "base" / digest)
            t = time.monotonic()
            df.build_dockerfile(ctx / "Dockerfile", name="bench", settings=settings)
            out.append(time.monotonic() - t)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return out


def layer_builds(n: int) -> list[float]:
    out: list[float] = []
    for _ in range(n):
        root = Path(tempfile.mkdtemp(prefix="bench-layer-"))
        try:
            settings = _settings(root)
            layers = images.chain(images.definition_dir(settings, "default"))
            spec = images._layer_spec([d for _, d in layers])
            t = time.monotonic()
            asyncio.run(images._ensure_base(settings, spec))
            out.append(time.monotonic() - t)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--layers", type=int, default=1)
    args = ap.parse_args()
    builds = dockerfile_builds(args.n)
    print("dockerfile build on a cached layer: " + " ".join(f"{s:.1f}s" for s in builds))
    if args.layers:
        layer = layer_builds(args.layers)
        print("mmdebstrap layer of default:       " + " ".join(f"{s:.1f}s" for s in layer))


if __name__ == "__main__":
    main()
