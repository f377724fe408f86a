"""Persisted sandbox handles (``<sandboxes_dir>/<id>.json``), written before a sandbox starts.

A handle names everything a sandbox owns on the host (process group, cgroups, runtime state
directories), so that destroy and the reaper can clean up even after the creating process died.
Writes are atomic (temp file + rename); destroy deletes the handle last.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path

from pydantic import ValidationError

from ephemeral.sandbox.base import Handle
from ephemeral.sandbox.cgroups import CgroupSet


def process_start_time(pid: int) -> int | None:
    """Kernel start time of ``pid`` (clock ticks), to tell a live owner from a reused pid."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(raw[raw.rfind(")") + 2 :].split()[19])


def pid_alive(pid: int, start_time: int | None) -> bool:
    now = process_start_time(pid)
    return now is not None and (start_time is None or now == start_time)


def handle_path(sandboxes_dir: Path, sandbox_id: str) -> Path:
    return sandboxes_dir / f"{sandbox_id}.json"


def write(sandboxes_dir: Path, handle: Handle) -> Path:
    sandboxes_dir.mkdir(parents=True, exist_ok=True)
    path = handle_path(sandboxes_dir, handle.id)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(handle.model_dump_json())
    os.replace(tmp, path)
    return path


def read_all(sandboxes_dir: Path) -> list[tuple[Path, Handle | None]]:
    """Every handle file; an unreadable one comes back as (path, None)."""
    out: list[tuple[Path, Handle | None]] = []
    if not sandboxes_dir.is_dir():
        return out
    for path in sorted(sandboxes_dir.glob("*.json")):
        try:
            out.append((path, Handle.model_validate_json(path.read_text())))
        except (OSError, ValidationError):
            out.append((path, None))
    return out


def teardown(handle: Handle, path: Path | None) -> None:
    """Kill and remove everything ``handle`` names; idempotent; the handle file goes last."""
    if handle.pgid:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(handle.pgid, signal.SIGKILL)
    for pid in handle.pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if handle.cgroups:
        cg = CgroupSet([Path(p) for p in handle.cgroups])
        cg.kill_all()
        cg.remove()
    for p in handle.paths:
        shutil.rmtree(p, ignore_errors=True)
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
