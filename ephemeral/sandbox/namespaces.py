"""``namespaces`` isolation: bubblewrap + cgroups + a seccomp deny-list.

Every namespace is unshared (user, pid, net, ipc, uts, cgroup, mount) and nested user namespaces
are disabled; the image root is bound read-only; the writable paths are size-capped tmpfs; all
capabilities are dropped; the guest runs as uid/gid 1000. The host kernel is shared, so this is
the weakest level: it is only picked when nothing stronger runs, and always labelled.

The guest's uid 1000 is an unprivileged host uid (a random one in 200000-259999 per sandbox),
not host root: the launcher (root) joins the cgroups, enters a private mount namespace, binds
the image at a world-traversable mount point there (the cache lives under a 0700 home), drops to
that uid with ``setpriv`` and execs bwrap, which builds its own user namespace. The bind exists
only in that private namespace and vanishes with it. Where the kernel refuses unprivileged user
namespaces, bwrap runs as root instead (uid 1000 inside then maps to host root: weaker, and
``privileged_fallback`` says so).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from pathlib import Path

from ephemeral import errors
from ephemeral.sandbox import cgroups, handles, seccomp
from ephemeral.sandbox.base import Limits, Sandbox
from ephemeral.sandbox.process import ProcessDriver, ProcessSandbox, new_handle
from ephemeral.settings import Settings

AGENT_ARGV = ["/usr/bin/python3", "-I", "-S"]
SMALL_TMPFS = 16 << 20
# Mount point for the image inside each sandbox's private mount namespace (empty on the host).
MOUNT_POINT = Path("/run/ephemeral/rootfs")
HOST_UID_BASE = 200_000
HOST_UID_SPAN = 60_000
log = logging.getLogger(__name__)


class NamespacesDriver(ProcessDriver):
    isolation = "namespaces"
    binary = "bwrap"
    package = "bubblewrap"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.privileged_fallback = False

    def argv(self, rootfs: str, limits: Limits, seccomp_fd: int) -> list[str]:
        disk = limits.disk_mib << 20
        argv = [
            "bwrap",
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--die-with-parent",
            "--new-session",
            "--as-pid-1",
            "--cap-drop",
            "ALL",
            "--uid",
            "1000",
            "--gid",
            "1000",
            "--hostname",
            "sandbox",
            "--ro-bind",
            rootfs,
            "/",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(disk),
            "--tmpfs",
            "/tmp",
        ]
        for path in ("/run", "/var/tmp", "/home/worker", "/dev/shm"):
            argv += ["--size", str(SMALL_TMPFS), "--tmpfs", path]
        argv += [
            "--chdir",
            "/",
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/local/bin:/usr/bin:/bin",
            "--setenv",
            "HOME",
            "/home/worker",
            "--setenv",
            "LANG",
            "C.UTF-8",
            "--seccomp",
            str(seccomp_fd),
            "--",
            *AGENT_ARGV,
            self._agent_path,
            "--channel",
            "stdio",
        ]
        return argv

    @staticmethod
    def unprivileged_launcher(rootfs: str, host_uid: int) -> list[str]:
        for d in (MOUNT_POINT.parent, MOUNT_POINT):
            d.mkdir(mode=0o755, exist_ok=True)
        return [
            "unshare", "--mount", "--propagation", "private",
            "/bin/sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh",
            rootfs, str(MOUNT_POINT),
            "setpriv", f"--reuid={host_uid}", f"--regid={host_uid}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all",
        ]  # fmt: skip

    async def create(self, *, owner: str, limits: Limits) -> Sandbox:
        if not self.privileged_fallback:
            try:
                return await self._create(owner, limits, unprivileged=True)
            except errors.SandboxError as exc:
                text = str(exc)
                if "namespace" not in text and "uid map" not in text:
                    raise
                log.warning("unprivileged bwrap refused (%s); running bwrap as root", text)
                self.privileged_fallback = True
        return await self._create(owner, limits, unprivileged=False)

    async def _create(self, owner: str, limits: Limits, *, unprivileged: bool) -> Sandbox:
        rootfs = await self._image()
        handle = new_handle(self.isolation, owner)
        cg = cgroups.CgroupSet.for_id(handle.id)
        handle.cgroups = [str(d) for d in cg.dirs]
        hfile = handles.write(self.settings.sandboxes_dir, handle)
        sbx: ProcessSandbox | None = None
        fd = os.memfd_create("ephemeral-seccomp", 0)
        try:
            os.write(fd, seccomp.program())
            os.lseek(fd, 0, os.SEEK_SET)
            cg = cgroups.CgroupSet.create(handle.id, limits)
            sbx = ProcessSandbox(
                sandbox_id=handle.id,
                isolation=self.isolation,
                image=self.settings.image,
                handle=handle,
                handle_file=hfile,
                cgroups=cg,
                limits=limits,
            )
            if unprivileged:
                host_uid = HOST_UID_BASE + secrets.randbelow(HOST_UID_SPAN)
                argv = [
                    *self.unprivileged_launcher(rootfs, host_uid),
                    *self.argv(str(MOUNT_POINT), limits, fd),
                ]
            else:
                argv = self.argv(rootfs, limits, fd)
            await sbx._start(argv, pass_fds=[fd])
            return sbx
        except BaseException as exc:
            await self._failed_start(exc, sbx, handle, hfile)
            raise
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
