"""What a destroyed sandbox must not leave on the host: the check of the ``make_sandbox`` factory.

Firecracker's test framework checks after every test that the microVM's processes, jails and
files are gone; this does the same from what the sandbox declared when it was made: its handle
file (``<sandboxes_dir>/<id>.json``), the processes, process group, cgroup directories and host
paths the handle names, the processes in its cgroup, any host mount naming it, and any loop
device whose backing file names it (a disk-backed writable root's).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from ephemeral.sandbox import handles
from ephemeral.sandbox.base import Handle, Sandbox


@dataclass(frozen=True)
class Footprint:
    sandbox_id: str
    handle_file: Path
    handle: Handle | None
    pids: dict[int, int | None] = field(default_factory=dict)  # pid -> kernel start time


def footprint(sbx: Sandbox, sandboxes_dir: Path) -> Footprint:
    """Taken right after create: everything the sandbox owns on the host at that point."""
    path = handles.handle_path(sandboxes_dir, sbx.id)
    try:
        handle: Handle | None = Handle.model_validate_json(path.read_text())
    except (OSError, ValidationError):
        handle = None
    pids = set(handle.pids) if handle else set()
    if handle and handle.pgid:
        pids.add(handle.pgid)
    host_pids = getattr(sbx, "host_pids", None)
    if callable(host_pids):
        pids |= set(host_pids())
    starts = {pid: handles.process_start_time(pid) for pid in pids}
    return Footprint(sbx.id, path, handle, {p: t for p, t in starts.items() if t is not None})


def _running(pid: int, start_time: int | None) -> bool:
    """Alive and not a zombie (a zombie holds no memory, files or mounts; its parent reaps it)."""
    if not handles.pid_alive(pid, start_time):
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def leftovers(fp: Footprint) -> list[str]:
    """Everything of the sandbox still on the host; empty when destroy was complete."""
    left = []
    if fp.handle_file.exists():
        left.append(f"handle file {fp.handle_file}")
    if fp.handle is None:
        left.append(f"no handle was written for {fp.sandbox_id} (nothing to check against)")
        return left
    left += [f"process {pid}" for pid, start in fp.pids.items() if _running(pid, start)]
    left += [f"cgroup {d}" for d in fp.handle.cgroups if os.path.exists(d)]
    left += [f"host path {p}" for p in fp.handle.paths if os.path.exists(p)]
    names = [fp.sandbox_id, *fp.handle.paths]
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        mountinfo = []
    left += [f"mount {line}" for line in mountinfo if any(n in line for n in names)]
    left += [f"loop device {dev}" for dev in loop_devices(fp.sandbox_id)]
    return left


def loop_devices(name: str) -> list[str]:
    """Loop devices whose backing file's path (deleted or not) contains ``name``: a
    disk-backed writable root's until its last mount goes."""
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            if name in backing.read_text():
                found.append(backing.parent.parent.name)
        except OSError:
            continue
    return found
