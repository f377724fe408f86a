"""Prefect through its public API, and each private touch named, checked at start and tested
(issue 38): ``ephemeral.flows.prefect_private``.

The source check (``ast``) finds every touch of a private part of Prefect in the modules that
import it (a private attribute read off anything but our own ``self``, a Prefect class
subclassed, an attribute of a Prefect module set) and fails on one that
``prefect_private.TOUCHES`` does not name for that module. The start check runs against the
installed Prefect, and fails naming the part when one is missing.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from ephemeral import errors
from ephemeral.settings import REPO_ROOT, Settings

ROOTS = ("ephemeral", "flows", "tasks")
CHECKER = "flows/prefect_private.py"  # names and checks the touches: reads each itself


def _private(attr: str) -> bool:
    dunder = attr.startswith("__") and attr.endswith("__")
    return attr == "__var__" or (attr.startswith("_") and not dunder)


def private_touches(path: Path) -> list[tuple[int, str, str]]:
    """(line, attribute, what) for each touch of Prefect's private parts in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    from_prefect: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "prefect":
            from_prefect |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            from_prefect |= {
                a.asname or a.name.split(".")[0]
                for a in node.names
                if a.name.split(".")[0] == "prefect"
            }
    try:  # the Prefect layer is checked whether or not a module imports Prefect itself
        layer = path.resolve().relative_to(REPO_ROOT.resolve()).parts[0] in ("flows", "tasks")
    except ValueError:
        layer = False
    if not from_prefect and not layer:
        return []
    found: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                if isinstance(base, ast.Name) and base.id in from_prefect:
                    found.append((node.lineno, base.id, f"class {node.name}({base.id})"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))
        ):
            found.append((node.lineno, node.args[1].value, ast.unparse(node)))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            ours = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if not ours:
                found.append((node.lineno, node.attr, ast.unparse(node)))
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id in from_prefect
                ):
                    found.append((node.lineno, target.attr, f"sets {ast.unparse(target)}"))
    return found


def module_file(dotted: str) -> str:
    """``ephemeral.flows.executor.FlowExecutor.execute`` -> ``flows/executor.py`` (the longest
    prefix that is a file; ``ephemeral/flows`` links to the top-level folder)."""
    parts = dotted.split(".")
    if parts[1] in ("flows", "tasks"):
        parts = parts[1:]
    for end in range(len(parts), 0, -1):
        rel = "/".join(parts[:end]) + ".py"
        if (REPO_ROOT / rel).is_file():
            return rel
    raise AssertionError(f"no module in {dotted}")


def named_touches() -> dict[str, set[str]]:
    """Module path -> the attributes ``prefect_private.TOUCHES`` names for it."""
    from ephemeral.flows.prefect_private import TOUCHES

    named: dict[str, set[str]] = {}
    for touch in TOUCHES:
        path = module_file(touch.used_by)
        attrs = {name.strip().split(".")[-1] for name in touch.name.split(",")}
        named.setdefault(path, set()).update(attrs)
    return named


def test_every_private_touch_of_prefect_is_named() -> None:
    named = named_touches()
    unnamed = []
    for root in ROOTS:
        for path in sorted((REPO_ROOT / root).rglob("*.py")):
            rel = path.relative_to(REPO_ROOT).as_posix()
            if rel == CHECKER:
                continue
            for line, attr, what in private_touches(path):
                if attr not in named.get(rel, set()):
                    unnamed.append(f"{rel}:{line}: {what}")
    assert not unnamed, f"private parts of Prefect touched but not named: {unnamed}"


def test_every_named_touch_is_still_made() -> None:
    """A touch that is gone from the code is gone from the list (and the docs) too."""
    for rel, attrs in named_touches().items():
        made = {attr for _, attr, _ in private_touches(REPO_ROOT / rel)}
        assert attrs <= made, (rel, attrs - made)


def test_the_checker_sees_the_old_worker(tmp_path: Path) -> None:
    """The shapes the worker had before it used Prefect's public API only."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from prefect.task_worker import TaskWorker\n"
        "from prefect.server.api import server\n"
        "class HostWorker(TaskWorker):\n"
        "    async def _acquire_token(self, task_run_id):\n"
        "        if self._limiter is not None and self._limiter.available_tokens < 1:\n"
        "            run = await self._client.read_task_run(task_run_id)\n"
        "        return await super()._acquire_token(task_run_id)\n"
        "server.subprocess = None\n"
        "def wrap(client):\n"
        "    return client._client._transport\n"
    )
    found = sorted((line, attr) for line, attr, _ in private_touches(probe))
    assert found == [
        (3, "TaskWorker"),
        (7, "_acquire_token"),
        (8, "subprocess"),
        (10, "_client"),
        (10, "_transport"),
    ], found


def test_the_installed_prefect_has_every_part_we_touch() -> None:
    from ephemeral.flows import prefect_private

    assert prefect_private.problems(embedded=True) == []
    prefect_private.check(embedded=True)


def test_a_missing_server_subprocess_fails_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.server.api import server

    from ephemeral.flows import prefect_private

    monkeypatch.setattr(server, "subprocess", object())
    with pytest.raises(errors.PrefectIncompatible) as caught:
        prefect_private.check(embedded=True)
    assert "prefect.server.api.server.subprocess" in caught.value.detail
    assert "guard_embedded_server" in caught.value.detail
    # A process without the embedded server does not touch it, so does not need it.
    prefect_private.check(embedded=False)


def test_a_client_without_its_httpx_client_fails_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import prefect.client.orchestration as orchestration

    from ephemeral.flows import prefect_private

    class PrefectClient:  # a Prefect whose client keeps its httpx client elsewhere
        def __init__(self, api: str) -> None:
            self.http = api

    monkeypatch.setattr(orchestration, "PrefectClient", PrefectClient)
    with pytest.raises(errors.PrefectIncompatible) as caught:
        prefect_private.check(embedded=True)
    assert "PrefectClient._client" in caught.value.detail
    assert "retry_when_busy" in caught.value.detail


def test_an_untested_prefect_version_fails_at_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from ephemeral.flows import embedded_server, prefect_private

    monkeypatch.setattr(prefect_private, "version", lambda _name: "3.99.0")
    monkeypatch.setattr(embedded_server, "guard_embedded_server", lambda: None)
    with pytest.raises(errors.PrefectIncompatible) as caught:
        embedded_server.configure(Settings.load(state_dir=tmp_path / "state"))
    assert "Prefect 3.99.0 is not a version Ephemeral was tested with" in caught.value.detail


def test_retry_when_busy_refuses_a_client_it_cannot_wrap() -> None:
    from ephemeral.flows.prefect_client import retry_when_busy

    client: Any = object()
    with pytest.raises(errors.PrefectIncompatible, match=r"PrefectClient\._client\._transport"):
        retry_when_busy(client)
