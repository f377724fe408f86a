"""Pull + unpack of a multi-layer image from a loopback registry, against its floor.

    .venv/bin/python bench/oci_pull.py [--n 3]

The image is the ``default`` image's rootfs (Python, curl, ~180 MB) split in three gzip
layers (``usr/lib``, the rest of ``usr``, everything else), pushed with skopeo into a
``docker-registry`` on 127.0.0.1 (plain HTTP, no auth: the registry's own costs are the same
for both sides). Each round, into empty directories:

- ours: ``ephemeral.oci.pull.pull`` (manifest, config, every layer downloaded with its digest
  checked, decompressed with its diff id checked, unpacked through hostwrite's checked writer);
- floor: ``skopeo copy docker://… oci:DIR`` then ``umoci unpack`` (Debian's umoci: the well-kept
  unpacker the issue names), and ``skopeo copy`` + ``tar -xzf`` per layer (no whiteout
  handling, no checks: the lowest possible).

Prints p50 of each and the ratios (the issue's goal: ours <= 1.2 x skopeo + umoci). No asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.measure import missing_tool
from ephemeral.oci import pull as oci_pull
from ephemeral.settings import Settings
from tests.drivers import built_image
from tests.oci import layouts as L
from tests.oci.conftest import serve_registry


def three_layers(root: Path) -> list[bytes]:
    """A rootfs as three layers: ``usr/lib``, the rest of ``usr``, everything else."""
    usr_rest = sorted(f"usr/{p.name}" for p in (root / "usr").iterdir() if p.name != "lib")
    top = sorted(p.name for p in root.iterdir() if p.name != "usr")
    return [
        L.tar_of_tree(root, ["usr/lib"]),
        L.tar_of_tree(root, usr_rest),
        L.tar_of_tree(root, top),
    ]


def timed(fn: Callable[[], object]) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3)
    args = ap.parse_args()
    if (why := missing_tool("docker-registry", "skopeo", "umoci")) is not None:
        print(why)
        return 1
    root = built_image(Settings.load(), "default").rootfs
    work = Path(tempfile.mkdtemp(prefix="bench-oci-"))
    try:
        layout = L.Layout(work / "layout")
        desc = layout.image(three_layers(root))
        layout.tag(desc, "t")
        layout.close()
        sizes = [
            d["size"]
            for d in json.loads(
                (layout.root / "blobs/sha256" / desc["digest"].split(":")[1]).read_text()
            )["layers"]
        ]
        (work / "reg").mkdir()
        with serve_registry(work / "reg", tls=False) as reg:
            reg.push(layout.root, "t", "bench/default:1")
            ref = f"{reg.host}/bench/default:1"
            ours: list[float] = []
            umoci: list[float] = []
            tar_floor: list[float] = []
            for i in range(args.n):
                cache = work / f"cache{i}"
                settings = Settings.load(
                    state_dir=work / "state", cache_dir=cache, registry_private_hosts=[reg.host]
                )

                def ours_pull(s: Settings = settings) -> None:
                    asyncio.run(oci_pull.pull(s, ref))

                ours.append(timed(ours_pull))
                shutil.rmtree(cache)

                def skopeo(dest: Path) -> None:
                    subprocess.run(
                        ["skopeo", "copy", "--quiet", "--src-tls-verify=false",
                         f"docker://{ref}", f"oci:{dest}:t"],
                        check=True,
                    )  # fmt: skip

                def with_umoci() -> None:
                    skopeo(work / "oci-u")
                    subprocess.run(
                        ["umoci", "unpack", "--image", f"{work / 'oci-u'}:t", str(work / "bundle")],
                        check=True, capture_output=True,
                    )  # fmt: skip

                def with_tar() -> None:
                    skopeo(work / "oci-t")
                    index = json.loads((work / "oci-t" / "index.json").read_text())
                    mdig = index["manifests"][0]["digest"].split(":")[1]
                    man = json.loads((work / "oci-t/blobs/sha256" / mdig).read_text())
                    (work / "tar-root").mkdir()
                    for layer in man["layers"]:
                        blob = work / "oci-t/blobs/sha256" / layer["digest"].split(":")[1]
                        subprocess.run(
                            ["tar", "-xzf", str(blob), "-C", str(work / "tar-root")], check=True
                        )

                umoci.append(timed(with_umoci))
                tar_floor.append(timed(with_tar))
                for d in ("oci-u", "bundle", "oci-t", "tar-root"):
                    shutil.rmtree(work / d, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def p50(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    print(f"image: {len(sizes)} gzip layers, {sum(sizes) / 1e6:.1f} MB compressed, "
          f"{root} unpacked; n={args.n}")  # fmt: skip
    print(f"ours  pull+unpack          p50 {p50(ours):6.2f}s  {[round(x, 2) for x in ours]}")
    print(f"floor skopeo copy + umoci  p50 {p50(umoci):6.2f}s  {[round(x, 2) for x in umoci]}")
    print(f"floor skopeo copy + tar -x p50 {p50(tar_floor):6.2f}s  "
          f"{[round(x, 2) for x in tar_floor]}")  # fmt: skip
    print(f"ratio ours / (skopeo + umoci) = {p50(ours) / p50(umoci):.2f}  (goal <= 1.2)")
    print(f"ratio ours / (skopeo + tar)   = {p50(ours) / p50(tar_floor):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
