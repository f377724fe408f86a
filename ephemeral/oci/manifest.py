"""OCI and Docker v2 schema 2 documents: media types, bounds, and the checks a pull applies.

Everything here comes from a registry and is hostile until checked: sizes are bounded before
anything is fetched (a manifest that points at a 1 GiB config is refused from its descriptor),
every digest is one this project verifies, and the platform is chosen from an index the way
Docker does for ``linux/amd64``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ephemeral import errors
from ephemeral.oci.reference import check_digest

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
INDEXES = (OCI_INDEX, DOCKER_LIST)
MANIFESTS = (OCI_MANIFEST, DOCKER_MANIFEST)
ACCEPT = ", ".join((*MANIFESTS, *INDEXES))
CONFIGS = (OCI_CONFIG, DOCKER_CONFIG)
# layer media type -> compression ("" for a plain tar); the content is sniffed as well
LAYERS = {
    "application/vnd.oci.image.layer.v1.tar": "",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
}

# containerd and Docker refuse manifests past 4 MiB; a config is a few KiB in practice.
MAX_MANIFEST_BYTES = 4 << 20
MAX_CONFIG_BYTES = 8 << 20
MAX_LAYERS = 127  # Docker's limit on an image's layers (and what one overlay mount takes here)
PLATFORM = ("linux", "amd64")


class BadImage(errors.InvalidRequest):
    """The registry's content is not an image this project will run (422 naming ``image``)."""


def bad(why: str) -> BadImage:
    return BadImage(f"image: {why}", errors=[{"field": "image", "message": why}])


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: tuple[str, str, str] | None = None  # os, architecture, variant

    @classmethod
    def parse(cls, raw: Any, where: str) -> Descriptor:
        if not isinstance(raw, dict):
            raise bad(f"{where}: a descriptor must be an object")
        media, digest, size = raw.get("mediaType"), raw.get("digest"), raw.get("size")
        if not isinstance(media, str) or not isinstance(digest, str):
            raise bad(f"{where}: a descriptor needs mediaType and digest")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise bad(f"{where}: a descriptor's size must be a non-negative integer")
        try:
            check_digest(digest)
        except errors.InvalidRequest as exc:
            raise bad(f"{where}: {exc.detail}") from exc
        plat = raw.get("platform")
        platform = None
        if isinstance(plat, dict):
            platform = (
                str(plat.get("os", "")),
                str(plat.get("architecture", "")),
                str(plat.get("variant", "")),
            )
        return cls(media[:200], digest, size, platform)


def load_json(body: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"the {what} is not JSON") from exc
    if not isinstance(doc, dict):
        raise bad(f"the {what} is not a JSON object")
    return doc


def media_type_of(doc: dict[str, Any], header: str | None) -> str:
    """A document's media type: its own ``mediaType``, else the response's Content-Type."""
    media = doc.get("mediaType")
    if isinstance(media, str) and media:
        return media
    if header:
        return header.split(";", 1)[0].strip()
    raise bad("the manifest names no media type")


def choose_platform(doc: dict[str, Any]) -> Descriptor:
    """The ``linux/amd64`` manifest of an index (as Docker picks on this host: no variant or
    ``v1`` first, then any amd64 variant), or a refusal naming the platforms it has."""
    raw = doc.get("manifests")
    if not isinstance(raw, list) or len(raw) > 1024:
        raise bad("the index has no manifest list (or more than 1024 entries)")
    found = [Descriptor.parse(m, f"manifests[{i}]") for i, m in enumerate(raw)]
    wanted = [d for d in found if d.platform and d.platform[:2] == PLATFORM]
    wanted.sort(key=lambda d: d.platform is not None and d.platform[2] not in ("", "v1"))
    for d in wanted:
        if d.media_type in MANIFESTS:
            return d
    have = sorted({"/".join(p for p in d.platform if p) for d in found if d.platform})
    raise bad(f"no linux/amd64 image in the index (it has: {', '.join(have) or 'none'})")


@dataclass
class ImageManifest:
    config: Descriptor
    layers: list[Descriptor] = field(default_factory=list)

    @classmethod
    def parse(cls, doc: dict[str, Any], max_layer_bytes: int) -> ImageManifest:
        config = Descriptor.parse(doc.get("config"), "config")
        if config.media_type not in CONFIGS:
            raise bad(f"config media type {config.media_type!r} is not an image config")
        if config.size > MAX_CONFIG_BYTES:
            raise bad(
                f"the manifest's config is {config.size} bytes; at most {MAX_CONFIG_BYTES} are read"
            )
        raw = doc.get("layers")
        if not isinstance(raw, list) or not raw:
            raise bad("the manifest has no layers")
        if len(raw) > MAX_LAYERS:
            raise bad(f"the manifest has {len(raw)} layers; at most {MAX_LAYERS} are stacked")
        layers = [Descriptor.parse(d, f"layers[{i}]") for i, d in enumerate(raw)]
        for i, d in enumerate(layers):
            if d.media_type not in LAYERS:
                raise bad(
                    f"layers[{i}]: media type {d.media_type!r} is not a layer this host unpacks"
                )
            if d.size > max_layer_bytes:
                raise bad(f"layers[{i}] is {d.size} bytes, over the limit of {max_layer_bytes}")
        return cls(config, layers)


@dataclass(frozen=True)
class RunConfig:
    """What of an image's config a sandbox honours (``Env``, ``WorkingDir``, ``User``) and
    what is kept for display (``Entrypoint``, ``Cmd``), plus the layers' diff ids."""

    diff_ids: tuple[str, ...]
    env: dict[str, str]
    workdir: str | None
    user: str | None
    entrypoint: list[str] | None
    cmd: list[str] | None

    @classmethod
    def parse(cls, body: bytes, layers: int) -> RunConfig:
        doc = load_json(body, "config")
        if (doc.get("os"), doc.get("architecture")) != PLATFORM:
            raise bad(f"the image is {doc.get('os')}/{doc.get('architecture')}, not linux/amd64")
        rootfs = doc.get("rootfs")
        if not isinstance(rootfs, dict) or rootfs.get("type") != "layers":
            raise bad("the config's rootfs is not of type layers")
        diff_ids = rootfs.get("diff_ids")
        if not isinstance(diff_ids, list) or len(diff_ids) != layers:
            raise bad("the config's rootfs.diff_ids do not match the manifest's layers")
        for i, d in enumerate(diff_ids):
            if not isinstance(d, str) or not d.startswith("sha256:"):
                raise bad(f"rootfs.diff_ids[{i}] is not a sha256 digest")
            try:
                check_digest(d)
            except errors.InvalidRequest as exc:
                raise bad(f"rootfs.diff_ids[{i}]: {exc.detail}") from exc
        conf = doc.get("config") or {}
        if not isinstance(conf, dict):
            raise bad("the config's config is not an object")
        env: dict[str, str] = {}
        for item in conf.get("Env") or []:
            if isinstance(item, str) and "=" in item:
                k, _, v = item.partition("=")
                if k and "\0" not in item:
                    env[k] = v
        workdir = conf.get("WorkingDir") or None
        if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/")):
            workdir = None  # Docker makes a relative one absolute; nothing sane uses it
        user = conf.get("User") or None

        def strings(v: Any) -> list[str] | None:
            return [str(x) for x in v] if isinstance(v, list) else None

        return cls(
            diff_ids=tuple(diff_ids),
            env=env,
            workdir=workdir,
            user=str(user) if user is not None else None,
            entrypoint=strings(conf.get("Entrypoint")),
            cmd=strings(conf.get("Cmd")),
        )
