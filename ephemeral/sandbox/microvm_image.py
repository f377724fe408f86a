"""Build the microVM boot artifacts: Debian's cloud kernel, the stage0 initramfs, the ext4 root.

The kernel comes from Debian's own package (``apt-get download`` of the package that
``linux-image-cloud-amd64`` depends on), so no URL lives in the tree. Debian builds every virtio
driver as a module, hence the small stage0 initramfs (static busybox, the modules listed in
``sandbox_images/<name>/microvm/modules.txt`` and ``stage0-init.sh``) that loads them, mounts the
read-only root disk under a tmpfs overlay and hands over to ``stage2-init.sh`` run by the root's
``/bin/sh``, which starts the agent and applies each restored sandbox's limits.

Everything is cached under ``settings.image_cache_dir / "microvm"`` by content hash, so a second
build only costs the hashing. The memory snapshot is made by :mod:`ephemeral.sandbox.microvm`,
which needs a running VM.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ephemeral.errors import SandboxError
from ephemeral.sandbox.image_bases import microvm_definition_dir
from ephemeral.settings import Settings

log = logging.getLogger(__name__)

KERNEL_META_PACKAGE = "linux-image-cloud-amd64"
BUSYBOX = Path("/usr/bin/busybox")
APT_TIMEOUT_S = 300.0
MKFS_TIMEOUT_S = 300.0
RESOLVE_TTL_S = 24 * 3600.0


@dataclass(frozen=True)
class Kernel:
    version: str  # e.g. "6.1.0-57-cloud-amd64"
    vmlinuz: Path
    modules_dir: Path  # .../lib/modules/<version>


@dataclass(frozen=True)
class BootArtifacts:
    """What QEMU needs to boot the image; ``key`` names this exact combination."""

    kernel: Kernel
    initrd: Path
    rootfs_ext4: Path
    key: str


def microvm_cache(settings: Settings) -> Path:
    return settings.image_cache_dir / "microvm"


def definition_dir(settings: Settings, image: str) -> Path:
    """The image's ``microvm/`` boot definition, or its nearest base's (a derived image such as
    python-dev boots the same way as the image it is built on)."""
    return microvm_definition_dir(settings, image)


def _run(argv: list[str], *, timeout: float, cwd: Path | None = None) -> str:
    try:
        proc = subprocess.run(
            argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError as e:
        raise SandboxError(f"microvm image build: {argv[0]} is not installed", cause=e) from e
    except subprocess.TimeoutExpired as e:
        raise SandboxError(f"microvm image build: {argv[0]} timed out after {timeout:.0f}s") from e
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-600:]
        raise SandboxError(f"microvm image build: {' '.join(argv[:3])} failed: {tail}")
    return proc.stdout


def _resolve_kernel_package() -> str | None:
    """The versioned package the cloud meta-package points at, from the local apt lists."""
    try:
        out = _run(["apt-cache", "depends", KERNEL_META_PACKAGE], timeout=60)
    except SandboxError:
        return None
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("Depends:") and "linux-image-" in line:
            return line.split(":", 1)[1].strip()
    return None


def _kernel_package(root: Path) -> str | None:
    """``_resolve_kernel_package`` costs seconds (apt-cache): remember its answer for a day."""
    memo = root / "resolved.json"
    try:
        saved = json.loads(memo.read_text())
        if time.time() - float(saved["at"]) < RESOLVE_TTL_S and (root / saved["package"]).is_dir():
            return str(saved["package"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    package = _resolve_kernel_package()
    if package is not None:
        root.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"package": package, "at": time.time()}))
        tmp.replace(memo)
    return package


def ensure_kernel(settings: Settings) -> Kernel:
    """Fetch and unpack Debian's cloud kernel once; reuse the newest cached one when offline."""
    root = microvm_cache(settings) / "kernels"
    package = _kernel_package(root)
    if package is None:
        cached = sorted(p for p in root.glob("linux-image-*") if (p / "done").exists())
        if not cached:
            raise SandboxError(
                f"microvm: cannot resolve {KERNEL_META_PACKAGE} (run `apt-get update` first)"
            )
        return _kernel_in(cached[-1])
    target = root / package
    if (target / "done").exists():
        return _kernel_in(target)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        work = Path(tmp)
        # apt's download sandbox user must be able to write here
        work.chmod(0o777)
        _run(["apt-get", "download", "-q", package], cwd=work, timeout=APT_TIMEOUT_S)
        debs = list(work.glob("*.deb"))
        if len(debs) != 1:
            raise SandboxError(f"microvm: apt-get download {package} produced {len(debs)} files")
        unpacked = work / "x"
        _run(["dpkg-deb", "-x", str(debs[0]), str(unpacked)], timeout=APT_TIMEOUT_S)
        staged = work / "kernel"
        staged.mkdir()
        vmlinuz = next(iter(sorted((unpacked / "boot").glob("vmlinuz-*"))), None)
        if vmlinuz is None:
            raise SandboxError(f"microvm: {package} has no /boot/vmlinuz-*")
        version = vmlinuz.name.removeprefix("vmlinuz-")
        shutil.copy2(vmlinuz, staged / "vmlinuz")
        shutil.copy2(unpacked / "boot" / f"config-{version}", staged / "config")
        (staged / "lib").mkdir()
        shutil.move(unpacked / "lib" / "modules", staged / "lib" / "modules")
        (staged / "version").write_text(version + "\n")
        (staged / "done").write_text(package + "\n")
        if target.exists() and not (target / "done").exists():
            shutil.rmtree(target)
        try:
            staged.rename(target)
        except OSError:
            if not (target / "done").exists():
                raise
            # another process finished the same fetch first
    return _kernel_in(target)


def _kernel_in(d: Path) -> Kernel:
    version = (d / "version").read_text().strip()
    return Kernel(version=version, vmlinuz=d / "vmlinuz", modules_dir=d / "lib/modules" / version)


def _module_names(defn: Path) -> list[str]:
    names = []
    for line in (defn / "modules.txt").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            names.append(line)
    return names


def _find_module(kernel: Kernel, name: str) -> Path:
    for candidate in (name, name.replace("_", "-")):
        hits = sorted(kernel.modules_dir.rglob(f"{candidate}.ko"))
        if hits:
            return hits[0]
    raise SandboxError(f"microvm: kernel {kernel.version} has no module {name}.ko")


class _Cpio:
    """A deterministic newc archive (no host uid/mtime leaks into the hash)."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.ino = 1

    def _entry(
        self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)
    ) -> None:
        encoded = name.encode() + b"\0"
        fields = [self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(encoded), 0]
        self.ino += 1
        self.buf.write(b"070701" + b"".join(b"%08X" % f for f in fields) + encoded)
        self.buf.write(b"\0" * (-(110 + len(encoded)) % 4))
        self.buf.write(data)
        self.buf.write(b"\0" * (-len(data) % 4))

    def directory(self, name: str) -> None:
        self._entry(name, 0o040755)

    def file(self, name: str, data: bytes, perm: int = 0o644) -> None:
        self._entry(name, 0o100000 | perm, data)

    def chardev(self, name: str, major: int, minor: int) -> None:
        self._entry(name, 0o020600, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return self.buf.getvalue()


def _depends(ko: bytes) -> list[str]:
    """The ``depends=`` entry of a module's .modinfo section (no depmod needed)."""
    at = ko.find(b"\0depends=")
    if at < 0:
        return []
    value = ko[at + 9 : ko.index(b"\0", at + 9)].decode()
    return [d for d in value.split(",") if d]


def _load_order(kernel: Kernel, wanted: list[str]) -> list[tuple[str, bytes]]:
    """``wanted`` plus their dependencies, each after everything it needs."""
    order: list[tuple[str, bytes]] = []
    seen: set[str] = set()

    def visit(name: str, depth: int) -> None:
        if name in seen:
            return
        if depth > 32:
            raise SandboxError(f"microvm: module dependency loop at {name}")
        data = _find_module(kernel, name).read_bytes()
        for dep in _depends(data):
            visit(dep, depth + 1)
        seen.add(name)
        order.append((name, data))

    for name in wanted:
        visit(name, 0)
    return order


def build_initramfs(kernel: Kernel, defn: Path) -> bytes:
    """stage0.cpio.gz contents: busybox, the modules in load order, ``/init``."""
    modules = _load_order(kernel, _module_names(defn))
    names = [n for n, _ in modules]
    cpio = _Cpio()
    for d in ("bin", "dev", "proc", "sys", "lib", "lib/modules", "lower", "upper", "newroot"):
        cpio.directory(d)
    cpio.chardev("dev/console", 5, 1)
    cpio.file("bin/busybox", BUSYBOX.read_bytes(), 0o755)
    cpio.file("init", (defn / "stage0-init.sh").read_bytes(), 0o755)
    cpio.file("stage2-init.sh", (defn / "stage2-init.sh").read_bytes(), 0o755)
    cpio.file("lib/modules/order", ("\n".join(names) + "\n").encode())
    for name, data in modules:
        cpio.file(f"lib/modules/{name}.ko", data)
    return gzip.compress(cpio.finish(), compresslevel=6, mtime=0)


def _tree_size(root: Path) -> tuple[int, int]:
    total, count = 0, 0
    for dirpath, dirnames, filenames in os.walk(root):
        count += 1 + len(dirnames) + len(filenames)
        for f in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                continue
    return total, count


def build_ext4(rootfs: Path, out: Path) -> None:
    """A journal-less ext4 image of ``rootfs``; the VM only ever mounts it read-only."""
    size, count = _tree_size(rootfs)
    mib = (int(size * 1.3) >> 20) + 64
    inodes = int(count * 1.5) + 4096
    tmp = out.with_name(out.name + ".tmp")
    tmp.unlink(missing_ok=True)
    _run(
        [
            "mkfs.ext4",
            "-q",
            "-F",
            "-O",
            "^has_journal",
            "-L",
            "ephemeral-root",
            "-N",
            str(inodes),
            "-E",
            "root_owner=0:0",
            "-d",
            str(rootfs),
            str(tmp),
            f"{mib}M",
        ],
        timeout=MKFS_TIMEOUT_S,
    )
    tmp.rename(out)


def _digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:16]


def ensure_boot_artifacts(
    settings: Settings, image: str, rootfs: Path, image_hash: str
) -> BootArtifacts:
    """Kernel + initramfs + ext4 for ``image`` (its rootfs already built), cached by hash."""
    if not rootfs.is_dir():
        raise SandboxError(f"microvm: rootfs {rootfs} does not exist")
    defn = definition_dir(settings, image)
    for needed in ("stage0-init.sh", "stage2-init.sh", "modules.txt"):
        if not (defn / needed).is_file():
            raise SandboxError(f"microvm: {defn}/{needed} is missing")
    cache = microvm_cache(settings)
    cache.mkdir(parents=True, exist_ok=True)
    # Several processes (test sessions, the API server) may build the same artifacts at once.
    with (cache / ".build.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _ensure_locked(settings, image, rootfs, image_hash, defn, cache)


def _ensure_locked(
    settings: Settings, image: str, rootfs: Path, image_hash: str, defn: Path, cache: Path
) -> BootArtifacts:
    kernel = ensure_kernel(settings)

    # Keyed by its inputs, so a cache hit costs no archive build.
    bb = BUSYBOX.stat()
    initrd_key = _digest(
        kernel.version,
        (defn / "stage0-init.sh").read_bytes(),
        (defn / "stage2-init.sh").read_bytes(),
        (defn / "modules.txt").read_bytes(),
        f"{bb.st_size}:{bb.st_mtime_ns}",
    )
    initrd = cache / "initrd" / f"stage0-{initrd_key}.cpio.gz"
    if not initrd.exists():
        initrd.parent.mkdir(parents=True, exist_ok=True)
        tmp = initrd.with_name(initrd.name + ".tmp")
        tmp.write_bytes(build_initramfs(kernel, defn))
        tmp.rename(initrd)
        prune_stale(settings, image, keep=initrd)

    ext4 = cache / "rootfs" / f"{image}-{image_hash}.ext4"
    if not ext4.exists():
        ext4.parent.mkdir(parents=True, exist_ok=True)
        build_ext4(rootfs, ext4)
        prune_stale(settings, image, keep=ext4)
    key = _digest(image, image_hash, kernel.version, initrd_key)
    return BootArtifacts(kernel=kernel, initrd=initrd, rootfs_ext4=ext4, key=key)


def build_with_image(settings: Settings, image: str, rootfs: Path, image_hash: str) -> None:
    """Hook run by ``images.ensure_image`` right after it builds an image: make the microVM's
    kernel, initramfs and ext4 with it (the memory snapshot waits for the first microVM).

    Best effort: a host that cannot fetch the kernel still gets its image for the other
    drivers; the microVM driver tries again when used and fails with the reason then."""
    if not definition_dir(settings, image).is_dir():
        return
    if shutil.which("qemu-system-x86_64") is None:
        # No microVM runs here: skip the kernel download and the ext4 (most of a cold build).
        log.info("microVM artifacts for image %s skipped: qemu-system-x86_64 not installed", image)
        return
    try:
        ensure_boot_artifacts(settings, image, rootfs, image_hash)
    except (SandboxError, OSError) as exc:
        log.warning("microVM artifacts for image %s not built: %s", image, exc)


def prune_stale(settings: Settings, image: str, *, keep: Path) -> list[Path]:
    """Drop older ext4 builds of ``image``, older initramfs files and every snapshot made from a
    file that is gone (~100-300 MB each).

    A running VM keeps its open files, so this is safe while old sandboxes still run."""
    cache = microvm_cache(settings)
    removed: list[Path] = []
    stale = [p for p in (cache / "rootfs").glob(f"{image}-*.ext4") if p != keep]
    if keep.name.startswith("stage0-"):
        stale = [p for p in (cache / "initrd").glob("stage0-*.cpio.gz") if p != keep]
    for p in stale:
        p.unlink(missing_ok=True)
        removed.append(p)
    for argv_file in (cache / "snapshots").glob("*/argv.json"):
        try:
            argv = json.loads(argv_file.read_text())
        except (OSError, ValueError):
            continue
        for value in argv:
            for part in str(value).replace(",", "=").split("="):
                if part.startswith(str(cache)) and not Path(part).exists():
                    shutil.rmtree(argv_file.parent, ignore_errors=True)
                    removed.append(argv_file.parent)
                    break
            else:
                continue
            break
    return removed
