"""``GET /v1/images`` and runs that name an image, over the real app and real sandboxes."""

from __future__ import annotations

import httpx
import pytest

from ephemeral.engine.runtime import Runtime
from ephemeral.sandbox import images
from ephemeral.settings import Settings
from tests.api.conftest import SAMPLE_BODY, Member, write_cassette
from tests.api.test_errors import assert_problem
from tests.drivers import built_image
from tests.run.conftest import turn

pytestmark = pytest.mark.sandbox


def _needs_python_dev(settings: Settings) -> images.ImageConfig:
    built = built_image(settings, "python-dev")
    return built


async def test_images_lists_the_built_images(
    http: httpx.AsyncClient, member: Member, api_settings: Settings
) -> None:
    built = _needs_python_dev(api_settings)
    r = await http.get("/v1/images", headers=member.headers)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["default"] == "default"
    by_name = {i["name"]: i for i in body["images"]}
    assert {"default", "python-dev"} <= set(by_name)
    dev = by_name["python-dev"]
    assert dev["hash"] == built.hash and dev["base"] == "default"
    assert dev["size_bytes"] > by_name["default"]["size_bytes"] > 10_000_000
    assert dev["built_at"].endswith("Z")
    assert (await http.get("/v1/images")).status_code == 401


async def test_a_run_on_python_dev_runs_pytest_and_is_verified(
    http: httpx.AsyncClient, member: Member, runtime: Runtime, api_settings: Settings
) -> None:
    built = _needs_python_dev(api_settings)
    model = write_cassette(
        api_settings.cassettes_dir,
        "api-pytest",
        [turn("python3 -m pytest -q"), turn(final="pytest passed")],
    )
    test_file = "ZGVmIHRlc3RfaXQoKToKICAgIGFzc2VydCAxICsgMSA9PSAyCg=="  # def test_it(): 1 + 1 == 2
    body = {
        **SAMPLE_BODY,
        "model": model,
        "image": "python-dev",
        "files": [{"path": "test_sum.py", "content_base64": test_file}],
        "setup": ["python3 -c 'import pytest'"],
        "verify": ["python3 -m pytest -q"],
        "verify_timeout_seconds": 20,
    }
    r = await http.post("/v1/runs", json=body, headers=member.headers)
    assert r.status_code == 201, r.text
    run = r.json()
    assert run["policy"]["image"] == "python-dev"
    await runtime.wait(run["id"], 90)
    got = (await http.get(f"/v1/runs/{run['id']}", headers=member.headers)).json()
    assert got["status"] == "succeeded", got["termination"]
    assert got["image"] == "python-dev" and got["image_hash"] == built.hash
    events = (await http.get(f"/v1/runs/{run['id']}/events", headers=member.headers)).json()
    shell = next(e["data"] for e in events if e["type"] == "shell.executed")
    assert shell["exit_code"] == 0 and "1 passed" in shell["stdout"]
    verify = [e["data"] for e in events if e["type"] == "verify.executed"]
    assert len(verify) == 1 and verify[0]["exit_code"] == 0 and "1 passed" in verify[0]["stdout"]
    ready = next(e["data"] for e in events if e["type"] == "sandbox.ready")
    assert ready["image"] == "python-dev" and ready["image_hash"] == built.hash


async def test_an_unbuilt_image_is_422_naming_image_with_the_available_ones(
    http: httpx.AsyncClient, member: Member, runtime: Runtime
) -> None:
    r = await http.post(
        "/v1/runs", json={**SAMPLE_BODY, "image": "no-such-image"}, headers=member.headers
    )
    problem = assert_problem(r, 422)
    assert [e["field"] for e in problem["errors"]] == ["image"]
    assert "'no-such-image' is not built" in problem["detail"]
    assert "available: default" in problem["detail"]
    # refused before any reservation
    assert (await runtime.store.orgs.get(member.org_id)).reserved_micros == 0


async def test_verify_slice_must_leave_the_agent_time(
    http: httpx.AsyncClient, member: Member
) -> None:
    body = {**SAMPLE_BODY, "timeout_seconds": 30, "verify": ["true"], "verify_timeout_seconds": 30}
    problem = assert_problem(await http.post("/v1/runs", json=body, headers=member.headers), 422)
    assert [e["field"] for e in problem["errors"]] == ["verify_timeout_seconds"]
