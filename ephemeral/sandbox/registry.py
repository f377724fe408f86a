"""Driver lookup by isolation name, and the ``auto`` policy.

``auto`` picks the strongest level that really starts a sandbox here (a cached probe, see
probe.py). ``microvm-tcg`` is never picked by ``auto`` and ``microvm`` never means tcg: software
emulation is not a security boundary. A run never gets weaker isolation than it asked for: a
request is served by its own level or a stronger one, or refused with every reason.
"""

from __future__ import annotations

import importlib.util

from ephemeral import errors
from ephemeral.sandbox.base import ALL_ISOLATIONS, STRENGTH_ORDER, SandboxDriver
from ephemeral.settings import Settings

ALIASES = {"microvm": "microvm-kvm"}


def microvm_available() -> bool:
    return importlib.util.find_spec("ephemeral.sandbox.microvm") is not None


def get_driver(isolation: str, settings: Settings) -> SandboxDriver:
    name = ALIASES.get(isolation, isolation)
    if name == "namespaces":
        from ephemeral.sandbox.namespaces import NamespacesDriver

        return NamespacesDriver(settings)
    if name == "gvisor":
        from ephemeral.sandbox.gvisor import GVisorDriver

        return GVisorDriver(settings)
    if name in ("microvm-kvm", "microvm-tcg"):
        if not microvm_available():
            raise errors.IsolationUnavailable(f"{name}: the microVM driver is not installed")
        from ephemeral.sandbox.microvm import MicroVMDriver

        return MicroVMDriver(settings, accel="kvm" if name == "microvm-kvm" else "tcg")
    raise errors.InvalidRequest.field(
        "isolation",
        f"unknown isolation {isolation!r}; one of auto, microvm, " + ", ".join(ALL_ISOLATIONS),
    )


async def probe_level(isolation: str, settings: Settings, *, fresh: bool = False) -> str | None:
    """None if ``isolation`` runs here, else why not (cached)."""
    from ephemeral.sandbox.probe import cached_probe

    try:
        driver = get_driver(isolation, settings)
    except errors.IsolationUnavailable as exc:
        return exc.detail
    return await cached_probe(driver, settings, fresh=fresh)


async def offered(settings: Settings, *, fresh: bool = False) -> dict[str, str | None]:
    """Every real level and whether it runs here (None) or why not."""
    return {iso: await probe_level(iso, settings, fresh=fresh) for iso in ALL_ISOLATIONS}


async def resolve_isolation(requested: str, settings: Settings) -> str:
    if requested == "auto":
        candidates = list(STRENGTH_ORDER)
    else:
        name = ALIASES.get(requested, requested)
        if name not in ALL_ISOLATIONS:
            get_driver(name, settings)  # raises the InvalidRequest naming the field
        if name == "microvm-tcg":
            candidates = [name]
        else:
            # the level asked for first, then anything stronger, never weaker
            stronger = list(STRENGTH_ORDER[: STRENGTH_ORDER.index(name)])
            candidates = [name, *reversed(stronger)]
    reasons: list[str] = []
    for iso in candidates:
        why = await probe_level(iso, settings)
        if why is None:
            return iso
        reasons.append(why if why.startswith(f"{iso}:") else f"{iso}: {why}")
    raise errors.IsolationUnavailable(
        f"isolation {requested!r} cannot run on this host: " + "; ".join(reasons)
    )
