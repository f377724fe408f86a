"""Per-sandbox cgroups: memory, pids and CPU limits, kill-all, removal.

cgroup v2 when ``/sys/fs/cgroup/cgroup.controllers`` exists (one directory), otherwise v1 with
one directory per controller (``/sys/fs/cgroup/{memory,pids,cpu}``). Every sandbox gets
``<controller root>/ephemeral/<sandbox id>``. A process joins by writing its own pid to each
``cgroup.procs`` *before* it execs the runtime, so nothing it starts can escape the limits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from ephemeral import errors
from ephemeral.sandbox.base import Limits

CGROUP_ROOT = Path("/sys/fs/cgroup")
PARENT = "ephemeral"
V1_CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000


def is_v2(root: Path = CGROUP_ROOT) -> bool:
    return (root / "cgroup.controllers").is_file()


def available(root: Path = CGROUP_ROOT) -> str | None:
    """None if per-sandbox cgroups can be made here, else why not."""
    if is_v2(root):
        ctrls = (root / "cgroup.controllers").read_text().split()
        missing = {"memory", "pids", "cpu"} - set(ctrls)
        return f"cgroup v2 lacks controllers {sorted(missing)}" if missing else None
    missing_dirs = [c for c in V1_CONTROLLERS if not (root / c / "cgroup.procs").is_file()]
    if missing_dirs:
        return f"cgroup v1 controllers not mounted: {missing_dirs}"
    if not os.access(root / "memory", os.W_OK):
        return "no write access to /sys/fs/cgroup (needs root)"
    return None


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise errors.SandboxError(f"cgroup: cannot write {value!r} to {path}: {exc}") from exc


class CgroupSet:
    """The cgroup directories of one sandbox (one on v2, one per controller on v1)."""

    def __init__(self, dirs: list[Path]) -> None:
        self.dirs = dirs

    @classmethod
    def for_id(
        cls, sandbox_id: str, root: Path = CGROUP_ROOT, *, all_controllers: bool = False
    ) -> CgroupSet:
        if is_v2(root):
            return cls([root / PARENT / sandbox_id])
        ctrls = list(V1_CONTROLLERS)
        if all_controllers:
            ctrls += sorted(
                p.name
                for p in root.iterdir()
                if p.name not in ctrls and (p / "cgroup.procs").is_file() and not p.is_symlink()
            )
        return cls([root / c / PARENT / sandbox_id for c in ctrls])

    @classmethod
    def create(
        cls,
        sandbox_id: str,
        limits: Limits,
        *,
        memory_extra_mib: int = 0,
        pids_extra: int = 0,
        root: Path = CGROUP_ROOT,
    ) -> CgroupSet:
        cg = cls.for_id(sandbox_id, root)
        mem = (limits.memory_mib + memory_extra_mib) << 20
        pids = limits.pids + pids_extra
        quota = max(1000, int(limits.cpus * CPU_PERIOD_US))
        try:
            if is_v2(root):
                parent = root / PARENT
                parent.mkdir(exist_ok=True)
                for d in (root, parent):
                    with contextlib.suppress(OSError):
                        (d / "cgroup.subtree_control").write_text("+memory +pids +cpu")
                d = cg.dirs[0]
                d.mkdir()
                _write(d / "memory.max", str(mem))
                if (d / "memory.swap.max").exists():
                    _write(d / "memory.swap.max", "0")
                _write(d / "pids.max", str(pids))
                _write(d / "cpu.max", f"{quota} {CPU_PERIOD_US}")
            else:
                for d in cg.dirs:
                    d.parent.mkdir(exist_ok=True)
                    d.mkdir()
                mem_d, pids_d, cpu_d = cg.dirs
                _write(mem_d / "memory.limit_in_bytes", str(mem))
                if (mem_d / "memory.memsw.limit_in_bytes").exists():
                    _write(mem_d / "memory.memsw.limit_in_bytes", str(mem))
                _write(pids_d / "pids.max", str(pids))
                _write(cpu_d / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(cpu_d / "cpu.cfs_quota_us", str(quota))
        except OSError as exc:
            cg.remove()
            raise errors.SandboxError(f"cgroup setup failed for {sandbox_id}: {exc}") from exc
        except errors.SandboxError:
            cg.remove()
            raise
        return cg

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs:
            with contextlib.suppress(OSError, ValueError):
                found.update(int(x) for x in (d / "cgroup.procs").read_text().split())
        return found

    def kill_all(self, timeout: float = 5.0) -> None:
        """SIGKILL everything inside, until the cgroups are empty (or the timeout passes)."""
        kill_file = self.dirs[0] / "cgroup.kill"
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids()
            if not pids:
                return
            if kill_file.exists():
                with contextlib.suppress(OSError):
                    kill_file.write_text("1")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise errors.SandboxError(f"cgroup {self.dirs[0]} still has {sorted(pids)}")
            time.sleep(0.005)

    def oom_killed(self) -> bool:
        for d in self.dirs:
            for name in ("memory.events", "memory.oom_control"):
                with contextlib.suppress(OSError):
                    for line in (d / name).read_text().splitlines():
                        key, _, val = line.partition(" ")
                        if key == "oom_kill" and val.strip() not in ("", "0"):
                            return True
        return False

    def remove(self, timeout: float = 5.0) -> None:
        """rmdir every directory; a cgroup is removable only once its last task has been reaped."""
        deadline = time.monotonic() + timeout
        for d in self.dirs:
            while d.exists():
                try:
                    d.rmdir()
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if time.monotonic() > deadline:
                        raise errors.SandboxError(f"cannot remove cgroup {d}: {exc}") from exc
                    self.kill_all(timeout=max(0.1, deadline - time.monotonic()))
                    time.sleep(0.005)
