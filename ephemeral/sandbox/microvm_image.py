"""Build the microVM boot artifacts: Debian's cloud kernel, the stage0 initramfs, the ext4 root.

The kernel comes from Debian's own package (``apt-get download`` of the package that
``linux-image-cloud-amd64`` depends on), so no URL lives in the tree. Debian builds every virtio
driver as a module, hence the small stage0 initramfs (static busybox, the modules listed in
``sandbox_images/<name>/microvm/modules.txt`` and ``stage0-init.sh``) that loads them, mounts the
read-only image disk under a tmpfs overlay and the agent runtime's disk at ``/.ephemeral``, and
hands over to ``stage2-init.sh`` run by its own busybox, which starts the agent on the runtime
and applies each restored sandbox's limits: nothing of the image runs our side.

The image disk is a built image's rootfs as one ext4 (``build_ext4``), or a pulled image's
layers as the directories of one ext4 (``build_layered_ext4``, once per image digest), which
the guest stacks as overlayfs lower layers.

Everything is cached under ``settings.image_cache_dir / "microvm"`` by content hash, so a second
build only costs the hashing. The memory snapshot is made by :mod:`ephemeral.sandbox.microvm`,
which needs a running VM.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Iterable, Iterator
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
STALE_AFTER_S = 3600.0  # an older initramfs or ext4 build is pruned only once this old
# the boot definition (stage 0 and 2, modules) of a pulled image: it has none of its own
PULLED_DEFINITION = "default"
# bumped when a pulled image's disk is laid out differently (it is part of the disk's name)
PULLED_DISK_VERSION = 1


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
    # a pulled image's disk holds its layers as directories 0..N-1 (lowest first), which the
    # guest stacks as overlayfs does on the host; 0: the disk is the rootfs itself
    layers: int = 0
    agent_disk: Path | None = None  # the agent runtime (agent_runtime.py), mounted /.ephemeral


def microvm_cache(settings: Settings) -> Path:
    return settings.image_cache_dir / "microvm"


def definition_dir(settings: Settings, image: str) -> Path:
    """The image's ``microvm/`` boot definition, or its nearest base's (a derived image such as
    python-dev boots the same way as the image it is built on), else ``default``'s (a rootfs
    registered as an image has none: the stages run nothing of the image)."""
    found = microvm_definition_dir(settings, image)
    return found if found.is_dir() else microvm_definition_dir(settings, PULLED_DEFINITION)


def _run(argv: list[str], timeout: float, *, cwd: Path | None = None) -> str:
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


def build_ext4(rootfs: Path, out: Path, label: str = "ephemeral-root") -> None:
    """A journal-less ext4 image of ``rootfs``; the VM only ever mounts it read-only."""
    _mkfs([rootfs], out, label, as_dirs=False)


def build_layered_ext4(layers: list[Path], out: Path) -> None:
    """One ext4 image whose root holds each of ``layers`` (lowest first) as directory ``i``, as
    it is: overlayfs whiteouts (character devices 0:0), opaque directories (their
    ``trusted.overlay.opaque``), owners and links are copied by ``mke2fs -d``, which only
    reads the trees (lstat, readlink, open of regular files) and writes nothing but ``out``.
    The layers are bound read-only into an empty staging directory in a mount namespace of
    its own, so no byte is copied on the host and the binds vanish with the process."""
    _mkfs(layers, out, "ephemeral-layers", as_dirs=True)


def _mkfs(sources: list[Path], out: Path, label: str, *, as_dirs: bool) -> None:
    size, count = 0, 0
    for src in sources:
        s, c = _tree_size(src)
        size, count = size + s, count + c
    mib = (int(size * 1.3) >> 20) + 64
    inodes = int(count * 1.5) + 4096
    tmp = out.with_name(out.name + ".tmp")
    tmp.unlink(missing_ok=True)
    mkfs = ["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-L", label, "-N", str(inodes)]
    mkfs += ["-E", "root_owner=0:0", "-d"]
    if not as_dirs:
        _run([*mkfs, str(sources[0]), str(tmp), f"{mib}M"], timeout=MKFS_TIMEOUT_S)
        tmp.rename(out)
        return
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".stage-") as stage:
        for i in range(len(sources)):
            (Path(stage) / str(i)).mkdir(mode=0o755)
        Path(stage).chmod(0o755)
        # "$@" are our store's paths, never the image's: each is bound at $stage/<i>
        script = (
            'set -e; stage=$1; out=$2; size=$3; shift 3; i=0; for layer in "$@"; do '
            'mount --bind -o ro "$layer" "$stage/$i"; i=$((i + 1)); done; '
            f'exec {" ".join(mkfs)} "$stage" "$out" "$size"'
        )
        unshare = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script]
        _run([*unshare, "sh", stage, str(tmp), f"{mib}M", *map(str, sources)], MKFS_TIMEOUT_S)
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
    defn = _checked_definition(settings, image)
    with _build_lock(settings) as cache:
        kernel = ensure_kernel(settings)
        initrd, initrd_key = _initrd(settings, image, kernel, defn, cache)
        ext4 = cache / "rootfs" / f"{image}-{image_hash}.ext4"
        if not ext4.exists():
            ext4.parent.mkdir(parents=True, exist_ok=True)
            build_ext4(rootfs, ext4)
            prune_stale(settings, image, keep=ext4)
    key = _digest(image, image_hash, kernel.version, initrd_key)
    return BootArtifacts(kernel=kernel, initrd=initrd, rootfs_ext4=ext4, key=key)


def layers_key(diff_ids: Iterable[str]) -> str:
    """What names the disk of an image of stored layers: their diff ids (hex, lowest first),
    so images with the same layers (a reference and its digest, a retag) share one disk."""
    return hashlib.sha256("\n".join(diff_ids).encode()).hexdigest()[:32]


def pulled_disk(settings: Settings, key: str) -> Path:
    """Where the disk of the layers :func:`layers_key` names is kept."""
    return microvm_cache(settings) / "oci" / f"{key}.v{PULLED_DISK_VERSION}.ext4"


def ensure_pulled_artifacts(settings: Settings, layers: list[Path]) -> BootArtifacts:
    """Kernel + initramfs (the ``default`` boot definition: nothing of it runs on the image's
    files) + one ext4 of the pulled image's ``layers`` (their directories in the layer store,
    lowest first), made once per list of layers."""
    defn = _checked_definition(settings, PULLED_DEFINITION)
    with _build_lock(settings) as cache:
        kernel = ensure_kernel(settings)
        initrd, initrd_key = _initrd(settings, PULLED_DEFINITION, kernel, defn, cache)
        # a layer's directory is <store>/layers/<diff id hex>/fs (oci/store.py)
        key = layers_key(layer.parent.name for layer in layers)
        ext4 = pulled_disk(settings, key)
        if not ext4.exists():
            ext4.parent.mkdir(parents=True, exist_ok=True)
            build_layered_ext4(layers, ext4)
    key = _digest("pulled", key, kernel.version, initrd_key)
    return BootArtifacts(
        kernel=kernel, initrd=initrd, rootfs_ext4=ext4, key=key, layers=len(layers)
    )


def ensure_runtime_disk(settings: Settings, runtime: Path) -> Path:
    """The agent runtime's directory (``agent_runtime.py``, named by its content hash) as a
    read-only ext4 disk, made once per runtime."""
    out = microvm_cache(settings) / "agent" / f"{runtime.name}.ext4"
    if out.exists():
        return out
    with _build_lock(settings):
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            build_ext4(runtime, out, label="ephemeral-agent")
    return out


def _checked_definition(settings: Settings, image: str) -> Path:
    defn = definition_dir(settings, image)
    for needed in ("stage0-init.sh", "stage2-init.sh", "modules.txt"):
        if not (defn / needed).is_file():
            raise SandboxError(f"microvm: {defn}/{needed} is missing")
    return defn


@contextlib.contextmanager
def _build_lock(settings: Settings) -> Iterator[Path]:
    """The microVM cache, held: several processes (test sessions, the API server) may build
    the same artifacts at once."""
    cache = microvm_cache(settings)
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".build.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield cache


def _initrd(
    settings: Settings, image: str, kernel: Kernel, defn: Path, cache: Path
) -> tuple[Path, str]:
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
    return initrd, initrd_key


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

    A running VM keeps its open files, so this is safe while old sandboxes still run. A file
    made in the last :data:`STALE_AFTER_S` stays: another checkout or version sharing the
    cache made it for VMs it is starting now (two definitions would otherwise delete each
    other's files between a snapshot and its restore)."""
    cache = microvm_cache(settings)
    removed: list[Path] = []
    stale = [p for p in (cache / "rootfs").glob(f"{image}-*.ext4") if p != keep]
    if keep.name.startswith("stage0-"):
        stale = [p for p in (cache / "initrd").glob("stage0-*.cpio.gz") if p != keep]
    now = time.time()
    for p in stale:
        try:
            if now - p.stat().st_mtime < STALE_AFTER_S:
                continue
        except OSError:
            continue
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
