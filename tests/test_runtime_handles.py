"""Flows, tasks and everything else are handed their runtime, never look it up (issue 38).

Checked on the source (``ast``, as in ``tests/test_layers.py``): no module defines or calls a
lookup of "the process's runtime" (``service.current()`` was one: a module-level dict keyed by
event loop), and no module keeps runtimes in a module-level registry. What a flow or task needs
reaches it as an argument: the agent-run flow a ``RunHandle`` (``RunId``), the eval flows the
runtime they are made with, the ``execute-run`` task the worker's runtime in its closure.
"""

from __future__ import annotations

import ast
from pathlib import Path

from ephemeral.settings import REPO_ROOT

ROOTS = ("ephemeral", "flows", "tasks")  # ephemeral/flows and ephemeral/tasks link to the last two
# Harbor constructs its environments itself, so nothing can hand them a runtime: the one their
# trials share is started, counted and closed in that module (its own lifecycle, not a lookup of
# a runtime someone else started).
EXEMPT = {"ephemeral/harbor/backend.py"}
RUNTIME_MODULES = ("ephemeral.engine.runtime", "ephemeral.service")  # now, before the move


def sources() -> list[Path]:
    files: list[Path] = []
    for root in ROOTS:
        files += sorted(p for p in (REPO_ROOT / root).rglob("*.py") if p.is_file())
    return files


def names_runtime(node: ast.AST | None) -> bool:
    """``node`` (an annotation) names the ``Runtime`` class (``AgentRuntime`` is another)."""
    if node is None:
        return False
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id == "Runtime":
            return True
        if isinstance(sub, ast.Attribute) and sub.attr == "Runtime":
            return True
        is_text = isinstance(sub, ast.Constant) and isinstance(sub.value, str)
        if is_text and names_runtime(ast.parse(sub.value, mode="eval")):  # a string annotation
            return True
    return False


def lookups(path: Path) -> list[str]:
    """Lookups of a runtime in ``path``: a function taking nothing that returns a ``Runtime``
    (it can only find one somewhere global), a module-level binding annotated with ``Runtime``
    (a registry), and any use of ``service.current``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and names_runtime(node.returns):
            a = node.args
            if not (a.posonlyargs or a.args or a.kwonlyargs or a.vararg or a.kwarg):
                found.append(f"line {node.lineno}: {node.name}() returns a Runtime it is not given")
        elif isinstance(node, ast.ImportFrom) and node.module in RUNTIME_MODULES:
            found += [
                f"line {node.lineno}: imports current" for a in node.names if a.name == "current"
            ]
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "current"
            and isinstance(node.value, ast.Name)
            and node.value.id == "service"
        ):
            found.append(f"line {node.lineno}: service.current")
    for stmt in tree.body:
        if isinstance(stmt, ast.AnnAssign) and names_runtime(stmt.annotation):
            found.append(f"line {stmt.lineno}: module-level {ast.unparse(stmt.target)}")
    return found


def test_no_module_looks_up_a_runtime() -> None:
    bad = {
        rel: found
        for path in sources()
        if (rel := path.relative_to(REPO_ROOT).as_posix()) not in EXEMPT
        and (found := lookups(path))
    }
    assert not bad, f"a runtime looked up instead of handed in: {bad}"


def test_the_runtime_module_has_no_current() -> None:
    import ephemeral.engine.runtime as runtime

    assert not hasattr(runtime, "current")


def test_the_check_sees_the_old_lookup(tmp_path: Path) -> None:
    """The checker itself, on the shapes the old code had."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import asyncio\n"
        "from ephemeral.service import Runtime, current\n"
        "from ephemeral import service\n"
        "_by_loop: dict[asyncio.AbstractEventLoop, Runtime] = {}\n"
        "def current() -> Runtime | None:\n"
        "    return _by_loop.get(asyncio.get_running_loop())\n"
        "async def flow_runtime() -> 'tuple[Runtime, bool]':\n"
        "    return service.current(), False\n"
        "def given(runtime: Runtime) -> Runtime:\n"
        "    return runtime\n"
        "_built: dict[str, 'AgentRuntime'] = {}\n"
    )
    found = lookups(probe)
    assert found == [
        "line 2: imports current",
        "line 5: current() returns a Runtime it is not given",
        "line 7: flow_runtime() returns a Runtime it is not given",
        "line 8: service.current",
        "line 4: module-level _by_loop",
    ], found


def test_the_worker_serves_the_task_runs_a_dispatcher_creates() -> None:
    """The worker's ``execute-run`` (its runtime in the closure) has the task key of the one a
    dispatching process creates task runs of: Prefect routes runs to workers by that key."""
    from ephemeral.flows.dispatch import execute_run, execute_run_task

    served = execute_run_task(object())  # type: ignore[arg-type]  # any runtime: not called
    assert served.task_key == execute_run.task_key
    assert served.name == execute_run.name == "execute-run"
