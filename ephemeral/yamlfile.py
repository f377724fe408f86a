"""YAML files read with the line of every key, validated by a pydantic model, every problem
reported at once naming the file, the line and the field.

Recipes, suites (``ephemeral.recipes.recipe``) and image definitions (``ephemeral.sandbox.images``)
are read here, so the sandbox layer does not import the recipes to parse its own files.
``line`` 0 means the file as a whole (unreadable, too large).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, NoReturn, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from ephemeral.errors import InvalidRequest, RecipeError

MAX_FILE_BYTES = 1 << 20
MAX_NODES = 100_000  # YAML values after alias expansion
MAX_DEPTH = 64

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class Source:
    """Where a document came from, and the line of every key and list item in it.

    ``aliases`` names keys the schema knows under two spellings: an error on one is shown at
    the line of the other. ``template_node`` is the node of a templated value (a recipe's
    prompt), whose template lines map into the file."""

    file: str
    lines: dict[tuple[str, ...], int] = field(default_factory=dict)
    template_node: yaml.Node | None = None
    aliases: Mapping[str, str] = field(default_factory=dict)

    def line_of(self, loc: Loc) -> int:
        key = tuple(str(p) for p in loc)
        if key and key[0] in self.aliases and key not in self.lines:
            key = (self.aliases[key[0]], *key[1:])
        while key:
            if key in self.lines:
                return self.lines[key]
            key = key[:-1]
        return self.lines.get((), 1)

    def template_line(self, lineno: int) -> int:
        """The file line of line ``lineno`` of the template."""
        node = self.template_node
        if node is None:
            return self.line_of(("prompt",))
        block = isinstance(node, yaml.ScalarNode) and node.style in ("|", ">")
        return node.start_mark.line + lineno + (1 if block else 0)


class Problem(NamedTuple):
    loc: Loc
    message: str
    template_line: int | None = None  # a line of the prompt template, mapped into the file
    line: int | None = None  # a file line known directly (YAML syntax errors)


def field_name(loc: Loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out or "(root)"


def error_of(source: Source, p: Problem) -> dict[str, Any]:
    if p.line is not None:
        line = p.line
    elif p.template_line is not None:
        line = source.template_line(p.template_line)
    else:
        line = source.line_of(p.loc)
    return {"field": field_name(p.loc), "message": p.message, "file": source.file, "line": line}


def fail_errors(
    errors: list[dict[str, Any]], error: type[InvalidRequest] = RecipeError
) -> NoReturn:
    first = errors[0]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    raise error(
        f"{first['file']}:{first['line']}: {first['field']}: {first['message']}{more}",
        errors=errors,
    )


def fail(
    source: Source, problems: list[Problem], error: type[InvalidRequest] = RecipeError
) -> NoReturn:
    fail_errors(sorted((error_of(source, p) for p in problems), key=lambda e: e["line"]), error)


def check(source: Source, problems: list[Problem]) -> None:
    if problems:
        fail(source, problems)


def _index(root: yaml.Node, src: Source) -> list[Problem]:
    """Record the line of every key and item; return duplicate keys.

    Walks aliases too, so it counts what the document expands to: an alias bomb or a
    self-referencing anchor stops here instead of in the validator or the template.
    """
    dups: list[Problem] = []
    todo: list[tuple[yaml.Node, tuple[str, ...]]] = [(root, ())]
    visited = 0
    while todo:
        node, path = todo.pop()
        visited += 1
        if visited > MAX_NODES or len(path) > MAX_DEPTH:
            raise _TooLarge
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
                here = (*path, key)
                line = key_node.start_mark.line + 1
                if here in src.lines:
                    first = src.lines[here]
                    dups.append(Problem(here, f"duplicate key (first at line {first})", line=line))
                    continue  # its children would only repeat the same complaint
                src.lines[here] = line
                todo.append((value_node, here))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                src.lines[(*path, str(i))] = item.start_mark.line + 1
                todo.append((item, (*path, str(i))))
    return dups


class _TooLarge(Exception):
    pass


def read_yaml(
    path: Path,
    label: str,
    *,
    template_key: str | None = None,
    aliases: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], Source, list[Problem]]:
    """Parse one YAML file into plain data, its line index and its duplicate keys."""
    whole = Source(file=label, lines={(): 0})  # line 0: the file as a whole
    try:
        raw = path.read_bytes()
    except OSError as exc:
        fail(whole, [Problem((), f"cannot read the file: {exc.strerror or exc}")])
    if len(raw) > MAX_FILE_BYTES:
        fail(whole, [Problem((), f"larger than {MAX_FILE_BYTES} bytes")])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        fail(whole, [Problem((), f"not UTF-8 (byte {exc.start})")])
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        src = Source(
            file=label,
            lines={(): node.start_mark.line + 1 if node else 1},
            aliases=dict(aliases or {}),
        )
        dups = _index(node, src) if node is not None else []
        data = loader.construct_document(node) if node is not None else None
    except (_TooLarge, RecursionError):
        fail(
            whole,
            [
                Problem(
                    (),
                    f"nests deeper than {MAX_DEPTH} levels or expands to more "
                    f"than {MAX_NODES} values (through aliases?)",
                    line=1,
                )
            ],
        )
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        fail(whole, [Problem(("yaml",), exc.problem or str(exc), line=line)])
    except yaml.YAMLError as exc:
        fail(whole, [Problem(("yaml",), str(exc), line=1)])
    finally:
        loader.dispose()
    if node is None or not isinstance(data, dict):
        fail(whole, [Problem((), "must be a YAML mapping of fields", line=1)])
    templated = None
    if template_key is not None:
        templated = next(
            (v for k, v in node.value if getattr(k, "value", None) == template_key), None
        )
    return data, dataclasses.replace(src, template_node=templated), dups


def schema_problems(
    exc: ValidationError,
    known: Sequence[str],
    *,
    relocate: Callable[[Loc], Loc] | None = None,
    not_allowed: Mapping[Loc, str] | None = None,
) -> list[Problem]:
    """pydantic's errors as problems: an unknown field suggests the closest ``known`` one
    (or says ``not_allowed[loc]``); ``relocate`` rewrites a location first."""
    problems = []
    for err in exc.errors(include_url=False):
        loc: Loc = tuple(p for p in err["loc"] if p != "[key]")
        if relocate is not None:
            loc = relocate(loc)
        kind, msg = err["type"], err["msg"]
        if kind == "extra_forbidden":
            name = str(loc[-1]) if loc else ""
            if not_allowed and loc in not_allowed:
                msg = not_allowed[loc]
            else:
                close = difflib.get_close_matches(name, known, n=1)
                msg = "unknown field" + (f" (did you mean {close[0]!r}?)" if close else "")
        elif kind == "missing":
            msg = "required"
        elif kind == "value_error":
            msg = msg.removeprefix("Value error, ")
        problems.append(Problem(loc, msg))
    return problems


ModelT = TypeVar("ModelT", bound=BaseModel)
Extra = Callable[[Any], list[tuple[Loc, str]]]


def load_yaml_model(
    path: Path,
    model: type[ModelT],
    *,
    label: str | None = None,
    extra: Extra | None = None,
    error: type[InvalidRequest] = RecipeError,
) -> ModelT:
    """Any YAML file validated by ``model``, with the recipes' errors (file, line, field).

    ``extra(obj)`` returns further problems as ``(location, message)`` once the schema passed;
    image definitions use this for checks that need the file system.
    """
    data, source, dups = read_yaml(path, label or str(path))
    try:
        obj = model.model_validate(data)
    except ValidationError as exc:
        problems = dups + schema_problems(exc, sorted(model.model_fields))
    else:
        problems = dups + [Problem(loc, msg) for loc, msg in (extra(obj) if extra else [])]
    if problems:
        fail(source, problems, error)
    return obj
