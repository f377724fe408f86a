"""Dockerfiles FROM a registry image (issue 36, item 5): time and disk of builds on the base's
stored layers (prints JSON; asserts nothing).

    .venv/bin/python bench/dockerfile_layers.py [--images 3]

The base is the ``default`` image's rootfs in three gzip layers (as ``bench/oci_pull.py``) on
a loopback ``docker-registry``. Then ``--images`` Dockerfiles ``FROM`` it, each one small
``RUN``, are built in a fresh cache: the first build's time (the pull included), each next
one's (same base, already pulled), the same inputs again (the cache), and the disk: the base's
layers, each new layer, the whole layer store and the image cache's entries, against what a
flattened copy per image would hold (the base's bytes once more per image).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.measure import missing_tool
from bench.oci_pull import three_layers
from ephemeral.oci.store import LayerStore, du
from ephemeral.sandbox.dockerfile import build_dockerfile
from ephemeral.settings import Settings
from tests.drivers import built_image
from tests.oci.conftest import serve_registry
from tests.sandbox.image_cache import link_runtime_source


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=3)
    args = ap.parse_args()
    if (why := missing_tool("docker-registry", "skopeo")) is not None:
        print(why)
        return 1
    work = Path(tempfile.mkdtemp(prefix="bench-dockerfile-layers-"))
    try:
        (work / "reg").mkdir()
        with serve_registry(work / "reg", tls=False) as reg:
            root = built_image(Settings.load(), "default").rootfs
            reg.push_image(work, "bench/base:1", three_layers(root))
            ref = f"{reg.host}/bench/base:1"
            settings = Settings.load(
                state_dir=work / "state",
                cache_dir=work / "cache",
                registry_private_hosts=[reg.host],
            )
            link_runtime_source(settings)
            times, new_layers = [], []
            for i in range(args.images):
                ctx = work / f"ctx{i}"
                ctx.mkdir()
                (ctx / "Dockerfile").write_text(
                    f"FROM {ref}\nRUN echo {i} > /marker && rm -rf /usr/share/doc\n"
                )
                t0 = time.monotonic()
                built = build_dockerfile(ctx / "Dockerfile", name=f"img{i}", settings=settings)
                times.append(time.monotonic() - t0)
                new_layers.append(du(built.layers[-2].parent))
            t0 = time.monotonic()
            build_dockerfile(work / "ctx0" / "Dockerfile", name="img0", settings=settings)
            cached = time.monotonic() - t0
            base = sum(du(p.parent) for p in built.layers[:-2])
            store = du(LayerStore(settings).root)
            entries = sum(du(p) for p in settings.image_cache_dir.glob("img*-*"))
            print(
                json.dumps(
                    {
                        "images": args.images,
                        "first_build_with_pull_s": round(times[0], 1),
                        "next_builds_s": [round(t, 1) for t in times[1:]],
                        "cached_build_s": round(cached, 3),
                        "base_layers_mb": round(base / 1e6, 1),
                        "new_layers_kb": [round(n / 1e3, 1) for n in new_layers],
                        "layer_store_mb": round(store / 1e6, 1),
                        "cache_entries_kb": round(entries / 1e3, 1),
                        "store_with_a_copy_per_image_mb": round(
                            (base * args.images + store) / 1e6, 1
                        ),
                    },
                    indent=1,
                )
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
