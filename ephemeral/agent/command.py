"""An agent run's agent step: the run's own program (``agent:``) in place of our loop.

The command runs once, with ``sh -c``, as the image's unprivileged user in the scratch
directory (or the image's ``workdir``), under what is left of the run's time (less verify's
slice) and compute budget. It gets

- the prompt as a file, ``$EPHEMERAL_PROMPT_FILE`` (:data:`PROMPT_FILE`), and as
  ``$EPHEMERAL_PROMPT`` when it fits one environment variable (:data:`ENV_PROMPT_MAX_BYTES`);
- ``$EPHEMERAL_MODEL``, the run's model, which the model gateway grants it beside ``models``;
- the gateway's variables (``OPENAI_BASE_URL``, ``OPENAI_API_BASE``, ``ANTHROPIC_BASE_URL``,
  placeholder keys) and the egress proxy's, from :func:`ephemeral.broker.attach.start_egress`.

While it runs, its model calls are the gateway's ``model.called`` events, charged to the run.
It is stopped as soon as the run must end: a cancel, the gateway or the proxy stopping the run
(the budget spent), or the time limit. At the time limit every process of the sandbox's user is
killed and verify still runs; on any other stop the run does not wait for the guest (it answers
one request at a time, and the agent's command is that request until its deadline): the
command's call is abandoned and teardown destroys the sandbox, with every process in it, at once.
Its answer is the file ``output`` names (read as the worker, at most :data:`ANSWER_CAP` bytes,
UTF-8), or else its stdout (at most :data:`AGENT_OUTPUT_CAP` bytes). ``agent.started`` and
``agent.exited`` frame it on the timeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
from typing import TYPE_CHECKING, Any, Final, Protocol

from ephemeral import errors
from ephemeral.lifecycle import StopRun
from ephemeral.lifecycle import TerminationReason as Reason
from ephemeral.models import NO_MODEL

if TYPE_CHECKING:
    from ephemeral.engine.exits import Exit
    from ephemeral.policy import Policy
    from ephemeral.sandbox.base import ExecResult, Sandbox
    from ephemeral.store import RunRow

log = logging.getLogger("ephemeral.run")

PROMPT_FILE: Final = "/tmp/ephemeral-agent/prompt.md"
# One environment string may be at most 128 KiB (Linux's MAX_ARG_STRLEN); the file always works.
ENV_PROMPT_MAX_BYTES: Final = 64 * 1024
AGENT_OUTPUT_CAP: Final = 256 * 1024  # bytes of the command's stdout (and of its stderr) kept
ANSWER_CAP: Final = 256 * 1024  # bytes of the `output` file read
STDERR_TAIL_CHARS: Final = 4_000  # of stderr, in agent.exited
WATCH_SECONDS: Final = 0.2  # how often a running agent is checked against cancel and budget
KILL_WAIT_SECONDS: Final = 10.0


class CommandRun(Protocol):
    """What the agent command step needs of its run: ``ephemeral.agent.loop.AgentRun`` is one
    (it imports this module, so this names it only structurally)."""

    row: RunRow
    policy: Policy
    model: str
    image: str
    workdir: str | None
    sandbox: Sandbox | None
    output: str | None

    @property
    def run_id(self) -> str: ...

    @property
    def stopped_by(self) -> Exit: ...

    def exec_env(self) -> dict[str, str]: ...

    async def emit(self, type_: str, data: dict[str, Any]) -> None: ...

    def _check_time(self) -> float: ...

    def _check_egress(self) -> None: ...

    async def _maybe_warn(self) -> None: ...


def environment(run: CommandRun) -> dict[str, str]:
    """The agent command's variables: the image's, the proxy's and gateway's, the prompt's."""
    prompt = run.row.prompt or ""
    named = "" if run.model == NO_MODEL else run.model  # a run naming none gets no model
    env = {**run.exec_env(), "EPHEMERAL_PROMPT_FILE": PROMPT_FILE, "EPHEMERAL_MODEL": named}
    if len(prompt.encode()) <= ENV_PROMPT_MAX_BYTES:
        env["EPHEMERAL_PROMPT"] = prompt
    agent = run.policy.agent
    if agent is not None and agent.output is not None:
        env["EPHEMERAL_OUTPUT"] = agent.output
    return env


async def agent_step(run: CommandRun) -> None:
    """Run the agent command to its exit (or kill it when the run must end) and take its
    answer into ``run.output``. Raises StopRun when the run ends other than ``completed``."""
    spec = run.policy.agent
    sandbox = run.sandbox
    assert spec is not None and sandbox is not None
    left = run._check_time()
    try:
        await sandbox.put_file(PROMPT_FILE, (run.row.prompt or "").encode(), 0o600)
    except errors.SandboxError as exc:
        why = f"the prompt file was not written: {exc.detail}"
        raise StopRun(Reason.SANDBOX_ERROR, why) from exc
    await run.emit(
        "agent.started",
        {
            "command": spec.command,
            "image": run.image,
            "models": list(run.policy.models),
            "prompt_file": PROMPT_FILE,
        },
    )
    task = asyncio.create_task(
        sandbox.exec(
            spec.command,
            timeout=max(0.1, left),
            max_output=AGENT_OUTPUT_CAP,
            env=environment(run),
            cwd=run.workdir,
        ),
        name=f"{run.run_id}:agent",
    )
    try:
        stop = await _watch(run, task)
    except asyncio.CancelledError:
        # A cancel or a drain: the agent dies with it (teardown destroys the sandbox next).
        await _kill(sandbox, task, ending=True)
        exited = _exited(None, killed=run.stopped_by.detail or run.stopped_by.reason)
        await asyncio.shield(run.emit("agent.exited", exited))
        raise
    if stop is not None:
        res = await _kill(sandbox, task, ending=stop.reason is not Reason.TIMEOUT)
        await run.emit("agent.exited", _exited(res, killed=stop.detail or stop.reason))
        raise stop
    try:
        res = task.result()
    except errors.SandboxError as exc:
        raise StopRun(Reason.SANDBOX_ERROR, exc.detail) from exc
    answer, problem = await _answer(run, sandbox, res)
    data = _exited(res)
    data["output_bytes"] = len(answer.encode()) if answer is not None else None
    if problem is not None:
        data["output_error"] = problem
    await run.emit("agent.exited", data)
    run.output = answer
    await run._maybe_warn()
    run._check_egress()  # its last call spent the budget
    if res.timed_out:
        run._check_time()  # the run's deadline (or the compute budget) is what stopped it
        raise StopRun(Reason.TIMEOUT, f"time limit of {run.policy.timeout_seconds} s reached")


async def _watch(run: CommandRun, task: asyncio.Task[ExecResult]) -> StopRun | None:
    """Wait for the agent's exit; the reason the run must end first, if one comes."""
    while not task.done():
        await asyncio.wait({task}, timeout=WATCH_SECONDS)
        if task.done():
            return None
        try:
            run._check_time()  # cancelled, the egress stopped (budget), out of time
        except StopRun as stop:
            return stop
    return None


async def _kill(
    sandbox: Sandbox, task: asyncio.Task[ExecResult], *, ending: bool
) -> ExecResult | None:
    """Stop the agent; the exec's result if it returned.

    ``ending``: nothing runs in this sandbox again (teardown is next). The guest serves one
    request at a time, so a ``kill_all`` would queue behind the agent's exec until that exec's
    own deadline (minutes, for a budget stop): the exec is abandoned instead and the sandbox's
    destruction kills what it ran. Otherwise (the time limit: verify runs next) the exec is at
    its deadline already, and every process of the sandbox's user is killed once it returns."""
    if ending and not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return None
    kill_all = getattr(sandbox, "kill_all", None)
    if kill_all is not None:
        try:
            await kill_all()
        except errors.SandboxError as exc:
            log.warning("kill_all of an agent failed: %s (teardown destroys the sandbox)", exc)
    with contextlib.suppress(BaseException):
        return await asyncio.wait_for(asyncio.shield(task), KILL_WAIT_SECONDS)
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    return None


def _exited(res: ExecResult | None, *, killed: str | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "exit_code": None if res is None or res.timed_out or killed else res.exit_code,
        "duration_ms": res.duration_ms if res is not None else None,
        "stderr": _tail(res.stderr) if res is not None else "",
        "stdout_bytes": len(res.stdout.encode()) if res is not None else 0,
        "truncated": res.truncated if res is not None else False,
        "timed_out": res.timed_out if res is not None else False,
    }
    if killed is not None:
        data["killed"] = killed[:300]
    return data


def _tail(text: str) -> str:
    return text if len(text) <= STDERR_TAIL_CHARS else "…" + text[-STDERR_TAIL_CHARS:]


async def _answer(
    run: CommandRun, sandbox: Sandbox, res: ExecResult
) -> tuple[str | None, str | None]:
    """The agent's final answer and, when there is none, why."""
    spec = run.policy.agent
    assert spec is not None
    if spec.output is None:
        return res.stdout.replace("\x00", ""), None
    base = posixpath.join(sandbox.workdir, run.workdir or "")
    path = posixpath.normpath(posixpath.join(base, spec.output))
    try:
        # As the worker: the agent may not have the host read a file it could not read itself.
        data = await sandbox.get_file(path, max_bytes=ANSWER_CAP, user="worker")
    except errors.FileNotFound:
        return None, "the output file was not written"
    except errors.PayloadTooLarge:
        return None, f"the output file is larger than {ANSWER_CAP} bytes"
    except (errors.FilePermissionDenied, errors.IsADirectory) as exc:
        return None, f"the output file cannot be read: {type(exc).__name__}"
    except errors.SandboxError as exc:
        raise StopRun(Reason.SANDBOX_ERROR, exc.detail) from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, "the output file is not UTF-8 text"
    return text.replace("\x00", ""), None
