"""The parser: Dockerfile syntax into instructions (parser directives, continuations, Docker's
word splitting and ``$VAR`` expansion) and ``.dockerignore`` syntax into rules; what it cannot
read is a DockerfileError ``PATH:LINE: INSTRUCTION: message``."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ephemeral import errors


@dataclass(frozen=True)
class Instruction:
    """One instruction: its keyword (upper case), its arguments with continuations joined,
    and the line it starts on (1-based)."""

    keyword: str
    args: str
    line: int
    original: str


@dataclass(frozen=True)
class Parsed:
    path: str
    escape: str
    instructions: list[Instruction]


def fail(
    path: str, line: int | None, instruction: str | None, message: str
) -> errors.DockerfileError:
    where = f"{path}:{line}" if line is not None else path
    what = f" {instruction}" if instruction else ""
    return errors.DockerfileError(
        f"{where}:{what}: {message}",
        path=path,
        line=line,
        instruction=instruction,
        errors=[{"field": f"{path}:{line}" if line else path, "message": message}],
    )


_DIRECTIVE = re.compile(r"#\s*([A-Za-z0-9_]+)\s*=\s*(.*?)\s*$")


def parse(text: str, path: str = "Dockerfile") -> Parsed:
    """Split a Dockerfile into instructions as Docker's parser does: parser directives at the
    top (``# escape=``; ``# syntax=`` and ``# check=`` are read and ignored), comments, empty
    lines, and lines continued by the escape character (comment and empty lines inside a
    continuation are dropped)."""
    escape = "\\"
    lines = text.splitlines()
    i = 0
    seen: set[str] = set()
    while i < len(lines):
        m = _DIRECTIVE.fullmatch(lines[i].strip())
        if m is None:
            break
        key = m.group(1).lower()
        if key not in ("escape", "syntax", "check"):
            break  # an ordinary comment: directives end here
        if key in seen:
            raise fail(path, i + 1, None, f"parser directive {key!r} given twice")
        seen.add(key)
        if key == "escape":
            if m.group(2) not in ("\\", "`"):
                raise fail(path, i + 1, None, f"invalid escape token {m.group(2)!r} (\\ or `)")
            escape = m.group(2)
        i += 1
    out: list[Instruction] = []
    cont = re.compile(re.escape(escape) + r"[ \t]*$")
    while i < len(lines):
        raw = lines[i]
        start = i
        i += 1
        cur = raw.lstrip()
        if not cur or cur.startswith("#"):
            continue
        parts = [raw]
        joined = ""
        while True:
            m = cont.search(cur)
            if m is None:
                joined += cur
                break
            joined += cur[: m.start()]
            # inside a continuation, comment and empty lines are dropped; the next line's
            # leading whitespace is kept
            while i < len(lines) and (not lines[i].strip() or lines[i].lstrip().startswith("#")):
                i += 1
            if i >= len(lines):
                break
            cur = lines[i]
            parts.append(cur)
            i += 1
        m2 = re.match(r"(\S+)\s*(.*)$", joined.strip(), re.S)
        if m2 is None:
            continue
        out.append(Instruction(m2.group(1).upper(), m2.group(2), start + 1, "\n".join(parts)))
    return Parsed(path, escape, out)


def split_words(text: str, escape: str = "\\") -> list[str]:
    """Docker's word split: whitespace outside quotes separates words; quotes and escapes are
    kept for :func:`expand`."""
    words: list[str] = []
    cur: list[str] = []
    quote: str | None = None
    in_word = False
    j = 0
    while j < len(text):
        ch = text[j]
        if quote is None and ch in " \t" and in_word:
            words.append("".join(cur))
            cur, in_word = [], False
        elif quote is None and ch in " \t":
            pass
        else:
            in_word = True
            if ch == escape and quote != "'" and j + 1 < len(text):
                cur.append(ch + text[j + 1])
                j += 2
                continue
            if quote is None and ch in "'\"":
                quote = ch
            elif quote == ch:
                quote = None
            cur.append(ch)
        j += 1
    if in_word:
        words.append("".join(cur))
    return words


class _Lexer:
    """Docker's word expansion (``ProcessWord``): quotes removed, escapes applied, ``$VAR``,
    ``${VAR}``, ``${VAR:-word}``, ``${VAR-word}``, ``${VAR:+word}``, ``${VAR+word}``,
    ``${VAR:?msg}``, ``${VAR?msg}``; an unset variable is empty."""

    def __init__(self, text: str, env: Mapping[str, str], escape: str) -> None:
        self.s = text
        self.i = 0
        self.env = env
        self.esc = escape

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def next(self) -> str:
        ch = self.peek()
        self.i += 1
        return ch

    def word(self, stop: str = "") -> str:
        out: list[str] = []
        while self.i < len(self.s):
            ch = self.peek()
            if stop and ch == stop:
                return "".join(out)
            self.i += 1
            if ch == "'":
                end = self.s.find("'", self.i)
                if end < 0:
                    raise ValueError("unexpected end of text: unterminated single quote")
                out.append(self.s[self.i : end])
                self.i = end + 1
            elif ch == '"':
                out.append(self.double())
            elif ch == "$":
                out.append(self.dollar())
            elif ch == self.esc:
                out.append(self.next())
            else:
                out.append(ch)
        if stop:
            raise ValueError(f"missing '{stop}'")
        return "".join(out)

    def double(self) -> str:
        out: list[str] = []
        while True:
            if self.i >= len(self.s):
                raise ValueError("unexpected end of text: unterminated double quote")
            ch = self.next()
            if ch == '"':
                return "".join(out)
            if ch == "$":
                out.append(self.dollar())
                continue
            if ch == self.esc and self.peek() in ('"', "$", self.esc) and self.peek():
                ch = self.next()
            out.append(ch)

    def name(self) -> str:
        start = self.i
        while self.i < len(self.s) and (self.s[self.i].isalnum() or self.s[self.i] == "_"):
            self.i += 1
        return self.s[start : self.i]

    def dollar(self) -> str:
        if self.peek() != "{":
            name = self.name()
            return "$" if not name else self.env.get(name, "")
        self.i += 1
        name = self.name()
        if not name:
            raise ValueError("bad substitution: '${' needs a variable name")
        ch = self.next()
        if ch == "}":
            return self.env.get(name, "")
        colon = ch == ":"
        if colon:
            ch = self.next()
        if ch not in ("-", "+", "?"):
            raise ValueError(f"unsupported modifier {ch!r} in ${{{name}...}}")
        word = self.word(stop="}")
        self.i += 1
        value = self.env.get(name)
        unset = value is None or (colon and value == "")
        if ch == "-":
            return word if unset else str(value)
        if ch == "+":
            return "" if unset else word
        if unset:
            raise ValueError(f"{name}: {word or 'is not allowed to be unset or empty'}")
        return str(value)


def expand(text: str, env: Mapping[str, str], escape: str = "\\") -> str:
    return _Lexer(text, env, escape).word()


def exec_form(args: str) -> list[str] | None:
    """The JSON array of an exec-form instruction, or None (then it is the shell form)."""
    if not args.startswith("["):
        return None
    try:
        value = json.loads(args)
    except ValueError:
        return None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return None


def split_flags(args: str) -> tuple[dict[str, str], str]:
    """Leading ``--name=value`` (or ``--name``) flags of an instruction, and the rest."""
    flags: dict[str, str] = {}
    rest = args
    while rest.startswith("--"):
        word, _, after = rest.partition(" ")
        if word == "--":
            rest = after.lstrip()
            break
        key, eq, value = word[2:].partition("=")
        flags[key] = value if eq else "true"
        rest = after.lstrip()
    return flags, rest


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """moby/patternmatcher's translation: ``**`` spans directories, ``*`` and ``?`` stay
    within one, ``[...]`` is a class, ``\\`` escapes."""
    out = ["^"]
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "*":
            if i + 1 < len(pattern) and pattern[i + 1] == "*":
                i += 1
                if i + 1 < len(pattern) and pattern[i + 1] == "/":
                    i += 1
                if i + 1 >= len(pattern):
                    out.append(".*" if out == ["^"] else "(/.*)?")
                else:
                    out.append("(.*/)?")
            else:
                out.append("[^/]*")
        elif ch == "?":
            out.append("[^/]")
        elif ch == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        elif ch == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                raise ValueError(f"bad pattern {pattern!r}: unterminated '['")
            body = pattern[i + 1 : end]
            if body.startswith("^") or body.startswith("!"):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end
        else:
            out.append(re.escape(ch))
        i += 1
    out.append("$")
    return re.compile("".join(out))


def _clean(path: str) -> str:
    """Go's path.Clean for a relative path ('' and '.' are '.')."""
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == ".." and parts and parts[-1] != "..":
            parts.pop()
            continue
        parts.append(part)
    return "/".join(parts) or "."


@dataclass(frozen=True)
class IgnoreRule:
    pattern: str
    exclusion: bool
    regex: re.Pattern[str]


def parse_dockerignore(text: str, path: str = ".dockerignore") -> list[IgnoreRule]:
    """Docker's rules: one pattern a line, ``#`` comments, whitespace trimmed, paths cleaned and
    relative to the context (a leading ``/`` is dropped), ``!`` makes an exception."""
    rules: list[IgnoreRule] = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            continue
        p = line.strip()
        if not p:
            continue
        exclusion = p.startswith("!")
        if exclusion:
            p = p[1:].strip()
            if not p:
                raise fail(path, n, None, "an exception ('!') needs a pattern")
        p = _clean(p.lstrip("/")) if p not in ("/",) else "."
        try:
            rules.append(IgnoreRule(p, exclusion, _pattern_regex(p)))
        except (ValueError, re.error) as exc:
            raise fail(path, n, None, str(exc)) from None
    return rules


def ignored(rules: list[IgnoreRule], rel: str) -> bool:
    """Whether context path ``rel`` is excluded: the last rule matching it or one of its
    parent directories decides (patternmatcher's ``MatchesOrParentMatches``)."""
    parts = rel.split("/")
    parents = ["/".join(parts[: k + 1]) for k in range(len(parts) - 1)]
    out = False
    for rule in rules:
        if rule.regex.match(rel) or any(rule.regex.match(p) for p in parents):
            out = not rule.exclusion
    return out


def _join(base: str, path: str) -> str:
    joined = path if path.startswith("/") else f"{base.rstrip('/')}/{path}"
    return "/" + _clean(joined.lstrip("/")) if _clean(joined.lstrip("/")) != "." else "/"
