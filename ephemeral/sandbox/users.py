"""Which uid and gid an exec ``user`` becomes: the guest agent's own rules, on the host.

The agent (``sandbox_images/default/guest/agent.py``, ``lookup_user``) resolves a name through
the image's ``/etc/passwd`` and a string of ASCII digits as a number ("00" and "0000" are uid
0); a number with no entry is itself. The host applies the same rules to the image's file
(a sandbox's root may add users to its own copy at run time: a name the image lacks is left
to the agent, which reads the sandbox's; only root can change it, and root is refused where
it would be host root) so that it compares users as ids, never as strings: where root would
be host root, every spelling of uid 0 is refused before the agent is asked (which, under
``--no-root``, refuses it too). ``tests/sandbox/test_users.py`` runs
both implementations on the same inputs.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import NamedTuple

MAX_UID = (1 << 32) - 2  # (uid_t)-1 means "unchanged" to setuid: never a user
PASSWD_CAP = 1 << 20  # what the agent reads of /etc/passwd


class Ids(NamedTuple):
    uid: int
    gid: int


def _is_number(text: str) -> bool:
    return text.isascii() and text.isdigit()


def resolve(user: str, passwd: str) -> Ids | None:
    """The ids ``user`` becomes given the image's passwd text; None: no such user (the agent
    answers exit 126). A number past :data:`MAX_UID` raises ValueError."""
    number = int(user) if _is_number(user) else None
    if number is not None and number > MAX_UID:
        raise ValueError(f"uid {user} is out of range (at most {MAX_UID})")
    for line in passwd.splitlines():
        parts = line.split(":")
        if len(parts) < 7 or not _is_number(parts[2]) or not _is_number(parts[3]):
            continue
        uid, gid = int(parts[2]), int(parts[3])
        if uid > MAX_UID or gid > MAX_UID:
            continue
        if parts[0] == user or (number is not None and uid == number):
            return Ids(uid, gid)
    return Ids(number, number) if number is not None else None


def read_passwd(rootfs: Path) -> str | None:
    """The image's ``/etc/passwd`` as the agent reads it (first MiB), or None when it is not a
    regular file reached without a symlink: an image is untrusted input, and the host must not
    follow its links into host paths."""
    return read_etc(rootfs, "passwd")


def read_etc(rootfs: Path, name: str) -> str | None:
    """The image's ``/etc/NAME`` (first MiB), or None when it is not a regular file reached
    without a symlink (the image is untrusted: its links must not lead the host anywhere)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        root = os.open(rootfs, flags | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        etc = os.open("etc", flags | os.O_DIRECTORY, dir_fd=root)
        try:
            fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=etc)
        finally:
            os.close(etc)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            with os.fdopen(fd, "rb", closefd=False) as fh:
                return fh.read(PASSWD_CAP).decode("utf-8", "replace")
        finally:
            os.close(fd)
    except OSError:
        return None
    finally:
        os.close(root)
