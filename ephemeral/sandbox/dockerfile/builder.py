"""The builder: a plan built as untrusted input, every step in the build sandbox
(:mod:`ephemeral.sandbox.build_sandbox`: root of its own user namespace, the image as ``/``,
no network), never as host root; the result cached by the hash of all its inputs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import hashlib
import json
import os
import shutil
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from ephemeral import build_proxy, errors
from ephemeral.oci import pull as oci_pull
from ephemeral.oci import reference, sandbox_image
from ephemeral.oci.store import LayerStore, PulledImage
from ephemeral.sandbox import build_area, host_pip, image_gc, images, users
from ephemeral.sandbox.build_sandbox import IN_DIR, OUT_DIR, BuildLimits, BuildSandbox
from ephemeral.sandbox.dockerfile import layers
from ephemeral.sandbox.dockerfile.aliases import DEBIAN_BASES, NAME, _resolve
from ephemeral.sandbox.dockerfile.context import (
    Context,
    _archive_flag,
    _copy_file,
    _is_archive,
    _stage_tree,
    archive_bounds,
    resolve_copy,
    scan_context,
)
from ephemeral.sandbox.dockerfile.installs import requirements_file
from ephemeral.sandbox.dockerfile.parser import IgnoreRule, fail, parse, parse_dockerignore
from ephemeral.sandbox.dockerfile.plan import (
    _ENV_KEY,
    DEFAULT_PATH,
    TRANSLATOR_VERSION,
    CopyStep,
    Plan,
    RunStep,
    WorkdirStep,
    translate,
)
from ephemeral.settings import Settings

MAX_DOCKERFILE_BYTES = 1 << 20


RUN_TIMEOUT_S = 900.0


COPY_TIMEOUT_S = 300.0


PIP_TIMEOUT_S = 900.0


WHEELS = "/run/ephemeral-build/wheels"


APT_SHIM = "/run/ephemeral-build/apt-get"


MAX_REQUIREMENTS_BYTES = 1 << 20


def read_in_image(rootfs: Path, path: str) -> bytes:
    """File ``path`` of the image being built, read without following any link (the image is
    untrusted: a link could name a host path); OSError when it cannot be read so."""
    parts = [p for p in path.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise OSError(f"{path}: not a plain path")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(rootfs, flags | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        f = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)
    with os.fdopen(f, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise OSError(f"{path}: not a regular file")
        data = fh.read(MAX_REQUIREMENTS_BYTES + 1)
    if len(data) > MAX_REQUIREMENTS_BYTES:
        raise OSError(f"{path}: larger than {MAX_REQUIREMENTS_BYTES} bytes")
    return data


def load(
    dockerfile: Path,
    context: Path | None,
    build_args: Mapping[str, str],
    settings: Settings,
) -> tuple[Plan, Context, bytes]:
    """Read, parse and translate a Dockerfile and scan its context (no build)."""
    path = str(dockerfile)
    root = (context if context is not None else dockerfile.parent).resolve()
    if not root.is_dir():
        raise fail(path, None, None, f"context {root} is not a directory")
    data = _read_dockerfile(dockerfile, root, path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise fail(path, None, None, "not UTF-8 text") from None
    rules: list[IgnoreRule] = []
    for ign in (dockerfile.with_name(dockerfile.name + ".dockerignore"), root / ".dockerignore"):
        if ign.is_file() and not ign.is_symlink():
            rules = parse_dockerignore(ign.read_text(errors="replace"), str(ign))
            break
    for k in build_args:
        if not _ENV_KEY.fullmatch(k):
            raise errors.InvalidRequest.field("build_args", f"{k!r} is not a valid argument name")

    pulled: dict[str, PulledImage] = {}

    def registry_image(image: str) -> str | None:
        """The normalized reference of ``image``, pulled now unless this host has it."""
        try:
            ref = str(reference.parse(image, "FROM"))
        except errors.InvalidRequest:
            return None
        if ref not in pulled:  # load runs in a thread of its own: no loop is running here
            pulled[ref] = asyncio.run(oci_pull.ensure_image(settings, ref, "FROM"))
        return ref

    def base_env(image: str) -> dict[str, str]:
        if image in pulled:
            return dict(pulled[image].env)
        env: dict[str, str] = {}
        for _, d in images.chain(images.definition_dir(settings, image)):
            env.update(d.env)
        return env

    def base_start(image: str) -> tuple[str | None, str | None]:
        got = pulled.get(image)
        return (got.workdir, got.user) if got is not None else (None, None)

    def resolve_base(image: str) -> str | None:
        # with an allow list, Debian is the registry's (its own apt, through the proxy)
        debian = DEBIAN_BASES.fullmatch(image) is not None
        found = None if debian and settings.build_allow_hosts else _resolve(settings, image)
        if found is None:
            return registry_image(image)
        if not (settings.images_dir / found / "image.yaml").is_file():
            return None  # a Dockerfile image as a base: not yet (its steps are not a definition)
        return found

    def copied_image(image: str) -> str | None:
        # a bare name that is no stage is more likely a stage's typo than an image: not pulled
        return registry_image(image) if any(c in image for c in "/:@") else None

    plan = translate(
        parse(text, path), build_args, resolve_base, base_env, base_start, copied_image
    )
    ctx = scan_context(root, rules, path)
    for stage in [*plan.stages, plan]:
        for step in stage.steps:
            if isinstance(step, CopyStep) and step.from_stage is None:
                resolve_copy(ctx, plan, step)  # a missing or escaping source fails first
    return plan, ctx, data


def _read_dockerfile(dockerfile: Path, root: Path, path: str) -> bytes:
    """The Dockerfile's bytes: a regular file inside the context, opened without following a
    link (its directory is resolved; the file itself must not be a link). A refused file's
    content is never read, so no error can echo it."""
    where = dockerfile.parent.resolve() / dockerfile.name
    if not where.is_relative_to(root):
        raise fail(path, None, None, f"the Dockerfile must be inside the context {root}")
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        why = "a symlink (not followed)" if exc.errno == errno.ELOOP else exc.strerror
        raise fail(path, None, None, f"cannot read it: {why}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise fail(path, None, None, "not a regular file")
        if st.st_size > MAX_DOCKERFILE_BYTES:
            raise fail(path, None, None, f"larger than {MAX_DOCKERFILE_BYTES} bytes")
        data = f.read(MAX_DOCKERFILE_BYTES + 1)
    if len(data) > MAX_DOCKERFILE_BYTES:
        raise fail(path, None, None, f"larger than {MAX_DOCKERFILE_BYTES} bytes")
    return data


def _base_identity(settings: Settings, base: str) -> str:
    """What a base contributes to the cache key: a registry image's manifest digest (as this
    host pulled it), our image's definition hash."""
    if "/" in base:
        found = LayerStore(settings).resolve(reference.parse(base))
        if found is None:  # load pulled it; gc took it since
            raise errors.SandboxError(f"image build: the base {base} is no longer here")
        return found.digest
    return images.definition_hash(images.definition_dir(settings, base))


def _digest(data: bytes, build_args: Mapping[str, str], ctx: Context, base_hash: str) -> str:
    h = hashlib.sha256(
        f"dockerfile-{TRANSLATOR_VERSION} builder-{images.BUILDER_VERSION}\n".encode()
    )
    h.update(f"base {base_hash}\n".encode())
    h.update(len(data).to_bytes(8, "big") + data)
    args = json.dumps(dict(sorted(build_args.items()))).encode()
    h.update(len(args).to_bytes(8, "big") + args)
    h.update(f"context {ctx.digest}\n".encode())
    return h.hexdigest()


def build_dockerfile(
    dockerfile: Path,
    context: Path | None = None,
    *,
    name: str | None = None,
    build_args: Mapping[str, str] | None = None,
    settings: Settings | None = None,
) -> images.ImageConfig:
    """Build the image a Dockerfile describes (or find it cached) and return its config.

    ``context`` defaults to the Dockerfile's directory; ``name`` to ``dockerfile-<hash12>``.
    The build is cached under ``~/.cache/ephemeral/images/<name>-<hash16>`` by the sha256 of
    the Dockerfile, the build args, the context's files that ``.dockerignore`` lets in and the
    base image's hash: a second call with the same inputs returns at once. After it, ``name``
    is an image like the others (``images list``, ``GET /v1/images``, a run's ``image``).

    Returns :class:`ephemeral.sandbox.images.ImageConfig`, what ``images.built_image`` and
    ``Runtime.built_image`` return for the image: ``name``, ``hash``, ``rootfs``, ``env`` (the
    Dockerfile's final ``ENV``, over its base image's env and ``PATH``), ``workdir`` and ``cwd``
    (the final ``WORKDIR``, absolute, or None when it gives none), ``user`` (the final ``USER``,
    ``root`` when it gives none, as in Docker), ``base`` (our image it is built on) and
    ``dockerfile`` (``cmd``, ``entrypoint``, ``expose``, ``labels``, ``shell``, ``path``).

    Raises :class:`ephemeral.errors.DockerfileError` (with ``path``, ``line``, ``instruction``)
    for what is not honoured and for a step that fails. Blocking: it runs its own event loop,
    in a thread of its own when the caller is inside one (async code should rather
    ``await abuild_dockerfile(...)`` or ``await asyncio.to_thread(build_dockerfile, ...)``,
    which do not hold up the caller's loop).
    """

    def run() -> images.ImageConfig:
        return asyncio.run(
            abuild_dockerfile(
                dockerfile, context, name=name, build_args=build_args, settings=settings
            )
        )

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dockerfile") as pool:
        return pool.submit(run).result()


async def abuild_dockerfile(
    dockerfile: Path,
    context: Path | None = None,
    *,
    name: str | Callable[[str], str] | None = None,
    build_args: Mapping[str, str] | None = None,
    settings: Settings | None = None,
) -> images.ImageConfig:
    """:func:`build_dockerfile` for async callers; ``name`` may be a function of the build's
    content digest (what Harbor's environment names its images by)."""
    settings = settings or Settings.load()
    build_args = dict(build_args or {})
    dockerfile = Path(dockerfile)
    plan, ctx, data = await asyncio.to_thread(load, dockerfile, context, build_args, settings)
    base_hash = _base_identity(settings, plan.base)
    for k in plan.needed():  # a stage copied from is part of the image
        base_hash += f"+{k}:{_base_identity(settings, plan.stages[k].base)}"
    digest = _digest(data, build_args, ctx, base_hash)
    name = name(digest) if callable(name) else name or f"dockerfile-{digest[:12]}"
    if not NAME.fullmatch(name):
        raise errors.InvalidRequest.field(
            "name", f"{name!r}: lowercase letters, digits and '-', at most 41 characters"
        )
    if (settings.images_dir / name / "image.yaml").is_file():
        raise errors.InvalidRequest.field(
            "name", f"{name!r} is an image definition of sandbox_images/: choose another name"
        )
    out = settings.image_cache_dir / f"{name}-{digest[:16]}"
    marker = out / "image.json"
    if not marker.is_file():
        async with images._AsyncFileLock(images.name_lock_path(settings, name)):
            if not marker.is_file():
                await _build(settings, plan, ctx, dockerfile, base_hash, out, digest, name)
    images.point_name(settings, name, out)
    built = images.built_image(settings, name)
    assert built is not None
    return built


async def _build(
    settings: Settings,
    plan: Plan,
    ctx: Context,
    dockerfile: Path,
    base_hash: str,
    out: Path,
    digest: str,
    name: str,
) -> None:
    limits = BuildLimits.of(settings)
    await asyncio.to_thread(build_area.sweep, settings.image_cache_dir)
    extracted: dict[int, tuple[Path, bool]] = {}
    proxy = build_proxy.for_build(settings)
    # every stage, what later stages copy from it and the image itself are written in the
    # build's area: one size-limited filesystem (build_area.py), in directories host root's
    # only (a set-uid file of a stage is no host user's to reach)
    async with images.BuildArea(out, limits.disk_mib) as area:
        scratch = area.fs / "stages"
        scratch.mkdir(mode=0o700)
        # the stages of COPY --from=<image> first: any stage may copy from them
        for k in sorted(plan.needed(), key=lambda k: (not plan.stages[k].image_only, k)):
            await _build_stage(settings, plan, k, ctx, scratch, extracted, limits, proxy)
        work = area.fs / "image"
        if plan.from_registry:
            layered = area.fs / "layered"
            info = await _assemble_stage(
                settings, plan, plan, ctx, layered, extracted, [], limits, proxy
            )
            work.mkdir(mode=0o700)
            image = await asyncio.to_thread(
                layers.store_image,
                settings,
                info.pop("pulled"),
                layered / "ovl" / "o" / "upper",
                name=name,
                digest=digest,
                env=plan.env,
                workdir=plan.workdir,
                user=plan.user,
                cmd=plan.cmd,
                entrypoint=plan.entrypoint,
            )
            info.update(_layered_meta(settings, image))
        else:
            info = await _assemble_stage(
                settings, plan, plan, ctx, work, extracted, [], limits, proxy
            )
        shutil.rmtree(scratch, ignore_errors=True)
        if proxy is not None:
            info["network"] = _network_info(work, settings, proxy)
        await _finish(work, plan, info, dockerfile, base_hash, digest, name)
        await area.commit(work)
    await asyncio.to_thread(image_gc.after_build, settings, out)


def _layered_meta(settings: Settings, image: PulledImage) -> dict[str, Any]:
    """What ``image.json`` says of an image made of stored layers (``images.built_image``
    reads it): the layers, lowest first, then the guest agent's; the one holding the
    ``/etc/passwd`` a session's users come from; the store reference that keeps them."""
    store = LayerStore(settings)
    paths = [store.layer_root(layer.diff_id) for layer in image.layers]
    agent_fs, agent_path = sandbox_image.agent_layer(settings)
    etc = next((p for p in reversed(paths) if (p / "etc" / "passwd").exists()), paths[-1])
    return {
        "layers": [str(p) for p in [*paths, agent_fs]],
        "rootfs_layer": str(etc),
        "agent_path": agent_path,
        "oci_reference": image.reference,
        "size_bytes": image.layers[-1].unpacked_bytes,
    }


NETWORK_FILE = "network.json"


def _network_info(work: Path, settings: Settings, proxy: build_proxy.BuildProxy) -> dict[str, Any]:
    """Every request the build's proxy saw, in ``network.json`` beside ``image.json``; a
    summary for ``image.json``."""
    record = {"allow": list(settings.build_allow_hosts), "requests": proxy.records}
    (work / NETWORK_FILE).write_text(json.dumps(record, indent=1))
    return {
        "allow": record["allow"],
        "requests": len(proxy.records),
        "denied": len(proxy.denied()),
        "file": NETWORK_FILE,
    }


async def _finish(
    out: Path,
    plan: Plan,
    info: dict[str, Any],
    dockerfile: Path,
    base_hash: str,
    digest: str,
    name: str,
) -> None:
    """Write the image's ``image.json`` (last: its presence says the image is whole)."""
    meta = {
        "name": name,
        "hash": digest,
        "built_at": time.time(),
        **info,
        "env": plan.env,
        "workdir": plan.workdir,
        "cwd": plan.workdir,
        "exec_user": plan.user or "root",
        "base": plan.base,
        "base_hash": base_hash,
        "dockerfile": {
            "path": str(dockerfile),
            "cmd": plan.cmd,
            "entrypoint": plan.entrypoint,
            "expose": plan.expose,
            "labels": plan.labels,
            "shell": plan.shell,
            "build_args": plan.args_used,
            "packages": plan.packages,
        },
        "size_bytes": info.get("size_bytes") or await asyncio.to_thread(images._du, out),
    }
    (out / "image.json").write_text(json.dumps(meta, indent=1))


async def _assemble_stage(
    settings: Settings,
    final: Plan,
    stage: Plan,
    ctx: Context,
    out: Path,
    extracted: dict[int, tuple[Path, bool]],
    exports: list[tuple[CopyStep, Path]],
    limits: BuildLimits,
    proxy: build_proxy.BuildProxy | None,
) -> dict[str, Any]:
    """Build one stage's rootfs in ``out`` (its base's chain, then its steps); before the
    build sandbox closes, copy what later stages' ``COPY --from`` take into ``exports``.

    A stage on a registry image runs on the image's stored layers under a writable layer of
    its own (``layers.py``), left in ``out/ovl/o/upper``; ``pulled`` is then its base."""
    if stage.from_registry:
        pulled = await oci_pull.ensure_image(settings, stage.base, "FROM")
        store = LayerStore(settings)
        staging = out / "stage"
        await asyncio.to_thread(staging.mkdir, mode=0o700, parents=True)
        lowers = [store.layer_root(x.diff_id) for x in pulled.layers]
        root = layers.LayeredRoot(lowers, out / "ovl")
        async with BuildSandbox(root.root, limits, root=root, net=proxy) as box:
            await _stage_steps(box, root.root, staging, final, stage, ctx, extracted, exports)
        shutil.rmtree(staging, ignore_errors=True)
        return {"pulled": pulled}
    chain = images.chain(images.definition_dir(settings, stage.base))
    spec = images._layer_spec([d for _, d in chain], tuple(stage.packages))
    base = await images._ensure_base(settings, spec)

    async def steps(box: BuildSandbox, rootfs: Path, staging: Path, _env: dict[str, str]) -> None:
        await _stage_steps(box, rootfs, staging, final, stage, ctx, extracted, exports)

    return await images._assemble(chain, base, out, limits, then=steps, net=proxy)


async def _stage_steps(
    box: BuildSandbox,
    rootfs: Path,
    staging: Path,
    final: Plan,
    stage: Plan,
    ctx: Context,
    extracted: dict[int, tuple[Path, bool]],
    exports: list[tuple[CopyStep, Path]],
) -> None:
    await _apply(box, rootfs, staging, stage, ctx, extracted)
    if stage is final:
        _check_user(rootfs, stage)
    for step, into in exports:
        extracted[id(step)] = (into / "data", await _export(box, final, step, into))


async def _build_stage(
    settings: Settings,
    final: Plan,
    k: int,
    ctx: Context,
    scratch: Path,
    extracted: dict[int, tuple[Path, bool]],
    limits: BuildLimits,
    proxy: build_proxy.BuildProxy | None,
) -> None:
    """An earlier stage: built, what is copied from it exported, its rootfs deleted."""
    consumers = [
        step
        for later in [*final.stages, final]
        for step in later.steps
        if isinstance(step, CopyStep) and step.from_stage == k
    ]
    exports = [(step, scratch / f"from-{k}-{n}") for n, step in enumerate(consumers)]
    for _, into in exports:
        into.mkdir(mode=0o700)
    await _assemble_stage(
        settings,
        final,
        final.stages[k],
        ctx,
        scratch / f"stage-{k}",
        extracted,
        exports,
        limits,
        proxy,
    )
    shutil.rmtree(scratch / f"stage-{k}", ignore_errors=True)


_EXPORT_SH = r"""
out=$1 meta=$2; shift 2
IFS=''
n=0 kind=file
for p in "$@"; do
  found=
  for m in $p; do
    [ -e "$m" ] || [ -L "$m" ] || continue
    found=1 n=$((n + 1))
    if [ -d "$m" ] && [ ! -L "$m" ]; then kind=dir; cp -a -- "$m"/. "$out"/
    else cp -a -- "$m" "$out"/
    fi
  done
  if [ -z "$found" ]; then echo "$p: no such file in the stage" >&2; exit 1; fi
done
if [ "$n" -gt 1 ]; then kind=many; fi
echo "$kind" > "$meta/kind"
"""


async def _export(box: BuildSandbox, final: Plan, step: CopyStep, into: Path) -> bool:
    """Copy a ``COPY --from``'s sources out of the stage (inside its build sandbox, where its
    links resolve in it) into ``into/data``; whether the destination is a directory."""
    (into / "data").mkdir()
    (into / "meta").mkdir()
    await box.own(into)
    try:
        await box.run(
            ["/bin/sh", "-ec", _EXPORT_SH, "sh", OUT_DIR, OUT_DIR + "-meta", *step.sources],
            f"COPY --from at line {step.line}",
            env={"PATH": DEFAULT_PATH, "LANG": "C.UTF-8"},
            timeout=COPY_TIMEOUT_S,
            rw=[(into / "data", OUT_DIR), (into / "meta", OUT_DIR + "-meta")],
        )
    except errors.SandboxError as exc:
        detail = exc.detail.removeprefix("image build: ")
        raise fail(final.path, step.line, step.keyword, detail) from None
    try:
        kind = read_in_image(into, "/meta/kind").decode(errors="replace").strip()
    except OSError:
        kind = ""
    if kind == "many" and not step.as_dir:
        raise fail(
            final.path,
            step.line,
            step.keyword,
            "with more than one source file the destination must be a directory and end with '/'",
        )
    return step.as_dir or kind in ("dir", "many")


def _check_user(rootfs: Path, plan: Plan) -> str | None:
    """The final USER must be a user of the image (a name in its passwd, or a number)."""
    if plan.user is None:
        return None
    who = plan.user.split(":", 1)[0]
    if users.resolve(who, users.read_passwd(rootfs) or "") is None:
        raise fail(plan.path, plan.user_line, "USER", f"{who!r} is not a user of the image")
    return plan.user


_APT_SHIM_TEXT = r"""#!/bin/sh
# ephemeral's apt-get at build time: the build has no network, and the packages of the
# Dockerfile's `apt-get install` lines are already in the image's package layer
sub= pkgs= skip=
for a in "$@"; do
  if [ -n "$skip" ]; then skip=; continue; fi
  case $a in
    -o|-c|-t|--option|--config-file|--target-release|--default-release) skip=1 ;;
    -*) ;;
    *) if [ -z "$sub" ]; then sub=$a; else pkgs="$pkgs $a"; fi ;;
  esac
done
case $sub in
  update|upgrade|dist-upgrade|full-upgrade|clean|autoclean) exit 0 ;;
  install)
    missing=
    for p in $pkgs; do
      n=${p%%=*}; n=${n%%/*}
      s=$(dpkg-query -W -f='${db:Status-Status}' "$n" 2>/dev/null)
      [ "$s" = installed ] || missing="$missing $n"
    done
    [ -z "$missing" ] && exit 0
    echo "apt-get install: not in the image's package layer:$missing" >&2
    echo "(the builder installs the packages it reads in RUN apt-get install lines)" >&2
    exit 100 ;;
  *) echo "apt-get $sub: not honoured at build time (no network: packages come from" >&2
    echo "the image's package layer)" >&2
    exit 100 ;;
esac
"""


async def _apply(
    box: BuildSandbox,
    rootfs: Path,
    stage: Path,
    plan: Plan,
    ctx: Context,
    extracted: dict[int, tuple[Path, bool]],
) -> None:
    shim = stage / "apt-get"
    shim.write_text(_APT_SHIM_TEXT)
    shim.chmod(0o755)
    wheels = stage / "wheels"
    wheels.mkdir()
    for n, step in enumerate(plan.steps):
        if isinstance(step, RunStep):
            await _run_step(box, rootfs, stage, plan, step, shim, wheels)
        elif isinstance(step, CopyStep) and step.from_stage is not None:
            data, as_dir = extracted[id(step)]
            await _copy_in(box, data, plan, step, as_dir)
        elif isinstance(step, CopyStep):
            await _copy(box, stage / f"copy-{n}", plan, ctx, step)
        else:
            await _workdir(box, rootfs, plan, step)


def _image_ids(
    rootfs: Path, plan: Plan, spec: str, line: int, kw: str
) -> tuple[int, int, str | None]:
    """uid, gid and home of ``USER`` value ``spec`` in the image as it is now."""
    who, _, group = spec.partition(":")
    passwd = users.read_passwd(rootfs) or ""
    ids = users.resolve(who, passwd)
    if ids is None:
        raise fail(plan.path, line, kw, f"USER {who!r} is not a user of the image (yet)")
    home = None
    for entry in passwd.splitlines():
        parts = entry.split(":")
        if len(parts) >= 7 and parts[2] == str(ids.uid) and (parts[0] == who or who.isdigit()):
            home = parts[5]
            break
    gid = ids.gid
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            found = _group_id(rootfs, group)
            if found is None:
                raise fail(plan.path, line, kw, f"group {group!r} is not a group of the image")
            gid = found
    return ids.uid, gid, home


def _group_id(rootfs: Path, group: str) -> int | None:
    text = users.read_etc(rootfs, "group") or ""
    for entry in text.splitlines():
        parts = entry.split(":")
        if len(parts) >= 3 and parts[0] == group and parts[2].isdigit():
            return int(parts[2])
    return None


_IN_DIR_CD = 'cd -- "$0" || exit 1; exec "$@"'


async def _run_step(
    box: BuildSandbox,
    rootfs: Path,
    stage: Path,
    plan: Plan,
    step: RunStep,
    shim: Path,
    wheels: Path,
) -> None:
    env = dict(step.env)
    prefix: list[str] = []
    home = "/root"
    if step.user is not None:
        uid, gid, user_home = _image_ids(rootfs, plan, step.user, step.line, "RUN")
        home = user_home or "/"
        if uid != 0 or gid != 0:
            prefix = ["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={gid}"]
            prefix += ["--init-groups"] if user_home is not None else ["--clear-groups"]
            prefix.append("--")
    env.setdefault("HOME", home)
    ro: list[tuple[Path, str]] = []
    if plan.from_registry:  # the image's own tools as they are: no read-ahead, no shim
        if prefix:
            prefix[0] = "setpriv"  # where the image has it (util-linux, busybox)
        await _run(box, plan, step, [*prefix, *step.argv], env, ro)
        return
    for p in ("usr/bin/apt-get", "usr/bin/apt"):
        try:
            if stat.S_ISREG(os.lstat(rootfs / p).st_mode):
                ro.append((shim, "/" + p))
        except OSError:
            pass
    if step.pip:
        try:
            version = images.image_python(rootfs)
        except errors.SandboxError as exc:
            raise fail(plan.path, step.line, "RUN", exc.detail) from None
        for reqs in step.pip:
            full = _with_files(rootfs, plan, step, reqs)
            if full[-1] != "--":  # a requirements file may name nothing
                joins = box.cgroup.prefix() if box.cgroup else []  # the build's cgroup
                await _pip_download(plan, step, version, full, wheels, joins)
        ro.append((wheels, WHEELS))
        env.setdefault("PIP_NO_INDEX", "1")
        env["PIP_FIND_LINKS"] = WHEELS
    await _run(box, plan, step, [*prefix, *step.argv], env, ro)


async def _run(
    box: BuildSandbox,
    plan: Plan,
    step: RunStep,
    command: list[str],
    env: dict[str, str],
    ro: list[tuple[Path, str]],
) -> None:
    argv = ["/bin/sh", "-c", _IN_DIR_CD, step.workdir, *command]
    seen = len(box.net.records) if isinstance(box.net, build_proxy.BuildProxy) else 0
    try:
        await box.run(argv, f"RUN at line {step.line}", env=env, timeout=RUN_TIMEOUT_S, ro=ro)
    except errors.SandboxError as exc:
        detail = exc.detail.removeprefix("image build: ")
        if isinstance(box.net, build_proxy.BuildProxy):  # what the proxy refused, named
            for r in box.net.denied(seen):
                detail += f"\nthe build's proxy refused {r['method']} {r['host']}:{r['port']}: "
                detail += str(r.get("reason", ""))
        raise fail(plan.path, step.line, "RUN", detail) from None


def _with_files(rootfs: Path, plan: Plan, step: RunStep, reqs: list[str]) -> list[str]:
    """``reqs`` with each ``-r FILE`` replaced by the file's requirements (read in the image
    as it is when the RUN comes)."""
    out: list[str] = []
    files: list[str] = []
    it = iter(reqs)
    for w in it:
        if w == "-r":
            files.append(next(it))
        else:
            out.append(w)
    for f in files:
        try:
            text = read_in_image(rootfs, f).decode("utf-8", "replace")
            out += requirements_file(text)
        except OSError as exc:
            raise fail(plan.path, step.line, "RUN", f"pip install -r {f}: {exc}") from None
        except ValueError as exc:
            raise fail(plan.path, step.line, "RUN", f"pip install -r {f}: {exc}") from None
    return out


async def _pip_download(
    plan: Plan, step: RunStep, version: str, reqs: list[str], wheels: Path, prefix: list[str]
) -> None:
    """The host's pip fetches wheels only for the image's python, in an empty scratch
    directory as a uid that owns nothing (:mod:`ephemeral.sandbox.host_pip`)."""
    cut = reqs.index("--")
    args = [
        "download",
        "--disable-pip-version-check",
        "--no-input",
        "--only-binary=:all:",
        f"--python-version={version}",
        "--implementation=cp",
        *reqs[:cut],  # --no-deps, --pre
        "--dest",
        "{out}",
    ]
    try:
        await host_pip.run(
            args,
            reqs[cut + 1 :],
            "pip download",
            wheels,
            timeout=PIP_TIMEOUT_S,
            prefix=prefix,
            within=wheels.parent,  # the build's stage directory, in its area
        )
    except errors.EphemeralError as exc:
        detail = exc.detail.removeprefix("image build: ")
        raise fail(plan.path, step.line, "RUN", detail) from None


_COPY_SH = r"""
src=$1 dst=$2 kind=$3 own=$4 mode=$5
# GNU cp replaces a file rather than writing through a link there; a cp without those options
# (busybox: alpine, a static image) copies as it can
if cp --remove-destination --preserve=mode,timestamps,links --version >/dev/null 2>&1; then
  cp_="cp -R -P --remove-destination --preserve=mode,timestamps,links"
else
  cp_="cp -R -P -p"
fi
case $own in
  '') own=0:0 ;;
  *:*) ;;
  *) u=$own; case $u in *[!0-9]*) u=$(id -u -- "$u") || exit 1 ;; esac; own=$u:$u ;;
esac
if [ "$kind" = dir ]; then
  new=; [ -e "$dst" ] || [ -L "$dst" ] || new=1
  mkdir -p -- "$dst"
  for e in "$src"/* "$src"/.[!.]* "$src"/..?*; do
    [ -e "$e" ] || [ -L "$e" ] || continue
    n=${e##*/}
    $cp_ -- "$e" "$dst/"
    chown -R -h -- "$own" "$dst/$n"
    if [ -n "$mode" ]; then chmod -R -- "$mode" "$dst/$n"; fi
  done
  if [ -n "$new" ]; then chown -h -- "$own" "$dst"; fi
else
  for e in "$src"/* "$src"/.[!.]* "$src"/..?*; do
    [ -e "$e" ] || [ -L "$e" ] || continue
    if [ -d "$dst" ] && [ ! -L "$dst" ]; then t="$dst/${e##*/}"
    else mkdir -p -- "$(dirname -- "$dst")"; t=$dst; fi
    [ -d "$t" ] && [ ! -L "$t" ] || rm -f -- "$t"
    $cp_ -- "$e" "$t"
    chown -R -h -- "$own" "$t"
    if [ -n "$mode" ]; then chmod -R -- "$mode" "$t"; fi
  done
fi
"""


async def _copy(box: BuildSandbox, staged: Path, plan: Plan, ctx: Context, step: CopyStep) -> None:
    """Docker's COPY rules: a directory's contents (not itself) are copied; several sources
    (or a glob's matches) need a destination ending in ``/``; a file copied to a path ending
    in ``/`` (or to an existing directory) keeps its name; missing directories are made."""
    resolved, as_dir = await asyncio.to_thread(resolve_copy, ctx, plan, step)
    if step.keyword == "ADD":
        archives = [
            (rel, host) for rel, host, kind in resolved if kind == "f" and _is_archive(host)
        ]
        for rel, host in archives:
            await _unpack(box, plan, step, rel, host)
        resolved = [r for r in resolved if (r[0], r[1]) not in archives]
        if not resolved:
            return

    def stage() -> None:
        staged.mkdir()
        for rel, host, kind in resolved:
            if kind == "d":
                _stage_tree(ctx, rel, host, staged)
            else:
                dst = staged / (PurePosixPath(rel).name if rel != "." else "file")
                if dst.exists():
                    dst.unlink()
                _copy_file(host, dst)

    try:
        await asyncio.to_thread(stage)
    except OSError as exc:
        raise fail(plan.path, step.line, step.keyword, f"cannot read the source: {exc}") from None
    await _copy_in(box, staged, plan, step, as_dir)


async def _copy_in(
    box: BuildSandbox, staged: Path, plan: Plan, step: CopyStep, as_dir: bool
) -> None:
    """Copy the staged sources into the image from inside the build sandbox (where a link
    the image holds resolves in the image), owned by ``--chown`` or root."""
    await box.own(staged)
    try:
        await box.run(
            [
                "/bin/sh",
                "-ec",
                _COPY_SH,
                "sh",
                f"{IN_DIR}/src",
                step.dest,
                "dir" if as_dir else "file",
                step.chown or "",
                step.chmod or "",
            ],
            f"{step.keyword} at line {step.line}",
            env={"PATH": DEFAULT_PATH, "LANG": "C.UTF-8"},
            timeout=COPY_TIMEOUT_S,
            ro=[(staged, f"{IN_DIR}/src")],
        )
    except errors.SandboxError as exc:
        detail = exc.detail.removeprefix("image build: ")
        raise fail(plan.path, step.line, step.keyword, detail) from None


_UNPACK_SH = r"""
src=$1 dst=$2 flag=$3
mkdir -p -- "$dst"
tar -x $flag --no-same-owner --no-same-permissions -f "$src" -C "$dst"
"""


async def _unpack(box: BuildSandbox, plan: Plan, step: CopyStep, rel: str, host: Path) -> None:
    """ADD of a local archive: unpacked into the destination as a directory, by the image's
    tar inside the build sandbox (a member's path resolves in the image), owned by root."""
    flag = _archive_flag(host) or ""
    try:
        await asyncio.to_thread(
            archive_bounds, host, box.limits.add_max_mib << 20, box.limits.add_max_files
        )
    except ValueError as exc:
        raise fail(plan.path, step.line, "ADD", f"{rel}: {exc}") from None
    try:
        await box.run(
            ["/bin/sh", "-ec", _UNPACK_SH, "sh", f"{IN_DIR}/archive", step.dest, flag],
            f"ADD {rel} at line {step.line}",
            env={"PATH": DEFAULT_PATH, "LANG": "C.UTF-8"},
            timeout=COPY_TIMEOUT_S,
            ro=[(host, f"{IN_DIR}/archive")],
        )
    except errors.SandboxError as exc:
        detail = exc.detail.removeprefix("image build: ")
        raise fail(plan.path, step.line, "ADD", detail) from None


_WORKDIR_SH = r"""
dir=$1 own=$2
if [ -e "$dir" ] || [ -L "$dir" ]; then exit 0; fi
mkdir -p -- "$dir"
if [ -n "$own" ]; then chown -- "$own" "$dir"; fi
"""


async def _workdir(box: BuildSandbox, rootfs: Path, plan: Plan, step: WorkdirStep) -> None:
    own = ""
    if step.user is not None:
        uid, gid, _ = _image_ids(rootfs, plan, step.user, step.line, "WORKDIR")
        own = f"{uid}:{gid}"
    try:
        await box.run(
            ["/bin/sh", "-ec", _WORKDIR_SH, "sh", step.path, own],
            f"WORKDIR at line {step.line}",
            env={"PATH": DEFAULT_PATH},
            timeout=COPY_TIMEOUT_S,
        )
    except errors.SandboxError as exc:
        raise fail(
            plan.path, step.line, "WORKDIR", exc.detail.removeprefix("image build: ")
        ) from None
