"""The image a Harbor trial's sandbox runs, as Harbor with Docker chooses it.

``--ek image=NAME`` for every task; else the task's ``docker_image`` mapped by ``--ek images``;
else what ``ephemeral/recipes/prebuild.py`` resolves (shared with ``ephemeral images
prebuild``, so what prebuild made is what a trial finds): the ``docker_image`` pulled (or one of
ours), else the task's Dockerfile built. Made once per environment across trials and processes;
a failed build is not tried again until asked. Every failure is Harbor's
``SandboxBuildFailedError``: an environment error (retried, never graded), not the agent's 0.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from harbor.environments.base import SandboxBuildFailedError

from ephemeral.harbor.config import HarborConfig
from ephemeral.oci import sandbox_image
from ephemeral.recipes import prebuild
from ephemeral.sandbox import images
from ephemeral.settings import Settings

log = logging.getLogger("ephemeral.harbor")


def has_dockerfile(environment_dir: Path) -> bool:
    return (environment_dir / prebuild.DOCKERFILE).is_file()


async def resolve(
    settings: Settings,
    config: HarborConfig,
    environment_dir: Path,
    docker_image: str | None,
    *,
    force_build: bool,
    trial: str,
) -> images.ImageConfig:
    """The task's image (``trial``: Harbor's session id, for the log)."""
    if config.image:
        return built(settings, config.image, "--ek image")
    mapped = config.images.get(docker_image) if docker_image else None
    if mapped is not None and not (force_build and has_dockerfile(environment_dir)):
        return built(settings, mapped, f"--ek images[{docker_image!r}]")
    env = prebuild.for_harbor(
        settings,
        environment_dir,
        docker_image,
        source=str(environment_dir.parent),
        force_build=force_build,
    )
    t0 = time.monotonic()
    try:
        outcome = await prebuild.ensure(settings, env, retry_failed=config.retry_failed)
    except Exception as exc:  # the host's (a full disk, say): still not the agent's 0
        raise SandboxBuildFailedError(f"ephemeral: {env.label}: {exc}") from exc
    if outcome.status == "failed":
        raise SandboxBuildFailedError(f"ephemeral: {outcome.detail}")
    found = sandbox_image.built_image(settings, outcome.image)
    if found is None:  # collected between the two lines: the next attempt makes it again
        raise SandboxBuildFailedError(f"ephemeral: image {outcome.image!r} is gone")
    log.info(
        "%s: image %s %s in %.1f s", trial, outcome.image, outcome.status, time.monotonic() - t0
    )
    return found


def built(settings: Settings, name: str, where: str) -> images.ImageConfig:
    """The built image ``name`` that ``where`` (an ``--ek`` key) names, or the command that
    builds it."""
    found = sandbox_image.built_image(settings, name)
    if found is None:
        raise SandboxBuildFailedError(
            f"ephemeral: {where}: image {name!r} is not built here "
            f"(ephemeral images build {name}; built: {', '.join(images.available(settings))})"
        )
    return found
