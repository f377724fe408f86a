"""A session's writable root sized by its request (issue 36, item 7): ``disk_mib`` above
``disk_tmpfs_max_mib`` is disk-backed and may exceed the memory limit; past the host's
``disk_max_mib`` the request is a 422 naming the field. The real app, runtime and sandboxes."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from ephemeral.sandbox.registry import probe_level
from ephemeral.settings import Settings
from tests.api.conftest import Member
from tests.drivers import unavailable

pytestmark = pytest.mark.sandbox


async def test_a_session_writes_more_than_its_memory_and_reads_it_back(
    http: httpx.AsyncClient, member: Member, isolation: str
) -> None:
    body = {"isolation": isolation, "timeout_seconds": 600, "disk_mib": 1024}
    r = await http.post("/v1/sandboxes", json=body, headers=member.headers)
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    assert r.json()["policy"]["disk_mib"] == 1024

    async def run(command: str) -> dict[str, object]:
        r = await http.post(
            f"/v1/sandboxes/{sid}/exec",
            json={"command": command, "timeout_seconds": 600},
            headers=member.headers,
            timeout=700,
        )
        assert r.status_code == 200, r.text
        return dict(r.json())

    try:
        # 700 MiB: more than the session's whole memory limit (512 MiB)
        wrote = await run("head -c 700M /dev/urandom | tee /tmp/big | sha256sum")
        assert wrote["exit_code"] == 0, wrote
        back = await run("sha256sum /tmp/big | cut -d' ' -f1; stat -c %s /tmp/big")
        digest, size = str(back["stdout"]).split()
        assert (digest, int(size)) == (str(wrote["stdout"]).split()[0], 700 << 20), back
    finally:
        closed = await http.delete(f"/v1/sandboxes/{sid}", headers=member.headers)
        assert closed.status_code == 200, closed.text


@pytest.mark.parametrize("path", ["/v1/sandboxes", "/v1/runs"])
async def test_a_disk_past_the_hosts_cap_is_a_422_naming_disk_mib(
    http: httpx.AsyncClient, member: Member, path: str
) -> None:
    body: dict[str, object] = {"timeout_seconds": 60, "disk_mib": 10241}  # the cap is 10240
    if path == "/v1/runs":
        body.update(prompt="hi", model="replay/sandbox-proof")
    r = await http.post(path, json=body, headers=member.headers)
    assert r.status_code == 422, r.text
    (item,) = r.json()["errors"]
    assert item["field"] == "disk_mib" and "10240" in item["message"], item
    body["disk_mib"] = 8  # below the least a request may ask
    r = await http.post(path, json=body, headers=member.headers)
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "disk_mib", r.text


@pytest.mark.parametrize("path", ["/v1/sandboxes", "/v1/runs"])
async def test_a_microvm_refuses_a_disk_it_would_hold_in_memory(
    http: httpx.AsyncClient, member: Member, path: str, tmp_path: Path
) -> None:
    # No disk-backed layer in a microVM yet: its root is a tmpfs in the guest's memory, so a
    # disk_mib past disk_tmpfs_max_mib (256) is refused by name, not an out-of-memory guest.
    why = await probe_level("microvm-tcg", Settings.load(state_dir=tmp_path / "probe"))
    if why is not None:
        unavailable(f"microvm-tcg: {why}", "microvm-tcg")
    body: dict[str, object] = {"isolation": "microvm-tcg", "timeout_seconds": 60, "disk_mib": 257}
    if path == "/v1/runs":
        body.update(prompt="hi", model="replay/sandbox-proof")
    r = await http.post(path, json=body, headers=member.headers)
    assert r.status_code == 422, r.text
    (item,) = r.json()["errors"]
    assert item["field"] == "disk_mib" and "256" in item["message"], item
