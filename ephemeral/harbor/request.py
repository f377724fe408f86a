"""What a Harbor trial asks of its sandbox session: checked when Harbor makes the environment
(before a sandbox starts), then the session request, its limits and its labels.

Harbor's task (``task.toml``'s ``[environment]``, its network policy) and the job's ``--ek``
settings (``config.py``) meet here; the environment (``environment.py``) passes in what Harbor
holds, so nothing here reads Harbor's environment object.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harbor.environments.base import SandboxBuildFailedError
from harbor.models.task.config import NetworkMode

from ephemeral.harbor import task_image
from ephemeral.harbor.config import HarborConfig
from ephemeral.labels import bounded
from ephemeral.policy import MIN_DISK_MIB
from ephemeral.recipes import prebuild
from ephemeral.sandbox.base import Limits
from ephemeral.sessions.manager import NO_ROOT_ISOLATIONS
from ephemeral.sessions.requests import SessionRequest


def check_task(
    config: HarborConfig,
    environment_dir: Path,
    docker_image: str | None,
    network_policies: list[Any],
) -> None:
    """Refuse a task this environment cannot run as asked: Harbor's ``_validate_definition``,
    called as it makes the environment, so the reason comes before any sandbox or image."""
    if environment_dir.is_symlink():  # its files (or a build context) would be the host's
        raise ValueError(
            f"ephemeral environment: {environment_dir} is a symbolic link (to "
            f"{os.readlink(environment_dir)}): a task's files must be its own, not a host "
            "directory"
        )
    for name in prebuild.COMPOSE_FILES:
        if (environment_dir / name).exists():
            raise ValueError(
                f"ephemeral environment: {environment_dir / name}: docker-compose tasks (sidecar "
                "services) are not supported"
            )
    if not task_image.has_dockerfile(environment_dir) and not docker_image and not config.image:
        raise FileNotFoundError(
            f"ephemeral environment: {environment_dir} has no {prebuild.DOCKERFILE}, the task "
            "sets no docker_image, and no --ek image=NAME was given"
        )
    if config.isolation in NO_ROOT_ISOLATIONS:
        raise ValueError(
            f"ephemeral environment: --ek isolation={config.isolation}: Harbor runs "
            "its own commands as root, which that level refuses (there root is host root)"
        )
    for policy in network_policies:
        check_network(config, policy)


def check_network(config: HarborConfig, policy: Any) -> None:
    mode = policy.network_mode
    if mode != NetworkMode.NO_NETWORK and not config.web:
        raise ValueError(
            f"ephemeral environment: the task asks for network_mode={mode.value!r}, and web "
            "is off: sandboxes have no network. Pass --ek web=true to let it out through "
            "the broker (docs/broker.md), or set network_mode = 'no-network' in task.toml"
        )


def storage_disk_mib(storage_mb: int, max_storage_mb: int) -> int:
    """A task's ``storage_mb`` as the session's ``disk_mib``: the job's ``max_storage_mb`` at
    most (the host's ``disk_max_mib`` is checked at admission), the request's least at least."""
    return max(MIN_DISK_MIB, min(storage_mb, max_storage_mb))


def limits(
    config: HarborConfig, *, cpus: float | None, memory_mb: float | None, storage_mb: int | None
) -> Limits:
    """The sandbox's cgroup and disk limits: the task's (Harbor's effective values, overrides
    applied), else the job's ``--ek`` defaults."""
    storage = storage_mb or config.storage_mb
    return Limits(
        cpus=float(cpus) if cpus else config.cpus,
        memory_mib=int(memory_mb) if memory_mb else config.memory_mb,
        pids=config.pids,
        disk_mib=storage_disk_mib(int(storage), config.max_storage_mb),
    )


def session_request(
    config: HarborConfig, network_policy: Any, image: str, disk_mib: int
) -> SessionRequest:
    """The session's request; a value it refuses is Harbor's environment error."""
    web: bool | dict[str, list[str]] = False
    if network_policy.network_mode == NetworkMode.PUBLIC:
        web = True
    elif network_policy.network_mode == NetworkMode.ALLOWLIST:
        allowed = network_policy.allowed_hosts
        web = {"allow": list(allowed)} if allowed else False
    fields: dict[str, Any] = {
        "isolation": config.isolation,
        "web": web,
        "timeout_seconds": config.timeout_seconds,
        "max_cost_micros": config.max_cost_micros,
        "zero_data_retention": config.zero_data_retention,
        "image": image,
        # the task's storage_mb: the host's disk_max_mib refuses more (Harbor's
        # environment error), and above disk_tmpfs_max_mib the root is on disk
        "disk_mib": disk_mib,
    }
    try:
        return SessionRequest.model_validate(fields)
    except ValueError as exc:  # pydantic's message names the field
        raise SandboxBuildFailedError(f"ephemeral: bad session settings: {exc}") from exc


def labels(session_id: str, task: str, trial_paths: Any) -> dict[str, str]:
    """Which job, task and trial this session's money went to (``costs --by
    label:harbor_job``): Harbor puts a trial's directory in its job's."""
    found = {"harbor_session": session_id, "harbor_task": task}
    trial_dir = getattr(trial_paths, "trial_dir", None)
    if isinstance(trial_dir, Path):
        found |= {"harbor_trial": trial_dir.name, "harbor_job": trial_dir.parent.name}
    return {k: bounded(v) for k, v in found.items()}
