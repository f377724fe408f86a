"""A sandbox that is one host process tree (bwrap, runsc) with the guest agent on its stdio.

The drivers decide the argv; this module owns the lifecycle every such sandbox shares:
persist the handle, make the cgroups, spawn the runtime inside them (it joins before exec, so
nothing escapes), handshake with the agent, and tear down. Adoption, the wall-clock lifetime and
destroy-once are ``lifecycle.SandboxBase``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shlex
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ephemeral import errors, ids
from ephemeral.sandbox import (
    agent_runtime,
    cgroups,
    handles,
    images,
    sidechannel,
    spawn,
    writable_root,
)
from ephemeral.sandbox.base import Handle, Limits, Sandbox
from ephemeral.sandbox.cgroups import CgroupSet
from ephemeral.sandbox.guest import GuestBacked, GuestClient
from ephemeral.settings import Settings

STDERR_KEEP = 64 * 1024  # the runtime's own log: kept for diagnostics, never unbounded
# From the spawn to the agent's hello. It only bounds a runtime that hangs (one that fails says
# so at once: the channel closes). 20 s killed boots that were progressing: 100 runsc starts at
# once under load 130 here had 3 still importing the agent's modules at 20 s (runsc's log).
HELLO_TIMEOUT = 60.0


class ProcessSandbox(GuestBacked):
    def __init__(
        self,
        *,
        sandbox_id: str,
        isolation: str,
        image: str,
        handle: Handle,
        handle_file: Path,
        cgroups: CgroupSet | None,
        limits: Limits,
        cleanup: Callable[[], None] | None = None,
        runtime: str | None = None,
    ) -> None:
        # runtime unset: the binary on PATH for this level, read at start
        super().__init__(
            sandbox_id=sandbox_id,
            isolation=isolation,
            image=image,
            runtime=runtime or "",
            owner=handle.owner,
            limits=limits,
            handle=handle,
            handle_file=handle_file,
        )
        self._handle: Handle = handle
        self._handle_file: Path = handle_file
        self._cgroups = cgroups
        self._cleanup = cleanup
        self._proc: spawn.Child | None = None
        self._stderr = bytearray()
        self._stderr_task: asyncio.Task[None] | None = None
        self._created = time.monotonic()

    # ---- lifecycle

    async def _start(
        self, argv: Sequence[str], *, pass_fds: Sequence[int] = (), oom_protected: bool = False
    ) -> None:
        """Start the runtime. ``oom_protected``: where this host's root holds
        CAP_SYS_RESOURCE, it and the guest agent are never the memory cgroup's OOM victims
        (oom_score_adj -1000 through the legacy ``oom_adj``, which leaves the floor a process
        may lower itself to at 0; the agent puts each command at 1000). Best effort: without
        the capability (this project's test host) the agent's 0 against its commands' 1000 is
        what protects it."""
        t0 = time.monotonic()
        if not self.runtime:
            from ephemeral.sandbox.probe import runtime_version

            self.runtime = await asyncio.to_thread(runtime_version, self.isolation)
        join = ""
        if self._cgroups is not None:
            join = " && ".join(f"echo $$ > {shlex.quote(f)}" for f in self._cgroups.procs_files)
            join += " && "
        protect = "{ echo -17 > /proc/$$/oom_adj; } 2>/dev/null; " if oom_protected else ""
        script = join + protect + 'exec "$@"'
        # spawn, not the loop's subprocess_exec: only the stdio and pass_fds may reach the
        # runtime, whatever the loop (spawn.py says what uvloop leaked into runsc's boots)
        self._proc = await spawn.spawn(
            ["/bin/sh", "-c", script, "sh", *argv],
            pass_fds=pass_fds,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
        )
        self._handle.pgid = self._proc.pid
        self._handle.pids = [self._proc.pid]
        handles.write(self._handle_file.parent, self._handle)
        _widen_pipes(self._proc.pipe_fds())
        self._stderr_task = asyncio.create_task(self._drain_stderr())
        self._client = GuestClient(self._proc.stdout, self._proc.stdin, label=self.id)
        try:
            hello = await self._client.handshake(HELLO_TIMEOUT)
        except errors.SandboxError as exc:
            await asyncio.sleep(0.05)  # let the runtime's last words arrive
            raise errors.SandboxError(
                f"{self.isolation} sandbox did not start: {exc.detail}; runtime said: "
                f"{self.log_tail(2000) or '(nothing)'}"
            ) from exc
        self.workdir = hello.workdir
        self.boot_ms = int((time.monotonic() - t0) * 1000)
        self._start_lifetime()

    async def _drain_stderr(self) -> None:
        assert self._proc is not None
        # rate-limited: a guest flooding this pipe blocks on it instead of costing host CPU
        await sidechannel.drain(self._proc.stderr, self._stderr, keep=STDERR_KEEP)

    def _running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    def log_tail(self, n: int = STDERR_KEEP) -> str:
        return self._stderr[-n:].decode("utf-8", errors="replace").strip()

    @property
    def host_pids(self) -> set[int]:
        """Every host process of this sandbox (from its cgroup), for tests and the benchmark."""
        found = self._cgroups.pids() if self._cgroups else set()
        if self._proc is not None and self._proc.returncode is None:
            found.add(self._proc.pid)
        return found

    async def _teardown(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()
        # Everything the handle names, in the order that cannot leave orphans: kill the
        # process group and the cgroup's members, reap, then remove cgroups and files.
        await asyncio.to_thread(self._kill)
        if self._stderr_task is not None:
            # the runtime's last words, for diagnostics; never wait long for them
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._stderr_task, 0.5)
        if self._proc is not None:
            self._proc.close_pipes()
            with contextlib.suppress(ProcessLookupError, TimeoutError):
                await asyncio.wait_for(self._proc.wait(), 10.0)
        if self._cleanup is not None:
            await asyncio.to_thread(self._cleanup)

    def _kill(self) -> None:
        if self._handle.pgid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._handle.pgid, 9)
        if self._cgroups is not None:
            self._cgroups.kill_all()


PIPE_BYTES = 1 << 20  # the channel's pipes: room for several whole egress data frames
F_SETPIPE_SZ = 1031


def _widen_pipes(fds: Sequence[int]) -> None:
    """Grow the channel's pipes from the kernel's 64 KiB to 1 MiB (the unprivileged maximum by
    default). A 128 KiB egress data frame then goes in one write and one wakeup instead of
    several; gVisor's guest cannot do this itself (its stdio are the host's pipes, which
    ``fcntl`` inside the Sentry does not reach). Best effort: a smaller pipe still works."""
    for fd in fds:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_BYTES)


def close_pipes(proc: asyncio.subprocess.Process) -> None:
    """Close our ends of the child's pipes. A guest that flooded stdout leaves the reader paused
    with the pipe full; until it is closed, ``wait()`` never completes."""
    transport = getattr(proc, "_transport", None)
    if transport is None:
        return
    for fd in (0, 1, 2):
        pipe = transport.get_pipe_transport(fd)
        if pipe is not None:
            pipe.close()


def new_handle(driver: str, owner: str, sandbox_id: str | None = None) -> Handle:
    return Handle(
        id=sandbox_id or ids.new_id("sbx"),
        driver=driver,
        owner=owner,
        host_pid=os.getpid(),
        host_start_time=handles.process_start_time(os.getpid()),
        created_at=time.time(),
    )


class ProcessDriver:
    """What the process drivers (gvisor, namespaces) share: the image's rootfs, the agent
    runtime the agent runs on (``agent_runtime.py``: nothing of the image runs our side) and a
    probe.

    A subclass names its runtime ``binary`` and the package that installs it.
    """

    isolation: str
    binary: str
    package: str

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._rootfs: str | None = None
        self._runtime: agent_runtime.AgentRuntime | None = None
        self._agent_path = ""  # the agent inside the sandbox: the runtime's, once known

    async def _image(self) -> str:
        """What the writable root mounts: the built rootfs, or a pulled image's layers (pulled
        first when missing: admission pulls, so this is a sandbox started by hand)."""
        if self._rootfs is None:
            from ephemeral.oci import sandbox_image

            if sandbox_image.is_reference(self.settings.image):
                pulled = await sandbox_image.ensure(self.settings, self.settings.image)
                lower = pulled.lower()
            else:
                lower = str(await images.ensure_image(self.settings, self.settings.image))
                built = images.built_image(self.settings, self.settings.image)
                if built is not None and built.layers:  # built FROM a registry image
                    lower = built.lower()
            # the agent runs on the runtime whatever the image holds (Python or not)
            self._runtime = await agent_runtime.ensure_runtime(self.settings)
            self._agent_path = self._runtime.agent
            self._rootfs = self._with_etc(lower)
        return self._rootfs

    def _with_etc(self, lower: str) -> str:
        """/etc/hosts, hostname and resolv.conf as a container has them (writable_root.py)."""
        cache = self.settings.image_cache_dir
        return writable_root.with_container_etc(lower, cache)

    def _agent_argv(self) -> tuple[Path, list[str]]:
        """The agent runtime's directory on the host and the agent's command line inside."""
        assert self._runtime is not None, "_image() first"
        return self._runtime.root, self._runtime.argv(self._agent_path)

    def binary_path(self) -> str | None:
        """The runtime binary to run; None when it is missing."""
        return shutil.which(self.binary)

    async def probe(self) -> str | None:
        if self.binary_path() is None:
            return f"{self.binary} not installed (apt-get install {self.package})"
        why = cgroups.available()
        if why:
            return why
        from ephemeral.sandbox.probe import start_and_exec_true

        return await start_and_exec_true(self)

    async def create(self, *, owner: str, limits: Limits) -> Sandbox:
        raise NotImplementedError  # each driver starts its own runtime

    async def _failed_start(
        self,
        exc: BaseException,
        sbx: ProcessSandbox | None,
        handle: Handle,
        handle_file: Path,
    ) -> None:
        """Leave nothing behind from a start that failed; raise it as a SandboxError.

        Returns only for errors that must propagate as they are (ours, cancellation); the
        caller re-raises those.
        """
        if sbx is not None:
            await sbx.destroy()
        else:
            handles.teardown(handle, handle_file)
        if isinstance(exc, errors.EphemeralError | asyncio.CancelledError | KeyboardInterrupt):
            return
        raise errors.SandboxError(f"{self.isolation} sandbox failed to start: {exc}") from exc
