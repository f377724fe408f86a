"""Is an isolation level really usable here? Start one and run ``true`` in it.

The existence of ``/dev/kvm`` or a runtime binary proves nothing (``/dev/kvm`` here is kvm_pvm
and stock kernels crash under it), so a probe is a real sandbox. Results are cached per process
and in ``<state_dir>/isolation-probe.json`` keyed by the runtime's version string, so the CLI
does not pay ~0.5 s per level on every call; a changed runtime or image invalidates the entry.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ephemeral import errors
from ephemeral.sandbox.base import Limits

if TYPE_CHECKING:
    from ephemeral.sandbox.base import SandboxDriver
    from ephemeral.settings import Settings

PROBE_LIMITS = Limits(cpus=1.0, memory_mib=256, pids=64, disk_mib=16, lifetime_seconds=60)
CACHE_TTL_SECONDS = 24 * 3600
_memo: dict[tuple[str, str], str | None] = {}
_version_memo: dict[tuple[str, int, int], str] = {}


async def start_and_exec_true(driver: SandboxDriver) -> str | None:
    try:
        sbx = await asyncio.wait_for(driver.create(owner="probe", limits=PROBE_LIMITS), 60)
    except (errors.EphemeralError, TimeoutError, OSError) as exc:
        return f"{driver.isolation}: could not start a sandbox: {exc}"
    try:
        res = await sbx.exec(["true"], timeout=20)
        if res.exit_code != 0:
            return f"{driver.isolation}: `true` exited {res.exit_code} in the sandbox"
        return None
    except errors.EphemeralError as exc:
        return f"{driver.isolation}: exec failed: {exc}"
    finally:
        await sbx.destroy()


def runtime_path(isolation: str, settings: Settings | None = None) -> str | None:
    """The runtime binary a level runs: ``EPHEMERAL_RUNSC_PATH`` for gvisor, else on PATH."""
    if isolation == "gvisor" and settings is not None and settings.runsc_path is not None:
        return str(settings.runsc_path)
    if isolation.startswith("microvm"):
        return shutil.which("qemu-system-x86_64")
    binary = {"namespaces": "bwrap", "gvisor": "runsc"}.get(isolation)
    return shutil.which(binary) if binary else None


def runtime_version(isolation: str, path: str | None = None) -> str:
    """The runtime binary's first ``--version`` line (``runsc version 0.0~20221219.0``): a
    fingerprint, so a cached verdict dies with an upgrade, and what runs and
    ``ephemeral isolation`` report. ``path`` overrides the binary found on PATH."""
    path = path or runtime_path(isolation)
    if path is None:
        return "missing"
    # Memoised by the binary's identity: `--version` costs 40-60 ms and admission calls this
    # twice per run (the API's hot path); an upgraded binary has a new mtime and is re-read.
    try:
        st = Path(path).stat()
    except OSError:
        return "unknown"
    memo_key = (path, st.st_mtime_ns, st.st_size)
    if memo_key in _version_memo:
        return _version_memo[memo_key]
    try:
        out = subprocess.run([path, "--version"], capture_output=True, timeout=10, check=False)
        version = out.stdout.decode(errors="replace").strip().splitlines()[0][:200]
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return "unknown"
    _version_memo[memo_key] = version
    return version


def level_report(isolation: str, reason: str | None, settings: Settings) -> dict[str, object]:
    """One level as ``ephemeral isolation`` and ``GET /v1/isolation`` show it, given its probe's
    verdict (``reason`` None: it runs here)."""
    return {
        "available": reason is None,
        "reason": reason,
        "runtime": runtime_version(isolation, runtime_path(isolation, settings)),
        "privileged": isolation == "namespaces" and settings.namespaces_privileged,
    }


async def cached_probe(
    driver: SandboxDriver, settings: Settings, *, fresh: bool = False
) -> str | None:
    from ephemeral.sandbox import images

    version = await asyncio.to_thread(
        runtime_version, driver.isolation, runtime_path(driver.isolation, settings)
    )
    try:
        image_key = images.image_dir(settings, settings.image).name
    except errors.EphemeralError:
        image_key = "no-image"
    key = (driver.isolation, f"{version}|{image_key}")
    if not fresh and key in _memo:
        return _memo[key]
    cache_file = settings.state_dir / "isolation-probe.json"
    cache: dict[str, dict[str, object]] = {}
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(driver.isolation)
    if (
        not fresh
        and isinstance(entry, dict)
        and entry.get("key") == key[1]
        and time.time() - float(str(entry.get("at", 0))) < CACHE_TTL_SECONDS
    ):
        reason = entry.get("reason")
        _memo[key] = reason if isinstance(reason, str) else None
        return _memo[key]
    reason = await driver.probe()
    _memo[key] = reason
    cache[driver.isolation] = {"key": key[1], "reason": reason, "at": time.time()}
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(cache_file)
    except OSError:
        pass  # a read-only state dir only costs a re-probe next time
    return reason
