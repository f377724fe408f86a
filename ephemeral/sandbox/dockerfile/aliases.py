"""Which of our images a ``FROM`` or a ``docker_image`` name stands for: Debian bookworm is
``default``, one of our images is itself, and ``ephemeral images alias`` maps other names."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ephemeral import errors
from ephemeral.sandbox import images
from ephemeral.settings import Settings

# Debian 12 by any of its tags (dated, slim, pinned by digest): our mmdebstrap base of the
# host's mirror stands for all of them (a pinned digest is not reproduced)
DEBIAN_BASES = re.compile(
    r"((docker\.io/)?library/)?debian:(bookworm|12(\.[0-9]+)?)(-[0-9]{8})?(-slim)?"
    r"(@sha256:[0-9a-f]{64})?"
)


NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,40}")


def _aliases_path(settings: Settings) -> Path:
    return settings.image_cache_dir / "aliases.json"


def aliases(settings: Settings) -> dict[str, str]:
    """The local map of ``docker_image`` names to our images (``ephemeral images alias``)."""
    try:
        raw = json.loads(_aliases_path(settings).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {}


_DOCKER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}")


def set_alias(settings: Settings, name: str, image: str) -> None:
    """Make ``docker_image`` name ``name`` mean our image ``image`` (which must exist)."""
    if not _DOCKER_NAME.fullmatch(name):
        raise errors.InvalidRequest.field("name", f"{name!r} is not an image name")
    if _our_image(settings, image) is None:
        raise errors.InvalidRequest.field(
            "image", f"{image!r} is not one of our images (sandbox_images/ or a built Dockerfile)"
        )
    current = aliases(settings)
    current[name] = image
    p = _aliases_path(settings)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(".aliases.json.tmp")
    tmp.write_text(json.dumps(current, indent=1, sort_keys=True))
    os.replace(tmp, p)


def _our_image(settings: Settings, name: str) -> str | None:
    if not NAME.fullmatch(name):
        return None
    if (settings.images_dir / name / "image.yaml").is_file():
        return name
    if images.dockerfile_image_dir(settings, name) is not None:
        return name
    return None


def resolve_image(settings: Settings, docker_image: str) -> str:
    """Our image for a ``docker_image`` name: a Debian bookworm base is ``default``, one of our
    images is itself, an alias is what it names; anything else is a DockerfileError."""
    found = _resolve(settings, docker_image)
    if found is None:
        raise errors.DockerfileError(
            f"docker_image {docker_image!r}: no image of ours is that image (build its "
            "Dockerfile with `ephemeral images build --dockerfile`, or map the name with "
            "`ephemeral images alias NAME IMAGE`)",
            errors=[{"field": "docker_image", "message": "unknown image"}],
        )
    return found


def _resolve(settings: Settings, image: str) -> str | None:
    if DEBIAN_BASES.fullmatch(image):
        return "default"
    alias = aliases(settings).get(image)
    if alias is not None:
        return _our_image(settings, alias)
    return _our_image(settings, image)
