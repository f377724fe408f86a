"""The translator: parsed instructions into our image plan (a base image of ours, the packages
to fetch, the steps to run in the build sandbox, the image's config)."""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ephemeral import errors
from ephemeral.sandbox.dockerfile.installs import _apt_packages, _pip_requirements
from ephemeral.sandbox.dockerfile.parser import (
    Instruction,
    Parsed,
    _clean,
    _join,
    exec_form,
    expand,
    fail,
    split_flags,
    split_words,
)

# Bumped when the translation's output changes for the same Dockerfile (part of the hash).
TRANSLATOR_VERSION = 1


DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


DEFAULT_SHELL = ("/bin/sh", "-c")


# A WORKDIR is handed to shells of the sessions and runs that use the image: plain characters
_SAFE_PATH = re.compile(r"/[A-Za-z0-9._/+@:=,~ -]*")


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
    sources: list[str]  # context paths (cleaned, relative), or absolute paths of a stage
    dest: str  # absolute
    as_dir: bool
    chown: str | None
    chmod: str | None
    from_stage: int | None = None  # COPY --from: the index of an earlier stage
    from_image: str | None = None  # COPY --from=<reference>: that image (a stage of its own)


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
    name: str | None = None  # FROM ... AS NAME
    stages: list[Plan] = field(default_factory=list)  # the final stage's: those before it
    image_only: bool = False  # a stage made for a COPY --from=<reference> (after the others)

    @property
    def from_registry(self) -> bool:
        """Whether the base is a registry image (a normalized reference: it has a '/'),
        built on its layers (``layers.py``), else one of our images."""
        return "/" in self.base

    def needed(self) -> list[int]:
        """The earlier stages the final one copies from, directly or through another."""
        todo = [self]
        seen: set[int] = set()
        while todo:
            for step in todo.pop().steps:
                k = step.from_stage if isinstance(step, CopyStep) else None
                if k is not None and k not in seen:
                    seen.add(k)
                    todo.append(self.stages[k])
        return sorted(seen)


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
    base_start: Any = None,
    resolve_image: Any = None,
) -> Plan:
    """The plan of a parsed Dockerfile. ``resolve_base(name)`` is the image a ``FROM`` names
    (our image's name, a registry image's normalized reference, or None), ``base_env(image)``
    that image's env, ``base_start(image)`` its ``(WorkingDir, User)`` (None, None for ours),
    ``resolve_image(name)`` the reference a ``COPY --from`` that is no stage names, or None."""
    images_copied: dict[str, list[CopyStep]] = {}
    path, esc = parsed.path, parsed.escape
    global_args: dict[str, str | None] = {}
    plan: Plan | None = None
    stages: list[Plan] = []
    stage_names: dict[str, int] = {}

    def finish(stage: Plan) -> None:
        stage.env = env
        given = base_workdir or any(isinstance(s, WorkdirStep) for s in stage.steps)
        stage.workdir = workdir if given else None
        stage.user = user
        stage.shell = shell
        stage.packages = list(dict.fromkeys(stage.packages))

    env: dict[str, str] = {}
    args: dict[str, str] = {}
    workdir = "/"
    base_workdir = False
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
            if not re.fullmatch(r"[A-Z]{1,16}", kw):  # not a keyword: echo nothing of the file
                raise fail(path, ins.line, None, "not a Dockerfile instruction")
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
                finish(plan)
                stages.append(plan)
                args = {}
                workdir = "/"
                user = None
                shell = list(DEFAULT_SHELL)
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
            if image.lower() in stage_names:
                raise err(
                    ins,
                    f"FROM the earlier stage {image!r} is not honoured (COPY --from={image} is)",
                )
            base = resolve_base(image)
            if base is None:
                raise err(
                    ins,
                    f"{image!r} is not an image reference, nor one of our images (ephemeral "
                    "images list; ephemeral images alias NAME IMAGE)",
                )
            alias = words[2].lower() if len(words) == 3 else None
            if alias is not None and (alias in stage_names or alias.isdigit()):
                raise err(ins, f"stage name {alias!r} is taken or a number")
            plan = Plan(path=path, base=base, name=alias)
            if alias is not None:
                stage_names[alias] = len(stages)
            env = {"PATH": DEFAULT_PATH, **base_env(base)}
            start = base_start(base) if base_start is not None else (None, None)
            base_workdir = bool(start[0]) and start[0] != "/"
            workdir = _join("/", start[0]) if start[0] else "/"
            user = start[1] or None
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
            step = _copy_step(ins, sub, workdir, esc, path, stage_names, len(stages), resolve_image)
            if step.from_image is not None:
                images_copied.setdefault(step.from_image, []).append(step)
            plan.steps.append(step)
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
    finish(plan)
    # each image a COPY --from names is a stage of its own after the Dockerfile's (built first)
    for ref, steps in images_copied.items():
        for step in steps:
            step.from_stage = len(stages)
        env = {"PATH": DEFAULT_PATH, **base_env(ref)}
        stages.append(Plan(path=path, base=ref, env=env, image_only=True))
    plan.stages = stages
    return plan


def _script_of(form: list[str]) -> str:
    """What to read package names in for an exec-form RUN: the script of ``sh -c SCRIPT``,
    else the argv itself."""
    shells = ("sh", "bash", "dash")
    if len(form) >= 3 and os.path.basename(form[0]) in shells and form[1] == "-c":
        return form[2]
    return shlex.join(form)


def _copy_step(
    ins: Instruction,
    sub: Any,
    workdir: str,
    esc: str,
    path: str,
    stage_names: Mapping[str, int] | None = None,
    n_stages: int = 0,
    resolve_image: Any = None,
) -> CopyStep:
    def err(message: str) -> errors.DockerfileError:
        return fail(path, ins.line, ins.keyword, message)

    flags, rest = split_flags(ins.args)
    from_stage: int | None = None
    from_image: str | None = None
    for k in flags:
        if k == "from" and ins.keyword == "COPY":
            given = sub(ins, flags["from"])
            ref = given.lower()
            if ref.isdigit() and int(ref) < n_stages:
                from_stage = int(ref)
            elif stage_names and ref in stage_names:
                from_stage = stage_names[ref]
            elif resolve_image is not None and (found := resolve_image(given)) is not None:
                from_image, from_stage = found, -1  # numbered once every stage is known
            else:
                raise err(f"--from={ref}: not an earlier stage of this Dockerfile nor an image")
        elif k not in ("chown", "chmod", "link"):
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
    as_dir = dest.endswith("/") or dest in (".", "..") or dest.endswith("/.")
    if from_stage is not None:
        for s in sources:
            if ".." in s.split("/") or not re.fullmatch(r"[A-Za-z0-9._/+@:=,~*?\[\] -]+", s):
                raise err(f"{s!r}: a path of the stage without '..' and shell characters")
        staged = [
            "/" + _clean(s.lstrip("/")) if _clean(s.lstrip("/")) != "." else "/" for s in sources
        ]
        return CopyStep(
            ins.line,
            ins.keyword,
            staged,
            _join(workdir, dest),
            as_dir,
            chown,
            chmod,
            from_stage,
            from_image,
        )
    for s in sources:
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", s) or s.startswith("git@"):
            raise err(f"{s!r}: URL sources are not honoured (copy local files of the context)")
        if s.startswith("/") or ".." in s.split("/"):
            raise err(f"{s!r}: sources must be paths inside the context (no '/' start, no '..')")
    return CopyStep(
        ins.line,
        ins.keyword,
        [_clean(s) for s in sources],
        _join(workdir, dest),
        as_dir,
        chown,
        chmod,
    )
