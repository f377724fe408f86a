"""Inspect AI's provider battery (``inspect_ai.util._sandbox.self_check``, as
``tests/inspect/test_self_check.py`` runs it) against a cluster API (``EPHEMERAL_URL``) whose
sessions are placed on worker hosts (issue 22): PostgreSQL, one ``prefect server``, one
``ephemeral serve`` with ``EPHEMERAL_EXECUTOR=dispatch`` and two ``ephemeral worker``s, gvisor.
The provider is unchanged; the known failure is the one of the in-process ``gvisor-http``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

pytest.importorskip("inspect_ai", reason="the inspect extra is not installed")

from inspect_ai.util import SandboxEnvironment
from inspect_ai.util._sandbox.self_check import *  # noqa: F403

from ephemeral.inspect_provider import EphemeralSandboxConfig, EphemeralSandboxEnvironment
from ephemeral.sandbox.registry import probe_level
from ephemeral.settings import Settings
from tests.cluster.harness import Cluster
from tests.drivers import unavailable
from tests.fixtures_pg import PgCluster
from tests.inspect.test_self_check import KNOWN_FAILURES

pytestmark = [
    pytest.mark.prefect,
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.sandbox,
    pytest.mark.asyncio(loop_scope="module"),
]
LEVEL = "gvisor"


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, postgres_cluster: PgCluster
) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("inspect-cluster")
    why = asyncio.run(probe_level(LEVEL, Settings.load(state_dir=root / "probe")))
    if why is not None:
        unavailable(f"{LEVEL}: {why}", LEVEL)
    db_url = postgres_cluster.url(postgres_cluster.create_database("inspect"))
    c = Cluster(root, db_url, lease_seconds=10, isolation=LEVEL)
    try:
        c.start()
        c.api_key = c.make_key("inspect", 100_000_000)
        c.api_url = c.start_api()
        c.start_worker("a", limit=1, pool=1)
        c.start_worker("b", limit=1, pool=1)
        yield c
    finally:
        c.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def provider_env(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SandboxEnvironment]:
    mp = pytest.MonkeyPatch()
    mp.setenv("EPHEMERAL_STATE_DIR", str(tmp_path_factory.mktemp("client")))
    mp.setenv("EPHEMERAL_URL", cluster.api_url)
    mp.setenv("EPHEMERAL_API_KEY", cluster.api_key)
    task = "self-check-cluster"
    config = EphemeralSandboxConfig(isolation=LEVEL, timeout_seconds=1800, pool_size=1)
    try:
        await EphemeralSandboxEnvironment.task_init(task, config)
        envs = await EphemeralSandboxEnvironment.sample_init(task, config, {})
        yield envs["default"]
        await EphemeralSandboxEnvironment.sample_cleanup(task, config, envs, False)
        await EphemeralSandboxEnvironment.task_cleanup(task, config, True)
    finally:
        mp.undo()


@pytest_asyncio.fixture(loop_scope="module")
async def sandbox_env(
    request: pytest.FixtureRequest, provider_env: SandboxEnvironment
) -> SandboxEnvironment:
    reason = KNOWN_FAILURES["gvisor-http"].get(request.node.originalname)
    if reason is not None:
        request.node.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    return provider_env


async def test_the_battery_ran_on_a_worker_host(
    cluster: Cluster, provider_env: SandboxEnvironment
) -> None:
    """Last in the file: the battery's session was placed on a worker, not the API process."""
    import sqlalchemy as sa

    from ephemeral.store import Store
    from ephemeral.store.schema import runs

    store = await Store.open(cluster.db_url)
    try:
        org = await store.orgs.get("inspect")
        async with store.engine.connect() as conn:
            got = await conn.execute(
                sa.select(runs.c.host).where(runs.c.org_id == org.id, runs.c.kind == "session")
            )
            found = {r[0] for r in got}
    finally:
        await store.close()
    assert found and found <= {"a", "b"}, found
