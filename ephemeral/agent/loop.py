"""One run's agent loop, without Prefect: provision → (model step, tool steps)* → teardown → settle.

An agent run (``policy.agent``) has one agent step instead of the turns: its own program in the
sandbox (``ephemeral.agent.command``), calling its model through the gateway.

Each step is a coroutine method of :class:`AgentRun`. :func:`drive` sequences them; it is the
only place that knows the order, and it takes the step callables as a parameter so that the
Prefect flow (``flows/agent_run.py``) wraps each step in a task while tests and
``EPHEMERAL_EXECUTOR=plain`` call the same methods directly.

Deadlines are ours, not Prefect's: every model call and shell command gets the smaller of its
own cap, the run's wall-clock deadline and the moment compute would exhaust the budget.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ephemeral import errors
from ephemeral.agent.retry import call_with_retries
from ephemeral.engine import exits
from ephemeral.engine import verify as verify_env
from ephemeral.engine.close import close
from ephemeral.engine.exits import Exit
from ephemeral.engine.run import Run
from ephemeral.ids import utcnow
from ephemeral.lifecycle import RunStatus, StopRun, compute_charge
from ephemeral.lifecycle import TerminationReason as Reason
from ephemeral.providers.base import Message, ModelReply, ToolCall, ToolSpec, Usage

if TYPE_CHECKING:
    from ephemeral.providers.base import Provider
    from ephemeral.sandbox.base import Limits, Sandbox
    from ephemeral.settings import Settings
    from ephemeral.store import RunRow

# StopRun: from ephemeral.lifecycle
__all__ = ["PLAIN_STEPS", "AgentRun", "Steps", "StopRun", "drive", "take_turn"]
log = logging.getLogger("ephemeral.run")

MAX_TOKENS = 2048
MIN_USEFUL_TOKENS = 64
MAX_COMMAND_CHARS = 16_384
STEP_OUTPUT_CAP = 64 * 1024  # bytes of stdout/stderr kept per shell step
VERIFY_OUTPUT_CAP = 16 * 1024  # bytes of stdout/stderr kept per setup or verify command
TOOL_RESULT_CHARS = 16_000  # what goes back to the model per tool result
SHELL_TOOL = ToolSpec(
    name="shell",
    description=(
        "Run a shell command (sh -c) inside the run's sealed sandbox as user `worker`, in the "
        "scratch directory. Returns exit code, stdout and stderr."
    ),
    parameters={
        "type": "object",
        "properties": {"command": {"type": "string", "description": "The command to run."}},
        "required": ["command"],
        "additionalProperties": False,
    },
)


@dataclass(kw_only=True)
class AgentRun(Run):
    """A run our agent loop drives (``ephemeral.engine.run.Run`` holds what every run has), built by
    the engine from the stored run row."""

    model: str
    provider: Provider
    provider_model: str
    acquire_sandbox: Callable[[str, Limits], Awaitable[Sandbox]]
    max_turns: int = 20
    isolation: str = "auto"
    image: str = "default"
    # From the image definition: every command of the run (setup, the agent's, verify) runs
    # with this environment, in this directory (relative to scratch; None: scratch itself).
    command_env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    verify_results: list[dict[str, Any]] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)  # recorded model turns
    usage: Usage = field(default_factory=Usage)
    model_calls: int = 0
    output: str | None = None
    exit: Exit | None = None  # how the run ends (ephemeral.engine.exits), once the loop knows
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    stopping: Exit | None = None  # the exit a stop from outside gave it (Engine.end)
    compute: tuple[int, int] | None = None  # (micros, lifetime_ms) of its sandbox, at teardown
    settings: Settings | None = None  # where its record goes (None: the caller records it)

    @property
    def stopped_by(self) -> Exit:
        """The exit a stop from outside ends the run with: the one it was given (a drain, the
        watchdog), else a client's cancel."""
        return self.stopping or exits.cancelled()

    def stop_with(self, exit: Exit) -> None:
        """End the run by ``exit`` from outside: the loop takes it at its next step, or at
        once when its task is cancelled (``Engine.end``)."""
        self.stopping = exit
        self.cancelled.set()

    def _check_egress(self) -> None:
        """A stop the egress proxy hit (budget out, broker failure) ends the run here."""
        stop = self.stop()
        if stop is not None:
            raise stop

    async def _start_egress(self, sandbox: Sandbox) -> None:
        try:
            await self.start_egress(sandbox)
        except errors.SandboxError as exc:
            raise StopRun(Reason.SANDBOX_ERROR, f"egress did not start: {exc.detail}") from exc

    def _check_time(self) -> float:
        if self.cancelled.is_set():
            raise self.stopped_by.stop()
        self._check_egress()
        left = self.time_left()
        if left <= 0:
            compute = self.budget.compute_deadline()
            if compute is not None and compute < self.work_deadline:
                raise StopRun(Reason.BUDGET_EXHAUSTED, "compute used up the remaining budget")
            reserved = self.policy.verify_reserve_seconds()
            kept = f" ({reserved} s of it kept for verify)" if reserved else ""
            raise StopRun(
                Reason.TIMEOUT, f"time limit of {self.policy.timeout_seconds} s reached{kept}"
            )
        return left

    # steps -------------------------------------------------------------------------------
    async def provision(self) -> None:
        # The sandbox (warm or cold) is attached only now, when the run can act: the runtime
        # granted its slot (``started_at``) before, and nothing was billed while it queued.
        started_at = self.row.started_at
        if started_at is None:  # executed without the runtime's slot grant
            started_at = utcnow()
            await self.store.runs.transition(
                self.run_id,
                expect={RunStatus.QUEUED},
                to=RunStatus.PROVISIONING,
                started_at=started_at,
            )
        t0 = self.clock.monotonic()
        sandbox = await asyncio.wait_for(
            self.acquire_sandbox(self.run_id, self.limits),
            timeout=max(1.0, self.time_left()),
        )
        self.attach(sandbox)
        await self.running(
            sandbox,
            # What this run waited for, not the sandbox's original boot (a pooled one is instant).
            boot_ms=int((self.clock.monotonic() - t0) * 1000),
            queue_wait_ms=_ms(self.row.created_at, started_at),
            expect={RunStatus.PROVISIONING},
        )
        await self.put_files(sandbox)
        await self._start_egress(sandbox)
        await self.emit("worker.started", self.started())
        self.messages = [
            Message(role="system", content=self._system_prompt()),
            Message(role="user", content=self.row.prompt or ""),
        ]

    def _system_prompt(self) -> str:
        tools = (
            "a `shell` tool that runs commands in a sealed sandbox"
            if self.policy.shell
            else ("no tools")
        )
        hosted = [f"`{t.name}`" for t in self.tools() if t is not SHELL_TOOL]
        if hosted:  # the broker's tools run on the host: the sandbox itself has no network
            shell = f"{tools} and " if self.policy.shell else ""
            tools = f"{shell}{', '.join(hosted)} (run by the host; the sandbox has no network)"
        egress = ""
        if self.egress_env:
            egress = (
                " Commands in the sandbox reach the outside only through the host's HTTP proxy "
                "(http_proxy/https_proxy are set; curl, pip and git use them)"
            )
            allow = self.policy.web_allow
            if allow:
                egress += f", for these hosts only: {', '.join(allow)}"
            elif not self.policy.web_on:
                egress += ", for the connections below only"
            egress += "."
            if self.policy.connections:
                names = ", ".join(
                    f"{c.name} ({'/'.join(c.methods)} {', '.join(c.paths)})"
                    for c in self.policy.connections
                )
                egress += (
                    " Your code calls a connection as plain HTTP at "
                    "http://NAME.connections.internal/PATH (the host adds the credentials and "
                    f"the TLS; never send any yourself). Connections: {names}."
                )
        return (
            "You are an agent working inside a disposable sandbox. You have "
            f"{tools}. Web access is {'on' if self.policy.web_on else 'off'}.{egress} "
            f"Your budget is {self.budget.reserved_micros} micro-dollars and your time limit is "
            f"{self.policy.timeout_seconds} seconds; both are hard caps. "
            "Answer in Markdown when done."
        )

    def tools(self) -> list[ToolSpec]:
        specs = [SHELL_TOOL] if self.policy.shell else []
        return specs + (self.broker.tools(self.policy) if self.broker else [])

    async def model_step(self) -> ModelReply | None:
        """One model call. Returns the reply, or None when the loop is over (final answer)."""
        if self.model_calls >= self.max_turns:
            raise StopRun(
                Reason.MODEL_ERROR, f"no final answer within max_turns ({self.max_turns})"
            )
        left = self._check_time()
        from ephemeral.money.pricing import estimate_tokens

        est_in = estimate_tokens(self.messages, self.tools())
        price = self.price_book.model_price(self.model)
        room = self.budget.remaining() - self.price_book.worst_case(self.model, est_in, 0)
        max_tokens = MAX_TOKENS
        if price.output_per_mtok > 0:
            max_tokens = min(MAX_TOKENS, room * 1_000_000 // price.output_per_mtok)
        if max_tokens < MIN_USEFUL_TOKENS:
            raise StopRun(Reason.BUDGET_EXHAUSTED, "the next model call does not fit the budget")
        worst = self.price_book.worst_case(self.model, est_in, max_tokens)
        if not self.budget.fits(worst):
            raise StopRun(Reason.BUDGET_EXHAUSTED, "the next model call does not fit the budget")
        # The budget note changes every turn, so the model always sees what is left.
        note = Message(
            role="user",
            content=f"[budget left: {self.budget.remaining()} micro-dollars; "
            f"time left: {int(left)} s]",
        )
        t0 = time.monotonic()
        try:
            reply = await call_with_retries(
                lambda timeout: self.provider.complete(
                    model=self.provider_model,
                    messages=[*self.messages, note] if self.model_calls else self.messages,
                    tools=self.tools(),
                    max_tokens=int(max_tokens),
                    timeout=timeout,
                ),
                deadline=lambda: self.time_left(),
                cancelled=self.cancelled,
            )
        except errors.ModelError as exc:
            raise StopRun(Reason.MODEL_ERROR, exc.detail) from exc
        cost = self.price_book.model_cost(self.model, reply.usage)
        # Never charge past the reservation, even if a provider over-reports usage.
        cost = min(cost, self.budget.remaining())
        self.budget.charged["model_micros"] += cost
        await self.store.money.charge(
            self.run_id, "model", cost, key=f"{self.run_id}:model:{self.model_calls}"
        )
        self.model_calls += 1
        self.usage = Usage(
            input_tokens=self.usage.input_tokens + reply.usage.input_tokens,
            output_tokens=self.usage.output_tokens + reply.usage.output_tokens,
            cached_input_tokens=self.usage.cached_input_tokens + reply.usage.cached_input_tokens,
        )
        latency = reply.latency_ms or int((time.monotonic() - t0) * 1000)
        self.turns.append(
            {
                "message": reply.message.model_dump(),
                "usage": reply.usage.model_dump(),
                "latency_ms": latency,
            }
        )
        await self.emit(
            "model.called",
            {
                "model": self.model,
                "input_tokens": reply.usage.input_tokens,
                "output_tokens": reply.usage.output_tokens,
                "cost_micros": cost,
                "latency_ms": latency,
            },
        )
        await self._maybe_warn()
        self.messages.append(reply.message)
        if not reply.message.tool_calls:
            self.output = reply.message.content or ""
            return None
        return reply

    async def agent_step(self) -> None:
        """An agent run's one step: its own program in place of our loop's turns
        (``ephemeral.agent.command``)."""
        from ephemeral.agent.command import agent_step

        await agent_step(self)

    async def tool_step(self, call: ToolCall) -> None:
        """Run one tool call the model asked for; anything not granted answers a tool error."""
        self._check_time()
        if call.name == "shell" and self.policy.shell:
            result = await self._shell(call)
        elif self.broker is not None and self.broker.handles(call.name):
            result = await self.broker.handle(call, ctx=self)
            await self._maybe_warn()
        else:
            result = f"error: tool `{call.name}` is not available in this run (not granted)"
        self.messages.append(Message(role="tool", tool_call_id=call.id, content=result))

    async def _shell(self, call: ToolCall) -> str:
        command = call.arguments.get("command")
        if not isinstance(command, str) or not command.strip():
            return "error: the shell tool takes one string argument `command`"
        if len(command) > MAX_COMMAND_CHARS:
            return f"error: command longer than {MAX_COMMAND_CHARS} characters"
        assert self.sandbox is not None
        timeout = max(0.1, min(float(self.policy.timeout_seconds), self.time_left()))
        try:
            res = await self.sandbox.exec(
                command,
                timeout=timeout,
                max_output=STEP_OUTPUT_CAP,
                env=self.exec_env() or None,
                cwd=self.workdir,
            )
        except errors.SandboxError as exc:
            raise StopRun(Reason.SANDBOX_ERROR, exc.detail) from exc
        await self.emit(
            "shell.executed",
            {
                "command": command,
                "exit_code": res.exit_code,
                "stdout": res.stdout,
                "stderr": res.stderr,
                "duration_ms": res.duration_ms,
                "truncated": res.truncated,
            },
        )
        await self._maybe_warn()
        self._check_egress()
        if res.timed_out:
            self._check_time()  # the run's own deadline may be what stopped it
        text = f"exit_code: {res.exit_code}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
        if res.timed_out:
            text += "\n(the command was killed at its deadline)"
        if len(text) > TOOL_RESULT_CHARS:
            text = text[:TOOL_RESULT_CHARS] + "\n…(truncated)"
        return text

    async def setup(self) -> None:
        """The request's setup commands, before the first model call; the model never sees
        their output. The first that fails (non-zero, or killed at the deadline) ends the run
        ``setup_failed``. They share the agent's time and compute budget."""
        assert self.sandbox is not None
        if self.workdir:
            await self._exec_recorded(
                "setup.executed",
                f"mkdir -p -- '{self.workdir}'",
                self.time_left(),
                in_workdir=False,
            )
        for i, command in enumerate(self.policy.setup):
            left = self._check_time()
            res = await self._exec_recorded("setup.executed", command, left)
            if res["exit_code"] != 0:
                why = (
                    "was killed at its deadline"
                    if res["timed_out"]
                    else (f"exited {res['exit_code']}")
                )
                tail = "" if self.zdr else f": {_tail(res['stderr'] or res['stdout'])}"
                raise StopRun(Reason.SETUP_FAILED, f"setup[{i}] {why}{tail}")

    async def verify(self) -> None:
        """The request's verify commands after the agent's final answer (or its time ran out).

        Every process the agent left is killed first, so the grader sees the files, not a
        still-running agent; then verify gets a fresh home, the run's verify files and an
        environment the agent could not shape (``ephemeral.engine.verify``). Each command gets what
        is left of the run's whole time limit (the slice kept for verify) and of the compute
        budget; results are ``verify.executed`` events and ``verify_results``, for the checks
        and the records.
        """
        if self.sandbox is None or not self.policy.verify:
            return
        # A sandbox without kill_all (the fake) runs no agent process to stop or reset after.
        kill_all = getattr(self.sandbox, "kill_all", None)
        survivors: str | None = None
        if kill_all is not None:
            try:
                await kill_all()
            except errors.SandboxError as exc:
                log.warning("run %s: kill_all before verify failed: %s", self.run_id, exc)
                survivors = "the agent's processes could not be stopped"
        if survivors is None and self.budget.seconds_left(self.deadline) > 0:
            try:
                if kill_all is not None:
                    await verify_env.reset(self.sandbox, self.budget.seconds_left(self.deadline))
                for f in self.policy.verify_files:
                    await self.sandbox.put_file(f"{verify_env.VERIFY_DIR}/{f.path}", f.data())
            except errors.SandboxError as exc:
                raise StopRun(Reason.SANDBOX_ERROR, exc.detail) from exc
        env = verify_env.environment(self.command_env, self.egress_env)
        for command in self.policy.verify:
            left = self.budget.seconds_left(self.deadline)
            if survivors is not None or left <= 0 or self.cancelled.is_set():
                why = survivors or (
                    "cancelled" if self.cancelled.is_set() else "no time or budget left"
                )
                result = {
                    "command": command,
                    "exit_code": None,
                    "stdout": "",
                    "stderr": "",
                    "duration_ms": 0,
                    "truncated": False,
                    "timed_out": False,
                    "skipped": why,
                }
                self.verify_results.append(result)
                await self.emit("verify.executed", result)
                continue
            res = await self._exec_recorded("verify.executed", command, left, env=env)
            self.verify_results.append(res)

    def exec_env(self) -> dict[str, str]:
        """The environment of every command run for the agent: the image's, then the egress
        proxy's. Setup and verify get the proxy too: they run under the same grant."""
        return {**self.command_env, **self.egress_env}

    async def _exec_recorded(
        self,
        event: str,
        command: str,
        timeout: float,
        *,
        in_workdir: bool = True,
        env: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        assert self.sandbox is not None
        try:
            res = await self.sandbox.exec(
                command,
                timeout=max(0.1, timeout),
                max_output=VERIFY_OUTPUT_CAP,
                env=(self.exec_env() if env is None else env) or None,
                cwd=self.workdir if in_workdir else None,
            )
        except errors.SandboxError as exc:
            raise StopRun(Reason.SANDBOX_ERROR, exc.detail) from exc
        data: dict[str, Any] = {
            "command": command,
            "exit_code": None if res.timed_out else res.exit_code,
            "stdout": res.stdout,
            "stderr": res.stderr,
            "duration_ms": res.duration_ms,
            "truncated": res.truncated,
            "timed_out": res.timed_out,
        }
        await self.emit(event, data)
        return data

    async def _maybe_warn(self) -> None:
        if self.budget.should_warn():
            await self.emit(
                "budget.warning",
                {
                    "spent_micros": self.budget.spent(),
                    "remaining_micros": self.budget.remaining(),
                },
            )

    async def teardown(self) -> None:
        """Destroy the sandbox (idempotent) and charge its compute, capped at the reservation."""
        if self.sandbox is None:
            return
        sandbox, self.sandbox = self.sandbox, None
        try:
            await self.release(sandbox)
        finally:
            compute = compute_charge(
                micros_per_second=self.budget.compute_micros_per_second,
                seconds=self.budget.sandbox_seconds(),
                reserved_micros=self.budget.reserved_micros,
                other_spent_micros=self.budget.non_compute_spent(),
            )
            self.budget.charged["compute_micros"] = compute
            # Charged by the close, with sandbox.destroyed, in the one transaction that ends
            # the run (a crash before it: recovery charges the same from the events).
            self.compute = (compute, int(self.budget.sandbox_seconds() * 1000))

    async def settle(self) -> RunRow:
        """End the run: the one close (:func:`ephemeral.engine.close.close`), then its record."""
        # Every charge still landing (a model call through the gateway settling) first: the
        # close's transcript and settlement count it.
        await self.web.flush()
        await self.deliver_output(self.output)
        return await close(
            self.store,
            self.settings,
            self.run_id,
            self.exit or Exit(Reason.INFRA_ERROR),
            usage=self._usage(),
            output=self.output,
            keep_output=not self.zdr,
            compute=self.compute,
            transcript=None if self.zdr else self._transcript(),
        )

    def _usage(self) -> dict[str, int]:
        """Our loop's model calls and those the sandbox's code made through the gateway."""
        calls, tokens_in, tokens_out = self.gateway_usage() or (0, 0, 0)
        return {
            "model_calls": self.model_calls + calls,
            "input_tokens": self.usage.input_tokens + tokens_in,
            "output_tokens": self.usage.output_tokens + tokens_out,
        }

    def _transcript(self) -> list[dict[str, Any]]:
        # A run whose model calls were its sandbox code's (the gateway) records those.
        gateway = self.egress.gateway if self.egress is not None else None
        return self.turns or (list(gateway.turns) if gateway is not None else [])


def _tail(text: str, limit: int = 300) -> str:
    text = text.strip().replace("\n", " | ")
    return text if len(text) <= limit else "…" + text[-limit:]


def _ms(a: datetime, b: datetime) -> int:
    """Milliseconds from ``a`` to ``b`` (naive times, as SQLite returns them, are UTC)."""
    a, b = (t if t.tzinfo is not None else t.replace(tzinfo=UTC) for t in (a, b))
    return max(0, int((b - a).total_seconds() * 1000))


@dataclass
class Steps:
    """The step callables :func:`drive` sequences, in its order: provision, setup, (turn or
    model_step + tool_step)* or, for an agent run (``policy.agent``), agent, then verify,
    teardown, settle. Prefect tasks or the plain methods (the default of each)."""

    provision: Callable[[AgentRun], Awaitable[None]] = AgentRun.provision
    # Setup and verify are looked up on the run when called (a test may patch the method).
    setup: Callable[[AgentRun], Awaitable[None]] = lambda run: run.setup()
    model_step: Callable[[AgentRun], Awaitable[ModelReply | None]] = AgentRun.model_step
    tool_step: Callable[[AgentRun, ToolCall], Awaitable[None]] = AgentRun.tool_step
    agent: Callable[[AgentRun], Awaitable[None]] = AgentRun.agent_step
    verify: Callable[[AgentRun], Awaitable[None]] = lambda run: run.verify()
    teardown: Callable[[AgentRun], Awaitable[None]] = AgentRun.teardown
    settle: Callable[[AgentRun], Awaitable[RunRow]] = AgentRun.settle
    # A whole turn (the model call and the tool calls it asked for) as one step: Prefect makes
    # one task of it instead of one per call. None: :func:`take_turn` over the two above.
    turn: Callable[[AgentRun], Awaitable[bool]] | None = None


PLAIN_STEPS = Steps()


async def take_turn(run: AgentRun, steps: Steps = PLAIN_STEPS) -> bool:
    """One model call and the tool calls it asked for; False once the model gave its answer."""
    reply = await steps.model_step(run)
    if reply is None:
        return False
    for call in reply.message.tool_calls:
        await steps.tool_step(run, call)
    return True


async def drive(run: AgentRun, steps: Steps = PLAIN_STEPS) -> RunRow:
    """Run the whole loop. The sandbox is destroyed and the money settled whatever happens."""
    try:
        async with asyncio.timeout(max(0.0, run.work_deadline - run.clock.monotonic()) + 5.0):
            await steps.provision(run)
            await steps.setup(run)
            if run.policy.agent is not None:
                await steps.agent(run)
            else:
                while await (steps.turn(run) if steps.turn else take_turn(run, steps)):
                    pass
        run.exit = exits.succeeded()
    except asyncio.CancelledError:
        run.exit = run.stopped_by
        await asyncio.shield(_finish(run, steps))
        raise
    except Exception as exc:
        run.exit = exits.raised(exc)
        if run.exit.reason is Reason.INFRA_ERROR:
            log.exception("run %s failed", run.run_id)
        if run.output is None and run.messages and run.messages[-1].role == "assistant":
            run.output = run.messages[-1].content
    if run.exit.reason in (Reason.COMPLETED, Reason.TIMEOUT):
        # An agent that used all its time is still graded: verify has its own slice.
        try:
            async with asyncio.timeout(max(0.0, run.deadline - run.clock.monotonic()) + 5.0):
                await steps.verify(run)
        except StopRun as exc:
            run.exit = Exit(exc.reason, exc.detail)
        except TimeoutError:
            log.warning("run %s: verify outlived the run's time limit", run.run_id)
        except asyncio.CancelledError:
            # Whoever stopped it (a client, a drain, the watchdog), the detail says the agent
            # had finished and its grading was cut short.
            stop = run.stopping or exits.cancelled()
            run.exit = Exit(stop.reason, f"{stop.detail or stop.reason} (during verify)")
            await asyncio.shield(_finish(run, steps))
            raise
        except Exception:  # a broken grader must not leave the run open
            log.exception("run %s: verify failed", run.run_id)
            run.exit = exits.crashed("verify failed: internal error")
    return await asyncio.shield(_finish(run, steps))


async def _finish(run: AgentRun, steps: Steps) -> RunRow:
    """Teardown, then settle. ``drive`` awaits it shielded: both must finish even if the caller
    is being cancelled. If a step's wrapper fails (a Prefect API error around the task, not the
    step itself), the plain method still runs: both are idempotent, and neither may be skipped."""
    try:
        await steps.teardown(run)
    except Exception as exc:  # noqa: BLE001 - the sandbox must go whatever failed
        log.warning("run %s: teardown step failed (%s); tearing down directly", run.run_id, exc)
        await run.teardown()
    try:
        return await steps.settle(run)
    except Exception as exc:  # noqa: BLE001 - the money must settle whatever failed
        log.warning("run %s: settle step failed (%s); settling directly", run.run_id, exc)
        return await run.settle()
