"""Sandbox sessions placed on worker hosts, for API processes in dispatch mode
(``EPHEMERAL_EXECUTOR=dispatch``; docs/deploy.md, "Sessions on worker hosts").

:class:`PlacedSessions` replaces the runtime's :class:`~ephemeral.sessions.manager.Sessions` in an
API process that dispatches. A session is validated and admitted here exactly as in one process (the
same policy, money, idempotency), then placed: the API asks a live worker host with a free session
slot (the ``worker_hosts`` directory) to claim and start it over the internal channel
(:mod:`ephemeral.sessions.link`). A host that is full or does not answer is skipped for the next;
none within ``placement_timeout_seconds`` and the session ends ``failed`` / ``infra_error``,
refunded. Exec, files and delete on any API process go to the host that claimed the session
(the run row's ``host``).

Why not through Prefect as runs go: a task run costs 120-280 ms from submission to its body
(docs/deploy.md, the mechanism table), past this path's 50 ms budget, and a session is driven
call by call, so its calls need a channel to its host anyway. Placement is one signed call.

A host that dies takes its sessions with it: their leases stop being renewed and any runtime's
sweep settles them (``failed``/``infra_error``, compute charged to the last renewal). Until
then a call answers 409 naming the host that does not answer; after, 409 "has ended".
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ephemeral import errors
from ephemeral.engine import exits
from ephemeral.engine.close import close
from ephemeral.ids import utcnow
from ephemeral.lifecycle import TERMINAL_STATUSES, RunStatus
from ephemeral.money.pricing import PriceBook
from ephemeral.policy import Policy
from ephemeral.sandbox.base import ExecResult, Limits
from ephemeral.sandbox.source import SandboxSource
from ephemeral.sessions.link import LinkClient, LinkError, LinkRefused, Peer, Transport
from ephemeral.sessions.manager import DEADLINE_GRACE_SECONDS, DEFAULT_EXEC_TIMEOUT, Sessions
from ephemeral.sessions.requests import MAX_FILE_BYTES, ExecRequest, SessionRequest
from ephemeral.settings import Settings
from ephemeral.store import RunRow, Store, hosts

if TYPE_CHECKING:
    from ephemeral.engine.runtime import Runtime

log = logging.getLogger("ephemeral.sessions.placement")

DIRECTORY_SECONDS = 1.0  # the host directory is read again when older than this
CALL_MARGIN_SECONDS = 30.0  # past a command's own deadline before a call counts as hung
RETRY_SECONDS = 0.2  # between rounds over the hosts when every one was full


def install(runtime: Runtime, transport: Transport | None = None) -> None:
    """Make the runtime's sessions placed ones (called by ``ephemeral serve`` when it
    dispatches). Nothing of it starts until the first session. ``transport``: how the channel
    reaches hosts (TCP unless a test hands an in-memory one)."""
    runtime.sessions = PlacedSessions(
        runtime.settings,
        runtime.store,
        runtime.price_book,
        runtime.sandboxes,
        runtime.owner,
        transport=transport,
    )


class PlacedSessions(Sessions):
    """Admitted here, started and served on a worker host; the same arguments as
    :class:`~ephemeral.sessions.manager.Sessions` (its sandbox source is used only for the
    admission's isolation check: no sandbox starts in this process)."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        price_book: PriceBook,
        sandboxes: SandboxSource,
        owner: str,
        *,
        transport: Transport | None = None,
    ) -> None:
        super().__init__(settings, store, price_book, sandboxes, owner)
        self._transport = transport
        self._link: LinkClient | None = None
        self._directory: tuple[float, list[hosts.HostRow]] = (0.0, [])
        self._pending: Counter[str] = Counter()  # placements in flight per host, from here

    def link(self) -> LinkClient:
        if self._link is None:
            from ephemeral.sessions.host import ensure_seal_key

            self._link = LinkClient(
                ensure_seal_key(self.settings), self.settings.host_id, self._transport
            )
        return self._link

    # the directory -------------------------------------------------------------------------
    async def _hosts(self, *, refresh: bool = False) -> list[hosts.HostRow]:
        at, found = self._directory
        if refresh or time.monotonic() - at > DIRECTORY_SECONDS:
            found = await self.store.hosts.live(utcnow())
            self._directory = (time.monotonic(), found)
        return found

    def _free(self, host: hosts.HostRow) -> int:
        return host.free - self._pending[host.host]

    def _note(self, host: str, sessions_live: Any) -> None:
        """What a host said of its load, until the directory is read again."""
        if not isinstance(sessions_live, int):
            return
        at, found = self._directory
        self._directory = (
            at,
            [
                h.model_copy(update={"sessions_live": sessions_live}) if h.host == host else h
                for h in found
            ],
        )

    async def _candidates(self, *, refresh: bool = False) -> list[hosts.HostRow]:
        """Live hosts with a free slot, most free first (ties in random order)."""
        found = [h for h in await self._hosts(refresh=refresh) if self._free(h) > 0]
        random.shuffle(found)
        return sorted(found, key=lambda h: -self._free(h))

    async def _peer(self, host: str) -> Peer:
        for row in await self._hosts():
            if row.host == host:
                return Peer(row.host, row.address, row.instance)
        found = await self.store.hosts.get(host)
        if found is None:
            raise LinkError(f"host {host} is not in the host directory (it stopped)")
        return Peer(found.host, found.address, found.instance)

    # create --------------------------------------------------------------------------------
    async def create(self, org_id: str, request: SessionRequest, **kw: Any) -> tuple[RunRow, bool]:
        """As in one process, refused with 429 before any money moves when no worker host
        has a free session slot (or none is alive)."""
        if not await self._candidates() and not await self._candidates(refresh=True):
            raise errors.QueueFull(
                "no worker host has a free sandbox session slot (or none is running: "
                "`ephemeral worker`); retry after the time in Retry-After",
                retry_after=1.0,
            )
        return await super().create(org_id, request, **kw)

    async def _start(self, row: RunRow, policy: Policy, asked: Limits | None = None) -> RunRow:
        """Place the admitted session (``Sessions.create`` calls this after admission)."""
        if asked is not None:  # an in-process caller's limits do not travel to another host
            raise errors.InvalidRequest.field(
                "limits", "a session placed on a worker host takes the host's default limits"
            )
        settings = self.settings
        timeout = settings.placement_timeout_seconds
        # If this process dies before a host claims the session, this lease expires and any
        # process's sweep settles it (refunded: it never had a sandbox).
        await self.store.runs.update(
            row.id,
            lease_expires_at=utcnow() + timedelta(seconds=timeout + settings.lease_seconds),
        )
        deadline = time.monotonic() + timeout
        refresh = False
        while True:
            for host in await self._candidates(refresh=refresh):
                self._pending[host.host] += 1
                try:
                    result, _ = await self.link().call(
                        Peer(host.host, host.address, host.instance),
                        "start",
                        {"session_id": row.id},
                        timeout=max(1.0, deadline - time.monotonic() + 1.0),
                    )
                except errors.QueueFull:
                    self._note(host.host, host.session_slots)
                    continue
                except LinkRefused as exc:
                    log.error("session %s: %s", row.id, exc.detail)
                    continue
                except LinkError as exc:
                    log.warning("session %s: host %s: %s", row.id, host.host, exc.detail)
                    self.link().forget(host.address)
                    if await self._claimed(row.id):  # it got there before the link broke
                        return await self._started(row.id, deadline)
                    continue
                except errors.Conflict:  # cancelled meanwhile, or claimed by an earlier try
                    return await self._started(row.id, deadline)
                finally:
                    self._pending[host.host] -= 1
                self._note(host.host, result.get("sessions_live"))
                return await self.store.runs.get(row.id)
            if time.monotonic() >= deadline:
                break
            refresh = True
            await asyncio.sleep(RETRY_SECONDS)
        detail = f"no worker host took the session within {timeout:.0f} s (all full or unreachable)"
        log.error("session %s: %s", row.id, detail)
        try:
            return await close(
                self.store,
                self.settings,
                row.id,
                exits.crashed(detail),
                usage={},
                output=None,
                expect={RunStatus.QUEUED},
            )
        except errors.Conflict:  # a host claimed it at the last moment
            return await self._started(row.id, deadline)

    async def _claimed(self, session_id: str) -> bool:
        return (await self.store.runs.get(session_id)).status != RunStatus.QUEUED

    async def _started(self, session_id: str, deadline: float) -> RunRow:
        """The session left ``queued`` through another path (a host's start, or an exit):
        answer once it is running or over (or as it is at the deadline). No exit of its own."""
        while True:
            row = await self.store.runs.get(session_id)
            if row.status not in (RunStatus.QUEUED, RunStatus.PROVISIONING):
                return row
            if time.monotonic() >= deadline:
                return row
            await asyncio.sleep(0.05)

    # use -----------------------------------------------------------------------------------
    async def _remote(self, session_id: str, org_id: str | None) -> tuple[RunRow, Peer]:
        row = await self.get(session_id, org_id)  # NotFound for another org's
        if row.status in TERMINAL_STATUSES:
            raise _ended(row)
        if row.host is None or row.status == RunStatus.QUEUED:
            raise errors.Conflict(f"sandbox {session_id} is still being placed on a host")
        try:
            return row, await self._peer(row.host)
        except LinkError as exc:
            raise await self._unreachable(row, exc) from exc

    async def _unreachable(self, row: RunRow, exc: LinkError) -> errors.EphemeralError:
        """The error for a call its host did not answer: the session's state, never a hang."""
        now = await self.store.runs.get(row.id)
        if now.status in TERMINAL_STATUSES:
            return _ended(now)
        if isinstance(exc, LinkRefused):
            return errors.EphemeralError(
                f"{exc.detail} (do this process and the host share EPHEMERAL_SEAL_KEY_FILE?)"
            )
        lease = self.settings.lease_seconds
        return errors.Conflict(
            f"sandbox {row.id}: its host {row.host} does not answer ({exc.detail}); if the host "
            f"died, the session is settled when its lease expires (within {lease:.0f} s)"
        )

    def _time_left(self, row: RunRow) -> float:
        policy = Policy.model_validate(row.policy)
        if row.started_at is None:
            return float(policy.timeout_seconds)
        end = row.started_at.timestamp() + policy.timeout_seconds
        return max(0.0, end - utcnow().timestamp()) + DEADLINE_GRACE_SECONDS

    async def _call(
        self,
        row: RunRow,
        peer: Peer,
        op: str,
        args: dict[str, Any],
        body: bytes = b"",
        *,
        timeout: float,
    ) -> tuple[dict[str, Any], bytes]:
        try:
            return await self.link().call(
                peer,
                op,
                {"session_id": row.id, "org_id": row.org_id, **args},
                body,
                timeout=timeout,
            )
        except LinkError as exc:
            self.link().forget(peer.address)
            self._directory = (0.0, [])  # the host may have restarted elsewhere
            raise await self._unreachable(row, exc) from exc

    async def exec(self, session_id: str, org_id: str | None, req: ExecRequest) -> ExecResult:
        if session_id in self._live:
            return await super().exec(session_id, org_id, req)
        row, peer = await self._remote(session_id, org_id)
        wait = min(req.timeout_seconds or DEFAULT_EXEC_TIMEOUT, self._time_left(row))
        _, out = await self._call(
            row,
            peer,
            "exec",
            {},
            req.model_dump_json().encode(),
            timeout=wait + CALL_MARGIN_SECONDS,
        )
        return ExecResult.model_validate_json(out)

    async def write_file(self, session_id: str, org_id: str | None, path: str, data: bytes) -> None:
        if session_id in self._live:
            return await super().write_file(session_id, org_id, path, data)
        if len(data) > MAX_FILE_BYTES:
            raise errors.PayloadTooLarge(f"{path}: over the {MAX_FILE_BYTES}-byte file limit")
        row, peer = await self._remote(session_id, org_id)
        await self._call(
            row,
            peer,
            "write",
            {"path": path},
            data,
            timeout=self._time_left(row) + CALL_MARGIN_SECONDS,
        )

    async def read_file(
        self, session_id: str, org_id: str | None, path: str, max_bytes: int = MAX_FILE_BYTES
    ) -> bytes:
        if session_id in self._live:
            return await super().read_file(session_id, org_id, path, max_bytes)
        row, peer = await self._remote(session_id, org_id)
        _, data = await self._call(
            row,
            peer,
            "read",
            {"path": path, "max_bytes": min(max_bytes, MAX_FILE_BYTES)},
            timeout=self._time_left(row) + CALL_MARGIN_SECONDS,
        )
        if len(data) > min(max_bytes, MAX_FILE_BYTES):
            raise errors.SandboxError(f"host {row.host} returned more than max_bytes of {path}")
        return data

    async def end(
        self, session_id: str, org_id: str | None = None, *, cancelled: bool = False
    ) -> RunRow:
        if session_id in self._live:
            return await super().end(session_id, org_id, cancelled=cancelled)
        row = await self.get(session_id, org_id)
        if row.status in TERMINAL_STATUSES:
            return row
        row, peer = await self._remote(session_id, org_id)
        await self._call(
            row,
            peer,
            "end",
            {"cancelled": cancelled},
            timeout=DEADLINE_GRACE_SECONDS + CALL_MARGIN_SECONDS,
        )
        return await self.store.runs.get(session_id)

    async def close(self) -> None:
        await super().close()
        if self._link is not None:
            await self._link.close()


def _ended(row: RunRow) -> errors.Conflict:
    return errors.Conflict(f"sandbox {row.id} has ended ({row.status}: {row.termination_reason})")
