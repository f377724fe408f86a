"""Host uid slots: a range of 65,536 host ids that one user namespace maps, held by a lock.

The ``namespaces`` driver gives each sandbox a slot and so does the image build sandbox
(:mod:`ephemeral.sandbox.build_sandbox`): two holders never share host uids, and none of those
uids is host root or a real host user. Here, so the builder need not import a driver.
"""

from __future__ import annotations

import fcntl
import os
import secrets
from pathlib import Path

from ephemeral import errors

SLOTS_DIR = Path("/run/ephemeral/uid-slots")
# Host ids of slot N: SLOT_BASE + N * SLOT_SIZE .. + SLOT_SIZE - 1 (above every real user)
SLOT_BASE = 1 << 30
SLOT_SIZE = 1 << 16
SLOTS = 4096


def allocate_slot() -> tuple[int, int]:
    """A free uid slot's first host id and the fd whose lock holds it (released on close)."""
    SLOTS_DIR.mkdir(parents=True, mode=0o700, exist_ok=True)
    for _ in range(64):
        slot = secrets.randbelow(SLOTS)
        fd = os.open(SLOTS_DIR / f"{slot}.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return SLOT_BASE + slot * SLOT_SIZE, fd
    raise errors.SandboxError("namespaces: no free uid slot (too many sandboxes at once)")
