"""No class of the package is a grab-bag (issue 38): at most ``MAX_METHODS`` methods each.

A class past it holds more than one concern: split what does not need the object into
functions or a small class of its own (``ephemeral/harbor/request.py``, ``task_image.py`` and
``session.py`` came out of the Harbor environment that way). Counted on the source (``ast``):
every ``def`` and ``async def`` directly in a class body, properties, static and class methods
included; a class nested in a class or a function is counted on its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_words import package_files  # every file of the package once

MAX_METHODS = 30


def class_sizes(path: Path) -> list[tuple[str, int]]:
    """(name, method count) of every class in the module at ``path``, nested ones too."""
    return [
        (node.name, sum(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) for n in node.body))
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.ClassDef)
    ]


def test_the_counter_sees_methods_of_every_kind(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "class A:\n"
        "    def a(self): ...\n"
        "    async def b(self): ...\n"
        "    @property\n"
        "    def c(self): ...\n"
        "    @staticmethod\n"
        "    def d(): ...\n"
        "    class B:\n"
        "        def e(self): ...\n"
        "    x = 1\n"
        "def f():\n"
        "    class Local:\n"
        "        def g(self): ...\n"
        "        def h(self): ...\n"
    )
    assert sorted(class_sizes(source)) == [("A", 4), ("B", 1), ("Local", 2)]


def test_no_class_has_more_than_the_limit_of_methods() -> None:
    over = [
        f"{rel}:{name} has {count} methods"
        for rel, path in package_files()
        for name, count in class_sizes(path)
        if count > MAX_METHODS
    ]
    assert not over, f"more than {MAX_METHODS} methods in a class: " + "; ".join(over)
