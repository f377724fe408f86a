"""A pulled image as a sandbox's image: its layers under a small layer of our own (the guest
agent), and the parts of its config a sandbox honours.

An ``image`` value that is a built image's name (``[a-z0-9][a-z0-9-]*``, at most 41
characters: ``default``, ``python-dev``) keeps that meaning; any other value must be an OCI
reference (``ubuntu:24.04``, ``ghcr.io/o/i:t``, ``host:5000/r@sha256:…``). So a bare
``ubuntu`` names a built image: write ``ubuntu:latest`` (or ``docker.io/library/ubuntu``) to
pull it.

The agent layer (``<cache_dir>/oci/agent/<hash>/fs``) holds the root image's guest agent at its
image path, by the hash of its source. ``namespaces`` and ``gvisor`` no longer run it: their
agent runs on the agent runtime mounted at ``/.ephemeral`` (``sandbox/agent_runtime.py``), so
any pulled image hosts a sandbox there, with Python or without.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ephemeral import errors
from ephemeral.oci import pull as oci_pull
from ephemeral.oci import reference
from ephemeral.oci.reference import is_reference as is_reference
from ephemeral.oci.store import LayerStore, PulledImage
from ephemeral.sandbox import images
from ephemeral.sandbox.cache_use import mark_used
from ephemeral.settings import Settings


def agent_layer(settings: Settings) -> tuple[Path, str]:
    """``(layer directory, agent path in the image)``: the root image's guest agent alone,
    made once per agent source (an atomic rename: concurrent makers agree)."""
    root_dir, root = images.chain(images.definition_dir(settings, "default"))[0]
    assert root.agent is not None  # a root image has one (checked at load)
    source = (root_dir / root.agent.source).read_bytes()
    key = hashlib.sha256(source + root.agent.path.encode()).hexdigest()[:16]
    store = LayerStore(settings)
    layer = store.root / "agent" / key
    if not (layer / "fs").is_dir():
        store.ensure()
        tmp = store.tmp / f"agent-{key}-{os.getpid()}"
        target = tmp / "fs" / root.agent.path.lstrip("/")
        target.parent.mkdir(parents=True, mode=0o755)
        for d in [tmp / "fs", *target.parents]:
            if d.is_relative_to(tmp / "fs"):
                d.chmod(0o755)
        target.write_bytes(source)
        target.chmod(0o755)
        layer.parent.mkdir(exist_ok=True, mode=0o700)
        try:
            os.rename(tmp, layer)
        except OSError:
            if not (layer / "fs").is_dir():
                raise
    return layer / "fs", root.agent.path


def _config(settings: Settings, name: str, pulled: PulledImage) -> images.ImageConfig:
    store = LayerStore(settings)
    layers = [store.layer_root(layer.diff_id) for layer in pulled.layers]
    for layer in layers:  # what images gc reads as this layer's last use
        mark_used(layer.parent)
    agent_fs, agent_path = agent_layer(settings)
    # /etc/passwd as the agent will see it: the topmost layer that has one
    etc = next((p for p in reversed(layers) if (p / "etc" / "passwd").exists()), layers[-1])
    return images.ImageConfig(
        name=name,
        hash=pulled.hex,
        rootfs=etc,
        layers=[*layers, agent_fs],
        agent_path=agent_path,
        env=pulled.env,
        # as Docker's exec: the config's WorkingDir and User (root when it names none) are a
        # session exec's defaults; a run's commands still run as worker in its scratch dir
        cwd=pulled.workdir,
        # `user`, `uid`, `user:group` or `uid:gid`: the user (its group part is not applied)
        user=(pulled.user or "").split(":", 1)[0] or "root",
        pulled=True,
    )


def image_config(settings: Settings, name: str) -> images.ImageConfig | None:
    """The pulled image ``name`` as a sandbox image, or None when this host does not have it
    (never contacts a registry)."""
    try:
        ref = reference.parse(name)
    except errors.InvalidRequest:
        return None
    pulled = LayerStore(settings).resolve(ref)
    return _config(settings, name, pulled) if pulled is not None else None


def built_image(settings: Settings, name: str) -> images.ImageConfig | None:
    """What an ``image`` value names on this host, or None (never builds, never pulls): the
    pulled image for a registry reference, else the current build of that name."""
    if is_reference(name):
        return image_config(settings, name)
    return images.built_image(settings, name)


async def ensure(settings: Settings, name: str, field: str = "image") -> images.ImageConfig:
    """The image ``name``, pulled first if this host does not have it (admission)."""
    pulled = await oci_pull.ensure_image(settings, name, field)
    return _config(settings, name, pulled)


def pinned_reference(name: str, image_hash: str) -> str:
    """The reference ``name`` held to the manifest digest its admission resolved it to
    (``image_hash``, the hex a run records): what that run's sandbox boots, whatever a later
    ``pull`` or ``rm`` makes the name mean."""
    return str(reference.parse(name).with_digest(f"sha256:{image_hash}"))


async def ensure_admitted(settings: Settings, name: str, image_hash: str) -> images.ImageConfig:
    """The image admission resolved ``name`` to: from this host's store, else pulled again by
    its digest (the registry must serve those very bytes, or this raises ``RegistryError``);
    never the image the name points at now."""
    try:
        pulled = await oci_pull.ensure_image(settings, pinned_reference(name, image_hash))
    except errors.RegistryError as exc:
        raise errors.RegistryError(
            f"the image admitted as {name} (sha256:{image_hash}) is no longer on this host "
            f"and could not be pulled again by its digest: {exc.detail}"[:2000]
        ) from exc
    return _config(settings, name, pulled)
