"""The broker depends on a narrow context, not on the agent: no import of it anywhere (not even
for type checking or lazily inside a function), and importing the broker loads no agent."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import ephemeral.broker

FORBIDDEN = ("ephemeral.agent", "ephemeral.engine", "ephemeral.sandbox")


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_no_broker_module_imports_the_agent() -> None:
    package = Path(ephemeral.broker.__file__).parent
    modules = sorted(package.glob("*.py"))
    assert len(modules) >= 7
    bad = {
        f"{p.name}: {name}" for p in modules for name in _imports(p) if name.startswith(FORBIDDEN)
    }
    assert bad == set()


def test_importing_the_broker_loads_no_agent() -> None:
    code = (
        "import sys, ephemeral.broker, ephemeral.broker.context;"
        f"bad = sorted(m for m in sys.modules if m.startswith({FORBIDDEN!r}));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
