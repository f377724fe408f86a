"""Agent runs (``agent:``): a real third-party agent, mini-swe-agent (its model layer is litellm),
in the ``mini-swe-agent`` image, in real sandboxes, calling the local model server (the real
OpenAI wire format) through the gateway, which holds the canary key.

The image is built on first use (cached by its definition's hash, docs/images.md); the build
fetches its wheels with the host's pip, so it takes minutes the first time.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from ephemeral.engine.runtime import Runtime
from ephemeral.events import Event
from ephemeral.policy import RunRequest
from ephemeral.sandbox import images
from ephemeral.settings import REPO_ROOT, Settings
from ephemeral.testing.providers import (
    CapturedRequest,
    FakeOpenAIServer,
    FakeReply,
    openai_chat_response,
)
from tests import runlevel
from tests.api.server import live_server
from tests.broker.conftest import state_bytes_contain
from tests.gateway.conftest import OPENAI_KEY
from tests.goldenlog import assert_golden_log
from tests.patience import PATIENCE
from tests.run.test_agent_run import POOL_PATIENCE, assert_settled, run_to_end, types

pytestmark = [pytest.mark.sandbox]

IMAGE = "mini-swe-agent"
GPT = "openai/gpt-6-luna"
PROJECT = REPO_ROOT / "recipes" / "evals" / "fix-the-test" / "project"
# mini-swe-agent's runs end on their own; their limits only stop a hung agent. Compute is charged
# by the second of sandbox life, and on an emulated microVM (TCG) at load 40 mini had not made
# its first call after 125 s: the budget covers compute for the whole time limit, as a
# session's default does, so what these tests assert is settlement, never the host's speed.
MINI_SECONDS = 1800
MINI_BUDGET = MINI_SECONDS * 800 + 100_000  # 800 micros a second: the default book's sandbox
HUNG_TEST_SECONDS = 2400  # pytest-timeout for a mini run: longer than its time limit
# What a user writes: mini in yolo mode on the prompt, its model through the gateway (litellm's
# `openai/` provider reads OPENAI_BASE_URL and OPENAI_API_KEY), its submission as the answer.
# Each of mini's commands may take the run's time limit (its own default is 30 s, which a
# pytest on TCG under load passed, and mini then told the model the command timed out).
MINI = (
    'python3 -m minisweagent.run.mini -y --exit-immediately -m "openai/$EPHEMERAL_MODEL" '
    f"-c mini.yaml -c environment.timeout={MINI_SECONDS} "
    '-t "$EPHEMERAL_PROMPT" -o /tmp/mini.traj.json > /tmp/mini.log 2>&1; status=$?; '
    'python3 -c \'import json; print(json.load(open("/tmp/mini.traj.json"))'
    '["info"]["submission"])\' > /tmp/answer.md; exit $status'
)
FIX = (
    'cat > calc/ops.py <<\'EOF\'\n"""Arithmetic for the calc package."""\n\n\n'
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "def mul(a, b):\n    return a * b\nEOF\npython3 -m pytest -q -p no:cacheprovider"
)
PYTEST = "python3 -m pytest -q -p no:cacheprovider"
BREAK = "sed -i 's/return a + b/return a - b/' calc/ops.py"


@pytest.fixture(scope="session")
def mini_image() -> Iterator[str]:
    """The image, built here if this definition was not built yet (it is not in make setup)."""
    import asyncio

    settings = Settings.load()
    if images.built_image(settings, IMAGE) is None:
        asyncio.run(images.ensure_image(settings, IMAGE))
    yield IMAGE


def _reply(content: str, command: str, tokens: tuple[int, int]) -> FakeReply:
    return FakeReply(
        body=openai_chat_response(
            content=content,
            tool_calls=[(f"call_{uuid.uuid4().hex[:8]}", "bash", {"command": command})],
            prompt_tokens=tokens[0],
            completion_tokens=tokens[1],
        )
    )


def _files() -> list[dict[str, str]]:
    import base64

    return [
        {
            "path": str(p.relative_to(PROJECT)),
            "content_base64": base64.b64encode(p.read_bytes()).decode(),
        }
        for p in sorted(PROJECT.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    ]


def _request(isolation: str, **kw: Any) -> RunRequest:
    body: dict[str, Any] = {
        "prompt": "The package `calc` has a failing test. Fix the package, not the tests.",
        "model": GPT,
        "isolation": isolation,
        "files": _files(),
        "setup": [BREAK],
        "verify": [PYTEST],
        "verify_timeout_seconds": 60,
        "timeout_seconds": MINI_SECONDS,
        "max_cost_micros": MINI_BUDGET,
        "agent": {"command": MINI, "image": IMAGE, "output": "/tmp/answer.md"},
    }
    return RunRequest.model_validate({**body, **kw})


def _fixing_script() -> list[FakeReply]:
    return [
        _reply("Run the tests first.", PYTEST, (900, 30)),
        # what the sandbox holds: the run's environment, where a key would show
        _reply("Look around.", "env; cat /proc/self/environ | tr '\\0' '\\n'", (1400, 25)),
        _reply("Fix the operator.", FIX, (1900, 120)),
        _reply(
            "Done.",
            "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && echo 'Fixed calc/ops.py: 3 passed'",
            (2300, 40),
        ),
    ]


def _called(events: list[Event]) -> list[dict[str, Any]]:
    return [e.data for e in events if e.type == "model.called"]


@pytest.mark.timeout(HUNG_TEST_SECONDS)
async def test_mini_swe_agent_fixes_the_test_through_the_gateway(
    runtime: Runtime,
    openai_server: FakeOpenAIServer,
    isolation: str,
    mini_image: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    openai_server.push(*_fixing_script())
    row, events = await run_to_end(runtime, _request(isolation))
    assert row.status == "succeeded", (row.termination_detail, _agent_log(events))
    assert_settled(row, events)
    kinds = types(events)
    assert kinds.index("setup.executed") < kinds.index("agent.started")
    assert kinds.index("agent.started") < kinds.index("model.called")
    assert kinds.index("agent.exited") < kinds.index("verify.executed")
    started = next(e.data for e in events if e.type == "agent.started")
    assert started["image"] == IMAGE and started["models"] == [GPT]
    exited = next(e.data for e in events if e.type == "agent.exited")
    assert exited["exit_code"] == 0 and "killed" not in exited, exited

    # every model call of the agent: on the timeline, with its tokens and cost, charged
    called = _called(events)
    assert [(c["input_tokens"], c["output_tokens"]) for c in called] == [
        (900, 30),
        (1400, 25),
        (1900, 120),
        (2300, 40),
    ]
    assert all(c["via"] == "gateway" and c["model"] == GPT and c["cost_micros"] > 0 for c in called)
    assert sum(c["cost_micros"] for c in called) == row.breakdown["model_micros"]
    assert row.usage is not None and row.usage["model_calls"] == 4
    assert openai_server.unexpected == 0
    # the agent ran its commands: the test failed first, the fix made it pass, verify agrees
    second = openai_server.requests[1].json()["messages"]
    assert "1 failed" in json.dumps(second)
    verify = [e.data for e in events if e.type == "verify.executed"]
    assert verify[0]["exit_code"] == 0 and "3 passed" in verify[0]["stdout"]
    assert row.output is not None and "3 passed" in row.output

    # the canary key: on the wire to the provider only; not in the sandbox (whose environment
    # went back to the model in the third request), the events, the records or the logs
    assert all(r.headers["authorization"] == f"Bearer {OPENAI_KEY}" for r in openai_server.requests)
    sandbox_env = json.dumps(openai_server.requests[2].json()["messages"])
    assert "OPENAI_BASE_URL=http://model.internal/v1" in sandbox_env
    assert OPENAI_KEY not in sandbox_env
    assert OPENAI_KEY not in json.dumps([e.model_dump() for e in events])
    assert state_bytes_contain(runtime.settings.state_dir, OPENAI_KEY.encode()) == []
    assert OPENAI_KEY not in caplog.text


def _never_stops(req: CapturedRequest) -> FakeReply:
    """A model that always wants one more command, and reports a large usage each time (as a
    provider does: its whole max tokens, input tokens no more than the body's bytes / 3)."""
    body = req.json()
    out = min(4_000, body.get("max_completion_tokens") or body.get("max_tokens") or 4_000)
    return _reply("One more look.", f"echo {TOKEN}; sleep 0.2", (len(req.body) // 3, out))


# Its output is priced high (10 $ per million tokens): each call's hold, not the sandbox's
# compute, is what spends the budget.
PRICEY = "openai/gpt-4o"


@pytest.fixture
async def free_compute(broker_settings: Settings, tmp_path: Path) -> AsyncIterator[Runtime]:
    """A runtime whose price book charges nothing for compute: the budget is spent by what the
    test's model server reports alone (on a slow host compute used it up before mini's first
    call, at TCG speed under load)."""
    book = tmp_path / "free-compute.yaml"
    book.write_text("compute: {per_vcpu_second_micros: 0, per_gib_second_micros: 0}\n")
    settings = broker_settings.model_copy(update={"price_book": book})
    async with runlevel.started(settings, check=True) as rt:
        yield rt


TOKEN = f"agent-never-stops-{uuid.uuid4().hex}"


def _host_processes_with(token: str) -> list[int]:
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if token.encode() in cmdline:
            found.append(int(pid))
    return found


@pytest.mark.timeout(HUNG_TEST_SECONDS)
async def test_an_agent_that_never_stops_ends_budget_exhausted_and_is_killed(
    free_compute: Runtime, openai_server: FakeOpenAIServer, isolation: str, mini_image: str
) -> None:
    runtime = free_compute
    openai_server.push(*[_never_stops] * 200)
    request = _request(
        isolation,
        prompt=f"Keep going ({TOKEN}).",
        model=PRICEY,
        max_cost_micros=100_000,
        verify=[],
        verify_timeout_seconds=None,
    )
    row, events = await run_to_end(runtime, request)
    assert row.status == "budget_exhausted", (row.termination_detail, _agent_log(events))
    assert_settled(row, events)
    assert row.charged_micros <= row.reserved_micros == 100_000
    called = _called(events)
    # the model's calls spend the budget (compute is free here)
    assert len(called) >= 1 and all(c["model"] == PRICEY for c in called), called
    assert sum(c["cost_micros"] for c in called) == row.breakdown["model_micros"]
    assert row.breakdown["compute_micros"] == 0
    exited = [e.data for e in events if e.type == "agent.exited"]
    assert len(exited) == 1 and exited[0]["exit_code"] is None, exited
    assert exited[0]["killed"] == "model calls used up the budget"
    assert "sandbox.destroyed" in kinds_after(events, "agent.exited")
    # the agent (whose argv carries the prompt) is gone: no process on this host has it
    assert _host_processes_with(TOKEN) == []


def kinds_after(events: list[Event], kind: str) -> list[str]:
    names = types(events)
    return names[names.index(kind) + 1 :]


def _agent_log(events: list[Event]) -> Any:
    return [e.data for e in events if e.type in ("agent.exited", "setup.executed")]


@pytest.mark.parametrize("isolation", ["namespaces"], indirect=True)
def test_an_agent_run_through_the_api_shows_its_model_calls_on_the_cli_timeline(
    broker_settings: Settings,
    openai_server: FakeOpenAIServer,
    isolation: str,
    mini_image: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ephemeral.cli.remote import run_remote

    openai_server.push(*_fixing_script())
    with live_server(broker_settings) as server:
        client = Settings.load(url=server.url, api_key=server.member("agents"))
        # the CLI's path against a server: POST /v1/runs, then the timeline from the live SSE
        worst = run_remote(client, [(_request(isolation), {})], as_json=False)
    printed = capsys.readouterr().out
    assert worst == 0, printed
    lines = printed.splitlines()
    models = [line for line in lines if "Model:" in line]
    assert len(models) == 4, printed
    assert all(GPT in line and "tokens" in line for line in models)
    assert any("Agent: $ python3 -m minisweagent" in line for line in lines), printed
    assert any("Agent: exit 0" in line for line in lines), printed
    agent_lines = [i for i, line in enumerate(lines) if "Agent:" in line]
    model_lines = [i for i, line in enumerate(lines) if "Model:" in line]
    assert agent_lines[0] < model_lines[0] and model_lines[-1] < agent_lines[-1]
    assert openai_server.unexpected == 0


# -- the agent step itself, with a shell program in the default image (no model) -----------------
def _shell_agent(isolation: str, prompt: str, agent: dict[str, str], **kw: Any) -> RunRequest:
    """A run whose agent is a shell program in the default image (the model is granted, unused)."""
    body = {"prompt": prompt, "model": GPT, "isolation": isolation, "agent": agent}
    return RunRequest.model_validate({**body, **kw})


async def test_the_agent_gets_the_prompt_as_a_file_and_a_variable_and_its_stdout_is_the_answer(
    runtime: Runtime, isolation: str
) -> None:
    command = (
        'id -un; cat "$EPHEMERAL_PROMPT_FILE"; echo; '
        'test "$EPHEMERAL_PROMPT" = "$(cat "$EPHEMERAL_PROMPT_FILE")" && echo prompt-var-same; '
        'echo "model=$EPHEMERAL_MODEL base=$OPENAI_BASE_URL"; echo oops >&2; exit 3'
    )
    request = _shell_agent(
        isolation, "Say 'hi' (with quotes) and $HOME.", {"command": command}, timeout_seconds=60
    )
    row, events = await run_to_end(runtime, request)
    assert row.status == "succeeded", row.termination_detail
    assert_settled(row, events)
    assert row.output is not None
    lines = row.output.splitlines()
    assert lines[0] == "worker"
    assert "Say 'hi' (with quotes) and $HOME." in row.output and "prompt-var-same" in lines
    assert f"model={GPT} base=http://model.internal/v1" in lines
    exited = next(e.data for e in events if e.type == "agent.exited")
    assert exited["exit_code"] == 3 and exited["stderr"] == "oops\n"
    assert exited["output_bytes"] == len(row.output.encode())
    assert "model.called" not in types(events) and "shell.executed" not in types(events)
    assert_golden_log("agent-run", events)


async def test_an_agent_past_the_time_limit_is_killed_and_the_run_times_out(
    broker_settings: Settings, isolation: str
) -> None:
    request = _shell_agent(
        isolation,
        "wait",
        {"command": "echo started; sleep 600", "output": "answer.md"},
        timeout_seconds=4,
    )
    # The limit counts from the slot grant, the boot included: a cold microVM under load used
    # all 4 s before the agent started. A warm sandbox is adopted at once.
    settings = broker_settings.model_copy(update={"pool_size": 1, "isolation": isolation})
    async with runlevel.started(settings, check=True, warm_pool=True) as runtime:
        [pool] = runtime.sandboxes.pools.values()
        await pool.wait_ready(POOL_PATIENCE)
        row, events = await run_to_end(runtime, request)
    assert row.status == "timed_out", row.termination_detail
    assert_settled(row, events)
    exited = next(e.data for e in events if e.type == "agent.exited")
    assert exited["exit_code"] is None and (exited["timed_out"] or exited.get("killed"))
    assert "sandbox.destroyed" in kinds_after(events, "agent.exited")


async def test_a_missing_output_file_is_no_answer_and_says_why(
    runtime: Runtime, isolation: str
) -> None:
    request = _shell_agent(
        isolation, "p", {"command": "echo not-the-answer", "output": "answer.md"}
    )
    row, events = await run_to_end(runtime, request)
    assert row.status == "succeeded" and row.output is None
    exited = next(e.data for e in events if e.type == "agent.exited")
    assert exited["output_error"] == "the output file was not written"
    assert exited["output_bytes"] is None


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"shell": False}, "shell"),
        ({"image": "python-dev", "agent": {"command": "x", "image": "default"}}, "agent.image"),
        ({"agent": {"command": "x", "image": "not-built-here"}}, "agent.image"),
        ({"agent": {"command": ""}}, "agent.command"),
        ({"agent": {"command": "x", "output": "a/"}}, "agent.output"),
        ({"agent": {"command": "x", "argv": ["x"]}}, "agent.argv"),
    ],
)
async def test_bad_agent_requests_are_refused_naming_the_field(
    runtime: Runtime, http: Any, member: Any, extra: dict[str, Any], field: str
) -> None:
    body = {"prompt": "p", "agent": {"command": "echo hi"}, **extra}
    r = await http.post("/v1/runs", json=body, headers=member.headers)
    assert r.status_code == 422, r.text
    fields = [e["field"] for e in r.json().get("errors") or []]
    assert field in fields, r.json()
    assert (await runtime.store.runs.open()) == []


async def test_a_cancelled_agent_run_ends_cancelled_its_agent_killed_and_settled(
    runtime: Runtime, isolation: str
) -> None:
    token = f"agent-cancelled-{uuid.uuid4().hex}"
    command = f"echo started; sleep 100; echo never {token}"
    request = _shell_agent(isolation, "wait", {"command": command}, timeout_seconds=120)
    org = await runtime.local_org()
    row, _ = await runtime.admit(org, request)
    task = runtime.engine.launch(row.id)
    deadline = asyncio.get_running_loop().time() + PATIENCE
    while "agent.started" not in types(await runtime.store.events.list(row.id)):
        assert not task.done() and asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.1)
    await runtime.cancel(row.id)
    row = await runtime.engine.wait(row.id, timeout=PATIENCE)  # the task itself ends cancelled
    events = await runtime.store.events.list(row.id)
    assert (row.status, row.termination_reason) == ("cancelled", "cancelled"), row
    assert_settled(row, events)
    assert "never" not in (row.output or "")
    assert "sandbox.destroyed" in kinds_after(events, "agent.exited")
    exited = next(e.data for e in events if e.type == "agent.exited")
    assert exited["killed"] == row.termination_detail == "cancelled by request", exited
    # the agent (whose argv carries the token) did not outlive the run
    assert _host_processes_with(token) == []


async def test_a_zero_data_retention_agent_run_keeps_only_sizes_and_seals_its_answer(
    runtime: Runtime, isolation: str
) -> None:
    canary = "CANARY-agent-zdr-5e1c"
    request = _shell_agent(
        isolation,
        f"say {canary}",
        {"command": 'cat "$EPHEMERAL_PROMPT_FILE"; cat "$EPHEMERAL_PROMPT_FILE" >&2'},
        timeout_seconds=60,
        zero_data_retention=True,
    )
    row, events = await run_to_end(runtime, request)
    assert row.status == "succeeded", row.termination_detail
    assert_settled(row, events)
    assert row.prompt is None and row.output is None
    exited = next(e.data for e in events if e.type == "agent.exited")
    assert "stderr" not in exited and exited["stderr_bytes"] == len(f"say {canary}")
    started = next(e.data for e in events if e.type == "agent.started")
    assert "command" not in started and started["command_bytes"] > 0
    assert canary not in json.dumps([e.data for e in events])
    assert not state_bytes_contain(runtime.settings.state_dir, canary.encode())
    assert await runtime.take_or_unseal_zdr_output(row) == f"say {canary}"
    assert await runtime.take_or_unseal_zdr_output(row) is None  # read once
