"""The build context: the files ``.dockerignore`` lets in (scanned and hashed on the host,
without following links), and the sources a ``COPY``/``ADD`` names in it."""

from __future__ import annotations

import hashlib
import lzma
import os
import shutil
import stat
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from ephemeral.sandbox.dockerfile.parser import IgnoreRule, _pattern_regex, fail, ignored
from ephemeral.sandbox.dockerfile.plan import CopyStep, Plan

# what a context may hold (it is hashed and copied on the host): bounded like every input
MAX_CONTEXT_FILES = 100_000


MAX_CONTEXT_BYTES = 4 << 30


@dataclass
class Context:
    """The files of a build context that ``.dockerignore`` lets in: relative path -> kind
    (``f`` file, ``d`` directory, ``l`` symlink), read without following any link."""

    root: Path
    entries: dict[str, str] = field(default_factory=dict)
    digest: str = ""


def scan_context(root: Path, rules: list[IgnoreRule], path: str) -> Context:
    h = hashlib.sha256()
    ctx = Context(root=root)
    count = size = 0
    has_exceptions = any(r.exclusion for r in rules)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/")
        keep_dirs = []
        for name in dirnames:
            rel = f"{rel_dir}/{name}" if rel_dir else name
            full = os.path.join(dirpath, name)
            if os.path.islink(full):
                filenames.append(name)  # a link to a directory is a link: never walked
                continue
            if ignored(rules, rel):
                if has_exceptions:
                    keep_dirs.append(name)  # an exception may let something below back in
                continue
            ctx.entries[rel] = "d"
            keep_dirs.append(name)
        dirnames[:] = keep_dirs
        for name in sorted(filenames):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if ignored(rules, rel):
                continue
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            count += 1
            if count > MAX_CONTEXT_FILES:
                raise fail(path, None, None, f"the context has more than {MAX_CONTEXT_FILES} files")
            if stat.S_ISLNK(st.st_mode):
                ctx.entries[rel] = "l"
                data = b"symlink " + os.readlink(full).encode()
            elif stat.S_ISREG(st.st_mode):
                size += st.st_size
                if size > MAX_CONTEXT_BYTES:
                    raise fail(
                        path, None, None, f"the context holds more than {MAX_CONTEXT_BYTES} bytes"
                    )
                ctx.entries[rel] = "f"
                data = b""
            else:
                continue  # sockets, fifos, devices: nothing Docker's context sends either
            # a directory that an exception re-includes a file of is in the context too
            parent = rel.rpartition("/")[0]
            while parent and parent not in ctx.entries:
                ctx.entries[parent] = "d"
                parent = parent.rpartition("/")[0]
            enc = rel.encode()
            h.update(len(enc).to_bytes(4, "big") + enc)
            if ctx.entries[rel] == "f":
                fh = hashlib.sha256()
                with open(full, "rb", buffering=0) as f:
                    while chunk := f.read(1 << 20):
                        fh.update(chunk)
                data = fh.digest() + (b"x" if st.st_mode & 0o111 else b"-")
                data += oct(stat.S_IMODE(st.st_mode)).encode()
            h.update(len(data).to_bytes(8, "big") + data)
    for rel, kind in sorted(ctx.entries.items()):
        if kind == "d":
            enc = rel.encode()
            h.update(b"dir" + len(enc).to_bytes(4, "big") + enc)
    ctx.digest = h.hexdigest()
    return ctx


def _match_sources(ctx: Context, pattern: str) -> list[str]:
    """Context paths a COPY source names: itself, or the matches of a glob (Go's
    ``filepath.Match``, one path part per pattern part)."""
    if pattern == ".":
        return ["."]
    if not any(c in pattern for c in "*?["):
        return [pattern]
    parts = pattern.split("/")
    regexes = [_pattern_regex(p) for p in parts]
    return sorted(
        rel
        for rel in ctx.entries
        if len(rel.split("/")) == len(parts)
        and all(r.match(seg) for r, seg in zip(regexes, rel.split("/"), strict=True))
    )


def _inside(ctx: Context, rel: str, plan: Plan, step: CopyStep) -> tuple[Path, str]:
    """The host path of context path ``rel`` and its kind, following a link of the source
    itself only when it stays in the context (and is not excluded)."""
    root = ctx.root
    if rel == ".":
        return root, "d"
    p = root / rel
    kind = ctx.entries.get(rel)
    if kind is None:
        raise fail(
            plan.path,
            step.line,
            step.keyword,
            f"{rel!r}: not found in the build context (or excluded by .dockerignore)",
        )
    if kind == "l":
        target = p.resolve()
        if not target.is_relative_to(root.resolve()):
            raise fail(
                plan.path, step.line, step.keyword, f"{rel!r} is a symlink out of the context"
            )
        trel = target.relative_to(root.resolve()).as_posix() or "."
        if trel != "." and trel not in ctx.entries:
            raise fail(
                plan.path,
                step.line,
                step.keyword,
                f"{rel!r} links to {trel!r}, which is not in the context (or excluded)",
            )
        kind = "d" if target.is_dir() else "f"
        if ctx.entries.get(trel) == "l":
            raise fail(
                plan.path, step.line, step.keyword, f"{rel!r}: a chain of links is not honoured"
            )
        return target, kind
    return p, kind


def _stage_tree(ctx: Context, rel: str, host: Path, into: Path) -> None:
    """Copy the included entries below context directory ``rel`` into ``into`` (never
    following a link: a link is copied as a link)."""
    prefix = "" if rel == "." else rel + "/"
    # a directory reached through a link: its entries are the target's
    real_rel = host.relative_to(ctx.root.resolve()).as_posix() if host != ctx.root else "."
    real_prefix = "" if real_rel == "." else real_rel + "/"
    del prefix
    for entry, kind in sorted(ctx.entries.items()):
        if not entry.startswith(real_prefix) or entry == real_rel:
            continue
        sub = entry[len(real_prefix) :]
        src = ctx.root / entry
        dst = into / sub
        if kind == "d":
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copystat(src, dst, follow_symlinks=False)
        elif kind == "l":
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(src), dst)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            _copy_file(src, dst)


def _copy_file(src: Path, dst: Path) -> None:
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as fin:
        st = os.fstat(fin.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{src} is not a regular file")
        with open(dst, "xb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def resolve_copy(
    ctx: Context, plan: Plan, step: CopyStep
) -> tuple[list[tuple[str, Path, str]], bool]:
    """The sources of a COPY/ADD (context path, host path, kind) and whether the destination
    is a directory, checked against Docker's rules before anything is built."""
    found: list[str] = []
    for s in step.sources:
        matches = _match_sources(ctx, s)
        if not matches:
            raise fail(plan.path, step.line, step.keyword, f"{s!r}: no source files were found")
        found += matches
    resolved = [(rel, *_inside(ctx, rel, plan, step)) for rel in found]
    as_dir = step.as_dir or any(kind == "d" for _, _, kind in resolved)
    if len(resolved) > 1 and not step.as_dir:
        raise fail(
            plan.path,
            step.line,
            step.keyword,
            "with more than one source file the destination must be a directory and end with '/'",
        )
    if step.keyword == "ADD":
        for rel, host, kind in resolved:
            if kind == "f" and _is_archive(host) and (step.chown or step.chmod):
                raise fail(
                    plan.path,
                    step.line,
                    "ADD",
                    f"{rel!r} is an archive: --chown and --chmod of what ADD unpacks are not "
                    "honoured",
                )
    return resolved, as_dir


_TAR_FLAGS = {b"\x1f\x8b": "-z", b"BZh": "-j", b"\xfd7zXZ\x00": "-J"}


def _archive_flag(path: Path) -> str | None:
    """tar's decompression flag for a local archive ADD unpacks (Docker's formats: tar,
    gzip, bzip2 and xz tars), ``""`` for a plain tar, None for anything else."""
    with open(path, "rb") as f:
        head = f.read(512)
    for magic, flag in _TAR_FLAGS.items():
        if head.startswith(magic):
            return flag
    return "" if head[257:262] == b"ustar" else None


def _is_archive(path: Path) -> bool:
    return _archive_flag(path) is not None


def archive_bounds(path: Path, max_bytes: int, max_files: int) -> None:
    """Read the members of a local archive ``ADD`` would unpack (headers only: nothing is
    written) and raise ValueError when they hold more than ``max_bytes`` (the sum of their
    sizes, sparse files at their full size) or more than ``max_files`` members: a small
    compressed archive can unpack to any size. Reading stops at the first bound passed."""
    total = count = 0
    try:
        with tarfile.open(path, "r|*") as tar:
            for member in tar:
                count += 1
                total += max(member.size, 0)
                if count > max_files:
                    raise ValueError(
                        f"the archive holds more than {max_files} members (build_add_max_files)"
                    )
                if total > max_bytes:
                    raise ValueError(
                        f"the archive unpacks to more than {max_bytes >> 20} MiB "
                        "(build_add_max_mib)"
                    )
    except (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError) as exc:
        raise ValueError(f"cannot read the archive: {exc}") from None
