"""Garbage collection of the image cache: builds and base layers, least recently used first.

The cache (``settings.image_cache_dir``) is a set of *entries*, each a directory (plus the
files that go with it) with a size, a last use and whether something uses it now. Each kind
of entry has a collector (:data:`COLLECTORS`: builds, base layers; another store, such as
pulled OCI layers, joins by adding one) and :func:`plan` chooses, oldest use first, what to
remove until the cache fits ``image_cache_max_mib``. Never removed:

- an entry in use: a live sandbox's mounts, root or open files lie in it (read from
  ``/proc``: every mount namespace's mount roots, every process's root and open files, so a
  sandbox of any state directory counts, and a pool's too), or a build holds its lock;
- an entry used in the last :data:`RECENT_S` seconds (a run admitted a moment ago boots
  from it soon);
- the current build of an image definition (``sandbox_images/NAME``): a run naming it needs
  it, and admission refuses a name that is not built (``ephemeral images rm NAME`` removes
  it); and the mmdebstrap layer it was built on (its ``image.json``'s ``layer``): a
  Dockerfile ``FROM NAME`` or a ``base: NAME`` definition builds on that layer, which takes
  minutes and a Debian mirror to make again (``ephemeral images rm NAME --base`` removes it).
  Its older builds, Dockerfile images and other mmdebstrap layers are collected.

A use is recorded by :func:`mark_used` (``.used``'s mtime) when a build or a lookup returns
the entry. ``ephemeral images gc`` runs it (``--dry-run`` lists what would go); each build
runs it after itself when ``image_cache_max_mib`` is set.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ephemeral.oci.store import LayerStore
from ephemeral.sandbox import build_area
from ephemeral.sandbox.cache_use import CURRENT, Entry, du, last_used, mark_used
from ephemeral.sandbox.microvm_image import layers_key
from ephemeral.settings import Settings

log = logging.getLogger(__name__)
RECENT_S = 600.0


def _current_definition_builds(settings: Settings) -> set[Path]:
    """The current build of each image definition (``sandbox_images/NAME``): what a run naming
    it needs. ``images`` names it in ``<image cache>/current/NAME`` when it builds or finds it;
    a definition with no such name yet (a cache older than it) keeps its newest build."""
    cache = settings.image_cache_dir
    found: set[Path] = set()
    named: set[str] = set()
    for ptr in (cache / CURRENT).glob("*"):
        with contextlib.suppress(OSError):
            target = ptr.read_text().strip()
            if target and "/" not in target and not target.startswith("."):
                found.add(cache / target)
                named.add(ptr.name)
    defined = {y.parent.name for y in settings.images_dir.glob("*/image.yaml")} - named
    newest: dict[str, tuple[float, Path]] = {}
    for marker in cache.glob("*/image.json") if defined else ():
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            meta = json.loads(marker.read_text())
            name, at = meta.get("name"), float(meta.get("built_at") or 0)
            if name in defined and at >= newest.get(name, (-1.0, marker))[0]:
                newest[name] = (at, marker.parent)
    return found | {d for _, d in newest.values()}


def _builds(settings: Settings) -> Iterator[Entry]:
    cache = settings.image_cache_dir
    current = _current_definition_builds(settings)
    pointers: dict[str, list[Path]] = {}
    for ptr in (cache / "dockerfile").glob("*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            pointers.setdefault(str(json.loads(ptr.read_text())["dir"]), []).append(ptr)
    for marker in cache.glob("*/image.json"):
        d = marker.parent
        if d.is_symlink():
            continue
        extra = list(pointers.get(d.name, []))
        ext4 = cache / "microvm" / "rootfs" / f"{d.name}.ext4"
        if ext4.is_file():
            extra.append(ext4)
        size = du(d) + sum(p.stat().st_size for p in extra if p.suffix == ".ext4")
        yield Entry("image", d, size, last_used(d, marker), extra, kept=d in current)


def _bases(settings: Settings) -> Iterator[Entry]:
    kept = set()  # the layers the current builds of definitions were made on (image.json)
    for build in _current_definition_builds(settings):
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            kept.add(json.loads((build / "image.json").read_text()).get("layer"))
    for done in (settings.image_cache_dir / "base").glob("*/done"):
        d = done.parent
        if d.is_symlink():
            continue
        yield Entry("base", d, du(d), last_used(d, done), kept=d.name in kept)


def _pulled_layers(settings: Settings) -> Iterable[Entry]:
    """The layers of pulled registry images (``ephemeral/oci/store.py``)."""
    return LayerStore(settings).gc_entries()


def _pulled_disks(settings: Settings) -> Iterator[Entry]:
    """The microVM disks of pulled images (``microvm_image.pulled_disk``), each with its use
    marker and the memory snapshots booted from it. A disk of layers no named image of the
    layer store has counts as never used; a removed disk is made again from the layers."""
    microvm = settings.image_cache_dir / "microvm"
    store = LayerStore(settings)
    named = set(store.references().values())
    pulled = {
        layers_key(x.diff_id.split(":", 1)[1] for x in image.layers)
        for image in store.all_images()
        if image.digest in named
    }
    snapshots: dict[str, list[Path]] = {}
    for argv in (microvm / "snapshots").glob("*/argv.json"):
        with contextlib.suppress(OSError, ValueError):
            for word in json.loads(argv.read_text()):
                if isinstance(word, str) and f"{microvm}/oci/" in word:
                    snapshots.setdefault(word, []).append(argv.parent)
    for disk in (microvm / "oci").glob("*.ext4"):
        marker = disk.with_name(disk.name + ".used")
        snaps = [d for word, ds in snapshots.items() if f"file={disk}," in word for d in ds]
        last = 0.0
        if disk.name.split(".", 1)[0] in pulled:
            for p in (marker, disk):
                with contextlib.suppress(OSError):
                    last = p.stat().st_mtime
                    break
        size = sum(p.stat().st_blocks * 512 for p in (disk,) if p.exists()) + sum(map(du, snaps))
        yield Entry("microvm", disk, size, last, [marker, *snaps])


# every kind of entry the cache holds (a new store adds its collector here)
COLLECTORS: list[Callable[[Settings], Iterable[Entry]]] = [
    _builds,
    _bases,
    _pulled_layers,
    _pulled_disks,
]


def _used_paths() -> set[str]:
    """Every path a process of this host has as a mount root, its root or an open file."""
    found: set[str] = set()
    seen_ns: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        base = f"/proc/{pid}"
        with contextlib.suppress(OSError):
            found.add(os.readlink(f"{base}/root"))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"{base}/fd"):
                with contextlib.suppress(OSError):
                    found.add(os.readlink(f"{base}/fd/{fd}"))
        try:
            ns = os.readlink(f"{base}/ns/mnt")
        except OSError:
            continue
        if ns in seen_ns:
            continue
        seen_ns.add(ns)
        with contextlib.suppress(OSError), open(f"{base}/mountinfo") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 4:
                    found.add(parts[3].encode().decode("unicode_escape"))
    return found


def _mark_in_use(entries: list[Entry]) -> None:
    used = _used_paths()
    now = time.time()
    for e in entries:
        roots = [str(e.path), *(str(p) for p in e.extra if p.suffix == ".ext4")]
        e.in_use = now - e.last_used < RECENT_S or any(
            u == r or u.startswith(r + "/") for u in used for r in roots
        )


def entries(settings: Settings) -> list[Entry]:
    """Every entry of the cache, in use or not, least recently used first."""
    found = [e for collect in COLLECTORS for e in collect(settings)]
    _mark_in_use(found)
    return sorted(found, key=lambda e: e.last_used)


def plan(settings: Settings, max_bytes: int | None = None) -> list[Entry]:
    """What to remove for the cache to hold at most ``max_bytes`` (default: the setting,
    whose 0 keeps everything; ``max_bytes=0`` removes every entry that may go), least recently
    used first, never an entry in use."""
    limit = max_bytes if max_bytes is not None else settings.image_cache_max_mib << 20
    if max_bytes is None and limit <= 0:
        return []  # the setting at 0 keeps everything
    found = entries(settings)
    total = sum(e.size_bytes for e in found)
    out: list[Entry] = []
    for e in found:
        if total <= limit:
            break
        if e.in_use or e.kept:
            continue
        out.append(e)
        total -= e.size_bytes
    return out


def remove(found: list[Entry]) -> list[Path]:
    removed: list[Path] = []
    for e in found:
        for p in [e.path, *e.extra]:
            with contextlib.suppress(FileNotFoundError):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
                removed.append(p)
    return removed


def collect(
    settings: Settings, *, dry_run: bool = False, max_bytes: int | None = None
) -> list[Entry]:
    """Stale build areas (build_area.sweep) and what no pulled image's reference reaches
    (``LayerStore.gc``, skipped while a pull holds the store, and the microVM disks of the
    images it removed), then :func:`plan`, removed unless ``dry_run``."""
    if not dry_run:
        from ephemeral.oci.store import LayerStore

        build_area.sweep(settings.image_cache_dir)
        LayerStore(settings).gc(wait=False)
        # the disks of images the store no longer has go with them, as their layers did
        orphans = entries(settings)
        remove([e for e in orphans if e.kind == "microvm" and not e.last_used and not e.in_use])
    chosen = plan(settings, max_bytes)
    if not dry_run:
        remove(chosen)
    return chosen


def after_build(settings: Settings, built: Path) -> None:
    """Keep the cache within ``image_cache_max_mib`` after a build (which is marked used)."""
    mark_used(built)
    if settings.image_cache_max_mib <= 0:
        return
    try:
        gone = collect(settings)
    except OSError as exc:  # a full collection is the operator's; the build is done
        log.warning("image cache gc: %s", exc)
        return
    for e in gone:
        log.info("image cache gc: removed %s %s (%d bytes)", e.kind, e.path, e.size_bytes)
