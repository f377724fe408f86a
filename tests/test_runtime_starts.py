"""Every runtime a test starts goes through tests/runlevel.py, so the run-level "nothing left"
check runs when it closes: read from the source of tests/ (its AST), not by convention."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
RUNLEVEL = TESTS / "runlevel.py"
# Ways to start a runtime other than runlevel.started: Runtime.start itself and serve's opener.
STARTERS = {("Runtime", "start"), (None, "start_runtime")}
# The files whose runtimes may skip the check (``runlevel.started(..., check=False)``), and why:
# each leaves runs open on purpose, for another process to settle.
UNCHECKED = {
    "tests/run/crash_child.py": "the process SIGKILLs itself mid-run: recovery is the test's",
    "tests/sessions/crash_child.py": "the process waits to be SIGKILLed with its session open",
    "tests/evals/test_deploy.py": "it admits a run for the deployment's worker to execute",
}


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _starts(tree: ast.AST) -> list[int]:
    """Lines that touch ``Runtime.start`` (called or not: an alias counts) or call
    ``start_runtime``."""
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and (_name(node.value), node.attr) in STARTERS) or (
            isinstance(node, ast.Call) and (None, _name(node.func)) in STARTERS
        ):
            lines.append(node.lineno)
    return sorted(lines)


def _unchecked(tree: ast.AST) -> list[int]:
    """Lines of ``runlevel.started(..., check=<anything but True>)``."""
    lines = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "started"
            and _name(node.func.value) == "runlevel"
        ):
            for kw in node.keywords:
                off = kw.arg == "check" and not (
                    isinstance(kw.value, ast.Constant) and kw.value.value is True
                )
                if off or kw.arg is None:  # **kwargs could carry check=False unseen
                    lines.append(node.lineno)
    return sorted(lines)


def _modules() -> dict[str, ast.AST]:
    root = TESTS.parent
    return {
        str(p.relative_to(root)): ast.parse(p.read_text(), filename=str(p))
        for p in sorted(TESTS.rglob("*.py"))
        if p != RUNLEVEL
    }


def test_no_runtime_starts_outside_the_runlevel_fixture() -> None:
    found = [f"{path}:{line}" for path, tree in _modules().items() for line in _starts(tree)]
    assert found == [], f"start it with tests.runlevel.started (the leftover check): {found}"


def test_the_check_is_skipped_only_where_named() -> None:
    skipping = {path: _unchecked(tree) for path, tree in _modules().items()}
    stray = [f"{p}:{line}" for p, lines in skipping.items() if p not in UNCHECKED for line in lines]
    assert stray == [], f"check=False without a reason in UNCHECKED: {stray}"
    stale = [p for p in UNCHECKED if not skipping.get(p)]
    assert stale == [], f"UNCHECKED names files that no longer skip the check: {stale}"


def test_the_reader_sees_each_way_in() -> None:
    """The two readers above, on the shapes they must catch and the ones they must not."""
    caught = ast.parse(
        "rt = await Runtime.start(s)\n"
        "go = service.Runtime.start\n"
        "rt = await start_runtime(s, warm_pool=False)\n"
        "rt = await app.start_runtime(s)\n"
    )
    assert _starts(caught) == [1, 2, 3, 4]
    fine = ast.parse("await runlevel.started(s)\nawait server.start(s)\nawait Pool.start()\n")
    assert _starts(fine) == []
    skips = ast.parse(
        "runlevel.started(s, check=False)\n"
        "runlevel.started(s, check=flag)\n"
        "runlevel.started(s, **kw)\n"
        "runlevel.started(s, check=True)\n"
        "runlevel.started(s)\n"
        "started(s, check=False)\n"  # another module's own helper (tests/egress/test_streams.py)
    )
    assert _unchecked(skips) == [1, 2, 3]
