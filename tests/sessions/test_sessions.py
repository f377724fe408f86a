"""Sandbox sessions in the core: admission, exec, files, limits, settlement, records."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest
from pydantic import ValidationError

from ephemeral import errors
from ephemeral.engine.runtime import Runtime
from ephemeral.records import Records
from ephemeral.sandbox import images
from ephemeral.sandbox.base import AGENT_CAPS
from ephemeral.sessions.requests import ExecRequest, SessionRequest
from ephemeral.store import RunRow
from ephemeral.testing.clock import FakeClock
from tests import runlevel
from tests.drivers import built_image
from tests.goldenlog import assert_golden_log
from tests.patience import PATIENCE

pytestmark = pytest.mark.sandbox


def _types(events: list) -> list[str]:
    return [e.type for e in events]


async def test_session_lifecycle_money_and_records(
    runtime: Runtime, org: str, isolation: str
) -> None:
    req = SessionRequest(isolation=isolation, timeout_seconds=60, max_cost_micros=20_000)
    row, replayed = await runtime.sessions.create(org, req)
    assert not replayed and row.status == "running" and row.kind == "session"
    assert row.isolation == isolation
    sid = row.id
    res = await runtime.sessions.exec(sid, org, ExecRequest(command=["sh", "-c", "echo hi; id -u"]))
    assert (res.exit_code, res.stdout) == (0, "hi\n1000\n")
    res = await runtime.sessions.exec(
        sid, org, ExecRequest(command="cat", stdin_base64=base64.b64encode(b"in").decode())
    )
    assert res.stdout == "in"
    root = await runtime.sessions.exec(sid, org, ExecRequest(command=["id", "-u"], user="root"))
    assert root.stdout == "0\n"
    await runtime.sessions.write_file(sid, org, "dir/a.txt", b"data")
    assert await runtime.sessions.read_file(sid, org, "dir/a.txt") == b"data"
    with pytest.raises(errors.FileNotFound):
        await runtime.sessions.read_file(sid, org, "missing")
    with pytest.raises(errors.IsADirectory):
        await runtime.sessions.read_file(sid, org, "/etc")
    with pytest.raises(errors.NotFound):  # another org's session is not found
        await runtime.sessions.exec(sid, "org_other", ExecRequest(command="true"))

    ended = await runtime.sessions.end(sid, org)
    assert ended.status == "succeeded" and ended.termination_reason == "completed"
    assert ended.charged_micros + ended.refunded_micros == ended.reserved_micros == 20_000
    assert ended.breakdown["compute_micros"] == ended.charged_micros > 0
    assert (await runtime.sessions.end(sid, org)).settled_at == ended.settled_at  # idempotent
    assert_golden_log("session", await runtime.store.events.list(sid))
    with pytest.raises(errors.Conflict):
        await runtime.sessions.exec(sid, org, ExecRequest(command="true"))
    events = await runtime.store.events.list(sid)
    assert _types(events) == [
        "run.queued",
        "sandbox.ready",
        "worker.started",
        "sandbox.exec",
        "sandbox.exec",
        "sandbox.exec",
        "sandbox.destroyed",
        "run.succeeded",
        "run.settled",
    ]
    ready = events[1].data
    built = images.built_image(runtime.settings, runtime.settings.image)
    assert built is not None
    assert (ready["image"], ready["image_hash"]) == (runtime.settings.image, built.hash)
    first = events[3].data
    assert first["command"] == "sh -c 'echo hi; id -u'" and first["stdout"] == "hi\n1000\n"
    assert events[5].data["user"] == "root"
    org_row = await runtime.store.orgs.get(org)
    assert org_row.reserved_micros == 0
    assert org_row.balance_micros == 1_000_000 - ended.charged_micros

    records = Records(runtime.settings.records_dir)
    try:
        cols, rows = records.costs("kind", None)
        by_kind = {r[0]: dict(zip(cols, r, strict=True)) for r in rows}
        assert by_kind["session"]["runs"] == 1
        assert by_kind["session"]["charged_micros"] == ended.charged_micros
    finally:
        records.close()
    # sessions are not runs: the run list does not show them
    listed, _ = await runtime.store.runs.list(org)
    assert listed == []


async def _settled(runtime: Runtime, org: str, session_id: str) -> RunRow:
    """The session once settled in the store and let go here (what its watchdog does)."""
    async with asyncio.timeout(PATIENCE):
        while not (done := await runtime.sessions.get(session_id, org)).settled or (
            runtime.sessions.owns(session_id)
        ):
            await asyncio.sleep(0.01)
    return done


async def test_time_limit_ends_the_session(runtime: Runtime, org: str, isolation: str) -> None:
    clock = runtime.sessions.clock = FakeClock()
    row, _ = await runtime.sessions.create(
        org, SessionRequest(isolation=isolation, timeout_seconds=2)
    )
    clock.advance(1.95)  # a command started now is cut at the session's deadline
    res = await runtime.sessions.exec(row.id, org, ExecRequest(command="sleep 30"))
    assert res.timed_out  # cut at the session's deadline
    clock.advance(0.1)  # past the deadline: the session's watchdog ends it
    done = await _settled(runtime, org, row.id)
    assert done.status == "timed_out"  # no sandbox handle left: the runtime fixture checks


async def test_budget_cap_ends_the_session(runtime: Runtime, org: str, isolation: str) -> None:
    clock = runtime.sessions.clock = FakeClock()
    limits = runtime.sandboxes.limits(60)
    rate = runtime.price_book.compute_micros(
        vcpu_seconds=limits.cpus, gib_seconds=limits.memory_mib / 1024
    )
    budget = max(1, int(rate * 1.5))  # 1.5 s of compute
    row, _ = await runtime.sessions.create(
        org, SessionRequest(isolation=isolation, timeout_seconds=60, max_cost_micros=budget)
    )
    clock.advance(1.5)  # compute has used the budget up: the watchdog ends the session
    done = await _settled(runtime, org, row.id)
    assert done.status == "budget_exhausted"
    assert done.charged_micros <= budget
    assert done.charged_micros + done.refunded_micros == budget


async def test_insufficient_balance_is_refused(runtime: Runtime) -> None:
    poor = await runtime.store.orgs.create("poor")
    await runtime.store.orgs.credit(poor.id, 100, note="test")
    with pytest.raises(errors.PaymentRequired):
        await runtime.sessions.create(poor.id, SessionRequest(max_cost_micros=1_000))
    # Nothing reserved on any org: the runtime fixture checks (tests/runlevel.py).


async def test_zero_data_retention_keeps_no_content(
    runtime: Runtime, org: str, isolation: str
) -> None:
    row, _ = await runtime.sessions.create(
        org, SessionRequest(isolation=isolation, zero_data_retention=True)
    )
    res = await runtime.sessions.exec(row.id, org, ExecRequest(command="echo secret-output"))
    assert res.stdout == "secret-output\n"  # delivered to the caller
    await runtime.sessions.end(row.id, org)
    ev = next(e for e in await runtime.store.events.list(row.id) if e.type == "sandbox.exec")
    assert "stdout" not in ev.data and "command" not in ev.data
    assert ev.data["stdout_bytes"] == len("secret-output\n")
    assert "secret-output" not in str(await runtime.store.events.list(row.id))


async def test_web_and_connections_pass_to_the_session_policy() -> None:
    # what they do inside: tests/sessions/test_egress.py
    grant = [{"name": "svc", "methods": ["GET"], "paths": ["/repos/*"]}]
    policy = SessionRequest.model_validate(
        {"web": {"allow": ["*.example.org"]}, "connections": grant}
    ).policy()
    assert policy.web_allow == ["*.example.org"] and policy.web_on
    assert [c.name for c in policy.connections] == ["svc"]


async def test_cancel_through_the_runs_api_ends_the_session(
    runtime: Runtime, org: str, isolation: str
) -> None:
    row, _ = await runtime.sessions.create(org, SessionRequest(isolation=isolation))
    pids = list(runtime.settings.sandboxes_dir.glob("*.json"))
    assert pids
    done = await runtime.cancel(row.id, org)
    assert (done.status, done.termination_reason) == ("cancelled", "cancelled")
    assert done.settled and not runtime.sessions.owns(row.id)  # no handle left: the fixture


async def test_root_is_refused_where_it_would_be_host_root(tmp_path: Path) -> None:
    from ephemeral.sandbox.registry import probe_level
    from ephemeral.settings import Settings
    from tests.drivers import unavailable

    settings = Settings.load(
        state_dir=tmp_path / "state", use_prefect=False, namespaces_privileged=True
    )
    why = await probe_level("namespaces", settings)
    if why is not None:
        unavailable(f"namespaces: {why}", "namespaces")
    async with runlevel.started(settings, check=True) as runtime:
        org = await runtime.local_org()
        row, _ = await runtime.sessions.create(org, SessionRequest(isolation="namespaces"))
        assert row.isolation == "namespaces-privileged"
        # users are compared as the uids the guest makes of them (issue 18): every spelling
        for user in ("root", "0", "00", "0000", "0000000000"):
            with pytest.raises(errors.InvalidRequest) as info:
                await runtime.sessions.exec(row.id, org, ExecRequest(command=["id"], user=user))
            assert info.value.errors is not None and info.value.errors[0]["field"] == "user"
        for user in ("+0", " 0", "\u0660"):  # not users at all: refused by the request's pattern
            with pytest.raises(ValidationError):
                ExecRequest(command=["id"], user=user)
        # the agent refuses uid 0 itself (--no-root), whatever the host let through
        live = runtime.sessions._live[row.id]
        for user in ("00", "root"):
            with pytest.raises(errors.InvalidRequest) as info:
                await live.sandbox.exec(["id", "-u"], user=user)
            assert info.value.errors is not None and info.value.errors[0]["field"] == "user"
        res = await runtime.sessions.exec(row.id, org, ExecRequest(command=["id", "-u"]))
        assert res.stdout == "1000\n"
        res = await runtime.sessions.exec(
            row.id, org, ExecRequest(command=["grep", "CapBnd", "/proc/self/status"])
        )
        assert int(res.stdout.split()[1], 16) == AGENT_CAP_MASK


# linux/capability.h numbers of ephemeral.sandbox.base.AGENT_CAPS
_CAP_NUMBERS = {
    "CAP_CHOWN": 0,
    "CAP_DAC_OVERRIDE": 1,
    "CAP_FOWNER": 3,
    "CAP_KILL": 5,
    "CAP_SETGID": 6,
    "CAP_SETUID": 7,
}
AGENT_CAP_MASK = sum(1 << _CAP_NUMBERS[name] for name in AGENT_CAPS)


async def test_root_and_worker_are_bounded_by_the_agents_six_capabilities(
    runtime: Runtime, org: str, isolation: str
) -> None:
    """On namespaces bwrap leaves the bounding set full; the agent cuts it (issue 18)."""
    assert len(AGENT_CAPS) == 6
    row, _ = await runtime.sessions.create(org, SessionRequest(isolation=isolation))
    status = "grep -E '^Cap(Bnd|Eff|Prm)' /proc/self/status"
    root = await runtime.sessions.exec(row.id, org, ExecRequest(command=status, user="root"))
    caps = {k.rstrip(":"): int(v, 16) for k, v in (ln.split() for ln in root.stdout.splitlines())}
    assert caps == {"CapBnd": AGENT_CAP_MASK, "CapEff": AGENT_CAP_MASK, "CapPrm": AGENT_CAP_MASK}
    worker = await runtime.sessions.exec(row.id, org, ExecRequest(command=status))
    caps = {k.rstrip(":"): int(v, 16) for k, v in (ln.split() for ln in worker.stdout.splitlines())}
    assert caps == {"CapBnd": AGENT_CAP_MASK, "CapEff": 0, "CapPrm": 0}


async def test_a_uid_outside_the_id_map_fails_that_exec_only(
    runtime: Runtime, org: str, isolation: str
) -> None:
    row, _ = await runtime.sessions.create(org, SessionRequest(isolation=isolation))
    # 70000 is past a namespaces sandbox's 65,536 ids; 2^32-1 and past are never uids
    outside = ["70000"] if isolation == "namespaces" else []
    for user in [*outside, "4294967295", "9999999999"]:
        with pytest.raises(errors.InvalidRequest) as info:
            await runtime.sessions.exec(row.id, org, ExecRequest(command=["id", "-u"], user=user))
        assert info.value.errors is not None and info.value.errors[0]["field"] == "user", user
        # and the session carries on
        res = await runtime.sessions.exec(row.id, org, ExecRequest(command=["id", "-u"]))
        assert (res.exit_code, res.stdout) == (0, "1000\n")
    res = await runtime.sessions.exec(
        row.id, org, ExecRequest(command=["id", "-u"], user="65534", cwd="/")
    )
    assert (res.exit_code, res.stdout) == (0, "65534\n")
    ended = await runtime.sessions.end(row.id, org)
    assert ended.status == "succeeded", ended.termination_detail


async def test_large_files_and_stdin_move_in_windows(
    runtime: Runtime, org: str, isolation: str
) -> None:
    row, _ = await runtime.sessions.create(
        org, SessionRequest(isolation=isolation, timeout_seconds=120)
    )
    blob = bytes(range(256)) * (80 << 12)  # 20 MiB: three 8 MiB windows
    await runtime.sessions.write_file(row.id, org, "big.bin", blob)
    assert await runtime.sessions.read_file(row.id, org, "big.bin") == blob
    with pytest.raises(errors.PayloadTooLarge):
        await runtime.sessions.read_file(row.id, org, "big.bin", max_bytes=len(blob) - 1)
    stdin = base64.b64encode(b"x" * (3 << 20)).decode()  # past INLINE_STDIN: via a file
    res = await runtime.sessions.exec(
        row.id, org, ExecRequest(command=["wc", "-c"], stdin_base64=stdin)
    )
    assert res.stdout.strip() == str(3 << 20)
    leftovers = await runtime.sessions.exec(
        row.id, org, ExecRequest(command="ls -a /tmp | grep -c ephemeral-stdin || true")
    )
    assert leftovers.stdout.strip() == "0"
    await runtime.sessions.end(row.id, org)


async def test_a_runtime_without_a_pool_gets_one_at_its_first_session(
    tmp_path: Path, isolation: str
) -> None:
    from ephemeral.settings import Settings

    settings = Settings.load(
        state_dir=tmp_path / "state", use_prefect=False, pool_size=1, isolation=isolation
    )
    async with runlevel.started(
        settings, check=True, warm_pool=False
    ) as runtime:  # as the API loop of `serve`
        assert runtime.sandboxes.pools == {}
        org = await runtime.local_org()
        first, _ = await runtime.sessions.create(org, SessionRequest(isolation=isolation))
        pool = runtime.sandboxes.pools[(isolation, settings.image)]
        await pool.wait_ready(PATIENCE)
        warm = {s.id for s in pool._ready}
        second, _ = await runtime.sessions.create(org, SessionRequest(isolation=isolation))
        assert second.sandbox_id in warm  # the second one came from the pool
        for row in (first, second):
            await runtime.sessions.end(row.id, org)


async def test_the_image_env_applies_to_exec(runtime: Runtime, org: str, isolation: str) -> None:
    built = built_image(runtime.settings, "python-dev")
    assert built.env.get("PIP_NO_INDEX") == "1"
    row, _ = await runtime.sessions.create(
        org, SessionRequest(isolation=isolation, image="python-dev")
    )
    try:
        res = await runtime.sessions.exec(row.id, org, ExecRequest(command="printenv PIP_NO_INDEX"))
        assert res.stdout == "1\n"
        res = await runtime.sessions.exec(
            row.id, org, ExecRequest(command="printenv PIP_NO_INDEX", env={"PIP_NO_INDEX": "0"})
        )
        assert res.stdout == "0\n"  # the caller's env wins
    finally:
        await runtime.sessions.end(row.id, org)
