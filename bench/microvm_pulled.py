"""A microVM of a pulled image against one of ``default``, same run, same bytes.

    .venv/bin/python bench/microvm_pulled.py [--n 10] [--accel tcg]

The pulled image is the ``default`` rootfs in three gzip layers (``usr/lib``, the rest of
``usr``, everything else) served by a ``docker-registry`` on 127.0.0.1, so both VMs boot the
same files: one from the built image's ext4, one from the disk of the pulled layers
(``microvm_image.build_layered_ext4``, stacked by the guest's overlayfs). In a fresh microVM
cache (the kernel is the shared cache's), it measures:

1. the disk: ``build_ext4`` of the rootfs against ``build_layered_ext4`` of the layers (paid
   once per image digest);
2. the cold boot to the agent's hello and the memory snapshot (paid once per image and
   limits; ``SnapshotMeta``: boot attempts, boot and save times);
3. the warm start every sandbox pays: ``create`` (a restore of the snapshot) to a ready
   sandbox (``boot_ms``) and its first ``exec``, the two images alternating.

Prints p50/p95 and the ratios. No asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.measure import missing_tool
from ephemeral.oci import pull as oci_pull
from ephemeral.oci.store import LayerStore
from ephemeral.sandbox import microvm_image
from ephemeral.sandbox.base import Limits
from ephemeral.sandbox.microvm import MicroVMDriver
from ephemeral.settings import Settings
from tests.drivers import built_image
from tests.oci import layouts as L
from tests.oci.conftest import serve_registry
from tests.sandbox.image_cache import link_runtime_source


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def fmt(xs: list[float]) -> str:
    return f"p50 {pct(xs, 50):8.1f} ms  p95 {pct(xs, 95):8.1f} ms  (n={len(xs)})"


def timed_ms(fn: object, *args: object) -> float:
    t0 = time.monotonic()
    fn(*args)  # type: ignore[operator]
    return (time.monotonic() - t0) * 1000


async def main(n: int, accel: str) -> int:
    needed = ("docker-registry", "skopeo", "qemu-system-x86_64", "mkfs.ext4")
    if (why := missing_tool(*needed)) is not None:
        print(why)
        return 1
    shared = Settings.load()
    root = built_image(shared, "default").rootfs
    work = Path(tempfile.mkdtemp(prefix="bench-microvm-pulled-"))
    try:
        usr_rest = sorted(f"usr/{p.name}" for p in (root / "usr").iterdir() if p.name != "lib")
        top = sorted(p.name for p in root.iterdir() if p.name != "usr")
        layout = L.Layout(work / "layout")
        desc = layout.image(
            [L.tar_of_tree(root, ["usr/lib"]), L.tar_of_tree(root, usr_rest),
             L.tar_of_tree(root, top)]
        )  # fmt: skip
        layout.tag(desc, "t")
        layout.close()
        (work / "reg").mkdir()
        with serve_registry(work / "reg", tls=False) as reg:
            reg.push(layout.root, "t", "bench/default:1")
            ref = f"{reg.host}/bench/default:1"
            settings = Settings.load(
                state_dir=work / "state",
                cache_dir=work / "cache",
                registry_private_hosts=[reg.host],
                use_prefect=False,
            )
            link_runtime_source(settings)  # the built default image, not rebuilt
            vm_cache = microvm_image.microvm_cache(settings)
            vm_cache.mkdir(parents=True)
            (vm_cache / "kernels").symlink_to(microvm_image.microvm_cache(shared) / "kernels")
            pulled = await oci_pull.pull(settings, ref)
            store = LayerStore(settings)
            layers = [store.layer_root(x.diff_id) for x in pulled.layers]

            plain, layered = [], []
            for i in range(3):
                plain.append(timed_ms(microvm_image.build_ext4, root, work / f"p{i}.ext4"))
                layered.append(
                    timed_ms(microvm_image.build_layered_ext4, layers, work / f"l{i}.ext4")
                )
                (work / f"p{i}.ext4").unlink()
                (work / f"l{i}.ext4").unlink()

            drivers = {
                "default": MicroVMDriver(settings.model_copy(update={"image": "default"}), accel),
                "pulled": MicroVMDriver(settings.model_copy(update={"image": ref}), accel),
            }
            metas = {}
            for name, driver in drivers.items():
                t0 = time.monotonic()
                snap = await driver.snapshot(Limits())
                metas[name] = (snap.meta, (time.monotonic() - t0) * 1000)
            ready: dict[str, list[float]] = {k: [] for k in drivers}
            first: dict[str, list[float]] = {k: [] for k in drivers}
            for _ in range(n):
                for name, driver in drivers.items():
                    sbx = await driver.create(owner="bench", limits=Limits())
                    try:
                        t0 = time.monotonic()
                        res = await sbx.exec(["true"], timeout=30)
                        assert res.exit_code == 0
                        first[name].append((time.monotonic() - t0) * 1000)
                        ready[name].append(float(sbx.boot_ms or 0))
                    finally:
                        await sbx.destroy()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"microvm-{accel}; the default rootfs as a built image and as 3 pulled layers")
    print(f"disk   build_ext4 (rootfs)          {fmt(plain)}")
    print(f"disk   build_layered_ext4 (layers)  {fmt(layered)}")
    for name, (meta, total) in metas.items():
        print(
            f"cold   {name:<8} attempts {meta.boot_attempts}  boot to hello {meta.boot_ms} ms  "
            f"save {meta.save_ms} ms  snapshot {meta.size_bytes / 1e6:.0f} MB  "
            f"with artifacts and check {total:.0f} ms"
        )
    for name in drivers:
        print(f"warm   {name:<8} restore to ready  {fmt(ready[name])}")
        print(f"warm   {name:<8} first exec        {fmt(first[name])}")
    r = pct(ready["pulled"], 50) / pct(ready["default"], 50)
    print(f"ratio pulled / default, restore to ready p50: {r:.2f} (goal <= 1.1)")
    c = metas["pulled"][0].boot_ms / metas["default"][0].boot_ms
    print(f"ratio pulled / default, cold boot to hello: {c:.2f}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--accel", choices=["tcg", "kvm"], default="tcg")
    args = ap.parse_args()
    sys.exit(asyncio.run(main(args.n, args.accel)))
