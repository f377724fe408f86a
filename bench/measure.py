"""What the benches share: a percentile, a bare command timed, the table of samples beside a
floor, and the check for the tools a bench needs (each bench prints; none asserts)."""

from __future__ import annotations

import asyncio
import shutil
import statistics
import time

# the Debian package of a tool where the names differ
_PACKAGES = {"qemu-system-x86_64": "qemu-system-x86", "mkfs.ext4": "e2fsprogs"}


def pct(xs: list[float], p: float) -> float:
    """The ``p``-th percentile, nearest rank (the sample itself, never interpolated)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


async def timed_proc(argv: list[str], *, first_byte: bool = False) -> float:
    """ms from spawn until ``argv`` exits, or with ``first_byte`` until its first byte on
    stdout (then it is waited for); a command that fails ends the bench."""
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE if first_byte else asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    got = b"-"
    if first_byte:
        assert proc.stdout is not None
        got = await proc.stdout.read(1)
    ms = (time.perf_counter() - t0) * 1000
    rc = await proc.wait()
    if not got or rc != 0:
        raise SystemExit(f"raw floor command failed ({rc}): {' '.join(argv)}")
    return ms


def floor_table(title: str, times: dict[str, list[float]], p: float, *, width: int) -> None:
    """Each sample list's p50, ``p``-th percentile, min and max (ms) and its p50 over the p50
    of ``times["floor"]``, the bare runtime measured in the same sitting."""
    floor = statistics.median(times["floor"])
    print(f"\n{title}")
    for name, xs in times.items():
        p50 = statistics.median(xs)
        print(
            f"  {name:{width}} p50 {p50:7.1f}  p{p:g} {pct(xs, p):7.1f}  min {min(xs):7.1f}"
            f"  max {max(xs):7.1f}  {p50 / floor:5.2f}x floor"
        )


def missing_tool(*tools: str) -> str | None:
    """Why a bench cannot start here: the first of ``tools`` not on PATH and its package."""
    for tool in tools:
        if shutil.which(tool) is None:
            return f"{tool} missing (apt-get install {_PACKAGES.get(tool, tool)})"
    return None
