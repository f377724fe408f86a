"""The Dockerfile translator against Docker's documented semantics, instruction by instruction:
parsing, substitution, ENV/ARG scoping, WORKDIR, COPY's rules, .dockerignore, what is refused
(an error naming the file, the line and the instruction), and the build that runs the plan."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from ephemeral import errors
from ephemeral.sandbox import dockerfile as df
from ephemeral.sandbox import images
from ephemeral.sandbox.dockerfile import context as df_context
from ephemeral.settings import Settings


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings.load(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache")


def plan_of(
    text: str, settings: Settings, tmp_path: Path, build_args: dict[str, str] | None = None
) -> df.Plan:
    ctx = tmp_path / "ctx"
    ctx.mkdir(exist_ok=True)
    (ctx / "Dockerfile").write_text(text)
    for name in ("f", "a.txt", "b.txt", "with space.txt"):  # what the COPY lines below name
        (ctx / name).write_text(name)
    plan, _, _ = df.load(ctx / "Dockerfile", None, build_args or {}, settings)
    return plan


def refused(text: str, settings: Settings, tmp_path: Path) -> errors.DockerfileError:
    with pytest.raises(errors.DockerfileError) as exc:
        plan_of(text, settings, tmp_path)
    return exc.value


# ------------------------------------------------------------------ parsing


def test_continuations_comments_and_line_numbers() -> None:
    text = (
        "# a comment\n"
        "\n"
        "from debian:bookworm\n"
        "RUN echo a \\\n"
        "# a comment inside the continuation is dropped\n"
        "\n"
        "    b \\  \n"
        "  c\n"
        "  env A=1\n"
    )
    parsed = df.parse(text)
    assert [(i.keyword, i.line) for i in parsed.instructions] == [
        ("FROM", 3),
        ("RUN", 4),
        ("ENV", 9),
    ]
    # the continued line's own leading whitespace is kept, the escape and newline removed
    assert parsed.instructions[1].args == "echo a     b   c"


def test_the_escape_directive_and_directives_only_at_the_top() -> None:
    parsed = df.parse("# escape=`\nFROM debian:bookworm\nRUN dir c:\\ `\n  && echo x\n")
    assert parsed.escape == "`"
    assert parsed.instructions[1].args == "dir c:\\   && echo x"
    late = df.parse("FROM debian:bookworm\n# escape=`\nRUN a `\n")
    assert late.escape == "\\"  # after an instruction it is an ordinary comment
    with pytest.raises(errors.DockerfileError, match="escape"):
        df.parse("# escape=x\nFROM debian:bookworm\n")


# ------------------------------------------------------------------ substitution


@pytest.mark.parametrize(
    ("word", "value"),
    [
        ("$A", "a"),
        ("${A}b", "ab"),
        ("${UNSET:-x}", "x"),
        ("${EMPTY:-x}", "x"),
        ("${EMPTY-x}", ""),
        ("${UNSET-x}", "x"),
        ("${A:-x}", "a"),
        ("${A:+x}", "x"),
        ("${UNSET:+x}", ""),
        ("${EMPTY:+x}", ""),
        ("${EMPTY+x}", "x"),
        ("$UNSET", ""),
        ("'$A'", "$A"),
        ('"$A b"', "a b"),
        ("\\$A", "$A"),
        ('"\\$A"', "$A"),
        ("${A:-$B}", "a"),
        ("${UNSET:-$B}", "b"),
        ("a$", "a$"),
    ],
)
def test_substitution_follows_docker(word: str, value: str) -> None:
    assert df.expand(word, {"A": "a", "B": "b", "EMPTY": ""}) == value


def test_a_bad_or_unsupported_modifier_is_an_error_naming_the_line(
    settings: Settings, tmp_path: Path
) -> None:
    exc = refused("FROM debian:bookworm\nENV X=${A%%b}\n", settings, tmp_path)
    assert (exc.line, exc.instruction) == (2, "ENV") and "modifier" in exc.detail
    exc = refused("FROM debian:bookworm\nWORKDIR ${NEEDED:?must be set}\n", settings, tmp_path)
    assert (exc.line, exc.instruction) == (2, "WORKDIR") and "must be set" in exc.detail


# ------------------------------------------------------------------ ENV, ARG


def test_env_both_forms_and_same_instruction_sees_the_previous_value(
    settings: Settings, tmp_path: Path
) -> None:
    """Docker's example: ``ENV abc=bye def=$abc`` sets def to abc's value before it."""
    plan = plan_of(
        "FROM debian:bookworm\n"
        "ENV abc=hello\n"
        "ENV abc=bye def=$abc\n"
        "ENV ghi=$abc\n"
        'ENV MY_NAME="John Doe" MY_DOG=Rex\\ The\\ Dog\n'
        "ENV LEGACY  a value with  spaces\n"
        "ENV PATH=/opt/bin:$PATH\n",
        settings,
        tmp_path,
    )
    env = plan.env
    assert (env["abc"], env["def"], env["ghi"]) == ("bye", "hello", "bye")
    assert (env["MY_NAME"], env["MY_DOG"]) == ("John Doe", "Rex The Dog")
    assert env["LEGACY"] == "a value with  spaces"
    assert env["PATH"] == "/opt/bin:" + df.DEFAULT_PATH


def test_arg_defaults_build_args_scope_and_env_precedence(
    settings: Settings, tmp_path: Path
) -> None:
    text = (
        "ARG BASE=bookworm\n"
        "FROM debian:${BASE}\n"
        "ARG USER_NAME=someuser\n"
        "ARG BASE\n"  # redeclared: the global value comes in
        "ARG UNSET\n"
        "ENV CONT_IMG_VER=${VERSION:-v1.0.0}\n"
        "ARG VERSION=v2\n"
        "ENV USER_NAME=from-env\n"
        "RUN echo $USER_NAME\n"
    )
    plan = plan_of(text, settings, tmp_path, {"USER_NAME": "given"})
    assert plan.base == "default"
    assert plan.env["CONT_IMG_VER"] == "v1.0.0"  # VERSION was not declared yet
    run = plan.steps[-1]
    assert isinstance(run, df.RunStep)
    assert run.env["USER_NAME"] == "from-env"  # ENV overrides an ARG of the same name
    assert run.env["BASE"] == "bookworm" and run.env["VERSION"] == "v2"
    assert "UNSET" not in run.env
    assert "VERSION" not in plan.env and "BASE" not in plan.env  # args are not the image's
    assert plan.args_used["USER_NAME"] == "given"
    # the builder does not expand RUN: the shell does, with those variables
    assert run.argv == ["/bin/sh", "-c", "echo $USER_NAME"]


def test_a_global_arg_is_not_in_the_stage_unless_redeclared(
    settings: Settings, tmp_path: Path
) -> None:
    plan = plan_of(
        "ARG V=1\nFROM debian:bookworm\nRUN echo $V\nARG V\nRUN echo $V\n", settings, tmp_path
    )
    first, second = plan.steps
    assert isinstance(first, df.RunStep) and isinstance(second, df.RunStep)
    assert "V" not in first.env and second.env["V"] == "1"


# ------------------------------------------------------------------ RUN, SHELL, the rest


def test_run_forms_shell_and_recorded_config(settings: Settings, tmp_path: Path) -> None:
    plan = plan_of(
        "FROM debian:bookworm\n"
        'RUN ["echo", "$HOME"]\n'
        'SHELL ["/bin/bash", "-o", "pipefail", "-c"]\n'
        "RUN echo hi | cat\n"
        "LABEL version=\"1.0\" description='a task'\n"
        "EXPOSE 80/tcp 8080\n"
        "ENTRYPOINT python3 -m http.server\n"
        'CMD ["--bind", "0.0.0.0"]\n',
        settings,
        tmp_path,
    )
    exec_form, shell_form = plan.steps
    assert isinstance(exec_form, df.RunStep) and isinstance(shell_form, df.RunStep)
    assert exec_form.argv == ["echo", "$HOME"]  # no shell, no substitution
    assert shell_form.argv == ["/bin/bash", "-o", "pipefail", "-c", "echo hi | cat"]
    assert plan.labels == {"version": "1.0", "description": "a task"}
    assert plan.expose == ["80/tcp", "8080"]
    assert plan.entrypoint == ["/bin/bash", "-o", "pipefail", "-c", "python3 -m http.server"]
    assert plan.cmd == ["--bind", "0.0.0.0"]


def test_workdir_is_resolved_against_the_previous_one(settings: Settings, tmp_path: Path) -> None:
    """Docker's examples: ``WORKDIR /a``, ``b``, ``c`` is ``/a/b/c``; ENV is expanded."""
    plan = plan_of(
        "FROM debian:bookworm\nWORKDIR /a\nWORKDIR b\nWORKDIR c\nRUN pwd\n"
        "ENV DIRPATH=/path\nWORKDIR $DIRPATH/$DIRNAME\nCOPY f rel/\n",
        settings,
        tmp_path,
    )
    dirs = [s.path for s in plan.steps if isinstance(s, df.WorkdirStep)]
    assert dirs == ["/a", "/a/b", "/a/b/c", "/path"]
    run = plan.steps[3]
    assert isinstance(run, df.RunStep) and run.workdir == "/a/b/c"
    copy = plan.steps[-1]
    assert isinstance(copy, df.CopyStep) and copy.dest == "/path/rel" and copy.as_dir
    assert plan.workdir == "/path"
    assert plan_of("FROM debian:bookworm\n", settings, tmp_path).workdir is None


def test_user_is_recorded_and_later_runs_use_it(settings: Settings, tmp_path: Path) -> None:
    plan = plan_of("FROM debian:bookworm\nRUN id\nUSER worker:worker\nRUN id\n", settings, tmp_path)
    first, second = plan.steps
    assert isinstance(first, df.RunStep) and isinstance(second, df.RunStep)
    assert (first.user, second.user, plan.user) == (None, "worker:worker", "worker:worker")


# ------------------------------------------------------------------ COPY / ADD


def test_copy_flags_forms_and_destinations(settings: Settings, tmp_path: Path) -> None:
    plan = plan_of(
        "FROM debian:bookworm\n"
        "WORKDIR /app\n"
        "COPY --chown=55:mygroup --chmod=0644 a.txt b.txt dir/\n"
        'COPY ["with space.txt", "/opt/x"]\n'
        "ADD --chown=bin a.txt .\n"
        "ENV D=/dest\n"
        "COPY a.txt $D/\n",
        settings,
        tmp_path,
    )
    multi, json_form, add, env_dest = (s for s in plan.steps if isinstance(s, df.CopyStep))
    assert (multi.sources, multi.dest, multi.as_dir) == (["a.txt", "b.txt"], "/app/dir", True)
    assert (multi.chown, multi.chmod) == ("55:mygroup", "0644")
    assert (json_form.sources, json_form.dest, json_form.as_dir) == (
        ["with space.txt"],
        "/opt/x",
        False,
    )
    assert (add.keyword, add.dest, add.as_dir, add.chown) == ("ADD", "/app", True, "bin")
    assert env_dest.dest == "/dest"


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("COPY ../secret /x", "inside the context"),
        ("COPY /etc/passwd /x", "inside the context"),
        ("COPY a/../../b /x", "inside the context"),
        ("COPY --from=builder /out /x", "--from"),
        ("ADD https://example.invalid/a.tgz /x", "URL"),
        ("ADD git@example.invalid:a/b.git /x", "URL"),
        ("COPY --parents a /x", "--parents"),
        ("COPY --chmod=u+x a /x", "octal"),
        ("COPY onlyone", "source and a destination"),
    ],
)
def test_copy_refusals_name_the_line(
    settings: Settings, tmp_path: Path, line: str, why: str
) -> None:
    exc = refused(f"FROM debian:bookworm\n{line}\n", settings, tmp_path)
    assert exc.line == 2 and exc.instruction == line.split()[0]
    assert why in exc.detail
    assert exc.detail.startswith(f"{tmp_path / 'ctx' / 'Dockerfile'}:2: {exc.instruction}: ")


def _ctx(root: Path, files: dict[str, str], ignore: str | None = None) -> df.Context:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    rules = df.parse_dockerignore(ignore) if ignore is not None else []
    return df.scan_context(root, rules, "Dockerfile")


def _copy_step(sources: list[str], dest: str = "/d/", as_dir: bool = True) -> df.CopyStep:
    return df.CopyStep(2, "COPY", sources, dest, as_dir, None, None)


def test_globs_match_one_path_part_per_pattern_part(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path, {"a.txt": "", "b.txt": "", "c.md": "", "sub/d.txt": "", "hom1": ""})
    assert df_context._match_sources(ctx, "*.txt") == ["a.txt", "b.txt"]
    assert df_context._match_sources(ctx, "*/*.txt") == ["sub/d.txt"]
    assert df_context._match_sources(ctx, "hom?") == ["hom1"]
    assert df_context._match_sources(ctx, "[ab].txt") == ["a.txt", "b.txt"]
    assert df_context._match_sources(ctx, "nothing*") == []


def test_sources_stay_in_the_context_and_links_out_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "ctx"
    root.mkdir()
    ctx = _ctx(root, {"in.txt": "x", "dir/f": "y"})
    os.symlink("/etc/hostname", root / "out")
    os.symlink("in.txt", root / "inner")
    os.symlink("/etc", root / "outdir")
    ctx = df.scan_context(root, [], "Dockerfile")
    assert ctx.entries["outdir"] == "l"  # a link to a directory is never walked
    plan = df.Plan(path="Dockerfile", base="default")
    with pytest.raises(errors.DockerfileError, match="symlink out of the context") as exc:
        df_context._inside(ctx, "out", plan, _copy_step(["out"]))
    assert (exc.value.line, exc.value.instruction) == (2, "COPY")
    with pytest.raises(errors.DockerfileError, match="symlink out of the context"):
        df_context._inside(ctx, "outdir", plan, _copy_step(["outdir"]))
    host, kind = df_context._inside(ctx, "inner", plan, _copy_step(["inner"]))
    assert (host, kind) == ((root / "in.txt").resolve(), "f")
    with pytest.raises(errors.DockerfileError, match="not found in the build context"):
        df_context._inside(ctx, "missing", plan, _copy_step(["missing"]))


def test_a_copied_tree_is_its_included_entries_and_links_stay_links(tmp_path: Path) -> None:
    root = tmp_path / "ctx"
    root.mkdir()
    ctx = _ctx(
        root,
        {"src/a.py": "a", "src/sub/b.py": "b", "src/x.pyc": "c", "src/keep.pyc": "k"},
        "**/*.pyc\n!src/keep.pyc\n",
    )
    os.symlink("/etc/shadow", root / "src" / "link")
    ctx = df.scan_context(root, df.parse_dockerignore("**/*.pyc\n!src/keep.pyc\n"), "D")
    out = tmp_path / "staged"
    out.mkdir()
    df_context._stage_tree(ctx, "src", root / "src", out)
    found = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert found == ["a.py", "keep.pyc", "link", "sub", "sub/b.py"]
    assert os.readlink(out / "link") == "/etc/shadow"  # copied as a link, never followed


# ------------------------------------------------------------------ .dockerignore


@pytest.mark.parametrize(
    ("rules", "path", "excluded"),
    [
        # Docker's documented examples
        ("*/temp*", "somedir/temporary.txt", True),
        ("*/temp*", "somedir/temp", True),
        ("*/temp*", "temp", False),
        ("*/*/temp*", "somedir/subdir/temporary.txt", True),
        ("temp?", "tempa", True),
        ("temp?", "tempab", False),
        ("**/*.go", "a/b/c.go", True),
        ("**/*.go", "c.go", True),
        ("*.md\n!README.md", "README.md", False),
        ("*.md\n!README.md", "other.md", True),
        ("*.md\n!README*.md\nREADME-secret.md", "README-secret.md", True),
        ("*.md\nREADME-secret.md\n!README*.md", "README-secret.md", False),
        # a directory's pattern excludes what is below it; a leading '/' is the context root
        ("build", "build/out/x.o", True),
        ("/build", "build/x", True),
        ("./build/", "build/x", True),
        ("# build", "build/x", False),
        ("  node_modules  ", "node_modules/a/b.js", True),
        ("docs\n!docs/keep.md", "docs/keep.md", False),
        ("docs\n!docs/keep.md", "docs/other.md", True),
    ],
)
def test_dockerignore_follows_docker(rules: str, path: str, excluded: bool) -> None:
    assert df.ignored(df.parse_dockerignore(rules), path) is excluded


def test_an_exception_reincludes_a_file_of_an_ignored_directory(tmp_path: Path) -> None:
    ctx = _ctx(
        tmp_path, {"docs/keep.md": "", "docs/drop.md": "", "a.txt": ""}, "docs\n!docs/keep.md\n"
    )
    assert "docs/keep.md" in ctx.entries and "docs/drop.md" not in ctx.entries
    assert ctx.entries["docs"] == "d"


def test_the_context_digest_covers_included_files_only(tmp_path: Path) -> None:
    files = {"a.txt": "1", "b.log": "x"}
    first = _ctx(tmp_path, files, "*.log\n").digest
    (tmp_path / "b.log").write_text("changed")
    assert _ctx(tmp_path, {}, "*.log\n").digest == first
    (tmp_path / "a.txt").write_text("2")
    assert _ctx(tmp_path, {}, "*.log\n").digest != first
    (tmp_path / "a.txt").write_text("1")
    (tmp_path / "a.txt").chmod(0o755)
    assert _ctx(tmp_path, {}, "*.log\n").digest != first


# ------------------------------------------------------------------ what is refused


@pytest.mark.parametrize(
    ("text", "line", "instruction", "why"),
    [
        # any other distribution is a registry image (tests/oci/test_dockerfile_from_registry.py)
        ("FROM Alpine::3\n", 1, "FROM", "not an image reference"),
        ("FROM ubuntu:-bad\n", 1, "FROM", "not an image reference"),
        ("FROM --platform=linux/arm64 debian:bookworm\n", 1, "FROM", "--platform"),
        ("FROM debian:bookworm AS a\nFROM a\n", 2, "FROM", "earlier stage 'a'"),
        ("FROM debian:bookworm AS a\nFROM debian:bookworm AS A\n", 2, "FROM", "taken"),
        ("FROM debian:bookworm\nCOPY --from=0 /x /y\n", 2, "COPY", "not an earlier stage"),
        ("FROM debian:bookworm\nCOPY --from=Py::3 /x /y\n", 2, "COPY", "nor an image"),
        ("FROM debian:bookworm\nCOPY --from=buidler /x /y\n", 2, "COPY", "nor an image"),
        (
            "FROM debian:bookworm AS b\nFROM debian:bookworm\nADD --from=b /x /y\n",
            3,
            "ADD",
            "--from",
        ),
        (
            "FROM debian:bookworm AS b\nFROM debian:bookworm\nCOPY --from=b /a;b /y\n",
            3,
            "COPY",
            "shell",
        ),
        ("RUN echo\n", 1, "RUN", "first instruction must be FROM"),
        ("FROM debian:bookworm\nRUN --mount=type=cache,target=/x true\n", 2, "RUN", "--mount"),
        ("FROM debian:bookworm\nRUN --network=host true\n", 2, "RUN", "--network"),
        ("FROM debian:bookworm\nRUN <<EOF\necho\nEOF\n", 2, "RUN", "here-documents"),
        ("FROM debian:bookworm\nONBUILD RUN true\n", 2, "ONBUILD", "not honoured"),
        ("FROM debian:bookworm\nHEALTHCHECK CMD true\n", 2, "HEALTHCHECK", "not honoured"),
        ("FROM debian:bookworm\nVOLUME /data\n", 2, "VOLUME", "not honoured"),
        ("FROM debian:bookworm\nSTOPSIGNAL SIGKILL\n", 2, "STOPSIGNAL", "not honoured"),
        ("FROM debian:bookworm\nFROBNICATE x\n", 2, "FROBNICATE", "unknown instruction"),
        ("FROM debian:bookworm\nSHELL /bin/bash -c\n", 2, "SHELL", "JSON form"),
        ("FROM debian:bookworm\nUSER a;b\n", 2, "USER", "not a user name"),
        ('FROM debian:bookworm\nWORKDIR "/a;b"\n', 2, "WORKDIR", "plain paths"),
        ("FROM debian:bookworm\nEXPOSE http\n", 2, "EXPOSE", "not a port"),
        ("FROM debian:bookworm\nRUN apt-get install -y $(cat pkgs)\n", 2, "RUN", "plain package"),
        ("FROM debian:bookworm\nRUN apt-get install -y ./local.deb\n", 2, "RUN", "plain package"),
        ("FROM debian:bookworm\nRUN pip install -i http://x/simple a\n", 2, "RUN", "an index"),
        ("FROM debian:bookworm\nRUN pip install -c c.txt x\n", 2, "RUN", "constraints file"),
        ("FROM debian:bookworm\nRUN pip install git+https://x/y\n", 2, "RUN", "URL"),
    ],
)
def test_what_is_not_honoured_is_an_error_naming_file_line_and_instruction(
    settings: Settings, tmp_path: Path, text: str, line: int, instruction: str, why: str
) -> None:
    exc = refused(text, settings, tmp_path)
    path = str(tmp_path / "ctx" / "Dockerfile")
    assert (exc.path, exc.line, exc.instruction) == (path, line, instruction)
    assert why in exc.detail
    assert exc.detail.startswith(f"{path}:{line}: {instruction}: ")
    assert exc.status == 422 and exc.to_problem()["type"].endswith("/invalid-dockerfile")


# ------------------------------------------------------------------ packages and pip


def test_apt_get_install_packages_go_into_the_package_layer(
    settings: Settings, tmp_path: Path
) -> None:
    plan = plan_of(
        "FROM debian:bookworm\n"
        "ARG EXTRA=jq\n"
        "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y \\\n"
        "      --no-install-recommends tree=2.1.0-1 \\\n"
        "    && apt install -y $EXTRA file && rm -rf /var/lib/apt/lists/*\n"
        'RUN ["apt-get", "install", "-y", "less"]\n'
        'RUN ["/bin/sh", "-c", "apt-get -y -o Dpkg::Options::=--force-confdef install vim-tiny"]\n'
        "RUN echo apt-get install not-a-command-here\n",
        settings,
        tmp_path,
    )
    assert plan.packages == ["tree", "jq", "file", "less", "vim-tiny"]
    layers = images.chain(images.definition_dir(settings, "default"))
    spec = images._layer_spec([d for _, d in layers], tuple(plan.packages))
    default_spec = images._layer_spec([d for _, d in layers])
    assert spec["packages"] == default_spec["packages"] + plan.packages
    # a package the base already has changes nothing: the cached layer is the same
    same = images._layer_spec([d for _, d in layers], ("python3", "curl"))
    assert images._base_hash(same) == images._base_hash(default_spec)


def test_requirements_files_are_read_in_the_image_without_links(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    (rootfs / "app").mkdir(parents=True)
    (rootfs / "app" / "req.txt").write_text(
        "# tools\nsix==1.16  # pinned\n\npytest>=7 \\\n  ; python_version >= '3.8'\n"
        "attrs --hash=sha256:00\n--prefer-binary\n"
    )
    text = df.read_in_image(rootfs, "/app/req.txt").decode()
    assert df.requirements_file(text) == [
        "six==1.16",
        "pytest>=7 ; python_version >= '3.8'",
        "attrs",
    ]
    os.symlink("/etc", rootfs / "etc")
    with pytest.raises(OSError):
        df.read_in_image(rootfs, "/etc/hostname")  # never through a link of the image
    for bad in ("-i http://x/simple", "-r other.txt", "-e .", "https://x/a.whl", "./pkg"):
        with pytest.raises(ValueError, match="line 2"):
            df.requirements_file(f"six\n{bad}\n")


def test_pip_installs_are_read_for_the_hosts_pip(settings: Settings, tmp_path: Path) -> None:
    plan = plan_of(
        "FROM python-dev\n"
        "ARG V=8.0\n"
        "RUN pip install --no-cache-dir pytest==$V 'requests[socks]>=2' && \\\n"
        "    python3 -m pip install --no-deps --target /opt/lib six . /src/pkg\n"
        "RUN /opt/venv/bin/pip3 install --upgrade --pre attrs\n"
        "WORKDIR /app\n"
        "RUN pip install -r requirements.txt --requirement=/abs.txt\n",
        settings,
        tmp_path,
    )
    first, second, _, third = plan.steps
    assert isinstance(first, df.RunStep) and isinstance(second, df.RunStep)
    assert isinstance(third, df.RunStep)
    assert third.pip == [["-r", "/app/requirements.txt", "-r", "/abs.txt", "--"]]
    assert first.pip == [["--", "pytest==8.0", "requests[socks]>=2"], ["--no-deps", "--", "six"]]
    assert second.pip == [["--pre", "--", "attrs"]]


# ------------------------------------------------------------------ names and aliases


def test_aliases_and_unknown_docker_images(settings: Settings, tmp_path: Path) -> None:
    assert df.resolve_image(settings, "debian:bookworm-slim") == "default"
    assert df.resolve_image(settings, "debian:12.5") == "default"
    for tag in (
        "debian:12-slim",
        "debian:bookworm-20240110-slim",
        "docker.io/library/debian:bookworm",
        "library/debian:12.4",
        "debian:bookworm@sha256:" + "a" * 64,
    ):
        assert df.resolve_image(settings, tag) == "default", tag
    for tag in ("debian:bullseye", "debian:13", "debian:bookworm-backports", "debian"):
        with pytest.raises(errors.DockerfileError):
            df.resolve_image(settings, tag)
    assert df.resolve_image(settings, "python-dev") == "python-dev"
    with pytest.raises(errors.DockerfileError, match=re.escape("docker_image 'python:3.12'")):
        df.resolve_image(settings, "python:3.12")
    df.set_alias(settings, "python:3.12", "python-dev")
    assert df.resolve_image(settings, "python:3.12") == "python-dev"
    with pytest.raises(errors.InvalidRequest, match="image"):
        df.set_alias(settings, "x:1", "no-such-image")
    # FROM an alias is the image it names
    plan = plan_of("FROM python:3.12\n", settings, tmp_path)
    assert plan.base == "python-dev"


def test_a_name_of_sandbox_images_cannot_be_taken(settings: Settings, tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM debian:bookworm\n")
    with pytest.raises(errors.InvalidRequest, match="name"):
        df.build_dockerfile(ctx / "Dockerfile", name="python-dev", settings=settings)
    with pytest.raises(errors.InvalidRequest, match="name"):
        df.build_dockerfile(ctx / "Dockerfile", name="Bad_Name", settings=settings)


# ------------------------------------------------------------------ real builds that fail


def _linked(settings: Settings, plan: df.Plan) -> None:
    """Link the shared mmdebstrap layer the plan needs into the test's own cache (skips when
    it is not built): the builds below ask no mirror."""
    from tests.drivers import unavailable

    layers = images.chain(images.definition_dir(settings, plan.base))
    digest = images._base_hash(images._layer_spec([d for _, d in layers], tuple(plan.packages)))
    layer = Settings.load().image_cache_dir / "base" / digest[:16]
    if not (layer / "done").is_file():
        unavailable(f"the mmdebstrap layer {layer} is not built (make setup)")
    link = settings.image_cache_dir / "base" / digest[:16]
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(layer)


@pytest.mark.sandbox
@pytest.mark.parametrize(
    ("text", "line", "instruction", "why"),
    [
        ("FROM debian:bookworm\nRUN true\nRUN echo out; exit 3\n", 3, "RUN", "exit 3"),
        # a package the builder could not read is not in the layer: apt-get says so
        (
            "FROM debian:bookworm\nRUN sh -c 'apt-get install -y jq'\n",
            2,
            "RUN",
            "not in the image's package layer: jq",
        ),
        ("FROM debian:bookworm\nRUN apt-get purge -y curl\n", 2, "RUN", "not honoured"),
        ("FROM debian:bookworm\nUSER nobody-here\n", 2, "USER", "not a user of the image"),
        ("FROM debian:bookworm\nUSER ghost\nRUN id\n", 3, "RUN", "'ghost' is not a user"),
        ("FROM debian:bookworm\nCOPY missing.txt /x\n", 2, "COPY", "not found"),
        ("FROM debian:bookworm\nCOPY a.txt b.txt /x\n", 2, "COPY", "end with '/'"),
        ("FROM debian:bookworm\nCOPY *.txt /x\n", 2, "COPY", "end with '/'"),
        ("FROM debian:bookworm\nADD --chown=worker a.tar /x/\n", 2, "ADD", "archive"),
        ("FROM debian:bookworm\nCOPY link /x\n", 2, "COPY", "symlink out of the context"),
    ],
)
def test_a_failing_build_names_file_line_and_instruction(
    settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    text: str,
    line: int,
    instruction: str,
    why: str,
) -> None:
    import tarfile

    monkeypatch.setattr(images, "build_with_image", lambda *_: None)
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(text)
    (ctx / "a.txt").write_text("a")
    (ctx / "b.txt").write_text("b")
    with tarfile.open(ctx / "a.tar", "w") as tar:
        tar.add(ctx / "a.txt", arcname="a.txt")
    os.symlink("/etc/hostname", ctx / "link")
    try:  # what can be checked before a build (COPY's sources) fails before one
        plan, _, _ = df.load(ctx / "Dockerfile", None, {}, settings)
    except errors.DockerfileError as exc:
        caught = exc
    else:
        _linked(settings, plan)
        with pytest.raises(errors.DockerfileError) as info:
            df.build_dockerfile(ctx / "Dockerfile", name="failing", settings=settings)
        caught = info.value
    assert (caught.line, caught.instruction) == (line, instruction), caught.detail
    assert why in caught.detail
    assert caught.detail.startswith(f"{ctx / 'Dockerfile'}:{line}: {instruction}: ")
    assert images.built_image(settings, "failing") is None  # nothing half-built is an image


# ------------------------------------------------------------------ listing, removal, CLI


def _fake_build(settings: Settings, name: str, digest: str = "ab" * 32) -> Path:
    """A build directory as build_dockerfile leaves it (marker last) and the name's pointer."""
    out = settings.image_cache_dir / f"{name}-{digest[:16]}"
    (out / "rootfs").mkdir(parents=True)
    meta = {"name": name, "hash": digest, "built_at": 1, "base": "default", "exec_user": "root"}
    meta["dockerfile"] = {"cmd": None}
    (out / "image.json").write_text(json.dumps(meta))
    images.point_name(settings, name, out)
    return out


def test_a_dockerfile_image_is_listed_resolved_and_removed_by_name(settings: Settings) -> None:
    from ephemeral.sandbox.image_bases import microvm_definition_dir

    old = _fake_build(settings, "task-env", "cd" * 32)
    out = _fake_build(settings, "task-env")
    listed = {i.path: i.current for i in images.list_images(settings)}
    assert listed == {old: False, out: True}  # the name points at the newer build
    built = images.built_image(settings, "task-env")
    assert built is not None and (built.user, built.base) == ("root", "default")
    assert images.available(settings) == ["task-env"]
    assert microvm_definition_dir(settings, "task-env") == settings.images_dir / "default/microvm"
    removed = images.remove_images(settings, "task-env")
    assert out in removed and old in removed
    assert images.built_image(settings, "task-env") is None
    with pytest.raises(errors.InvalidRequest, match="image"):
        images.require_built(settings, "task-env")


def _cli(tmp_path: Path, *args: str) -> tuple[int, str]:
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": str(repo),
        "EPHEMERAL_STATE_DIR": str(tmp_path / "state"),
        "EPHEMERAL_CACHE_DIR": str(tmp_path / "cache"),
    }
    done = subprocess.run(
        [sys.executable, "-m", "ephemeral.cli", "images", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, done.stdout + done.stderr


def test_the_cli_refuses_a_dockerfile_naming_the_line_and_maps_aliases(
    settings: Settings, tmp_path: Path
) -> None:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM debian:bookworm\nVOLUME /data\n")
    code, out = _cli(tmp_path, "build", "--dockerfile", str(ctx / "Dockerfile"))
    assert code != 0 and f"{ctx / 'Dockerfile'}:2: VOLUME: " in out, out
    code, out = _cli(tmp_path, "build", "--context", str(ctx))
    assert code != 0 and "--dockerfile" in out, out
    code, out = _cli(tmp_path, "alias", "python:3.12", "no-such-image")
    assert code != 0 and "no-such-image" in out, out
    code, out = _cli(tmp_path, "alias", "python:3.12", "python-dev")
    assert code == 0, out
    assert df.resolve_image(settings, "python:3.12") == "python-dev"


# ------------------------------------------------------------------ multi-stage


def test_stages_are_planned_apart_and_only_the_needed_ones_built(
    settings: Settings, tmp_path: Path
) -> None:
    plan = plan_of(
        "ARG V=1\n"
        "FROM python-dev AS build\n"
        "ENV IN_BUILD=1\n"
        "WORKDIR /src\n"
        "FROM debian:bookworm AS unused\n"
        "RUN exit 1\n"
        "FROM debian:bookworm AS second\n"
        "COPY --from=BUILD /src/out /mid/\n"
        "FROM debian:bookworm\n"
        "ARG V\n"
        "COPY --from=second mid/ /app/\n"
        "COPY --from=0 /src/out/result.txt .\n",
        settings,
        tmp_path,
    )
    assert [s.name for s in plan.stages] == ["build", "unused", "second"]
    assert [s.base for s in plan.stages] == ["python-dev", "default", "default"]
    assert plan.stages[0].env["IN_BUILD"] == "1" and "IN_BUILD" not in plan.env
    assert plan.stages[0].workdir == "/src" and plan.workdir is None
    assert plan.needed() == [0, 2]  # `unused` is never built
    first, second = plan.steps
    assert isinstance(first, df.CopyStep) and isinstance(second, df.CopyStep)
    assert (first.from_stage, first.sources, first.dest) == (2, ["/mid"], "/app")
    assert (second.from_stage, second.sources, second.dest, second.as_dir) == (
        0,
        ["/src/out/result.txt"],
        "/",
        True,
    )


@pytest.mark.sandbox
def test_add_unpacks_local_archives_and_copies_other_files(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tarfile

    monkeypatch.setattr(images, "build_with_image", lambda *_: None)
    ctx = tmp_path / "ctx"
    (ctx / "tree" / "pkg").mkdir(parents=True)
    (ctx / "tree" / "pkg" / "m.py").write_text("x = 1\n")
    for name, mode in (("plain.tar", "w"), ("gz.tar.gz", "w:gz")):
        with tarfile.open(ctx / name, mode) as tar:
            tar.add(ctx / "tree", arcname=".")
    (ctx / "notes.txt").write_text("just a file\n")
    (ctx / "Dockerfile").write_text(
        "FROM debian:bookworm\n"
        "ADD plain.tar /plain\n"
        "ADD gz.tar.gz notes.txt /gz/\n"
        "COPY gz.tar.gz /kept/\n"  # COPY never unpacks
    )
    plan, _, _ = df.load(ctx / "Dockerfile", None, {}, settings)
    _linked(settings, plan)
    root = df.build_dockerfile(ctx / "Dockerfile", name="added", settings=settings).rootfs
    assert (root / "plain/pkg/m.py").read_text() == "x = 1\n"
    assert (root / "gz/pkg/m.py").read_text() == "x = 1\n"
    assert (root / "gz/notes.txt").read_text() == "just a file\n"
    assert (root / "gz/pkg/m.py").stat().st_uid == 0
    assert (root / "kept/gz.tar.gz").read_bytes() == (ctx / "gz.tar.gz").read_bytes()


@pytest.mark.sandbox
def test_copy_from_an_earlier_stage(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(images, "build_with_image", lambda *_: None)
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(
        "FROM debian:bookworm AS build\n"
        "RUN mkdir -p /out/sub && echo built > /out/result.txt && echo deep > /out/sub/d.txt"
        " && ln -s /etc/hostname /out/link && chown -R worker /out\n"
        "FROM debian:bookworm AS unused\n"
        "RUN exit 1\n"
        "FROM debian:bookworm\n"
        "COPY --from=build /out/ /app/\n"
        "COPY --from=0 --chown=worker /out/result.txt /single.txt\n"
        "COPY --from=build /out/*.txt /globbed/\n"
    )
    plan, _, _ = df.load(ctx / "Dockerfile", None, {}, settings)
    _linked(settings, plan)
    built = df.build_dockerfile(ctx / "Dockerfile", name="staged", settings=settings)
    root = built.rootfs
    assert (root / "app/result.txt").read_text() == "built\n"
    assert (root / "app/sub/d.txt").read_text() == "deep\n"
    assert os.readlink(root / "app/link") == "/etc/hostname"  # a link of the stage stays one
    assert (root / "app/result.txt").stat().st_uid == 0  # COPY --from without --chown: root
    assert (root / "single.txt").read_text() == "built\n"
    assert (root / "single.txt").stat().st_uid == 1000
    assert sorted(p.name for p in (root / "globbed").iterdir()) == ["result.txt"]
    leftovers = [p.name for p in settings.image_cache_dir.iterdir() if "stages" in p.name]
    assert leftovers == []  # the stages' rootfs are gone


@pytest.mark.sandbox
def test_run_steps_are_not_host_root_and_have_no_network(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Dockerfile's RUN is root of its own user namespace (mapped to an unprivileged host
    uid range), with a loopback of its own: a host service on 127.0.0.1 is out of reach."""
    import socket

    monkeypatch.setattr(images, "build_with_image", lambda *_: None)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(
        "FROM debian:bookworm\n"
        "RUN id -u > /uid && cat /proc/self/uid_map > /uidmap\n"
        'RUN python3 -c "import socket; s = socket.socket(); '
        f"print(s.connect_ex(('127.0.0.1', {port})))\" > /net\n"
    )
    try:
        plan, _, _ = df.load(ctx / "Dockerfile", None, {}, settings)
        _linked(settings, plan)
        root = df.build_dockerfile(ctx / "Dockerfile", name="hostile", settings=settings).rootfs
    finally:
        listener.close()
    assert (root / "uid").read_text() == "0\n"
    inside, outside, count = (int(x) for x in (root / "uidmap").read_text().split())
    assert inside == 0 and outside >= 1 << 30 and count == 65536  # never host uid 0
    assert (root / "net").read_text() == "111\n"  # ECONNREFUSED: not the host's loopback


# ------------------------------------------------------------------ nothing runs on the host

_EVIL_SETUP = """\
import os
open({marker!r}, "w").write(str(os.getuid()))
from setuptools import setup
setup(name="evil", version="0.1")
"""


def _evil_context(tmp_path: Path, text: str) -> tuple[Path, Path]:
    """A context holding the red-team's sdist ``evil.tgz`` (and its twins under other
    archive names), whose build backend would write ``marker`` on the host."""
    import io
    import tarfile

    marker = tmp_path / "marker"
    ctx = tmp_path / "ctx"
    (ctx / "sub").mkdir(parents=True)
    setup = _EVIL_SETUP.format(marker=str(marker)).encode()
    for name in ("evil.tgz", "evil.tar", "evil.tar.lz", "evil.zip", "sub/evil.tgz"):
        with tarfile.open(ctx / name, "w:gz" if name.endswith("tgz") else "w") as tar:
            info = tarfile.TarInfo("evil-0.1/setup.py")
            info.size = len(setup)
            tar.addfile(info, io.BytesIO(setup))
    (ctx / "Dockerfile").write_text(text)
    return ctx, marker


@pytest.mark.parametrize(
    "words",
    [
        "evil.tgz",
        "six evil.tar",
        "evil.tar.lz",
        "'evil.zip'",
        "sub/evil.tgz",
        "file:evil.tgz",
        "'evil.tgz[x]'",
        "git+file:///tmp/x",
        "'evil @ file:///tmp/evil.tgz'",
    ],
)
def test_a_pip_word_the_hosts_pip_would_read_as_a_file_is_refused_at_load(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, words: str
) -> None:
    """The red-team's `RUN pip install evil.tgz`: pip reads a bare name with an archive
    extension as a local file and runs its build backend. Refused at load, naming the line,
    before any pip runs (even with the context as the working directory)."""
    ctx, marker = _evil_context(
        tmp_path, f"FROM debian:bookworm\nRUN true\nRUN pip install {words}\n"
    )
    monkeypatch.chdir(ctx)
    with pytest.raises(errors.DockerfileError) as exc:
        df.load(ctx / "Dockerfile", None, {}, settings)
    assert (exc.value.line, exc.value.instruction) == (3, "RUN"), exc.value.detail
    assert "pip install" in exc.value.detail
    assert not marker.exists()


def test_a_path_of_the_image_is_left_to_the_pip_inside(settings: Settings, tmp_path: Path) -> None:
    plan = plan_of(
        "FROM debian:bookworm\nRUN pip install ./evil.tgz /src/evil.tar . six\n",
        settings,
        tmp_path,
    )
    step = plan.steps[0]
    assert isinstance(step, df.RunStep) and step.pip == [["--", "six"]]


@pytest.mark.sandbox
def test_a_requirements_file_naming_an_archive_fails_before_the_hosts_pip(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same sdist named in a ``-r`` file (a file of the image, read when its RUN comes):
    the build fails naming the RUN line and the file's line; the host's pip never ran."""
    monkeypatch.setattr(images, "build_with_image", lambda *_: None)
    ctx, marker = _evil_context(
        tmp_path,
        "FROM debian:bookworm\nCOPY req.txt evil.tgz /app/\nWORKDIR /app\n"
        "RUN pip install -r req.txt\n",
    )
    (ctx / "req.txt").write_text("# fine\nsix\nevil.tgz\n")
    monkeypatch.chdir(ctx)
    plan, _, _ = df.load(ctx / "Dockerfile", None, {}, settings)
    _linked(settings, plan)
    with pytest.raises(errors.DockerfileError) as exc:
        df.build_dockerfile(ctx / "Dockerfile", name="evil", settings=settings)
    assert not marker.exists(), f"the sdist's backend ran on the host as uid {marker.read_text()}"
    assert (exc.value.line, exc.value.instruction) == (4, "RUN"), exc.value.detail
    assert "req.txt: line 3: 'evil.tgz'" in exc.value.detail, exc.value.detail
    assert images.built_image(settings, "evil") is None
