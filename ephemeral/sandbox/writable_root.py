"""The writable root of every ``namespaces`` and ``gvisor`` sandbox: a private copy-on-write
overlay over the shared, read-only image, sized by the disk limit, gone with the sandbox.

Docker, E2B, Modal, Daytona, Inspect and Harbor all give a task a root it can write
(``apt-get install``, ``adduser``, ``pip install`` as root at run time), so it is always on:
a read-only root would buy nothing, since the upper layer is the sandbox's own and discarded.

How (run by host root in the launcher's private mount namespace, :func:`mount_script`: one
exec of ``mount_root.c``, compiled with the host's gcc on first use, which the image builds
need anyway; without it, the same steps as shell commands and a Python idmap helper):

- the image is bound read-only at :data:`LOWER` (a pulled image's layers each at
  ``LOWER/<i>``, on a small tmpfs, topmost first: the overlay's lower layers); for
  ``namespaces`` through an *idmapped* mount that
  shifts its owners into the sandbox's uid range (host uid 0 shows as the range's base, which
  is root inside the sandbox's user namespace), so the sandbox's root owns the image's files
  as it sees them, while on the host it stays an unprivileged uid owning nothing;
- a tmpfs of the disk limit at :data:`UPPER` (less where the memory limit could not hold it
  beside the sandbox's other tmpfs mounts: :func:`tmpfs_sizes`), named
  ``sandbox-upper-<id>`` (so a test can look for it in every mount namespace), holds the
  overlay's upper and work directories: a write past it is ENOSPC inside, never host disk;
  its pages are charged to the sandbox's memory cgroup like any tmpfs's;
- or, for a disk limit above ``disk_tmpfs_max_mib`` (:func:`on_disk`), an ext4 file of the
  disk limit instead (:func:`make_disk`: sparse, in the sandbox's host-root-only run
  directory), on a loop device that frees itself with the mount: the layer may be larger than
  memory and is not charged to it (only reclaimable page cache is), a write past it is ENOSPC,
  and the sandbox's ``/tmp`` lives on it too instead of a tmpfs. The file's name is unlinked
  once mounted, so its blocks go with the sandbox's mount namespace; a crash before that
  leaves it in the run directory, which the handle names (the reaper removes it);
- the overlay of both is mounted at :data:`MOUNT_POINT` and becomes the sandbox's ``/``;
- above the image, one more read-only layer of our own (:func:`with_container_etc`) holds what
  Docker writes into every container's ``/etc``: ``hosts`` (``localhost`` on 127.0.0.1 and
  ``::1``), ``hostname`` and a ``resolv.conf`` that fails at once (no server answers on
  loopback; with ``web`` names resolve in the egress proxy). They hide the image's own, and
  are the sandbox's to change (copied up into its upper layer, as any file of the image).
- the agent runtime (``agent_runtime.py``) is mounted at :data:`AGENT`, a read-only overlay of
  it and :data:`EMPTY` (a filesystem of its own, so the sandbox's ``/proc/self/mountinfo``
  names no host path for it either), which the driver maps read-only at ``/.ephemeral``.

The mounts exist only in that mount namespace: when the sandbox's last process dies (destroy,
or the reaper killing the leftovers of a crashed host), the kernel frees them, upper layer
included (a disk-backed one's loop device and blocks with it). Nothing is written to the
image, and nothing but that disk file anywhere else on the host.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import NamedTuple

from ephemeral import errors
from ephemeral.sandbox.base import Limits
from ephemeral.settings import Settings

# Empty directories on the host; the mounts on them exist only in each launcher's namespace.
RUN_DIR = Path("/run/ephemeral")
LOWER = RUN_DIR / "lower"  # the image, bound at a path that says nothing about the host
UPPER = RUN_DIR / "upper"  # the sandbox's tmpfs: upper and work directories of the overlay
MOUNT_POINT = RUN_DIR / "rootfs"  # the overlay the runtime makes the sandbox's /
AGENT = RUN_DIR / "agent"  # the agent runtime, read-only, mapped at agent_runtime.MOUNT
EMPTY = RUN_DIR / "empty"  # the agent runtime overlay's second layer (it has no upper one)
UPPER_TAG = "sandbox-upper-"
SOURCE = Path(__file__).with_name("mount_root.c")
log = logging.getLogger(__name__)
_helpers: dict[Path, Path | None] = {}
_helpers_lock = threading.Lock()  # creates call helper() from threads: one build at a time

# An idmapped bind mount (open_tree + mount_setattr(MOUNT_ATTR_IDMAP) + move_mount): this
# host's util-linux (2.38) ignores X-mount.idmap. argv: user namespace file, source, target.
_IDMAP = """
import ctypes, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
def call(*args):
    r = libc.syscall(*args)
    if r < 0:
        e = ctypes.get_errno()
        sys.exit(f"namespaces: idmapped mount of the image failed: {os.strerror(e)}")
    return r
ns = os.open(sys.argv[1], os.O_RDONLY | os.O_CLOEXEC)
tree = call(428, -100, sys.argv[2].encode(), 1 | os.O_CLOEXEC)  # open_tree(CLONE)
attr = struct.pack("QQQQ", 0x00100001, 0, 0, ns)  # MOUNT_ATTR_IDMAP|RDONLY, userns_fd
call(442, tree, b"", 0x1000, attr, len(attr))  # mount_setattr(AT_EMPTY_PATH)
call(429, tree, b"", -100, sys.argv[3].encode(), 4)  # move_mount(F_EMPTY_PATH)
"""


def helper(cache_dir: Path) -> Path | None:
    """The compiled ``mount_root.c`` under ``cache_dir/helpers`` (built once per source hash,
    atomically), or None where it cannot be built: the shell fallback then runs."""
    with _helpers_lock:
        if cache_dir not in _helpers:
            _helpers[cache_dir] = _build_helper(cache_dir)
        return _helpers[cache_dir]


def _build_helper(cache_dir: Path) -> Path | None:
    found: Path | None = None
    source = SOURCE.read_bytes()
    target = cache_dir / "helpers" / f"mount-root-{hashlib.sha256(source).hexdigest()[:16]}"
    if target.is_file() and os.access(target, os.X_OK):
        found = target
    elif shutil.which("gcc") is not None:
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                ["gcc", "-O2", "-Wall", "-o", str(tmp), str(SOURCE)],
                check=True,
                capture_output=True,
                timeout=120,
            )
            os.replace(tmp, target)
            found = target
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning(
                "writable root: cannot build %s (%s); using the shell fallback", SOURCE, exc
            )
            with contextlib.suppress(OSError):
                tmp.unlink()
    return found


# Beyond every tmpfs, the memory limit keeps this much for the guest agent (~20 MiB) and the
# commands that answer after the mounts are full: at least this, and an eighth of the limit.
HEADROOM_MIB = 64
SMALL_MIB = 16  # /run, /var/tmp, the worker's home, /dev/shm (/dev under gVisor), at most


class TmpfsSizes(NamedTuple):
    large: int  # bytes: the upper layer, and /tmp apart from it (0: both on the disk)
    small: int  # bytes: each of the small mounts


def on_disk(limits: Limits, settings: Settings) -> bool:
    """Whether the writable layer is an ext4 file on the host's disk rather than a tmpfs: for
    a disk limit above ``disk_tmpfs_max_mib`` (docs/images.md gives the measurement)."""
    return limits.disk_mib > settings.disk_tmpfs_max_mib


def tmpfs_sizes(limits: Limits, small_mounts: int, disk: bool = False) -> TmpfsSizes:
    """Sizes that fit together inside the memory limit, with headroom (issue 35, finding 9).

    Every tmpfs's pages are charged to the sandbox's memory cgroup and cannot be reclaimed
    (there is no swap): mounts that could hold more than the limit turned a full disk into an
    out-of-memory kill of the guest agent (``sandbox_error``). Sized so, filling every one of
    them ends in ``ENOSPC`` and the sandbox carries on. The upper layer and /tmp get the disk
    limit each, or half of what the memory limit leaves them, whichever is less; with a
    disk-backed layer (``disk``) neither is a tmpfs, and only the small mounts count."""
    room = max(0, limits.memory_mib - max(HEADROOM_MIB, limits.memory_mib // 8))
    small = max(1, min(SMALL_MIB, room // (2 * max(1, small_mounts))))
    if disk:
        return TmpfsSizes(0, small << 20)
    large = max(1, min(limits.disk_mib, (room - small_mounts * small) // 2))
    return TmpfsSizes(large << 20, small << 20)


DISK_FILE = "upper.ext4"  # in the sandbox's run directory
_MKFS_TIMEOUT_S = 120.0


def make_disk(run_dir: Path, disk_mib: int) -> Path:
    """The writable layer's ext4 file of ``disk_mib`` (sparse: the host's disk holds what the
    sandbox wrote) in ``run_dir``, which is made host root's only (0700); neither is opened
    through a link. The file is the launcher's to mount and unlink (:func:`mount_script`)."""
    from ephemeral.sandbox import ext4

    run_dir.mkdir(parents=True, mode=0o700, exist_ok=True)
    if run_dir.is_symlink() or run_dir.lstat().st_uid != os.getuid():
        raise errors.SandboxError(f"{run_dir} is not this host's own directory")
    run_dir.chmod(0o700)
    return ext4.make(run_dir / DISK_FILE, disk_mib, journal=False, timeout=_MKFS_TIMEOUT_S)


HOSTNAME = "sandbox"  # the drivers' UTS hostname
CONTAINER_ETC = {
    "hosts": "".join(
        [
            "127.0.0.1\tlocalhost\n",
            "::1\tlocalhost ip6-localhost ip6-loopback\n",
            f"127.0.1.1\t{HOSTNAME}\n",
        ]
    ),
    "hostname": f"{HOSTNAME}\n",
    # glibc and musl try a nameserver once, for a second at most; nothing listens on port 53
    # of the sandbox's loopback, so a lookup is refused at once rather than waiting
    "resolv.conf": "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n",
}


def container_etc(cache_dir: Path) -> Path:
    """The layer holding :data:`CONTAINER_ETC` under ``etc/`` (root's, 0644), made once per
    content under ``cache_dir/helpers`` (a rename: concurrent makers agree)."""
    blob = repr(sorted(CONTAINER_ETC.items())).encode()
    layer = cache_dir / "helpers" / f"etc-{hashlib.sha256(blob).hexdigest()[:16]}"
    if (layer / "etc" / "hosts").is_file():
        return layer
    tmp = layer.with_name(f"{layer.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "etc").mkdir(parents=True, mode=0o755)
    tmp.chmod(0o755)
    for name, text in CONTAINER_ETC.items():
        (tmp / "etc" / name).write_text(text)
        (tmp / "etc" / name).chmod(0o644)
    try:
        os.rename(tmp, layer)
    except OSError:  # another maker was first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (layer / "etc" / "hosts").is_file():
            raise
    return layer


def with_container_etc(lower: str, cache_dir: Path) -> str:
    """``lower`` (a rootfs, or layers joined by ':' topmost first) under :func:`container_etc`."""
    return f"{container_etc(cache_dir)}:{lower}"


def prepare_dirs() -> None:
    for d in (RUN_DIR, LOWER, UPPER, MOUNT_POINT, AGENT, EMPTY):
        d.mkdir(mode=0o755, exist_ok=True)


def tag(sandbox_id: str) -> str:
    return UPPER_TAG + sandbox_id


# The launcher script's first five arguments, as :func:`args` gives them.
ARGS = "rootfs=$1 size=$2 tag=$3 agent=$4 disk=$5\nshift 5\n"


def args(rootfs: str, size: int, sandbox_id: str, agent: Path, disk: Path | None) -> list[str]:
    """``size``: the upper layer's tmpfs, in bytes (:func:`tmpfs_sizes`); ``agent``: the agent
    runtime's directory; ``disk``: the ext4 file of a disk-backed layer (:func:`make_disk`),
    or None for the tmpfs."""
    return [rootfs, str(size), tag(sandbox_id), str(agent), str(disk) if disk else "-"]


def mount_script(*, helper: Path | None, idmap_userns: str | None, owner: str = "0") -> str:
    """Shell that mounts the overlay and the agent runtime; expects ``$rootfs $size $tag
    $agent $disk`` set. ``idmap_userns``: a path (shell word) of the user namespace the image's
    owners are shifted into, and ``owner`` the host uid that is root there (the upper root
    directory's owner)."""
    if helper is not None:
        return (
            f'{shlex.quote(str(helper))} "$rootfs" {LOWER} {UPPER} {MOUNT_POINT} "$size" "$tag" '
            f'"$disk" {owner} "$agent" {AGENT} {EMPTY} {idmap_userns or ""} || exit 1\n'
        )
    # the runtime's lower layer by an fd, as the helper does: mountinfo shows no host path
    agent = (
        f'(exec 9<"$agent" && mount -t overlay -o ro,nosuid,nodev,'
        f"lowerdir=/proc/self/fd/9:{EMPTY} ephemeral-agent {AGENT}) || exit 1\n"
    )
    if idmap_userns is None:
        bind = 'mount --bind "$src" "$dst" && mount -o remount,bind,ro "$dst" || exit 1\n'
    else:
        bind = (
            f"{shlex.quote(sys.executable)} -I -S -c {shlex.quote(_IDMAP)} {idmap_userns} "
            '"$src" "$dst" || exit 1\n'
        )
    # a pulled image's layers, topmost first, joined by ':' (as mount_root.c takes them)
    return (
        agent + 'case "$rootfs" in\n*:*)\n'
        f"mount -t tmpfs -o size=64k,mode=0755 layers {LOWER} || exit 1\n"
        "i=0; lowers=; IFS=:\n"
        "for src in $rootfs; do\n"
        f'dst={LOWER}/$i; mkdir "$dst" || exit 1\n'
        + bind
        + 'lowers="${lowers:+$lowers:}$dst"; i=$((i + 1))\n'
        "done\nunset IFS\n;;\n"
        f'*) src="$rootfs"; dst={LOWER}; lowers={LOWER}\n'
        + bind
        + ";;\nesac\n"
        + 'if [ "$disk" = - ]; then\n'
        + f'mount -t tmpfs -o "size=$size,mode=0700,nosuid,nodev" "$tag" {UPPER} || exit 1\n'
        # util-linux's loop mount autoclears the device, as mount_root.c's does
        + f'else mount -o loop,nosuid,nodev,noatime,noinit_itable "$disk" {UPPER} && '
        + f'rm -f -- "$disk" && chmod 0700 {UPPER} || exit 1\nfi\n'
        + f"mkdir {UPPER}/root {UPPER}/work || exit 1\n"
        + f"chown {owner}:{owner} {UPPER}/root && chmod 0755 {UPPER}/root || exit 1\n"
        + f'if [ "$disk" != - ]; then mkdir -m 1777 {UPPER}/root/tmp && '
        + f"chown {owner}:{owner} {UPPER}/root/tmp || exit 1; fi\n"
        + 'mount -t overlay sandbox -o "lowerdir=$lowers,'
        + f'upperdir={UPPER}/root,workdir={UPPER}/work" {MOUNT_POINT} || exit 1\n'
    )


def launcher(
    rootfs: str, size: int, sandbox_id: str, helper: Path | None, agent: Path, disk: Path | None
) -> list[str]:
    """argv prefix for a runtime that needs nothing else: a private mount namespace with the
    overlay at :data:`MOUNT_POINT` and the agent runtime at :data:`AGENT`, then the runtime's
    argv (which follows)."""
    prepare_dirs()
    script = ARGS + mount_script(helper=helper, idmap_userns=None) + 'exec "$@"'
    return [
        "unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script, "sh",
        *args(rootfs, size, sandbox_id, agent, disk),
    ]  # fmt: skip
