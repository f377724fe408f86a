"""What every store in the image cache shares with ``images gc`` (``sandbox/image_gc.py``): an
entry's shape, how a use is recorded, and where an image definition's current build is named.

A leaf: the stores (built images, pulled layers) record uses and describe their entries here,
and the collector reads them, so neither imports the other's module.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

USED = ".used"  # its mtime is the entry's last use
CURRENT = "current"  # <image cache>/current/NAME holds the directory name of NAME's current build


@dataclass
class Entry:
    kind: str  # "image" or "base" (or what a new collector names)
    path: Path
    size_bytes: int
    last_used: float
    extra: list[Path] = field(default_factory=list)  # removed with it (a microVM disk, a name)
    in_use: bool = False
    kept: bool = False  # a definition's current build, or its layer: `images rm NAME` only


def mark_used(path: Path) -> None:
    """Record a use of the entry at ``path`` now (best effort: a read-only cache still works)."""
    with contextlib.suppress(OSError):
        (path / USED).touch()


def last_used(path: Path, fallback: Path) -> float:
    for p in (path / USED, fallback):
        with contextlib.suppress(OSError):
            return os.stat(p).st_mtime
    return 0.0


def du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
    return total
