"""The host resolves an exec ``user`` to ids exactly as the guest agent does (issue 18, item 3).

The agent's ``lookup_user`` runs here on the same passwd text (its module loaded from the image
definition, its read of /etc/passwd pointed at the text), so the two rule sets cannot drift."""

from __future__ import annotations

import importlib.util
import io
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ephemeral.sandbox import users
from ephemeral.settings import REPO_ROOT

AGENT = REPO_ROOT / "sandbox_images" / "default" / "guest" / "agent.py"
PASSWD = (
    "root:x:0:0:root:/root:/bin/bash\n"
    "sync:x:4:65534:sync:/bin:/bin/sync\n"
    "worker:x:1000:1000::/home/worker:/bin/sh\n"
    "toor:x:0:0:another root:/root:/bin/sh\n"  # a hostile image: a second name for uid 0
    "arab:x:\u0660:0::/:/bin/sh\n"  # a uid of non-ASCII digits: skipped by both
    "big:x:4294967295:1::/:/bin/sh\n"  # (uid_t)-1: skipped by both
    "short:x:7\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
)
SPELLINGS = [
    "root", "0", "00", "0000", "0000000000", "toor", "worker", "1000", "01000", "sync",
    "4", "nobody", "65534", "70000", "arab", "big", "short", "7", "missing", "\u0660",
    "+0", " 0", "0 ", "-0", "4294967294", "4294967295", "9999999999",
]  # fmt: skip


def _agent(passwd: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("guest_agent_under_test", AGENT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def fake_open(path: str, mode: str = "r", *a: Any, **kw: Any) -> io.BytesIO:
        assert path == "/etc/passwd" and mode == "rb"
        return io.BytesIO(passwd.encode())

    mod.open = fake_open  # type: ignore[attr-defined]  # the module's global shadows open()
    return mod


def _guest(mod: ModuleType, user: str) -> object:
    try:
        found = mod.lookup_user(user)
    except mod.OpError as exc:
        return ("refused", exc.kind)
    return None if found is None else tuple(found[:2])


def _host(user: str) -> object:
    try:
        ids = users.resolve(user, PASSWD)
    except ValueError:
        return ("refused", "bad_user")
    return None if ids is None else tuple(ids)


@pytest.mark.parametrize("user", SPELLINGS)
def test_host_and_guest_resolve_users_alike(user: str) -> None:
    assert _host(user) == _guest(_agent(PASSWD), user)


def test_every_spelling_of_uid_0_is_uid_0() -> None:
    for user in ("root", "0", "00", "0000", "0000000000", "toor"):
        assert users.resolve(user, PASSWD) == (0, 0), user
    for user in ("+0", " 0", "\u0660", "-0"):  # not numbers to the guest: unknown names
        assert users.resolve(user, PASSWD) is None, user
    assert users.resolve("01000", PASSWD) == (1000, 1000)
    assert users.resolve("70000", PASSWD) == (70000, 70000)  # no entry: the number itself


def test_the_guest_refuses_uid_0_under_no_root() -> None:
    mod = _agent(PASSWD)
    mod.NO_ROOT = True  # type: ignore[attr-defined]
    for user in ("root", "0", "00", "toor"):
        assert _guest(mod, user) == ("refused", "bad_user"), user
    assert _guest(mod, "sync") == (4, 65534)
    assert _guest(mod, "worker") == (1000, 1000)


def test_read_passwd_follows_no_link_of_the_image(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc" / "passwd").write_text(PASSWD)
    assert users.read_passwd(rootfs) == PASSWD
    secret = tmp_path / "host-file"
    secret.write_text("host:x:0:0::/:/bin/sh\n")
    (rootfs / "etc" / "passwd").unlink()
    (rootfs / "etc" / "passwd").symlink_to(secret)
    assert users.read_passwd(rootfs) is None
    (rootfs / "etc" / "passwd").unlink()
    os.mkfifo(rootfs / "etc" / "passwd")  # a fifo would block a plain open()
    assert users.read_passwd(rootfs) is None
    other = tmp_path / "etc"
    other.mkdir()
    (other / "passwd").write_text(PASSWD)
    (rootfs / "etc" / "passwd").unlink()
    (rootfs / "etc").rmdir()
    (rootfs / "etc").symlink_to(other)
    assert users.read_passwd(rootfs) is None


def test_the_group_file_is_read_as_passwd_is(tmp_path: Path) -> None:
    # the Dockerfile builder's USER NAME:GROUP reads /etc/group through the same reader
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc" / "group").write_text("staff:x:50:\n")
    assert users.read_etc(rootfs, "group") == "staff:x:50:\n"
    secret = tmp_path / "host-group"
    secret.write_text("wheel:x:0:\n")
    (rootfs / "etc" / "group").unlink()
    (rootfs / "etc" / "group").symlink_to(secret)
    assert users.read_etc(rootfs, "group") is None
