"""Where runs and sessions get their sandboxes: the warm pools, the limits, the boot retries.

One :class:`SandboxSource` per runtime. Runs (``ephemeral.engine.engine``) and sessions
(``ephemeral.sessions.manager``) ask it for a sandbox for an owner under a policy; neither sees the
pools, the drivers or the host facts behind it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, cast

from ephemeral import errors, progress
from ephemeral.money.pricing import PriceBook
from ephemeral.oci import sandbox_image
from ephemeral.policy import Policy
from ephemeral.sandbox import images
from ephemeral.sandbox.base import Limits, Sandbox
from ephemeral.sandbox.pool import boots_at_once
from ephemeral.sandbox.registry import get_driver, resolve_isolation
from ephemeral.settings import Settings

log = logging.getLogger("ephemeral.sandbox.source")

# What a request's isolation resolves to and which build an image name means are looked up on
# every admission and every sandbox (hashing the image definition, reading the probe cache and
# the image's metadata: ~10 ms of a session's create, measured); this long they are reused.
HOST_FACTS_SECONDS = 5.0
BOOT_ATTEMPTS = 3  # tries to boot a run's or a session's sandbox
BOOT_RETRY_SECONDS = 0.25
LIFETIME_GRACE_SECONDS = 10.0  # a sandbox outlives its run's time limit by this (backstop)


class SandboxSource:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.pools: dict[tuple[str, str], Any] = {}  # (isolation, image) -> WarmPool
        self._host_facts: dict[tuple[str, str], tuple[float, Any]] = {}
        self._boots = asyncio.Semaphore(boots_at_once())  # every sandbox this source starts
        self._pool_asked = False

    def limits(self, timeout_seconds: int, disk_mib: int | None = None) -> Limits:
        """The limits of a run's or session's sandbox: it lives its time limit plus a grace,
        with the writable root it asked for (``disk_mib``; None: the default)."""
        asked = {} if disk_mib is None else {"disk_mib": disk_mib}
        return Limits(lifetime_seconds=float(timeout_seconds) + LIFETIME_GRACE_SECONDS, **asked)

    def compute_rate(self, limits: Limits, price_book: PriceBook) -> int:
        """Micros per second of a sandbox of ``limits`` (``PriceBook.compute_micros``)."""
        return int(
            price_book.compute_micros(
                vcpu_seconds=limits.cpus, gib_seconds=limits.memory_mib / 1024
            )
        )

    async def isolation_for(self, requested: str) -> str:
        """The level ``requested`` resolves to here (``resolve_isolation``), reused for
        ``HOST_FACTS_SECONDS``; a level that cannot run raises every time."""
        hit = self._host_facts.get(("isolation", requested))
        if hit is not None and time.monotonic() - hit[0] < HOST_FACTS_SECONDS:
            return str(hit[1])
        level = await resolve_isolation(requested, self.settings)
        self._host_facts[("isolation", requested)] = (time.monotonic(), level)
        return level

    async def require_isolation(self, requested: str, *, disk_mib: int | None = None) -> str:
        """:meth:`isolation_for` at admission: a level that cannot run here is a 422 naming
        the request's ``isolation`` (runs and sessions are admitted with the same check), and
        a ``disk_mib`` a microVM cannot hold one naming ``disk_mib``."""
        try:
            level = await self.isolation_for(requested)
        except errors.IsolationUnavailable as exc:
            raise errors.IsolationUnavailable(
                exc.detail, errors=[{"field": "isolation", "message": exc.detail}]
            ) from exc
        # A microVM's writable root is a tmpfs in the guest's own memory (no disk-backed layer
        # there yet): a larger one would not fail with ENOSPC but with the guest out of memory.
        cap = self.settings.disk_tmpfs_max_mib
        if level.startswith("microvm") and disk_mib is not None and disk_mib > cap:
            raise errors.InvalidRequest.field(
                "disk_mib",
                f"must be at most {cap} on {level} (a microVM's writable root is held in its"
                " memory, EPHEMERAL_DISK_TMPFS_MAX_MIB); a larger disk needs gvisor or namespaces",
            )
        return level

    async def require_image(self, policy: Policy) -> str | None:
        """At admission: a built image's name must be built here (else a 422 listing what
        is), and a registry reference is pulled now if this host does not have it (a 422
        naming the field for a bad reference or image, a 502 when the registry fails), so a
        run or session starts from an image resolved to its digest before anything runs.
        Returns that digest's hex for a registry reference (the run records it and its sandbox
        boots it: :meth:`acquire`'s ``image_hash``), else None."""
        name = policy.run_image
        if name is None:
            return None
        where = "image" if policy.image is not None else "agent.image"
        if sandbox_image.is_reference(name):
            pulled = await sandbox_image.ensure(self.settings, name, field=where)
            self._host_facts.pop(("image", name), None)
            return pulled.hash
        images.require_built(self.settings, name, field=where)
        return None

    async def admitted_image(self, name: str, image_hash: str | None) -> images.ImageConfig | None:
        """The image a run or session was admitted with: for a registry reference, the digest
        admission recorded (``image_hash``; pulled again by that digest if it is gone here),
        else the current build of ``name`` (:meth:`built_image`)."""
        if image_hash is not None and sandbox_image.is_reference(name):
            return await sandbox_image.ensure_admitted(self.settings, name, image_hash)
        return self.built_image(name)

    def built_image(self, name: str) -> images.ImageConfig | None:
        """The current build of image ``name`` (``images.built_image``), reused for
        ``HOST_FACTS_SECONDS``."""
        hit = self._host_facts.get(("image", name))
        if hit is not None and time.monotonic() - hit[0] < HOST_FACTS_SECONDS:
            found = cast(images.ImageConfig, hit[1])
            # a Dockerfile image's name moves to its new build at once (build_dockerfile)
            if found.dockerfile is None or (
                images.dockerfile_image_dir(self.settings, name) == found.rootfs.parent
            ):
                return found
        built = sandbox_image.built_image(self.settings, name)
        if built is not None:  # one built a moment from now is seen at once
            self._host_facts[("image", name)] = (time.monotonic(), built)
        return built

    async def start_pool(self) -> None:
        from ephemeral.sandbox.pool import WarmPool

        self._pool_asked = True
        isolation = await resolve_isolation(self.settings.isolation, self.settings)
        pool = WarmPool(
            get_driver(isolation, self.settings),
            self.settings.pool_size,
            self.limits(120),
            boots=self._boots,
        )
        progress.stage(f"booting the warm pool ({self.settings.pool_size} {isolation} sandboxes)")
        await pool.start()
        # Per image: the pool holds sandboxes of the default image; a run naming another image
        # starts its sandbox cold (bench/images.py measures what that costs).
        self.pools[(isolation, self.settings.image)] = pool

    async def ensure_pool(self) -> None:
        """A source started without a warm pool (a runtime started with ``warm_pool=False``)
        gets one of ``pool_size`` when first asked: later sandboxes start warm. Nothing happens
        when there is a pool already or ``pool_size`` is 0."""
        if self._pool_asked or self.pools or self.settings.pool_size == 0:
            return
        await self.start_pool()

    async def acquire(
        self, policy: Policy, owner: str, limits: Limits, image_hash: str | None = None
    ) -> Sandbox:
        """A sandbox for the run or session ``owner``: warm from the pool, else booted; of
        the digest ``image_hash`` when its image is a registry reference (the one admission
        recorded: :meth:`require_image`).

        A boot that fails is tried again (``BOOT_ATTEMPTS`` in all): nothing has happened in a
        sandbox that never started. (The burst failures that made this necessary, runsc's
        "cannot read client sync file", were the server's loop leaking fds into runsc: fixed
        in ``spawn.py``; the retry stays for what a loaded host still throws at a boot.)"""
        for attempt in range(1, BOOT_ATTEMPTS + 1):
            try:
                return await self._acquire_once(policy, owner, limits, image_hash)
            except errors.SandboxError as exc:
                if attempt == BOOT_ATTEMPTS:
                    raise
                log.warning(
                    "%s: sandbox boot failed (attempt %d of %d): %s",
                    owner,
                    attempt,
                    BOOT_ATTEMPTS,
                    exc.detail,
                )
                await asyncio.sleep(BOOT_RETRY_SECONDS * attempt)
        raise AssertionError("unreachable")

    async def _acquire_once(
        self, policy: Policy, owner: str, limits: Limits, image_hash: str | None
    ) -> Sandbox:
        isolation = await self.isolation_for(policy.isolation)
        image = policy.run_image or self.settings.image
        boot = image
        if image_hash is not None and sandbox_image.is_reference(image):
            # the admitted digest, never what the name means now (a pull or rm since)
            boot = sandbox_image.pinned_reference(image, image_hash)
        pool = self.pools.get((isolation, image)) if boot == image else None
        # a warm sandbox has the pool's cpus, memory, pids and disk: other limits boot cold
        if pool is not None and _same(pool.limits, limits):
            sandbox: Sandbox = await pool.acquire(owner, limits)
            return sandbox
        settings = self.settings
        if boot != settings.image:
            settings = settings.model_copy(update={"image": boot})
        async with self._boots:
            sandbox = await get_driver(isolation, settings).create(owner=owner, limits=limits)
        sandbox.image = image  # the name as asked; the digest is the run's image_hash
        return sandbox

    async def close(self) -> None:
        for pool in self.pools.values():
            await pool.close()


def _same(warm: Limits, asked: Limits) -> bool:
    """Whether a warm sandbox of ``warm`` serves ``asked`` (its lifetime restarts when adopted)."""
    return warm.model_copy(update={"lifetime_seconds": 0}) == asked.model_copy(
        update={"lifetime_seconds": 0}
    )
