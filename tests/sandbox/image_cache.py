"""Build real images in a test's own cache: the shared mmdebstrap layer is linked, never written.

A derived image whose chain adds no packages reuses the default image's mmdebstrap layer, so it
builds in seconds; every image of the test (and the build's partial directories) lives under the
test's tmp directory, so other users of the shared cache see nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ephemeral.sandbox import agent_runtime, images
from ephemeral.settings import Settings
from tests.drivers import unavailable


def isolated_settings(
    tmp_path: Path, defs: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> Settings:
    """Settings whose image cache is ``tmp_path/cache``, holding a link to the shared
    mmdebstrap layer of ``name``'s chain (skips when that layer is not built)."""
    shared = Settings.load(images_dir=defs)
    settings = Settings.load(
        state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", images_dir=defs
    )
    layers = images.chain(images.definition_dir(settings, name))
    link_shared_layer(settings, shared, images._layer_spec([d for _, d in layers]))
    if name != agent_runtime.SOURCE_IMAGE:
        link_runtime_source(settings)
    # the microVM's boot artifacts are another module's business and take minutes
    monkeypatch.setattr(images, "build_with_image", lambda *_: None)
    return settings


def link_shared_layer(
    settings: Settings, shared: Settings, spec: dict[str, Any], of: str = ""
) -> None:
    """Link the mmdebstrap layer of ``spec`` in ``shared``'s cache into ``settings``' cache
    (skips when that layer is not built; ``of`` names its image in the reason)."""
    digest = images._base_hash(spec)[:16]
    layer = shared.image_cache_dir / "base" / digest
    if not (layer / "done").is_file():
        unavailable(f"the mmdebstrap layer {layer}{of} is not built (make setup)")
    link = settings.image_cache_dir / "base" / digest
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(layer)


def link_runtime_source(settings: Settings) -> None:
    """Link the shared build of the image the agent runtime is made of (``default``) into
    ``settings``' cache, so a sandbox started there does not build it again (when the shared
    cache has it: else the first sandbox builds it, as anywhere)."""
    shared = Settings.load(images_dir=settings.images_dir)
    built = images.image_dir(shared, agent_runtime.SOURCE_IMAGE)
    link = settings.image_cache_dir / built.name
    if (built / "image.json").is_file() and not link.exists():
        settings.image_cache_dir.mkdir(parents=True, exist_ok=True)
        link.symlink_to(built)
