"""How a run (or a sandbox session) ends: its exits, each a named transition to the one close.

In the manner of Prefect's ``FlowRunEngine.handle_success`` / ``handle_exception`` /
``handle_timeout`` / ``handle_crash``: whatever ends a run names one of these, and the
:class:`Exit` it returns (a termination reason and its detail; the status follows from
``lifecycle.STATUS_FOR_REASON``) is what :func:`ephemeral.engine.close.close` writes::

    exit                 status / reason               taken when
    succeeded()          succeeded / completed         the agent gave its answer; a session's DELETE
    failed(reason, ...)  failed / the reason           setup failed, the sandbox or the model
                                                       failed, a policy was broken
    raised(exc)          what the exception names      a step raised (the agent loop): a StopRun's
                                                       own exit, a sandbox or model error, a
                                                       timeout, else infra_error
    timed_out(detail)    timed_out / timeout           the run's time limit: its own deadline,
                                                       a session's watchdog, the run watchdog
    budget_exhausted()   budget_exhausted              the next step or compute does not fit
    cancelled(detail)    cancelled / cancelled         a client's cancel, a worker's drain, the
                                                       server stopping, Prefect cancelling it
    crashed(why)         failed / infra_error          nothing executes it any more: its process
                                                       or host died, its executor raised, no host
                                                       took it

Three closers take an exit to the close: a run's own agent (``agent.drive``, then
``AgentRun.settle``), the engine for a run no agent of this process drives
(``Engine.end``: it stops a live one first, so the agent closes with the exit it was given),
and a session's manager (``Sessions._end``). The close is a compare-and-set on the run's
status, checked against ``lifecycle.TRANSITIONS``: two exits racing end the run once, with the
first one's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ephemeral import errors
from ephemeral.lifecycle import STATUS_FOR_REASON, RunStatus, StopRun, TerminationReason

BY_REQUEST = "cancelled by request"


@dataclass(frozen=True)
class Exit:
    """A run's way out: why it ended (``reason``) and, for people, how (``detail``)."""

    reason: TerminationReason
    detail: str | None = None

    @property
    def status(self) -> RunStatus:
        return STATUS_FOR_REASON[self.reason]

    def stop(self) -> StopRun:
        """The exception a step raises to take this exit (the agent loop catches it)."""
        return StopRun(self.reason, self.detail)


def succeeded() -> Exit:
    return Exit(TerminationReason.COMPLETED)


def failed(reason: TerminationReason, detail: str | None) -> Exit:
    """The run's own work failed (``setup_failed``, ``sandbox_error``, ``model_error``, ...)."""
    return Exit(TerminationReason(reason), detail)


def timed_out(detail: str) -> Exit:
    return Exit(TerminationReason.TIMEOUT, detail)


def budget_exhausted(detail: str) -> Exit:
    return Exit(TerminationReason.BUDGET_EXHAUSTED, detail)


def cancelled(detail: str = BY_REQUEST) -> Exit:
    """Stopped from outside: by a client's request, or ``detail`` says by whom and why."""
    return Exit(TerminationReason.CANCELLED, detail)


def crashed(why: str | BaseException) -> Exit:
    """Nothing executes the run any more; an exception is one that escaped its executor."""
    if isinstance(why, BaseException):
        why = f"execution failed: {brief_error(why)}"
    return Exit(TerminationReason.INFRA_ERROR, why)


def raised(exc: BaseException) -> Exit:
    """The exit an exception raised by one of the run's steps names."""
    if isinstance(exc, StopRun):
        return Exit(exc.reason, exc.detail or exc.reason)
    if isinstance(exc, errors.IsolationUnavailable | errors.SandboxError):
        return failed(TerminationReason.SANDBOX_ERROR, exc.detail)
    if isinstance(exc, errors.ModelError):
        return failed(TerminationReason.MODEL_ERROR, exc.detail)
    if isinstance(exc, TimeoutError):
        return timed_out("time limit reached")
    return Exit(TerminationReason.INFRA_ERROR, f"{type(exc).__name__}: internal error")


def brief_error(exc: BaseException) -> str:
    """The exception's type and first line, bounded: it lands in the run's termination detail."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__
