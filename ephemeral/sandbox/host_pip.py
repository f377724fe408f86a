"""The host's pip, fetching wheels for an image build: every input passed as data, nothing of a
task author's run, as a host uid that owns nothing, in an empty directory.

pip reads more than names on its command line and in requirements files: a word with a path
separator, a leading ``.`` or ``~``, a URL or VCS scheme (``file:``, ``git+``...), a
``name @ URL``, or a bare name with an archive extension (``evil.tgz``: pip's
``is_archive_file``) is a local file or a link, and pip runs its build backend to read its
metadata, ``--only-binary`` or not. So what reaches the host's pip is checked first
(:func:`requirement_problem`: a PEP 508 *name* requirement and nothing else), follows ``--``
(never an option), and pip runs (:func:`run`):

- in a fresh, empty scratch directory (its working directory and ``HOME``), made in the
  build's size-limited area (:mod:`ephemeral.sandbox.build_area`) and seen by pip at an empty
  mount point of its own: a bare name can find no file of the caller's, and what pip
  downloads counts against the build's disk;
- with Debian's interpreter and pip (``/usr/bin/python3``, package ``python3-pip``), not the
  caller's: a uid that owns nothing must be able to run it, and an interpreter under a private
  home (pyenv's in ``/root``, mode 0700, as Harbor's Python 3.12 venv has it) cannot be loaded
  by one;
- as the first host uid of a uid range of its own (:mod:`ephemeral.sandbox.uid_ranges`, held for
  the call): a uid above every real user that owns nothing on the host but the scratch
  directory, with no supplementary groups and no new privileges;
- with an environment of ``PATH``, ``HOME``, ``LANG`` and the host's ``PIP_*``, proxy and CA
  variables only (the mirrors pip is configured for; no secret of the caller's environment);
- wheels only (``--only-binary=:all:``) into the scratch directory, from where the builder
  takes the regular ``*.whl`` files and nothing else.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from ephemeral import errors
from ephemeral.sandbox.build_sandbox import MOUNT_DIR, _mounts_prefix, run_bounded
from ephemeral.sandbox.uid_ranges import allocate_uid_range

# Debian's (python3-pip, installed by `make apt-runtime`): any uid can run it, whatever venv
# (and whose interpreter) the caller runs in.
HOST_PYTHON = "/usr/bin/python3"

# pip's ARCHIVE_EXTENSIONS (pip/_internal/utils/filetypes.py): a name ending so is a file to pip
ARCHIVE_EXTENSIONS = (
    ".zip",
    ".whl",
    ".tar.bz2",
    ".tbz",
    ".tar.xz",
    ".txz",
    ".tlz",
    ".tar.lz",
    ".tar.lzma",
    ".tar.gz",
    ".tgz",
    ".tar",
)
_ENV_KEPT = re.compile(
    r"PIP_[A-Z0-9_]+|(HTTPS?|ALL|NO)_PROXY|(https?|all|no)_proxy|SSL_CERT_(FILE|DIR)"
    r"|REQUESTS_CA_BUNDLE"
)


def requirement_problem(word: str) -> str | None:
    """Why pip would read ``word`` as something other than a requirement of a package by name
    (an option, a local path or archive, a URL or a direct reference), or None."""
    if not word or word.startswith("-"):
        return "pip would read it as an option"
    if "://" in word or ":" in word.split(";", 1)[0] or "@" in word:
        return "URLs and direct references are not honoured (only requirements by name)"
    if "/" in word or "\\" in word or word.startswith((".", "~")):
        return "pip would read it as a local path (only requirements by name are fetched)"
    try:
        req = Requirement(word)
    except InvalidRequirement:
        return "not a requirement specifier such as 'name==1.2'"
    if req.url is not None:
        return "URLs and direct references are not honoured (only requirements by name)"
    head = word.split(";", 1)[0].split("[", 1)[0].strip().lower()
    if head.endswith(ARCHIVE_EXTENSIONS) or req.name.lower().endswith(ARCHIVE_EXTENSIONS):
        return (
            "pip would read a name ending in an archive extension as a local file "
            "(name a package; a file of the image is named ./FILE)"
        )
    return None


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if _ENV_KEPT.fullmatch(k)}
    env.update(PATH="/usr/local/bin:/usr/bin:/bin", HOME=str(home), LANG="C.UTF-8")
    env["PIP_NO_INPUT"] = "1"
    return env


async def run(
    args: Sequence[str],
    requirements: Sequence[str],
    what: str,
    into: Path,
    *,
    timeout: float,
    files: Sequence[Path] = (),
    prefix: Sequence[str] = (),
    within: Path | None = None,
) -> None:
    """Run ``python -m pip ARGS --dest|--target DIR -- REQUIREMENTS`` (``args`` names the
    subcommand and its options; ``{out}`` in it is replaced by pip's output directory) and
    move the wheels or tree it made into ``into``. ``files`` (wheels the definition ships)
    are copied into the scratch directory first, as ``{file0}``, ``{file1}``... ``prefix``
    goes before everything (the build's cgroup). The scratch directory is made in ``within``
    (the build's size-limited area; default the host's temporary directory) and bound, in a
    private mount namespace, on an empty mount point the uid can reach: the directories
    above it are host root's only."""
    for r in requirements:
        if not any(r == f"{{file{i}}}" for i in range(len(files))) and (
            why := requirement_problem(r)
        ):
            raise errors.InvalidRequest.field("requirement", f"{r!r}: {why}")
    uid, range_fd = allocate_uid_range()
    scratch = Path(tempfile.mkdtemp(prefix="ephemeral-pip-", dir=within))
    points = MOUNT_DIR / str(uid)
    at = points / "pip"
    try:
        subs = await asyncio.to_thread(_prepare, scratch, uid, files, at)
        shutil.rmtree(points, ignore_errors=True)
        at.mkdir(parents=True, mode=0o755)
        argv = [
            *prefix,
            *_mounts_prefix([(scratch, at)]),
            *("/bin/sh", "-c", 'cd "$0" && exec "$@"', str(at / "cwd")),  # as root, then
            "setpriv",
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--no-new-privs",
            "--",
            HOST_PYTHON,
            "-m",
            "pip",
            *(subs.get(a, a) for a in args),
            "--no-cache-dir",
            "--",
            *(subs.get(r, r) for r in requirements),
        ]
        await run_bounded(argv, what, timeout=timeout, env=_env(at / "home"))
        await asyncio.to_thread(_take, scratch / "out", into)
    finally:
        os.close(range_fd)
        shutil.rmtree(points, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)


def _prepare(scratch: Path, uid: int, files: Sequence[Path], at: Path) -> dict[str, str]:
    """The scratch directory, owned by ``uid``: ``home``, ``cwd`` (empty: pip's working
    directory), ``out`` (what pip makes) and a copy of each shipped wheel; the placeholders,
    as pip sees them (the scratch directory bound at ``at``)."""
    subs = {"{out}": str(at / "out")}
    for i, f in enumerate(files):
        shipped = scratch / f"shipped-{i}" / f.name
        shipped.parent.mkdir()
        shutil.copyfile(f, shipped, follow_symlinks=False)
        subs[f"{{file{i}}}"] = str(at / shipped.relative_to(scratch))
    for d in ("home", "out", "cwd"):
        (scratch / d).mkdir()
    for p in [scratch, *scratch.rglob("*")]:
        os.lchown(p, uid, uid)
    return subs


def _take(out: Path, into: Path) -> None:
    """Move what pip made into ``into``, owned by root: regular files and directories only
    (pip made them, but it ran as another uid: nothing it left is trusted to be anything)."""
    into.mkdir(parents=True, exist_ok=True)
    for dirpath, dirnames, filenames in os.walk(out):
        rel = Path(dirpath).relative_to(out)
        for name in dirnames:
            if os.path.islink(os.path.join(dirpath, name)):
                continue  # a link is never followed nor kept
            (into / rel / name).mkdir(exist_ok=True)
        for name in filenames:
            src = os.path.join(dirpath, name)
            st = os.lstat(src)
            if not stat.S_ISREG(st.st_mode):
                continue
            dst = into / rel / name
            shutil.copyfile(src, dst, follow_symlinks=False)
            os.chmod(dst, 0o755 if st.st_mode & 0o111 else 0o644)
