"""A build's working space: a size-limited filesystem, removed whatever happens to the build.

Every image build (an ``image.yaml`` image, a Dockerfile image with its stages, an mmdebstrap
layer) writes only into the area of its result ``X``: the directory ``X.partial`` next to it,
holding a sparse ext4 file of ``build_disk_mib`` mounted (``nosuid,nodev``) at
``X.partial/fs``. A build that writes past it gets ``ENOSPC`` (the ext4's inode count bounds
its files too); the host's disk holds at most that file. What the build made is copied out to
``X.partial/out`` and renamed to ``X`` (:meth:`BuildArea.commit`), then the area goes.

While a build uses its area it holds an exclusive lock on ``X.partial/.lock``: an area whose
lock nobody holds is what a dead build left (a crash, a kill), and :func:`sweep` (run before
every build and by ``ephemeral images gc``) unmounts and removes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import time
from pathlib import Path

from ephemeral import errors
from ephemeral.sandbox import ext4
from ephemeral.sandbox.build_sandbox import run_bounded, sweep_cgroups

SUFFIX = ".partial"
LOCK = ".lock"
# an area with no lock file yet is being made (mkdir then lock): stale only when this old
_GRACE_S = 60.0
_TOOL_TIMEOUT_S = 300.0


class BuildArea:
    """``async with BuildArea(out, disk_mib) as area:`` build in ``area.fs``, then
    ``await area.commit(area.fs / "image")``; on any exit the area is unmounted and removed."""

    def __init__(self, out: Path, disk_mib: int) -> None:
        self.out = out
        self.disk_mib = disk_mib
        self.path = out.with_name(out.name + SUFFIX)
        self.fs = self.path / "fs"
        self._lock: int | None = None
        self._mounted = False

    async def __aenter__(self) -> BuildArea:
        for tool in ("mkfs.ext4", "mount", "umount"):
            if shutil.which(tool) is None:
                raise errors.SandboxError(f"image build needs {tool} (its disk is an ext4 file)")
        await asyncio.to_thread(_remove, self.path)
        self.path.mkdir(parents=True, mode=0o700)
        # host root's only: a set-id file of the build is no host user's to reach
        self.path.chmod(0o700)
        try:
            self._lock = _hold(self.path)
            image = await asyncio.to_thread(
                ext4.make, self.path / "fs.img", self.disk_mib, timeout=_TOOL_TIMEOUT_S
            )
            self.fs.mkdir(mode=0o700)
            await run_bounded(
                ["mount", "-o", "loop,nosuid,nodev", str(image), str(self.fs)],
                "mount the build's filesystem",
                timeout=_TOOL_TIMEOUT_S,
            )
            self._mounted = True
            self.fs.chmod(0o700)
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def commit(self, src: Path) -> None:
        """Copy ``src`` (in the area) to the result's place, owners, modes, set-id bits and
        file capabilities kept; the result appears whole (a rename) or not at all."""
        staged = self.path / "out"
        await run_bounded(
            ["cp", "-a", "--", f"{src}/.", str(staged)], "copy the build out", timeout=None
        )
        await asyncio.to_thread(_remove, self.out)
        os.rename(staged, self.out)

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self._mounted:
                await asyncio.to_thread(_unmount, self.fs)
                self._mounted = False
            await asyncio.to_thread(_remove, self.path)
        finally:
            if self._lock is not None:
                os.close(self._lock)
                self._lock = None


def _hold(path: Path) -> int:
    fd = os.open(path / LOCK, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _mounts_below(path: Path) -> list[Path]:
    """Mount points at or below ``path`` in this mount namespace, deepest first."""
    found: list[Path] = []
    prefix = str(path).rstrip("/") + "/"
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == str(path) or point.startswith(prefix):
                found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _unmount(path: Path) -> None:
    """Unmount ``path`` and whatever is mounted below it; a busy one lazily (the loop device
    is freed with its last user)."""
    import subprocess

    for point in _mounts_below(path):
        done = subprocess.run(["umount", str(point)], capture_output=True, check=False)
        if done.returncode != 0:
            subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False)


def _remove(path: Path) -> None:
    if not path.exists() and not path.is_symlink():
        return
    _unmount(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def stale(path: Path) -> bool:
    """Whether area ``path`` was left by a build that is gone (nobody holds its lock)."""
    try:
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        try:
            return time.time() - os.lstat(path).st_mtime > _GRACE_S
        except OSError:
            return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def sweep(root: Path) -> list[Path]:
    """Remove the areas under ``root`` (the image cache, one level of subdirectories) that
    dead builds left, mounts included, and the cgroups of dead builders (killing what is
    left in them); returns the areas that went."""
    removed: list[Path] = []
    sweep_cgroups()
    if not root.is_dir():
        return removed
    for parent in [root, *(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())]:
        for area in parent.glob(f"*{SUFFIX}"):
            if area.is_dir() and not area.is_symlink() and stale(area):
                _remove(area)
                removed.append(area)
    return removed
