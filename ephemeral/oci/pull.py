"""Pull an image: resolve its reference, fetch and check its manifest and config, and make
each of its layers present in the store once (download, verify, unpack, verify the diff id).

``ensure_image`` is what admission calls: an image already pulled under that reference is used
as it is (no registry is contacted, as ``docker run`` does); ``pull`` always asks the registry
what the tag means now (``ephemeral images pull``). Concurrent pulls of the same layer unpack it
once: a per-layer lock, and the store's commit keeps the first complete copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import time
from pathlib import Path

from ephemeral import errors
from ephemeral.oci import manifest as m
from ephemeral.oci import reference
from ephemeral.oci.registry import Registry
from ephemeral.oci.store import LayerInfo, LayerStore, PulledImage
from ephemeral.oci.unpack import Budget, unpack_layer
from ephemeral.sandbox.cache_use import mark_used
from ephemeral.settings import Settings

PARALLEL_LAYERS = 3


async def ensure_image(settings: Settings, text: str, field: str = "image") -> PulledImage:
    """The image ``text`` names, pulled now only if this host does not have it."""
    ref = reference.parse(text, field)
    found = LayerStore(settings).resolve(ref)
    if found is not None:
        return found
    return await pull(settings, text, field)


async def pull(settings: Settings, text: str, field: str = "image") -> PulledImage:
    ref = reference.parse(text, field)
    store = LayerStore(settings)
    store.ensure()
    lock_fd = await asyncio.to_thread(_lock_shared, store)
    try:
        return await _pull(settings, store, ref)
    finally:
        os.close(lock_fd)


def _lock_shared(store: LayerStore) -> int:
    fd = os.open(store.root / ".lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)  # gc holds it exclusively
    return fd


async def _pull(settings: Settings, store: LayerStore, ref: reference.Reference) -> PulledImage:
    if ref.digest is not None:
        cached = store.resolve(ref)
        if cached is not None:  # a digest names the same bytes forever
            return cached
    async with Registry(settings, ref) as reg:
        body, doc, media, digest = await reg.manifest(ref.target)
        if media in m.INDEXES:
            chosen = m.choose_platform(doc)
            body, doc, media, digest = await reg.manifest(chosen.digest)
        if media not in m.MANIFESTS:
            raise m.bad(f"media type {media!r} is not an image manifest this host pulls")
        existing = store.image(digest)
        if existing is not None and store.complete(existing):
            store.set_ref(ref, digest)
            return existing
        man = m.ImageManifest.parse(doc, settings.image_max_layer_mib << 20)
        config_body = await reg.small_blob(man.config, m.MAX_CONFIG_BYTES)
        config = m.RunConfig.parse(config_body, len(man.layers))
        budget = Budget(
            bytes=settings.image_max_unpacked_mib << 20, entries=settings.image_max_files
        )
        at_once = asyncio.Semaphore(PARALLEL_LAYERS)

        async def one(i: int) -> LayerInfo:
            async with at_once:
                return await _ensure_layer(store, reg, man.layers[i], config.diff_ids[i], budget)

        layers = list(await asyncio.gather(*(one(i) for i in range(len(man.layers)))))
        total = sum(layer.unpacked_bytes for layer in layers)
        if total > settings.image_max_unpacked_mib << 20:
            raise m.bad(f"the image unpacks to {total} bytes, over image_max_unpacked_mib")
        store.put_blob(digest, body)
        store.put_blob(man.config.digest, config_body)
        image = PulledImage(
            digest=digest,
            reference=str(ref),
            config_digest=man.config.digest,
            layers=layers,
            env=config.env,
            workdir=config.workdir,
            user=config.user,
            entrypoint=config.entrypoint,
            cmd=config.cmd,
            pulled_at=time.time(),
        )
        store.put_image(image)
        store.set_ref(ref, digest)
        return image


async def _ensure_layer(
    store: LayerStore, reg: Registry, d: m.Descriptor, diff_id: str, budget: Budget
) -> LayerInfo:
    info = store.layer_info(diff_id)
    if info is None:
        lock = store.tmp / f"{diff_id.split(':')[1]}.lock"
        fd = os.open(lock, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
            info = store.layer_info(diff_id)  # another pull may have made it meanwhile
            if info is None:
                info = await _fetch_layer(store, reg, d, diff_id, budget)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                lock.unlink()
    mark_used(store.layer_dir(diff_id))  # a pull is a use (images gc: least recently used)
    return LayerInfo(
        digest=d.digest,
        diff_id=diff_id,
        size=d.size,
        unpacked_bytes=int(info.get("unpacked_bytes", 0)),
        entries=int(info.get("entries", 0)),
    )


async def _fetch_layer(
    store: LayerStore, reg: Registry, d: m.Descriptor, diff_id: str, budget: Budget
) -> dict[str, int]:
    work = store.tmp / f"layer-{diff_id.split(':')[1]}-{os.getpid()}-{time.monotonic_ns()}"
    work.mkdir(mode=0o700)
    try:
        blob = work / "blob"
        await reg.blob_to_file(d, blob)
        tree = work / "fs"
        try:
            done = await asyncio.to_thread(unpack_layer, blob, tree, budget)
        except errors.SandboxError as exc:  # hostwrite's refusals: the layer is hostile
            raise m.bad(f"layer {d.digest}: {exc.detail}") from exc
        if done.diff_id != diff_id:
            raise m.bad(f"layer {d.digest} unpacks to {done.diff_id}, the config says {diff_id}")
        blob.unlink()
        info = {"unpacked_bytes": done.bytes, "entries": done.entries, "skipped": done.skipped}
        store.commit_layer(diff_id, tree, info)
        return info
    finally:
        await asyncio.to_thread(shutil.rmtree, work, True)


def pulled_layers(store: LayerStore, image: PulledImage) -> list[Path]:
    """The image's unpacked layers, lowest first."""
    return [store.layer_root(layer.diff_id) for layer in image.layers]
