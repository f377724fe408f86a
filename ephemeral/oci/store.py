"""The content-addressed store of pulled images, under ``<cache_dir>/oci`` (mode 0700)::

    blobs/sha256/<hex>            manifests and configs, as the registry sent them (verified)
    layers/<hex>/fs/              one layer unpacked once, keyed by its diff id (the sha256 of
                                  its uncompressed tar), in overlayfs form (``unpack.py``)
    layers/<hex>/layer.json       written last: the layer is complete
    images/<hex>.json             one image (by its manifest's digest): its layers in order,
                                  the parts of its config a sandbox honours, sizes
    refs/<sha256 of ref>.json     a reference as pulled (``docker.io/library/ubuntu:24.04``)
                                  and the image digest it resolved to
    tmp/                          downloads and unpacks in progress

A layer's compressed blob is deleted once it is unpacked and verified: the unpacked tree is the
stored form, so the disk of N images sharing a base is the sum of their unique layers (plus
their small manifests and configs). ``gc`` removes what no reference reaches: images no ref
names, layers no image lists, blobs nothing lists, and leftovers in ``tmp/``. Pulls hold the
store's lock shared; ``gc`` holds it exclusively, so it never removes what a pull is writing.
``ephemeral images gc`` runs it, then sizes the whole image cache with the layers as entries
(:meth:`LayerStore.gc_entries`, least recently used first, never one a sandbox mounts).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from ephemeral import flock
from ephemeral.oci.reference import Reference
from ephemeral.sandbox.cache_use import USED, Entry
from ephemeral.settings import Settings


class LayerInfo(BaseModel):
    digest: str  # of the compressed blob, as the manifest lists it
    diff_id: str
    size: int  # compressed
    unpacked_bytes: int = 0
    entries: int = 0


class PulledImage(BaseModel):
    """One pulled image: what a sandbox of it needs, and where it came from."""

    digest: str  # sha256 of the platform manifest: what ``image_hash`` records
    reference: str  # the normalized reference it was last pulled as
    config_digest: str
    layers: list[LayerInfo]
    env: dict[str, str] = {}
    workdir: str | None = None
    user: str | None = None
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    pulled_at: float = 0.0

    @property
    def hex(self) -> str:
        return self.digest.split(":", 1)[1]

    @property
    def unpacked_bytes(self) -> int:
        return sum(layer.unpacked_bytes for layer in self.layers)


@dataclass
class GcReport:
    images: list[str] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    blobs: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    refs: list[str] = field(default_factory=list)  # built images' whose build is gone


def du(path: Path) -> int:
    """Bytes of disk (allocated blocks) under ``path``, each inode once, links not followed."""
    if not path.is_dir() or path.is_symlink():
        with contextlib.suppress(OSError):
            return path.lstat().st_blocks * 512
        return 0
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(root, name))
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


# The store reference of an image built from a Dockerfile FROM a registry image
# (``sandbox/dockerfile/layers.py``): kept while its build's entry in the image cache is.
BUILD_REGISTRY = "localhost/ephemeral-build"


def _hex(digest: str) -> str:
    return digest.split(":", 1)[1]


class LayerStore:
    def __init__(self, settings: Settings) -> None:
        self.root = settings.oci_dir
        self.blobs = self.root / "blobs" / "sha256"
        self.layers = self.root / "layers"
        self.images = self.root / "images"
        self.refs = self.root / "refs"
        self.tmp = self.root / "tmp"
        self.builds = settings.image_cache_dir  # where a built image's entry lives

    def ensure(self) -> None:
        # host root's only: nothing of an image is another host user's to read or run
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.root.chmod(0o700)
        for d in (self.blobs, self.layers, self.images, self.refs, self.tmp):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)

    @contextlib.contextmanager
    def locked(self, *, exclusive: bool, wait: bool = True) -> Iterator[bool]:
        """Hold the store's lock; yields False (not held) when ``wait`` is False and another
        process holds it."""
        self.ensure()
        with flock.held(self.root / ".lock", exclusive=exclusive, wait=wait) as got:
            yield got

    # ---- paths and records

    def layer_dir(self, diff_id: str) -> Path:
        return self.layers / _hex(diff_id)

    def layer_root(self, diff_id: str) -> Path:
        """The unpacked tree: an overlay lower directory (its path has no ``:`` or ``,``)."""
        return self.layer_dir(diff_id) / "fs"

    def layer_info(self, diff_id: str) -> dict[str, int] | None:
        try:
            data = json.loads((self.layer_dir(diff_id) / "layer.json").read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def commit_layer(self, diff_id: str, unpacked: Path, info: dict[str, int]) -> None:
        """Move an unpacked and verified tree into place (a racing pull's copy is dropped)."""
        dest = self.layer_dir(diff_id)
        staging = self.tmp / f"commit-{_hex(diff_id)}-{os.getpid()}-{time.monotonic_ns()}"
        staging.mkdir(mode=0o700)
        os.rename(unpacked, staging / "fs")
        (staging / "layer.json").write_text(json.dumps(info))
        try:
            os.rename(staging, dest)
        except OSError:
            if self.layer_info(diff_id) is None:
                raise
            shutil.rmtree(staging)

    def put_blob(self, digest: str, body: bytes) -> None:
        path = self.blobs / _hex(digest)
        if not path.exists():
            tmp = self.tmp / f"blob-{_hex(digest)}-{os.getpid()}-{time.monotonic_ns()}"
            tmp.write_bytes(body)
            os.replace(tmp, path)

    def image(self, digest: str) -> PulledImage | None:
        try:
            return PulledImage.model_validate_json(
                (self.images / f"{_hex(digest)}.json").read_text()
            )
        except (OSError, ValueError):
            return None

    def complete(self, image: PulledImage) -> bool:
        return all(self.layer_info(layer.diff_id) is not None for layer in image.layers)

    def put_image(self, image: PulledImage) -> None:
        tmp = self.tmp / f"image-{image.hex}-{os.getpid()}-{time.monotonic_ns()}"
        tmp.write_text(image.model_dump_json(indent=1))
        os.replace(tmp, self.images / f"{image.hex}.json")

    def _ref_path(self, ref: Reference | str) -> Path:
        return self.refs / f"{hashlib.sha256(str(ref).encode()).hexdigest()[:32]}.json"

    def set_ref(self, ref: Reference, digest: str) -> None:
        tmp = self.tmp / f"ref-{os.getpid()}-{time.monotonic_ns()}"
        tmp.write_text(json.dumps({"reference": str(ref), "digest": digest, "at": time.time()}))
        os.replace(tmp, self._ref_path(ref))

    def resolve(self, ref: Reference) -> PulledImage | None:
        """The complete image ``ref`` was pulled as here, or None (never contacts a registry).
        A reference with a digest is also the image stored under that manifest digest, pulled
        under any name: a digest names the same bytes everywhere (how a run boots the digest
        its admission recorded, ``sandbox_image.pinned_reference``)."""
        if ref.digest is not None:
            stored = self.image(ref.digest)
            if stored is not None and self.complete(stored):
                return stored
        try:
            data = json.loads(self._ref_path(ref).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("reference") != str(ref):
            return None
        found = self.image(str(data.get("digest", "")))
        return found if found is not None and self.complete(found) else None

    def references(self) -> dict[str, str]:
        """Every reference pulled here → its image digest."""
        out: dict[str, str] = {}
        if not self.refs.is_dir():
            return out
        for p in sorted(self.refs.glob("*.json")):
            with contextlib.suppress(OSError, ValueError):
                data = json.loads(p.read_text())
                out[str(data["reference"])] = str(data["digest"])
        return out

    def remove_ref(self, ref: Reference) -> bool:
        path = self._ref_path(ref)
        if path.exists():
            path.unlink()
            return True
        return False

    def _build_gone(self, ref: str) -> bool:
        """Whether ``ref`` names an image built from a Dockerfile (``BUILD_REGISTRY``) whose
        entry in the image cache is gone (``images rm``, or ``images gc`` took it)."""
        if not ref.startswith(BUILD_REGISTRY + "/"):
            return False
        name, _, tag = ref.removeprefix(BUILD_REGISTRY + "/").partition(":")
        return not (self.builds / f"{name}-{tag}" / "image.json").is_file()

    def all_images(self) -> list[PulledImage]:
        out = []
        if self.images.is_dir():
            for p in sorted(self.images.glob("*.json")):
                found = self.image("sha256:" + p.stem)
                if found is not None:
                    out.append(found)
        return out

    # ---- garbage collection

    def live_layers(self) -> set[str]:
        """The hex diff ids of the layers of every image some reference names."""
        live_images = set(self.references().values())
        return {
            _hex(layer.diff_id)
            for image in self.all_images()
            if image.digest in live_images
            for layer in image.layers
        }

    def gc_entries(self) -> Iterator[Entry]:
        """The layers as ``images gc`` entries (``sandbox/image_gc.py``): its plan removes the
        least recently used first, never one a live sandbox mounts; a layer no named image
        lists counts as never used. An image whose layer went is pulled again when next
        named (``resolve`` answers only for complete images)."""
        if not self.layers.is_dir():
            return
        live = self.live_layers()
        for d in sorted(self.layers.iterdir()):
            if d.is_symlink() or not d.is_dir():
                continue
            last = 0.0
            if d.name in live:
                for marker in (d / USED, d / "layer.json"):
                    with contextlib.suppress(OSError):
                        last = marker.stat().st_mtime
                        break
            yield Entry("layer", d, du(d), last)

    def gc(self, *, dry_run: bool = False, wait: bool = True) -> GcReport:
        """Remove what no reference reaches (see the module's docstring). With ``wait=False``
        nothing is done while a pull holds the store (the next gc will)."""
        report = GcReport()
        if not self.root.is_dir():
            return report
        with self.locked(exclusive=True, wait=wait) as held:
            if not held:
                return report
            refs = self.references()
            for text in [r for r in refs if self._build_gone(r)]:
                report.refs.append(text)
                del refs[text]
                if not dry_run:
                    self._ref_path(text).unlink(missing_ok=True)
            live_images = set(refs.values())
            live_layers: set[str] = set()
            live_blobs: set[str] = set()
            for image in self.all_images():
                if image.digest not in live_images:
                    path = self.images / f"{image.hex}.json"
                    report.images.append(image.digest)
                    report.freed_bytes += du(path)
                    if not dry_run:
                        path.unlink()
                    continue
                live_layers |= {_hex(layer.diff_id) for layer in image.layers}
                live_blobs |= {image.hex, _hex(image.config_digest)}
            for d in sorted(self.layers.iterdir()):
                if d.name not in live_layers:
                    report.layers.append("sha256:" + d.name)
                    report.freed_bytes += du(d)
                    if not dry_run:
                        shutil.rmtree(d)
            for b in sorted(self.blobs.iterdir()):
                if b.name not in live_blobs:
                    report.blobs.append("sha256:" + b.name)
                    report.freed_bytes += du(b)
                    if not dry_run:
                        b.unlink()
            for t in sorted(self.tmp.iterdir()):  # nothing pulls while we hold the lock
                report.freed_bytes += du(t)
                if not dry_run:
                    shutil.rmtree(t) if t.is_dir() and not t.is_symlink() else t.unlink()
        return report
