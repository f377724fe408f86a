"""Guest images: build, cache, list and remove.

An image is declared by a directory ``sandbox_images/<name>/`` (``image.yaml`` + the guest
agent + optional extra build steps). Its identity is the sha256 of every file in that directory
and, for an image with ``base: OTHER``, of OTHER's identity, so the cache key changes exactly
when the definition (or a base's) does. Layout under the image cache::

    base/<layer-hash>/rootfs       mmdebstrap output (packages + user), the slow part (~2 min)
    <name>-<hash>/rootfs           layer copy + guest agent + pip, files, build steps
    <name>-<hash>/image.json       written last: its presence means the image is complete
    <name>-<hash>/<step>/          output of the extra build step ``<defdir>/<step>/build-step``

The mmdebstrap layer is keyed only by what mmdebstrap sees (the root's release and user, the
packages of every image in the chain), so editing the agent, pip, files or build steps
rebuilds in seconds. A derived image gets its own layer with its chain's packages, then the
chain's definitions are applied root first: the base's pip, files and build steps, then its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from ephemeral import errors, progress
from ephemeral.sandbox import build_area, host_pip, image_gc
from ephemeral.sandbox.build_area import BuildArea
from ephemeral.sandbox.build_sandbox import (
    IN_DIR,
    MOUNT_DIR,
    OUT_DIR,
    RANGE,
    BuildCgroup,
    BuildLimits,
    BuildSandbox,
    NetHook,
    _mounts_prefix,
    _userns_prefix,
    explain,
    run_bounded,
    shift_owners,
)
from ephemeral.sandbox.cache_use import CURRENT, mark_used
from ephemeral.sandbox.host_pip import requirement_problem
from ephemeral.sandbox.image_bases import base_name as _base_name
from ephemeral.sandbox.image_bases import microvm_definition_dir as microvm_definition_dir
from ephemeral.sandbox.microvm_image import build_with_image
from ephemeral.sandbox.uid_ranges import allocate_uid_range
from ephemeral.settings import Settings

log = logging.getLogger(__name__)
_BUILD_STEP = "build-step"
_MARKER = "image.json"


def _image_path(v: str) -> str:
    """A path in the image: absolute, with no empty, ``.`` or ``..`` part (which the host
    would resolve against its own tree)."""
    if any(part in ("", ".", "..") for part in v[1:].rstrip("/").split("/")):
        raise ValueError("must be a plain absolute path (no '.', '..' or '//' parts)")
    return v


ImagePath = Annotated[str, AfterValidator(_image_path)]


class UserSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    uid: int = Field(ge=1, le=65534)
    gid: int = Field(ge=1, le=65534)


class AgentSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str = Field(min_length=1)  # relative to the definition directory
    path: ImagePath = Field(pattern=r"^/[A-Za-z0-9._/-]+$")


class PreloadSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str = Field(min_length=1)  # relative to the definition directory
    path: ImagePath = Field(pattern=r"^/[A-Za-z0-9._/-]+\.so$")


class FileCopy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str = Field(min_length=1)  # relative to the definition directory; a file or a tree
    path: ImagePath = Field(pattern=r"^/[A-Za-z0-9._/+@-]+$")
    mode: str | None = Field(default=None, pattern=r"^0?[0-7]{3,4}$")


_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
_INHERITED = ("suite", "variant", "exclude_paths", "user", "agent", "preload")


class ImageDefinition(BaseModel):
    """``image.yaml``. A root image gives suite, variant, packages, user and agent; an image
    with ``base:`` inherits those and adds its own packages, pip requirements, files, env,
    workdir and build steps (applied after the base's own)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,40}$")
    base: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9-]{0,40}$")
    suite: str | None = Field(default=None, pattern=r"^[a-z]+$")
    variant: str | None = Field(
        default=None, pattern=r"^(extract|custom|essential|apt|required|minbase|buildd)$"
    )
    packages: list[Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9+.:=~-]{0,99}$")]] = []
    exclude_paths: list[str] = []
    user: UserSpec | None = None
    agent: AgentSpec | None = None
    preload: list[PreloadSpec] = []
    # requirement specifiers (PEP 508, no URL) or ./wheels shipped in the definition: the
    # host's pip fetches wheels only (no code runs) into a staging directory, copied in
    pip: list[Annotated[str, Field(min_length=1, max_length=500)]] = []
    files: list[FileCopy] = []
    env: dict[Annotated[str, Field(pattern=_ENV_NAME)], Annotated[str, Field(max_length=4096)]] = {}
    # where commands run: a path relative to the run's scratch directory, made at start
    workdir: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._+@-][A-Za-z0-9._/+@-]{0,199}$")
    # shell steps run at build time in the build sandbox (build_sandbox.py), with no network
    build: list[Annotated[str, Field(min_length=1, max_length=16_384)]] = []

    @field_validator("workdir")
    @classmethod
    def _plain(cls, v: str | None) -> str | None:
        if v is not None and any(p in ("", ".", "..") for p in v.rstrip("/").split("/")):
            raise ValueError("must be a plain path inside the scratch directory")
        return v

    def layering_problems(self) -> list[tuple[tuple[str | int, ...], str]]:
        """A root image declares its release, user and agent; a derived one inherits them."""
        if self.base is None:
            missing = [f for f in ("suite", "variant", "user", "agent") if getattr(self, f) is None]
            out: list[tuple[tuple[str | int, ...], str]] = [
                ((f,), "required in an image without base:") for f in missing
            ]
            if not self.packages:
                out.append((("packages",), "required in an image without base:"))
            return out
        out = [
            ((f,), f"inherited from base {self.base!r}; give it there")
            for f in _INHERITED
            if f in self.model_fields_set
        ]
        if self.base == self.name:
            out.append((("base",), "an image cannot be its own base"))
        return out


class ImageInfo(BaseModel):
    name: str
    hash: str
    path: Path
    rootfs: Path
    built_at: float
    size_bytes: int
    current: bool


def definition_dir(settings: Settings, name: str) -> Path:
    d = settings.images_dir / name
    if not (d / "image.yaml").is_file():
        raise errors.InvalidRequest.field("image", f"no image definition {d / 'image.yaml'}")
    return d


def load_definition(defdir: Path) -> ImageDefinition:
    """Parse and check ``image.yaml``; errors name the file, the line and the field."""
    from ephemeral.yamlfile import load_yaml_model

    def on_disk(d: ImageDefinition) -> list[tuple[tuple[str | int, ...], str]]:
        problems = d.layering_problems()
        if d.name != defdir.name:
            problems.append((("name",), f"must be the directory's name {defdir.name!r}"))
        if d.base is not None and not (defdir.parent / d.base / "image.yaml").is_file():
            problems.append((("base",), f"no image definition {defdir.parent / d.base}"))
        sources: list[tuple[tuple[str | int, ...], str]] = [
            (("files", i, "source"), f.source) for i, f in enumerate(d.files)
        ]
        if d.agent is not None:
            sources.append((("agent", "source"), d.agent.source))
        sources += [(("preload", i, "source"), p.source) for i, p in enumerate(d.preload)]
        for where, source in sources:
            if (why := source_problem(defdir, source)) is not None:
                problems.append((where, why))
        for i, req in enumerate(d.pip):
            if (why := pip_problem(defdir, req)) is not None:
                problems.append((("pip", i), why))
        return problems

    return load_yaml_model(
        defdir / "image.yaml", ImageDefinition, extra=on_disk, error=errors.InvalidRequest
    )


def source_problem(defdir: Path, source: str) -> str | None:
    """Why ``source`` is not a file or tree inside ``defdir`` (symlinks resolved), or None."""
    parts = source.split("/")
    if source.startswith("/") or ".." in parts:
        return "must be a path relative to the definition directory, without '..'"
    root = defdir.resolve()
    src = (defdir / source).resolve()
    if not src.is_relative_to(root):
        return f"resolves outside the definition directory {root} (a symlink out?)"
    if not src.exists():
        return f"no such file {defdir / source}"
    if src.is_dir():
        for p in src.rglob("*"):
            if p.is_symlink() and not p.resolve().is_relative_to(root):
                return f"{p} is a symlink out of the definition directory"
    return None


def pip_problem(defdir: Path, item: str) -> str | None:
    """Why ``item`` is not a requirement of a package by name (PEP 508, no URL, nothing pip
    reads as a path or archive: :func:`~ephemeral.sandbox.host_pip.requirement_problem`) nor a
    wheel shipped with the definition (``./path.whl``), or None: pip options never get through."""
    if item.startswith("./"):
        if not item.endswith(".whl"):
            return "a local item must be a wheel (./path.whl) inside the definition"
        return source_problem(defdir, item[2:])
    if (why := requirement_problem(item)) is not None:
        return f"must be a requirement specifier such as 'name==1.2': {why}"
    return None


def chain(defdir: Path) -> list[tuple[Path, ImageDefinition]]:
    """The definition and its bases, root first (``base:`` names a sibling directory)."""
    out: list[tuple[Path, ImageDefinition]] = []
    seen: set[str] = set()
    d: Path | None = defdir
    while d is not None:
        if d.name in seen:
            raise errors.InvalidRequest.field(
                "base", f"{defdir / 'image.yaml'}: base images form a cycle through {d.name!r}"
            )
        seen.add(d.name)
        definition = load_definition(d)
        out.append((d, definition))
        d = d.parent / definition.base if definition.base else None
    return out[::-1]


def _definition_files(defdir: Path) -> Iterator[Path]:
    """What a build is made of: not ``microvm/``, the boot definition, which no rootfs holds
    (the microVM's initramfs is keyed by its files: a change there rebuilds no image)."""
    for p in sorted(defdir.rglob("*")):
        if "__pycache__" in p.parts or p.name.endswith(".pyc"):
            continue
        if p.relative_to(defdir).parts[0] == "microvm":
            continue
        if p.is_symlink() or p.is_file():
            yield p


# Bumped when the builder's output changes for the same definition (it is part of the hash).
BUILDER_VERSION = 4


def definition_hash(defdir: Path, _seen: frozenset[str] = frozenset()) -> str:
    """sha256 of every file of the definition and, for a derived image, of its base's hash."""
    if defdir.name in _seen:
        raise errors.InvalidRequest.field(
            "base", f"{defdir / 'image.yaml'}: base images form a cycle through {defdir.name!r}"
        )
    h = hashlib.sha256(f"builder-{BUILDER_VERSION}\n".encode())
    base = _base_name(defdir)
    if base is not None:
        parent = definition_hash(defdir.parent / base, _seen | {defdir.name})
        h.update(f"base {parent}\n".encode())
    for p in _definition_files(defdir):
        rel = p.relative_to(defdir).as_posix().encode()
        h.update(len(rel).to_bytes(4, "big") + rel)
        # a symlink is hashed as its target's name: it is never followed out of the definition
        data = b"symlink " + os.readlink(p).encode() if p.is_symlink() else p.read_bytes()
        h.update(len(data).to_bytes(8, "big") + data)
        h.update(b"x" if os.access(p, os.X_OK) else b"-")
    return h.hexdigest()


def _layer_spec(defs: list[ImageDefinition], extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """What mmdebstrap sees for a chain: the root's release and user, every layer's packages
    (and ``extra``: a Dockerfile's ``apt-get install`` packages, dockerfile/installs.py)."""
    root = defs[0]
    packages = list(dict.fromkeys([*(p for d in defs for p in d.packages), *extra]))
    spec = root.model_dump(include={"suite", "variant", "packages", "exclude_paths", "user"})
    spec["packages"] = packages
    return spec


def _base_hash(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def image_dir(settings: Settings, name: str = "default") -> Path:
    """The cache directory of the current build of ``name``: of its definition's hash, or, for
    an image built from a Dockerfile (no definition directory), the one its name points at."""
    if not (settings.images_dir / name / "image.yaml").is_file():
        found = dockerfile_image_dir(settings, name)
        if found is not None:
            return found
    defdir = definition_dir(settings, name)
    return settings.image_cache_dir / f"{name}-{definition_hash(defdir)[:16]}"


def _names_dir(settings: Settings) -> Path:
    return settings.image_cache_dir / "dockerfile"


def dockerfile_image_dir(settings: Settings, name: str) -> Path | None:
    """The build a Dockerfile image's name points at (written by dockerfile/builder.py), or None."""
    if not _NAME.fullmatch(name):
        return None
    try:
        target = json.loads((_names_dir(settings) / f"{name}.json").read_text())["dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(target, str) or not _NAME_DIR.fullmatch(target):
        return None
    return settings.image_cache_dir / target


def point_name(settings: Settings, name: str, out: Path) -> None:
    """Make image ``name`` mean the build ``out`` (a Dockerfile image's current build)."""
    d = _names_dir(settings)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{name}.json.tmp"
    tmp.write_text(json.dumps({"dir": out.name}))
    os.replace(tmp, d / f"{name}.json")


_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,40}")
_NAME_DIR = re.compile(r"[a-z0-9][a-z0-9-]{0,40}-[0-9a-f]{16}")


def register_rootfs(
    settings: Settings,
    name: str,
    rootfs: Path,
    *,
    digest: str,
    env: dict[str, str] | None = None,
    user: str | None = None,
    cwd: str | None = None,
    source: dict[str, Any] | None = None,
) -> ImageConfig:
    """Make image ``name`` boot the directory ``rootfs`` as it is: any distribution, with or
    without Python or glibc (``namespaces`` and ``gvisor`` run the agent on the agent runtime,
    never on the image). ``rootfs`` stays where it is and read-only to us: the image's cache
    entry ``<name>-<hash16>/`` holds ``image.json`` and a ``rootfs`` symlink to it, and the
    name points at that entry as a Dockerfile image's does, so a run, a session or a driver
    naming ``name`` gets it (``ensure_image``, ``built_image``) and ``images rm`` drops the entry
    but never the tree. ``digest`` identifies the content (an OCI image's, say); ``env``,
    ``user`` and ``cwd`` are what its commands run with, as for a Dockerfile image; ``source``
    is kept in ``image.json`` for whoever registered it."""
    if not _NAME.fullmatch(name) or (settings.images_dir / name / "image.yaml").is_file():
        raise errors.InvalidRequest.field(
            "name", f"{name!r}: lowercase letters, digits and '-', not an image definition's"
        )
    root = rootfs.resolve()
    if not root.is_dir():
        raise errors.InvalidRequest.field("rootfs", f"{rootfs} is not a directory")
    out = settings.image_cache_dir / f"{name}-{hashlib.sha256(digest.encode()).hexdigest()[:16]}"
    out.mkdir(parents=True, exist_ok=True)
    link = out / "rootfs"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(root)
    meta = {
        "name": name,
        "hash": digest,
        "built_at": time.time(),
        "env": dict(env or {}),
        "exec_user": user,
        "cwd": cwd,
        "python": _python_or_none(root),
        "rootfs_source": str(root),
        "source": source,
        "size_bytes": 0,  # the tree is not ours to count
    }
    tmp = out / f".{_MARKER}.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, out / _MARKER)
    point_name(settings, name, out)
    found = built_image(settings, name)
    assert found is not None
    return found


def built_rootfs(settings: Settings, name: str = "default") -> Path | None:
    """The rootfs of the current definition if it is built, else None (never builds)."""
    d = image_dir(settings, name)
    return d / "rootfs" if (d / _MARKER).is_file() else None


_run = run_bounded


def _mmdebstrap_argv(spec: dict[str, Any], target: Path) -> list[str]:
    u = spec["user"]
    argv = [
        "mmdebstrap",
        "--mode=unshare",
        f"--variant={spec['variant']}",
        '--aptopt=APT::Install-Recommends "false"',
        "--include=" + ",".join(spec["packages"]),
    ]
    argv += [f"--dpkgopt=path-exclude={p}" for p in spec["exclude_paths"]]
    argv += [
        f'--customize-hook=chroot "$1" groupadd -g {u["gid"]} {u["name"]}',
        f'--customize-hook=chroot "$1" useradd -m -u {u["uid"]} -g {u["gid"]} -s /bin/sh '
        f"{u['name']}",
        # apt lists and caches are dead weight in a sandbox that never installs anything
        '--customize-hook=rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*',
        # no mirror argument: mmdebstrap uses the host's default Debian mirror
        spec["suite"],
        str(target),
    ]
    return argv


async def _ensure_base(settings: Settings, spec: dict[str, Any]) -> Path:
    base = settings.image_cache_dir / "base" / _base_hash(spec)[:16]
    rootfs = base / "rootfs"
    if (base / "done").is_file():
        mark_used(base)
        return rootfs
    if shutil.which("mmdebstrap") is None:
        raise errors.SandboxError("image build needs mmdebstrap (apt-get install mmdebstrap)")
    # Images whose definitions name the same packages share this layer: one build makes it
    # (across processes too), the others wait and reuse it instead of removing it mid-build.
    async with _AsyncFileLock(base.parent / f".{base.name}.lock"):
        if (base / "done").is_file():
            return rootfs
        await asyncio.to_thread(build_area.sweep, settings.image_cache_dir)
        limits = BuildLimits.of(settings)
        async with BuildArea(base, limits.disk_mib) as area:
            layer = area.fs / "layer"
            layer.mkdir(mode=0o700)
            with BuildCgroup(limits) as cg:
                try:
                    await _mmdebstrap(spec, layer, layer / "rootfs", cg.prefix())
                except errors.SandboxError as exc:
                    raise explain(exc, limits, cg) from None
            (layer / "done").write_text(str(time.time()))
            await area.commit(layer)
    return rootfs


async def _mmdebstrap(spec: dict[str, Any], base: Path, rootfs: Path, prefix: list[str]) -> None:
    """mmdebstrap as root of a user namespace of its own (a uid range: ``0..65535`` inside is
    ``first..first+65535`` on the host), in its ``unshare`` mode (as root of that namespace it
    unshares mount, pid, uts and ipc and makes no further user namespace): the maintainer
    scripts of the packages a definition or Dockerfile names run as that namespace's root,
    never as host root. The layer's owners are shifted back to ``0..65535`` after."""
    first_uid, range_fd = allocate_uid_range()
    # the layer's directory is bound (by host root, in a private mount namespace) on an empty
    # mount point that uid may reach: the directories above it are host root's only
    points = MOUNT_DIR / str(first_uid)
    try:
        shutil.rmtree(points, ignore_errors=True)
        points.mkdir(parents=True, mode=0o755)
        at = points / "layer"
        at.mkdir(mode=0o755)
        os.chown(base, first_uid, first_uid)
        argv = [
            *prefix,
            *_mounts_prefix([(base, at)]),
            *_userns_prefix(first_uid),
            *_mmdebstrap_argv(spec, at / rootfs.name),
        ]
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/", "LANG": "C.UTF-8"}
        await _run(argv, "mmdebstrap", env=env)
        await asyncio.to_thread(
            shift_owners, rootfs, -first_uid, lo=first_uid, hi=first_uid + RANGE
        )
        os.chown(base, 0, 0)
        os.chmod(base, 0o700)
    finally:
        shutil.rmtree(points, ignore_errors=True)
        os.close(range_fd)


_INSTALL = """\
src=$1 dst=$2 mode=$3
if [ -d "$src" ]; then
  mkdir -p "$dst" && cp -R --preserve=mode,timestamps,links "$src"/. "$dst"/
else
  mkdir -p "$(dirname "$dst")" && cp --preserve=mode,timestamps "$src" "$dst"
fi
if [ -n "$mode" ]; then chmod "$mode" "$dst"; fi
"""
INSTALL_TIMEOUT_S = 300.0
_GCC = ("gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror")


async def _install(
    box: BuildSandbox, src: Path, dst: str, what: str, mode: str | None = None
) -> None:
    """Copy ``src`` (a host file or tree the builder vetted) to ``dst`` in the image, from inside
    the build sandbox: a symlink a build step left in the image resolves in the image."""
    inside = f"{IN_DIR}/src"
    await box.run(
        ["/bin/sh", "-ec", _INSTALL, "sh", inside, dst, mode or ""],
        what,
        env=_step_env({}),
        timeout=INSTALL_TIMEOUT_S,
        ro=[(src, inside)],
    )


def _step_env(env: dict[str, str]) -> dict[str, str]:
    return {
        "PATH": BUILD_PATH,
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "DEBIAN_FRONTEND": "noninteractive",
        **env,
    }


async def _compile_preloads(
    box: BuildSandbox, defdir: Path, d: ImageDefinition, stage: Path
) -> None:
    """The host's gcc compiles each shim inside the build sandbox, which shows it the host's
    ``/usr`` read-only and nothing else of the host (no /etc, /root, /home): a source cannot
    ``.incbin`` a host secret. The shims are then installed into the image from inside."""
    if not d.preload:
        return
    if shutil.which("gcc") is None:
        raise errors.SandboxError("image build needs gcc for preload shims (apt-get install gcc)")
    out = stage / "preload"
    out.mkdir(parents=True)
    await box.own(out)
    for i, item in enumerate(d.preload):
        await box.run(
            [*_GCC, "-o", f"{OUT_DIR}/{i}.so", f"{IN_DIR}/shim.c"],
            f"compile {item.source}",
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            timeout=INSTALL_TIMEOUT_S,
            ro=[(source_path(defdir, item.source), f"{IN_DIR}/shim.c")],
            rw=[(out, OUT_DIR)],
            host_usr=True,
        )
    for i, item in enumerate(d.preload):
        await _install(box, out / f"{i}.so", item.path, f"install {item.source}", "0755")
    await box.run(
        ["/bin/sh", "-ec", 'printf "%s\\n" "$@" > /etc/ld.so.preload', "sh"]
        + [p.path for p in d.preload],
        "write /etc/ld.so.preload",
        env=_step_env({}),
        timeout=INSTALL_TIMEOUT_S,
    )


def source_path(defdir: Path, source: str) -> Path:
    """A definition's source path, resolved; checked again here (the build trusts no load)."""
    if (why := source_problem(defdir, source)) is not None:
        raise errors.InvalidRequest.field("source", f"{defdir / 'image.yaml'}: {source}: {why}")
    return (defdir / source).resolve()


async def _precompile_agent(box: BuildSandbox, agent_path: str) -> None:
    """Compile the agent with the image's own python (best effort): a script run as __main__ is
    recompiled at every start (~10 ms). namespaces and gvisor now run the agent runtime's own
    compiled agent; this one is what they ran before, which bench/agent_runtime.py compares."""
    code = (
        "import py_compile; py_compile.compile("
        f"{agent_path!r}, cfile={agent_path + 'c'!r}, doraise=True, "
        "invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)"
    )
    try:
        await box.run(
            ["/usr/bin/python3", "-I", "-S", "-c", code],
            "precompile agent",
            env=_step_env({}),
            timeout=INSTALL_TIMEOUT_S,
        )
    except errors.SandboxError as exc:
        log.warning("%s", exc.detail)


def _build_steps(defdir: Path) -> list[Path]:
    return sorted(defdir.glob(f"*/{_BUILD_STEP}"))


BUILD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BUILD_STEP_TIMEOUT_S = 900.0
PIP_TIMEOUT_S = 900.0


def image_python(rootfs: Path) -> str:
    """``3.11`` for a rootfs whose python3 is 3.11: what pip installs for."""
    found = sorted(
        p.name.removeprefix("python")
        for p in (rootfs / "usr" / "bin").glob("python3.*")
        if p.name.removeprefix("python3.").isdigit()
    )
    if not found:
        raise errors.SandboxError("image build: pip: the image has no python3 (add it to packages)")
    return found[-1]


async def _pip_install(
    box: BuildSandbox, defdir: Path, d: ImageDefinition, rootfs: Path, stage: Path
) -> None:
    """The host's pip fetches wheels (only: nothing of a requirement runs) into a staging
    directory of the build, never into the image, in an empty scratch directory as a uid that
    owns nothing (:mod:`ephemeral.sandbox.host_pip`); the build sandbox copies them in. Items
    are requirements by name or shipped wheels (checked at load) and follow ``--``, so none is
    read as a pip option or a file."""
    if not d.pip:
        return
    for i, item in enumerate(d.pip):
        if (why := pip_problem(defdir, item)) is not None:
            raise errors.InvalidRequest.field(f"pip[{i}]", f"{defdir / 'image.yaml'}: {why}")
    version = image_python(rootfs)
    target = stage / f"pip-{d.name}"
    await asyncio.to_thread(stage.mkdir, exist_ok=True)
    shipped = [source_path(defdir, r[2:]) for r in d.pip if r.startswith("./")]
    n = iter(range(len(shipped)))
    reqs = [f"{{file{next(n)}}}" if r.startswith("./") else r for r in d.pip]
    args = [
        "install",
        "--disable-pip-version-check",
        "--no-input",
        "--no-warn-script-location",
        "--only-binary=:all:",
        f"--python-version={version}",
        "--implementation=cp",
        "--target",
        "{out}",
    ]
    if all(r.startswith("./") for r in d.pip):
        args.append("--no-index")  # only wheels shipped with the definition: no registry
    await host_pip.run(
        args,
        reqs,
        f"pip install into the image (python {version})",
        target,
        timeout=PIP_TIMEOUT_S,
        files=shipped,
        prefix=box.cgroup.prefix() if box.cgroup else (),
        within=stage,  # in the build's area: what pip downloads counts against its disk
    )
    await _install(
        box,
        target,
        f"/usr/local/lib/python{version}/dist-packages",
        f"{d.name}: install pip's wheels",
    )


async def _copy_files(box: BuildSandbox, defdir: Path, d: ImageDefinition) -> None:
    for i, f in enumerate(d.files):
        await _install(box, source_path(defdir, f.source), f.path, f"{d.name}: files[{i}]", f.mode)


async def _run_build_steps(box: BuildSandbox, d: ImageDefinition, env: dict[str, str]) -> None:
    """Each step runs as root of the build sandbox's user namespace, in the image, offline."""
    for i, step in enumerate(d.build):
        await box.run(
            ["/bin/sh", "-ec", step],
            f"{d.name}: build[{i}]",
            env=_step_env(env),
            timeout=BUILD_STEP_TIMEOUT_S,
        )


# what a Dockerfile build (dockerfile/builder.py) does in the image after the chain: given the build
# sandbox, the rootfs, a staging directory of the build and the chain's env
Then = Callable[[BuildSandbox, Path, Path, dict[str, str]], Awaitable[None]]


async def _assemble(
    layers: list[tuple[Path, ImageDefinition]],
    base: Path,
    work: Path,
    limits: BuildLimits,
    then: Then | None = None,
    net: NetHook | None = None,
) -> dict[str, Any]:
    """Copy the mmdebstrap layer into ``work`` (a new directory in the build's area,
    :mod:`ephemeral.sandbox.build_area`), then apply every definition in the chain, root
    first, each definition-controlled part inside the build sandbox (then ``then``, in the
    same sandbox), under ``limits``.

    Returns what the image's runs need to know (agent path, user, env, workdir)."""
    tmp = work
    # host root's only: a set-id file a build step made in the image is no host user's to run
    tmp.mkdir(mode=0o700)
    tmp.chmod(0o700)
    rootfs = tmp / "rootfs"
    stage = tmp / "stage"  # host-side inputs: pip's downloads, compiled shims
    await _run(["cp", "-a", "--reflink=auto", str(base), str(rootfs)], "copy base rootfs")
    # mmdebstrap copies the build host's name: every sandbox says `sandbox` instead
    (rootfs / "etc" / "hostname").write_text("sandbox\n")
    root_dir, root = layers[0]
    assert root.agent is not None and root.user is not None  # checked by the model
    env: dict[str, str] = {}
    workdir: str | None = None
    async with BuildSandbox(rootfs, limits, net=net) as box:
        await _install(
            box, source_path(root_dir, root.agent.source), root.agent.path, "install agent", "0755"
        )
        await _precompile_agent(box, root.agent.path)
        await _compile_preloads(box, root_dir, root, stage)
        for defdir, d in layers:
            env.update(d.env)
            workdir = d.workdir or workdir
            await _pip_install(box, defdir, d, rootfs, stage)
            await _copy_files(box, defdir, d)
            await _run_build_steps(box, d, env)
        for step in _build_steps(layers[-1][0]):
            if os.access(step, os.X_OK):
                if step.parent.name in ("rootfs", "stage"):
                    raise errors.InvalidRequest.field(
                        _BUILD_STEP, f"{step}: the directory name {step.parent.name!r} is taken"
                    )
                step_out = tmp / step.parent.name
                step_out.mkdir(exist_ok=True)
                await box.own(step_out)
                await box.run(
                    [f"{IN_DIR}/{_BUILD_STEP}", "/", OUT_DIR],
                    f"build step {step}",
                    env=_step_env(env),
                    timeout=BUILD_STEP_TIMEOUT_S,
                    ro=[(step, f"{IN_DIR}/{_BUILD_STEP}")],
                    rw=[(step_out, OUT_DIR)],
                )
        if then is not None:
            stage.mkdir(exist_ok=True)
            await then(box, rootfs, stage, dict(env))
    shutil.rmtree(stage, ignore_errors=True)
    return {
        "agent_path": root.agent.path,
        "user": root.user.model_dump(),
        "env": env,
        "workdir": workdir,
        "python": _python_or_none(rootfs),
    }


def _python_or_none(rootfs: Path) -> str | None:
    try:
        return image_python(rootfs)
    except errors.SandboxError:
        return None


async def ensure_image(settings: Settings, name: str = "default") -> Path:
    """The rootfs path of image ``name``, building it first if this definition is not cached.

    A derived image (``base:``) is built from one mmdebstrap layer holding every package of
    its chain, then each definition of the chain is applied, root first; its hash covers its
    base's hash, so a changed base rebuilds it.
    """
    if not (settings.images_dir / name / "image.yaml").is_file():
        found = dockerfile_image_dir(settings, name)
        if found is not None and (found / _MARKER).is_file():
            mark_used(found)
            return found / "rootfs"  # built from a Dockerfile: only build_dockerfile builds it
    defdir = definition_dir(settings, name)
    layers = chain(defdir)
    digest = definition_hash(defdir)
    out = settings.image_cache_dir / f"{name}-{digest[:16]}"
    if (out / _MARKER).is_file():
        mark_used(out)
        _name_current(settings, name, out)
        return out / "rootfs"
    # flock blocks: take it in a thread so other coroutines keep running during a build
    async with _AsyncFileLock(name_lock_path(settings, name)):
        if (out / _MARKER).is_file():
            return out / "rootfs"
        progress.stage(f"building image {name} (not built yet for this definition: minutes)")
        limits = BuildLimits.of(settings)
        await asyncio.to_thread(build_area.sweep, settings.image_cache_dir)
        spec = _layer_spec([d for _, d in layers])
        base = await _ensure_base(settings, spec)
        async with BuildArea(out, limits.disk_mib) as area:
            work = area.fs / "image"
            info = await _assemble(layers, base, work, limits)
            base_name = layers[-1][1].base
            meta = {
                "name": name,
                "hash": digest,
                "built_at": time.time(),
                **info,
                "base": base_name,
                "base_hash": definition_hash(defdir.parent / base_name) if base_name else None,
                # its mmdebstrap layer, kept by the cache's gc while this is the current build
                "layer": base.parent.name,
                "size_bytes": await asyncio.to_thread(_du, work),
            }
            (work / _MARKER).write_text(json.dumps(meta, indent=1))
            await area.commit(work)
        _name_current(settings, name, out)
        await asyncio.to_thread(image_gc.after_build, settings, out)
        # microVM hook (owned by microvm_image.py): kernel, initramfs and ext4 of this rootfs
        await asyncio.to_thread(build_with_image, settings, name, out / "rootfs", digest[:16])
    return out / "rootfs"


async def ensure_layer(settings: Settings, name: str) -> Path:
    """The mmdebstrap layer of definition ``name``'s chain (what a ``FROM NAME`` Dockerfile or a
    ``base: NAME`` definition builds on), made again if the cache's gc removed it, and named in
    the current build's ``image.json`` so the gc keeps it from now on (builds made before that
    field lack it). ``ephemeral images build NAME`` calls it: a cache over its size had
    evicted python-dev's layer while its build stayed, and ``make setup`` did not restore it."""
    rootfs = await ensure_image(settings, name)
    spec = _layer_spec([d for _, d in chain(definition_dir(settings, name))])
    layer = await _ensure_base(settings, spec)
    marker = rootfs.parent / _MARKER
    async with _AsyncFileLock(name_lock_path(settings, name)):
        meta = json.loads(marker.read_text())
        if meta.get("layer") != layer.parent.name:
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(json.dumps({**meta, "layer": layer.parent.name}, indent=1))
            tmp.replace(marker)
    return layer


def name_lock_path(settings: Settings, name: str) -> Path:
    """The lock a build of image ``name`` holds (any builder, any process sharing the cache),
    and so does a removal of its builds: one of them at a time."""
    return settings.image_cache_dir / f".{name}.lock"


@contextlib.contextmanager
def name_locked(settings: Settings, name: str) -> Iterator[None]:
    """Hold :func:`name_lock_path` (blocking: from a thread, or where nothing else runs)."""
    fd = _open_lock(name_lock_path(settings, name))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and the lock with it


def _open_lock(path: Path) -> int:
    """The lock file at ``path`` (made, with its directory, if missing), open for ``flock``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_CREAT | os.O_RDWR, 0o600)


class _AsyncFileLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: int | None = None

    async def __aenter__(self) -> None:
        fd = _open_lock(self.path)
        self._fh = fd
        await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)

    async def __aexit__(self, *exc: object) -> None:
        if self._fh is not None:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            os.close(self._fh)
            self._fh = None


def _name_current(settings: Settings, name: str, out: Path) -> None:
    """Name ``out`` the current build of definition ``name`` (``images gc`` keeps it); written
    only when it changes."""
    ptr = settings.image_cache_dir / CURRENT / name
    with contextlib.suppress(OSError):
        if ptr.read_text() == out.name:
            return
    with contextlib.suppress(OSError):  # best effort, as mark_used: a read-only cache still works
        ptr.parent.mkdir(parents=True, exist_ok=True)
        tmp = ptr.with_name(f".{name}.{os.getpid()}.tmp")
        tmp.write_text(out.name)
        os.replace(tmp, ptr)


def _du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


class ImageConfig(BaseModel):
    """What a run takes from its built image: identity, and how its commands run.

    ``user`` and ``cwd`` are set for an image built from a Dockerfile (its ``USER``, root when
    it has none, as in Docker; its ``WORKDIR``): a session's exec that names no user or cwd
    gets them. ``dockerfile`` holds what such an image records without acting on it (``CMD``,
    ``ENTRYPOINT``, ``EXPOSE``, ``LABEL``, ``SHELL``), and the Dockerfile's path."""

    name: str
    hash: str
    rootfs: Path
    agent_path: str = "/opt/ephemeral/agent.py"
    env: dict[str, str] = {}
    workdir: str | None = None
    base: str | None = None
    user: str | None = None
    cwd: str | None = None
    dockerfile: dict[str, Any] | None = None
    # a pulled registry image (ephemeral/oci/sandbox_image.py): its layers, lowest first, the
    # guest agent's layer last; ``rootfs`` is then the layer holding its /etc/passwd
    layers: list[Path] = []
    pulled: bool = False

    def lower(self) -> str:
        """What the writable root mounts as the overlay's lower layer(s) (``writable_root``):
        the rootfs, or a pulled image's layers topmost first, joined by ':'."""
        if not self.layers:
            return str(self.rootfs)
        return ":".join(str(p) for p in reversed(self.layers))


def built_image(settings: Settings, name: str) -> ImageConfig | None:
    """The current build of image ``name``, or None when it is not built (never builds). A
    registry reference is ``oci.sandbox_image.built_image``'s (that module builds on this one)."""
    try:
        d = image_dir(settings, name)
    except errors.InvalidRequest:
        return None
    try:
        meta = json.loads((d / _MARKER).read_text())
    except (OSError, ValueError):
        return None
    mark_used(d)
    if (settings.images_dir / name / "image.yaml").is_file():
        _name_current(settings, name, d)
    # a Dockerfile image FROM a registry image: stored layers (dockerfile/layers.py)
    layers = [Path(p) for p in meta.get("layers") or []]
    for layer in layers[:-1]:  # what images gc reads as the layer's last use (not the agent's)
        mark_used(layer.parent)
    return ImageConfig(
        name=name,
        hash=str(meta.get("hash", "")),
        rootfs=Path(meta["rootfs_layer"]) if layers else d / "rootfs",
        layers=layers,
        pulled=bool(layers),
        agent_path=str(meta.get("agent_path") or "/opt/ephemeral/agent.py"),
        env=dict(meta.get("env") or {}),
        workdir=meta.get("workdir"),
        base=meta.get("base"),
        user=meta.get("exec_user"),
        cwd=meta.get("cwd"),
        dockerfile=meta.get("dockerfile"),
    )


def available(settings: Settings) -> list[str]:
    """Names of the images whose current definition is built here (what a run may name)."""
    return sorted({i.name for i in list_images(settings, sizes=False) if i.current})


def require_built(settings: Settings, name: str, field: str = "image") -> ImageConfig:
    """The built image, or a 422 naming ``field`` that lists what this server has built."""
    found = built_image(settings, name)
    if found is None:
        names = ", ".join(available(settings)) or "none"
        hint = (
            f"build it with `ephemeral images build {name}`"
            if (settings.images_dir / name / "image.yaml").is_file()
            else "build one with `ephemeral images build NAME`"
        )
        raise errors.InvalidRequest.field(
            field, f"image {name!r} is not built on this server (available: {names}; {hint})"
        )
    return found


def list_images(settings: Settings, *, sizes: bool = True) -> list[ImageInfo]:
    out: list[ImageInfo] = []
    cache = settings.image_cache_dir
    if not cache.is_dir():
        return out
    for marker in sorted(cache.glob(f"*/{_MARKER}")):
        try:
            meta = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        name = str(meta.get("name", ""))
        try:
            current = image_dir(settings, name) == marker.parent
        except errors.InvalidRequest:
            current = False
        out.append(
            ImageInfo(
                name=name,
                hash=str(meta.get("hash", "")),
                path=marker.parent,
                rootfs=marker.parent / "rootfs",
                built_at=float(meta.get("built_at", 0)),
                size_bytes=(
                    int(meta["size_bytes"])
                    if isinstance(meta.get("size_bytes"), int)
                    else (_du(marker.parent) if sizes else 0)
                ),
                current=current,
            )
        )
    return out


def remove_images(
    settings: Settings, name: str, *, all_versions: bool = True, include_base: bool = False
) -> list[Path]:
    """Delete cached builds of ``name`` (every version, or only stale ones); returns what went.

    Under the name's build lock, listed once it is held: processes sharing the cache (two
    checkouts' test suites, an ``images rm`` beside a build) take turns, so a removal never
    deletes a build while it is committed, and never a tree another removal is deleting (both
    rmtrees failed with FileNotFoundError on whichever directory the other took first)."""
    removed: list[Path] = []
    # a name no builder takes has no build and no lock (nor a lock file made from it)
    with name_locked(settings, name) if _NAME.fullmatch(name) else contextlib.nullcontext():
        for info in list_images(settings):
            if info.name == name and (all_versions or not info.current):
                shutil.rmtree(info.path)
                removed.append(info.path)
                # the microVM's disk of this build (microvm_image names it <name>-<hash16>.ext4)
                ext4 = settings.image_cache_dir / "microvm" / "rootfs" / f"{info.path.name}.ext4"
                if ext4.is_file():
                    ext4.unlink()
                    removed.append(ext4)
        pointer = _names_dir(settings) / f"{name}.json"
        if all_versions and _NAME.fullmatch(name) and pointer.is_file():
            pointer.unlink()  # a Dockerfile image's name: nothing left to point at
            removed.append(pointer)
        if all_versions and _NAME.fullmatch(name):  # a definition's current build: gone too
            (settings.image_cache_dir / CURRENT / name).unlink(missing_ok=True)
    if include_base and (settings.image_cache_dir / "base").is_dir():
        base = settings.image_cache_dir / "base"
        shutil.rmtree(base)
        removed.append(base)
    return removed
