"""Guest images: build, cache, list and remove.

An image is declared by a directory ``sandbox_images/<name>/`` (``image.yaml`` + the guest
agent + optional extra build steps). Its identity is the sha256 of every file in that directory,
so the cache key changes exactly when the definition does. Layout under the image cache::

    base/<base-hash>/rootfs        mmdebstrap output (packages + user), the slow part (~2 min)
    <name>-<hash>/rootfs           base copy + guest agent: what every driver runs
    <name>-<hash>/image.json       written last: its presence means the image is complete
    <name>-<hash>/<step>/          output of the extra build step ``<defdir>/<step>/build-step``

The base layer is keyed only by what mmdebstrap sees, so editing the agent rebuilds in seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ephemeral import errors
from ephemeral.sandbox.microvm_image import build_with_image
from ephemeral.settings import Settings

log = logging.getLogger(__name__)
_BUILD_STEP = "build-step"
_MARKER = "image.json"


class UserSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    uid: int = Field(ge=1, le=65534)
    gid: int = Field(ge=1, le=65534)


class AgentSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str
    path: str = Field(pattern=r"^/[A-Za-z0-9._/-]+$")


class PreloadSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str
    path: str = Field(pattern=r"^/[A-Za-z0-9._/-]+\.so$")


class ImageDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,40}$")
    suite: str = Field(pattern=r"^[a-z]+$")
    variant: str = Field(pattern=r"^(extract|custom|essential|apt|required|minbase|buildd)$")
    packages: list[str] = Field(min_length=1)
    exclude_paths: list[str] = []
    user: UserSpec
    agent: AgentSpec
    preload: list[PreloadSpec] = []


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
    path = defdir / "image.yaml"
    try:
        raw = yaml.safe_load(path.read_text())
        return ImageDefinition.model_validate(raw)
    except (OSError, yaml.YAMLError) as exc:
        raise errors.InvalidRequest(f"{path}: {exc}") from exc
    except ValidationError as exc:
        errs = [{"field": ".".join(map(str, e["loc"])), "message": e["msg"]} for e in exc.errors()]
        detail = "; ".join(f"{e['field']}: {e['message']}" for e in errs)
        raise errors.InvalidRequest(f"{path}: {detail}", errors=errs) from exc


def _definition_files(defdir: Path) -> Iterator[Path]:
    for p in sorted(defdir.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc"):
            yield p


# Bumped when the builder's output changes for the same definition (it is part of the hash).
BUILDER_VERSION = 3


def definition_hash(defdir: Path) -> str:
    h = hashlib.sha256(f"builder-{BUILDER_VERSION}\n".encode())
    for p in _definition_files(defdir):
        rel = p.relative_to(defdir).as_posix().encode()
        h.update(len(rel).to_bytes(4, "big") + rel)
        data = p.read_bytes()
        h.update(len(data).to_bytes(8, "big") + data)
        h.update(b"x" if os.access(p, os.X_OK) else b"-")
    return h.hexdigest()


def _base_hash(d: ImageDefinition) -> str:
    keyed = d.model_dump(include={"suite", "variant", "packages", "exclude_paths", "user"})
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()


def image_dir(settings: Settings, name: str = "default") -> Path:
    defdir = definition_dir(settings, name)
    return settings.image_cache_dir / f"{name}-{definition_hash(defdir)[:16]}"


def built_rootfs(settings: Settings, name: str = "default") -> Path | None:
    """The rootfs of the current definition if it is built, else None (never builds)."""
    d = image_dir(settings, name)
    return d / "rootfs" if (d / _MARKER).is_file() else None


async def _run(argv: list[str], what: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        tail = out.decode(errors="replace")[-4000:]
        raise errors.SandboxError(f"image build: {what} failed (exit {proc.returncode}):\n{tail}")


def _mmdebstrap_argv(d: ImageDefinition, target: Path) -> list[str]:
    u = d.user
    argv = [
        "mmdebstrap",
        "--mode=root",
        f"--variant={d.variant}",
        '--aptopt=APT::Install-Recommends "false"',
        "--include=" + ",".join(d.packages),
    ]
    argv += [f"--dpkgopt=path-exclude={p}" for p in d.exclude_paths]
    argv += [
        f'--customize-hook=chroot "$1" groupadd -g {u.gid} {u.name}',
        f'--customize-hook=chroot "$1" useradd -m -u {u.uid} -g {u.gid} -s /bin/sh {u.name}',
        # apt lists and caches are dead weight in a sandbox that never installs anything
        '--customize-hook=rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*',
        # no mirror argument: mmdebstrap uses the host's default Debian mirror
        d.suite,
        str(target),
    ]
    return argv


async def _ensure_base(settings: Settings, d: ImageDefinition) -> Path:
    base = settings.image_cache_dir / "base" / _base_hash(d)[:16]
    rootfs = base / "rootfs"
    if (base / "done").is_file():
        return rootfs
    if shutil.which("mmdebstrap") is None:
        raise errors.SandboxError("image build needs mmdebstrap (apt-get install mmdebstrap)")
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    await _run(_mmdebstrap_argv(d, rootfs), "mmdebstrap")
    (base / "done").write_text(str(time.time()))
    return rootfs


async def _compile_preloads(defdir: Path, d: ImageDefinition, rootfs: Path) -> None:
    if not d.preload:
        return
    if shutil.which("gcc") is None:
        raise errors.SandboxError("image build needs gcc for preload shims (apt-get install gcc)")
    for item in d.preload:
        dst = rootfs / item.path.lstrip("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        await _run(
            [
                "gcc",
                "-shared",
                "-fPIC",
                "-O2",
                "-Wall",
                "-Werror",
                "-o",
                str(dst),
                str(defdir / item.source),
            ],
            f"compile {item.source}",
        )
        dst.chmod(0o755)
    (rootfs / "etc" / "ld.so.preload").write_text("".join(p.path + "\n" for p in d.preload))


async def _precompile_agent(rootfs: Path, agent_path: str) -> None:
    """Compile the agent with the image's own python: a script run as __main__ is otherwise
    recompiled at every start (~10 ms of a ~50 ms cold start). Best effort: the .py still runs."""
    code = (
        "import py_compile; py_compile.compile("
        f"{agent_path!r}, cfile={agent_path + 'c'!r}, doraise=True, "
        "invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)"
    )
    try:
        await _run(
            ["chroot", str(rootfs), "/usr/bin/python3", "-I", "-S", "-c", code], "precompile agent"
        )
    except errors.SandboxError as exc:
        log.warning("%s", exc.detail)


def agent_exec_path(rootfs: Path | str, agent_path: str) -> str:
    """The path to run inside the guest: the precompiled agent when the image has one."""
    compiled = agent_path + "c"
    return compiled if (Path(rootfs) / compiled.lstrip("/")).is_file() else agent_path


def _build_steps(defdir: Path) -> list[Path]:
    return sorted(defdir.glob(f"*/{_BUILD_STEP}"))


async def _assemble(defdir: Path, d: ImageDefinition, base: Path, out: Path) -> None:
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    await _run(["cp", "-a", "--reflink=auto", str(base), str(tmp / "rootfs")], "copy base rootfs")
    # mmdebstrap copies the build host's name: every sandbox says `sandbox` instead
    (tmp / "rootfs" / "etc" / "hostname").write_text("sandbox\n")
    agent_dst = tmp / "rootfs" / d.agent.path.lstrip("/")
    agent_dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(defdir / d.agent.source, agent_dst)
    agent_dst.chmod(0o755)
    await _precompile_agent(tmp / "rootfs", d.agent.path)
    await _compile_preloads(defdir, d, tmp / "rootfs")
    for step in _build_steps(defdir):
        if os.access(step, os.X_OK):
            step_out = tmp / step.parent.name
            step_out.mkdir(exist_ok=True)
            await _run([str(step), str(tmp / "rootfs"), str(step_out)], f"build step {step}")
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)


async def ensure_image(settings: Settings, name: str = "default") -> Path:
    """The rootfs path of image ``name``, building it first if this definition is not cached."""
    defdir = definition_dir(settings, name)
    d = load_definition(defdir)
    digest = definition_hash(defdir)
    out = settings.image_cache_dir / f"{name}-{digest[:16]}"
    if (out / _MARKER).is_file():
        return out / "rootfs"
    lock = settings.image_cache_dir / f".{name}.lock"
    # flock blocks: take it in a thread so other coroutines keep running during a build
    async with _AsyncFileLock(lock):
        if (out / _MARKER).is_file():
            return out / "rootfs"
        base = await _ensure_base(settings, d)
        await _assemble(defdir, d, base, out)
        meta = {
            "name": name,
            "hash": digest,
            "built_at": time.time(),
            "agent_path": d.agent.path,
            "user": d.user.model_dump(),
        }
        (out / _MARKER).write_text(json.dumps(meta, indent=1))
        # microVM hook (owned by microvm_image.py): kernel, initramfs and ext4 of this rootfs
        await asyncio.to_thread(build_with_image, settings, name, out / "rootfs", digest[:16])
    return out / "rootfs"


class _AsyncFileLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: int | None = None

    async def __aenter__(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
        self._fh = fd
        await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)

    async def __aexit__(self, *exc: object) -> None:
        if self._fh is not None:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            os.close(self._fh)
            self._fh = None


def _du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def list_images(settings: Settings) -> list[ImageInfo]:
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
                size_bytes=_du(marker.parent),
                current=current,
            )
        )
    return out


def remove_images(
    settings: Settings, name: str, *, all_versions: bool = True, include_base: bool = False
) -> list[Path]:
    """Delete cached builds of ``name`` (every version, or only stale ones); returns what went."""
    removed: list[Path] = []
    for info in list_images(settings):
        if info.name == name and (all_versions or not info.current):
            shutil.rmtree(info.path)
            removed.append(info.path)
    if include_base and (settings.image_cache_dir / "base").is_dir():
        base = settings.image_cache_dir / "base"
        shutil.rmtree(base)
        removed.append(base)
    return removed
