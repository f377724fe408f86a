"""The exit status of every ``ephemeral`` command, in one place (docs/cli.md lists them).

A script can tell apart what it gave wrong (2), what broke around the work (3) and how the work
itself ended (0, 1, 4-6). The codes for a run's ending are derived from the run statuses of
:mod:`ephemeral.lifecycle`; with several runs (a recipe), the command exits with the highest code.
``ephemeral sandbox exec`` is the exception: it exits with the sandboxed command's own status.
"""

from __future__ import annotations

from enum import IntEnum

from ephemeral import errors
from ephemeral.lifecycle import TERMINAL_STATUSES, RunStatus


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    ERROR = 3
    TIMED_OUT = 4
    BUDGET_EXHAUSTED = 5
    CANCELLED = 6


MEANING: dict[ExitCode, str] = {
    ExitCode.OK: "success: every run succeeded, every check and gate passed",
    ExitCode.FAILED: "the work ran and did not pass: a run ended `failed`, a check of a recipe run "
    "or an eval gate failed, `recipes validate` found a problem",
    ExitCode.USAGE: "bad input (unknown option, invalid value, invalid recipe); "
    "nothing was started",
    ExitCode.ERROR: "the command could not do its work: not found, conflict, no balance, "
    "server or store unreachable, a run that did not finish",
    ExitCode.TIMED_OUT: "a run ended `timed_out`",
    ExitCode.BUDGET_EXHAUSTED: "a run ended `budget_exhausted`, or a recipe run was skipped "
    "for the recipe's budget",
    ExitCode.CANCELLED: "a run ended `cancelled`",
}

FOR_STATUS: dict[RunStatus, ExitCode] = {
    RunStatus.SUCCEEDED: ExitCode.OK,
    RunStatus.FAILED: ExitCode.FAILED,
    RunStatus.TIMED_OUT: ExitCode.TIMED_OUT,
    RunStatus.BUDGET_EXHAUSTED: ExitCode.BUDGET_EXHAUSTED,
    RunStatus.CANCELLED: ExitCode.CANCELLED,
}
if set(FOR_STATUS) != TERMINAL_STATUSES:  # a new terminal status needs its own code
    raise ImportError(f"exit codes cover {sorted(FOR_STATUS)}, not {sorted(TERMINAL_STATUSES)}")


def for_status(status: str) -> ExitCode:
    """The code for how a run ended; a run that is not terminal did not finish (``ERROR``)."""
    if status not in TERMINAL_STATUSES:
        return ExitCode.ERROR
    return FOR_STATUS[RunStatus(status)]


def for_error(exc: errors.EphemeralError) -> ExitCode:
    """Bad input (a model this host cannot serve included) is ``USAGE``; any other error of
    ours is ``ERROR``."""
    bad_input = isinstance(exc, errors.InvalidRequest | errors.UnknownModel)
    return ExitCode.USAGE if bad_input else ExitCode.ERROR
