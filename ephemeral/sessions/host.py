"""A worker host's side of sandbox sessions in dispatch mode (docs/deploy.md, "Sessions on
worker hosts").

``ephemeral worker`` starts one :class:`SessionHost` beside its runtime: the internal channel's
listener (:mod:`ephemeral.sessions.link`), its row in the host directory (``worker_hosts``), and a
loop that renews the leases of the sessions it hosts, renews the directory row and acts on
cancel requests any process wrote to the store. The sessions themselves run in the runtime's
:class:`~ephemeral.sessions.manager.Sessions`, exactly as in one process (same limits, events and
money); only their admission happened in an API process.

A session is claimed by one host only: the claim moves it ``queued`` → ``provisioning`` with
this host, this process as owner and a lease (compare-and-set), so a retried placement can
never start it twice. If the host dies, the lease expires and any live process settles it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ephemeral import errors
from ephemeral.ids import utcnow
from ephemeral.lifecycle import TERMINAL_STATUSES, RunKind, RunStatus
from ephemeral.sessions.link import Limits, LinkServer, link_key
from ephemeral.sessions.requests import ExecRequest

if TYPE_CHECKING:
    from ephemeral.engine.runtime import Runtime
    from ephemeral.settings import Settings

log = logging.getLogger("ephemeral.sessions.host")

TEND_SECONDS = 0.5  # cancel requests are looked for this often (as for runs)
# Expired leases are looked for this often here, besides every runtime's 5 s watchdog: the
# sessions (and runs) of a dead host settle about a lease after its death, not lease + 5 s.
SWEEP_SECONDS = 1.0


def ensure_seal_key(settings: Settings) -> bytes:
    """The channel's key; the shared seal key file is made on first use, as the broker does."""
    from ephemeral.broker.secrets import Sealer

    Sealer.for_settings(settings).seal({})
    return link_key(settings.seal_key_path)


class SessionHost:
    def __init__(self, runtime: Runtime, slots: int) -> None:
        self.runtime = runtime
        self.slots = slots
        self.hosted: set[str] = set()  # claimed here and not yet ended
        self._claiming: set[str] = set()  # being claimed: not yet live in the sessions
        self.server = LinkServer(
            ensure_seal_key(runtime.settings),
            runtime.host,
            self.handle,
            Limits.for_settings(runtime.settings),
        )
        self._tend_task: asyncio.Task[None] | None = None
        self._cancelling: dict[str, asyncio.Task[Any]] = {}
        self.taking = True  # False once draining: new sessions go to other hosts

    @classmethod
    async def start(
        cls,
        runtime: Runtime,
        *,
        slots: int,
        listen: Callable[[LinkServer], Awaitable[str]] | None = None,
    ) -> SessionHost:
        """``listen``: how the channel's server is reached (a TCP socket on the settings'
        address, unless a test serves it in memory: ``MemoryTransport.listen``)."""
        settings = runtime.settings
        host = cls(runtime, slots)
        if listen is None:
            address = await host.server.start(settings.link_address, settings.link_port)
        else:
            address = await listen(host.server)
        await host._register()
        host._tend_task = asyncio.create_task(host._tend(), name="session-host")
        log.warning("host %s takes sessions on %s (%d slots)", runtime.host, address, slots)
        return host

    async def stop_taking(self) -> None:
        """Take no new session (a draining worker): the directory row goes, so API processes
        place elsewhere, and a start that still arrives is answered as full. The sessions
        already here carry on until they end or the runtime closes."""
        self.taking = False
        with contextlib.suppress(Exception):
            await self.runtime.store.hosts.unregister(
                host=self.runtime.host, instance=self.server.instance
            )

    async def close(self) -> None:
        if self._tend_task is not None:
            self._tend_task.cancel()
            with contextlib.suppress(BaseException):
                await self._tend_task
        await self.server.close()
        with contextlib.suppress(Exception):
            await self.runtime.store.hosts.unregister(
                host=self.runtime.host, instance=self.server.instance
            )

    async def _register(self) -> None:
        now = utcnow()
        await self.runtime.store.hosts.register(
            host=self.runtime.host,
            address=self.server.address,
            instance=self.server.instance,
            session_slots=self.slots,
            sessions_live=len(self.hosted),
            now=now,
            expires_at=now + timedelta(seconds=self.runtime.settings.lease_seconds),
        )

    # the channel's operations ----------------------------------------------------------------
    async def handle(
        self, op: str, args: dict[str, Any], body: bytes
    ) -> tuple[dict[str, Any], bytes]:
        sessions = self.runtime.sessions
        session_id = str(args.get("session_id", ""))
        org_id = args.get("org_id")
        org = str(org_id) if org_id is not None else None
        if op == "ping":
            return {"host": self.runtime.host, "sessions_live": len(self.hosted)}, b""
        if op == "start":
            return await self._start(session_id), b""
        if op not in ("exec", "write", "read", "end"):
            raise errors.InvalidRequest.field("op", f"unknown operation {op[:40]!r}")
        await self._require_live(session_id, org)
        if op == "exec":
            try:
                request = ExecRequest.model_validate_json(body)
            except ValueError as exc:
                raise errors.InvalidRequest(f"exec: {exc}") from exc
            res = await sessions.exec(session_id, org, request)
            return {}, res.model_dump_json().encode()
        path = str(args.get("path", ""))
        if op == "write":
            await sessions.write_file(session_id, org, path, body)
            return {}, b""
        if op == "read":
            max_bytes = args.get("max_bytes")
            if not isinstance(max_bytes, int) or isinstance(max_bytes, bool):
                raise errors.InvalidRequest.field("max_bytes", "must be an integer")
            return {}, await sessions.read_file(session_id, org, path, max_bytes)
        row = await sessions.end(session_id, org, cancelled=bool(args.get("cancelled")))
        return {"status": row.status}, b""

    async def _require_live(self, session_id: str, org_id: str | None) -> None:
        if self.runtime.sessions.owns(session_id):
            return
        row = await self.runtime.sessions.get(session_id, org_id)  # NotFound for another org's
        if row.status in TERMINAL_STATUSES:
            raise errors.Conflict(
                f"sandbox {session_id} has ended ({row.status}: {row.termination_reason})"
            )
        raise errors.Conflict(
            f"sandbox {session_id} is not live on host {self.runtime.host} (the host restarted); "
            "it is settled when its lease expires"
        )

    async def _start(self, session_id: str) -> dict[str, Any]:
        """Claim an admitted session and start its sandbox here; QueueFull when no slot is
        free (the API process tries another host), Conflict when it no longer waits."""
        runtime = self.runtime
        row = await runtime.sessions.get(session_id)
        if row.kind != RunKind.SESSION:
            raise errors.NotFound(f"sandbox {session_id} not found")
        if not self.taking:
            raise errors.QueueFull(f"host {runtime.host} is draining", retry_after=1.0)
        if len(self.hosted) >= self.slots:
            raise errors.QueueFull(
                f"host {runtime.host} hosts {len(self.hosted)} sessions, its limit",
                retry_after=1.0,
            )
        self.hosted.add(session_id)  # before any await: the slot is taken now
        self._claiming.add(session_id)
        try:
            now = utcnow()
            row = await runtime.store.runs.transition(
                session_id,
                expect={RunStatus.QUEUED},
                to=RunStatus.PROVISIONING,
                events=[("run.claimed", {"host": runtime.host})],
                host=runtime.host,
                owner=runtime.owner,
                lease_renewed_at=now,
                lease_expires_at=now + timedelta(seconds=runtime.settings.lease_seconds),
            )
            row = await runtime.sessions.start_admitted(row)
        except BaseException:
            if not runtime.sessions.owns(session_id):
                self.hosted.discard(session_id)
            raise
        finally:
            self._claiming.discard(session_id)
        if row.status in TERMINAL_STATUSES:
            self.hosted.discard(session_id)
        return {"status": row.status, "sessions_live": len(self.hosted)}

    # leases, directory, cancel requests --------------------------------------------------------
    async def _tend(self) -> None:
        lease = self.runtime.settings.lease_seconds
        renewed = swept = time.monotonic()
        while True:
            await asyncio.sleep(TEND_SECONDS)
            try:
                due = time.monotonic() - renewed >= lease / 3
                await self._tend_once(renew=due)
                if due:
                    renewed = time.monotonic()
                if time.monotonic() - swept >= SWEEP_SECONDS:
                    swept = time.monotonic()
                    await self.runtime.settle_expired_leases()
            except Exception:
                log.exception("session host: lease renewal, cancel poll or sweep failed")

    async def _tend_once(self, *, renew: bool) -> None:
        runtime = self.runtime
        for session_id in list(self.hosted):
            if not (runtime.sessions.owns(session_id) or session_id in self._claiming):
                self.hosted.discard(session_id)  # ended (its own watchdog, a delete, a cancel)
        if renew:
            now = utcnow()
            expires = now + timedelta(seconds=runtime.settings.lease_seconds)
            await runtime.store.leases.renew(
                self.hosted, owner=runtime.owner, renewed_at=now, expires_at=expires
            )
            alive = await runtime.store.hosts.heartbeat(
                host=runtime.host,
                instance=self.server.instance,
                sessions_live=len(self.hosted),
                now=now,
                expires_at=expires,
            )
            if not alive and self.taking:  # the row expired or was replaced: take it again
                await self._register()
            # Settled by another process (this host's lease lapsed: a stall, a partition): its
            # money is closed, so its sandbox must go too, now, not at its time limit.
            for session_id in await runtime.store.hosts.ended_among(self.hosted):
                if session_id not in self._cancelling and session_id not in self._claiming:
                    log.error("session %s: settled elsewhere; ending it here", session_id)
                    self._cancelling[session_id] = asyncio.create_task(
                        runtime.sessions.end(session_id), name=f"end-{session_id}"
                    )
        for session_id in await runtime.store.cancels.requested(self.hosted):
            if session_id not in self._cancelling:
                self._cancelling[session_id] = asyncio.create_task(
                    runtime.sessions.end(session_id, cancelled=True), name=f"cancel-{session_id}"
                )
        for session_id, task in list(self._cancelling.items()):
            if task.done():
                del self._cancelling[session_id]
                if not task.cancelled() and task.exception() is not None:
                    log.warning("session %s: cancel failed: %s", session_id, task.exception())
