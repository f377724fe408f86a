"""A trial's sandbox session as the Harbor environment talks to it: guest commands that always
end, files read back, processes killed.

The guest serves one request at a time, so a call is never cancelled halfway: a cancel waits
for its reply (``through``) and is raised after. Every failure of the session is Harbor's
``RuntimeRequestError`` (a sandbox failure: retried, never graded as the agent's), and so is
any call after the environment's ``stop`` closed it.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
import shlex
from typing import Any

from ephemeral import errors
from ephemeral.harbor import commands
from ephemeral.sessions.requests import ExecRequest

log = logging.getLogger("ephemeral.harbor")

# A file up to this size comes back as base64 on stdout (one exec); a larger one is copied
# to /tmp and read as a file (the session's file limit, 128 MiB).
INLINE_DOWNLOAD_BYTES = 3 << 20
MAX_OUTPUT_BYTES = 64 << 20  # per stream of one command


def runtime_request_error(action: str, message: str) -> Exception:
    """Harbor classifies failures by class name: RuntimeRequestError is a sandbox failure
    (retried, not graded), never the agent's."""
    try:
        from harbor.agents.computer_1.runtime import RuntimeRequestError
    except ImportError:  # pragma: no cover - an older Harbor
        return RuntimeError(message)
    return RuntimeRequestError(action, 0, message)


def not_started() -> Exception:
    return runtime_request_error("exec", "ephemeral: the environment is not started")


class Session:
    """The session ``session_id`` of ``org`` on ``runtime``; ``trial`` (Harbor's session id)
    names it in the log."""

    def __init__(self, runtime: Any, org: str | None, session_id: str, trial: str) -> None:
        self.runtime, self.org, self.id, self.trial = runtime, org, session_id, trial
        self.closed = False

    def _live(self) -> str:
        if self.closed:  # stopped under a call in flight (a shielded kill, say)
            raise not_started()
        return self.id

    async def call(
        self,
        command: list[str] | str,
        *,
        user: str,
        cwd: str = "/",
        env: dict[str, str] | None = None,
        stdin: bytes = b"",
        timeout: float = commands.HOUSEKEEPING_TIMEOUT,
    ) -> Any:
        """One guest command through the session (an event), its cancel raised once it ended."""
        result, cancelled = await self.through(
            commands.exec_request(
                command, user=user, cwd=cwd, env=env, stdin=stdin, timeout=timeout
            )
        )
        if cancelled:
            raise asyncio.CancelledError()
        return result

    async def through(self, sent: ExecRequest) -> tuple[Any, bool]:
        """(the result, whether this task was cancelled meanwhile): the call always ends."""
        call = asyncio.ensure_future(self.runtime.sessions.exec(self._live(), self.org, sent))
        cancelled = False
        while not call.done():
            try:
                await asyncio.shield(call)
            except asyncio.CancelledError:
                cancelled = cancelled or not call.done()
            except Exception:  # noqa: BLE001 - the call's own error, raised below
                break
        try:
            return call.result(), cancelled
        except errors.InvalidRequest as exc:
            raise ValueError(f"ephemeral exec: {exc.detail}") from exc
        except errors.EphemeralError as exc:
            raise runtime_request_error("exec", f"ephemeral: {exc.detail}") from exc

    async def outputs(self, exec_id: str) -> tuple[str, str]:
        """The stdout and stderr a finished command left in its files."""
        out_path, err_path, _ = commands.paths(exec_id)
        texts = []
        for path in (out_path, err_path):
            try:
                data = await self.runtime.sessions.read_file(
                    self._live(), self.org, path, MAX_OUTPUT_BYTES
                )
            except errors.FilePermissionDenied:  # a umask that left it unreadable: root reads
                data = await self.fetch(f"cat -- {shlex.quote(path)}", path)
            except errors.PayloadTooLarge as exc:
                raise runtime_request_error(
                    "exec", f"ephemeral: the command's output is over {MAX_OUTPUT_BYTES} bytes"
                ) from exc
            except errors.EphemeralError as exc:
                raise runtime_request_error("exec", f"ephemeral: {exc.detail}") from exc
            texts.append(bytes(data).decode("utf-8", errors="replace"))
        return texts[0], texts[1]

    async def end_phase(self) -> None:
        """Kill every process the agent phase left (a setsid or double-forked child, root's, one
        ignoring SIGTERM: the command's own kill reaches its session only) before the verifier
        runs, so none can rewrite its reward. The verifier does not run if that fails."""
        try:
            killed = await self.runtime.sessions.kill_all(self._live(), self.org)
        except errors.EphemeralError as exc:
            raise runtime_request_error(
                "exec", f"ephemeral: the agent phase's processes could not be stopped: {exc.detail}"
            ) from exc
        if killed:
            log.info("%s: %d processes of the agent phase killed", self.trial, killed)

    async def kill(self, exec_id: str, sid: int) -> None:
        """Every process of the command's session (``commands.kill_script``), then its files."""
        await self.call(["bash", "-c", commands.kill_script(exec_id, sid)], user="root")

    async def fetch(self, producer: str, what: str, stdin: bytes = b"") -> bytes:
        """The bytes ``producer`` writes, read as root: base64 on stdout when small, else
        through a file in /tmp that the session reads (as the worker, so it is made readable)."""
        tmp = f"/tmp/.ephemeral-dl-{secrets.token_hex(6)}"
        script = (
            f"set -e; umask 077; {producer} > {tmp}\n"
            f'if [ "$(stat -c %s {tmp})" -le {INLINE_DOWNLOAD_BYTES} ]; then '
            f"base64 -w0 {tmp}; rm -f {tmp}; else chmod 644 {tmp}; echo SPILL; fi\n"
        )
        res = await self.call(["bash", "-c", script], user="root", stdin=stdin)
        if res.exit_code != 0:
            await self.call(["rm", "-f", "--", tmp], user="root")
            said = (res.stderr or res.stdout).strip()[:500]
            raise runtime_request_error("download", f"ephemeral: cannot read {what}: {said}")
        if res.stdout.strip() != "SPILL":
            return base64.b64decode(res.stdout.strip(), validate=True)
        try:
            return bytes(await self.runtime.sessions.read_file(self._live(), self.org, tmp))
        except errors.EphemeralError as exc:
            raise runtime_request_error(
                "download", f"ephemeral: cannot read {what}: {exc.detail}"
            ) from exc
        finally:
            await self.call(["rm", "-f", "--", tmp], user="root")
