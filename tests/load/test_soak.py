"""Under load with Prefect failing, every run still settles and nobody pays for the queue.

A real ``prefect server`` behind :class:`FaultProxy` (10 % of API calls answered 503, 5 %
dropped without an answer; Prefect's own client retries only once, so failures reach our code),
a real ``ephemeral serve`` subprocess pointed at it (4 slots, at most 4 waiting, so 12 clients
also meet 429s), and 24 runs driven at 12 concurrent clients through the public API by the same
code as ``bench/soak.py``: every client takes a second run while others still queue, so
admission, the queue and settling all run at once. Correctness only; the load figures (hundreds
of runs, 16 and 64 clients, 8 slots) and the timings belong to the bench (``make bench``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.served import Served, make_key, serve
from bench.soak import analyse, compute_rate, drive, one_run
from ephemeral import prefect_setup
from ephemeral.settings import Settings
from ephemeral.store import Store
from tests.evals.prefect_server import PrefectServer
from tests.load.fault_proxy import FaultProxy

pytestmark = [pytest.mark.sandbox, pytest.mark.prefect, pytest.mark.slow]

RUNS = 24
CLIENTS = 12
SLOTS = 4
QUEUED = 4  # SLOTS + QUEUED < CLIENTS: the first burst meets 429s


@pytest.fixture
def faulty_prefect(tmp_path: Path) -> Iterator[FaultProxy]:
    template = prefect_setup.ensure_template(Settings.load(state_dir=tmp_path / "state"))
    server = PrefectServer(tmp_path / "prefect-server", template=template)
    try:
        server.start()
        proxy = FaultProxy(server.port, p_unavailable=0.10, p_drop=0.05).start()
        try:
            yield proxy
        finally:
            proxy.stop()
    finally:
        server.stop()


@pytest.fixture
def served(tmp_path: Path, faulty_prefect: FaultProxy) -> Iterator[tuple[Served, str]]:
    state = tmp_path / "state"
    key = asyncio.run(make_key(Settings.load(state_dir=state), org="soak"))
    env = {
        "PREFECT_API_URL": f"{faulty_prefect.url}/api",
        "PREFECT_CLIENT_MAX_RETRIES": "1",
        "EPHEMERAL_MAX_CONCURRENT_RUNS": str(SLOTS),
        "EPHEMERAL_MAX_QUEUED_RUNS": str(QUEUED),
    }
    server = serve(state, pool=2, env=env)
    try:
        yield server, key
    finally:
        server.stop()


# Correctness, not speed: on a loaded 2-core box (another test process beside it) the runs take
# minutes; a run counts as stuck only past STUCK_AFTER.
STUCK_AFTER = 480


@pytest.mark.timeout(STUCK_AFTER + 300)
def test_every_run_settles_under_prefect_faults(
    served: tuple[Served, str], faulty_prefect: FaultProxy
) -> None:
    server, key = served
    outcomes, _wall = asyncio.run(drive(server.url, key, RUNS, CLIENTS, stuck_after=STUCK_AFTER))
    stats = analyse(outcomes, compute_rate(server.settings))
    assert faulty_prefect.counts["503"] + faulty_prefect.counts["drop"] > 0, faulty_prefect.counts
    assert sum(stats["statuses"].values()) == RUNS
    assert stats["throttled"] > 0  # the admission limit was reached: this was load
    assert stats["statuses"].get("never-admitted", 0) == 0, stats["errors"]
    assert stats["stuck"] == [], server.log.read_text()[-3000:]
    assert stats["unbalanced"] == []
    assert stats["charged_while_queued"] == []
    for outcome in outcomes:
        types = [e["type"] for e in outcome.events]
        assert types[0] == "run.queued" and types[-1] == "run.settled"
        assert f"run.{outcome.run['status']}" in types  # type: ignore[index]

    async def org_reserved() -> int:
        store = await Store.open(server.settings.db_url)
        try:
            return (await store.orgs.get("soak")).reserved_micros
        finally:
            await store.close()

    assert asyncio.run(org_reserved()) == 0

    # Faults over: the same server still serves, and a run goes through.
    faulty_prefect.calm()
    assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200

    async def after() -> str:
        async with httpx.AsyncClient(
            base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60
        ) as client:
            outcome = await one_run(client, 120)
        assert outcome.settled
        return str((outcome.run or {}).get("status"))

    assert asyncio.run(after()) == "succeeded"
