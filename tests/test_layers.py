"""The layers of docs/architecture.md, checked on the source: the core imports no layer above it.

Every import statement counts, lazy ones inside functions included (``ast``, not a runtime
import graph, so a forbidden import cannot hide behind a branch that tests never take).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ephemeral.settings import REPO_ROOT

PACKAGE = REPO_ROOT / "ephemeral"
# The layers above the core: entry points (which choose an executor), the Prefect flows and
# tasks, and the docs generator (it reads the CLI).
ABOVE_CORE = ("cli", "api", "flows", "tasks", "docsgen.py")
# Under either spelling: ``flows``/``tasks`` from a checkout, ``ephemeral.flows``/``.tasks``.
FORBIDDEN_IN_CORE = (
    "flows",
    "tasks",
    "ephemeral.flows",
    "ephemeral.tasks",
    "ephemeral.cli",
    "ephemeral.api",
    "prefect",
    "fastapi",
    "starlette",
    "uvicorn",
    "typer",
)


def imported_modules(path: Path, package: str | None = None) -> list[tuple[int, str]]:
    """Every module an import statement in ``path`` names, absolute, with its line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    if package is None:
        package = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts[:-1])
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            # ``from ephemeral import flows`` names the module ``ephemeral.flows``.
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
            found.append((node.lineno, base))
    return found


def core_modules() -> list[Path]:
    files = []
    for path in sorted(PACKAGE.rglob("*.py")):
        top = path.relative_to(PACKAGE).parts[0]
        if top not in ABOVE_CORE:
            files.append(path)
    return files


def forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN_IN_CORE)


def test_the_core_is_what_the_docs_say() -> None:
    names = {p.relative_to(PACKAGE).as_posix() for p in core_modules()}
    for module in ("service.py", "agent.py", "evals.py", "recipes.py", "executor.py"):
        assert module in names
    for folder in ("store/", "sandbox/", "broker/", "providers/", "records/"):
        assert any(n.startswith(folder) for n in names), folder
    assert not any(n.startswith(("flows/", "tasks/", "cli/", "api/")) for n in names)


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_core_module_imports_no_layer_above(path: Path) -> None:
    bad = [f"line {line}: {name}" for line, name in imported_modules(path) if forbidden(name)]
    assert not bad, f"{path.relative_to(REPO_ROOT)} imports a layer above the core: {bad}"


def test_flows_and_tasks_use_the_ephemeral_namespace() -> None:
    """Inside the flows and tasks, and everywhere else in the repository, the top-level
    spellings ``flows``/``tasks`` are never imported: installed, only ``ephemeral.flows`` and
    ``ephemeral.tasks`` exist."""
    roots = [REPO_ROOT / d for d in ("ephemeral", "flows", "tasks", "tests", "bench")]
    bad = []
    for root in roots:
        for path in root.rglob("*.py"):
            for line, name in imported_modules(path):
                if name.split(".")[0] in ("flows", "tasks"):
                    bad.append(f"{path.relative_to(REPO_ROOT)}:{line}: {name}")
    assert not bad


def test_the_namespace_mapping_is_the_top_level_folders() -> None:
    """``ephemeral/flows`` and ``ephemeral/tasks`` are links to the top-level folders, so a
    checkout, an editable install and a wheel all see one copy of each file."""
    for name in ("flows", "tasks"):
        link = PACKAGE / name
        assert link.is_symlink() and link.resolve() == (REPO_ROOT / name).resolve()
    import ephemeral.flows.agent_run as agent_run

    assert Path(agent_run.__file__).resolve() == (REPO_ROOT / "flows" / "agent_run.py").resolve()


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The checker itself: lazy, relative and ``from ephemeral import flows`` forms are caught."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f():\n"
        "    from flows.agent_run import agent_run\n"
        "    from ..flows import executor\n"
        "    from ephemeral import tasks\n"
        "    import prefect.settings\n"
    )
    names = [n for _, n in imported_modules(probe, "ephemeral.store") if forbidden(n)]
    assert "flows.agent_run" in names
    assert "ephemeral.flows.executor" in names
    assert "ephemeral.tasks" in names
    assert "prefect.settings" in names
