"""``ephemeral.harbor:EphemeralEnvironment``: Harbor's ``BaseEnvironment`` over sandbox sessions.

Each trial is one sandbox session (docs/integrations.md): admitted with its policy and money
cap, limited in time, every command an event, settled and recorded at ``stop``. The image is
the task's Dockerfile built into one of our images (cached by content), a ``docker_image``
mapped to a built image (``--ek images=...``), or ``--ek image=NAME``.

The class is Harbor's interface: ``exec`` and the file transfers as Harbor's Docker environment
does them. What it hands on is elsewhere in this package: the task checked and the session's
request, limits and labels (``request.py``), the image (``task_image.py``), the session's guest
calls that always end (``session.py``), the scripts behind ``exec`` and their requests
(``commands.py``), the ``--ek`` settings (``config.py``), the shared runtime (``backend.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import io
import logging
import os
import secrets
import shlex
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harbor.environments.base import (
    BaseEnvironment,
    ExecResult,
    SandboxBuildFailedError,
    ServiceOperationsUnsupportedError,
)
from harbor.environments.capabilities import (
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.models.trial.config import ResourceMode
from harbor.models.trial.paths import EnvironmentPaths
from harbor.utils.path_filter import filter_paths_by_patterns

from ephemeral import errors
from ephemeral.harbor import backend, commands, request, task_image
from ephemeral.harbor.config import HarborConfig, load_config
from ephemeral.harbor.session import Session, not_started, runtime_request_error
from ephemeral.lifecycle import RunStatus
from ephemeral.sandbox import hostread, hostwrite, images
from ephemeral.sandbox.base import Limits
from ephemeral.sessions.requests import MAX_FILE_BYTES

log = logging.getLogger("ephemeral.harbor")

SKIPS_LOGGED = 20  # entries of a download not written (links, devices) named in the log
CLEANUP_BATCH = 16  # finished commands whose files one rm removes (in the next starter)
# Harbor's verifier starts by removing the reward files, as root (``Verifier._remove_reward_files``,
# built from the same paths): the end of the agent phase. Harbor tells an environment nothing
# else between the phases; tests/harbor runs the real Harbor, so a change there fails them.
_REWARDS = EnvironmentPaths()
VERIFIER_START = "rm -f -- " + " ".join(
    shlex.quote(str(p)) for p in (_REWARDS.reward_text_path, _REWARDS.reward_json_path)
)


class EphemeralEnvironment(BaseEnvironment):
    """One Ephemeral sandbox session per trial (gVisor, namespaces or a microVM)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        own = {k: kwargs.pop(k) for k in list(kwargs) if k in HarborConfig.model_fields}
        known = set(inspect.signature(BaseEnvironment.__init__).parameters)
        unknown = sorted(set(kwargs) - known - {"suppress_override_warnings"})
        if unknown:
            raise ValueError(
                f"ephemeral environment: unknown --ek {', '.join(unknown)} "
                f"(known: {', '.join(HarborConfig.model_fields)})"
            )
        self.config = load_config(own)
        self._session: Session | None = None
        self._runtime: Any = None
        self._org: str | None = None
        self._image: images.ImageConfig | None = None
        self._holding = False
        self._finished: list[str] = []  # exec ids whose output files are still in /tmp
        super().__init__(*args, **kwargs)

    # what Harbor asks first -----------------------------------------------------------------
    @staticmethod
    def type() -> str:
        return "ephemeral"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # No network device at all; egress only through the broker, by host name (web: an
        # allow list). Wildcards are not declared: the broker's "*.d" never matches d itself.
        return EnvironmentCapabilities(
            disable_internet=True, network_allowlist=True, network_allowlist_hostnames=True
        )

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        # cgroup limits (CPU quota, memory.max) on the sandbox's host cgroup
        return EnvironmentResourceCapabilities(
            cpu_limit=True, memory_limit=True, fractional_cpus=True
        )

    def _validate_definition(self) -> None:
        request.check_task(
            self.config,
            Path(self.environment_dir),
            self.task_env_config.docker_image,
            [self.network_policy, *self._phase_network_policies],
        )

    # lifecycle ------------------------------------------------------------------------------
    async def start(self, force_build: bool) -> None:
        runtime, org = await backend.acquire()
        self._runtime, self._org, self._holding = runtime, org, True
        image = await task_image.resolve(
            runtime.settings,
            self.config,
            Path(self.environment_dir),
            self.task_env_config.docker_image,
            force_build=force_build,
            trial=self.session_id,
        )
        self._image = image
        limits = self._limits()
        try:
            row, _ = await runtime.sessions.create(
                org,
                request.session_request(
                    self.config, self.network_policy, image.name, limits.disk_mib
                ),
                labels=request.labels(self.session_id, self.environment_name, self.trial_paths),
                limits=limits,
            )
        except errors.EphemeralError as exc:
            raise SandboxBuildFailedError(
                f"ephemeral: the sandbox was refused: {exc.detail}"
            ) from exc
        self._session = Session(runtime, org, row.id, self.session_id)
        if row.status != RunStatus.RUNNING:
            self._session = None
            raise SandboxBuildFailedError(
                f"ephemeral: the sandbox did not start ({row.termination_reason}: "
                f"{row.termination_detail})"
            )
        log.info("%s: sandbox session %s (image %s)", self.session_id, row.id, image.name)
        if self.task_env_config.workdir:  # as Docker's WORKDIR: made when missing
            made = await self._live().call(
                ["mkdir", "-p", "--", self.task_env_config.workdir], user="root"
            )
            _check(made, f"mkdir {self.task_env_config.workdir}")
        result = await self.ensure_dirs(self._mount_targets(writable_only=True))
        if result is not None and result.return_code != 0:
            raise SandboxBuildFailedError(
                f"ephemeral: cannot create Harbor's directories: {result.stderr or result.stdout}"
            )
        await self._upload_environment_dir_after_start()

    async def stop(self, delete: bool) -> None:
        # Always destroyed: a sandbox never outlives its session (--no-delete has no effect).
        session, self._session = self._session, None
        try:
            if session is not None and self._runtime is not None:
                session.closed = True  # a call still in flight (a shielded kill) ends here
                await asyncio.shield(self._runtime.sessions.end(session.id, self._org))
        finally:
            if self._holding:
                self._holding = False
                backend.release()

    def _limits(self) -> Limits:
        # Harbor's effective values: the task's, with the job's --override-* applied
        return request.limits(
            self.config,
            cpus=self._resource_limit_value("cpu", auto_mode=ResourceMode.LIMIT),
            memory_mb=self._resource_limit_value("memory", auto_mode=ResourceMode.LIMIT),
            storage_mb=self._effective_storage_mb,
        )

    # commands -------------------------------------------------------------------------------
    def _live(self) -> Session:
        if self._session is None:
            raise not_started()
        return self._session

    def _user(self, user: str | int | None) -> str:
        resolved = self._resolve_user(user)
        if resolved is None:
            default = getattr(self._image, "user", None)
            if isinstance(default, str | int) and str(default):
                return str(default)
            return "root"  # Docker's default user
        return str(resolved)

    def _cwd(self, cwd: str | None) -> str:
        if cwd:
            return cwd
        if self.task_env_config.workdir:
            return self.task_env_config.workdir
        # a Dockerfile's WORKDIR (absolute); an image.yaml's workdir is the worker's scratch
        image_cwd = getattr(self._image, "cwd", None)
        return image_cwd if isinstance(image_cwd, str) and image_cwd else "/"

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        as_user = self._user(user)
        session = self._live()
        if command == VERIFIER_START:
            await session.end_phase()
        exec_id = secrets.token_hex(16)
        deadline = None if timeout_sec is None else time.monotonic() + timeout_sec
        cleanup: list[str] = []
        if len(self._finished) >= CLEANUP_BATCH:
            cleanup, self._finished = self._finished, []
        argv, stdin = commands.start_argv(
            exec_id, command, slice_s=commands.slice_until(deadline), cleanup=cleanup
        )
        starter = commands.exec_request(
            argv, user=as_user, cwd=self._cwd(cwd), env=self._merge_env(env), stdin=stdin
        )
        try:
            started, cancelled = await session.through(starter)
        except ValueError as exc:  # a missing cwd, a uid outside the sandbox: as docker exec
            return ExecResult(stdout="", stderr=f"{exc}\n", return_code=126)
        if cancelled:  # while it started: it dies now
            if started.exit_code == 0:
                sid, _ = commands.parse_started(started.stdout)
                with contextlib.suppress(Exception):
                    await session.kill(exec_id, sid)
            raise asyncio.CancelledError()
        if started.exit_code != 0:
            # the command never ran: an unknown user, say, as Docker reports it
            return ExecResult(
                stdout=started.stdout, stderr=started.stderr, return_code=started.exit_code
            )
        sid, waited = commands.parse_started(started.stdout)
        try:
            code = commands.parse_wait(waited)
            while code is None:
                if deadline is not None and time.monotonic() >= deadline:
                    raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
                res = await session.call(
                    commands.wait_argv(exec_id, commands.slice_until(deadline)), user="root"
                )
                code = commands.parse_wait(res.stdout)
            stdout, stderr = await session.outputs(exec_id)
        except BaseException:
            # cancelled (a phase timeout), timed out or failed: the command dies now
            with contextlib.suppress(Exception):
                await asyncio.shield(session.kill(exec_id, sid))
            raise
        self._finished.append(exec_id)
        return ExecResult(stdout=stdout, stderr=stderr, return_code=code)

    # files ----------------------------------------------------------------------------------
    # Uploads read host files without following a link (ephemeral/sandbox/hostread.py);
    # downloads come back as a tar the host parses itself and writes under the target without
    # following a link, links and devices not written (ephemeral/sandbox/hostwrite.py).
    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        source = Path(source_path)
        data = await asyncio.to_thread(
            hostread.read_file,
            source,
            root=_source_root(self.environment_dir, source),
            max_bytes=MAX_FILE_BYTES,
        )
        t = shlex.quote(target_path)
        res = await self._live().call(
            ["bash", "-c", f'mkdir -p -- "$(dirname -- {t})" && cat > {t}'],
            user="root",
            stdin=data,
        )
        _check(res, f"upload {source_path} to {target_path}")

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        source = Path(source_dir)
        data = await asyncio.to_thread(
            hostread.pack, source, root=_source_root(self.environment_dir, source)
        )
        t = shlex.quote(target_dir)
        res = await self._live().call(
            ["bash", "-c", f"mkdir -p -- {t} && tar xzf - -C {t} --no-same-owner"],
            user="root",
            stdin=data,
        )
        _check(res, f"upload {source_dir} to {target_dir}")

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self._live().fetch(f"cat -- {shlex.quote(source_path)}", source_path)
        await asyncio.to_thread(_write_file, Path(target_path), data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await self._download_tree(source_dir, target_dir, ".")

    async def _download_dir_with_exclusions_impl(
        self,
        *,
        source_dir: str,
        target_dir: Path | str,
        exclude: list[str],
        service: str | None,
    ) -> None:
        # Harbor's own extracts with tarfile's filter on the host: never used here
        if not self.is_main_service(service):
            raise ServiceOperationsUnsupportedError(self._service_unsupported_message(service))
        flags = " ".join(f"--exclude={shlex.quote(pattern)}" for pattern in exclude)
        await self._download_tree(source_dir, target_dir, f"{flags} .")

    async def download_dir_filtered(
        self,
        *,
        source_dir: str,
        target_dir: Path | str,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        protect: Sequence[str] | None = None,
    ) -> None:
        """Harbor's filtered download (exclude wins; ``protect`` always), through our own."""
        await asyncio.to_thread(Path(target_dir).mkdir, parents=True, exist_ok=True)
        listed = await self._live().fetch(
            f"cd -- {shlex.quote(source_dir)} && find . -type f -print0", source_dir
        )
        paths = [
            p.removeprefix("./")
            for p in listed.decode("utf-8", "surrogateescape").split("\0")
            if p and p != "."
        ]
        selected = filter_paths_by_patterns(paths, include=include, exclude=exclude)
        if protect:
            missing = set(protect) - set(selected)
            selected += [path for path in paths if path in missing]
        if not selected:
            self.logger.warning(
                f"No files in {source_dir!r} matched include={include} exclude={exclude}; "
                "downloading nothing"
            )
            return
        names = "".join(f"./{p}\0" for p in selected).encode("utf-8", "surrogateescape")
        await self._download_tree(
            source_dir, target_dir, "--null --verbatim-files-from -T -", stdin=names
        )

    async def _download_tree(
        self, source_dir: str, target_dir: Path | str, members: str, stdin: bytes = b""
    ) -> None:
        data = await self._live().fetch(
            f"tar czf - --hard-dereference -C {shlex.quote(source_dir)} {members}",
            source_dir,
            stdin=stdin,
        )
        try:
            report = await asyncio.to_thread(_unpack, data, Path(target_dir))
        except errors.EphemeralError as exc:
            raise RuntimeError(f"ephemeral: download of {source_dir}: {exc.detail}") from exc
        for path, why in report.skipped[:SKIPS_LOGGED]:
            self.logger.warning(f"download of {source_dir}: {path}: {why}")
        if len(report.skipped) > SKIPS_LOGGED:
            left = len(report.skipped) - SKIPS_LOGGED
            self.logger.warning(f"download of {source_dir}: {left} more entries not written")


def _check(res: Any, what: str) -> None:
    if res.exit_code != 0:
        said = (res.stderr or res.stdout)[:500]
        raise runtime_request_error("upload", f"ephemeral: {what}: exit {res.exit_code}: {said}")


def _source_root(environment_dir: Path | str, source: Path | str) -> Path | None:
    """The task's directory when ``source`` lies in it: walked from there, so a link on the
    way (``environment/`` itself, say) is refused. Elsewhere (the agent's own scripts, the
    trial's logs, Harbor's staged copy of a filtered ``tests/``): opened as given, but not
    through a link at its last component nor at any member."""
    task = Path(os.path.abspath(environment_dir)).parent
    return task if Path(os.path.abspath(source)).is_relative_to(task) else None


def _write_file(target: Path, data: bytes) -> None:
    """``data`` as the file ``target`` (replaced, never written through a link there)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        hostwrite.TreeWriter(fd).file(target.name, [data])
    finally:
        os.close(fd)


def _unpack(data: bytes, target: Path) -> hostwrite.Report:
    """The sandbox's tar written under ``target`` by the host itself: links, devices and FIFOs
    are not written (reported), nothing is written through a link or outside ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return hostwrite.write_tar(io.BytesIO(data), hostwrite.TreeWriter(fd, links="skip"))
    finally:
        os.close(fd)
