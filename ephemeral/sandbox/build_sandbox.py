"""The image build's sandbox: where every definition-controlled command of a build runs.

An image definition is untrusted input (task authors write them), so nothing it controls runs
as host root or sees a host path. Each command runs under bubblewrap with the image being built
bound read-write as ``/``, in a user namespace of its own that maps ``0..65535`` inside to a
uid range of the ``namespaces`` driver (``base..base+65535`` on the host: never host root, never
a real host user, never another live sandbox). Root inside may chown, write any file of the
image and install packages' files, and none of that is host root: a process that got out of
the mount namespace would be host uid ``base``, which owns nothing.

For the mapped root to own the image's files, :class:`BuildSandbox` shifts the rootfs's owners
by ``base`` for the time of the build and shifts them back after (set-id bits and file
capabilities, which a chown clears, are put back). Inside: every namespace unshared, no
network (not even loopback), a fresh tmpfs ``/tmp`` and ``/run``, a minimal ``/dev``, a
``/proc`` of its own pid namespace, Docker's default capability set (of that namespace only),
no further user namespaces, ``--die-with-parent``, a time limit, and output read in bounded
pieces (only its tail is kept, for the error).

Inputs from the definition directory (files, wheels, the agent) are bound read-only under
``/run/ephemeral-build/in`` and copied by a command inside, so symlinks a build step left in
the image resolve inside the image, never on the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import shlex
import shutil
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ephemeral import errors
from ephemeral.sandbox import cgroups, handles
from ephemeral.sandbox.base import Limits
from ephemeral.sandbox.uid_ranges import allocate_uid_range
from ephemeral.settings import Settings

IN_DIR = "/run/ephemeral-build/in"
OUT_DIR = "/run/ephemeral-build/out"
OUTPUT_TAIL = 64 << 10  # what is kept of a command's output (for the error), in bytes
# Docker's default capabilities but CAP_NET_RAW (there is no network): what package scripts
# and `useradd` need, in the namespace only
BUILD_CAPS = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_MKNOD",
    "CAP_AUDIT_WRITE",
    "CAP_SETFCAP",
)
RANGE = 1 << 16
# Empty mount points on the host (one directory per uid range); the mounts on them exist only
# in each command's private mount namespace.
MOUNT_DIR = Path("/run/ephemeral/build")
_CAPS_XATTR = "security.capability"


@dataclass(frozen=True)
class BuildLimits:
    """What one build may use (settings ``build_*``): its cgroup's memory, processes and CPUs,
    its filesystem (:mod:`ephemeral.sandbox.build_area`), each step's ``/tmp`` and ``/run``,
    and what one ``ADD`` may unpack."""

    memory_mib: int = 2048
    pids: int = 1024
    cpus: float = 2.0
    disk_mib: int = 8192
    tmp_mib: int = 512
    add_max_mib: int = 2048
    add_max_files: int = 100_000

    @classmethod
    def of(cls, settings: Settings) -> BuildLimits:
        return cls(
            memory_mib=settings.build_memory_mib,
            pids=settings.build_pids,
            cpus=settings.build_cpus,
            disk_mib=settings.build_disk_mib,
            tmp_mib=settings.build_tmp_mib,
            add_max_mib=settings.build_add_max_mib,
            add_max_files=settings.build_add_max_files,
        )


class BuildCgroup:
    """One build's cgroup (:class:`ephemeral.sandbox.cgroups.CgroupSet`, as the sandboxes'):
    every command of the build joins it before it execs (:meth:`prefix`); at the end whatever
    is left in it is killed and it is removed. ``with BuildCgroup(limits) as cg:``."""

    def __init__(self, limits: BuildLimits) -> None:
        self.limits = limits
        # the builder's pid and start time: a cgroup whose builder is gone is swept
        pid = os.getpid()
        self.id = f"build-{pid}-{handles.process_start_time(pid) or 0}-{secrets.token_hex(4)}"
        self.cg: cgroups.CgroupSet | None = None

    def __enter__(self) -> BuildCgroup:
        if (why := cgroups.available()) is not None:
            raise errors.SandboxError(f"image build needs cgroups for its limits: {why}")
        lim = self.limits
        self.cg = cgroups.CgroupSet.create(
            self.id, Limits(cpus=lim.cpus, memory_mib=lim.memory_mib, pids=lim.pids)
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cg is not None:
            self.cg.remove()
            self.cg = None

    def prefix(self) -> list[str]:
        """argv prefix: join this cgroup, then exec what follows."""
        assert self.cg is not None
        join = " && ".join(f"echo $$ > {shlex.quote(f)}" for f in self.cg.procs_files)
        return ["/bin/sh", "-c", join + ' && exec "$@"', "sh"]

    def exhausted(self) -> str | None:
        """Which limit the build ran into (memory or processes), or None."""
        if self.cg is None:
            return None
        if self.cg.oom_killed():
            return f"out of memory (the build's limit is build_memory_mib={self.limits.memory_mib})"
        for d in self.cg.dirs:
            with contextlib.suppress(OSError, ValueError):
                for line in (d / "pids.events").read_text().splitlines():
                    key, _, val = line.partition(" ")
                    if key == "max" and int(val) > 0:
                        return (
                            f"out of processes (the build's limit is build_pids={self.limits.pids})"
                        )
        return None


def sweep_cgroups() -> list[str]:
    """Kill what is left in, and remove, the cgroups of builds whose builder process is gone
    (a crash or a kill: its steps may outlive it); returns their ids."""
    gone: list[str] = []
    if cgroups.available() is not None:
        return gone
    found: set[str] = set()
    for d in cgroups.CgroupSet.for_id("build-").dirs:
        with contextlib.suppress(OSError):
            found |= {p.name for p in d.parent.iterdir() if p.name.startswith("build-")}
    for name in sorted(found):
        parts = name.split("-")
        if len(parts) != 4 or not (parts[1].isdigit() and parts[2].isdigit()):
            continue
        if handles.pid_alive(int(parts[1]), int(parts[2]) or None):
            continue
        try:
            cgroups.CgroupSet.for_id(name).remove()
        except errors.SandboxError:
            continue  # still busy: the next sweep tries again
        gone.append(name)
    return gone


def explain(
    exc: errors.SandboxError, limits: BuildLimits, cg: BuildCgroup | None
) -> errors.SandboxError:
    """``exc`` of a failed build command, saying which limit it ran into when it did."""
    why = cg.exhausted() if cg is not None else None
    if why is None and "No space left on device" in exc.detail:
        why = (
            f"no space left (the build's disk is build_disk_mib={limits.disk_mib}, each "
            f"step's /tmp build_tmp_mib={limits.tmp_mib})"
        )
    if why is None:
        return exc
    head, sep, rest = exc.detail.partition("\n")
    return errors.SandboxError(f"{head} {why}{sep}{rest}")


def _mounts_prefix(binds: Sequence[tuple[Path, Path]]) -> list[str]:
    """argv prefix: a private mount namespace where each host path is bound on its mount point
    under :data:`MOUNT_DIR` (host root does it: the sandbox's ids need no permission on the
    host directories above, which are often 0700), then what follows ``--``."""
    script = (
        'while [ "$1" != -- ]; do mount --bind "$1" "$2" || exit 1; shift 2; done\nshift\nexec "$@"'
    )
    flat = [str(p) for pair in binds for p in pair]
    prefix = ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script, "sh"]
    return [*prefix, *flat, "--"]


# Shell (host root, ``$base`` set): a process ``$h`` holding a new user namespace that maps
# 0..65535 to ``$base..``, its maps written from outside before anything runs in it.
HOLDER_SH = (
    "unshare --user -- sleep 60 </dev/null >/dev/null 2>&1 &\nh=$!\ni=0\n"
    'until echo "0 $base 65536" 2>/dev/null >"/proc/$h/uid_map"; do\n'
    "  i=$((i + 1))\n"
    "  if [ $i -gt 200000 ] || ! kill -0 $h 2>/dev/null; then\n"
    '    echo "build sandbox: could not map the user namespace" >&2; exit 1\n'
    "  fi\ndone\n"
    'echo "0 $base 65536" >"/proc/$h/gid_map" || exit 1\n'
)


def _userns_prefix(base: int) -> list[str]:
    """argv prefix: a user namespace mapping 0..65535 to ``base..``, entered as its root, with
    no further user namespaces allowed; what follows runs there (the namespaces driver's
    launcher, without its overlay: here the image is written). Capabilities are recomputed at
    exec, so the map is written before anything runs inside: hence a holder process whose
    namespace is kept on fd 9 while nsenter makes us its uid 0."""
    script = (
        "base=$1\nnsfd=9\nshift\n"
        + HOLDER_SH
        + 'eval "exec $nsfd<\\"/proc/$h/ns/user\\"" || exit 1\n'
        "{ kill -9 $h; wait $h; } 2>/dev/null\n"
        'exec nsenter --user="/proc/self/fd/$nsfd" --setuid=0 --setgid=0 -- /bin/sh -c '
        '\'eval "exec $0<&-" && echo 0 >/proc/sys/user/max_user_namespaces && '
        'exec "$@"\' "$nsfd" "$@"'
    )
    return ["/bin/sh", "-c", script, "sh", str(base)]


def bwrap_argv(
    root: Path | None,
    env: dict[str, str],
    *,
    ro: Sequence[tuple[Path, str]] = (),
    rw: Sequence[tuple[Path, str]] = (),
    tmp_mib: int = BuildLimits.tmp_mib,
    own_net: bool = True,
) -> list[str]:
    """bwrap with ``root`` as ``/`` (read-write) and nothing of the host but ``ro``/``rw``;
    with no root, ``/`` is an empty tmpfs with the host's ``/usr`` read-only (the C compiler).
    ``own_net=False``: the network namespace it is started in is kept (a build's proxied one,
    :mod:`ephemeral.build_proxy`), else one of its own with nothing in it."""
    argv = [
        "bwrap",
        "--unshare-ipc",
        "--unshare-pid",
        *(["--unshare-net"] if own_net else []),
        "--unshare-uts",
        "--unshare-cgroup",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
    ]
    for cap in BUILD_CAPS:
        argv += ["--cap-add", cap]
    argv += ["--hostname", "build"]
    if root is not None:
        argv += ["--bind", str(root), "/"]
    else:
        argv += ["--ro-bind", "/usr", "/usr"]
        for link in ("bin", "lib", "lib64", "sbin"):
            if os.path.islink(f"/{link}"):
                argv += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
    size = str(tmp_mib << 20)  # tmpfs pages are charged to the build's memory cgroup too
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/run"]
    for src, dst in ro:
        argv += ["--ro-bind", str(src), dst]
    for src, dst in rw:
        argv += ["--bind", str(src), dst]
    argv += ["--chdir", "/", "--clearenv"]
    for k, v in env.items():
        argv += ["--setenv", k, v]
    return [*argv, "--"]


async def run_bounded(
    argv: list[str],
    what: str,
    *,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    pass_fds: Sequence[int] = (),
) -> None:
    """Run ``argv`` in a session of its own; killed at ``timeout``; of its output only the last
    :data:`OUTPUT_TAIL` bytes are kept (a step printing forever costs no host memory)."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        cwd=cwd,
        start_new_session=True,
        pass_fds=tuple(pass_fds),
    )
    tail = bytearray()

    async def drain() -> None:
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(1 << 16):
            tail.extend(chunk)
            del tail[:-OUTPUT_TAIL]
        await proc.wait()

    try:
        await asyncio.wait_for(drain(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        await proc.wait()
        raise errors.SandboxError(f"image build: {what} timed out after {timeout:.0f}s") from None
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        await proc.wait()
        raise
    if proc.returncode != 0:
        text = tail.decode(errors="replace")[-4000:]
        raise errors.SandboxError(f"image build: {what} failed (exit {proc.returncode}):\n{text}")


def shift_owners(root: Path, delta: int, *, lo: int, hi: int) -> None:
    """Add ``delta`` to the uid and gid of every inode under ``root`` whose ids lie in
    ``[lo, hi)``; ids outside become ``lo + 65534 + delta`` (nobody). Set-id bits and file
    capabilities, which the kernel clears on chown, are restored."""
    seen: set[tuple[int, int]] = set()

    def one(path: str) -> None:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) in seen:
            return  # a hard link: shifted once
        seen.add((st.st_dev, st.st_ino))

        def move(i: int) -> int:
            return (i if lo <= i < hi else lo + 65534) + delta

        link = stat.S_ISLNK(st.st_mode)
        caps: bytes | None = None
        if stat.S_ISREG(st.st_mode):
            with contextlib.suppress(OSError):
                caps = os.getxattr(path, _CAPS_XATTR, follow_symlinks=False)
        os.lchown(path, move(st.st_uid), move(st.st_gid))
        if not link and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            os.chmod(path, stat.S_IMODE(st.st_mode))
        if caps is not None:
            try:
                os.setxattr(path, _CAPS_XATTR, caps, follow_symlinks=False)
            except OSError as exc:  # a v3 capability names its namespace root: drop it
                if exc.errno not in (errno.EINVAL, errno.EPERM):
                    raise

    one(str(root))
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            one(os.path.join(dirpath, name))


class RootHook(Protocol):
    """A root the sandbox does not own by shifting it (a registry image's layers under an
    overlay, ``dockerfile/layers.py``): mounted once the uid range is known, released after."""

    async def mount(self, base: int) -> None: ...

    async def release(self, base: int) -> None: ...


class NetHook(Protocol):
    """A network namespace whose only way out is a proxy (``ephemeral/build_proxy.py``)."""

    async def start(self) -> str: ...  # the namespace's path (/proc/PID/ns/net)

    def env(self) -> dict[str, str]: ...  # what points a command at the proxy

    async def stop(self) -> None: ...


class BuildSandbox:
    """Holds a uid range and the shifted ownership of ``rootfs`` for one build; ``run`` runs a
    command inside. Use as ``async with BuildSandbox(rootfs) as box:``. With ``root``, that
    hook makes ``rootfs`` (nothing is shifted); with ``net``, commands run in its network
    namespace, with its proxy in their environment, instead of one with nothing in it."""

    def __init__(
        self,
        rootfs: Path,
        limits: BuildLimits | None = None,
        *,
        root: RootHook | None = None,
        net: NetHook | None = None,
    ) -> None:
        self.rootfs = rootfs
        self.limits = limits or BuildLimits()
        self.base = 0
        self._range_fd: int | None = None
        self._shifted: list[Path] = []
        self.cgroup: BuildCgroup | None = None
        self.root = root
        self.net = net
        self._netns: str | None = None
        self._mounted = False

    async def __aenter__(self) -> BuildSandbox:
        for tool in ("bwrap", "unshare", "nsenter"):
            if shutil.which(tool) is None:
                raise errors.SandboxError(f"image build needs {tool} (its sandbox runs in one)")
        self.base, self._range_fd = allocate_uid_range()
        try:
            self.cgroup = BuildCgroup(self.limits).__enter__()
            if self.root is not None:
                self._mounted = True
                await self.root.mount(self.base)
            else:
                await self.own(self.rootfs)
            if self.net is not None:
                self._netns = await self.net.start()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def own(self, path: Path) -> None:
        """Make ``path`` (the rootfs, an output directory) belong to the sandbox's ids."""
        await asyncio.to_thread(shift_owners, path, self.base, lo=0, hi=RANGE)
        self._shifted.append(path)

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self.cgroup is not None:  # nothing of the build outlives it
                await asyncio.to_thread(self.cgroup.__exit__)
                self.cgroup = None
            if self.net is not None:
                await self.net.stop()
                self._netns = None
            if self.root is not None and self._mounted:
                self._mounted = False
                await self.root.release(self.base)
            for path in reversed(self._shifted):
                base = self.base
                await asyncio.to_thread(shift_owners, path, -base, lo=base, hi=base + RANGE)
            self._shifted.clear()
        finally:
            if self._range_fd is not None:
                os.close(self._range_fd)
                self._range_fd = None

    async def run(
        self,
        argv: list[str],
        what: str,
        *,
        env: dict[str, str],
        timeout: float,
        ro: Sequence[tuple[Path, str]] = (),
        rw: Sequence[tuple[Path, str]] = (),
        host_usr: bool = False,
    ) -> None:
        """Run ``argv`` in the sandbox: in the image, or (``host_usr``) in an empty root with
        the host's ``/usr`` read-only."""
        points = MOUNT_DIR / str(self.base)
        shutil.rmtree(points, ignore_errors=True)
        points.mkdir(parents=True, mode=0o755)
        binds: list[tuple[Path, Path]] = []

        def point(src: Path) -> Path:
            at = points / str(len(binds))
            if src.is_dir():
                at.mkdir(mode=0o755)
            else:
                at.touch(mode=0o644)
            binds.append((src, at))
            return at

        try:
            root = None if host_usr else point(self.rootfs)
            ro_at = [(point(src), dst) for src, dst in ro]
            rw_at = [(point(src), dst) for src, dst in rw]
            assert self.cgroup is not None
            netns: list[str] = []
            if self._netns is not None and self.net is not None:
                # entered by host root before the user namespace (which could not enter it)
                netns = ["nsenter", f"--net={self._netns}", "--"]
                env = {**env, **self.net.env()}
            own_net = self._netns is None
            full = [
                *self.cgroup.prefix(),
                *netns,
                *_mounts_prefix(binds),
                *_userns_prefix(self.base),
                *bwrap_argv(
                    root, env, ro=ro_at, rw=rw_at, tmp_mib=self.limits.tmp_mib, own_net=own_net
                ),
                *argv,
            ]
            env_ = {"PATH": "/usr/sbin:/usr/bin:/bin"}
            try:
                await run_bounded(full, what, timeout=timeout, env=env_)
            except errors.SandboxError as exc:
                raise explain(exc, self.limits, self.cgroup) from None
        finally:
            shutil.rmtree(points, ignore_errors=True)
