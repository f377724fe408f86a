"""An advisory lock across processes: ``flock(2)`` on a lock file, held for a ``with`` block.

The image layer store (ephemeral/oci/store.py) and the records' compactors and purge
(ephemeral/records/compaction.py) take theirs here. Closing the fd releases the lock, so a
process that dies holding one holds it no more.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def held(path: Path, *, exclusive: bool = True, wait: bool = True) -> Iterator[bool]:
    """Hold the lock on ``path`` (made, mode 0600, when missing) for the block. Yields True;
    or False, holding nothing, when ``wait`` is False and another process holds it."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        flags = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(fd, flags if wait else flags | fcntl.LOCK_NB)
        except BlockingIOError:
            got = False
        else:
            got = True
        yield got
    finally:
        os.close(fd)
