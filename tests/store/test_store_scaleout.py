"""The store's part of scale-out: leases, cancel requests, sealed content (docs/deploy.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import sqlalchemy as sa

from ephemeral import errors
from ephemeral.cluster import leases
from ephemeral.ids import new_run_id, utcnow
from ephemeral.lifecycle import RunStatus, TerminationReason
from ephemeral.store import Org, RunRow, Store
from ephemeral.store.schema import process_leases
from ephemeral.testing.clock import FakeClock
from tests.patience import PATIENCE
from tests.store.storehelp import policy


async def _run(store: Store, org: Org) -> RunRow:
    run, _ = await store.runs.admit(
        org_id=org.id, run_id=new_run_id(), model="replay/x", prompt="p", policy=policy(10_000)
    )
    return run


async def _claim(store: Store, run_id: str, lease: timedelta, owner: str | None = None) -> RunRow:
    now = utcnow()
    return await store.runs.transition(
        run_id,
        expect={RunStatus.QUEUED},
        to=RunStatus.PROVISIONING,
        events=[("run.claimed", {"host": "a"})],
        started_at=now,
        host="a",
        owner=owner,
        lease_renewed_at=now,
        lease_expires_at=now + lease,
    )


async def test_a_lease_expires_unless_renewed_and_only_open_runs_count(
    store: Store, org: Org
) -> None:
    fresh, stale, done = [await _run(store, org) for _ in range(3)]
    claimed = await _claim(store, fresh.id, timedelta(seconds=30), owner="a:1:1")
    assert (claimed.host, claimed.lease_expires_at is not None) == ("a", True)
    await _claim(store, stale.id, timedelta(seconds=-1), owner="a:1:1")
    await _claim(store, done.id, timedelta(seconds=-1), owner="a:1:1")
    await store.runs.close(
        done.id, reason=TerminationReason.COMPLETED, detail=None, usage={}, output=None
    )
    assert [r.id for r in await store.leases.expired(utcnow())] == [stale.id]
    later = utcnow() + timedelta(seconds=60)
    # only the holder renews: another process's renewal (a stale list) leaves the rows alone
    await store.leases.renew(
        [stale.id], owner="b:2:2", renewed_at=utcnow(), expires_at=later + timedelta(1)
    )
    assert [r.id for r in await store.leases.expired(utcnow())] == [stale.id]
    await store.leases.renew(
        [fresh.id, stale.id, done.id],
        owner="a:1:1",
        renewed_at=utcnow(),
        expires_at=later + timedelta(1),
    )
    assert await store.leases.expired(later) == []
    assert (await store.runs.get(done.id)).lease_expires_at < later  # a closed run is not renewed


async def test_a_live_process_lease_covers_its_runs_until_it_lapses_or_lets_go(
    store: Store, org: Org
) -> None:
    # A worker's run renewals can be late under load; its process lease (ephemeral.cluster.leases)
    # says it is alive, so its runs are not settled as a dead host's.
    mine, other, dropped = [await _run(store, org) for _ in range(3)]
    await _claim(store, mine.id, timedelta(seconds=-1), owner="host-a:1:1")
    await _claim(store, other.id, timedelta(seconds=-1), owner="host-b:2:2")
    await _claim(store, dropped.id, timedelta(seconds=-1), owner="host-a:1:1")
    await leases.renew(store.engine, "host-a:1:1", "a", 30)
    assert {r.id for r in await store.leases.expired(utcnow())} == {other.id}
    # a run the live process lets go of is no longer covered; of another owner, refused
    assert await store.leases.let_go(dropped.id, "host-b:2:2", utcnow()) is False
    assert await store.leases.let_go(dropped.id, "host-a:1:1", utcnow()) is True
    assert (await store.runs.get(dropped.id)).owner is None
    assert {r.id for r in await store.leases.expired(utcnow())} == {other.id, dropped.id}
    # the process lease lapses (the process died): its runs expire with their own leases
    await leases.renew(store.engine, "host-a:1:1", "a", -1)
    assert {r.id for r in await store.leases.expired(utcnow())} == {mine.id, other.id, dropped.id}
    await leases.drop(store.engine, "host-a:1:1")
    assert len(await store.leases.expired(utcnow())) == 3


async def _lease_expires(store: Store, owner: str) -> object:
    async with store.engine.connect() as conn:
        return await conn.scalar(
            sa.select(process_leases.c.expires_at).where(process_leases.c.owner == owner)
        )


async def _until(done: Callable[[], bool]) -> None:
    """Wait for the lease's thread to act on a clock move (its store write takes real time)."""
    async with asyncio.timeout(PATIENCE):
        while not done():
            await asyncio.sleep(0.01)


async def test_a_process_lease_is_renewed_while_the_loop_turns_and_lapses_when_it_is_wedged(
    store: Store, db_url: str
) -> None:
    clock = FakeClock()
    lease = leases.ProcessLease(db_url, "host-a:9:9", "a", lease_seconds=30, clock=clock)
    await lease.start()
    try:
        assert await _lease_expires(store, "host-a:9:9") is not None  # held from start()
        renewals = lease.renewals
        for n in (1, 2):  # a third of a lease passes, twice, the loop turning
            clock.advance(10)
            await _until(lambda n=n: lease.renewals >= renewals + n)  # type: ignore[misc]
        assert lease.renewals >= renewals + 2  # renewed by its thread, the loop only turning
        # a loop wedged for two leases (a blocking call: this one waits for the thread without
        # letting the loop turn): the thread stops renewing
        clock.advance(60)
        deadline = time.monotonic() + PATIENCE
        while lease.stalls == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lease.stalls > 0
        wedged = await _lease_expires(store, "host-a:9:9")
        assert wedged < clock.now()  # type: ignore[operator]
        renewals = lease.renewals
        await asyncio.sleep(0)  # turning again (the ticker marks it): renewed again
        clock.advance(10)
        await _until(lambda: lease.renewals > renewals)
        assert (await _lease_expires(store, "host-a:9:9")) > wedged  # type: ignore[operator]
    finally:
        await lease.stop()
    assert await _lease_expires(store, "host-a:9:9") is None  # dropped at stop


async def test_cancel_requests_are_kept_for_open_runs_only(store: Store, org: Org) -> None:
    run, other = await _run(store, org), await _run(store, org)
    assert await store.cancels.request(run.id) is True
    first = (await store.runs.get(run.id)).cancel_requested_at
    assert await store.cancels.request(run.id) is True
    assert (await store.runs.get(run.id)).cancel_requested_at == first  # the first request stays
    assert await store.cancels.requested([run.id, other.id]) == [run.id]
    await store.runs.close(
        other.id, reason=TerminationReason.CANCELLED, detail=None, usage={}, output=None
    )
    assert await store.cancels.request(other.id) is False


async def test_close_run_with_expect_leaves_a_claimed_run_alone(store: Store, org: Org) -> None:
    run = await _run(store, org)
    await _claim(store, run.id, timedelta(seconds=30))
    with pytest.raises(errors.Conflict, match="provisioning"):
        await store.runs.close(
            run.id,
            reason=TerminationReason.CANCELLED,
            detail="cancelled by request",
            usage={},
            output=None,
            expect={RunStatus.QUEUED},
        )
    row = await store.runs.get(run.id)
    assert (row.status, row.settled) == ("provisioning", False)
    assert [e.type for e in await store.events.list(run.id)] == ["run.queued", "run.claimed"]


async def test_sealed_content_goes_to_exactly_one_reader(
    store: Store, org: Org, db_url: str
) -> None:
    run = await _run(store, org)
    await store.sealed.put(run.id, "output", "token-1", utcnow() + timedelta(minutes=15))
    other = await Store.open(db_url)  # another process's store
    try:
        got = await asyncio.gather(
            *(s.sealed.take(run.id, "output") for s in (store, other, store, other))
        )
    finally:
        await other.close()
    assert sorted(got, key=str) == [None, None, None, "token-1"]


async def test_sealed_content_past_its_ttl_is_never_read_and_purged(store: Store, org: Org) -> None:
    run = await _run(store, org)
    await store.sealed.put(run.id, "prompt", "old", utcnow() - timedelta(seconds=1))
    await store.sealed.put(run.id, "output", "new", utcnow() + timedelta(minutes=15))
    assert await store.sealed.take(run.id, "prompt") is None
    assert await store.sealed.purge(utcnow()) == 1
    await store.retention.erase(run.id)  # erasure takes what is left too
    assert await store.sealed.take(run.id, "output") is None


async def test_the_outbox_finds_undispatched_ownerless_runs_and_a_release_renumbers(
    store: Store, org: Org
) -> None:
    waiting, dispatched, owned = [await _run(store, org) for _ in range(3)]
    await store.outbox.mark_dispatched(dispatched.id, 0)
    await store.outbox.take(
        owned.id, host="a", owner="a:1:2", renewed_at=utcnow(), expires_at=utcnow()
    )
    later = utcnow() + timedelta(seconds=1)
    assert [r.id for r in await store.outbox.undispatched(later)] == [waiting.id]
    assert await store.outbox.undispatched(waiting.created_at) == []  # not yet due
    await store.outbox.mark_dispatched(waiting.id, 1)  # another hand-over's number: not this one
    assert [r.id for r in await store.outbox.undispatched(later)] == [waiting.id]

    # a draining worker hands back what it holds: ownerless, undispatched, the next number
    assert await store.outbox.release(owned.id, "b:1:2") is None  # not b's
    assert await store.outbox.release(owned.id, "a:1:2") == 1
    back = await store.runs.get(owned.id)
    assert (back.owner, back.host, back.lease_expires_at, back.dispatches) == (None,) * 3 + (1,)
    assert await store.outbox.release(dispatched.id, "a:1:2") == 1  # received untaken
    assert {r.id for r in await store.outbox.undispatched(later)} == {
        waiting.id,
        owned.id,
        dispatched.id,
    }
    await _claim(store, waiting.id, timedelta(seconds=30))
    assert await store.outbox.release(waiting.id, "a:1:2") is None  # began: not handed back


async def test_a_cluster_fact_is_the_first_one_stored(store: Store) -> None:
    assert await store.facts.put_first("records_root", "x") == "x"
    assert await store.facts.put_first("records_root", "y") == "x"
