"""Harbor tasks written by the tests (the layout of Harbor 0.25's task format), and a runner for
``harbor run`` from the Python 3.12 venv ``make setup`` builds (``.venv-harbor``)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from textwrap import dedent

REPO = Path(__file__).resolve().parents[2]
HARBOR_VENV = Path(os.environ.get("EPHEMERAL_HARBOR_VENV", REPO / ".venv-harbor"))
HARBOR = HARBOR_VENV / "bin" / "harbor"
ENVIRONMENT = "ephemeral.harbor:EphemeralEnvironment"


def harbor_missing() -> str | None:
    if not HARBOR.is_file():
        return f"no Harbor venv at {HARBOR_VENV} (make harbor-venv needs Python 3.12)"
    return None


def _toml(name: str, env: str, agent_timeout: float = 120.0) -> str:
    return dedent(f"""\
        schema_version = "1.4"

        [task]
        name = "ephemeral-tests/{name}"

        [agent]
        timeout_sec = {agent_timeout}

        [verifier]
        timeout_sec = 120.0

        [environment]
        build_timeout_sec = 900.0
        network_mode = "no-network"
        cpus = 1
        memory_mb = 1024
        """) + dedent(env)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if rel.endswith(".sh"):
            path.chmod(0o755)


REWARD = "then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"
# the verifier of a task whose score the test does not look at, and a solution that does nothing
SCORES_ONE = "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n"
DOES_NOTHING = "#!/bin/bash\ntrue\n"

# The apt packages of every Dockerfile here are the same list: one package layer for them all.
APT = (
    "RUN apt-get update && apt-get install -y --no-install-recommends \\\n"
    "    python3-pytest python3-pip && rm -rf /var/lib/apt/lists/*\n"
)


def toolbox(root: Path) -> None:
    """apt and pip installs, COPY of a file and a directory, ENV, WORKDIR and USER."""
    _write(root / "toolbox", {
        "task.toml": _toml("toolbox", ""),
        "instruction.md": "Write /work/app/report.txt as the oracle does.\n",
        "environment/Dockerfile": (
            "FROM debian:bookworm-slim\n" + APT
            + "RUN pip install --no-cache-dir --break-system-packages six\n"
            "COPY greet.txt /opt/greet.txt\n"
            "COPY data/ /opt/data/\n"
            "ENV GREETING_FILE=/opt/greet.txt\n"
            "WORKDIR /work/app\n"
            "RUN useradd -m -u 1500 tester && chown tester /work/app\n"
            "USER tester\n"
        ),
        "environment/greet.txt": "hello from the context\n",
        "environment/data/a.csv": "1,2\n",
        "environment/data/b.csv": "3,4\n",
        "solution/solve.sh": dedent("""\
            #!/bin/bash
            set -euo pipefail
            {
              id -un; pwd; cat "$GREETING_FILE"; ls /opt/data
              python3 -c 'import six, pytest; print("imports ok")'
            } > report.txt
            """),
        "tests/test.sh": dedent("""\
            #!/bin/bash
            want=$'tester\\n/work/app\\nhello from the context\\na.csv\\nb.csv\\nimports ok'
            if [ "$(cat /work/app/report.txt 2>/dev/null)" = "$want" ]; """) + REWARD,
    })  # fmt: skip


def fixbug(root: Path) -> None:
    """A bug to fix, graded by pytest (the tests arrive only for the verifier)."""
    _write(root / "fixbug", {
        "task.toml": _toml("fixbug", ""),
        "instruction.md": "Fix add() in /app/calc.py.\n",
        "environment/Dockerfile": (
            "FROM debian:bookworm\n" + APT + "COPY src/ /app/\nWORKDIR /app\n"
        ),
        "environment/src/calc.py": "def add(a, b):\n    return a - b\n",
        "solution/solve.sh": "#!/bin/bash\nsed -i 's/a - b/a + b/' /app/calc.py\n",
        "tests/test_calc.py": (
            "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
        ),
        "tests/test.sh": (
            "#!/bin/bash\n"
            "if PYTHONPATH=/app python3 -m pytest -q -p no:cacheprovider /tests/test_calc.py "
            "> /logs/verifier/pytest.txt 2>&1; " + REWARD
        ),
    })  # fmt: skip


def hidden(root: Path) -> None:
    """The verifier's expected answer is a file the agent never sees (/tests comes later)."""
    _write(root / "hidden", {
        "task.toml": _toml("hidden", ""),
        "instruction.md": "Write the sum of /app/numbers.txt to /app/answer.txt.\n",
        "environment/Dockerfile": "FROM debian:bookworm\nWORKDIR /app\nCOPY numbers.txt .\n",
        "environment/numbers.txt": "17\n25\n",
        "solution/solve.sh": dedent("""\
            #!/bin/bash
            [ ! -e /tests ] || echo "the tests were visible" > /app/peeked
            echo $(( $(paste -sd+ /app/numbers.txt) )) > /app/answer.txt
            """),
        "tests/expected.txt": "42\n",
        "tests/test.sh": (
            "#!/bin/bash\n"
            'if [ ! -e /app/peeked ] && [ "$(cat /app/answer.txt 2>/dev/null)" = '
            '"$(cat /tests/expected.txt)" ]; ' + REWARD
        ),
    })  # fmt: skip


def timeout(root: Path) -> None:
    """The agent phase times out (Harbor cancels exec): its processes must be gone before the
    verifier runs, which scores 1 only then. A docker_image name: Debian's maps to ours."""
    _write(root / "timeout", {
        "task.toml": _toml("timeout", 'docker_image = "debian:bookworm"\n', agent_timeout=4.0),
        "instruction.md": "Sleep.\n",
        "solution/solve.sh": "#!/bin/bash\nsleep 1000 &\nsleep 1001\n",
        "tests/test.sh": (
            "#!/bin/bash\n"
            "left=0; for p in /proc/[0-9]*; do "
            'case "$(tr "\\0" " " < $p/cmdline 2>/dev/null)" in "sleep 100"*) left=1;; esac; done\n'
            'if [ $left = 0 ]; ' + REWARD
        ),
    })  # fmt: skip


# Rewrites the reward to 1 whenever the verifier has written another; ignores SIGTERM.
FORGER = (
    'trap "" TERM HUP INT; while :; do r=$(cat /logs/verifier/reward.txt 2>/dev/null); '
    'if [ -n "$r" ] && [ "$r" != 1 ]; then echo 1 > /logs/verifier/reward.txt; fi; sleep 0.02; done'
)


def forgers(root: Path) -> None:
    """Issue 35, finding 6: the agent phase leaves writers that forge the verifier's reward (a
    setsid one, a double-forked daemon, one under a parent that stays alive: root's, ignoring
    SIGTERM), then exits (``forger``) or times out (``forger_late``). The verifier writes 0 and
    waits a second: a writer left alive turns it into 1."""
    start = (
        "#!/bin/bash\n"
        f"export w='{FORGER}'\n"
        "exec </dev/null >/dev/null 2>&1\n"
        'setsid bash -c "$w" setsid-forger &\n'
        '( setsid bash -c "$w" daemon-forger & )\n'
        "( setsid bash -c 'bash -c \"$w\" child-forger; sleep 1000' & )\n"
    )
    verifier = "#!/bin/bash\necho 0 > /logs/verifier/reward.txt\nsleep 1\nps -eo pid,user,args\n"
    for name, agent_timeout, tail in (("forger", 120.0, ""), ("forger_late", 4.0, "sleep 1000\n")):
        _write(root / name, {
            "task.toml": _toml(
                name, 'docker_image = "debian:bookworm"\n', agent_timeout=agent_timeout
            ),
            "instruction.md": "Forge the reward.\n",
            "solution/solve.sh": start + tail,
            "tests/test.sh": verifier,
        })  # fmt: skip


def sleeper(root: Path) -> None:
    """An agent phase that sleeps for a minute (the tests interrupt Harbor meanwhile)."""
    _write(root / "sleeper", {
        "task.toml": _toml("sleeper", 'docker_image = "debian:bookworm"\n'),
        "instruction.md": "Sleep.\n",
        "solution/solve.sh": "#!/bin/bash\nsleep 60\n",
        "tests/test.sh": SCORES_ONE,
    })  # fmt: skip


def unsupported(root: Path) -> None:
    """A Dockerfile instruction the builder does not honour: the trial ends at build."""
    _write(root / "unsupported", {
        "task.toml": _toml("unsupported", ""),
        "instruction.md": "Nothing.\n",
        "environment/Dockerfile": "FROM debian:bookworm\nRUN true\nHEALTHCHECK CMD true\n",
        "solution/solve.sh": DOES_NOTHING,
        "tests/test.sh": SCORES_ONE,
    })  # fmt: skip


def public(root: Path) -> None:
    """A task that asks for the internet (Harbor's default network_mode)."""
    _write(root / "public", {
        "task.toml": _toml("public", "").replace('network_mode = "no-network"', ""),
        "instruction.md": "Nothing.\n",
        "environment/Dockerfile": "FROM debian:bookworm\n",
        "solution/solve.sh": DOES_NOTHING,
        "tests/test.sh": SCORES_ONE,
    })  # fmt: skip


@dataclass
class Trial:
    task: str
    agent: str
    reward: float | None
    exception: str | None
    message: str
    result: dict[str, object]


def harbor_env(state: Path) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("EPHEMERAL_URL", "VIRTUAL_ENV"))
    }
    env |= {
        "HARBOR_TELEMETRY": "0",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch (and retries) of a price list
        "PYTHONPATH": str(REPO),
        "EPHEMERAL_STATE_DIR": str(state),
        "COLUMNS": "200",
    }
    return env


def harbor_argv(
    tasks: Path, jobs: Path, *, agents: list[str], ek: dict[str, str], n: int, job: str
) -> list[str]:
    argv = [str(HARBOR), "run", "-p", str(tasks), "-e", ENVIRONMENT, "-n", str(n),
            "-o", str(jobs), "--job-name", job, "-y", "-q"]  # fmt: skip
    for agent in agents:
        argv += ["-a", agent]
    for key, value in ek.items():
        argv += ["--ek", f"{key}={value}"]
    return argv


def run_harbor(
    tasks: Path,
    jobs: Path,
    state: Path,
    *,
    agents: list[str],
    ek: dict[str, str],
    n: int = 4,
    timeout: float = 900,
    job: str = "job",
    extra: list[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    argv = harbor_argv(tasks, jobs, agents=agents, ek=ek, n=n, job=job) + (extra or [])
    env = harbor_env(state)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)


def run_job(
    task_dirs: list[Path],
    jobs: Path,
    state: Path,
    *,
    agents: list[str],
    ek: dict[str, object],
    n: int = 4,
    timeout: float = 900,
    job: str = "job",
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """One ``harbor run -c JOB.yaml``: every agent on every task (the CLI takes one agent);
    ``env``: more environment variables for it."""
    config = {
        "job_name": job,
        "jobs_dir": str(jobs),
        "n_concurrent_trials": n,
        "quiet": True,
        "environment": {"import_path": ENVIRONMENT, "kwargs": ek},
        "agents": [{"name": a} for a in agents],
        "tasks": [{"path": str(d)} for d in task_dirs],
    }
    jobs.mkdir(parents=True, exist_ok=True)
    path = jobs / f"{job}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    argv = [str(HARBOR), "run", "-c", str(path), "-y"]
    return subprocess.run(
        argv, env=harbor_env(state) | (env or {}), capture_output=True, text=True, timeout=timeout
    )


def trials(jobs: Path, job: str = "job") -> list[Trial]:
    """Every trial's result.json (``harbor run`` exits 0 even when trials fail)."""
    out = []
    for path in sorted((jobs / job).glob("*/result.json")):
        r = json.loads(path.read_text())
        rewards = (r.get("verifier_result") or {}).get("rewards") or {}
        exc = r.get("exception_info") or {}
        out.append(
            Trial(
                task=str(r["task_name"]).rsplit("/", 1)[-1],
                agent=str(r["agent_info"]["name"]),
                reward=rewards.get("reward"),
                exception=exc.get("exception_type"),
                message=str(exc.get("exception_message") or ""),
                result=r,
            )
        )
    return out
