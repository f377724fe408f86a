"""Hostile tar archives, as a sandbox's root could make its ``tar`` print them, and the check
that a host directory tree did not change (used by tests/sandbox/test_hostwrite.py and, from
Harbor's Python, tests/harbor/hostile_probe.py)."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path

KINDS = {
    "file": tarfile.REGTYPE,
    "dir": tarfile.DIRTYPE,
    "symlink": tarfile.SYMTYPE,
    "hardlink": tarfile.LNKTYPE,
    "chr": tarfile.CHRTYPE,
    "blk": tarfile.BLKTYPE,
    "fifo": tarfile.FIFOTYPE,
}


@dataclass(frozen=True)
class Member:
    name: str
    kind: str = "file"
    link: str = ""
    data: bytes = b""
    mode: int = 0o644


def archive(members: list[Member], *, fmt: int = tarfile.GNU_FORMAT, gz: bool = True) -> bytes:
    """The members as a tar (``tarfile`` only writes it here: the writer under test reads it)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w", format=fmt) as tar:
        for m in members:
            info = tarfile.TarInfo(m.name)
            info.type = KINDS[m.kind]
            info.linkname = m.link
            info.mode = m.mode
            if m.kind == "file":
                info.size = len(m.data)
                tar.addfile(info, io.BytesIO(m.data))
            else:
                tar.addfile(info)
    return buf.getvalue()


def cve_2025_4517(dest: str) -> list[Member]:
    """CPython's own reproduction of CVE-2025-4517 (``test_realpath_limit_attack``): a chain of
    directories and links whose expansion passes PATH_MAX, so ``realpath`` stops resolving and
    tarfile's data filter lets ``escape`` point at ``dest``'s parent; then ``flag`` there is
    overwritten through a hard link and ``newfile`` made beside it."""
    steps = "abcdefghijklmnop"
    comp = "d" * ((os.pathconf("/", "PC_PATH_MAX") - len(dest) - 1) // (len(steps) + 1))
    out: list[Member] = []
    path = ""
    for step in steps:
        out.append(Member(os.path.join(path, comp), "dir", mode=0o777))
        out.append(Member(os.path.join(path, step), "symlink", link=comp))
        path = os.path.join(path, comp)
    linkpath = os.path.join(*steps, "l" * 254)
    out.append(Member(linkpath, "symlink", link=os.path.join(*[".."] * len(steps))))
    out.append(Member("escape", "symlink", link=os.path.join(linkpath, "..")))
    out.append(Member("flaglink", "hardlink", link=os.path.join("escape", "flag")))
    out.append(Member("flaglink", data=b"overwritten", mode=0o4755))
    out.append(Member("escape/newfile", data=b"new", mode=0o755))
    return out


def raw(name: bytes, *, kind: bytes = b"0", size_field: bytes = b"", data: bytes = b"") -> bytes:
    """One hand-made header (and data): what ``tarfile`` will not write (a negative or huge
    base-256 size, a NUL inside a name)."""
    header = bytearray(512)
    header[0 : len(name[:100])] = name[:100]
    header[100:108] = b"0000644\0"
    header[108:116] = header[116:124] = b"0000000\0"
    header[124:136] = size_field or f"{len(data):011o}\0".encode()
    header[136:148] = b"00000000000\0"
    header[156:157] = kind
    header[257:265] = b"ustar  \0"
    header[148:156] = b"        "
    header[148:156] = f"{sum(header):06o}\0 ".encode()
    body = data + bytes(-len(data) % 512)
    return bytes(header) + body + bytes(1024)


def snapshot(root: Path, skip: Path | None = None) -> dict[str, tuple[object, ...]]:
    """Every entry under ``root`` (but ``skip``'s subtree): its type, mode, size, owner and
    content (a file's sha256, a link's target). Links are not followed."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if skip is not None and here == skip:
            dirnames[:] = []
            continue
        for name in dirnames + filenames:
            p = here / name
            if skip is not None and p == skip:
                continue
            st = p.lstat()
            if stat.S_ISREG(st.st_mode):
                content: object = hashlib.sha256(p.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                content = os.readlink(p)
            else:
                content = None
            out[str(p.relative_to(root))] = (
                st.st_mode,
                st.st_size,
                st.st_uid,
                st.st_nlink,
                content,
            )
    return out


def bad_entries(target: Path, *, links_ok: bool = False) -> list[str]:
    """What in ``target`` is not a regular file or directory (links too unless ``links_ok``),
    or carries a set-id, sticky or group/other write bit."""
    bad = []
    for dirpath, dirnames, filenames in os.walk(target):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            try:
                mode = p.lstat().st_mode
            except OSError as exc:  # past PATH_MAX: what the CVE-2025-4517 chain makes
                bad.append(f"{p.relative_to(target)}: {exc.strerror}")
                continue
            kind_ok = stat.S_ISREG(mode) or stat.S_ISDIR(mode) or (links_ok and stat.S_ISLNK(mode))
            if not kind_ok or (not stat.S_ISLNK(mode) and stat.S_IMODE(mode) & 0o7022):
                bad.append(f"{p.relative_to(target)} {stat.filemode(mode)}")
    return bad
