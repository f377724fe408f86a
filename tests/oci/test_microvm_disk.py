"""A pulled image's microVM disk, without booting a VM: the layers as directories 0..N-1 of one
ext4 (read back with ``debugfs``), whiteouts, opaque directories and owners as the layer store
holds them, and ``images gc`` sizing the disks (with the snapshots booted from them) like the
other entries of the cache."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ephemeral.oci import pull as oci_pull
from ephemeral.oci.reference import parse
from ephemeral.oci.store import LayerStore, PulledImage
from ephemeral.sandbox import image_gc, microvm_image
from ephemeral.settings import Settings
from tests.oci import layouts as L
from tests.oci.conftest import Registry


def _debugfs(disk: Path, request: str) -> str:
    out = subprocess.run(
        ["debugfs", "-R", request, str(disk)], capture_output=True, text=True, check=True
    )
    return out.stdout


def _disk(settings: Settings, image: PulledImage) -> Path:
    store = LayerStore(settings)
    key = microvm_image.layers_key(x.diff_id.split(":")[1] for x in image.layers)
    disk = microvm_image.pulled_disk(settings, key)
    disk.parent.mkdir(parents=True, exist_ok=True)
    microvm_image.build_layered_ext4([store.layer_root(x.diff_id) for x in image.layers], disk)
    return disk


def test_the_disk_holds_each_layer_as_the_store_does(
    oci_settings: Settings, registry: Registry, tmp_path: Path
) -> None:
    if shutil.which("debugfs") is None or shutil.which("mkfs.ext4") is None:
        pytest.skip("e2fsprogs not installed")
    owned = L.file("home/app/notes", "mine")
    owned.uid = owned.gid = 1000
    base = L.tar([L.directory("etc"), L.file("etc/issue", "base"), L.directory("var/cache"),
                  L.file("var/cache/old", "x"), L.directory("home/app"), owned])  # fmt: skip
    top = L.tar([L.directory("etc"), L.file("etc/.wh.issue"), L.directory("var/cache"),
                 L.file("var/cache/.wh..wh..opq"), L.file("var/cache/new", "y")])  # fmt: skip
    registry.push_image(tmp_path, "test/disk:1", [base, top])
    image = asyncio.run(oci_pull.ensure_image(oci_settings, f"{registry.host}/test/disk:1"))
    disk = _disk(oci_settings, image)
    assert _debugfs(disk, "ls -p /").count("/") >= 2
    assert "base" in _debugfs(disk, "cat /0/etc/issue")
    whiteout = _debugfs(disk, "stat /1/etc/issue")
    assert "Type: character special" in whiteout and "Device major/minor number: 00:00" in whiteout
    assert "trusted.overlay.opaque" in _debugfs(disk, "ea_list /1/var/cache")
    assert "User:  1000   Group:  1000" in _debugfs(disk, "stat /0/home/app/notes")
    assert "old" in _debugfs(disk, "ls /0/var/cache")  # hidden in the VM by the opaque dir


def test_images_gc_sizes_the_disks_of_pulled_images(
    oci_settings: Settings, registry: Registry, tmp_path: Path
) -> None:
    """A disk goes with its use marker and the snapshots booted from it: first one whose image
    is gone from the store, then by last use; a disk in use is kept."""
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("e2fsprogs not installed")
    refs = []
    for name in ("one", "two"):
        registry.push_image(tmp_path, f"test/gc-{name}:1", [L.tar([L.file(name, name)])])
        refs.append(f"{registry.host}/test/gc-{name}:1")
    images = [asyncio.run(oci_pull.ensure_image(oci_settings, ref)) for ref in refs]
    disks = [_disk(oci_settings, image) for image in images]
    snap = microvm_image.microvm_cache(oci_settings) / "snapshots" / "k1"
    snap.mkdir(parents=True)
    (snap / "argv.json").write_text(json.dumps(["-drive", f"id=root,file={disks[0]},format=raw"]))
    (snap / "state.bin").write_bytes(b"s" * 4096)
    store = LayerStore(oci_settings)
    store.remove_ref(parse(refs[0]))
    store.gc()  # the image record of the first one goes: its disk is now never used
    found = {e.path: e for e in image_gc.entries(oci_settings) if e.kind == "microvm"}
    assert found[disks[0]].last_used == 0.0 and snap in found[disks[0]].extra
    assert found[disks[0]].size_bytes >= 4096 + disks[0].stat().st_blocks * 512
    image_gc.collect(oci_settings)  # under the limit: only what nothing names goes
    assert not disks[0].exists() and not snap.exists()
    assert disks[1].exists()
    os.utime(disks[1], (1, 1))
    with disks[1].open("rb"):  # a VM has it open
        image_gc.collect(oci_settings, max_bytes=0)
        assert disks[1].exists()
    image_gc.collect(oci_settings, max_bytes=0)
    assert not disks[1].exists()


def test_a_newer_boot_file_prunes_old_ones_not_a_fresh_one_of_another_checkout(
    tmp_path: Path,
) -> None:
    """Two checkouts (or versions) sharing the microVM cache each build their initramfs and
    ext4: a file made in the last hour is another one's in use, not stale."""
    settings = Settings.load(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache")
    cache = microvm_image.microvm_cache(settings)
    (cache / "initrd").mkdir(parents=True)
    (cache / "rootfs").mkdir()
    old, fresh, mine = (cache / "initrd" / f"stage0-{n}.cpio.gz" for n in ("old", "fresh", "mine"))
    disk_old, disk_fresh, disk_mine = (cache / "rootfs" / f"default-{n}.ext4" for n in "abc")
    for p in (old, fresh, mine, disk_old, disk_fresh, disk_mine):
        p.write_bytes(b"x")
    for p in (old, disk_old):
        os.utime(p, (1, 1))
    microvm_image.prune_stale(settings, "default", keep=mine)
    microvm_image.prune_stale(settings, "default", keep=disk_mine)
    assert [p.exists() for p in (old, fresh, mine)] == [False, True, True]
    assert [p.exists() for p in (disk_old, disk_fresh, disk_mine)] == [False, True, True]
