"""Which image an image definition is built on, and where its microVM boot definition lives.

Shared by the image builder (:mod:`ephemeral.sandbox.images`) and the microVM kernel/initramfs
builder (:mod:`ephemeral.sandbox.microvm_image`), which runs as the builder's hook: here, so
neither imports the other to find a definition's base.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from ephemeral.settings import Settings


def base_name(defdir: Path) -> str | None:
    """The ``base:`` an ``image.yaml`` names, or None (no base, or not a usable name)."""
    # Read without validation: hashing must not need a valid definition (the build checks it),
    # and a definition whose base names itself must not recurse forever.
    try:
        raw = yaml.safe_load((defdir / "image.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    base = raw.get("base") if isinstance(raw, dict) else None
    if not isinstance(base, str) or base == defdir.name or "/" in base or base.startswith("."):
        return None
    return base


def dockerfile_base(settings: Settings, name: str) -> str | None:
    """The image a Dockerfile image (no definition directory) was built on, or None."""
    import json
    import re

    if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,40}", name):
        return None
    try:
        pointer = json.loads((settings.image_cache_dir / "dockerfile" / f"{name}.json").read_text())
        target = str(pointer["dir"])
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,40}-[0-9a-f]{16}", target):
            return None
        base = json.loads((settings.image_cache_dir / target / "image.json").read_text())["base"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (
        base if isinstance(base, str) and re.fullmatch(r"[a-z0-9][a-z0-9-]{0,40}", base) else None
    )


def microvm_definition_dir(settings: Settings, name: str) -> Path:
    """The ``microvm/`` boot definition of an image: its own, or the nearest base's (for an
    image built from a Dockerfile, its base's)."""
    if not (settings.images_dir / name / "image.yaml").is_file():
        name = dockerfile_base(settings, name) or name
    d = settings.images_dir / name
    seen: set[str] = set()
    while d.name not in seen:
        seen.add(d.name)
        if (d / "microvm").is_dir():
            return d / "microvm"
        base = base_name(d)
        if base is None:
            break
        d = d.parent / base
    return settings.images_dir / name / "microvm"
