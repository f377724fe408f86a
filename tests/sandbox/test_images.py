"""Image definitions: validation with the field named, hashing, listing and removal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ephemeral import errors
from ephemeral.sandbox import images
from ephemeral.settings import REPO_ROOT, Settings


@pytest.fixture
def defs(tmp_path: Path) -> Path:
    d = tmp_path / "images"
    shutil.copytree(
        REPO_ROOT / "sandbox_images" / "default",
        d / "default",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return d


def test_hash_changes_with_any_file_and_only_then(defs: Path) -> None:
    d = defs / "default"
    first = images.definition_hash(d)
    assert images.definition_hash(d) == first
    (d / "guest" / "agent.py").write_text((d / "guest" / "agent.py").read_text() + "\n# x\n")
    assert images.definition_hash(d) != first


def test_bad_definition_names_the_field(defs: Path) -> None:
    y = defs / "default" / "image.yaml"
    y.write_text(y.read_text().replace("uid: 1000", "uid: 0"))
    with pytest.raises(errors.InvalidRequest) as exc:
        images.load_definition(defs / "default")
    assert "user.uid" in exc.value.detail


def test_list_and_remove_cached_builds(defs: Path, tmp_path: Path) -> None:
    settings = Settings.load(
        state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", images_dir=defs
    )
    current = images.image_dir(settings, "default")
    stale = settings.image_cache_dir / "default-0000000000000000"
    for d, h in ((current, "cur"), (stale, "old")):
        (d / "rootfs").mkdir(parents=True)
        (d / "image.json").write_text(json.dumps({"name": "default", "hash": h, "built_at": 1}))
    assert images.built_rootfs(settings) == current / "rootfs"
    listed = {i.path: i.current for i in images.list_images(settings)}
    assert listed == {current: True, stale: False}
    assert images.remove_images(settings, "default", all_versions=False) == [stale]
    assert images.remove_images(settings, "default") == [current]
    assert images.built_rootfs(settings) is None


def test_missing_definition_is_a_clear_error(tmp_path: Path) -> None:
    settings = Settings.load(state_dir=tmp_path, images_dir=tmp_path)
    with pytest.raises(errors.InvalidRequest, match="image"):
        images.definition_dir(settings, "nope")
