"""ephemeral/sandbox/hostwrite.py: hostile archives (the CVE-2025-4517 chain, ``..``, absolute
paths, links and hard links out, devices, FIFOs, huge counts and sizes, NUL and newlines in
names, duplicates, a file then a directory of the same name) leave everything outside the target
as it was, and the target holds only regular files and directories (links too, never followed,
under the ``store`` policy image layers use). Harbor's download path runs the same writer on
real sandboxes: tests/harbor/test_hostile_download.py."""

from __future__ import annotations

import io
import os
import random
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ephemeral import errors
from ephemeral.sandbox import hostwrite
from tests.sandbox.hostile_tar import (
    KINDS,
    Member,
    archive,
    bad_entries,
    cve_2025_4517,
    raw,
    snapshot,
)

NAMES = [
    "ok", "dir", "dir/f", "link", "link/f", "./ok", "..", "../x", "a/../../x", "dir/../../x",
    "/abs", "/etc/x", "a\nb", "tab\tname", "x" * 300, "escape", "escape/newfile",
    ".hostwrite-0", "d/e/f/g",
]  # fmt: skip
TARGETS = ["/", "..", "../..", "../outside", "../outside/canary", "/etc/passwd", "ok", "dir"]


def _tree(tmp: Path) -> tuple[Path, Path]:
    """``tmp/outside/canary`` and friends, and the (empty) target ``tmp/work/target``."""
    (tmp / "outside").mkdir()
    (tmp / "outside" / "canary").write_text("canary")
    (tmp / "canary").write_text("canary")
    target = tmp / "work" / "target"
    target.mkdir(parents=True)
    return tmp, target


def _write(data: bytes, target: Path, links: hostwrite.LinkPolicy, **limits: int) -> object:
    fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
    try:
        writer = hostwrite.TreeWriter(fd, links=links, limits=hostwrite.Limits(**limits))
        return hostwrite.write_tar(io.BytesIO(data), writer)
    except errors.SandboxError as exc:
        return exc
    finally:
        os.close(fd)


def _holds(tmp: Path, target: Path, data: bytes, links: hostwrite.LinkPolicy, **kw: int) -> object:
    before = snapshot(tmp, skip=target)
    result = _write(data, target, links, **kw)
    assert snapshot(tmp, skip=target) == before
    assert bad_entries(target, links_ok=links == "store") == []
    leftovers = [p for p in target.rglob(".hostwrite-*")]
    assert leftovers == []
    return result


member = st.builds(
    Member,
    name=st.one_of(st.sampled_from(NAMES), st.text("ab/.\n", min_size=1, max_size=12)),
    kind=st.sampled_from(sorted(KINDS)),
    link=st.sampled_from(TARGETS + NAMES),
    data=st.binary(max_size=64),
    mode=st.sampled_from([0o644, 0o777, 0o4755, 0o6777, 0o1777]),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    members=st.lists(member, max_size=12),
    fmt=st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
    links=st.sampled_from(["skip", "store", "refuse"]),
)
def test_hostile_archives_change_nothing_outside(
    tmp_path_factory: pytest.TempPathFactory, members: list[Member], fmt: int, links: str
) -> None:
    tmp, target = _tree(tmp_path_factory.mktemp("hw"))
    _holds(tmp, target, archive(members, fmt=fmt), links)  # type: ignore[arg-type]


@pytest.mark.parametrize("links", ["skip", "store"])
def test_the_cve_2025_4517_chain(tmp_path: Path, links: hostwrite.LinkPolicy) -> None:
    tmp, target = _tree(tmp_path)
    (target.parent / "flag").write_text("canary")
    result = _holds(tmp, target, archive(cve_2025_4517(str(target))), links)
    assert (target.parent / "flag").read_text() == "canary"
    assert not (target.parent / "newfile").exists()
    if links == "skip":  # the links are not written: escape/ is a directory of the target
        assert isinstance(result, hostwrite.Report)
        assert (target / "escape" / "newfile").read_bytes() == b"new"
        assert (target / "flaglink").stat().st_mode & 0o7777 == 0o755  # set-uid dropped
        assert ("flaglink", "a hard link (to 'escape/flag') is not written") in result.skipped
    else:  # stored links are never followed: the write through escape/ is refused
        assert isinstance(result, errors.SandboxError)
        assert "a is a link or not a directory" in result.detail  # a/b/...: the chain


@pytest.mark.parametrize(
    ("members", "why"),
    [
        ([Member("../x", data=b"x")], "a '..' component"),
        ([Member("/abs", data=b"x")], "an absolute path"),
        ([Member("a\nb", data=b"x")], "control character"),
        ([Member("x" * 256, data=b"x")], "a name over 255 bytes"),
        ([Member("/".join(["d"] * 70), "dir")], "more than 64 levels deep"),
        ([Member("f", data=b"x"), Member("f/g", data=b"y")], "f is a link or not a directory"),
        ([Member("d", "dir"), Member("d", data=b"y")], "a file where a directory is"),
        ([Member("l", "symlink", link="/"), Member("l/x", data=b"y")], "l is a link or not"),
    ],
)
def test_refused_with_the_entry_named(tmp_path: Path, members: list[Member], why: str) -> None:
    tmp, target = _tree(tmp_path)
    result = _holds(tmp, target, archive(members, fmt=tarfile.PAX_FORMAT), "store")
    assert isinstance(result, errors.SandboxError)
    assert why in result.detail


def test_links_devices_and_fifos_are_skipped_and_reported(tmp_path: Path) -> None:
    tmp, target = _tree(tmp_path)
    members = [
        Member("f", data=b"one"),
        Member("f", data=b"two"),  # a duplicate replaces the earlier file
        Member("out", "symlink", link="../../outside/canary"),
        Member("hl", "hardlink", link="f"),
        Member("null", "chr"),
        Member("disk", "blk"),
        Member("pipe", "fifo"),
    ]
    report = _holds(tmp, target, archive(members), "skip")
    assert isinstance(report, hostwrite.Report)
    assert sorted(os.listdir(target)) == ["f"]
    assert (target / "f").read_bytes() == b"two"
    assert [p for p, _ in report.skipped] == ["out", "hl", "null", "disk", "pipe"]
    refused = _holds(tmp, target, archive(members), "refuse")
    assert isinstance(refused, errors.SandboxError) and "'out'" in refused.detail


def test_an_existing_link_in_the_target_is_replaced_not_followed(tmp_path: Path) -> None:
    tmp, target = _tree(tmp_path)
    (target / "f").symlink_to(tmp / "canary")
    os.link(tmp / "outside" / "canary", target / "g")  # a hard link to a file outside
    _write(archive([Member("f", data=b"x"), Member("g", data=b"y")]), target, "skip")
    # replaced (the outside file has one link less), never written through
    assert (tmp / "canary").read_text() == (tmp / "outside" / "canary").read_text() == "canary"
    assert (target / "f").read_bytes() == b"x" and not (target / "f").is_symlink()


@pytest.mark.parametrize(
    ("data", "limits", "why"),
    [
        (archive([Member(f"f{i}") for i in range(60)]), {"max_entries": 50}, "more than 50"),
        (archive([Member("z", data=bytes(3 << 20))]), {"max_file_bytes": 1 << 20}, "a file over"),
        (
            archive([Member(f"z{i}", data=bytes(1 << 20)) for i in range(3)]),
            {"max_total_bytes": 2 << 20},
            "more than 2097152 bytes in all",
        ),
        (archive([Member("z", data=bytes(8 << 20))]), {"max_archive_bytes": 4 << 20}, "over"),
        (raw(b"big", size_field=b"\x80" + (1 << 62).to_bytes(11, "big")), {}, "a file over"),
        (raw(b"neg", size_field=b"\xff" * 12), {}, "a negative number"),
        (raw(b"nul\0name", data=b"x") + b"", {}, None),  # the name ends at the NUL: "nul"
        (raw(b"sparse", kind=b"S"), {}, "type b'S'"),
        (raw(b"f", data=b"x")[:700], {}, "ends inside"),
        # seeded: every xdist worker must collect the same test ids
        (b"\x1f\x8b" + random.Random(0).randbytes(64), {}, "bad gzip data"),
    ],
)
def test_bounds_and_malformed_archives(
    tmp_path: Path, data: bytes, limits: dict[str, int], why: str | None
) -> None:
    tmp, target = _tree(tmp_path)
    result = _holds(tmp, target, data, "skip", **limits)
    if why is None:
        assert isinstance(result, hostwrite.Report) and os.listdir(target) == ["nul"]
    else:
        assert isinstance(result, errors.SandboxError), result
        assert why in result.detail


def test_gnu_tar_output_round_trips(tmp_path: Path) -> None:
    """What an honest GNU tar makes (long names, pax, empty dirs, modes) is written whole."""
    import shutil
    import subprocess

    if shutil.which("tar") is None:
        pytest.skip("no tar on this host")
    src = tmp_path / "src"
    deep = src / ("n" * 120) / ("m" * 120)
    deep.mkdir(parents=True)
    (deep / "f.txt").write_text("deep")
    (src / "empty").mkdir()
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o755)
    (src / "big").write_bytes(os.urandom(3 << 20))
    for fmt in ("gnu", "posix"):
        data = subprocess.run(
            ["tar", "czf", "-", f"--format={fmt}", "-C", str(src), "."],
            check=True, capture_output=True,
        ).stdout  # fmt: skip
        target = tmp_path / f"out-{fmt}"
        target.mkdir()
        report = _write(data, target, "skip")
        assert isinstance(report, hostwrite.Report) and report.skipped == []
        for p in src.rglob("*"):
            q = target / p.relative_to(src)
            assert q.is_dir() == p.is_dir()
            if p.is_file():
                assert q.read_bytes() == p.read_bytes()
                assert q.stat().st_mode == p.stat().st_mode
