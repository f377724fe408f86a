"""Jinja2 for recipes: sandboxed, bounded, and shell-quoting in commands.

A recipe's templates are untrusted, and so are the values they render (dataset rows). Two
environments share one set of limits:

* :data:`PROMPTS` renders prompts: Jinja2's immutable sandbox (no private attributes, no
  mutation) with ``StrictUndefined``.
* :data:`COMMANDS` renders ``setup`` and ``verify``: the same, and every ``{{ … }}`` becomes
  exactly one shell word (``shlex.quote`` of its value, applied by ``finalize`` to every
  interpolation, so no template can forget it). :func:`command_problems` refuses the places
  where a quoted word is not one word: inside quotes, after a backslash, in a comment, a
  here-document, ``${…}``, ``$((…))`` or backticks, and ``{% filter %}`` blocks (they rewrite
  text after it was quoted).

Limits (:func:`render`): no value a template builds may exceed the field's length limit. The
operators and methods that build strings or numbers from a count (``*``, ``**``, ``%``, ``+``,
``~``, ``center``/``ljust``/``rjust``/``zfill``, ``replace``, ``join``, ``format``) and the
filters that do (``center``, ``indent``, ``wordwrap``, ``join``, ``replace``, ``truncate``,
``format``, ``batch``, ``slice``, ``sum``, ``urlize``) are checked *before* they run; every
other filter and method is checked on its result (they grow a value by a small factor at
most), and only the listed methods of ``str``, ``dict``, ``list`` and numbers can be called at
all. Every loop iteration, call, filter, operator and piece of output is a step: a render may
take :data:`MAX_STEPS` steps and :data:`MAX_SECONDS` seconds, and emit at most the limit in
characters, macros and blocks included. Breaking a limit is a :class:`TemplateLimit`.
"""

from __future__ import annotations

import functools
import inspect
import re
import shlex
import string
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from jinja2 import StrictUndefined, nodes
from jinja2.exceptions import SecurityError
from jinja2.runtime import BlockReference, LoopContext, Macro, Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.utils import Cycler, Joiner, Namespace
from jinja2.visitor import NodeTransformer

MAX_STEPS = 100_000
MAX_SECONDS = 2.0
MAX_INT_DIGITS = 4_300  # Python's own limit for int <-> str
MAX_WRAP_LINES = 2_000  # textwrap is quadratic in a long word: bound its pieces
DEFAULT_LIMIT = 100_000


class TemplateLimit(SecurityError):
    """A template tried to build more, or work longer, than a recipe template may."""


@dataclass
class _Budget:
    limit: int
    deadline: float
    steps: int = 0
    emitted: int = 0


_BUDGET: ContextVar[_Budget | None] = ContextVar("ephemeral_template_budget", default=None)


def _limit() -> int:
    budget = _BUDGET.get()
    return budget.limit if budget else DEFAULT_LIMIT


def _step() -> None:
    budget = _BUDGET.get()
    if budget is None:  # compile-time constant folding: only the size checks apply
        return
    budget.steps += 1
    if budget.steps > MAX_STEPS:
        raise TemplateLimit(f"more than {MAX_STEPS} steps (loop iterations, calls, filters)")
    if budget.steps % 64 == 0 and time.monotonic() > budget.deadline:
        raise TemplateLimit(f"rendering took longer than {MAX_SECONDS} s")


def _digits(n: int) -> int:
    return n.bit_length() * 30103 // 100000 + 1


def weight(value: Any, cap: int) -> int:
    """About how many characters ``value`` is as text (stops counting once over ``cap``)."""
    total = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str | bytes):
            total += len(v)
        elif v is None or isinstance(v, bool | float):
            total += 8
        elif isinstance(v, int):
            total += _digits(v)
        elif isinstance(v, Mapping):
            total += 4 * len(v)
            if total <= cap:
                stack.extend(v.keys())
                stack.extend(v.values())
        elif isinstance(v, list | tuple | set | frozenset):
            total += 2 * len(v)
            if total <= cap:
                stack.extend(v)
        elif isinstance(v, Namespace):
            stack.append(object.__getattribute__(v, "_Namespace__attrs"))
        else:
            total += 16
        if total > cap:
            return total
    return total


def _refuse_over(estimate: int, what: str) -> None:
    limit = _limit()
    if estimate > limit:
        raise TemplateLimit(f"{what} would build more than {limit} characters")


def _check_result(value: Any, what: str) -> Any:
    limit = _limit()
    if isinstance(value, int) and not isinstance(value, bool):
        if _digits(value) > MAX_INT_DIGITS:
            raise TemplateLimit(f"{what} builds a number of more than {MAX_INT_DIGITS} digits")
    elif weight(value, limit) > limit:
        raise TemplateLimit(f"{what} builds more than {limit} characters")
    return value


# --------------------------------------------------------------------------- pre-checks

_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")


def _check_percent(fmt: str, args: Any, what: str) -> None:
    widths, fields = 0, 0
    for m in _PERCENT.finditer(fmt):
        if "*" in (m.group(1) or "") + (m.group(2) or ""):
            raise TemplateLimit(f"{what}: a * width or precision is not allowed")
        widths += int(m.group(1) or 0) + int(m.group(2) or 0)
        fields += 1
    _refuse_over(len(fmt) + widths + fields * weight(args, _limit()), what)


def _check_format(fmt: str, args: Any, what: str) -> None:
    literal, widths, fields = 0, 0, 0
    for text, name, spec, _ in string.Formatter().parse(fmt):
        literal += len(text)
        if name is not None:
            fields += 1
            if spec and "{" in spec:
                raise TemplateLimit(f"{what}: a nested field in a format spec is not allowed")
            widths += sum(int(n) for n in re.findall(r"\d+", spec or ""))
    _refuse_over(literal + widths + fields * weight(args, _limit()), what)


def _bounded_items(items: Iterable[Any], sep: str, what: str) -> list[Any]:
    """``items`` as a list, refused as soon as joining them would pass the limit."""
    limit = _limit()
    out: list[Any] = []
    total = 0
    for item in items:
        _step()
        total += weight(item, limit) + len(sep)
        if total > limit:
            raise TemplateLimit(f"{what} would build more than {limit} characters")
        out.append(item)
    return out


def _replace_size(s: str, old: str, new: str, count: int | None) -> int:
    hits = s.count(old) if old else len(s) + 1
    if count is not None and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(0, len(new) - len(old))


def _width(value: Any) -> int:
    return value if isinstance(value, int) else 0


# A filter's pre-check gets its bound arguments (by parameter name) and may replace some.
_FilterCheck = Callable[[dict[str, Any], str], None]


def _pre_center(a: dict[str, Any], what: str) -> None:
    _refuse_over(max(len(str(a["value"])), _width(a.get("width", 80))), what)


def _pre_indent(a: dict[str, Any], what: str) -> None:
    s, width = str(a["s"]), a.get("width", 4)
    unit = len(width) if isinstance(width, str) else _width(width)
    _refuse_over(len(s) + (s.count("\n") + 1) * unit, what)


def _pre_wordwrap(a: dict[str, Any], what: str) -> None:
    s, width = str(a["s"]), a.get("width", 79)
    if not isinstance(width, int) or width < 1:
        raise TemplateLimit(f"{what}: the width must be a positive integer")
    lines = len(s) // width + s.count("\n") + 1
    if lines > MAX_WRAP_LINES:
        raise TemplateLimit(f"{what} would make more than {MAX_WRAP_LINES} lines")
    _refuse_over(len(s) + lines * len(a.get("wrapstring") or "\n"), what)


def _pre_join(a: dict[str, Any], what: str) -> None:
    a["value"] = _bounded_items(a["value"], str(a.get("d", "")), what)


def _pre_replace(a: dict[str, Any], what: str) -> None:
    _refuse_over(_replace_size(str(a["s"]), str(a["old"]), str(a["new"]), a.get("count")), what)


def _pre_truncate(a: dict[str, Any], what: str) -> None:
    _refuse_over(len(str(a["s"])) + len(str(a.get("end", "..."))), what)


def _pre_format(a: dict[str, Any], what: str) -> None:
    _check_percent(str(a["value"]), (a.get("args"), a.get("kwargs")), what)


def _pre_count(name: str) -> _FilterCheck:
    def check(a: dict[str, Any], what: str) -> None:
        if _width(a.get(name)) > _limit():
            raise TemplateLimit(f"{what}: {name} {a.get(name)} is more than {_limit()}")

    return check


def _pre_sum(a: dict[str, Any], what: str) -> None:
    if not isinstance(a.get("start", 0), int | float):
        raise TemplateLimit(f"{what}: only numbers can be summed")


def _pre_urlize(a: dict[str, Any], what: str) -> None:
    n = len(str(a["value"]))
    extra = len(str(a.get("target") or "")) + len(str(a.get("rel") or "")) + 48
    _refuse_over(3 * n + (n // 4 + 1) * extra, what)


_FILTER_CHECKS: dict[str, _FilterCheck] = {
    "center": _pre_center,
    "indent": _pre_indent,
    "wordwrap": _pre_wordwrap,
    "join": _pre_join,
    "replace": _pre_replace,
    "truncate": _pre_truncate,
    "format": _pre_format,
    "batch": _pre_count("linecount"),
    "slice": _pre_count("slices"),
    "sum": _pre_sum,
    "urlize": _pre_urlize,
}


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(func)
    pre = _FILTER_CHECKS.get(name)
    params = list(sig.parameters)
    passed = getattr(func, "jinja_pass_arg", None) is not None
    # Jinja's async variants take an eval context their (sync) signature does not show.
    hidden = passed and params[0] not in {"context", "eval_ctx", "environment", "env"}
    first = 1 if passed and not hidden else 0
    what = f"the filter {name}"

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _step()
        if pre is not None:
            lead, rest = (args[:1], args[1:]) if hidden else ((), args)
            bound = sig.bind(*rest, **kwargs)
            bound.apply_defaults()
            named = dict(bound.arguments)
            named.setdefault("value", named.get(params[first]))
            named.setdefault("s", named.get(params[first]))
            pre(named, what)
            if name == "join":  # the items, now a bounded list
                bound.arguments[params[first]] = named["value"]
            args, kwargs = (*lead, *bound.args), bound.kwargs
        return _check_result(func(*args, **kwargs), what)

    return bounded


# Methods a template may call; the first group is checked before it runs.
_STR_METHODS = frozenset(
    [
        "center",
        "ljust",
        "rjust",
        "zfill",
        "replace",
        "join",
        "capitalize",
        "casefold",
        "count",
        "endswith",
        "find",
        "index",
        "isalnum",
        "isalpha",
        "isascii",
        "isdecimal",
        "isdigit",
        "isidentifier",
        "islower",
        "isnumeric",
        "isprintable",
        "isspace",
        "istitle",
        "isupper",
        "lower",
        "lstrip",
        "partition",
        "removeprefix",
        "removesuffix",
        "rfind",
        "rindex",
        "rpartition",
        "rsplit",
        "rstrip",
        "split",
        "splitlines",
        "startswith",
        "strip",
        "swapcase",
        "title",
        "upper",
    ]
)
_METHODS: dict[type, frozenset[str]] = {
    str: _STR_METHODS,
    dict: frozenset({"get", "items", "keys", "values", "copy"}),
    list: frozenset({"count", "index", "copy"}),
    tuple: frozenset({"count", "index"}),
    int: frozenset({"bit_length"}),
    bool: frozenset({"bit_length"}),
    float: frozenset({"is_integer"}),
}
_CALLABLE_TYPES = (Macro, LoopContext, BlockReference, Cycler, Joiner, Undefined)


def _check_method(owner: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    what = f"{type(owner).__name__}.{name}"
    allowed = next((names for t, names in _METHODS.items() if type(owner) is t), None)
    if allowed is None or name not in allowed:
        raise SecurityError(f"{what}() is not available in recipe templates")
    if not isinstance(owner, str):
        return
    if name in {"center", "ljust", "rjust", "zfill"}:
        _refuse_over(max(len(owner), _width(args[0] if args else 0)), what)
    elif name == "replace" and len(args) >= 2:
        count = args[2] if len(args) > 2 else kwargs.get("count")
        _refuse_over(_replace_size(owner, str(args[0]), str(args[1]), count), what)


# --------------------------------------------------------------------------- the environment


HookT = TypeVar("HookT", bound=Callable[..., Any])


def _hook(func: HookT) -> HookT:
    """Mark a function the compiled template may call as it is (it checks its own limits)."""
    func._ephemeral_hook = True  # type: ignore[attr-defined]
    return func


class _Literal(str):
    """Not a value: what the counting hooks write (nothing), which shell quoting leaves alone."""

    __slots__ = ()


_EMPTY = _Literal("")


class _Bounder(NodeTransformer):
    """Routes every loop, ``~`` and piece of output through the environment's counters."""

    def _hook(self, name: str, arg: nodes.Node, lineno: int) -> nodes.Call:
        return nodes.Call(
            nodes.EnvironmentAttribute(name, lineno=lineno), [arg], [], None, None, lineno=lineno
        )

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = self._hook("bounded_iter", node.iter, node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return self._hook("bounded_concat", nodes.List(node.nodes, lineno=node.lineno), node.lineno)

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        self.generic_visit(node)
        text = sum(len(c.data) for c in node.nodes if isinstance(c, nodes.TemplateData))
        children: list[nodes.Expr] = [
            c if isinstance(c, nodes.TemplateData) else self._hook("emit", c, c.lineno)
            for c in node.nodes
        ]
        if text:  # the node's template text, counted once each time it is written
            children.insert(0, self._hook("emit_text", nodes.Const(text), node.lineno))
        node.nodes = children
        return node


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(undefined=StrictUndefined, autoescape=False, **kwargs)
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals.pop("lipsum", None)
        self.globals["range"] = safe_range

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        return _Bounder().visit(tree)

    # hooks the compiled template calls (see _Bounder)
    @_hook
    def bounded_iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            _step()
            yield item

    @_hook
    def bounded_concat(self, items: list[Any]) -> str:
        _refuse_over(sum(weight(x, _limit()) for x in items), "~")
        return _check_result("".join(str(x) for x in items), "~")

    @_hook
    def emit(self, value: Any) -> Any:
        n = len(value) if type(value) is str else weight(value, _limit())
        self._count(n)
        return value

    @_hook
    def emit_text(self, n: int) -> _Literal:
        self._count(n)
        return _EMPTY

    def _count(self, n: int) -> None:
        budget = _BUDGET.get()
        if budget is not None:
            budget.emitted += n
            if budget.emitted > budget.limit:
                raise TemplateLimit(f"renders to more than {budget.limit} characters")

    # the sandbox's own interception points
    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _step()
        what = f"the operator {operator}"
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "**" and ints and right > 0 and abs(left) > 1:
            if left.bit_length() * right > MAX_INT_DIGITS * 3.33:
                raise TemplateLimit(f"{what} builds a number of more than {MAX_INT_DIGITS} digits")
        elif operator == "*" and not ints:
            count = next((x for x in (left, right) if isinstance(x, int)), None)
            seq = next((x for x in (left, right) if isinstance(x, str | list | tuple)), None)
            if count is not None and seq is not None and count > 0:
                _refuse_over(weight(seq, _limit()) * count, what)
        elif operator == "*" and ints:
            if left.bit_length() + right.bit_length() > MAX_INT_DIGITS * 3.33:
                raise TemplateLimit(f"{what} builds a number of more than {MAX_INT_DIGITS} digits")
        elif operator == "+" and not (
            isinstance(left, int | float) and isinstance(right, int | float)
        ):
            _refuse_over(weight(left, _limit()) + weight(right, _limit()), what)
        elif operator == "%" and isinstance(left, str):
            _check_percent(left, right, what)
        return _check_result(super().call_binop(context, operator, left, right), what)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        inner = super().wrap_str_format(value)
        if inner is None:
            return None
        fmt = str(value.__self__)
        is_map = value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            _check_format(fmt, args if not is_map else args[:1], f"str.{value.__name__}")
            return str(_check_result(inner(*args, **kwargs), f"str.{value.__name__}"))

        return _hook(bounded)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _step()
        if getattr(__obj, "_ephemeral_hook", False):
            kwargs.pop("_loop_vars", None)  # Jinja's own, for functions that take the context
            kwargs.pop("_block_vars", None)
            return __obj(*args, **kwargs)
        owner = getattr(__obj, "__self__", None)
        if owner is not None and inspect.isbuiltin(__obj):
            _check_method(owner, __obj.__name__, args, kwargs)
            if __obj.__name__ == "join" and isinstance(owner, str) and args:
                args = (_bounded_items(args[0], owner, "str.join"), *args[1:])
        elif not (
            isinstance(__obj, _CALLABLE_TYPES)
            or isinstance(owner, _CALLABLE_TYPES)
            or __obj in (safe_range, dict, Namespace, Cycler, Joiner)
        ):
            raise SecurityError(f"{__obj!r} is not callable in recipe templates")
        result = super().call(__context, __obj, *args, **kwargs)
        return _check_result(result, f"{getattr(__obj, '__name__', 'the call')}()")


def _shell_word(value: Any) -> str:
    if type(value) is _Literal:
        return value
    return shlex.quote(str(value))


PROMPTS = _BoundedEnvironment(keep_trailing_newline=False)
COMMANDS = _BoundedEnvironment(keep_trailing_newline=False, finalize=_shell_word)


def render(template: Any, context: Mapping[str, Any], *, limit: int) -> str:
    """``template`` rendered under the limits above, with ``limit`` characters at most."""
    token = _BUDGET.set(_Budget(limit=limit, deadline=time.monotonic() + MAX_SECONDS))
    try:
        out: list[str] = []
        total = 0
        for piece in template.generate(context):
            total += len(piece)
            if total > limit:
                raise TemplateLimit(f"renders to more than {limit} characters")
            out.append(piece)
        return "".join(out)
    finally:
        _BUDGET.reset(token)


# --------------------------------------------------------------------------- shell contexts


def command_problems(source: str) -> list[str]:
    """Why ``{{ … }}`` in the command template ``source`` would not be one shell word."""
    problems: list[str] = []
    lexer = _ShellLexer()
    in_var = False
    try:
        tokens = list(COMMANDS.lex(source))
    except Exception:  # noqa: BLE001 - the compile step reports syntax errors itself
        return []
    for lineno, kind, value in tokens:
        if kind == "variable_begin":
            in_var = True
            where = lexer.placeholder()
            if where is not None:
                problems.append(
                    f"line {lineno}: {{{{ … }}}} {where}: each {{{{ … }}}} in a command is "
                    "already one shell-quoted word; write it bare"
                )
        elif kind == "variable_end":
            in_var = False
        elif kind == "data" and not in_var:
            lexer.feed(value)
    try:
        tree = COMMANDS.parse(source)
    except Exception:  # noqa: BLE001 - reported by the compile step
        return problems
    if any(True for _ in tree.find_all(nodes.FilterBlock)):
        problems.append("a {% filter %} block could rewrite quoted values; use a filter on {{ }}")
    return problems


class _ShellLexer:
    """Just enough of POSIX sh to know whether a spot is a plain word position."""

    def __init__(self) -> None:
        self.stack: list[str] = ["top"]  # top, sq, dq, bq, cs, ar, pe, comment, heredoc
        self.word_start = True
        self.escaped = False
        self.heredocs: list[str] = []  # delimiters waiting for the next newline
        self.heredoc_end = ""
        self.line = ""
        self.pending = ""

    def placeholder(self) -> str | None:
        state = self.stack[-1]
        why = {
            "sq": "inside single quotes",
            "dq": "inside double quotes",
            "bq": "inside backticks",
            "ar": "inside $(( ))",
            "pe": "inside ${ }",
            "comment": "in a comment",
            "heredoc": "in a here-document",
        }.get(state)
        if why is None and self.escaped:
            why = "after a backslash"
        if why is None and self.pending:
            why = "as a here-document's delimiter"
        self.word_start = False
        self.escaped = False
        return why

    def feed(self, text: str) -> None:
        i = 0
        while i < len(text):
            i = self._char(text, i)

    def _char(self, text: str, i: int) -> int:
        c = text[i]
        state = self.stack[-1]
        if self.escaped:
            self.escaped = False
            return i + 1
        if state == "heredoc":
            if c == "\n":
                if self.line.lstrip("\t") == self.heredoc_end:
                    self.stack.pop()
                    self._start_heredoc()
                self.line = ""
            else:
                self.line += c
            return i + 1
        if state == "comment":
            if c == "\n":
                self.stack.pop()
                self._newline()
            return i + 1
        if state == "sq":
            if c == "'":
                self.stack.pop()
            return i + 1
        if c == "\\":
            self.escaped = True
            return i + 1
        if state in {"dq", "bq", "pe", "ar"}:
            closer = {"dq": '"', "bq": "`", "pe": "}", "ar": ")"}[state]
            if c == closer:
                self.stack.pop()
                return i + 1
            if state == "ar" and c == "(":
                self.stack.append("ar")  # a nested parenthesis closes with one ")"
                return i + 1
            return self._opener(text, i, quoted=True)
        # top, sub or cs: a command position
        if state == "cs" and c == ")":
            self.stack.pop()
            return i + 1
        if self.pending and not c.isspace() and c not in ";&|":
            return self._delimiter(text, i)
        if c == "#" and self.word_start:
            self.stack.append("comment")
            return i + 1
        if c == "<" and text.startswith("<<", i) and not text.startswith("<<<", i):
            self.pending = "<<"
            j = i + 2
            if j < len(text) and text[j] == "-":
                j += 1
            self.word_start = True
            return j
        if c == "\n":
            self._newline()
            return i + 1
        self.word_start = c.isspace() or c in ";&|()<>"
        if c == "(":
            self.stack.append("sub")
        elif c == ")" and state == "sub":
            self.stack.pop()
        return self._opener(text, i, quoted=False)

    def _opener(self, text: str, i: int, *, quoted: bool) -> int:
        c, nxt = text[i], text[i + 1 : i + 2]
        if c == "'" and not quoted:
            self.stack.append("sq")
        elif c == '"' and not quoted:
            self.stack.append("dq")
        elif c == "`":
            self.stack.append("bq")
        elif c == "$" and text.startswith("((", i + 1):
            self.stack += ["ar", "ar"]  # closed by "))"
            return i + 3
        elif c == "$" and nxt == "(":
            self.stack.append("cs")
            return i + 2
        elif c == "$" and nxt == "{":
            self.stack.append("pe")
            return i + 2
        return i + 1

    def _delimiter(self, text: str, i: int) -> int:
        j = i
        word = ""
        while j < len(text) and not text[j].isspace() and text[j] not in ";&|<>()":
            if text[j] not in "'\"\\":
                word += text[j]
            j += 1
        self.heredocs.append(word)
        self.pending = ""
        self.word_start = True
        return j

    def _newline(self) -> None:
        self.word_start = True
        self._start_heredoc()

    def _start_heredoc(self) -> None:
        if self.heredocs:
            self.heredoc_end = self.heredocs.pop(0)
            self.stack.append("heredoc")
            self.line = ""
