"""``@sandboxenv(name="ephemeral")``: one Ephemeral sandbox session per Inspect sample.

Lifecycle: ``task_init`` starts the backend (in process: a runtime whose warm pool fills while
the task starts; with ``EPHEMERAL_URL``: a client of that server), ``sample_init`` creates a
session (a warm sandbox: milliseconds), ``sample_cleanup`` ends it (sandbox destroyed, money
settled, recorded), ``task_cleanup`` ends whatever is left and stops the backend. An eval that
is interrupted still runs the cleanups; one that is killed leaves sessions that end at their
time limit (server) or are reaped and settled at the next start (in process).

Errors as Inspect expects them: FileNotFoundError, PermissionError, IsADirectoryError,
OutputLimitExceededError (a read over Inspect's limit, or output past the exec cap),
TimeoutError (a command killed at its timeout), PermissionError (exit 126: not executable),
SandboxUserUnsupportedError (a user this isolation refuses), SandboxUnavailableError (the
session has ended or its sandbox failed).
"""

from __future__ import annotations

import asyncio
import errno
import logging
from typing import Any, Literal, overload

from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    SandboxUnavailableError,
    SandboxUserUnsupportedError,
    sandboxenv,
)
from pydantic import BaseModel

from ephemeral import errors
from ephemeral.inspect_provider.backends import Backend, LocalBackend
from ephemeral.inspect_provider.config import EphemeralSandboxConfig, load_config
from ephemeral.labels import bounded
from ephemeral.sessions.requests import MAX_EXEC_OUTPUT, MAX_FILE_BYTES, ExecRequest
from ephemeral.settings import Settings

log = logging.getLogger("ephemeral.inspect")


class _Backends:
    """One backend per event loop (Inspect runs a task on one loop; tests may use several),
    counted by task_init/task_cleanup."""

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, tuple[Backend, set[str]]] = {}
        self._users: dict[asyncio.AbstractEventLoop, int] = {}
        self._locks: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}

    async def get(self, config: EphemeralSandboxConfig) -> tuple[Backend, set[str]]:
        loop = asyncio.get_running_loop()
        found = self._by_loop.get(loop)
        if found is not None:
            return found
        async with self._locks.setdefault(loop, asyncio.Lock()):
            found = self._by_loop.get(loop)
            if found is None:
                found = (await _start_backend(config), set())
                self._by_loop[loop] = found
            return found

    def hold(self) -> None:
        loop = asyncio.get_running_loop()
        self._users[loop] = self._users.get(loop, 0) + 1

    async def release(self) -> None:
        loop = asyncio.get_running_loop()
        self._users[loop] = self._users.get(loop, 0) - 1
        if self._users[loop] > 0:
            return
        self._users.pop(loop, None)
        self._locks.pop(loop, None)
        found = self._by_loop.pop(loop, None)
        if found is None:
            return
        backend, open_sessions = found
        for session_id in list(open_sessions):
            try:
                await backend.end(session_id)
            except errors.EphemeralError as exc:
                log.warning("task cleanup: could not end sandbox %s: %s", session_id, exc)
        await backend.close()


async def _start_backend(config: EphemeralSandboxConfig) -> Backend:
    settings = Settings.load()
    if settings.url:
        from ephemeral.inspect_provider.remote import RemoteBackend

        return RemoteBackend(settings)
    return await LocalBackend.start(settings, config.isolation, config.pool_size)


BACKENDS = _Backends()


@sandboxenv(name="ephemeral")
class EphemeralSandboxEnvironment(SandboxEnvironment):
    """An Ephemeral sandbox session (gVisor, namespaces or a microVM) as an Inspect sandbox."""

    def __init__(self, backend: Backend, session_id: str, open_sessions: set[str]) -> None:
        super().__init__()
        self.backend = backend
        self.session_id = session_id
        self._open = open_sessions

    # lifecycle ------------------------------------------------------------------------------
    @classmethod
    def config_files(cls) -> list[str]:
        return ["ephemeral.yaml", "ephemeral.yml"]

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return load_config(config)

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        cfg = _config(config)
        BACKENDS.hold()
        await BACKENDS.get(cfg)  # the warm pool starts filling now

    @classmethod
    async def sample_init(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        metadata: dict[str, str],
    ) -> dict[str, SandboxEnvironment]:
        cfg = _config(config)
        try:
            request = cfg.session_request()
        except errors.EphemeralError as exc:
            raise ValueError(f"ephemeral sandbox config: {exc.detail}") from exc
        request = request.model_copy(update={"labels": {**request.labels, **_labels(task_name)}})
        backend, open_sessions = await BACKENDS.get(cfg)
        try:
            session_id = await backend.create(request)
        except errors.EphemeralError as exc:
            raise SandboxUnavailableError(f"ephemeral: {exc.detail}") from exc
        open_sessions.add(session_id)
        return {"default": cls(backend, session_id, open_sessions)}

    @classmethod
    async def sample_cleanup(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        environments: dict[str, SandboxEnvironment],
        interrupted: bool,
    ) -> None:
        for env in environments.values():
            sandbox = env.as_type(EphemeralSandboxEnvironment)
            await asyncio.shield(sandbox._end())

    @classmethod
    async def task_cleanup(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None, cleanup: bool
    ) -> None:
        await BACKENDS.release()

    async def _end(self) -> None:
        try:
            await self.backend.end(self.session_id)
        except errors.EphemeralError as exc:
            log.warning("sample cleanup: could not end sandbox %s: %s", self.session_id, exc)
        finally:
            self._open.discard(self.session_id)

    # use ------------------------------------------------------------------------------------
    async def exec(
        self,
        cmd: list[str],
        input: str | bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        timeout: int | None = None,
        timeout_retry: bool = True,
        concurrency: bool = True,
    ) -> ExecResult[str]:
        import base64

        data = input.encode() if isinstance(input, str) else (input or b"")
        cap = min(SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE, MAX_EXEC_OUTPUT)
        try:
            request = ExecRequest(
                command=list(cmd),
                stdin_base64=base64.b64encode(data).decode(),
                env=env or {},
                cwd=cwd,
                user=user,
                timeout_seconds=float(timeout) if timeout is not None else None,
                max_output_bytes=cap,
            )
        except ValueError as exc:
            raise ValueError(f"ephemeral exec: {exc}") from exc
        try:
            res = await self.backend.exec(self.session_id, request)
        except errors.InvalidRequest as exc:
            if exc.errors and exc.errors[0].get("field") == "user":
                raise SandboxUserUnsupportedError(exc.detail) from exc
            raise ValueError(exc.detail) from exc
        except (errors.Conflict, errors.SandboxError, errors.NotFound) as exc:
            raise SandboxUnavailableError(f"ephemeral: {exc.detail}") from exc
        if res.timed_out:
            raise TimeoutError(f"command timed out after {timeout} s: {cmd[0]}")
        if res.exit_code == 126 and "Permission denied" in res.stderr:
            raise PermissionError(errno.EACCES, res.stderr.strip(), cmd[0])
        if res.truncated:
            raise OutputLimitExceededError(_size(cap), truncated_output=res.stdout)
        return ExecResult(
            success=res.exit_code == 0,
            returncode=res.exit_code,
            stdout=res.stdout,
            stderr=res.stderr,
        )

    async def write_file(self, file: str, contents: str | bytes) -> None:
        data = contents.encode("utf-8") if isinstance(contents, str) else contents
        try:
            await self.backend.write(self.session_id, file, data)
        except errors.EphemeralError as exc:
            raise _file_error(exc, file) from exc

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        limit = SandboxEnvironmentLimits.MAX_READ_FILE_SIZE
        try:
            data = await self.backend.read(self.session_id, file, min(limit, MAX_FILE_BYTES))
        except errors.PayloadTooLarge as exc:
            raise OutputLimitExceededError(
                SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR
                if limit <= MAX_FILE_BYTES
                else _size(MAX_FILE_BYTES),
                truncated_output=None,
            ) from exc
        except errors.EphemeralError as exc:
            raise _file_error(exc, file) from exc
        return data.decode("utf-8") if text else data


def _labels(task_name: str) -> dict[str, str]:
    """Which task and sample this session's money went to (``costs --by label:inspect_task``).
    Inspect enters the sample's context before its sandboxes, so the sample is known here."""
    labels = {"inspect_task": bounded(task_name)}
    try:
        from inspect_ai.log._samples import sample_active

        active = sample_active()
    except ImportError:  # a private module of Inspect's: without it, the task alone
        active = None
    sample = getattr(active, "sample", None)
    if sample is not None and getattr(sample, "id", None) is not None:
        labels["inspect_sample"] = bounded(sample.id)
    epoch = getattr(active, "epoch", None)
    if isinstance(epoch, int):
        labels["inspect_epoch"] = str(epoch)
    return labels


def _config(config: SandboxEnvironmentConfigType | None) -> EphemeralSandboxConfig:
    try:
        return load_config(config)
    except errors.EphemeralError as exc:
        raise ValueError(f"ephemeral sandbox config: {exc.detail}") from exc


def _file_error(exc: errors.EphemeralError, file: str) -> Exception:
    if isinstance(exc, errors.FileNotFound):
        return FileNotFoundError(errno.ENOENT, "No such file or directory", file)
    if isinstance(exc, errors.FilePermissionDenied):
        return PermissionError(errno.EACCES, "Permission denied", file)
    if isinstance(exc, errors.IsADirectory):
        return IsADirectoryError(errno.EISDIR, "Is a directory", file)
    if isinstance(exc, errors.PayloadTooLarge):
        return OutputLimitExceededError(_size(MAX_FILE_BYTES), truncated_output=None)
    if isinstance(exc, errors.Conflict | errors.SandboxError | errors.NotFound):
        return SandboxUnavailableError(f"ephemeral: {exc.detail}")
    return exc


def _size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"
