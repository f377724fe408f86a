"""OCI image layouts made in Python for the registry tests (pushed with skopeo).

A layer is a tar built from a list of entries; ``image`` writes its blobs, config and manifest
into an OCI layout directory and returns the manifest's descriptor. Nothing here is code under
test: tarfile only *writes* the test's own archives.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"


@dataclass
class Entry:
    path: str
    data: bytes = b""
    kind: bytes = tarfile.REGTYPE
    mode: int = 0o644
    link: str = ""
    uid: int = 0
    gid: int = 0


def file(path: str, data: bytes | str = b"", mode: int = 0o644) -> Entry:
    return Entry(path, data.encode() if isinstance(data, str) else data, mode=mode)


def directory(path: str, mode: int = 0o755) -> Entry:
    return Entry(path, kind=tarfile.DIRTYPE, mode=mode)


def symlink(path: str, target: str) -> Entry:
    return Entry(path, kind=tarfile.SYMTYPE, link=target, mode=0o777)


def hardlink(path: str, target: str) -> Entry:
    return Entry(path, kind=tarfile.LNKTYPE, link=target)


def tar(entries: list[Entry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for e in entries:
            info = tarfile.TarInfo(e.path)
            info.type = e.kind
            info.mode = e.mode
            info.uid, info.gid = e.uid, e.gid
            info.linkname = e.link
            info.mtime = 1_700_000_000
            if e.kind == tarfile.REGTYPE:
                info.size = len(e.data)
                t.addfile(info, io.BytesIO(e.data))
            else:
                t.addfile(info)
    return buf.getvalue()


def tar_of_tree(root: Path, members: list[str]) -> bytes:
    """A layer holding ``members`` (paths relative to ``root``, recursively) of a real rootfs."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for m in members:
            t.add(root / m, arcname=m, recursive=True)
    return buf.getvalue()


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Layout:
    """An OCI layout directory being filled: blobs, then ``index.json`` on :meth:`close`."""

    root: Path
    manifests: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        (self.root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (self.root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')

    def blob(self, data: bytes, media: str) -> dict[str, Any]:
        digest = sha(data)
        (self.root / "blobs" / "sha256" / digest.split(":")[1]).write_bytes(data)
        return {"mediaType": media, "digest": digest, "size": len(data)}

    def image(
        self,
        layers: list[bytes],
        *,
        compression: list[str] | None = None,
        config: dict[str, Any] | None = None,
        arch: str = "amd64",
    ) -> dict[str, Any]:
        descs, diff_ids = [], []
        for i, raw in enumerate(layers):
            how = (compression or [])[i] if compression and i < len(compression) else "gzip"
            if how == "zstd":
                packed, media = zstandard.ZstdCompressor().compress(raw), LAYER_ZSTD
            else:
                packed, media = gzip.compress(raw, compresslevel=1, mtime=0), LAYER_GZIP
            descs.append(self.blob(packed, media))
            diff_ids.append(sha(raw))
        conf = {
            "architecture": arch,
            "os": "linux",
            "config": config or {},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
        cdesc = self.blob(json.dumps(conf).encode(), OCI_CONFIG)
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": cdesc,
            "layers": descs,
        }
        mdesc = self.blob(json.dumps(manifest).encode(), OCI_MANIFEST)
        mdesc["platform"] = {"architecture": arch, "os": "linux"}
        return mdesc

    def tag(self, desc: dict[str, Any], name: str) -> None:
        self.manifests.append({**desc, "annotations": {"org.opencontainers.image.ref.name": name}})

    def index(self, descs: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": descs}
        return self.blob(json.dumps(body).encode(), OCI_INDEX)

    def close(self) -> None:
        (self.root / "index.json").write_text(
            json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": self.manifests})
        )
