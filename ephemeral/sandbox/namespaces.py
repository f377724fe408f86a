"""``namespaces`` isolation: bubblewrap in a user namespace of its own, cgroups and seccomp.

Every namespace is unshared (user, pid, net, ipc, uts, cgroup, mount) and nested user namespaces
are disabled; the root is the sandbox's own copy-on-write overlay of the image
(``writable_root.py``); every writable path is a size-capped tmpfs. The host kernel is
shared, so this is the weakest level: it is only picked when nothing stronger runs, and
always labelled.

Identities. The launcher (host root) gives each sandbox a user namespace mapping 65,536 ids,
``0..65535`` inside to ``base..base+65535`` on the host, a uid range of its own
(:mod:`ephemeral.sandbox.uid_ranges`, held until destroy: two live sandboxes never share host
uids, and none of those uids is host root or a real host user). Inside it:

- the guest agent is root *of that namespace* (host uid ``base``), with only the capabilities it
  needs (:data:`~ephemeral.sandbox.base.AGENT_CAPS`, which is also its bounding set, so a root
  command cannot regain more at exec), non-dumpable, as pid 1 of its pid namespace;
- every command runs as uid/gid 1000 (host ``base+1000``), with no capabilities, no fds but
  0-2, and no-new-privileges, so it can neither signal, ptrace nor read ``/proc/1/fd`` or
  ``/proc/1/mem`` of the agent, nor forge its replies;
- the image's files belong to host root; the overlay's lower layer is an idmapped mount of the
  image that shows host uid ``n`` as ``base+n``, so inside they belong to their owners (root's
  to the sandbox's root, which may change them: the change lands in the sandbox's own upper
  layer), while on the host the sandbox's root is still ``base``, owning nothing;
- ``user.max_user_namespaces`` is 0 in that namespace, so no process can make another.

The sequence (:func:`_launcher`): in a private mount namespace, start a holder process in a
new user namespace, write its uid/gid maps from outside and keep its namespace by fd; bind the
image, idmapped into that namespace, at a neutral path and mount the writable overlay over it
(its own inodes, so other tenants' opens of the shared image files are not inotify events on
what this sandbox sees, and ``/proc/self/mountinfo`` names no host path); enter the namespace
as uid 0 with ``nsenter``, forbid further user namespaces and exec bwrap, which makes the
remaining namespaces and runs the agent. Everything vanishes with the sandbox's processes;
nothing is mounted on the host.

The kernel's view is masked like Docker's masked paths: ``/proc/cmdline``, ``loadavg`` and
``boot_id`` show per-sandbox values, ``kcore``/``keys``/``timer_list``/``sched_debug`` read
empty. ``/proc/uptime`` stays the host's: the kernel does not shift the start times in
``/proc/<pid>/stat`` by a time namespace, so any other uptime breaks ``ps``. ``/dev`` is
read-only (bwrap cannot size-cap it, and a tmpfs past the memory limit is an OOM kill);
``/dev/shm`` is a 16 MiB tmpfs. Every tmpfs is sized to fit the memory limit together
(``writable_root.tmpfs_sizes``), and the launcher makes itself and the agent OOM-immune where
the host allows it. The seccomp allowlist (``seccomp.py``) refuses
``socket(AF_VSOCK)``: vsock is not network-namespaced, so a bind would take a port from the
host's space.

``namespaces_privileged`` (an operator setting, never automatic) skips the user namespace: the
agent is host root with the same reduced capabilities and commands run as host uid 1000. Such a
sandbox is labelled ``namespaces-privileged``, and its agent refuses any user of uid or gid 0
(``--no-root``), however the request spells it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from pathlib import Path

from ephemeral.sandbox import agent_runtime, cgroups, handles, seccomp, writable_root
from ephemeral.sandbox.base import AGENT_CAPS, Limits, Sandbox
from ephemeral.sandbox.process import ProcessDriver, ProcessSandbox, new_handle
from ephemeral.sandbox.uid_ranges import allocate_uid_range
from ephemeral.settings import Settings

SMALL_TMPFS = ("/run", "/var/tmp", "/home/worker", "/dev/shm")  # sized by tmpfs_sizes
# Docker's masked /proc paths that exist here read empty; these read per-sandbox values.
MASKED = ("/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug")
PRIVILEGED_LABEL = "namespaces-privileged"
log = logging.getLogger(__name__)


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _launcher(
    rootfs: str,
    host_base: int | None,
    passed: list[int],
    upper_size: int,
    sandbox_id: str,
    helper: Path | None,
    agent: Path,
    disk: Path | None,
) -> list[str]:
    """argv prefix: private mount namespace, then (unless privileged) the user namespace, the
    writable root's overlay (over an image idmapped into that namespace), and the namespace
    entered as its root; the bwrap argv follows. ``passed`` are the fds bwrap reads: the
    namespace is held on a free single-digit fd (all a POSIX shell can name)."""
    nsfd = next(n for n in range(3, 10) if n not in passed)
    writable_root.prepare_dirs()
    head = writable_root.ARGS + "base=$1\nnsfd=$2\nshift 2\n"
    if host_base is None:
        script = head + writable_root.mount_script(helper=helper, idmap_userns=None) + 'exec "$@"'
    else:
        # The holder unshares; we (root outside) write its maps; its namespace is kept by an fd
        # while nsenter makes us its uid 0. Capabilities are recomputed at exec, so the map must
        # exist before anything runs inside as root: hence a holder instead of `unshare --user`.
        # The image is idmapped into that namespace before the overlay is made of it.
        script = (
            head + "unshare --user -- sleep 60 </dev/null >/dev/null 2>&1 &\nh=$!\ni=0\n"
            'until echo "0 $base 65536" 2>/dev/null >"/proc/$h/uid_map"; do\n'
            "  i=$((i + 1))\n"
            "  if [ $i -gt 200000 ] || ! kill -0 $h 2>/dev/null; then\n"
            '    echo "namespaces: could not map the user namespace" >&2; exit 1\n'
            "  fi\ndone\n"
            'echo "0 $base 65536" >"/proc/$h/gid_map" || exit 1\n'
            'eval "exec $nsfd<\\"/proc/$h/ns/user\\"" || exit 1\n'
            "{ kill -9 $h; wait $h; } 2>/dev/null\n"
            + writable_root.mount_script(
                helper=helper, idmap_userns='"/proc/self/fd/$nsfd"', owner='"$base"'
            )
            + 'exec nsenter --user="/proc/self/fd/$nsfd" --setuid=0 --setgid=0 -- /bin/sh -c '
            '\'eval "exec $0<&-" && echo 0 >/proc/sys/user/max_user_namespaces && '
            'exec "$@"\' "$nsfd" "$@"'
        )
    return [
        "unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script, "sh",
        *writable_root.args(rootfs, upper_size, sandbox_id, agent, disk), str(host_base or 0),
        str(nsfd),
    ]  # fmt: skip


class NamespacesDriver(ProcessDriver):
    isolation = "namespaces"
    binary = "bwrap"
    package = "bubblewrap"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.privileged = settings.namespaces_privileged

    @property
    def label(self) -> str:
        """What a sandbox of this driver is called in runs and logs."""
        return PRIVILEGED_LABEL if self.privileged else self.isolation

    def argv(
        self,
        rootfs: str,
        limits: Limits,
        fds: dict[str, int],
        agent: list[str],
        disk: bool = False,
    ) -> list[str]:
        """bwrap's argv; ``agent``: the agent's command line (``AgentRuntime.argv``); ``disk``:
        the writable root is disk-backed, with /tmp on it (no tmpfs)."""
        sizes = writable_root.tmpfs_sizes(limits, len(SMALL_TMPFS), disk)
        argv = [
            "bwrap",
            "--unshare-ipc",
            "--unshare-pid",
            "--unshare-net",
            "--unshare-uts",
            "--unshare-cgroup",
            "--die-with-parent",
            "--new-session",
            "--as-pid-1",
            "--cap-drop",
            "ALL",
        ]
        # SETPCAP only for the agent to cut its bounding set to AGENT_CAPS (bwrap leaves it
        # full) and then drop SETPCAP itself: ``--drop-bounding-set`` below.
        for cap in (*AGENT_CAPS, "CAP_SETPCAP"):
            argv += ["--cap-add", cap]
        argv += [
            "--hostname",
            "sandbox",
            "--bind",
            rootfs,
            "/",
            # the agent runtime, read-only (writable_root.AGENT is a read-only overlay of it)
            "--ro-bind",
            str(writable_root.AGENT),
            agent_runtime.MOUNT,
            "--proc",
            "/proc",
            "--dev",
            "/dev",
        ]
        if not disk:
            argv += ["--perms", "1777", "--size", str(sizes.large), "--tmpfs", "/tmp"]
        for path, perms in zip(SMALL_TMPFS, ("0755", "1777", "0755", "1777"), strict=True):
            argv += ["--perms", perms, "--size", str(sizes.small), "--tmpfs", path]
        # bwrap cannot size /dev's tmpfs: read-only, root cannot fill it past the memory limit
        # (its devices still open for writing; /dev/shm and /dev/pts are mounts of their own)
        argv += ["--remount-ro", "/dev"]
        for path in MASKED:
            if os.path.exists(path):
                argv += ["--ro-bind", "/dev/null", path]
        for name, path in (
            ("cmdline", "/proc/cmdline"),
            ("loadavg", "/proc/loadavg"),
            ("boot_id", "/proc/sys/kernel/random/boot_id"),
        ):
            argv += ["--perms", "0444", "--ro-bind-data", str(fds[name]), path]
        argv += ["--chdir", "/", "--clearenv"]
        for name, value in agent_runtime.ENV.items():
            argv += ["--setenv", name, value]
        argv += [
            "--add-seccomp-fd",
            str(fds["seccomp"]),
            "--",
            *agent,
            "--channel",
            "stdio",
            "--drop-bounding-set",
        ]
        if self.privileged:
            # the agent is host root: it refuses uid/gid 0 however a request spells the user
            argv.append("--no-root")
        return argv

    async def create(self, *, owner: str, limits: Limits) -> Sandbox:
        """Start one sandbox; any failure is a SandboxError and never a weaker sandbox."""
        rootfs = await self._image()
        helper = await asyncio.to_thread(writable_root.helper, self.settings.image_cache_dir)
        handle = new_handle(self.isolation, owner)
        cg = cgroups.CgroupSet.for_id(handle.id)
        handle.cgroups = [str(d) for d in cg.dirs]
        on_disk = writable_root.on_disk(limits, self.settings)
        run_dir = self.settings.state_dir / "run" / handle.id
        if on_disk:
            handle.paths = [str(run_dir)]  # the disk file until the launcher unlinks it
        hfile = handles.write(self.settings.sandboxes_dir, handle)
        sbx: ProcessSandbox | None = None
        fds: dict[str, int] = {}
        range_fd: int | None = None
        try:
            fds["seccomp"] = _memfd("ephemeral-seccomp", seccomp.program())
            fds["cmdline"] = _memfd("cmdline", b"BOOT_IMAGE=/vmlinuz-sandbox ro quiet\n")
            fds["loadavg"] = _memfd("loadavg", b"0.00 0.00 0.00 0/0 0\n")
            fds["boot_id"] = _memfd("boot_id", f"{uuid.uuid4()}\n".encode())
            host_base: int | None = None
            if not self.privileged:
                host_base, range_fd = allocate_uid_range()
            cg = cgroups.CgroupSet.create(handle.id, limits)
            held = range_fd
            sbx = ProcessSandbox(
                sandbox_id=handle.id,
                isolation=self.label,
                image=self.settings.image,
                handle=handle,
                handle_file=hfile,
                cgroups=cg,
                limits=limits,
                cleanup=(lambda: os.close(held)) if held is not None else None,
            )
            range_fd = None  # the sandbox's destroy releases it now
            runtime, agent = self._agent_argv()
            disk = None
            if on_disk:
                disk = await asyncio.to_thread(writable_root.make_disk, run_dir, limits.disk_mib)
            passed = [*fds.values()]
            argv = [
                *_launcher(
                    rootfs,
                    host_base,
                    passed,
                    writable_root.tmpfs_sizes(limits, len(SMALL_TMPFS), on_disk).large,
                    handle.id,
                    helper,
                    runtime,
                    disk,
                ),
                *self.argv(str(writable_root.MOUNT_POINT), limits, fds, agent, on_disk),
            ]
            await sbx._start(argv, pass_fds=list(fds.values()), oom_protected=True)
            return sbx
        except BaseException as exc:
            await self._failed_start(exc, sbx, handle, hfile)
            raise
        finally:
            for fd in fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            if range_fd is not None:
                os.close(range_fd)
