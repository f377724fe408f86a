"""The writable root over several lower layers (a pulled image): the compiled helper and the
shell fallback mount the same overlay, each layer bound at ``/run/ephemeral/lower/<i>``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ephemeral.sandbox import writable_root


@pytest.mark.parametrize("compiled", [True, False])
def test_layers_stack_topmost_first(tmp_path: Path, compiled: bool) -> None:
    top, base = tmp_path / "top", tmp_path / "base"
    (top / "a").mkdir(parents=True)
    (base / "a").mkdir(parents=True)
    (top / "a" / "f").write_text("top\n")
    (base / "a" / "f").write_text("base")
    (base / "a" / "only-base").write_text("b")
    agent = tmp_path / "agent"  # the agent runtime's mount comes with the root's
    agent.mkdir()
    helper = writable_root.helper(tmp_path / "cache") if compiled else None
    if compiled and helper is None:
        pytest.skip("gcc missing: the helper cannot be built")
    writable_root.prepare_dirs()
    script = (
        writable_root.ARGS
        + writable_root.mount_script(helper=helper, idmap_userns=None)
        + f"cat {writable_root.MOUNT_POINT}/a/f; ls {writable_root.MOUNT_POINT}/a; "
        + 'grep -o "lowerdir=[^,]*" /proc/self/mountinfo | tail -1'
    )
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
         *writable_root.args(f"{top}:{base}", 1, "layers-test", agent, None)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    lines = out.stdout.split()
    assert lines[:3] == ["top", "f", "only-base"]
    assert lines[3] == "lowerdir=/run/ephemeral/lower/0:/run/ephemeral/lower/1"  # no host path
