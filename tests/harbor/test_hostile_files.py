"""Files between a Harbor trial's sandbox and the host, on real sandboxes (issue 35, findings 1
and 4), driven from Harbor's venv by tests/harbor/hostile_probe.py:

- the sandbox's root replaces ``tar`` with a script printing the CVE-2025-4517 archive; Harbor's
  ``download_dir``, ``download_dir_with_exclusions`` and ``download_dir_filtered`` leave the
  canary beside the target as it was, make nothing next to it and write only regular files and
  directories (before: the canary was overwritten and ``newfile`` made, as root);
- a task whose ``environment/`` is a link to a host directory holding a 0600 key, or whose
  ``environment/``, ``tests/`` or ``solution/`` holds a link to it, is refused naming the link;
  the key never reaches the sandbox (before: it was copied into the workdir);
- two environments that differ only in ``.git`` get two images (before: one name, re-pointed
  by whichever built last)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.harbor import tasks

pytestmark = pytest.mark.sandbox


def _probe(tmp_path: Path, isolation: str, part: str) -> dict[str, object]:
    why = tasks.harbor_missing()
    if why is not None:
        pytest.skip(why)
    done = subprocess.run(
        [str(tasks.HARBOR_VENV / "bin" / "python"),
         str(Path(__file__).with_name("hostile_probe.py")), isolation, part],
        env=tasks.harbor_env(tmp_path / "state"), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return seen


def test_a_hostile_tar_writes_nothing_outside_the_download(tmp_path: Path, isolation: str) -> None:
    seen = _probe(tmp_path, isolation, "downloads")
    assert seen["tar_replaced"] is True
    assert seen["flag"] == "canary"
    assert seen["outside"] == ["dots", "excl0", "filtd", "flag", "plain"]  # no newfile, dotdot
    for how in ("plain", "excl0", "filtd"):
        assert seen[how] == "ok", how  # the links skipped, the rest written inside
    assert seen["bad"] == {"plain": [], "excl0": [], "filtd": []}
    assert seen["newfile"] == {"plain": True, "excl0": True, "filtd": True}  # escape/: a dir
    assert "RuntimeError" in str(seen["dotdot"]) and "a '..' component" in str(seen["dotdot"])


def test_host_files_behind_links_are_not_uploaded(tmp_path: Path, isolation: str) -> None:
    seen = _probe(tmp_path, isolation, "uploads")
    assert str(seen["linked_dir"]).startswith("refused: ephemeral environment: ")
    assert "task1/environment is a symbolic link" in str(seen["linked_dir"])
    assert "environment/id_rsa: a symbolic link" in str(seen["member"])
    assert "ok.txt" not in str(seen["member_sandbox"])  # nothing of it went in
    assert "tests/data: a symbolic link" in str(seen["tests"])
    assert "solution/solve.sh: a symbolic link" in str(seen["solve"])
    for out in (seen["member_sandbox"], seen["after"]):
        assert "PRIVATE KEY" not in str(out)


def test_environments_that_differ_only_in_git_get_two_images(
    tmp_path: Path, isolation: str
) -> None:
    """Harbor's environment_id leaves .git and __pycache__ out; the image name is the builder's
    digest of what is built (finding 9: one trial started from the other task's image)."""
    seen = _probe(tmp_path, isolation, "names")
    (env1, name1, hash1, head1), (env2, name2, hash2, head2) = seen["one"], seen["two"]  # type: ignore[misc]
    assert env1 == env2  # Harbor's own id cannot tell them apart
    assert name1 != name2
    assert name1 == "harbor-" + hash1[:34] and name2 == "harbor-" + hash2[:34]
    assert (head1, head2) == ("ref: one\n", "ref: two\n")


def test_harbors_host_writers_on_its_own_python(tmp_path: Path) -> None:
    """``_unpack`` and ``_write_file`` under Harbor's Python 3.12.1 (whose tarfile filter the
    CVE-2025-4517 chain bypasses): nothing outside the target changes, whatever the archive."""
    seen = _probe(tmp_path, "namespaces", "host")  # no sandbox is started
    for case in ("cve", "dotdot", "absolute", "links", "devices", "file_then_dir", "setuid"):
        result, unchanged, bad = seen[case]  # type: ignore[misc]
        assert unchanged is True and bad == [], (case, result)
    assert seen["cve"][0] == "ok, skipped 19"  # type: ignore[index]
    assert seen["links"][0] == "ok, skipped 2"  # type: ignore[index]  # out/ is a directory
    assert "a '..' component" in seen["dotdot"][0]  # type: ignore[index]
    assert "an absolute path" in seen["absolute"][0]  # type: ignore[index]
    assert seen["devices"][0] == "ok, skipped 2"  # type: ignore[index]
    assert "a link or not a directory" in seen["file_then_dir"][0]  # type: ignore[index]
    assert seen["write_file"] == ["canary", False]  # the link replaced, not written through
