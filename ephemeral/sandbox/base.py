"""The sandbox seam: what every driver offers and what callers may rely on.

Every driver's sandbox implements :class:`Sandbox` by subclassing
``ephemeral.sandbox.lifecycle.SandboxBase`` (adopt, expiry, destroy-once, ``async with``).
"""

from __future__ import annotations

from types import TracebackType
from typing import Protocol, Self, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

# Strongest first. microvm-tcg is deliberately absent: emulation is not a security boundary.
STRENGTH_ORDER: tuple[str, ...] = ("microvm-kvm", "gvisor", "namespaces")
ALL_ISOLATIONS: tuple[str, ...] = ("microvm-kvm", "microvm-tcg", "gvisor", "namespaces")

# What the guest agent (the sandbox's root) keeps, on every level: demote commands to the
# worker (SETUID, SETGID), kill them (KILL), and put/get files the worker owns or made
# unreadable (DAC_OVERRIDE, CHOWN, FOWNER). Commands keep none.
AGENT_CAPS = [
    "CAP_SETUID",
    "CAP_SETGID",
    "CAP_KILL",
    "CAP_DAC_OVERRIDE",
    "CAP_CHOWN",
    "CAP_FOWNER",
]


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    cpus: float = Field(default=1.0, gt=0, le=64)
    memory_mib: int = Field(default=512, ge=32, le=1 << 20)
    pids: int = Field(default=256, ge=8, le=1 << 16)
    disk_mib: int = Field(default=256, ge=1, le=1 << 20)
    lifetime_seconds: float = Field(default=600, gt=0)


class ExecResult(BaseModel):
    exit_code: int
    stdout: str
    stderr: str
    duration_ms: int
    truncated: bool
    timed_out: bool


@runtime_checkable
class Sandbox(Protocol):
    id: str
    isolation: str
    image: str
    runtime: str  # the runtime's version line, e.g. "runsc version 0.0~20221219.0"
    boot_ms: int
    workdir: str

    @property
    def alive(self) -> bool:
        """False once destroyed (or expired), or when its runtime died."""
        ...

    async def adopt(self, owner: str, lifetime_seconds: float | None = None) -> None:
        """``owner`` adopts a warm sandbox: re-own its handle and restart its lifetime (the
        owner's ``lifetime_seconds`` when given, else the pool's)."""
        ...

    async def exec(
        self,
        command: str | list[str],
        *,
        stdin: bytes = b"",
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float = 30.0,
        max_output: int = 64 * 1024,
        user: str | None = None,
        stdin_path: str | None = None,
    ) -> ExecResult:
        """Run a shell string (``sh -c``) or an argv as ``worker`` (or ``user``, a user of the
        image; who may ask for which is the caller's decision); never raises for a non-zero
        exit. ``stdin_path`` reads stdin from a file in the sandbox. Raises SandboxError if the
        sandbox or its agent fails or lies."""
        ...

    async def put_file(
        self, path: str, data: bytes, mode: int = 0o644, *, user: str | None = None
    ) -> None:
        """Write a file (any size; without ``user`` as root, owned by the worker; with it, as
        that user: FilePermissionDenied/IsADirectory when it may not)."""
        ...

    async def get_file(
        self, path: str, max_bytes: int = 1 << 20, *, user: str | None = None
    ) -> bytes:
        """Read a file: FileNotFound, FilePermissionDenied (as ``user``), IsADirectory,
        PayloadTooLarge past ``max_bytes``."""
        ...

    async def destroy(self) -> None:
        """Idempotent; afterwards no process, mount, cgroup or file of the sandbox remains."""
        ...

    async def __aenter__(self) -> Self:
        """``async with await driver.create(...) as sbx:`` destroys the sandbox on exit."""
        ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


class SandboxDriver(Protocol):
    isolation: str

    async def probe(self) -> str | None:
        """None if this driver really starts a sandbox here, else the reason it cannot."""
        ...

    async def create(self, *, owner: str, limits: Limits) -> Sandbox: ...


class Handle(BaseModel):
    """What is persisted (``<sandboxes_dir>/<id>.json``) before a sandbox starts, so that a
    crashed host process leaves enough for the reaper to destroy it."""

    model_config = ConfigDict(extra="allow")
    id: str
    driver: str
    owner: str
    host_pid: int
    host_start_time: int | None = None
    created_at: float
    pids: list[int] = []
    pgid: int | None = None
    cgroups: list[str] = []
    runsc_root: str | None = None
    container_id: str | None = None
    paths: list[str] = []  # host directories to delete (bundles, state)
