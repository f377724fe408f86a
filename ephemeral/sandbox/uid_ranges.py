"""Host uid ranges: 65,536 host ids that one user namespace maps, held by a lock.

The ``namespaces`` driver gives each sandbox a range and so does the image build sandbox
(:mod:`ephemeral.sandbox.build_sandbox`): two holders never share host uids, and none of those
uids is host root or a real host user. Here, so the builder need not import a driver.
"""

from __future__ import annotations

import fcntl
import os
import secrets
from pathlib import Path

from ephemeral import errors

# The lock files' directory keeps its old name: processes of an older version on this host lock
# the same files, so the two never hand out one range twice.
LOCKS_DIR = Path("/run/ephemeral/uid-slots")
# Host ids of range N: RANGE_BASE + N * RANGE_SIZE .. + RANGE_SIZE - 1 (above every real user)
RANGE_BASE = 1 << 30
RANGE_SIZE = 1 << 16
RANGES = 4096


def allocate_uid_range() -> tuple[int, int]:
    """A free uid range's first host id and the fd whose lock holds it (released on close)."""
    LOCKS_DIR.mkdir(parents=True, mode=0o700, exist_ok=True)
    for _ in range(64):
        n = secrets.randbelow(RANGES)
        fd = os.open(LOCKS_DIR / f"{n}.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return RANGE_BASE + n * RANGE_SIZE, fd
    raise errors.SandboxError("namespaces: no free uid range (too many sandboxes at once)")
