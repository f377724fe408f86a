"""What a ``RUN`` line installs, read statically: the packages of its ``apt-get install`` and the
requirements of its ``pip install`` (fetched on the host before the build, which has no
network)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping

from ephemeral import errors
from ephemeral.sandbox.dockerfile.parser import Instruction, _join, expand, fail
from ephemeral.sandbox.host_pip import requirement_problem

_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.:=~-]{0,99}")


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
    ``workdir``), ``--no-deps``/``--pre``. A path of the image (``/``, ``./``, ``../``, ``.``)
    is left to the pip inside; any other word pip would read as a path, an archive, a URL or
    an option is refused here, naming the line (``host_pip.requirement_problem``)."""
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
            if w in (".", "..") or w.startswith(("/", "./", "../")):
                continue  # a path of the image: only the pip inside reads it, never the host's
            if (why := requirement_problem(w)) is not None:
                raise err(f"pip install {w!r}: {why}")
            reqs.append(w)
        if reqs or "-r" in extra:
            out.append([*extra, "--", *reqs])
    return out


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
        if (why := requirement_problem(spec)) is not None:
            raise ValueError(f"line {n}: {spec!r}: {why}")
        out.append(spec)
    return out
