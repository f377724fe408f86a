"""Sandbox sessions on worker hosts (issue 22; docs/deploy.md, "Sessions on worker hosts").

Real processes, as ``tests/cluster/test_scaleout.py``: PostgreSQL 15 holding the store, one
``prefect server start``, two ``ephemeral serve`` with ``EPHEMERAL_EXECUTOR=dispatch`` and two
``ephemeral worker`` hosts, ``a`` and ``b``, with a 5 s lease and ``namespaces`` sandboxes. The
tests run in file order against one cluster: 40 sessions placed through one API process and
driven through the other (the first one killed), then ``kill -9`` of a host with live sessions.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from ephemeral.lifecycle import TERMINAL_STATUSES
from ephemeral.sandbox import handles
from tests.cluster.harness import Cluster
from tests.fixtures_pg import PgCluster
from tests.patience import PATIENCE

pytestmark = [pytest.mark.prefect, pytest.mark.postgres, pytest.mark.slow, pytest.mark.sandbox]

LEASE_SECONDS = 5.0
SESSION = {"shell": True, "timeout_seconds": 600, "max_cost_micros": 200_000}
N = 40


class Client:
    def __init__(self, url: str, key: str) -> None:
        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120
        )

    def create(self) -> dict[str, Any]:
        res = self.http.post("/v1/sandboxes", json=SESSION)
        assert res.status_code == 201, res.text
        obj = dict(res.json())
        assert obj["status"] == "running", obj
        return obj

    def exec(self, sid: str, command: str) -> httpx.Response:
        return self.http.post(f"/v1/sandboxes/{sid}/exec", json={"command": command})

    def get(self, sid: str) -> dict[str, Any]:
        res = self.http.get(f"/v1/sandboxes/{sid}")
        assert res.status_code == 200, res.text
        return dict(res.json())

    def events(self, sid: str) -> list[str]:
        return [e["type"] for e in self.http.get(f"/v1/runs/{sid}/events").json()]


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, postgres_cluster: PgCluster
) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("placed")
    db_url = postgres_cluster.url(postgres_cluster.create_database("placed"))
    c = Cluster(root, db_url, lease_seconds=LEASE_SECONDS, isolation="namespaces")
    try:
        c.start()
        c.api_key = c.make_key("acme", 100_000_000)
        c.api_url = c.start_api("api1")
        c.start_worker("a", limit=2, pool=1)
        c.start_worker("b", limit=2, pool=1)
        yield c
    finally:
        c.stop()


def rows(cluster: Cluster, ids: list[str]) -> dict[str, Any]:
    from ephemeral.store import Store

    async def go() -> dict[str, Any]:
        store = await Store.open(cluster.db_url)
        try:
            return {i: await store.runs.get(i) for i in ids}
        finally:
            await store.close()

    return asyncio.run(go())


def assert_money(obj: dict[str, Any]) -> None:
    cost = obj["cost"]
    assert cost["charged_micros"] + cost["refunded_micros"] == cost["reserved_micros"], obj


STATE: dict[str, Any] = {}


def test_forty_sessions_land_on_both_hosts_and_work_through_a_second_api(
    cluster: Cluster,
) -> None:
    first = Client(cluster.api_url, cluster.api_key)
    with ThreadPoolExecutor(8) as pool:
        made = list(pool.map(lambda _: first.create(), range(N)))
    ids = [m["id"] for m in made]
    by_host = {i: r.host for i, r in rows(cluster, ids).items()}
    assert set(by_host.values()) == {"a", "b"}, by_host
    api_pid = str(cluster.procs["api1"].pid)
    # owned by the host that runs them, not by the API process that admitted them
    assert all(r.owner and r.owner.split(":")[1] != api_pid for r in rows(cluster, ids).values())

    # the API process that placed them dies; a second one drives every session
    cluster.kill("api1")
    second = Client(cluster.start_api("api2"), cluster.api_key)
    cluster.api_url = str(second.http.base_url)

    def drive(i: int) -> None:
        sid = ids[i]
        out = second.exec(sid, f"echo hello-{i}; id -u")
        assert out.status_code == 200, out.text
        assert out.json()["stdout"] == f"hello-{i}\n1000\n"
        data = bytes(range(256)) * 40 + str(i).encode()
        put = second.http.put(f"/v1/sandboxes/{sid}/files", params={"path": "f.bin"}, content=data)
        assert put.status_code == 204, put.text
        got = second.http.get(f"/v1/sandboxes/{sid}/files", params={"path": "f.bin"})
        assert got.status_code == 200 and got.content == data
        missing = second.http.get(f"/v1/sandboxes/{sid}/files", params={"path": "nope"})
        assert missing.status_code == 404, missing.text
        timed = second.http.post(
            f"/v1/sandboxes/{sid}/exec", json={"command": "sleep 30", "timeout_seconds": 0.5}
        )
        assert timed.status_code == 200 and timed.json()["timed_out"] is True

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(drive, range(N)))

    # another org's key sees none of them, on the host either
    other = Client(str(second.http.base_url), cluster.make_key("other", 1_000_000))
    assert other.exec(ids[0], "true").status_code == 404
    assert other.http.delete(f"/v1/sandboxes/{ids[0]}").status_code == 404

    # half are ended through the second API: settled like local sessions, same events
    ended = ids[: N // 2]
    with ThreadPoolExecutor(8) as pool:
        done = list(pool.map(lambda s: second.http.delete(f"/v1/sandboxes/{s}"), ended))
    for res in done:
        assert res.status_code == 200, res.text
        obj = res.json()
        assert obj["status"] == "succeeded" and obj["usage"]["execs"] == 2, obj
        assert_money(obj)
        assert obj["cost"]["breakdown"]["compute_micros"] > 0
    types = second.events(ended[0])
    assert types[:4] == ["run.queued", "run.claimed", "sandbox.ready", "worker.started"]
    assert types.count("sandbox.exec") == 2
    assert types[-3:] == ["sandbox.destroyed", "run.succeeded", "run.settled"]
    gone = second.exec(ended[0], "true")
    assert gone.status_code == 409 and "has ended" in gone.json()["detail"]

    # a cancel through the runs API reaches the host through the store
    cancelled = ids[N // 2]
    res = second.http.post(f"/v1/runs/{cancelled}/cancel")
    assert res.status_code in (200, 202), res.text
    deadline = time.monotonic() + PATIENCE
    while second.get(cancelled)["status"] != "cancelled" and time.monotonic() < deadline:
        time.sleep(0.2)
    obj = second.get(cancelled)
    assert (obj["status"], obj["termination"]["reason"]) == ("cancelled", "cancelled"), obj
    assert_money(obj)
    assert "sandbox.destroyed" in second.events(cancelled)
    STATE["live"] = ids[N // 2 + 1 :]
    STATE["hosts"] = by_host


def test_sessions_of_a_killed_host_settle_and_answer_409(cluster: Cluster) -> None:
    api = Client(cluster.api_url, cluster.api_key)
    live: list[str] = STATE["live"]
    on_a = [s for s in live if STATE["hosts"][s] == "a"]
    on_b = [s for s in live if STATE["hosts"][s] == "b"]
    if not on_a or not on_b:  # the first test left live sessions on one host only: add some
        for _ in range(12):
            made = api.create()["id"]
            host = rows(cluster, [made])[made].host
            (on_a if host == "a" else on_b).append(made)
            if on_a and on_b:
                break
    assert on_a and on_b
    sandbox_ids = {r.sandbox_id for r in rows(cluster, on_a).values()}
    old = [
        h
        for _, h in handles.read_all(cluster.state_dir("a") / "sandboxes")
        if h is not None and h.id in sandbox_ids
    ]
    assert len(old) == len(on_a)

    cluster.kill("a")
    killed = time.monotonic()
    # a call to a dead host's session answers at once, clearly, never hangs
    res = api.exec(on_a[0], "true")
    assert res.status_code == 409, res.text
    assert "host a" in res.json()["detail"] or "has ended" in res.json()["detail"]
    # b's sessions carry on
    assert api.exec(on_b[0], "echo still").json()["stdout"] == "still\n"

    deadline = killed + PATIENCE  # settled by the lease (the detail below); how soon: bench/
    pending = set(on_a)
    while pending and time.monotonic() < deadline:
        for sid in list(pending):
            obj = api.get(sid)
            if obj["status"] in TERMINAL_STATUSES and "run.settled" in api.events(sid):
                pending.discard(sid)
        time.sleep(0.2)
    assert not pending, f"not settled: {sorted(pending)}"
    print(f"kill -9 -> {len(on_a)} sessions settled: {time.monotonic() - killed:.1f} s")
    for sid in on_a:
        obj = api.get(sid)
        assert obj["status"] == "failed", obj
        assert obj["termination"]["reason"] == "infra_error"
        assert_money(obj)
        types = api.events(sid)
        assert types.count("run.settled") == 1 and types.count("sandbox.destroyed") == 1
        after = api.exec(sid, "true")
        assert after.status_code == 409 and "has ended" in after.json()["detail"], after.text
        assert api.http.delete(f"/v1/sandboxes/{sid}").json()["status"] == "failed"
    detail = api.get(on_a[0])["termination"]["detail"]
    assert "host a stopped renewing" in detail or "process running this run died" in detail

    # a comes back: its reaper removes the dead worker's sandboxes, and it takes sessions again
    cluster.start_worker("a", limit=2, pool=1)
    left = [h for _, h in handles.read_all(cluster.state_dir("a") / "sandboxes") if h is not None]
    assert not {h.id for h in old} & {h.id for h in left}
    for h in old:
        assert not handles.pid_alive(h.host_pid, h.host_start_time)
    hosts = set()
    for _ in range(12):
        sid = api.create()["id"]
        assert api.exec(sid, "echo back").json()["stdout"] == "back\n"
        hosts.add(rows(cluster, [sid])[sid].host)
        assert api.http.delete(f"/v1/sandboxes/{sid}").status_code == 200
        if "a" in hosts:
            break
    assert "a" in hosts
    for sid in on_b:
        assert api.http.delete(f"/v1/sandboxes/{sid}").status_code == 200
    deadline = time.monotonic() + PATIENCE
    while cluster.org_reserved("acme") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster.org_reserved("acme") == 0
