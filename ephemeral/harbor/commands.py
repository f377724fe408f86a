"""The shell scripts behind Harbor's ``exec``: a command runs detached, and is waited on in slices.

The guest agent serves one request at a time, so a command in flight cannot be interrupted
through the channel, and a host-side cancel of a call in flight would leave its reply on the
channel for the next request. Harbor's phase timeouts cancel ``exec`` from outside
(``asyncio.wait_for``), and the command must die then, not at its own end. So a command runs in
the background of a starter (a session leader: the guest starts every command with
``setsid``), its output going to files; the starter, and then waiters, wait for it in slices
of at most ``WAIT_SLICE_SECONDS`` (never cancelled halfway). A short command ends within the
starter's slice: one guest command, then its output files are read. A cancel, or Harbor's
``timeout_sec``, kills every process of the starter's session (``kill_script``).

Only bash builtins on the common path: the files are made by redirections, the waits are
``read -t`` on a FIFO nobody writes (made once per sandbox with ``mkfifo``), so a command costs
the processes it starts itself plus one subshell. File names carry 128 random bits and are
created before anything else can learn them (``/tmp`` is sticky: nobody else can replace them).
"""

from __future__ import annotations

import base64
import re
import shlex
import time

from ephemeral.sessions.requests import MAX_EXEC_OUTPUT, ExecRequest

HOUSEKEEPING_TIMEOUT = 600.0  # the adapter's own commands (mkdir, upload, wait, kill, fetch)
WAIT_SLICE_SECONDS = 2.0
POLL_SECONDS = 0.02
# An argv element past this goes through stdin instead (Linux caps one at 128 KiB).
INLINE_COMMAND_BYTES = 96 << 10
PREFIX = "/tmp/.ephemeral-exec-"
TICK = "/tmp/.ephemeral-tick"  # a FIFO nobody writes: read -t on it is a sleep without a fork
DONE = "EPHEMERAL-DONE"
WAITING = "EPHEMERAL-WAIT"
_ID = re.compile(r"^[0-9a-f]{32}$")


def _wait_loop(path: str, slice_s: float) -> str:
    """Wait up to ``slice_s`` for ``path.rc`` to fill; print DONE and the status, or WAIT."""
    polls = max(1, int(slice_s / POLL_SECONDS))
    return (
        f"[ -p {TICK} ] || mkfifo -m 666 {TICK} 2>/dev/null || true\n"
        f"exec 9<> {TICK}\n"
        f"i=0; while [ ! -s {path}.rc ] && [ $i -lt {polls} ]; do "
        f"read -r -t {POLL_SECONDS} -u 9 _; i=$((i+1)); done\n"
        f'if [ -s {path}.rc ]; then read -r rc < {path}.rc; echo "{DONE} $rc"; '
        f'else echo "{WAITING}"; fi\n'
    )


def paths(exec_id: str) -> tuple[str, str, str]:
    """The command's stdout, stderr and status files."""
    if not _ID.match(exec_id):
        raise ValueError(f"bad exec id {exec_id!r}")
    p = PREFIX + exec_id
    return f"{p}.out", f"{p}.err", f"{p}.rc"


def start_argv(
    exec_id: str,
    command: str,
    *,
    slice_s: float = WAIT_SLICE_SECONDS,
    cleanup: list[str] | None = None,
) -> tuple[list[str], bytes]:
    """The argv and stdin that start ``command`` (shown in the session's events) and wait a
    slice for it. Prints the session id (the starter's pid), then what the wait loop prints.
    ``cleanup``: ids of finished commands whose files go now (batched: one ``rm`` for many)."""
    paths(exec_id)
    p = shlex.quote(PREFIX + exec_id)
    inline = len(command.encode()) <= INLINE_COMMAND_BYTES and "\0" not in command
    run = 'bash -c "$1"' if inline else f"bash {p}.cmd"
    script = (
        f": > {p}.out; : > {p}.err; : > {p}.rc\n"
        + ("" if inline else f"cat > {p}.cmd\n")
        # the subshell lets go of the starter's pipes: the guest returns when the starter ends
        + f"( {run} > {p}.out 2> {p}.err; echo $? > {p}.rc ) < /dev/null > /dev/null 2>&1 &\n"
        + "echo $$\n"
        + (
            "rm -f -- " + " ".join(f"{shlex.quote(PREFIX + c)}.*" for c in cleanup) + "\n"
            if cleanup
            else ""
        )
        + _wait_loop(p, slice_s)
    )
    if inline:
        return ["bash", "-c", script, "harbor-exec", command], b""
    return ["bash", "-c", script, "harbor-exec"], command.encode()


def slice_until(deadline: float | None) -> float:
    """How long one wait may last so as not to pass ``deadline`` (``time.monotonic``) by more
    than a poll: never cancelled halfway, a wait ends by itself."""
    if deadline is None:
        return WAIT_SLICE_SECONDS
    return max(POLL_SECONDS, min(WAIT_SLICE_SECONDS, deadline - time.monotonic()))


def exec_request(
    command: list[str] | str,
    *,
    user: str,
    cwd: str = "/",
    env: dict[str, str] | None = None,
    stdin: bytes = b"",
    timeout: float = HOUSEKEEPING_TIMEOUT,
) -> ExecRequest:
    """One guest command as the session takes it (its output within the session's cap)."""
    return ExecRequest(
        command=command,
        stdin_base64=base64.b64encode(stdin).decode(),
        env=env or {},
        cwd=cwd,
        user=user,
        timeout_seconds=timeout,
        max_output_bytes=MAX_EXEC_OUTPUT,
    )


def wait_argv(exec_id: str, slice_s: float = WAIT_SLICE_SECONDS) -> list[str]:
    paths(exec_id)
    return ["bash", "-c", _wait_loop(shlex.quote(PREFIX + exec_id), slice_s)]


def parse_started(stdout: str) -> tuple[int, str]:
    """(session id, the rest) from the starter's output, checked: the guest is not trusted."""
    head, _, rest = stdout.partition("\n")
    if not head.isdigit() or not 0 < int(head) < 1 << 22:
        raise ValueError(f"unexpected reply from the exec starter: {stdout[:200]!r}")
    return int(head), rest


def parse_wait(stdout: str) -> int | None:
    """The command's exit status once it ended, else None."""
    head = stdout.strip()
    if head == WAITING:
        return None
    parts = head.split()
    if len(parts) == 2 and parts[0] == DONE and parts[1].isdigit() and int(parts[1]) < 256:
        return int(parts[1])
    raise ValueError(f"unexpected reply from the exec waiter: {head[:200]!r}")


def kill_script(exec_id: str, sid: int) -> str:
    """SIGKILL every process in session ``sid`` (the command and all it started that did not
    leave the session), three rounds for forks racing the scan; then remove its files."""
    paths(exec_id)
    return (
        "for round in 1 2 3; do\n"
        "  for p in /proc/[0-9]*; do\n"
        '    read -r line < "$p/stat" 2>/dev/null || continue\n'
        "    set -f; set -- ${line##*) }; set +f\n"
        f'    [ "${{4-}}" = {int(sid)} ] && kill -KILL "${{p#/proc/}}" 2>/dev/null\n'
        "  done\n"
        "done\n"
        # SIGKILL is asynchronous: return once no live process of the session is left (a
        # zombie is dead), so the caller's next command never sees it (at most ~2 s)
        "for wait in $(seq 40); do\n"
        "  left=0\n"
        "  for p in /proc/[0-9]*; do\n"
        '    read -r line < "$p/stat" 2>/dev/null || continue\n'
        "    set -f; set -- ${line##*) }; set +f\n"
        f'    [ "${{4-}}" = {int(sid)} ] && [ "$1" != Z ] && left=1 &&'
        ' kill -KILL "${p#/proc/}" 2>/dev/null\n'
        "  done\n"
        '  [ "$left" = 0 ] && break\n'
        "  sleep 0.05\n"
        "done\n"
        f"rm -f -- {shlex.quote(PREFIX + exec_id)}.*\n"
    )
