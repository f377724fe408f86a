"""A sparse ext4 file made on the host: the disk of an image build (``build_area.py``) and of a
disk-backed writable root (``writable_root.make_disk``).

The file is created new (``O_EXCL``, never through a link) and host root's only (0600); its
size is a bound (a write past it is ``ENOSPC``, its inode count bounds the files), while the
host's disk holds only the blocks written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

from ephemeral import errors


def make(path: Path, mib: int, *, journal: bool = True, timeout: float = 300.0) -> Path:
    """Create ``path`` as an ext4 filesystem of ``mib`` MiB (no reserved blocks; inode tables
    zeroed lazily, the file being sparse). ``journal=False`` for a filesystem nothing reads
    after a crash (a sandbox's layer): no journal writes, faster to make."""
    if shutil.which("mkfs.ext4") is None:
        raise errors.SandboxError("a disk-backed filesystem needs mkfs.ext4 (e2fsprogs)")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, mib << 20)
    finally:
        os.close(fd)
    argv = ["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=1,nodiscard"]
    if not journal:
        argv += ["-O", "^has_journal"]
    try:
        subprocess.run([*argv, str(path)], check=True, capture_output=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        with contextlib.suppress(OSError):
            path.unlink()
        detail = getattr(exc, "stderr", b"") or b""
        raise errors.SandboxError(
            f"cannot make an ext4 filesystem of {mib} MiB: {exc} {detail.decode(errors='replace')}"
        ) from exc
    return path
