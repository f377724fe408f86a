"""Images from Dockerfiles: a parser and translator for the subset simple task images use.

A Dockerfile and its context are untrusted input (task authors write them), so a Dockerfile
becomes the same kind of build as an ``image.yaml`` (:mod:`ephemeral.sandbox.images`): one
mmdebstrap layer, then every step in the build sandbox (:mod:`ephemeral.sandbox.build_sandbox`:
root of its own user namespace, the image as ``/``, no network), never as host root.

What each instruction does here, with Docker's documented semantics:

- ``FROM debian:bookworm`` (``-slim``, ``debian:12*``) is our ``default`` image (Debian bookworm
  minbase with python3, the guest agent and user ``worker``); ``FROM NAME`` of one of our images
  (``sandbox_images/NAME``, or a name given by ``ephemeral images alias``) is that image. One
  stage: a second ``FROM`` and ``COPY --from`` are refused.
- ``RUN`` runs in the build sandbox as the current ``USER``, in ``WORKDIR``, with ``ENV`` and the
  stage's ``ARG`` values. The sandbox has no network: the packages of every ``apt-get install``
  (``apt install``) the translator reads in the ``RUN`` lines go into the image's mmdebstrap
  layer (fetched from the host's Debian mirror, as ``packages:`` are), and ``apt-get`` in the
  sandbox checks they are there (``update`` is a no-op, ``remove``/``purge`` are refused). The
  requirements of every ``pip install`` are fetched as wheels by the host's pip (as ``pip:``
  items are) into a directory the ``RUN`` sees, and pip in the sandbox installs from it
  (``PIP_NO_INDEX``, ``PIP_FIND_LINKS``).
- ``COPY``/``ADD`` of context files (``--chown``, ``--chmod``; Docker's trailing-slash,
  directory-contents and glob rules; ``.dockerignore``); sources stay inside the context.
- ``ENV``, ``ARG`` (defaults, ``build_args``), ``WORKDIR`` (made), ``USER`` (the default user of a
  session's exec), ``SHELL``; ``LABEL``, ``EXPOSE``, ``CMD``, ``ENTRYPOINT`` are recorded.
- Anything else is a :class:`~ephemeral.errors.DockerfileError` naming the file, the line and the
  instruction: the builder never makes an image that lacks what the Dockerfile says.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shlex
import shutil
import stat
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement

from ephemeral import errors
from ephemeral.sandbox import images, users
from ephemeral.sandbox.build_sandbox import IN_DIR, BuildSandbox
from ephemeral.settings import Settings

# Bumped when the translation's output changes for the same Dockerfile (part of the hash).
TRANSLATOR_VERSION = 1
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_SHELL = ("/bin/sh", "-c")
DEBIAN_BASES = re.compile(r"debian:(bookworm|bookworm-slim|12|12-slim|12\.[0-9]+|12\.[0-9]+-slim)")
NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,40}")
# what a context may hold (it is hashed and copied on the host): bounded like every input
MAX_CONTEXT_FILES = 100_000
MAX_CONTEXT_BYTES = 4 << 30
MAX_DOCKERFILE_BYTES = 1 << 20
RUN_TIMEOUT_S = 900.0
COPY_TIMEOUT_S = 300.0
PIP_TIMEOUT_S = 900.0
WHEELS = "/run/ephemeral-build/wheels"
APT_SHIM = "/run/ephemeral-build/apt-get"
# A WORKDIR is handed to shells of the sessions and runs that use the image: plain characters
_SAFE_PATH = re.compile(r"/[A-Za-z0-9._/+@:=,~ -]*")
_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.:=~-]{0,99}")

_REFUSED = {
    "ONBUILD": "triggers for images built FROM this one are not honoured",
    "HEALTHCHECK": "health checks are not honoured",
    "VOLUME": "volumes are not honoured (a sandbox has one root)",
    "STOPSIGNAL": "stop signals are not honoured",
}
_KNOWN = {
    "FROM",
    "RUN",
    "COPY",
    "ADD",
    "ENV",
    "ARG",
    "WORKDIR",
    "USER",
    "SHELL",
    "LABEL",
    "EXPOSE",
    "CMD",
    "ENTRYPOINT",
    "MAINTAINER",
}


# ------------------------------------------------------------------------------ parsing


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


# ------------------------------------------------------------------------------ .dockerignore


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


# ------------------------------------------------------------------------------ context


@dataclass
class Context:
    """The files of a build context that ``.dockerignore`` lets in: relative path -> kind
    (``f`` file, ``d`` directory, ``l`` symlink), read without following any link."""

    root: Path
    entries: dict[str, str] = field(default_factory=dict)
    digest: str = ""


def scan_context(root: Path, rules: list[IgnoreRule], path: str) -> Context:
    h = hashlib.sha256()
    ctx = Context(root=root)
    count = size = 0
    has_exceptions = any(r.exclusion for r in rules)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/")
        keep_dirs = []
        for name in dirnames:
            rel = f"{rel_dir}/{name}" if rel_dir else name
            full = os.path.join(dirpath, name)
            if os.path.islink(full):
                filenames.append(name)  # a link to a directory is a link: never walked
                continue
            if ignored(rules, rel):
                if has_exceptions:
                    keep_dirs.append(name)  # an exception may let something below back in
                continue
            ctx.entries[rel] = "d"
            keep_dirs.append(name)
        dirnames[:] = keep_dirs
        for name in sorted(filenames):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if ignored(rules, rel):
                continue
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            count += 1
            if count > MAX_CONTEXT_FILES:
                raise fail(path, None, None, f"the context has more than {MAX_CONTEXT_FILES} files")
            if stat.S_ISLNK(st.st_mode):
                ctx.entries[rel] = "l"
                data = b"symlink " + os.readlink(full).encode()
            elif stat.S_ISREG(st.st_mode):
                size += st.st_size
                if size > MAX_CONTEXT_BYTES:
                    raise fail(
                        path, None, None, f"the context holds more than {MAX_CONTEXT_BYTES} bytes"
                    )
                ctx.entries[rel] = "f"
                data = b""
            else:
                continue  # sockets, fifos, devices: nothing Docker's context sends either
            # a directory that an exception re-includes a file of is in the context too
            parent = rel.rpartition("/")[0]
            while parent and parent not in ctx.entries:
                ctx.entries[parent] = "d"
                parent = parent.rpartition("/")[0]
            enc = rel.encode()
            h.update(len(enc).to_bytes(4, "big") + enc)
            if ctx.entries[rel] == "f":
                fh = hashlib.sha256()
                with open(full, "rb", buffering=0) as f:
                    while chunk := f.read(1 << 20):
                        fh.update(chunk)
                data = fh.digest() + (b"x" if st.st_mode & 0o111 else b"-")
                data += oct(stat.S_IMODE(st.st_mode)).encode()
            h.update(len(data).to_bytes(8, "big") + data)
    for rel, kind in sorted(ctx.entries.items()):
        if kind == "d":
            enc = rel.encode()
            h.update(b"dir" + len(enc).to_bytes(4, "big") + enc)
    ctx.digest = h.hexdigest()
    return ctx


# ------------------------------------------------------------------------------ the plan


@dataclass
class RunStep:
    line: int
    argv: list[str]  # the full command (shell + string, or the exec form)
    env: dict[str, str]
    user: str | None  # as given to USER (resolved at build time)
    workdir: str
    pip: list[list[str]]  # one ``pip download`` argument list per pip install


@dataclass
class CopyStep:
    line: int
    keyword: str
    sources: list[str]  # context paths (cleaned, relative)
    dest: str  # absolute
    as_dir: bool
    chown: str | None
    chmod: str | None


@dataclass
class WorkdirStep:
    line: int
    path: str
    user: str | None


Step = RunStep | CopyStep | WorkdirStep


@dataclass
class Plan:
    """What a Dockerfile asks for, statically: the base image, the packages of its
    ``apt-get install`` lines, its steps, and the resulting image's config."""

    path: str
    base: str
    packages: list[str] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    user_line: int | None = None
    shell: list[str] = field(default_factory=lambda: list(DEFAULT_SHELL))
    labels: dict[str, str] = field(default_factory=dict)
    expose: list[str] = field(default_factory=list)
    cmd: list[str] | None = None
    entrypoint: list[str] | None = None
    args_used: dict[str, str] = field(default_factory=dict)


def _key_values(
    ins: Instruction, env: Mapping[str, str], escape: str, path: str
) -> list[tuple[str, str]]:
    """ENV / LABEL arguments: ``k=v ...`` (quotes and escapes per word), or the legacy
    ``k v`` (the rest of the line is the value)."""
    words = split_words(ins.args, escape)
    if not words:
        raise fail(path, ins.line, ins.keyword, "needs at least one argument")
    try:
        if "=" not in words[0]:
            key = words[0]
            value = ins.args[len(key) :].strip()
            if not value:
                raise fail(path, ins.line, ins.keyword, f"{key!r} needs a value (KEY=VALUE)")
            return [(expand(key, env, escape), expand(value, env, escape))]
        out = []
        for w in words:
            if "=" not in w:
                raise fail(path, ins.line, ins.keyword, f"{w!r}: expected KEY=VALUE")
            k, _, v = w.partition("=")
            out.append((expand(k, env, escape), expand(v, env, escape)))
        return out
    except ValueError as exc:
        raise fail(path, ins.line, ins.keyword, str(exc)) from None


_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def translate(
    parsed: Parsed,
    build_args: Mapping[str, str],
    resolve_base: Any,
    base_env: Any,
) -> Plan:
    """The plan of a parsed Dockerfile. ``resolve_base(name)`` is our image a ``FROM`` names
    (or None), ``base_env(image)`` that image's env."""
    path, esc = parsed.path, parsed.escape
    global_args: dict[str, str | None] = {}
    plan: Plan | None = None
    env: dict[str, str] = {}
    args: dict[str, str] = {}
    workdir = "/"
    user: str | None = None
    shell = list(DEFAULT_SHELL)

    def err(ins: Instruction, message: str) -> errors.DockerfileError:
        return fail(path, ins.line, ins.keyword, message)

    def sub(ins: Instruction, text: str) -> str:
        try:
            return expand(text, {**args, **env}, esc)
        except ValueError as exc:
            raise err(ins, str(exc)) from None

    def no_flags(ins: Instruction, flags: dict[str, str]) -> None:
        if flags:
            raise err(ins, f"--{next(iter(flags))} is not honoured")

    for ins in parsed.instructions:
        kw = ins.keyword
        if kw in _REFUSED:
            raise err(ins, _REFUSED[kw])
        if kw not in _KNOWN:
            raise err(ins, "unknown instruction")
        if plan is None and kw not in ("FROM", "ARG"):
            raise err(ins, "the first instruction must be FROM (ARG may come before it)")
        if kw == "ARG":
            flags, rest = split_flags(ins.args)
            no_flags(ins, flags)
            words = split_words(rest, esc)
            if not words:
                raise err(ins, "needs a name (ARG NAME[=default])")
            for w in words:
                name, eq, default = w.partition("=")
                if not _ENV_KEY.fullmatch(name):
                    raise err(ins, f"{name!r} is not a valid argument name")
                value: str | None
                if eq:
                    value = (
                        expand(default, {**args, **env}, esc)
                        if plan
                        else expand(
                            default, {k: v for k, v in global_args.items() if v is not None}, esc
                        )
                    )
                else:
                    value = None
                if plan is None:
                    global_args[name] = build_args.get(name, value)
                    continue
                if name in build_args:
                    value = build_args[name]
                elif value is None and global_args.get(name) is not None:
                    value = global_args[name]
                if value is not None:
                    args[name] = value
                    plan.args_used[name] = value
            continue
        if kw == "FROM":
            if plan is not None:
                raise err(ins, "multi-stage builds are not honoured (one FROM per Dockerfile)")
            flags, rest = split_flags(ins.args)
            no_flags(ins, flags)
            words = split_words(rest, esc)
            if len(words) not in (1, 3) or (len(words) == 3 and words[1].lower() != "as"):
                raise err(ins, "expected FROM IMAGE [AS NAME]")
            try:
                image = expand(
                    words[0], {k: v for k, v in global_args.items() if v is not None}, esc
                )
            except ValueError as exc:
                raise err(ins, str(exc)) from None
            base = resolve_base(image)
            if base is None:
                raise err(
                    ins,
                    f"{image!r} is not an image this builder can make: use debian:bookworm, "
                    "debian:bookworm-slim, debian:12 or one of our images (ephemeral images list; "
                    "ephemeral images alias NAME IMAGE)",
                )
            plan = Plan(path=path, base=base)
            env = {"PATH": DEFAULT_PATH, **base_env(base)}
            continue
        assert plan is not None
        if kw == "RUN":
            flags, rest = split_flags(ins.args)
            no_flags(ins, flags)
            if not rest:
                raise err(ins, "needs a command")
            form = exec_form(rest)
            if form is None and re.match(r"<<-?['\"]?[A-Za-z_]", rest):
                raise err(ins, "here-documents are not honoured")
            argv = form if form is not None else [*shell, rest]
            if not argv:
                raise err(ins, "needs a command")
            run_env = {**args, **env}
            script = rest if form is None else _script_of(form)
            plan.packages += _apt_packages(ins, script, run_env, path)
            pip = _pip_requirements(ins, script, run_env, path, workdir)
            plan.steps.append(RunStep(ins.line, argv, run_env, user, workdir, pip))
        elif kw in ("COPY", "ADD"):
            plan.steps.append(_copy_step(ins, sub, workdir, esc, path))
        elif kw == "ENV":
            for k, v in _key_values(ins, {**args, **env}, esc, path):
                if not _ENV_KEY.fullmatch(k):
                    raise err(ins, f"{k!r} is not a valid variable name")
                env[k] = v
        elif kw == "LABEL":
            for k, v in _key_values(ins, {**args, **env}, esc, path):
                plan.labels[k] = v
        elif kw == "MAINTAINER":
            plan.labels["maintainer"] = ins.args
        elif kw == "WORKDIR":
            value = sub(ins, ins.args.strip())
            if not value:
                raise err(ins, "needs a path")
            workdir = _join(workdir, value)
            if not _SAFE_PATH.fullmatch(workdir) or any(
                p in (".", "..") for p in workdir.split("/")
            ):
                raise err(
                    ins,
                    f"{workdir!r}: only plain paths of letters, digits and ._/+@:=,~- are honoured",
                )
            plan.steps.append(WorkdirStep(ins.line, workdir, user))
        elif kw == "USER":
            value = sub(ins, ins.args.strip())
            if not re.fullmatch(
                r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,31})?", value
            ):
                raise err(ins, f"{value!r} is not a user name or uid (USER NAME[:GROUP])")
            user = value
            plan.user_line = ins.line
        elif kw == "SHELL":
            form = exec_form(ins.args)
            if not form:
                raise err(ins, 'needs the JSON form: SHELL ["executable", "parameters"]')
            shell = form
        elif kw == "EXPOSE":
            for w in split_words(ins.args, esc):
                port = sub(ins, w)
                if not re.fullmatch(r"[0-9]{1,5}(-[0-9]{1,5})?(/(tcp|udp|sctp))?", port):
                    raise err(ins, f"{port!r} is not a port (PORT[/tcp|udp])")
                plan.expose.append(port)
        elif kw in ("CMD", "ENTRYPOINT"):
            form = exec_form(ins.args)
            value_list = form if form is not None else [*shell, ins.args]
            if kw == "CMD":
                plan.cmd = value_list
            else:
                plan.entrypoint = value_list
                plan.cmd = None  # ENTRYPOINT resets an inherited CMD (none here: one stage)
    if plan is None:
        raise fail(path, None, None, "no FROM instruction")
    plan.env = env
    plan.workdir = workdir if any(isinstance(s, WorkdirStep) for s in plan.steps) else None
    plan.user = user
    plan.shell = shell
    plan.packages = list(dict.fromkeys(plan.packages))
    return plan


def _script_of(form: list[str]) -> str:
    """What to read package names in for an exec-form RUN: the script of ``sh -c SCRIPT``,
    else the argv itself."""
    shells = ("sh", "bash", "dash")
    if len(form) >= 3 and os.path.basename(form[0]) in shells and form[1] == "-c":
        return form[2]
    return shlex.join(form)


def _join(base: str, path: str) -> str:
    joined = path if path.startswith("/") else f"{base.rstrip('/')}/{path}"
    return "/" + _clean(joined.lstrip("/")) if _clean(joined.lstrip("/")) != "." else "/"


def _copy_step(ins: Instruction, sub: Any, workdir: str, esc: str, path: str) -> CopyStep:
    def err(message: str) -> errors.DockerfileError:
        return fail(path, ins.line, ins.keyword, message)

    flags, rest = split_flags(ins.args)
    for k in flags:
        if k == "from":
            raise err("--from is not honoured (multi-stage builds and copies from images)")
        if k not in ("chown", "chmod", "link"):
            raise err(f"--{k} is not honoured")
    form = exec_form(rest)
    words = form if form is not None else split_words(rest, esc)
    if form is not None:
        words = [w.replace('"', '\\"') for w in words]
        words = [f'"{w}"' for w in words]
    if len(words) < 2:
        raise err(f"needs a source and a destination ({ins.keyword} SRC... DEST)")
    values = [sub(ins, w) for w in words]
    *sources, dest = values
    chown = sub(ins, flags["chown"]) if "chown" in flags else None
    if chown is not None and not re.fullmatch(
        r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,31})?", chown
    ):
        raise err(f"--chown={chown!r}: expected USER[:GROUP] (names or ids)")
    chmod = flags.get("chmod")
    if chmod is not None and not re.fullmatch(r"[0-7]{3,4}", chmod):
        raise err(f"--chmod={chmod!r}: only octal modes (such as 0755) are honoured")
    for s in sources:
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", s) or s.startswith("git@"):
            raise err(f"{s!r}: URL sources are not honoured (copy local files of the context)")
        if s.startswith("/") or ".." in s.split("/"):
            raise err(f"{s!r}: sources must be paths inside the context (no '/' start, no '..')")
    as_dir = dest.endswith("/") or dest in (".", "..") or dest.endswith("/.")
    return CopyStep(
        ins.line,
        ins.keyword,
        [_clean(s) for s in sources],
        _join(workdir, dest),
        as_dir,
        chown,
        chmod,
    )


# ------------------------------------------------------------------------------ RUN reading


_SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")", "\n", ";;", "{", "}"}


def _commands(
    ins: Instruction, text: str, env: Mapping[str, str], path: str
) -> Iterator[list[str | None]]:
    """The simple commands of a shell line, each word as the shell would make it from the
    RUN's variables, or None when it needs more (``$(...)``, backticks, an unquoted glob):
    for reading package names, which the caller refuses when it cannot read one."""
    cmd: list[str | None] = []
    for tok in _shell_tokens(ins, text, path):
        if tok is _SEP:
            if cmd:
                yield cmd
            cmd = []
            continue
        cmd.append(_expand_shell_word(str(tok), env))
    if cmd:
        yield cmd


_SEP = object()


def _shell_tokens(ins: Instruction, text: str, path: str) -> Iterator[object]:
    """Words (quotes and escapes kept) and command separators (``;``, ``&``, ``|``, ``(``,
    ``)``, newlines) of a shell line; ``#`` at a word's start comments out the rest."""
    word: list[str] = []
    quote: str | None = None
    i = 0
    while i < len(text):
        ch = text[i]
        if quote is not None:
            word.append(ch)
            if ch == "\\" and quote == '"' and i + 1 < len(text):
                word.append(text[i + 1])
                i += 1
            elif ch == quote:
                quote = None
        elif ch == "\\" and i + 1 < len(text):
            word.append(ch + text[i + 1])
            i += 1
        elif ch in "'\"":
            quote = ch
            word.append(ch)
        elif ch == "#" and not word:
            nl = text.find("\n", i)
            i = len(text) if nl < 0 else nl
            continue
        elif ch in " \t" or ch in ";&|()\n":
            if word:
                yield "".join(word)
                word = []
            if ch not in " \t":
                yield _SEP
        else:
            word.append(ch)
        i += 1
    if quote is not None:
        raise fail(path, ins.line, "RUN", "cannot read the command: unterminated quote")
    if word:
        yield "".join(word)


_WRAPPERS = {"sudo", "exec", "env", "command", "nohup", "then", "do", "else", "if", "while"}
_WRAPPERS |= {"!", "time", "xargs"}


def _strip_prefix(cmd: list[str | None]) -> list[str | None]:
    """Drop leading ``VAR=value`` assignments and wrappers (``env``, ``sudo``, ``if`` ...)."""
    i = 0
    while i < len(cmd):
        w = cmd[i]
        if w is not None and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", w) or w in _WRAPPERS):
            i += 1
            continue
        break
    return cmd[i:]


_APT_VALUE_OPTS = {"-o", "-c", "-t", "--option", "--config-file", "--target-release"}
_APT_VALUE_OPTS |= {"--default-release"}


def _apt_packages(ins: Instruction, text: str, env: Mapping[str, str], path: str) -> list[str]:
    """The packages of every ``apt-get install`` / ``apt install`` of a RUN line."""
    out: list[str] = []
    for cmd in _commands(ins, text, env, path):
        cmd = _strip_prefix(cmd)
        if not cmd or cmd[0] is None or os.path.basename(cmd[0]) not in ("apt-get", "apt"):
            continue
        words: list[str | None] = []
        skip = False
        for w in cmd[1:]:
            if skip:
                skip = False
                continue
            if w in _APT_VALUE_OPTS:
                skip = True
                continue
            if w is not None and w.startswith("-"):
                continue
            words.append(w)
        if not words or words[0] != "install":
            continue
        for value in words[1:]:
            for name in value.split() if value is not None else [None]:
                if name is None or not _PACKAGE.fullmatch(name):
                    raise fail(
                        path,
                        ins.line,
                        "RUN",
                        f"apt-get install {name or value!r}: only plain package names are "
                        "honoured (the builder reads them to fetch them before the build; it "
                        "cannot run a command substitution, a glob or install a local .deb)",
                    )
                out.append(name.split("=", 1)[0].split("/", 1)[0])
    return out


def _expand_shell_word(word: str, env: Mapping[str, str]) -> str | None:
    """A word's value as the shell would make it from the RUN's variables (quotes removed),
    or None when it needs more than variables (command substitution, an unquoted glob)."""
    if "`" in word or "$(" in word or _unquoted_glob(word):
        return None
    try:
        return expand(word, env)
    except ValueError:
        return None


def _unquoted_glob(word: str) -> bool:
    quote: str | None = None
    i = 0
    while i < len(word):
        ch = word[i]
        if quote is None and ch == "\\":
            i += 2
            continue
        if quote is None and ch in "'\"":
            quote = ch
        elif ch == quote:
            quote = None
        elif quote is None and ch in "*?[{":
            return True
        i += 1
    return False


_PIP = re.compile(r"pip(3(\.[0-9]+)?)?")
_PYTHON = re.compile(r"python(3(\.[0-9]+)?)?")
_PIP_VALUE_OPTS = {
    "-t",
    "--target",
    "--prefix",
    "--root",
    "--root-user-action",
    "--progress-bar",
    "--log",
    "--cache-dir",
    "--src",
    "--upgrade-strategy",
    "--python",
    "--timeout",
    "--retries",
    "--platform",
    "--python-version",
    "--implementation",
    "--abi",
    "--only-binary",
    "--no-binary",
    "--global-option",
    "--config-settings",
    "-C",
}
_PIP_REFUSED = {
    "-i": "an index",
    "--index-url": "an index",
    "--extra-index-url": "an index",
    "-f": "find-links",
    "--find-links": "find-links",
    "--trusted-host": "a host",
    "-e": "an editable install",
    "--editable": "an editable install",
    "-c": "a constraints file",
    "--constraint": "a constraints file",
}


def _pip_requirements(
    ins: Instruction, text: str, env: Mapping[str, str], path: str, workdir: str = "/"
) -> list[list[str]]:
    """For each ``pip install`` of a RUN line, what the host's pip must fetch: requirement
    specifiers, ``-r FILE`` (a file of the image, read when the RUN comes; relative to
    ``workdir``), ``--no-deps``/``--pre``. Local paths are left to the pip inside."""
    out: list[list[str]] = []

    def err(message: str) -> errors.DockerfileError:
        return fail(path, ins.line, "RUN", message)

    for cmd in _commands(ins, text, env, path):
        cmd = _strip_prefix(cmd)
        if not cmd or cmd[0] is None:
            continue
        prog = os.path.basename(cmd[0])
        rest: list[str | None]
        if _PIP.fullmatch(prog):
            rest = cmd[1:]
        elif _PYTHON.fullmatch(prog) and cmd[1:3] == ["-m", "pip"]:
            rest = cmd[3:]
        else:
            continue
        while rest and rest[0] is not None and rest[0].startswith("-"):
            rest = rest[1:]  # pip's general options (-q, --no-cache-dir, --isolated)
        if not rest or rest[0] != "install":
            continue
        reqs: list[str] = []
        extra: list[str] = []
        skip = False
        words = rest[1:]
        for n, w in enumerate(words):
            if skip:
                skip = False
                continue
            if w in ("-r", "--requirement") or (w or "").startswith("--requirement="):
                assert w is not None
                value = w.partition("=")[2] if "=" in w else (words[n + 1 : n + 2] or [None])[0]
                skip = "=" not in w
                if not value:
                    raise err("pip install -r: the builder cannot read the file's name")
                extra += ["-r", _join(workdir, value)]
                continue
            if w is None:
                raise err("pip install: the builder cannot read a requirement of this command")
            opt = w.split("=", 1)[0]
            if opt in _PIP_REFUSED:
                raise err(
                    f"pip install {w}: {_PIP_REFUSED[opt]} is not honoured (the host's pip "
                    "fetches the named requirements from the mirrors it is configured for)"
                )
            if opt in _PIP_VALUE_OPTS:
                skip = "=" not in w
                continue
            if w in ("--no-deps", "--pre"):
                extra.append(w)
                continue
            if w.startswith("-"):
                continue
            if "://" in w:
                raise err(f"pip install {w!r}: URLs are not honoured")
            if w.startswith((".", "/", "~")) or w.endswith((".whl", ".tar.gz", ".zip")):
                continue  # a local path in the image: the pip inside installs it
            try:
                req = Requirement(w)
            except InvalidRequirement:
                raise err(f"pip install {w!r}: not a requirement specifier") from None
            if req.url is not None:
                raise err(f"pip install {w!r}: URLs are not honoured")
            reqs.append(w)
        if reqs or "-r" in extra:
            out.append([*extra, "--", *reqs])
    return out


MAX_REQUIREMENTS_BYTES = 1 << 20


def read_in_image(rootfs: Path, path: str) -> bytes:
    """File ``path`` of the image being built, read without following any link (the image is
    untrusted: a link could name a host path); OSError when it cannot be read so."""
    parts = [p for p in path.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise OSError(f"{path}: not a plain path")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(rootfs, flags | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        f = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)
    with os.fdopen(f, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise OSError(f"{path}: not a regular file")
        data = fh.read(MAX_REQUIREMENTS_BYTES + 1)
    if len(data) > MAX_REQUIREMENTS_BYTES:
        raise OSError(f"{path}: larger than {MAX_REQUIREMENTS_BYTES} bytes")
    return data


def requirements_file(text: str) -> list[str]:
    """The requirement specifiers of a pip requirements file; ValueError naming the line for
    what is not honoured (indexes, links, nested files, editables, URLs)."""
    out: list[str] = []
    joined = re.sub(r"\\\n", "", text)
    for n, raw in enumerate(joined.splitlines(), 1):
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()
        if not line:
            continue
        words = line.split()
        if words[0].startswith("-"):
            opt = words[0].split("=", 1)[0]
            if opt in ("--pre", "--only-binary", "--prefer-binary", "--no-binary"):
                continue
            raise ValueError(f"line {n}: {opt} is not honoured in a requirements file")
        spec = " ".join(w for w in words if not w.startswith("--hash"))
        if "://" in spec:
            raise ValueError(f"line {n}: URLs are not honoured")
        if spec.startswith((".", "/", "~")):
            raise ValueError(f"line {n}: a local path is not honoured in a requirements file")
        try:
            req = Requirement(spec)
        except InvalidRequirement:
            raise ValueError(f"line {n}: {spec!r} is not a requirement specifier") from None
        if req.url is not None:
            raise ValueError(f"line {n}: URLs are not honoured")
        out.append(spec)
    return out


# ------------------------------------------------------------------------------ aliases


def _aliases_path(settings: Settings) -> Path:
    return settings.image_cache_dir / "aliases.json"


def aliases(settings: Settings) -> dict[str, str]:
    """The local map of ``docker_image`` names to our images (``ephemeral images alias``)."""
    try:
        raw = json.loads(_aliases_path(settings).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {}


_DOCKER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}")


def set_alias(settings: Settings, name: str, image: str) -> None:
    """Make ``docker_image`` name ``name`` mean our image ``image`` (which must exist)."""
    if not _DOCKER_NAME.fullmatch(name):
        raise errors.InvalidRequest.field("name", f"{name!r} is not an image name")
    if _our_image(settings, image) is None:
        raise errors.InvalidRequest.field(
            "image", f"{image!r} is not one of our images (sandbox_images/ or a built Dockerfile)"
        )
    current = aliases(settings)
    current[name] = image
    p = _aliases_path(settings)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(".aliases.json.tmp")
    tmp.write_text(json.dumps(current, indent=1, sort_keys=True))
    os.replace(tmp, p)


def _our_image(settings: Settings, name: str) -> str | None:
    if not NAME.fullmatch(name):
        return None
    if (settings.images_dir / name / "image.yaml").is_file():
        return name
    if images.dockerfile_image_dir(settings, name) is not None:
        return name
    return None


def resolve_image(settings: Settings, docker_image: str) -> str:
    """Our image for a ``docker_image`` name: a Debian bookworm base is ``default``, one of our
    images is itself, an alias is what it names; anything else is a DockerfileError."""
    found = _resolve(settings, docker_image)
    if found is None:
        raise errors.DockerfileError(
            f"docker_image {docker_image!r}: no image of ours is that image (build its "
            "Dockerfile with `ephemeral images build --dockerfile`, or map the name with "
            "`ephemeral images alias NAME IMAGE`)",
            errors=[{"field": "docker_image", "message": "unknown image"}],
        )
    return found


def _resolve(settings: Settings, image: str) -> str | None:
    if DEBIAN_BASES.fullmatch(image) or image in ("docker.io/library/debian:bookworm",):
        return "default"
    alias = aliases(settings).get(image)
    if alias is not None:
        return _our_image(settings, alias)
    return _our_image(settings, image)


# ------------------------------------------------------------------------------ building


def load(
    dockerfile: Path,
    context: Path | None,
    build_args: Mapping[str, str],
    settings: Settings,
) -> tuple[Plan, Context, bytes]:
    """Read, parse and translate a Dockerfile and scan its context (no build)."""
    path = str(dockerfile)
    try:
        st = os.stat(dockerfile)
        if not stat.S_ISREG(st.st_mode):
            raise fail(path, None, None, "not a regular file")
        if st.st_size > MAX_DOCKERFILE_BYTES:
            raise fail(path, None, None, f"larger than {MAX_DOCKERFILE_BYTES} bytes")
        data = dockerfile.read_bytes()
    except OSError as exc:
        raise fail(path, None, None, f"cannot read it: {exc.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise fail(path, None, None, "not UTF-8 text") from None
    root = (context if context is not None else dockerfile.parent).resolve()
    if not root.is_dir():
        raise fail(path, None, None, f"context {root} is not a directory")
    rules: list[IgnoreRule] = []
    for ign in (dockerfile.with_name(dockerfile.name + ".dockerignore"), root / ".dockerignore"):
        if ign.is_file() and not ign.is_symlink():
            rules = parse_dockerignore(ign.read_text(errors="replace"), str(ign))
            break
    for k in build_args:
        if not _ENV_KEY.fullmatch(k):
            raise errors.InvalidRequest.field("build_args", f"{k!r} is not a valid argument name")

    def base_env(image: str) -> dict[str, str]:
        env: dict[str, str] = {}
        for _, d in images.chain(images.definition_dir(settings, image)):
            env.update(d.env)
        return env

    def resolve_base(image: str) -> str | None:
        found = _resolve(settings, image)
        if found is None or not (settings.images_dir / found / "image.yaml").is_file():
            return None  # a Dockerfile image as a base: not yet (its steps are not a definition)
        return found

    plan = translate(parse(text, path), build_args, resolve_base, base_env)
    ctx = scan_context(root, rules, path)
    for step in plan.steps:
        if isinstance(step, CopyStep):
            resolve_copy(ctx, plan, step)  # a missing or escaping source fails before a build
    return plan, ctx, data


def _digest(data: bytes, build_args: Mapping[str, str], ctx: Context, base_hash: str) -> str:
    h = hashlib.sha256(
        f"dockerfile-{TRANSLATOR_VERSION} builder-{images.BUILDER_VERSION}\n".encode()
    )
    h.update(f"base {base_hash}\n".encode())
    h.update(len(data).to_bytes(8, "big") + data)
    args = json.dumps(dict(sorted(build_args.items()))).encode()
    h.update(len(args).to_bytes(8, "big") + args)
    h.update(f"context {ctx.digest}\n".encode())
    return h.hexdigest()


def build_dockerfile(
    dockerfile: Path,
    context: Path | None = None,
    *,
    name: str | None = None,
    build_args: Mapping[str, str] | None = None,
    settings: Settings | None = None,
) -> images.ImageConfig:
    """Build the image a Dockerfile describes (or find it cached) and return its config.

    ``context`` defaults to the Dockerfile's directory; ``name`` to ``dockerfile-<hash12>``.
    The build is cached under ``~/.cache/ephemeral/images/<name>-<hash16>`` by the sha256 of
    the Dockerfile, the build args, the context's files that ``.dockerignore`` lets in and the
    base image's hash: a second call with the same inputs returns at once. After it, ``name``
    is an image like the others (``images list``, ``GET /v1/images``, a run's ``image``).

    Returns :class:`ephemeral.sandbox.images.ImageConfig`, what ``images.built_image`` and
    ``Runtime.built_image`` return for the image: ``name``, ``hash``, ``rootfs``, ``env`` (the
    Dockerfile's final ``ENV``, over its base image's env and ``PATH``), ``workdir`` and ``cwd``
    (the final ``WORKDIR``, absolute, or None when it gives none), ``user`` (the final ``USER``,
    ``root`` when it gives none, as in Docker), ``base`` (our image it is built on) and
    ``dockerfile`` (``cmd``, ``entrypoint``, ``expose``, ``labels``, ``shell``, ``path``).

    Raises :class:`ephemeral.errors.DockerfileError` (with ``path``, ``line``, ``instruction``)
    for what is not honoured and for a step that fails. Blocking: it runs its own event loop
    (from async code, ``await asyncio.to_thread(build_dockerfile, ...)``).
    """
    return asyncio.run(
        abuild_dockerfile(dockerfile, context, name=name, build_args=build_args, settings=settings)
    )


async def abuild_dockerfile(
    dockerfile: Path,
    context: Path | None = None,
    *,
    name: str | None = None,
    build_args: Mapping[str, str] | None = None,
    settings: Settings | None = None,
) -> images.ImageConfig:
    """:func:`build_dockerfile` for async callers."""
    settings = settings or Settings.load()
    build_args = dict(build_args or {})
    dockerfile = Path(dockerfile)
    plan, ctx, data = await asyncio.to_thread(load, dockerfile, context, build_args, settings)
    base_dir = images.definition_dir(settings, plan.base)
    digest = _digest(data, build_args, ctx, images.definition_hash(base_dir))
    name = name or f"dockerfile-{digest[:12]}"
    if not NAME.fullmatch(name):
        raise errors.InvalidRequest.field(
            "name", f"{name!r}: lowercase letters, digits and '-', at most 41 characters"
        )
    if (settings.images_dir / name / "image.yaml").is_file():
        raise errors.InvalidRequest.field(
            "name", f"{name!r} is an image definition of sandbox_images/: choose another name"
        )
    out = settings.image_cache_dir / f"{name}-{digest[:16]}"
    marker = out / "image.json"
    if not marker.is_file():
        lock = settings.image_cache_dir / f".{name}.lock"
        async with images._AsyncFileLock(lock):
            if not marker.is_file():
                await _build(settings, plan, ctx, dockerfile, base_dir, out, digest, name)
    images.point_name(settings, name, out)
    built = images.built_image(settings, name)
    assert built is not None
    return built


async def _build(
    settings: Settings,
    plan: Plan,
    ctx: Context,
    dockerfile: Path,
    base_dir: Path,
    out: Path,
    digest: str,
    name: str,
) -> None:
    layers = images.chain(base_dir)
    spec = images._layer_spec([d for _, d in layers], tuple(plan.packages))
    base = await images._ensure_base(settings, spec)

    async def steps(box: BuildSandbox, rootfs: Path, stage: Path, _env: dict[str, str]) -> None:
        await _apply(box, rootfs, stage, plan, ctx)
        _check_user(rootfs, plan)

    info = await images._assemble(layers, base, out, then=steps)
    meta = {
        "name": name,
        "hash": digest,
        "built_at": time.time(),
        **info,
        "env": plan.env,
        "workdir": plan.workdir,
        "cwd": plan.workdir,
        "exec_user": plan.user or "root",
        "base": plan.base,
        "base_hash": images.definition_hash(base_dir),
        "dockerfile": {
            "path": str(dockerfile),
            "cmd": plan.cmd,
            "entrypoint": plan.entrypoint,
            "expose": plan.expose,
            "labels": plan.labels,
            "shell": plan.shell,
            "build_args": plan.args_used,
            "packages": plan.packages,
        },
        "size_bytes": await asyncio.to_thread(images._du, out),
    }
    (out / "image.json").write_text(json.dumps(meta, indent=1))


def _check_user(rootfs: Path, plan: Plan) -> str | None:
    """The final USER must be a user of the image (a name in its passwd, or a number)."""
    if plan.user is None:
        return None
    who = plan.user.split(":", 1)[0]
    if users.resolve(who, users.read_passwd(rootfs) or "") is None:
        raise fail(plan.path, plan.user_line, "USER", f"{who!r} is not a user of the image")
    return plan.user


_APT_SHIM_TEXT = r"""#!/bin/sh
# ephemeral's apt-get at build time: the build has no network, and the packages of the
# Dockerfile's `apt-get install` lines are already in the image's package layer
sub= pkgs= skip=
for a in "$@"; do
  if [ -n "$skip" ]; then skip=; continue; fi
  case $a in
    -o|-c|-t|--option|--config-file|--target-release|--default-release) skip=1 ;;
    -*) ;;
    *) if [ -z "$sub" ]; then sub=$a; else pkgs="$pkgs $a"; fi ;;
  esac
done
case $sub in
  update|upgrade|dist-upgrade|full-upgrade|clean|autoclean) exit 0 ;;
  install)
    missing=
    for p in $pkgs; do
      n=${p%%=*}; n=${n%%/*}
      s=$(dpkg-query -W -f='${db:Status-Status}' "$n" 2>/dev/null)
      [ "$s" = installed ] || missing="$missing $n"
    done
    [ -z "$missing" ] && exit 0
    echo "apt-get install: not in the image's package layer:$missing" >&2
    echo "(the builder installs the packages it reads in RUN apt-get install lines)" >&2
    exit 100 ;;
  *) echo "apt-get $sub: not honoured at build time (no network: packages come from" >&2
    echo "the image's package layer)" >&2
    exit 100 ;;
esac
"""


async def _apply(box: BuildSandbox, rootfs: Path, stage: Path, plan: Plan, ctx: Context) -> None:
    shim = stage / "apt-get"
    shim.write_text(_APT_SHIM_TEXT)
    shim.chmod(0o755)
    wheels = stage / "wheels"
    wheels.mkdir()
    for n, step in enumerate(plan.steps):
        if isinstance(step, RunStep):
            await _run_step(box, rootfs, stage, plan, step, shim, wheels)
        elif isinstance(step, CopyStep):
            await _copy(box, stage / f"copy-{n}", plan, ctx, step)
        else:
            await _workdir(box, rootfs, plan, step)


def _image_ids(
    rootfs: Path, plan: Plan, spec: str, line: int, kw: str
) -> tuple[int, int, str | None]:
    """uid, gid and home of ``USER`` value ``spec`` in the image as it is now."""
    who, _, group = spec.partition(":")
    passwd = users.read_passwd(rootfs) or ""
    ids = users.resolve(who, passwd)
    if ids is None:
        raise fail(plan.path, line, kw, f"USER {who!r} is not a user of the image (yet)")
    home = None
    for entry in passwd.splitlines():
        parts = entry.split(":")
        if len(parts) >= 7 and parts[2] == str(ids.uid) and (parts[0] == who or who.isdigit()):
            home = parts[5]
            break
    gid = ids.gid
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            found = _group_id(rootfs, group)
            if found is None:
                raise fail(plan.path, line, kw, f"group {group!r} is not a group of the image")
            gid = found
    return ids.uid, gid, home


def _group_id(rootfs: Path, group: str) -> int | None:
    text = _read_etc(rootfs, "group") or ""
    for entry in text.splitlines():
        parts = entry.split(":")
        if len(parts) >= 3 and parts[0] == group and parts[2].isdigit():
            return int(parts[2])
    return None


def _read_etc(rootfs: Path, name: str) -> str | None:
    """``/etc/NAME`` of the image, read without following a link (the image is untrusted)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        root = os.open(rootfs, flags | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        etc = os.open("etc", flags | os.O_DIRECTORY, dir_fd=root)
        try:
            fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=etc)
        finally:
            os.close(etc)
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return None
            return fh.read(users.PASSWD_CAP).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(root)


_IN_DIR_CD = 'cd -- "$0" || exit 1; exec "$@"'


async def _run_step(
    box: BuildSandbox,
    rootfs: Path,
    stage: Path,
    plan: Plan,
    step: RunStep,
    shim: Path,
    wheels: Path,
) -> None:
    env = dict(step.env)
    prefix: list[str] = []
    home = "/root"
    if step.user is not None:
        uid, gid, user_home = _image_ids(rootfs, plan, step.user, step.line, "RUN")
        home = user_home or "/"
        if uid != 0 or gid != 0:
            prefix = ["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={gid}"]
            prefix += ["--init-groups"] if user_home is not None else ["--clear-groups"]
            prefix.append("--")
    env.setdefault("HOME", home)
    ro: list[tuple[Path, str]] = []
    for p in ("usr/bin/apt-get", "usr/bin/apt"):
        try:
            if stat.S_ISREG(os.lstat(rootfs / p).st_mode):
                ro.append((shim, "/" + p))
        except OSError:
            pass
    if step.pip:
        version = images.image_python(rootfs)
        for reqs in step.pip:
            full = _with_files(rootfs, plan, step, reqs)
            if full[-1] != "--":  # a requirements file may name nothing
                await _pip_download(plan, step, version, full, wheels)
        ro.append((wheels, WHEELS))
        env.setdefault("PIP_NO_INDEX", "1")
        env["PIP_FIND_LINKS"] = WHEELS
    argv = ["/bin/sh", "-c", _IN_DIR_CD, step.workdir, *prefix, *step.argv]
    try:
        await box.run(argv, f"RUN at line {step.line}", env=env, timeout=RUN_TIMEOUT_S, ro=ro)
    except errors.SandboxError as exc:
        raise fail(plan.path, step.line, "RUN", exc.detail.removeprefix("image build: ")) from None


def _with_files(rootfs: Path, plan: Plan, step: RunStep, reqs: list[str]) -> list[str]:
    """``reqs`` with each ``-r FILE`` replaced by the file's requirements (read in the image
    as it is when the RUN comes)."""
    out: list[str] = []
    files: list[str] = []
    it = iter(reqs)
    for w in it:
        if w == "-r":
            files.append(next(it))
        else:
            out.append(w)
    for f in files:
        try:
            text = read_in_image(rootfs, f).decode("utf-8", "replace")
            out += requirements_file(text)
        except OSError as exc:
            raise fail(plan.path, step.line, "RUN", f"pip install -r {f}: {exc}") from None
        except ValueError as exc:
            raise fail(plan.path, step.line, "RUN", f"pip install -r {f}: {exc}") from None
    return out


async def _pip_download(
    plan: Plan, step: RunStep, version: str, reqs: list[str], wheels: Path
) -> None:
    """The host's pip fetches wheels only (no package code runs) for the image's python."""
    argv = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--no-input",
        "--only-binary=:all:",
        f"--python-version={version}",
        "--implementation=cp",
        f"--dest={wheels}",
        *reqs,
    ]
    try:
        await images._run(argv, "pip download", timeout=PIP_TIMEOUT_S)
    except errors.SandboxError as exc:
        raise fail(plan.path, step.line, "RUN", exc.detail.removeprefix("image build: ")) from None


_COPY_SH = r"""
src=$1 dst=$2 kind=$3 own=$4 mode=$5
case $own in
  '') own=0:0 ;;
  *:*) ;;
  *) u=$own; case $u in *[!0-9]*) u=$(id -u -- "$u") || exit 1 ;; esac; own=$u:$u ;;
esac
if [ "$kind" = dir ]; then
  new=; [ -e "$dst" ] || [ -L "$dst" ] || new=1
  mkdir -p -- "$dst"
  for e in "$src"/* "$src"/.[!.]* "$src"/..?*; do
    [ -e "$e" ] || [ -L "$e" ] || continue
    n=${e##*/}
    cp -R -P --remove-destination --preserve=mode,timestamps,links -- "$e" "$dst/"
    chown -R -h -- "$own" "$dst/$n"
    if [ -n "$mode" ]; then chmod -R -- "$mode" "$dst/$n"; fi
  done
  if [ -n "$new" ]; then chown -h -- "$own" "$dst"; fi
else
  for e in "$src"/* "$src"/.[!.]* "$src"/..?*; do
    [ -e "$e" ] || [ -L "$e" ] || continue
    if [ -d "$dst" ] && [ ! -L "$dst" ]; then t="$dst/${e##*/}"
    else mkdir -p -- "$(dirname -- "$dst")"; t=$dst; fi
    cp -R -P --remove-destination --preserve=mode,timestamps,links -- "$e" "$t"
    chown -R -h -- "$own" "$t"
    if [ -n "$mode" ]; then chmod -R -- "$mode" "$t"; fi
  done
fi
"""


def _match_sources(ctx: Context, pattern: str) -> list[str]:
    """Context paths a COPY source names: itself, or the matches of a glob (Go's
    ``filepath.Match``, one path part per pattern part)."""
    if pattern == ".":
        return ["."]
    if not any(c in pattern for c in "*?["):
        return [pattern]
    parts = pattern.split("/")
    regexes = [_pattern_regex(p) for p in parts]
    return sorted(
        rel
        for rel in ctx.entries
        if len(rel.split("/")) == len(parts)
        and all(r.match(seg) for r, seg in zip(regexes, rel.split("/"), strict=True))
    )


def _inside(ctx: Context, rel: str, plan: Plan, step: CopyStep) -> tuple[Path, str]:
    """The host path of context path ``rel`` and its kind, following a link of the source
    itself only when it stays in the context (and is not excluded)."""
    root = ctx.root
    if rel == ".":
        return root, "d"
    p = root / rel
    kind = ctx.entries.get(rel)
    if kind is None:
        raise fail(
            plan.path,
            step.line,
            step.keyword,
            f"{rel!r}: not found in the build context (or excluded by .dockerignore)",
        )
    if kind == "l":
        target = p.resolve()
        if not target.is_relative_to(root.resolve()):
            raise fail(
                plan.path, step.line, step.keyword, f"{rel!r} is a symlink out of the context"
            )
        trel = target.relative_to(root.resolve()).as_posix() or "."
        if trel != "." and trel not in ctx.entries:
            raise fail(
                plan.path,
                step.line,
                step.keyword,
                f"{rel!r} links to {trel!r}, which is not in the context (or excluded)",
            )
        kind = "d" if target.is_dir() else "f"
        if ctx.entries.get(trel) == "l":
            raise fail(
                plan.path, step.line, step.keyword, f"{rel!r}: a chain of links is not honoured"
            )
        return target, kind
    return p, kind


def _stage_tree(ctx: Context, rel: str, host: Path, into: Path) -> None:
    """Copy the included entries below context directory ``rel`` into ``into`` (never
    following a link: a link is copied as a link)."""
    prefix = "" if rel == "." else rel + "/"
    # a directory reached through a link: its entries are the target's
    real_rel = host.relative_to(ctx.root.resolve()).as_posix() if host != ctx.root else "."
    real_prefix = "" if real_rel == "." else real_rel + "/"
    del prefix
    for entry, kind in sorted(ctx.entries.items()):
        if not entry.startswith(real_prefix) or entry == real_rel:
            continue
        sub = entry[len(real_prefix) :]
        src = ctx.root / entry
        dst = into / sub
        if kind == "d":
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copystat(src, dst, follow_symlinks=False)
        elif kind == "l":
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(src), dst)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            _copy_file(src, dst)


def _copy_file(src: Path, dst: Path) -> None:
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as fin:
        st = os.fstat(fin.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{src} is not a regular file")
        with open(dst, "xb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def resolve_copy(
    ctx: Context, plan: Plan, step: CopyStep
) -> tuple[list[tuple[str, Path, str]], bool]:
    """The sources of a COPY/ADD (context path, host path, kind) and whether the destination
    is a directory, checked against Docker's rules before anything is built."""
    found: list[str] = []
    for s in step.sources:
        matches = _match_sources(ctx, s)
        if not matches:
            raise fail(plan.path, step.line, step.keyword, f"{s!r}: no source files were found")
        found += matches
    resolved = [(rel, *_inside(ctx, rel, plan, step)) for rel in found]
    as_dir = step.as_dir or any(kind == "d" for _, _, kind in resolved)
    if len(resolved) > 1 and not step.as_dir:
        raise fail(
            plan.path,
            step.line,
            step.keyword,
            "with more than one source file the destination must be a directory and end with '/'",
        )
    if step.keyword == "ADD":
        for rel, host, kind in resolved:
            if kind == "f" and _is_archive(host):
                raise fail(
                    plan.path,
                    step.line,
                    "ADD",
                    f"{rel!r} is an archive: ADD's extraction is not honoured (COPY it and "
                    "RUN tar)",
                )
    return resolved, as_dir


async def _copy(box: BuildSandbox, staged: Path, plan: Plan, ctx: Context, step: CopyStep) -> None:
    """Docker's COPY rules: a directory's contents (not itself) are copied; several sources
    (or a glob's matches) need a destination ending in ``/``; a file copied to a path ending
    in ``/`` (or to an existing directory) keeps its name; missing directories are made."""
    resolved, as_dir = await asyncio.to_thread(resolve_copy, ctx, plan, step)

    def stage() -> None:
        staged.mkdir()
        for rel, host, kind in resolved:
            if kind == "d":
                _stage_tree(ctx, rel, host, staged)
            else:
                dst = staged / (PurePosixPath(rel).name if rel != "." else "file")
                if dst.exists():
                    dst.unlink()
                _copy_file(host, dst)

    try:
        await asyncio.to_thread(stage)
    except OSError as exc:
        raise fail(plan.path, step.line, step.keyword, f"cannot read the source: {exc}") from None
    await box.own(staged)
    dest = step.dest
    try:
        await box.run(
            [
                "/bin/sh",
                "-ec",
                _COPY_SH,
                "sh",
                f"{IN_DIR}/src",
                dest,
                "dir" if as_dir else "file",
                step.chown or "",
                step.chmod or "",
            ],
            f"{step.keyword} at line {step.line}",
            env={"PATH": DEFAULT_PATH, "LANG": "C.UTF-8"},
            timeout=COPY_TIMEOUT_S,
            ro=[(staged, f"{IN_DIR}/src")],
        )
    except errors.SandboxError as exc:
        raise fail(
            plan.path, step.line, step.keyword, exc.detail.removeprefix("image build: ")
        ) from None


def _is_archive(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(512)
    return (
        head.startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd"))
        or head[257:262] == b"ustar"
    )


_WORKDIR_SH = r"""
dir=$1 own=$2
if [ -e "$dir" ] || [ -L "$dir" ]; then exit 0; fi
mkdir -p -- "$dir"
if [ -n "$own" ]; then chown -- "$own" "$dir"; fi
"""


async def _workdir(box: BuildSandbox, rootfs: Path, plan: Plan, step: WorkdirStep) -> None:
    own = ""
    if step.user is not None:
        uid, gid, _ = _image_ids(rootfs, plan, step.user, step.line, "WORKDIR")
        own = f"{uid}:{gid}"
    try:
        await box.run(
            ["/bin/sh", "-ec", _WORKDIR_SH, "sh", step.path, own],
            f"WORKDIR at line {step.line}",
            env={"PATH": DEFAULT_PATH},
            timeout=COPY_TIMEOUT_S,
        )
    except errors.SandboxError as exc:
        raise fail(
            plan.path, step.line, "WORKDIR", exc.detail.removeprefix("image build: ")
        ) from None
