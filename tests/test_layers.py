"""The layers of docs/architecture.md, checked on the source: the core imports no layer above it,
inside the core the lower parts import no higher one (``DIRECTION``), and no module of the
package imports itself back through others (no import cycle).

Every import statement counts, lazy ones inside functions and ``TYPE_CHECKING`` ones included
(``ast``, not a runtime import graph, so a forbidden import cannot hide behind a branch that
tests never take).
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterable
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
    for module in (
        "engine/runtime.py",
        "engine/engine.py",
        "engine/executor.py",
        "engine/close.py",
        "agent/loop.py",
        "sessions/manager.py",
        "money/pricing.py",
        "cluster/leases.py",
        "recipes/recipe.py",
    ):
        assert module in names
    for folder in ("store/", "sandbox/", "oci/", "broker/", "providers/", "records/", "evals/"):
        assert any(n.startswith(folder) for n in names), folder
    assert not any(n.startswith(("flows/", "tasks/", "cli/", "api/")) for n in names)


# The modules that stay flat in ``ephemeral/``: the core's shared vocabulary (ids, errors,
# events, settings, policy, ...), the entry points' helpers, and two that sit below the
# packages that import them (``lifecycle``: the store and the broker; ``build_proxy``: the
# sandbox's Dockerfile builder). Everything else lives in a package named for its subsystem.
FLAT_AT_MOST = 20


def test_the_tree_shows_the_subsystems() -> None:
    flat = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(flat) <= FLAT_AT_MOST, flat
    for package in ("engine", "agent", "sessions", "money", "cluster", "recipes"):
        assert (PACKAGE / package / "__init__.py").is_file(), package


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


# The run engine and what drives runs and sessions: the parts below never import these.
RUNS = (
    "ephemeral.engine",
    "ephemeral.agent",
    "ephemeral.sessions",
    "ephemeral.evals",
)
# Direction inside the core: a module under the key never imports a module under one of its
# values. The sandbox layer knows drivers and images, not what runs in them (recipes, evals)
# nor the fakes that ship for tests; the broker sees a run only as a BrokerContext; the store
# keeps rows, not sandboxes or the broker; image pulling (oci) and the records serve runs
# without knowing the engine; money (amounts, prices, budgets), scale-out (leases, outbox) and
# recipes know no run engine, session or agent loop; and only tests (and benches) import
# ``ephemeral.testing``.
DIRECTION: dict[str, tuple[str, ...]] = {
    "ephemeral.sandbox": (
        *RUNS,
        "ephemeral.recipes",
        "ephemeral.testing",
        "ephemeral.store",
        "ephemeral.broker",
        "ephemeral.records",
    ),
    "ephemeral.broker": (*RUNS, "ephemeral.sandbox", "ephemeral.records"),
    "ephemeral.store": (*RUNS, "ephemeral.sandbox", "ephemeral.broker", "ephemeral.oci"),
    "ephemeral.oci": (*RUNS, "ephemeral.store", "ephemeral.records", "ephemeral.recipes"),
    "ephemeral.records": (*RUNS, "ephemeral.sandbox", "ephemeral.broker"),
    "ephemeral.providers": (*RUNS, "ephemeral.sandbox", "ephemeral.store"),
    "ephemeral.money": (
        *RUNS,
        "ephemeral.cluster",
        "ephemeral.recipes",
        "ephemeral.sandbox",
        "ephemeral.store",
        "ephemeral.broker",
        "ephemeral.records",
    ),
    "ephemeral.cluster": (*RUNS, "ephemeral.recipes", "ephemeral.sandbox", "ephemeral.records"),
    "ephemeral.recipes": (*RUNS, "ephemeral.cluster", "ephemeral.store", "ephemeral.broker"),
    "ephemeral": ("ephemeral.testing",),
}
# A key also covers the package itself; ``ephemeral`` (everything) exempts the fakes themselves.
DIRECTION_EXEMPT = {"ephemeral": ("ephemeral.testing",)}


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def module_name(path: Path, root: Path = REPO_ROOT) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def wrong_way_imports(files: Iterable[Path], root: Path = REPO_ROOT) -> list[str]:
    """``file:line: importer -> imported`` for every import against ``DIRECTION``."""
    bad = []
    for path in files:
        module = module_name(path, root)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for layer, never in DIRECTION.items():
            if not under(module, layer):
                continue
            if any(under(module, e) for e in DIRECTION_EXEMPT.get(layer, ())):
                continue
            for line, name in imported_modules(path, package):
                if any(under(name, n) for n in never) and not under(name, module):
                    bad.append(f"{path.relative_to(root)}:{line}: {module} -> {name}")
    return sorted(set(bad))


def test_the_core_imports_point_down() -> None:
    assert set(DIRECTION) - {"ephemeral"} <= {
        module_name(p) for p in core_modules() if p.name == "__init__.py"
    }
    bad = wrong_way_imports(core_modules())
    assert not bad, f"imports against the direction of docs/architecture.md: {bad}"


def test_the_direction_checker_sees_a_wrong_way_import(tmp_path: Path) -> None:
    """A lazy import of the fakes from the sandbox layer and a relative import of the engine
    from the broker are both caught; the fakes importing the sandbox (downwards) is not."""
    texts = {
        "sandbox/probe.py": "def f():\n    from ephemeral.testing.sandbox import FakeDriver\n",
        "broker/probe.py": "from ..engine import Engine\n",
        "testing/probe.py": "from ephemeral.sandbox.base import Limits\n",
    }
    files = []
    for name, text in texts.items():
        path = tmp_path / "ephemeral" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        files.append(path)
    assert wrong_way_imports(files, tmp_path) == [
        "ephemeral/broker/probe.py:1: ephemeral.broker.probe -> ephemeral.engine",
        "ephemeral/broker/probe.py:1: ephemeral.broker.probe -> ephemeral.engine.Engine",
        "ephemeral/sandbox/probe.py:2: ephemeral.sandbox.probe -> ephemeral.testing.sandbox",
        "ephemeral/sandbox/probe.py:2: ephemeral.sandbox.probe -> "
        "ephemeral.testing.sandbox.FakeDriver",
    ]


# Import cycles allowed in the tree, each named by its modules: none. The test fails on any
# cycle (a new one, or a listed one that grew a module) and on a listed one that is gone.
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset()


def package_modules(roots: Iterable[tuple[Path, str]]) -> dict[str, Path]:
    """Module name -> file, for each ``(folder, dotted name)`` root (a package ``__init__`` is
    the package's own name)."""
    found: dict[str, Path] = {}
    for root, name in roots:
        for path in sorted(root.rglob("*.py")):
            parts = [name, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: first line}, inside ``modules`` only.

    ``from pkg import sub`` is an edge to ``pkg.sub`` when that is a module (importing a
    submodule runs its parent package first in any case, so that edge would be no cycle of
    the code's making); ``from pkg import name`` is an edge to ``pkg``.
    """
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                names = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            else:
                continue
            for name in names:
                while name and name not in modules:  # ``a.b.func`` -> the module ``a.b``
                    name = name.rpartition(".")[0]
                if name and name != module:
                    edges.setdefault(name, node.lineno)
        graph[module] = edges
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    counter = itertools.count()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[frozenset[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = next(counter)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = next(counter)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(frozenset(component))
    return cycles


def describe_cycle(graph: dict[str, dict[str, int]], cycle: frozenset[str]) -> str:
    edges = [
        f"{a} -> {b} (line {line})"
        for a in sorted(cycle)
        for b, line in sorted(graph[a].items())
        if b in cycle
    ]
    return "; ".join(edges)


def ephemeral_graph() -> dict[str, dict[str, int]]:
    # ``ephemeral/flows`` and ``ephemeral/tasks`` are links (rglob does not follow them): their
    # files are the top-level folders.
    return import_graph(
        package_modules(
            [
                (PACKAGE, "ephemeral"),
                (REPO_ROOT / "flows", "ephemeral.flows"),
                (REPO_ROOT / "tasks", "ephemeral.tasks"),
            ]
        )
    )


def test_the_package_has_no_import_cycle_but_the_known_ones() -> None:
    graph = ephemeral_graph()
    assert "ephemeral.flows.agent_run" in graph and "ephemeral.cli.runs" in graph
    cycles = import_cycles(graph)
    new = [describe_cycle(graph, c) for c in cycles if c not in KNOWN_CYCLES]
    assert not new, f"import cycles: {new}"
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in cycles]
    assert not gone, f"no longer a cycle, remove it from KNOWN_CYCLES: {gone}"


def test_the_cycle_finder_sees_lazy_and_type_only_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text("from pkg import sub\nA = 1\n")  # the submodule, not __init__
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import C\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.b import f\nC = 1\n"
    )
    (pkg / "d.py").write_text("import pkg.e\n")
    (pkg / "e.py").write_text("from pkg.d import x\n")
    graph = import_graph(package_modules([(pkg, "pkg")]))
    assert sorted(sorted(c) for c in import_cycles(graph)) == [
        ["pkg.c", "pkg.sub.b"],
        ["pkg.d", "pkg.e"],
    ]
