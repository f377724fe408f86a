"""A Dockerfile stage ``FROM`` a registry image: built on the image's own layers, its result a
new layer of the same store (``ephemeral/oci/store.py``), never a flattened copy.

The image's stored layers are the read-only lower layers of an overlay mounted (by host root,
in the build's area, ``build_area.py``) at ``<stage>/root``; each lower is an *idmapped*
bind mount that shifts its owners into the build's uid range, so the build sandbox's root owns
the image's files as it sees them, while the stored layers are never written. Everything a
step writes lands in the overlay's upper directory, on the area's size-limited disk, in
overlayfs form (whiteouts are character devices 0:0, opaque directories carry
``trusted.overlay.opaque``): exactly the form of a pulled layer. When the build sandbox closes,
the overlay is unmounted, the upper's owners are shifted back to the image's ids, the
overlay's bookkeeping attributes (anything ``trusted.overlay.*`` but ``opaque``) are dropped,
and the upper is copied into the store as one layer. ``redirect_dir``, ``index`` and
``metacopy`` are off, so the upper holds whole files and plain directories only (a directory
of a lower layer renamed by a step is copied, as Docker's overlay2 does).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

from ephemeral.oci import reference
from ephemeral.oci.store import BUILD_REGISTRY, LayerInfo, LayerStore, PulledImage, du
from ephemeral.sandbox.build_area import _unmount
from ephemeral.sandbox.build_sandbox import HOLDER_SH, RANGE, run_bounded, shift_owners
from ephemeral.sandbox.writable_root import _IDMAP
from ephemeral.settings import Settings

OVERLAY_OPTIONS = "redirect_dir=off,index=off,metacopy=off,xino=off"
KEPT_XATTR = "trusted.overlay.opaque"
_MOUNT_TIMEOUT_S = 120.0

# host root: the holder's user namespace, each layer idmapped into it, then the overlay
_MOUNT_SH = (
    "base=$1 py=$2 idmap=$3 where=$4 opts=$5\nshift 5\n" + HOLDER_SH + "i=0 lowers=\n"
    'for src in "$@"; do\n'
    '  dst="$where/l/$i"; mkdir -m 0755 "$dst" || exit 1\n'
    '  "$py" -I -S -c "$idmap" "/proc/$h/ns/user" "$src" "$dst" || exit 1\n'
    '  lowers="${lowers:+$lowers:}$dst"; i=$((i + 1))\n'
    "done\n"
    "{ kill -9 $h; wait $h; } 2>/dev/null\n"
    'mount -t overlay ephemeral-build -o "nosuid,nodev,lowerdir=$lowers,'
    'upperdir=$where/o/upper,workdir=$where/o/work,$opts" "$where/root" || exit 1\n'
)


class LayeredRoot:
    """The overlay of ``lowers`` (stored layers, lowest first) at ``where/root``, its upper
    ``where/o/upper`` (:data:`upper`): a :class:`~ephemeral.sandbox.build_sandbox.RootHook`."""

    def __init__(self, lowers: list[Path], where: Path) -> None:
        self.lowers = lowers
        self.where = where
        self.root = where / "root"
        self.upper = where / "o" / "upper"

    async def mount(self, base: int) -> None:
        for d in (self.where / "l", self.where / "o" / "work", self.upper, self.root):
            d.mkdir(parents=True, mode=0o700, exist_ok=True)
        os.chown(self.upper, base, base)  # root of the build's user namespace
        self.upper.chmod(0o755)
        await run_bounded(
            [
                "/bin/sh",
                "-c",
                _MOUNT_SH,
                "sh",
                str(base),
                sys.executable,
                _IDMAP,
                str(self.where),
                OVERLAY_OPTIONS,
                *(str(p) for p in reversed(self.lowers)),  # topmost first
            ],
            "mount the image's layers",
            timeout=_MOUNT_TIMEOUT_S,
        )

    async def release(self, base: int) -> None:
        """Unmount, then make the upper a layer in the store's form (owners, attributes)."""
        await asyncio.to_thread(_unmount, self.where)
        await asyncio.to_thread(shift_owners, self.upper, -base, lo=base, hi=base + RANGE)
        await asyncio.to_thread(_drop_overlay_xattrs, self.upper)


def _drop_overlay_xattrs(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (".", *dirnames, *filenames):
            path = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                for attr in os.listxattr(path, follow_symlinks=False):
                    if attr.startswith("trusted.overlay.") and attr != KEPT_XATTR:
                        os.removexattr(path, attr, follow_symlinks=False)


def built_reference(name: str, digest: str) -> str:
    """The store reference a built image is kept under (``images gc`` keeps its layers)."""
    return f"{BUILD_REGISTRY}/{name}:{digest[:16]}"


def store_image(
    settings: Settings,
    base: PulledImage,
    upper: Path,
    *,
    name: str,
    digest: str,
    env: dict[str, str],
    workdir: str | None,
    user: str | None,
    cmd: list[str] | None,
    entrypoint: list[str] | None,
) -> PulledImage:
    """Copy ``upper`` into the store as one layer and record the image ``base`` + that layer
    under :func:`built_reference` (blocking: run it in a thread). The layer is keyed by the
    build's digest (its inputs), not by a tar's: nothing here makes a tar of it."""
    store = LayerStore(settings)
    diff_id = "sha256:" + hashlib.sha256(f"ephemeral-build-layer {digest}".encode()).hexdigest()
    with store.locked(exclusive=False):  # gc waits
        info = store.layer_info(diff_id)
        if info is None:
            tmp = store.tmp / f"build-{digest[:16]}-{os.getpid()}-{time.monotonic_ns()}"
            tmp.mkdir(mode=0o755)
            subprocess.run(
                ["cp", "-a", "--", f"{upper}/.", str(tmp)], check=True, capture_output=True
            )
            info = {"unpacked_bytes": du(tmp), "entries": _entries(tmp)}
            store.commit_layer(diff_id, tmp, info)
        layer = LayerInfo(
            digest=diff_id,
            diff_id=diff_id,
            size=0,
            unpacked_bytes=int(info.get("unpacked_bytes", 0)),
            entries=int(info.get("entries", 0)),
        )
        ref = reference.parse(built_reference(name, digest))
        image = PulledImage(
            digest="sha256:" + digest,
            reference=str(ref),
            config_digest="sha256:" + digest,
            layers=[*base.layers, layer],
            env=env,
            workdir=workdir,
            user=user,
            entrypoint=entrypoint,
            cmd=cmd,
            pulled_at=time.time(),
        )
        store.put_image(image)
        store.set_ref(ref, image.digest)
    return image


def _entries(root: Path) -> int:
    return sum(len(dirnames) + len(filenames) for _, dirnames, filenames in os.walk(root))
