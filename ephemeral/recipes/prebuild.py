"""Environments made ready before anything runs in them (issue 36, item 8; docs/images.md,
"Prebuild").

An *environment* is what a Harbor task, a recipe or a suite needs its sandbox made from: an
image to pull (an OCI reference), a Dockerfile to build, or one of our built images. Harbor's
adapter (``ephemeral/harbor/task_image.py``) and ``ephemeral images prebuild`` resolve a task
the same way, through :func:`for_harbor`, so what prebuild made is what a trial finds:

- ``docker_image`` set (and not ``force_build`` with a Dockerfile): one of our images when the
  name is (an alias, Debian bookworm, a built name), else the registry image it names, pulled;
- else ``environment/Dockerfile``, built (the image is named by the builder's content digest).

:func:`ensure` makes one environment ready, holding a lock file per environment in the cache
directory, so a second trial or prebuild of the same environment, in this process or another,
waits for the one pull or build and then finds it made. A build that failed leaves a marker by
its content digest with the error; the next :func:`ensure` of the same inputs reports that
error at once without building again, until ``retry_failed`` (``--retry-failed``, Harbor's
``--ek retry_failed=true``). Pull failures are not remembered (a registry may come back).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import time
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ephemeral import errors
from ephemeral.settings import Settings

DOCKERFILE = "Dockerfile"
COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml")
TASK_FILE = "task.toml"
IMAGE_PREFIX = "harbor-"  # a Dockerfile's image: this and its build's digest
MAX_TASK_TOML = 1 << 20
MAX_ERROR_CHARS = 4000  # of a remembered build error
MAX_WORKERS = 16
LOCK_POLL_S = 0.2

Kind = Literal["image", "pull", "dockerfile", "invalid"]
Status = Literal["cached", "pulled", "built", "failed"]


@dataclass(frozen=True)
class Environment:
    """What a sandbox is made from. ``image``: our image's name (``image``) or the canonical
    reference (``pull``); ``dockerfile``/``context`` for a build; ``error`` for ``invalid``."""

    kind: Kind
    source: str  # what named it (a task directory, a recipe file)
    image: str = ""
    dockerfile: Path | None = None
    context: Path | None = None
    error: str = ""

    @property
    def key(self) -> str:
        """Environments with the same key are one (prebuild makes each once)."""
        if self.kind == "dockerfile":
            return f"dockerfile:{self.dockerfile}"
        if self.kind == "invalid":
            return f"invalid:{self.source}"
        return f"{self.kind}:{self.image}"

    @property
    def label(self) -> str:
        if self.kind == "dockerfile":
            return str(self.dockerfile)
        return self.image or "-"


@dataclass
class Outcome:
    env: Environment
    status: Status
    image: str = ""  # what a session names: our image, a Dockerfile's build, a reference
    digest: str = ""  # the build's content digest or the pulled manifest's
    detail: str = ""  # why it failed
    remembered: bool = False  # a failed build's marker answered: nothing was tried
    seconds: float = 0.0
    sources: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "environment": self.env.label,
            "kind": self.env.kind,
            "status": self.status,
            "image": self.image,
            "digest": self.digest,
            "error": self.detail or None,
            "remembered": self.remembered,
            "seconds": round(self.seconds, 3),
            "sources": self.sources or [self.env.source],
        }


def image_name(digest: str) -> str:
    """``harbor-`` and the sha256 of what is built, as far as an image name's 41 characters go
    (136 bits): environments that differ in any input of the build never share a name."""
    return IMAGE_PREFIX + digest[: 41 - len(IMAGE_PREFIX)]


# resolving -------------------------------------------------------------------------------------
def for_harbor(
    settings: Settings,
    environment_dir: Path,
    docker_image: str | None,
    *,
    source: str,
    force_build: bool = False,
) -> Environment:
    """A Harbor task's environment, as Harbor with Docker reads it (module docstring)."""
    dockerfile = environment_dir / DOCKERFILE
    for name in COMPOSE_FILES:
        if (environment_dir / name).exists():
            why = f"{environment_dir / name}: docker-compose tasks (sidecars) are not supported"
            return Environment("invalid", source, error=why)
    has_dockerfile = dockerfile.is_file()
    if docker_image and not (force_build and has_dockerfile):
        ours = _our_image(settings, docker_image)
        if ours is not None:
            return Environment("image", source, image=ours)
        from ephemeral.oci import reference

        try:
            ref = reference.parse(docker_image, "docker_image")
        except errors.InvalidRequest as exc:
            return Environment("invalid", source, error=exc.detail)
        return Environment("pull", source, image=str(ref))
    if not has_dockerfile:
        why = f"{dockerfile} not found and the task sets no docker_image"
        return Environment("invalid", source, error=why)
    return Environment("dockerfile", source, dockerfile=dockerfile, context=environment_dir)


def _our_image(settings: Settings, docker_image: str) -> str | None:
    """Our image for a ``docker_image`` name: a Debian bookworm base is ``default``, an alias
    (``ephemeral images alias``) what it names, one of our images itself; else None."""
    from ephemeral.sandbox.dockerfile import resolve_image

    try:
        return resolve_image(settings, docker_image)
    except errors.EphemeralError:
        return None


def harbor_task(settings: Settings, task_dir: Path, *, force_build: bool = False) -> Environment:
    """The environment of the Harbor task in ``task_dir`` (its ``task.toml``)."""
    source = str(task_dir)
    try:
        with (task_dir / TASK_FILE).open("rb") as f:
            raw = f.read(MAX_TASK_TOML + 1)
        if len(raw) > MAX_TASK_TOML:
            raise ValueError(f"larger than {MAX_TASK_TOML} bytes")
        config = tomllib.loads(raw.decode("utf-8"))
    except (OSError, ValueError) as exc:  # TOMLDecodeError and UnicodeDecodeError are ValueErrors
        return Environment("invalid", source, error=f"{task_dir / TASK_FILE}: {exc}")
    env = config.get("environment")
    docker_image = env.get("docker_image") if isinstance(env, dict) else None
    if docker_image is not None and not isinstance(docker_image, str):
        why = f"{task_dir / TASK_FILE}: environment.docker_image is not a string"
        return Environment("invalid", source, error=why)
    return for_harbor(
        settings, task_dir / "environment", docker_image, source=source, force_build=force_build
    )


def find(settings: Settings, paths: Iterable[Path], *, force_build: bool = False) -> list[Outcome]:
    """Every environment the paths name, each once (its sources listed): a Harbor task
    directory, a directory of tasks (a dataset), a recipe or a suite file. Nothing is made."""
    found: dict[str, Outcome] = {}
    for path in paths:
        for env in _environments(settings, path, force_build):
            seen = found.setdefault(env.key, Outcome(env, "failed"))
            seen.sources.append(env.source)
    return list(found.values())


def _environments(settings: Settings, path: Path, force_build: bool) -> list[Environment]:
    if path.is_dir():
        if (path / TASK_FILE).is_file():
            return [harbor_task(settings, path, force_build=force_build)]
        tasks = sorted(p for p in path.iterdir() if (p / TASK_FILE).is_file())
        if not tasks:
            why = f"{path}: neither a Harbor task ({TASK_FILE}) nor a directory of tasks"
            return [Environment("invalid", str(path), error=why)]
        return [harbor_task(settings, t, force_build=force_build) for t in tasks]
    if path.suffix in (".yaml", ".yml"):
        return _recipe_environments(settings, path)
    why = f"{path}: not a task directory, a dataset directory, a recipe or a suite"
    return [Environment("invalid", str(path), error=why)]


def _recipe_environments(settings: Settings, path: Path) -> list[Environment]:
    from ephemeral.oci.reference import is_reference
    from ephemeral.recipes import recipe as recipes

    try:
        loaded = recipes.load_any(path)
    except errors.EphemeralError as exc:
        return [Environment("invalid", str(path), error=exc.detail)]
    out = []
    for recipe in recipes.iter_recipes(loaded):
        source = recipe.source_file or str(path)
        image = recipe.run_policy.run_image or settings.image
        if is_reference(image):
            from ephemeral.oci import reference

            out.append(Environment("pull", source, image=str(reference.parse(image))))
        else:
            out.append(Environment("image", source, image=image))
    return out


# making ----------------------------------------------------------------------------------------
def _dir(settings: Settings, *parts: str) -> Path:
    d = settings.cache_dir.joinpath("prebuild", *parts)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


@contextlib.asynccontextmanager
async def _locked(path: Path) -> AsyncIterator[None]:
    """An exclusive lock on ``path`` across processes. Polled, not waited for in a thread: a
    trial cancelled while it waits (Harbor's build timeout) leaves no thread holding it."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


def _key_file(settings: Settings, kind: str, key: str, suffix: str) -> Path:
    return _dir(settings, kind) / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}{suffix}"


def failure(settings: Settings, digest: str) -> dict[str, Any] | None:
    """The remembered failure of the build ``digest``, or None."""
    path = _dir(settings, "failed") / f"{digest}.json"
    try:
        with path.open("rb") as f:
            data = json.loads(f.read(MAX_ERROR_CHARS * 8))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("error"), str) else None


def _remember(settings: Settings, digest: str, env: Environment, error: str) -> None:
    before = failure(settings, digest) or {}
    marker = {
        "digest": digest,
        "dockerfile": str(env.dockerfile),
        "error": error[:MAX_ERROR_CHARS],
        "at": time.time(),
        "attempts": int(before.get("attempts", 0)) + 1,
    }
    d = _dir(settings, "failed")
    tmp = d / f".{digest}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(marker, indent=1))
    os.replace(tmp, d / f"{digest}.json")


def _forget(settings: Settings, digest: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (_dir(settings, "failed") / f"{digest}.json").unlink()


async def ensure(settings: Settings, env: Environment, *, retry_failed: bool = False) -> Outcome:
    """Make ``env`` ready (pull, build, or find it made); never raises for the environment's
    own failure: the outcome says ``failed`` and why."""
    t0 = time.monotonic()
    try:
        if env.kind == "invalid":
            out = Outcome(env, "failed", detail=env.error)
        elif env.kind == "image":
            out = await _ensure_ours(settings, env)
        elif env.kind == "pull":
            out = await _ensure_pulled(settings, env)
        else:
            out = await _ensure_built(settings, env, retry_failed)
    except errors.EphemeralError as exc:
        out = Outcome(env, "failed", detail=exc.detail)
    out.seconds = time.monotonic() - t0
    return out


async def _ensure_ours(settings: Settings, env: Environment) -> Outcome:
    from ephemeral.sandbox import images

    if images.built_rootfs(settings, env.image) is not None:
        status: Status = "cached"
    else:
        await images.ensure_image(settings, env.image)
        status = "built"
    built = images.built_image(settings, env.image)
    return Outcome(env, status, image=env.image, digest=built.hash if built else "")


async def _ensure_pulled(settings: Settings, env: Environment) -> Outcome:
    from ephemeral.oci import pull, reference
    from ephemeral.oci.store import LayerStore

    ref = reference.parse(env.image, "docker_image")
    found = LayerStore(settings).resolve(ref)
    if found is not None:
        return Outcome(env, "cached", image=env.image, digest=found.digest)
    async with _locked(_key_file(settings, "locks", env.key, ".lock")):
        found = LayerStore(settings).resolve(ref)  # another pull may have made it meanwhile
        if found is not None:
            return Outcome(env, "cached", image=env.image, digest=found.digest)
        pulled = await pull.pull(settings, env.image, field="docker_image")
    return Outcome(env, "pulled", image=env.image, digest=pulled.digest)


class _Digest(Exception):
    def __init__(self, digest: str) -> None:
        super().__init__(digest)
        self.digest = digest


async def build_digest(settings: Settings, dockerfile: Path, context: Path) -> str:
    """The content digest the builder gives this build (its inputs: Dockerfile, context,
    base), found without building: the builder names its image by it before any step."""
    from ephemeral.sandbox.dockerfile import abuild_dockerfile

    def stop(digest: str) -> str:
        raise _Digest(digest)

    try:
        await abuild_dockerfile(dockerfile, context, name=stop, settings=settings)
    except _Digest as found:
        return found.digest
    raise AssertionError("the builder named no image")  # pragma: no cover


async def _ensure_built(settings: Settings, env: Environment, retry_failed: bool) -> Outcome:
    from ephemeral.sandbox import images
    from ephemeral.sandbox.dockerfile import abuild_dockerfile

    assert env.dockerfile is not None and env.context is not None
    digest = await build_digest(settings, env.dockerfile, env.context)
    name = image_name(digest)
    async with _locked(_dir(settings, "locks") / f"{digest}.lock"):
        built = images.built_image(settings, name)
        if built is not None and built.hash == digest:
            return Outcome(env, "cached", image=name, digest=digest)
        failed = failure(settings, digest)
        if failed is not None and not retry_failed:
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(failed["at"])))
            detail = f"{failed['error']} (this build failed at {when}; not tried again until asked)"
            return Outcome(env, "failed", digest=digest, detail=detail, remembered=True)
        made: list[str] = []

        def named(found: str) -> str:
            made.append(found)
            return image_name(found)

        try:
            built = await abuild_dockerfile(
                env.dockerfile, env.context, name=named, settings=settings
            )
        except errors.EphemeralError as exc:
            _remember(settings, made[-1] if made else digest, env, exc.detail)
            return Outcome(env, "failed", digest=digest, detail=exc.detail)
        if built.hash != made[-1]:  # the name must be of exactly what was built
            why = f"image {built.name} is the build {built.hash[:16]}, not {made[-1][:16]}"
            return Outcome(env, "failed", digest=digest, detail=why)
        _forget(settings, built.hash)
    return Outcome(env, "built", image=built.name, digest=built.hash)


def workers(settings: Settings, asked: int | None = None) -> int:
    """How many environments are made at once: ``asked``, else ``prebuild_workers``, else
    the host's cores; at most :data:`MAX_WORKERS`."""
    n = asked or settings.prebuild_workers or os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, n))


async def ensure_all(
    settings: Settings,
    found: list[Outcome],
    *,
    jobs: int,
    retry_failed: bool = False,
    started: Callable[[Outcome], None] | None = None,
    done: Callable[[Outcome], Awaitable[None] | None] | None = None,
) -> list[Outcome]:
    """Make every environment ready, ``jobs`` at a time; outcomes in ``found``'s order."""
    at_once = asyncio.Semaphore(jobs)

    async def one(item: Outcome) -> Outcome:
        async with at_once:
            if started is not None:
                started(item)
            out = await ensure(settings, item.env, retry_failed=retry_failed)
        out.sources = item.sources
        if done is not None:
            maybe = done(out)
            if maybe is not None:
                await maybe
        return out

    return list(await asyncio.gather(*(one(item) for item in found)))
