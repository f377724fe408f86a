"""Verify cannot be forged from what the agent left (issue 18, item 7), on every level.

The replayed agent plants everything a grader could pick up at start: a fake ``pytest`` and a
``.pth`` in its user site, ``PYTHONPATH``/``BASH_ENV``/``ENV`` (to a ``sitecustomize.py`` and
an ``exit 0`` script in /tmp) in every profile file, a pre-made /tmp/verify and verify home,
and a detached reader of /tmp/verify. Its own ``python3 -m pytest`` then "passes"; the
grader's, in plain, bash, login bash and login sh, still fails the real test. The verify-only
file is read by verify and by nothing of the agent's.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Callable
from pathlib import Path

import pytest

from ephemeral.engine.runtime import Runtime
from ephemeral.policy import RunRequest
from ephemeral.sandbox import registry
from ephemeral.settings import Settings
from tests.drivers import built_image, unavailable
from tests.run.conftest import turn
from tests.run.test_agent_run import assert_settled, run_to_end

pytestmark = [pytest.mark.sandbox]
LEVELS = ["namespaces", "gvisor", pytest.param("microvm-tcg", marks=pytest.mark.slow)]

PLANT = r"""
us=$HOME/.local/lib/python3.11/site-packages
mkdir -p "$us/pytest" /tmp/evil /tmp/verify /tmp/.verify-home
printf 'print("2 passed")\nraise SystemExit(0)\n' > "$us/pytest/__main__.py"
: > "$us/pytest/__init__.py"
echo 'import os; os._exit(0)' > "$us/evil.pth"
printf 'import os\nos._exit(0)\n' > /tmp/evil/sitecustomize.py
cp /tmp/evil/sitecustomize.py /tmp/evil/usercustomize.py
printf 'exit 0\n' > /tmp/evil/env.sh
for f in .profile .bashrc .bash_profile .bash_login; do
  printf 'export PYTHONPATH=/tmp/evil BASH_ENV=/tmp/evil/env.sh ENV=/tmp/evil/env.sh\nexit 0\n' \
    > "$HOME/$f"
done
cp -a "$HOME/." /tmp/.verify-home/
echo planted-by-agent > /tmp/verify/secret.txt
setsid sh -c 'while :; do cat /tmp/verify/* >> /tmp/leak 2>/dev/null; sleep 0.05; done' \
  </dev/null >/dev/null 2>&1 &
python3 -m pytest -q test_real.py; echo "agent-pytest-exit=$?"
cat /tmp/verify/secret.txt
"""
# Every site directory Python reads at start, written to for real: none may take a file.
SITE_DIRS_READ_ONLY = (
    "python3 -c 'import os, site, sys\n"
    "dirs = {d for d in [*site.getsitepackages(), *sys.path[1:]] if os.path.isdir(d)}\n"
    "bad = []\n"
    "for d in sorted(dirs):\n"
    "    try:\n"
    '        open(os.path.join(d, "x.pth"), "x").close()\n'
    "        bad.append(d)\n"
    "    except OSError:\n"
    "        pass\n"
    "print(len(dirs), bad)\n"
    "raise SystemExit(1 if bad or not dirs else 0)'"
)
REAL_TEST = "def test_real():\n    assert 1 + 1 == 3\n"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.mark.parametrize("level", LEVELS)
async def test_verify_runs_in_an_environment_the_agent_could_not_shape(
    level: str, runtime: Runtime, run_settings: Settings, make_cassette: Callable[..., str]
) -> None:
    why = await registry.probe_level(level, Settings.load(state_dir=run_settings.state_dir))
    if why is not None:
        unavailable(f"{level} cannot run here: {why}", level)
    built_image(run_settings, "python-dev")
    secret = f"verify-only-{secrets.token_hex(8)}"
    model = make_cassette(f"forge-verify-{level}", [turn(PLANT), turn(final="All green.")])
    pytest_real = "python3 -m pytest -q -p no:cacheprovider test_real.py"
    verify = [
        pytest_real,
        f"bash -c '{pytest_real}'",
        f"bash -lc '{pytest_real}'",
        f"sh -lc '{pytest_real}'",
        'cat "$EPHEMERAL_VERIFY_DIR/secret.txt"',
        "! grep -qs verify-only- /tmp/leak",
        "echo home=$HOME; ls -A $HOME; python3 -c 'import site; print(site.ENABLE_USER_SITE)'",
        SITE_DIRS_READ_ONLY,
    ]
    request = RunRequest.model_validate(
        {
            "prompt": "make the test pass",
            "model": model,
            "image": "python-dev",
            "isolation": level,
            "timeout_seconds": 300 if level.startswith("microvm") else 60,
            "verify_timeout_seconds": 150 if level.startswith("microvm") else 30,
            "max_cost_micros": 40_000,
            "files": [{"path": "test_real.py", "content_base64": _b64(REAL_TEST)}],
            "verify_files": [{"path": "secret.txt", "content_base64": _b64(secret + "\n")}],
            "verify": verify,
        }
    )
    row, events = await run_to_end(runtime, request)
    assert row.status == "succeeded", row.termination_detail
    shell = [e.data for e in events if e.type == "shell.executed"]
    assert len(shell) == 1
    # the plant works on the agent's own python: the test would pass if verify read it
    assert "agent-pytest-exit=0" in shell[0]["stdout"], shell[0]
    assert "planted-by-agent" in shell[0]["stdout"]
    assert secret not in str(shell)  # the agent never saw the verify-only file
    results = {v["command"]: v for v in (e.data for e in events if e.type == "verify.executed")}
    assert list(results) == verify
    for command in verify[:4]:
        res = results[command]
        assert res["exit_code"] == 1 and "1 failed" in res["stdout"], res
        assert "2 passed" not in res["stdout"]
    assert results[verify[4]]["stdout"] == secret + "\n"  # visible to verify
    assert results[verify[5]]["exit_code"] == 0  # the detached reader died before it existed
    env = results[verify[6]]
    assert env["exit_code"] == 0, env
    assert env["stdout"] == "home=/tmp/.verify-home\ntmp\nFalse\n"  # a fresh, empty home
    assert results[verify[7]]["exit_code"] == 0, results[verify[7]]
    assert_settled(row, events)


def test_verify_files_stay_out_of_sessions_and_out_of_reach_of_paths() -> None:
    """A session has no verify step: verify_files there is a 422, like setup and verify; paths
    are relative to /tmp/verify, never out of it."""
    from pydantic import ValidationError

    from ephemeral.sessions.requests import SessionRequest

    file = {"path": "a.txt", "content_base64": _b64("x")}
    with pytest.raises(ValidationError, match="verify_files"):
        SessionRequest.model_validate({"verify_files": [file]})
    for bad in ("/etc/x", "../x", "a/../../x", "a//b"):
        with pytest.raises(ValidationError, match=r"verify_files\.0\.path"):
            RunRequest.model_validate(
                {
                    "prompt": "p",
                    "verify": ["true"],
                    "verify_files": [{"path": bad, "content_base64": _b64("x")}],
                }
            )
    with pytest.raises(ValidationError, match="duplicate path"):
        RunRequest.model_validate({"prompt": "p", "verify": ["true"], "verify_files": [file, file]})


def test_the_verify_environment_keeps_no_writable_search_path() -> None:
    from ephemeral.engine.verify import environment

    env = environment(
        {
            "PATH": "/opt/tool/bin:/home/worker/.local/bin::.:bin:/tmp/x:/usr/bin",
            "PYTHONPATH": "/opt/lib",  # read-only: the image's own
            "BASH_ENV": "/tmp/evil.sh",
            "PERL5LIB": "/opt/perl:lib",  # one relative entry: the working directory
            "PIP_NO_INDEX": "1",
        },
        {"HTTP_PROXY": "http://127.0.0.1:3128"},
    )
    assert env == {
        "PATH": "/opt/tool/bin:/usr/bin",
        "PYTHONPATH": "/opt/lib",
        "PIP_NO_INDEX": "1",
        "HTTP_PROXY": "http://127.0.0.1:3128",
        "HOME": "/tmp/.verify-home",
        "TMPDIR": "/tmp/.verify-home/tmp",
        "PYTHONNOUSERSITE": "1",
        "EPHEMERAL_VERIFY_DIR": "/tmp/verify",
    }
    assert environment({}, {})["PATH"] == "/usr/local/bin:/usr/bin:/bin"


def test_a_recipe_puts_verify_files_from_its_own_directory(tmp_path: Path) -> None:
    from ephemeral.errors import RecipeError
    from ephemeral.recipes.recipe import load_recipe

    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / "test_hidden.py").write_text("def test_x():\n    pass\n")
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "f.txt").write_text("host file")
    (tmp_path / "link").symlink_to(outside)
    base = "name: r\nprompt: p\nverify: ['true']\n"
    good = tmp_path / "good.yaml"
    good.write_text(base + "verify_files_from: hidden\n")
    recipe = load_recipe(good)
    [f] = recipe.run_policy.verify_files
    assert f.path == "test_hidden.py" and f.data() == b"def test_x():\n    pass\n"
    assert recipe.run_policy.files == []  # never among the agent's files
    for value in (str(outside), "../" + outside.name, "link"):
        bad = tmp_path / "bad.yaml"
        bad.write_text(base + f"verify_files_from: '{value}'\n")
        with pytest.raises(RecipeError, match="verify_files_from"):
            load_recipe(bad)


async def test_no_verify_file_and_no_verify_command_when_the_agent_could_not_be_stopped(
    runtime: Runtime,
    run_settings: Settings,
    make_cassette: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    why = await registry.probe_level("namespaces", Settings.load(state_dir=run_settings.state_dir))
    if why is not None:
        unavailable(f"namespaces cannot run here: {why}", "namespaces")
    from ephemeral import errors
    from ephemeral.sandbox.guest import GuestBacked

    async def survivors(self: GuestBacked) -> int:
        raise errors.SandboxError("kill_all: kill_failed: 1 processes survived SIGKILL")

    monkeypatch.setattr(GuestBacked, "kill_all", survivors)
    put: list[str] = []
    real_put = GuestBacked.put_file

    async def record_put(self: GuestBacked, path: str, *a: object, **kw: object) -> None:
        put.append(path)
        await real_put(self, path, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(GuestBacked, "put_file", record_put)
    model = make_cassette("verify-survivors", [turn("echo hi"), turn(final="done")])
    request = RunRequest.model_validate(
        {
            "prompt": "p",
            "model": model,
            "isolation": "namespaces",
            "timeout_seconds": 60,
            "verify": ["true", "cat /tmp/verify/secret.txt"],
            "verify_files": [{"path": "secret.txt", "content_base64": _b64("s")}],
        }
    )
    row, events = await run_to_end(runtime, request)
    assert row.status == "succeeded", row.termination_detail
    verify = [e.data for e in events if e.type == "verify.executed"]
    assert [v["skipped"] for v in verify] == ["the agent's processes could not be stopped"] * 2
    assert [v["exit_code"] for v in verify] == [None, None]
    assert not any(p.startswith("/tmp/verify") for p in put), put
    assert_settled(row, events)
