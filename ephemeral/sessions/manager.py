"""Sandbox sessions: a sandbox that a client drives, beside runs (which drive themselves).

A session is admitted like a run (same policy fields, same money rules, same idempotency) and
stored in the same table with ``kind = 'session'``, so the ledger, the event log, crash
recovery and the records treat it exactly as a run:

    create   validate → reserve max_cost_micros → run.queued → sandbox (warm pool) →
             sandbox.ready → files → worker.started
    exec     argv or shell string, stdin, env, cwd, user, timeout, output cap → sandbox.exec
    files    put/get as the sandbox's worker (its permissions apply)
    kill_all every process but the guest agent's, between phases (Harbor's verifier start)
    end      destroy → compute charged + sandbox.destroyed → run.<status> → run.settled → record

A watchdog task per session ends it at its time limit (``timeout_seconds`` from its start) or
when compute would pass what its reservation has left, whichever comes first; the sandbox's own
lifetime (time limit + 10 s) is the backstop. A session lives in the process that created it
(in dispatch mode, the worker host that claimed it: ``ephemeral.sessions.placement``): when
that process dies, the next start of a runtime reaps its sandbox and settles it like an orphaned
run (:meth:`ephemeral.engine.runtime.Runtime.recover`), or, on a worker host, any runtime's
lease sweep. What a client sends is ``ephemeral.sessions.requests``; the public session object
is rendered by ``ephemeral.api.sandboxes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ephemeral import errors
from ephemeral.broker.broker import Broker
from ephemeral.clock import SYSTEM, Clock
from ephemeral.engine import exits
from ephemeral.engine.close import close, record
from ephemeral.engine.exits import Exit
from ephemeral.engine.grants import require_grants
from ephemeral.engine.run import Run
from ephemeral.ids import new_run_id, utcnow
from ephemeral.lifecycle import (
    TERMINAL_STATUSES,
    RunKind,
    RunStatus,
    TerminationReason,
    compute_charge,
)
from ephemeral.money.pricing import PriceBook
from ephemeral.policy import MAX_COST_MICROS, Policy
from ephemeral.sandbox import users
from ephemeral.sandbox.base import ExecResult, Limits, Sandbox
from ephemeral.sandbox.pool import boots_at_once
from ephemeral.sandbox.source import SandboxSource
from ephemeral.sessions.requests import MAX_FILE_BYTES, ExecRequest, SessionRequest
from ephemeral.settings import Settings
from ephemeral.store import RunRow, Store

log = logging.getLogger("ephemeral.sessions")

# The model column of a session: it has no model loop (its code may call models through the
# gateway, ephemeral.broker.gateway, whose calls its usage counts).
SESSION_MODEL = "(session)"
INLINE_STDIN = 1 << 20  # larger stdin goes to a file in the sandbox first (stdin_path)
EVENT_TEXT_CAP = 16 << 10  # command, stdout and stderr kept per sandbox.exec event
DEFAULT_EXEC_TIMEOUT = 3600.0  # no timeout: until the session's own deadline
# At the time limit, a command cut at the same deadline gets this long to come back killed
# (``timed_out``) before the sandbox goes: its caller sees a timeout, not a vanished sandbox.
DEADLINE_GRACE_SECONDS = 3.0
# Where root would be host root: namespaces run privileged (EPHEMERAL_NAMESPACES_PRIVILEGED).
NO_ROOT_ISOLATIONS = frozenset({"namespaces-privileged"})


@dataclass(kw_only=True)
class Live(Run):
    """A session running in this process: a run (``ephemeral.engine.run.Run``, the broker's context
    for its egress) that a client drives, with its sandbox from the start."""

    sandbox: Sandbox
    image_env: dict[str, str] = field(default_factory=dict)  # the image's `env` (image.yaml)
    passwd: str | None = None  # the image's /etc/passwd, to resolve exec users as the guest does
    image_user: str | None = None  # a Dockerfile image's USER: exec's default user
    image_cwd: str | None = None  # a Dockerfile image's WORKDIR: exec's default cwd
    execs: int = 0
    watchdog: asyncio.Task[None] | None = None
    ending: asyncio.Lock = field(default_factory=asyncio.Lock)
    inflight: int = 0  # commands running now (their timeouts end by the deadline)
    idle: asyncio.Event = field(default_factory=asyncio.Event)


class Sessions:
    """The sessions of one runtime (``runtime.sessions``); sandboxes come from ``sandboxes``."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        price_book: PriceBook,
        sandboxes: SandboxSource,
        owner: str,
        clock: Clock = SYSTEM,
    ) -> None:
        self.settings = settings
        self.store = store
        self.price_book = price_book
        self.sandboxes = sandboxes
        self.owner = owner
        # a session's time limit, compute deadline and watchdog (its tests move a fake one)
        self.clock = clock
        self._live: dict[str, Live] = {}
        self._starting: set[str] = set()  # admitted, sandbox on its way
        # Creates of one kind of sandbox start in the order they came, as many at once as
        # sandboxes may boot: in a burst the first sessions are admitted, booted and answered
        # first instead of every create advancing a step at a time together (bench/tti.py,
        # docs/deploy.md). Per kind, so slow cold boots of one image never hold back creates
        # that a warm pool of another answers at once.
        self._creates: dict[tuple[str, str | None], asyncio.Semaphore] = {}

    def owns(self, session_id: str) -> bool:
        """True while the session starts or runs in this process (the runtime's watchdog
        leaves it: a cold microVM may take longer than its two sweeps)."""
        return session_id in self._live or session_id in self._starting

    # create --------------------------------------------------------------------------------
    async def create(
        self,
        org_id: str,
        request: SessionRequest,
        *,
        idempotency_key: str | None = None,
        body_hash: str | None = None,
        labels: dict[str, Any] | None = None,
        limits: Limits | None = None,
    ) -> tuple[RunRow, bool]:
        """Admit (reserve the budget) and start the sandbox; returns ``(row, replayed)``.

        ``limits``: the sandbox's cpus, memory, pids and disk (in-process callers such as the
        Harbor environment; the lifetime always follows ``timeout_seconds``), priced as such.

        The row is ``running`` with its sandbox ready, or already settled ``failed`` when the
        sandbox could not start (refunded in full, less the compute of a sandbox that came up
        before the failure).
        """
        policy = request.policy()
        if "max_cost_micros" not in request.model_fields_set:
            policy = policy.model_copy(
                update={"max_cost_micros": self.default_budget(policy.timeout_seconds, limits)}
            )
        labels = {**request.labels, **(labels or {})}  # the caller's own can never be reserved
        async with self._in_turn(policy):
            return await self._create(org_id, policy, idempotency_key, body_hash, labels, limits)

    def default_budget(self, timeout_seconds: int, limits: Limits | None = None) -> int:
        """The budget of a session that names none: its sandbox's compute for the whole time
        limit it asked for (a session is charged by the second), never less than a run's
        default. A fixed default ended a 600 s session ``budget_exhausted`` after ~50 s."""
        rate = self.sandboxes.compute_rate(
            limits or self.sandboxes.limits(timeout_seconds), self.price_book
        )
        run_default = int(Policy.model_fields["max_cost_micros"].default)
        return min(MAX_COST_MICROS, max(run_default, rate * timeout_seconds))

    def _in_turn(self, policy: Policy) -> asyncio.Semaphore:
        kind = (policy.isolation, policy.run_image)
        gate = self._creates.get(kind)
        if gate is None:
            gate = self._creates[kind] = asyncio.Semaphore(boots_at_once())
        return gate

    async def _create(
        self,
        org_id: str,
        policy: Policy,
        idempotency_key: str | None,
        body_hash: str | None,
        labels: dict[str, Any] | None,
        limits: Limits | None,
    ) -> tuple[RunRow, bool]:
        await require_grants(self.store, org_id, policy, self.price_book, self.settings)
        await self.sandboxes.require_isolation(policy.isolation, disk_mib=policy.disk_mib)
        image_hash = await self.sandboxes.require_image(policy)  # a registry image's digest
        row, replayed = await self.store.runs.admit(
            org_id=org_id,
            run_id=new_run_id(),
            model=SESSION_MODEL,
            prompt=None,
            policy=policy.model_dump(mode="json"),
            labels=labels,
            idempotency_key=idempotency_key,
            body_hash=body_hash,
            owner=self.owner,
            kind=RunKind.SESSION,
            image_hash=image_hash,
        )
        if replayed:
            if row.kind != RunKind.SESSION:
                raise errors.InvalidRequest.field(
                    "Idempotency-Key", "was used for a run, not a sandbox session"
                )
            return row, True
        self._starting.add(row.id)
        try:
            return await self._start(row, policy, limits), False
        finally:
            self._starting.discard(row.id)

    async def start_admitted(self, row: RunRow) -> RunRow:
        """Start the sandbox of a session another process admitted and this host claimed
        (``ephemeral.sessions.host``): the path ``create`` takes after admission."""
        self._starting.add(row.id)
        try:
            policy = Policy.model_validate(row.policy)
            async with self._in_turn(policy):
                return await self._start(row, policy)
        finally:
            self._starting.discard(row.id)

    async def _start(self, row: RunRow, policy: Policy, asked: Limits | None = None) -> RunRow:
        # Two store commits in all (admission, then running with its two events): nobody waits
        # on a session's provisioning, the create call itself does. A crash in between leaves
        # it queued with its sandbox handle owned by it: recovery settles it and reaps that.
        started_at = utcnow()
        limits = self.sandboxes.limits(policy.timeout_seconds, policy.disk_mib)
        if asked is not None:
            limits = asked.model_copy(update={"lifetime_seconds": limits.lifetime_seconds})
        sandbox: Sandbox | None = None
        t0 = time.monotonic()
        try:
            await self.sandboxes.ensure_pool()
            sandbox = await self.sandboxes.acquire(policy, row.id, limits, row.image_hash)
            booted = time.monotonic()
            # Its time limit counts from its sandbox: the deadline is set as it attaches.
            live = Live(
                store=self.store,
                row=row,
                policy=policy,
                price_book=self.price_book,
                limits=limits,
                broker=Broker(self.settings),
                clock=self.clock,
                sandbox=sandbox,
            )
            live.attach(sandbox)
            self._live[row.id] = live
            await live.start_egress(sandbox)
            built = await self.sandboxes.admitted_image(sandbox.image, row.image_hash)
            live.image_hash = built.hash if built else None
            live.image_env = dict(built.env) if built else {}
            live.passwd = users.read_passwd(built.rootfs) if built else None
            live.image_user, live.image_cwd = (built.user, built.cwd) if built else (None, None)
            await live.put_files(sandbox)
            running = await live.running(
                sandbox,
                boot_ms=int((booted - t0) * 1000),
                queue_wait_ms=0,
                # provisioning: claimed by a worker host (ephemeral.sessions.host)
                expect={RunStatus.QUEUED, RunStatus.PROVISIONING},
                then=[("worker.started", live.started())],
                started_at=started_at,
            )
            live.watchdog = asyncio.create_task(self._watch(live), name=f"session-{row.id}")
            return running
        except asyncio.CancelledError:
            await asyncio.shield(
                self._end_start(row, sandbox, exits.cancelled("cancelled while starting"))
            )
            raise
        except Exception as exc:  # noqa: BLE001 - a failed start must settle, never stay open
            exit = (
                exits.failed(TerminationReason.SANDBOX_ERROR, exc.detail)
                if isinstance(exc, errors.EphemeralError)
                else exits.crashed(type(exc).__name__)
            )
            log.warning("session %s: start failed: %s", row.id, exit.detail)
            await asyncio.shield(self._end_start(row, sandbox, exit))
        return await self.store.runs.get(row.id)

    async def _end_start(self, row: RunRow, sandbox: Sandbox | None, exit: Exit) -> None:
        """A start that failed takes ``exit``: as a live session once it is one, else its
        sandbox (if one came up) goes and the row closes with nothing used."""
        live = self._live.get(row.id)
        if live is not None:
            await self._end(live, exit)
            return
        if sandbox is not None:
            await sandbox.destroy()
        await close(self.store, self.settings, row.id, exit, usage={}, output=None)

    # lookups -------------------------------------------------------------------------------
    async def get(self, session_id: str, org_id: str | None = None) -> RunRow:
        """The session's row; a run, another org's session or a missing one is NotFound."""
        row = await self.store.runs.get(session_id, org_id)
        if row.kind != RunKind.SESSION:
            raise errors.NotFound(f"sandbox {session_id} not found")
        return row

    async def _live_for(self, session_id: str, org_id: str | None) -> Live:
        live = self._live.get(session_id)
        if live is not None and (org_id is None or live.org_id == org_id):
            if live.time_left() <= 0 or live.stop() is not None:
                await self._end(live, self._limit_exit(live))
            else:
                return live
        row = await self.get(session_id, org_id)  # NotFound for another org's
        if row.status in TERMINAL_STATUSES:
            raise errors.Conflict(
                f"sandbox {session_id} has ended ({row.status}: {row.termination_reason})"
            )
        raise errors.Conflict(f"sandbox {session_id} is served by another process")

    # use -----------------------------------------------------------------------------------
    async def exec(self, session_id: str, org_id: str | None, req: ExecRequest) -> ExecResult:
        """Run one command; a timed-out command is killed (``timed_out``), never an error."""
        live = await self._live_for(session_id, org_id)
        if not live.policy.shell:
            raise errors.InvalidRequest.field("command", "this sandbox's policy has shell: false")
        if req.user is None and live.image_user is not None:
            req = req.model_copy(update={"user": live.image_user})
        if req.cwd is None and live.image_cwd is not None:
            req = req.model_copy(update={"cwd": live.image_cwd})
        self._check_user(live, req.user)
        left = live.time_left()
        timeout = min(req.timeout_seconds or DEFAULT_EXEC_TIMEOUT, max(0.05, left))
        stdin = req.stdin()
        stdin_path = req.stdin_path
        spill: str | None = None
        async with self._busy(live):
            if len(stdin) > INLINE_STDIN:
                spill = f"/tmp/.ephemeral-stdin-{secrets.token_hex(8)}"
                await live.sandbox.put_file(spill, stdin, 0o600, user=req.user or "worker")
                stdin, stdin_path = b"", spill
            res = await live.sandbox.exec(
                req.command,
                stdin=stdin,
                env={**live.image_env, **live.egress_env, **req.env},
                cwd=req.cwd,
                timeout=timeout,
                max_output=req.max_output_bytes,
                user=req.user,
                stdin_path=stdin_path,
            )
            if spill is not None:
                await live.sandbox.exec(["rm", "-f", "--", spill], user=req.user, cwd="/")
        live.execs += 1
        # The row's usage counts each command as it happens: a live session reads as true
        # as a settled one (same transaction as the event).
        await self.store.events.append(
            live.run_id,
            "sandbox.exec",
            {
                "command": _cap(req.display()),
                "user": req.user or "worker",
                "exit_code": res.exit_code,
                "stdout": _cap(res.stdout),
                "stderr": _cap(res.stderr),
                "duration_ms": res.duration_ms,
                "truncated": res.truncated,
                "timed_out": res.timed_out,
            },
            usage=_usage(live),
        )
        if live.stop() is not None:  # egress cut this command's streams: the session ends now
            await self._end(live, self._limit_exit(live))
        return res

    async def kill_all(self, session_id: str, org_id: str | None) -> int:
        """SIGKILL every process of the session's sandbox but its guest agent (whatever its
        session, uid or namespace: root's too), until none is left; how many there were. A
        phase boundary: what ran before (a Harbor agent phase) cannot touch what runs next (its
        verifier). A failure ends the session (``sandbox_error``): nothing must run after it."""
        live = await self._live_for(session_id, org_id)
        kill = getattr(live.sandbox, "kill_all", None)
        if kill is None:  # a sandbox that runs no process of its own (the fake)
            return 0
        async with self._busy(live):
            killed: int = await kill()
        return killed

    @contextlib.asynccontextmanager
    async def _busy(self, live: Live) -> AsyncIterator[None]:
        """A request in the sandbox: counted in flight (the session's end waits for it), and a
        sandbox that fails under it ends the session (``sandbox_error``)."""
        live.inflight += 1
        live.idle.clear()
        try:
            yield
        except errors.SandboxError as exc:
            await self._end(live, exits.failed(TerminationReason.SANDBOX_ERROR, exc.detail))
            raise
        finally:
            live.inflight -= 1
            if not live.inflight:
                live.idle.set()

    def _check_user(self, live: Live, user: str | None) -> None:
        """Users are compared as the ids the guest makes of them ("00" is uid 0); an id
        outside the sandbox's map is refused by the guest, for that request only."""
        if user is None:
            return
        try:
            ids = users.resolve(user, live.passwd or "")
        except ValueError as exc:
            raise errors.InvalidRequest.field("user", str(exc)) from None
        if ids is not None and 0 in ids and live.sandbox.isolation in NO_ROOT_ISOLATIONS:
            raise errors.InvalidRequest.field(
                "user",
                f"{user!r} is uid {ids.uid}, gid {ids.gid}: root is refused on "
                f"{live.sandbox.isolation}: there it would be host root (with the agent's "
                "capabilities); use gvisor, namespaces or a microVM",
            )

    async def write_file(self, session_id: str, org_id: str | None, path: str, data: bytes) -> None:
        """Write as the worker: its permissions apply, missing directories are made."""
        live = await self._live_for(session_id, org_id)
        _check_path(path)
        if len(data) > MAX_FILE_BYTES:
            raise errors.PayloadTooLarge(f"{path}: over the {MAX_FILE_BYTES}-byte file limit")
        try:
            await live.sandbox.put_file(path, data, user="worker")
        except errors.SandboxError as exc:
            await self._end(live, exits.failed(TerminationReason.SANDBOX_ERROR, exc.detail))
            raise

    async def read_file(
        self, session_id: str, org_id: str | None, path: str, max_bytes: int = MAX_FILE_BYTES
    ) -> bytes:
        """Read as the worker; PayloadTooLarge past ``max_bytes`` (at most MAX_FILE_BYTES)."""
        live = await self._live_for(session_id, org_id)
        _check_path(path)
        try:
            return await live.sandbox.get_file(path, min(max_bytes, MAX_FILE_BYTES), user="worker")
        except errors.SandboxError as exc:
            await self._end(live, exits.failed(TerminationReason.SANDBOX_ERROR, exc.detail))
            raise

    # end -----------------------------------------------------------------------------------
    async def end(
        self, session_id: str, org_id: str | None = None, *, cancelled: bool = False
    ) -> RunRow:
        """Destroy the sandbox and settle (idempotent: an ended session is returned as it is).

        ``DELETE`` ends it ``succeeded``/``completed``; a cancel (``POST /v1/runs/{id}/cancel``
        on a session) ``cancelled``."""
        live = self._live.get(session_id)
        if live is not None and (org_id is None or live.org_id == org_id):
            await self._end(live, exits.cancelled() if cancelled else exits.succeeded())
            return await self.store.runs.get(session_id)
        row = await self.get(session_id, org_id)
        if row.status in TERMINAL_STATUSES:
            return row
        raise errors.Conflict(f"sandbox {session_id} is served by another process")

    async def _watch(self, live: Live) -> None:
        while True:
            left = live.time_left()
            if left <= 0 or live.stop() is not None:
                break
            await self.clock.sleep(min(left, 1.0))
        if live.inflight:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(live.idle.wait(), DEADLINE_GRACE_SECONDS)
        await self._end(live, self._limit_exit(live))

    def _limit_exit(self, live: Live) -> Exit:
        """The exit of a session a limit ends: egress stopped it (its budget ran out, or the
        broker failed), else its time limit or, before it, its compute budget."""
        stop = live.stop()
        if stop is not None:
            return Exit(stop.reason, stop.detail)
        if self.clock.monotonic() >= live.deadline:
            return exits.timed_out(f"time limit of {live.policy.timeout_seconds} s reached")
        return exits.budget_exhausted("compute used up the remaining budget")

    async def _end(self, live: Live, exit: Exit) -> None:
        """End a live session by ``exit`` (once: a second exit finds it ended)."""
        async with live.ending:
            if self._live.get(live.run_id) is not live:
                return  # already ended
            try:
                await asyncio.shield(self._close(live, exit))
            finally:
                self._live.pop(live.run_id, None)
                task = live.watchdog
                if task is not None and task is not asyncio.current_task():
                    task.cancel()

    async def _close(self, live: Live, exit: Exit) -> None:
        try:
            await live.release(live.sandbox)
        finally:
            budget = live.budget
            charged = await self.store.money.charged(live.run_id)
            compute = compute_charge(
                micros_per_second=budget.compute_micros_per_second,
                seconds=budget.sandbox_seconds(),
                reserved_micros=budget.reserved_micros,
                other_spent_micros=sum(charged.values()) - charged.get("compute_micros", 0),
            )
            # Settled: no longer served here, also while its records are written (a reader that
            # sees the settled row must not find the session live).
            row = await close(
                self.store,
                None,
                live.run_id,
                exit,
                usage=_usage(live),
                output=None,
                compute=(compute, int(budget.sandbox_seconds() * 1000)),
            )
            self._live.pop(live.run_id, None)
            await record(self.store, self.settings, row)

    async def close(self) -> None:
        """End every live session (the runtime is stopping): ``cancelled``, settled."""
        for live in list(self._live.values()):
            with contextlib.suppress(Exception):
                await self._end(live, exits.cancelled("the server stopped"))


def _usage(live: Live) -> dict[str, int]:
    """A session's usage: its execs, and the model calls its code made through the gateway."""
    calls, tokens_in, tokens_out = live.gateway_usage() or (0, 0, 0)
    return {
        "model_calls": calls,
        "input_tokens": tokens_in,
        "output_tokens": tokens_out,
        "execs": live.execs,
    }


def _cap(text: str) -> str:
    return text if len(text) <= EVENT_TEXT_CAP else text[:EVENT_TEXT_CAP] + "…"


def _check_path(path: str) -> None:
    if not isinstance(path, str) or not 0 < len(path) <= 4096 or "\0" in path:
        raise errors.InvalidRequest.field("path", "must be 1-4096 characters without NUL")
