"""Unpack one image layer (untrusted input) into its own directory, in overlayfs form.

The layer's bytes are decompressed here (gzip or zstd, sniffed from the content, whatever the
media type claims), hashed on the way (the ``diff_id`` the config names, checked at the end)
and bounded (decompressed bytes and entries, per image). The tar itself is read and written by
``ephemeral/sandbox/hostwrite.py``, the project's one writer of untrusted trees: every path is
walked from the layer directory's fd one ``O_NOFOLLOW`` component at a time, ``..`` and
absolute paths are refused, symbolic links are stored as links and never followed, hard links
only reach earlier files of the same layer, devices and FIFOs are not made, set-id and sticky
bits and group/other write are dropped; files get the owners the layer names (uid and gid,
as Docker keeps them: the sandbox's idmapped view then shows them as the image's users).

What is OCI-specific happens here: a whiteout ``.wh.NAME`` becomes overlayfs's whiteout (a
character device 0:0 named ``NAME``) and an opaque marker ``.wh..wh..opq`` the
``trusted.overlay.opaque`` attribute of its directory, so that a sandbox's root is the kernel's
overlay of the layers, read-only, under its own writable layer. A whiteout of a name this same
layer holds is ignored (the OCI spec: a whiteout hides lower layers only).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import stat
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zstandard

from ephemeral.oci import manifest as m
from ephemeral.sandbox import hostwrite

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
OPAQUE_XATTR = "trusted.overlay.opaque"
_GZIP = b"\x1f\x8b"
_ZSTD = b"\x28\xb5\x2f\xfd"
CHUNK = 1 << 20


@dataclass
class Budget:
    """What the rest of an image may still unpack (shared by its layers)."""

    bytes: int
    entries: int


class _Decompressed:
    """A file-like view of a layer blob, decompressed and hashed as it is read, bounded."""

    def __init__(self, raw: io.BufferedReader, limit: int) -> None:
        head = raw.peek(4)[:4]
        self.limit = limit
        self.seen = 0
        self.hash = hashlib.sha256()
        self._src: Any
        if head[:2] == _GZIP:
            self._src = gzip.GzipFile(fileobj=raw, mode="rb")  # members concatenated too
        elif head == _ZSTD:
            self._src = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        else:
            self._src = raw

    def read(self, n: int = -1) -> bytes:
        n = CHUNK if n is None or n < 0 else min(n, CHUNK)
        try:
            out = self._src.read(n)
        except (zstandard.ZstdError, OSError, EOFError, zlib.error) as exc:
            raise m.bad(f"the layer does not decompress: {exc}") from exc
        self.seen += len(out)
        if self.seen > self.limit:
            raise m.bad(
                f"the layer decompresses past the image's limit of {self.limit} bytes "
                "(image_max_unpacked_mib)"
            )
        self.hash.update(out)
        return out

    def drain(self) -> None:
        """Read to the end: the diff id covers the tar's padding after its end blocks."""
        while self.read(CHUNK):
            pass


class LayerWriter(hostwrite.TreeWriter):
    """``TreeWriter`` with OCI whiteouts turned into overlayfs's form."""

    def _marker(self, path: str) -> tuple[str, ...] | None:
        parts = hostwrite.split(path, self.limits)
        return parts if parts and parts[-1].startswith(WHITEOUT) else None

    def _whiteout(self, path: str, parts: tuple[str, ...]) -> None:
        self._count(path)
        parent, name = self._parent(path)
        try:
            if name == OPAQUE:
                fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent)
                try:
                    os.setxattr(fd, OPAQUE_XATTR, b"y")
                finally:
                    os.close(fd)
                return
            hidden = name[len(WHITEOUT) :]
            if hidden.startswith(WHITEOUT):
                return  # other .wh..wh. markers (aufs' own) mean nothing to overlayfs
            if hidden in ("", ".", ".."):
                raise hostwrite.refused(path, "a whiteout of '.' or '..'")
            hostwrite.split(hidden, self.limits)
            with contextlib.suppress(FileExistsError):  # this layer's own entry wins
                os.mknod(hidden, stat.S_IFCHR | 0o000, os.makedev(0, 0), dir_fd=parent)
        finally:
            os.close(parent)

    def _own(self, path: str) -> None:
        """Give the entry just written the owner the layer names (root's need nothing: the
        host process is root), walking to it without following a link, never through one."""
        if self.owner == (0, 0):
            return
        if not hostwrite.split(path, self.limits):
            return  # the root: its owner is the caller's
        parent, name = self._parent(path)
        try:
            os.chown(name, *self.owner, dir_fd=parent, follow_symlinks=False)
        finally:
            os.close(parent)

    def file(self, path: str, chunks: Iterable[bytes], mode: int = 0o644) -> None:
        parts = self._marker(path)
        if parts is not None:
            for _ in chunks:  # a whiteout's content means nothing
                pass
            return self._whiteout(path, parts)
        super().file(path, chunks, mode)
        self._own(path)

    def directory(self, path: str, mode: int = 0o755) -> None:
        parts = self._marker(path)
        if parts is not None:
            raise hostwrite.refused(path, "a directory named as a whiteout")
        super().directory(path, mode)
        self._own(path)

    def symlink(self, path: str, target: str) -> None:
        if self._marker(path) is not None:
            raise hostwrite.refused(path, "a link named as a whiteout")
        super().symlink(path, target)
        self._own(path)

    def hardlink(self, path: str, target: str) -> None:
        if self._marker(path) is not None:
            raise hostwrite.refused(path, "a link named as a whiteout")
        super().hardlink(path, target)


@dataclass(frozen=True)
class Unpacked:
    diff_id: str
    bytes: int  # decompressed tar bytes
    entries: int
    skipped: int  # devices and FIFOs not made


def unpack_layer(blob: Path, dest: Path, budget: Budget) -> Unpacked:
    """Unpack the verified blob ``blob`` into the new directory ``dest`` (made here, 0755),
    within ``budget`` (decreased by what this layer used). ``dest`` is left for the caller to
    remove on failure."""
    dest.mkdir(mode=0o755)
    limits = hostwrite.Limits(
        max_entries=budget.entries,
        max_file_bytes=budget.bytes,
        max_total_bytes=budget.bytes,
        max_depth=128,
        max_archive_bytes=budget.bytes,
    )
    root = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with blob.open("rb") as raw:
            stream = _Decompressed(raw, budget.bytes)
            writer = LayerWriter(root, links="store", limits=limits)
            report = hostwrite.write_tar(stream, writer)  # type: ignore[arg-type]
            stream.drain()
    finally:
        os.close(root)
    budget.bytes -= stream.seen
    budget.entries -= writer.entries
    return Unpacked(
        diff_id="sha256:" + stream.hash.hexdigest(),
        bytes=stream.seen,
        entries=writer.entries,
        skipped=len(report.skipped),
    )
