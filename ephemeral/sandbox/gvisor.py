"""``gvisor`` isolation: Debian's ``runsc`` (ptrace platform), no network, a private writable root.

The guest's syscalls go to gVisor's user-space kernel (the Sentry), not to the host kernel,
which is why this is the strongest level on hosts without hardware virtualisation.

``runsc run`` starts in a private mount namespace whose ``/run/ephemeral/rootfs`` is the
sandbox's copy-on-write overlay of the image (``writable_root.py``): the Gofer serves the
guest's root from it, so a write lands in the sandbox's own tmpfs, bounded by the disk limit.

Each sandbox gets its own runsc ``--root`` state directory and OCI bundle under
``<state_dir>/run/<id>/``; ``runsc run`` is started inside the sandbox's host cgroup (joined
before exec), so the Sentry, the Gofer and every stub process count against its limits.
Destroy kills the cgroup and deletes the directories; no ``runsc delete`` round trip is needed
because all state lives in that private root.

Identities: the agent runs as gVisor's sandboxed root (uid 0 inside the Sentry's own user
namespace: never host root; the Sentry itself runs as an unprivileged host user) with only
:data:`~ephemeral.sandbox.base.AGENT_CAPS`, and makes itself non-dumpable; commands run as
uid 1000 with no capabilities.
A command therefore cannot open the agent's channel through ``/proc/1/fd``, ptrace it, or
signal it, and so cannot forge its own result.

Pitfalls (research/isolation.md 9-10): the agent's stdio must be pipes, not files, and the
runtime may hand the guest a non-blocking stdin, which the agent handles.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from ephemeral import errors
from ephemeral.sandbox import agent_runtime, cgroups, handles, writable_root
from ephemeral.sandbox.base import AGENT_CAPS, Limits, Sandbox
from ephemeral.sandbox.probe import runtime_version
from ephemeral.sandbox.process import ProcessDriver, ProcessSandbox, new_handle

# The Sentry, Gofer and ptrace stubs live in the same cgroup as the guest: headroom for them.
# Under the ptrace platform every guest process costs ~12 host threads (measured: 100 guest
# sleeps = 1,248 host pids), and this runsc enforces no guest-side process limit, so a guest
# fork bomb ends when the host pids limit stops the Sentry: the sandbox dies, the host does not.
SENTRY_MEMORY_MIB = 160
SENTRY_PIDS = 256
HOST_PIDS_PER_GUEST_PROCESS = 12
SMALL_TMPFS = 4  # /dev, /run, /var/tmp, /home/worker: sized by writable_root.tmpfs_sizes


def _tmpfs(dest: str, size: int) -> dict[str, Any]:
    return {
        "destination": dest,
        "type": "tmpfs",
        "source": "tmpfs",
        "options": [
            "nosuid",
            "nodev",
            "mode=1777" if dest in ("/tmp", "/var/tmp") else "mode=755",
            f"size={size}",
        ],
    }


def oci_spec(
    rootfs: str, agent: list[str], limits: Limits, cgroups_path: str, disk: bool = False
) -> dict[str, Any]:
    """The bundle's config.json; ``agent``: the agent's command line (``AgentRuntime.argv``);
    ``disk``: the writable root is disk-backed, with /tmp on it (no tmpfs)."""
    sizes = writable_root.tmpfs_sizes(limits, SMALL_TMPFS, disk)
    home = {
        "destination": "/home/worker",
        "type": "tmpfs",
        "source": "tmpfs",
        "options": ["nosuid", "nodev", "mode=755", "uid=1000", "gid=1000", f"size={sizes.small}"],
    }
    caps: dict[str, list[str]] = {
        k: list(AGENT_CAPS) for k in ("bounding", "effective", "permitted")
    }
    caps.update(inheritable=[], ambient=[])
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0, "additionalGids": []},
            "args": [
                *agent,
                "--channel",
                "stdio",
                "--max-memory-mib",
                str(limits.memory_mib),
                # the image's glibc programs get the statx shim (statx_shim.c says why)
                "--preload",
                agent_runtime.SHIM,
            ],
            "env": [f"{k}={v}" for k, v in agent_runtime.ENV.items()],
            "cwd": "/",
            "capabilities": caps,
            "noNewPrivileges": True,
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 4096, "soft": 4096}],
        },
        # the writable root's overlay (writable_root.py), private to this sandbox
        "root": {"path": rootfs, "readonly": False},
        "hostname": "sandbox",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {
                "destination": "/dev",
                "type": "tmpfs",
                "source": "tmpfs",
                # this runsc ignores a size here: a root command can fill /dev (docs/security.md)
                "options": ["nosuid", "strictatime", "mode=755", f"size={sizes.small}"],
            },
            {
                "destination": "/sys",
                "type": "sysfs",
                "source": "sysfs",
                "options": ["nosuid", "noexec", "nodev", "ro"],
            },
            # the agent runtime, read-only (writable_root.AGENT is a read-only overlay of it)
            {
                "destination": agent_runtime.MOUNT,
                "type": "bind",
                "source": str(writable_root.AGENT),
                "options": ["rbind", "ro", "nosuid", "nodev"],
            },
            # on a disk-backed root /tmp is its own directory, bound so that runsc adds no
            # tmpfs of its own there (one the Sentry's memory holds, sized by nothing)
            {
                "destination": "/tmp",
                "type": "bind",
                "source": f"{rootfs}/tmp",
                "options": ["rbind", "rw", "nosuid", "nodev"],
            }
            if disk
            else _tmpfs("/tmp", sizes.large),
            _tmpfs("/run", sizes.small),
            _tmpfs("/var/tmp", sizes.small),
            home,
        ],
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
            # Our pre-made cgroup: runsc joins it without changing its limits, and sizes the
            # Sentry's memory from it, so a guest memory bomb fails inside the guest instead of
            # the host OOM killer taking the whole Sentry.
            "cgroupsPath": cgroups_path,
        },
    }


class GVisorDriver(ProcessDriver):
    isolation = "gvisor"
    binary = "runsc"
    package = "runsc"

    def binary_path(self) -> str | None:
        """``EPHEMERAL_RUNSC_PATH`` when set (it must be an executable file), else PATH's."""
        configured = self.settings.runsc_path
        if configured is None:
            return super().binary_path()
        return str(configured) if os.access(configured, os.X_OK) and configured.is_file() else None

    async def probe(self) -> str | None:
        if self.settings.runsc_path is not None and self.binary_path() is None:
            return f"EPHEMERAL_RUNSC_PATH={self.settings.runsc_path} is not an executable file"
        return await super().probe()

    @staticmethod
    def runsc_argv(runsc: str, state_root: Path, bundle: Path, container_id: str) -> list[str]:
        return [
            runsc,
            f"--root={state_root}",
            "--network=none",
            "--platform=ptrace",
            # the only host mount besides the root is the agent runtime, which nothing changes:
            # the Sentry may cache it (bench/agent_runtime.py measures the difference)
            "--file-access-mounts=exclusive",
            "run",
            f"--bundle={bundle}",
            container_id,
        ]

    async def create(self, *, owner: str, limits: Limits) -> Sandbox:
        rootfs = await self._image()
        runsc = self.binary_path()
        if runsc is None:
            raise errors.IsolationUnavailable(f"gvisor: {self.binary} not found")
        runtime = await asyncio.to_thread(runtime_version, self.isolation, runsc)
        helper = await asyncio.to_thread(writable_root.helper, self.settings.image_cache_dir)
        handle = new_handle(self.isolation, owner)
        run_dir = self.settings.state_dir / "run" / handle.id
        state_root, bundle = run_dir / "state", run_dir / "bundle"
        # runsc adds its own per-controller cgroups at the same path: the handle names them all
        cg = cgroups.CgroupSet.for_id(handle.id, all_controllers=True)
        handle.cgroups = [str(d) for d in cg.dirs]
        handle.paths = [str(run_dir)]
        handle.runsc_root = str(state_root)
        handle.container_id = handle.id
        hfile = handles.write(self.settings.sandboxes_dir, handle)
        sbx: ProcessSandbox | None = None
        try:
            state_root.mkdir(parents=True, mode=0o700)
            bundle.mkdir(mode=0o700)
            agent_dir, agent = self._agent_argv()
            on_disk = writable_root.on_disk(limits, self.settings)
            disk = None
            if on_disk:  # in run_dir, which the handle names: the reaper removes a leftover
                disk = await asyncio.to_thread(writable_root.make_disk, run_dir, limits.disk_mib)
            spec = oci_spec(
                str(writable_root.MOUNT_POINT),
                agent,
                limits,
                f"/{cgroups.PARENT}/{handle.id}",
                on_disk,
            )
            (bundle / "config.json").write_text(json.dumps(spec))
            cg = cgroups.CgroupSet.create(
                handle.id,
                limits,
                memory_extra_mib=SENTRY_MEMORY_MIB,
                pids_extra=SENTRY_PIDS + limits.pids * (HOST_PIDS_PER_GUEST_PROCESS - 1),
            )
            sbx = ProcessSandbox(
                sandbox_id=handle.id,
                isolation=self.isolation,
                image=self.settings.image,
                handle=handle,
                handle_file=hfile,
                cgroups=cg,
                limits=limits,
                runtime=runtime,
            )
            await sbx._start(
                [
                    *writable_root.launcher(
                        rootfs,
                        writable_root.tmpfs_sizes(limits, SMALL_TMPFS, on_disk).large,
                        handle.id,
                        helper,
                        agent_dir,
                        disk,
                    ),
                    *self.runsc_argv(runsc, state_root, bundle, handle.id),
                ]
            )
            return sbx
        except BaseException as exc:
            await self._failed_start(exc, sbx, handle, hfile)
            raise
