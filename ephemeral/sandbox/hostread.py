"""Read host files that go into a sandbox from inside the directory that may give them.

A task author writes a task directory (a recipe, an image definition): what an upload reads of it
must be its own files, not whatever a link in it points to on the host (a key, another tenant's
data). So a source is opened by walking from its root one ``openat(O_NOFOLLOW)`` at a time
(:func:`ephemeral.sandbox.hostwrite.walk`), and every member of a directory is opened the same
way: a link anywhere (the source itself, a directory on the way, a member) is an
:class:`~ephemeral.errors.InvalidRequest` naming it, and so is a device, FIFO or socket. What is
read is what was checked: the check and the read use the same file descriptor.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import tarfile
from collections.abc import Callable
from pathlib import Path

from ephemeral import errors
from ephemeral.sandbox.hostwrite import Blocked, walk

MAX_UPLOAD_FILES = 100_000
MAX_UPLOAD_BYTES = 1 << 30
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class Refused(errors.InvalidRequest):
    """``path`` (``rel``: where in the source, when a member) is not read, and ``why``."""

    def __init__(self, path: Path | str, why: str, rel: str = "") -> None:
        super().__init__(f"{path}: {why}; an upload reads no link and nothing outside its root")
        self.why = why
        self.rel = rel


def _parts(root: Path, path: Path) -> tuple[str, ...]:
    root, path = Path(os.path.abspath(root)), Path(os.path.abspath(path))
    if not path.is_relative_to(root):
        raise Refused(path, f"not inside {root}")
    return path.relative_to(root).parts


def _open(root: Path | None, path: Path, *, directory: bool) -> int:
    """``path`` opened without following a link below ``root`` (the caller's own path to
    ``root`` is followed; with no ``root``, only the last component is not)."""
    parts: tuple[str, ...]
    if root is None:
        root, parts = path.parent, (path.name,)
    else:
        parts = _parts(root, path)
    base = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if directory:
            return walk(base, parts, create=False)
        parent = walk(base, parts[:-1], create=False)
    except Blocked as exc:
        raise Refused(
            root / exc.component, "a symbolic link or not a directory", exc.component
        ) from None
    finally:
        os.close(base)
    try:
        return _open_regular(parent, parts[-1] if parts else ".", path, "/".join(parts))
    finally:
        os.close(parent)


def _open_regular(dir_fd: int, name: str, shown: Path | str, rel: str) -> int:
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the name is a link
            raise Refused(shown, "a symbolic link", rel) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise Refused(shown, kind, rel)
    os.set_blocking(fd, True)
    return fd


def _read_all(fd: int, limit: int, shown: Path | str, rel: str) -> bytes:
    with os.fdopen(os.dup(fd), "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise Refused(shown, f"over {limit} bytes", rel)
    return data


def read_file(path: Path, *, root: Path | None, max_bytes: int = MAX_UPLOAD_BYTES) -> bytes:
    """The bytes of the regular file ``path`` (inside ``root`` when given), read without
    following a link."""
    fd = _open(root, Path(path), directory=False)
    try:
        return _read_all(fd, max_bytes, path, "")
    finally:
        os.close(fd)


def files(
    path: Path,
    *,
    root: Path | None,
    skip: Callable[[str], bool] = lambda rel: False,
    max_files: int = MAX_UPLOAD_FILES,
    max_bytes: int = MAX_UPLOAD_BYTES,
) -> list[tuple[str, bytes, int]]:
    """Every directory (``rel/``, no bytes) and regular file under the directory ``path`` as
    ``(relative path, bytes, mode)``, parents first, names sorted; ``skip(rel)`` leaves an
    entry out unread. Past ``max_files`` entries or ``max_bytes`` bytes: :class:`Refused`."""
    out: list[tuple[str, bytes, int]] = []
    total = 0

    def visit(fd: int, rel: str) -> None:
        nonlocal total
        with os.scandir(fd) as it:
            names = sorted(e.name for e in it)
        for name in names:
            sub = f"{rel}{name}"
            if skip(sub):
                continue
            if len(out) >= max_files:
                raise Refused(path, f"more than {max_files} files and directories")
            shown = Path(path) / sub
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise Refused(shown, "a symbolic link", sub)
            if stat.S_ISDIR(st.st_mode):
                try:
                    child = walk(fd, (name,), create=False)
                except Blocked:
                    raise Refused(shown, "replaced by a link while read", sub) from None
                try:
                    out.append((sub + "/", b"", stat.S_IMODE(st.st_mode)))
                    visit(child, sub + "/")
                finally:
                    os.close(child)
                continue
            if not stat.S_ISREG(st.st_mode):
                raise Refused(shown, "a device, FIFO or socket (only regular files)", sub)
            ffd = _open_regular(fd, name, shown, sub)
            try:
                data = _read_all(ffd, max_bytes - total, shown, sub)
                mode = stat.S_IMODE(os.fstat(ffd).st_mode)
            finally:
                os.close(ffd)
            total += len(data)
            out.append((sub, data, mode))

    fd = _open(root, Path(path), directory=True)
    try:
        visit(fd, "")
    finally:
        os.close(fd)
    return out


def pack(path: Path, *, root: Path | None) -> bytes:
    """The contents of the directory ``path`` (see :func:`files`) as a gzipped tar, modes kept
    without set-id bits, owned by root."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for rel, data, mode in files(path, root=root):
            info = tarfile.TarInfo(rel.rstrip("/"))
            info.mode = mode & 0o777
            if rel.endswith("/"):
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
