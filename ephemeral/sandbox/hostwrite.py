"""Write an untrusted tree (a sandbox's files, an image layer) under a host directory.

Everything that comes out of a sandbox is hostile, and so is the archive format it comes in:
``tarfile``'s extraction filters were bypassed more than once (CVE-2025-4517: links past
PATH_MAX that ``realpath`` stops resolving), and its header parser has had quadratic and endless
loops on crafted headers (CVE-2024-6232, CVE-2025-8194) on the Pythons this project runs. So
nothing here extracts with ``tarfile`` nor parses with it. The host writes every entry itself:

- a path is split into components, each checked (no ``..``, no absolute path, no NUL or other
  control character, at most ``NAME_MAX`` bytes, at most ``max_depth`` deep), and walked from
  the root's file descriptor one ``openat(O_DIRECTORY|O_NOFOLLOW)`` at a time: no link, old or
  new, is ever followed, so nothing can be written outside the root;
- a file is written to a fresh name (``O_CREAT|O_EXCL|O_NOFOLLOW``) and renamed over its place,
  so an existing file (or a hard link to one elsewhere) is replaced, never written through;
- modes keep the permission bits only (no set-uid, set-gid or sticky bit, no group or other
  write); the owner is the host process; times are not kept;
- links follow a :data:`LinkPolicy`: ``skip`` (downloads: a link is not written, and is
  reported), ``refuse`` (the whole write fails naming it) or ``store`` (image layers: written as
  a link, still never followed). Devices and FIFOs are never made (skipped and reported, or
  refused under ``refuse``);
- entries, bytes per file, bytes in all and the archive's own size are bounded (:class:`Limits`).

A duplicate name replaces the earlier file; a file where a directory is (or the reverse) fails.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO, Literal

from ephemeral import errors

LinkPolicy = Literal["skip", "refuse", "store"]
NAME_MAX = 255
PATH_MAX = 4096
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_TMP_PREFIX = ".hostwrite-"


@dataclass(frozen=True)
class Limits:
    """Bounds of one write. The defaults fit a trial's logs and artifacts with room to spare."""

    max_entries: int = 100_000
    max_file_bytes: int = 1 << 30
    max_total_bytes: int = 2 << 30
    max_depth: int = 64
    # what may be read of an archive (headers and padding included) once decompressed
    max_archive_bytes: int = (2 << 30) + (256 << 20)


@dataclass
class Report:
    """What was written and what was not (``skipped``: path and why)."""

    files: int = 0
    dirs: int = 0
    links: int = 0
    size: int = 0  # bytes written
    skipped: list[tuple[str, str]] = field(default_factory=list)


def refused(path: str, why: str) -> errors.SandboxError:
    return errors.SandboxError(f"untrusted tree: {path!r}: {why}")


def split(path: str, limits: Limits = Limits()) -> tuple[str, ...]:
    """The checked components of a relative ``path`` (``./`` and ``.`` parts dropped)."""
    if len(path.encode("utf-8", "surrogateescape")) > PATH_MAX:
        raise refused(path[:200], f"a path over {PATH_MAX} bytes")
    if path.startswith("/"):
        raise refused(path, "an absolute path")
    parts = tuple(p for p in path.split("/") if p not in ("", "."))
    for part in parts:
        if part == "..":
            raise refused(path, "a '..' component")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in part):
            raise refused(path, "a NUL, newline or other control character in the name")
        if len(part.encode("utf-8", "surrogateescape")) > NAME_MAX:
            raise refused(path, f"a name over {NAME_MAX} bytes")
        if part.startswith(_TMP_PREFIX):
            raise refused(path, f"names starting {_TMP_PREFIX!r} are the writer's own")
    if len(parts) > limits.max_depth:
        raise refused(path, f"more than {limits.max_depth} levels deep")
    return parts


class Blocked(Exception):
    """A component on the way is a link or not a directory (``component``: the path so far)."""

    def __init__(self, component: str) -> None:
        super().__init__(f"{component} is a link or not a directory")
        self.component = component


def walk(root_fd: int, parts: tuple[str, ...], *, create: bool) -> int:
    """A new fd of the directory ``parts`` under ``root_fd``, never following a link (made,
    mode 0755, when missing and ``create``; else FileNotFoundError). :class:`Blocked` when a
    component is a link or a file. The caller closes the fd."""
    fd = os.dup(root_fd)
    try:
        for i, part in enumerate(parts):
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):  # made meanwhile: opened below
                    os.mkdir(part, 0o755, dir_fd=fd)
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Blocked("/".join(parts[: i + 1])) from None
                raise
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _walk(root_fd: int, parts: tuple[str, ...], path: str) -> int:
    try:
        return walk(root_fd, parts, create=True)
    except Blocked as exc:
        raise refused(path, str(exc)) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # made as a link meanwhile: the root's owner raced us
            raise refused(path, "a link on the way") from None
        raise


def _file_mode(mode: int) -> int:
    return (mode & 0o755) | 0o600


def _dir_mode(mode: int) -> int:
    return (mode & 0o755) | 0o700


class TreeWriter:
    """Writes entries under ``root_fd`` (a directory the caller opened; not closed here)."""

    def __init__(
        self, root_fd: int, *, links: LinkPolicy = "skip", limits: Limits = Limits()
    ) -> None:
        self.root_fd = root_fd
        self.links = links
        self.limits = limits
        self.report = Report()
        self._entries = 0
        # the owner (uid, gid) the archive gives the entry being written, set by write_tar
        # before each call: this writer ignores it (files belong to the host process); a
        # subclass may apply it (image layers: ephemeral/oci/unpack.py)
        self.owner: tuple[int, int] = (0, 0)

    @property
    def entries(self) -> int:
        """How many entries were counted against ``limits.max_entries`` so far."""
        return self._entries

    def _count(self, path: str) -> None:
        self._entries += 1
        if self._entries > self.limits.max_entries:
            raise refused(path, f"more than {self.limits.max_entries} entries")

    def _parent(self, path: str) -> tuple[int, str]:
        """A new fd of the directory that holds ``path`` (made as needed, never through a link;
        the caller closes it) and the entry's name in it. For subclasses too (oci/unpack.py)."""
        parts = split(path, self.limits)
        if not parts:
            raise refused(path, "names the root itself")
        return _walk(self.root_fd, parts[:-1], path), parts[-1]

    def directory(self, path: str, mode: int = 0o755) -> None:
        self._count(path)
        parts = split(path, self.limits)
        if not parts:
            return  # the root: its mode is the caller's
        fd = _walk(self.root_fd, parts, path)
        try:
            os.fchmod(fd, _dir_mode(mode))
        finally:
            os.close(fd)
        self.report.dirs += 1

    def file(self, path: str, chunks: Iterable[bytes], mode: int = 0o644) -> None:
        """Write ``chunks`` as the regular file ``path`` (replacing a file of that name)."""
        self._count(path)
        parent, name = self._parent(path)
        tmp = f"{_TMP_PREFIX}{secrets.token_hex(8)}"
        try:
            fd = os.open(tmp, _NEW_FILE, 0o600, dir_fd=parent)
            try:
                size = 0
                for chunk in chunks:
                    size += len(chunk)
                    if size > self.limits.max_file_bytes:
                        raise refused(path, f"a file over {self.limits.max_file_bytes} bytes")
                    if self.report.size + size > self.limits.max_total_bytes:
                        raise refused(path, f"more than {self.limits.max_total_bytes} bytes in all")
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view) :]
                os.fchmod(fd, _file_mode(mode))
            finally:
                os.close(fd)
            try:
                os.rename(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
            except OSError as exc:
                if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                    raise refused(path, "a file where a directory is") from None
                raise
            tmp = ""
            self.report.files += 1
            self.report.size += size
        finally:
            if tmp:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=parent)
            os.close(parent)

    def _stored(self, path: str, what: str) -> bool:
        """Whether the link ``path`` is written (``store``); else skipped or refused."""
        self._count(path)
        split(path, self.limits)
        if self.links == "store":
            return True
        if self.links == "refuse":
            raise refused(path, what)
        self.report.skipped.append((path, f"{what} is not written"))
        return False

    def symlink(self, path: str, target: str) -> None:
        if not self._stored(path, f"a symbolic link (to {target[:200]!r})"):
            return
        size = len(target.encode(errors="surrogateescape"))
        if not target or "\x00" in target or size > PATH_MAX:
            raise refused(path, "a link target that is empty, has a NUL or is too long")
        parent, name = self._parent(path)
        try:
            self._clear(parent, name, path)
            os.symlink(target, name, dir_fd=parent)
            self.report.links += 1
        finally:
            os.close(parent)

    def hardlink(self, path: str, target: str) -> None:
        """A hard link to ``target``, an earlier regular file of this tree (``store`` only)."""
        if not self._stored(path, f"a hard link (to {target[:200]!r})"):
            return
        tparts = split(target, self.limits)
        try:
            tparent = walk(self.root_fd, tparts[:-1], create=False) if tparts else -1
            if tparent < 0:
                raise FileNotFoundError
        except (FileNotFoundError, Blocked):
            raise refused(path, f"a hard link to {target!r}, which is not in the tree") from None
        try:
            st = os.stat(tparts[-1], dir_fd=tparent, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise refused(path, f"a hard link to {target!r}, not a regular file of the tree")
            parent, name = self._parent(path)
            try:
                self._clear(parent, name, path)
                os.link(
                    tparts[-1], name, src_dir_fd=tparent, dst_dir_fd=parent, follow_symlinks=False
                )
                self.report.links += 1
            finally:
                os.close(parent)
        except FileNotFoundError:
            raise refused(path, f"a hard link to {target!r}, which is not in the tree") from None
        finally:
            os.close(tparent)

    def special(self, path: str, kind: str) -> None:
        """A device or FIFO: never made."""
        self._count(path)
        split(path, self.limits)
        if self.links == "refuse":
            raise refused(path, f"a {kind}")
        self.report.skipped.append((path, f"a {kind} is not written"))

    @staticmethod
    def _clear(parent: int, name: str, path: str) -> None:
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            raise refused(path, "a link where a directory is")
        os.unlink(name, dir_fd=parent)


# ---- tar, read by hand --------------------------------------------------------------------

BLOCK = 512
_MAX_META = 1 << 20  # a GNU long name or a pax header, in bytes
_FILE_TYPES = {b"0", b"\0", b"7"}
_SPECIALS = {b"3": "character device", b"4": "block device", b"6": "FIFO"}


class _Blocks:
    """The archive's bytes, gunzipped when they start with gzip's magic, counted."""

    def __init__(self, stream: BinaryIO, limit: int) -> None:
        self.stream = stream
        self.limit = limit
        self.seen = 0
        self.buf = bytearray()
        self.inflate: zlib._Decompress | None = None
        head = stream.read(2)
        if head == b"\x1f\x8b":
            self.inflate = zlib.decompressobj(wbits=31)
            self._feed(head)
        else:
            self.buf += head

    def _feed(self, raw: bytes) -> None:
        try:
            self._inflate(raw)
        except zlib.error as exc:
            raise refused("<archive>", f"bad gzip data: {exc}") from None

    def _inflate(self, raw: bytes) -> None:
        assert self.inflate is not None
        while raw:
            self.buf += self.inflate.decompress(raw, 1 << 20)
            raw = self.inflate.unconsumed_tail
            if self.inflate.eof and self.inflate.unused_data:  # concatenated gzip members
                raw = self.inflate.unused_data
                self.inflate = zlib.decompressobj(wbits=31)
            if len(self.buf) > 4 << 20:
                break  # the rest waits in unconsumed_tail, taken by the next read

    def read(self, n: int) -> bytes:
        while len(self.buf) < n:
            if self.inflate is not None and self.inflate.unconsumed_tail:
                self._feed(self.inflate.unconsumed_tail)
                continue
            raw = self.stream.read(1 << 16)
            if not raw:
                break
            if self.inflate is None:
                self.buf += raw
            else:
                self._feed(raw)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        self.seen += len(out)
        if self.seen > self.limit:
            raise refused("<archive>", f"over {self.limit} bytes once decompressed")
        return out

    def exactly(self, n: int, what: str) -> bytes:
        data = self.read(n)
        if len(data) != n:
            raise refused(what, "the archive ends inside an entry")
        return data


def _number(field: bytes, what: str) -> int:
    if field[:1] == b"\x80":  # GNU base-256, positive
        return int.from_bytes(field[1:], "big")
    if field[:1] and field[0] & 0x80:
        raise refused(what, "a negative number in a header")
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    if not all(48 <= c <= 55 for c in text):
        raise refused(what, "a header number that is not octal")
    return int(text, 8)


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax(data: bytes, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos, pos + 21)
        digits = data[pos:space] if space > 0 else b""
        if not digits.isdigit():
            if not data[pos:].strip(b"\0"):
                break  # padding
            raise refused(what, "a malformed pax record")
        end = pos + int(digits)
        record = data[space + 1 : end]
        if end > len(data) or end <= space + 1 or not record.endswith(b"\n") or b"=" not in record:
            raise refused(what, "a malformed pax record")
        key, _, value = record[:-1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos = end
    return out


def _data(blocks: _Blocks, size: int, what: str) -> Iterator[bytes]:
    left = size
    while left:
        chunk = blocks.exactly(min(left, 1 << 20), what)
        left -= len(chunk)
        yield chunk
    blocks.exactly(-size % BLOCK, what)


def _id(pax: str | None, field: bytes, what: str) -> int:
    """A uid or gid: the pax record's, else the header's (bounded to a 32-bit id)."""
    if pax is not None and not pax.isdigit():
        raise refused(what, "a pax uid or gid that is not a number")
    value = int(pax) if pax is not None else _number(field, what)
    if value > 0xFFFFFFFE:
        raise refused(what, "a uid or gid out of range")
    return value


def write_tar(stream: BinaryIO, writer: TreeWriter) -> Report:
    """Write the tar (optionally gzipped) archive ``stream`` through ``writer``.

    Read: ustar, GNU (long names and links, base-256 sizes) and pax (``path``, ``linkpath``,
    ``size``, ``uid``, ``gid``); anything else (sparse files, multi-volume, global pax names) is
    refused."""
    blocks = _Blocks(stream, writer.limits.max_archive_bytes)
    pending: dict[str, str] = {}
    headers = 0
    while True:
        header = blocks.read(BLOCK)
        if not header or header == bytes(BLOCK):
            return writer.report  # the end (zero blocks; GNU tar always writes them)
        if len(header) < BLOCK:
            raise refused("<archive>", "the archive ends inside a header")
        headers += 1
        if headers > 4 * writer.limits.max_entries:
            raise refused("<archive>", f"more than {4 * writer.limits.max_entries} headers")
        stored = _number(header[148:156], "<header>")
        if stored not in (sum(header[:148]) + 256 + sum(header[156:]),):
            raise refused("<archive>", f"a header with a bad checksum (entry {headers})")
        kind = header[156:157]
        name = _text(header[0:100])
        if header[257:263] == b"ustar\0" and header[345:346] != b"\0":
            name = _text(header[345:500]) + "/" + name
        name = pending.pop("path", name)
        link = pending.pop("linkpath", _text(header[157:257]))
        size = _number(header[124:136], name)
        if "size" in pending:
            raw_size = pending.pop("size")
            if not raw_size.isdigit():
                raise refused(name, "a pax size that is not a number")
            size = int(raw_size)
        if kind in (b"L", b"K", b"x", b"g"):
            if size > _MAX_META:
                raise refused(name, f"a long name or pax header over {_MAX_META} bytes")
            meta = b"".join(_data(blocks, size, name))
            if kind == b"L":
                pending["path"] = _text(meta)
            elif kind == b"K":
                pending["linkpath"] = _text(meta)
            else:
                fields = _pax(meta, name)
                if any(k.startswith("GNU.sparse") for k in fields):
                    raise refused(name, "a sparse file")
                if kind == b"g":
                    if {"path", "linkpath", "size"} & set(fields):
                        raise refused(name, "a global pax header naming paths or sizes")
                    continue
                keep = ("path", "linkpath", "size", "uid", "gid")
                pending.update({k: fields[k] for k in keep if k in fields})
            continue
        if size > writer.limits.max_file_bytes:
            raise refused(name, f"a file over {writer.limits.max_file_bytes} bytes")
        mode = _number(header[100:108], name)
        writer.owner = (_id(pending.pop("uid", None), header[108:116], name),
                        _id(pending.pop("gid", None), header[116:124], name))  # fmt: skip
        if kind in _FILE_TYPES:
            writer.file(name, _data(blocks, size, name), mode)
            continue
        for _ in _data(blocks, size, name):  # a non-file's data (a hostile header) is skipped
            pass
        if kind == b"5":
            writer.directory(name, mode)
        elif kind == b"2":
            writer.symlink(name, link)
        elif kind == b"1":
            writer.hardlink(name, link)
        elif kind in _SPECIALS:
            writer.special(name, _SPECIALS[kind])
        else:
            raise refused(name, f"an entry of type {kind!r} (sparse, volume or unknown)")
