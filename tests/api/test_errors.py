"""Bad input: every error is problem+json naming the field (the shape is pinned here)."""

from __future__ import annotations

import base64

import httpx
import pytest

from ephemeral import errors
from ephemeral.api.limits import MAX_API_BODY_BYTES
from tests.api.conftest import SAMPLE_BODY, Member

PROBLEM_KEYS = {"type", "title", "status", "detail"}


def assert_problem(r: httpx.Response, status: int, fields: list[str] | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    body = r.json()
    assert PROBLEM_KEYS <= set(body) <= PROBLEM_KEYS | {"errors"}
    assert body["status"] == status
    assert body["type"].startswith("https://ephemeral.dev/errors/")
    assert isinstance(body["title"], str) and body["title"]
    assert isinstance(body["detail"], str) and body["detail"]
    if fields is not None:
        assert [e["field"] for e in body["errors"]] == fields
        for e in body["errors"]:
            assert set(e) == {"field", "message"} and e["message"]
            assert e["field"] in body["detail"]
    return body


@pytest.mark.parametrize(
    ("change", "fields"),
    [
        ({"colour": "blue"}, ["colour"]),
        ({"prompt": None}, ["prompt"]),
        ({"prompt": ""}, ["prompt"]),
        ({"prompt": "x" * 100_001}, ["prompt"]),
        ({"timeout_seconds": 0}, ["timeout_seconds"]),
        ({"timeout_seconds": 3601}, ["timeout_seconds"]),
        ({"max_cost_micros": 0}, ["max_cost_micros"]),
        ({"max_cost_micros": 100_000_001}, ["max_cost_micros"]),
        ({"web": "sometimes"}, ["web"]),
        ({"isolation": "docker"}, ["isolation"]),
        ({"model": "no-slash"}, ["model"]),
        ({"files": [{"path": "../etc/passwd", "content_base64": ""}]}, ["files[0].path"]),
        ({"files": [{"path": "a.txt", "content_base64": "%%%"}]}, ["files[0].content_base64"]),
        ({"connections": [{"name": "gh", "methods": ["BREW"]}]}, ["connections[0].methods"]),
    ],
)
async def test_invalid_bodies_are_422_naming_each_field(
    http: httpx.AsyncClient, member: Member, change: dict, fields: list[str]
) -> None:
    body = {**SAMPLE_BODY, **change}
    body = {k: v for k, v in body.items() if v is not None}
    r = await http.post("/v1/runs", json=body, headers=member.headers)
    problem = assert_problem(r, 422, fields)
    if "colour" in fields:
        assert problem["errors"][0]["message"] == "unknown field"


async def test_several_bad_fields_are_all_named(http: httpx.AsyncClient, member: Member) -> None:
    r = await http.post("/v1/runs", json={"timeout_seconds": 0, "extra": 1}, headers=member.headers)
    body = assert_problem(r, 422)
    assert {e["field"] for e in body["errors"]} == {"prompt", "timeout_seconds", "extra"}


async def test_unknown_model_is_422_naming_model(http: httpx.AsyncClient, member: Member) -> None:
    r = await http.post(
        "/v1/runs", json={**SAMPLE_BODY, "model": "replay/no-such-cassette"}, headers=member.headers
    )
    assert_problem(r, 422, ["model"])


async def test_invalid_json_is_422(http: httpx.AsyncClient, member: Member) -> None:
    r = await http.post(
        "/v1/runs",
        content=b'{"prompt": ',
        headers={**member.headers, "Content-Type": "application/json"},
    )
    assert_problem(r, 422, ["body"])
    r = await http.post("/v1/runs", json=["prompt"], headers=member.headers)
    assert_problem(r, 422, ["body"])


async def test_wrong_content_type_is_415(http: httpx.AsyncClient, member: Member) -> None:
    r = await http.post(
        "/v1/runs",
        content=b"prompt=hi",
        headers={**member.headers, "Content-Type": "application/x-www-form-urlencoded"},
    )
    assert_problem(r, 415, ["Content-Type"])
    r = await http.post("/v1/runs", content=b'{"prompt":"hi"}', headers=member.headers)
    assert_problem(r, 415, ["Content-Type"])


async def test_oversized_body_is_413_before_parsing(
    http: httpx.AsyncClient, member: Member
) -> None:
    blob = base64.b64encode(b"\0" * (MAX_API_BODY_BYTES * 3 // 4 + 1024)).decode()
    body = {**SAMPLE_BODY, "files": [{"path": "big.bin", "content_base64": blob}]}
    r = await http.post("/v1/runs", json=body, headers=member.headers)
    assert_problem(r, 413, ["body"])


async def test_oversized_chunked_body_is_413(http: httpx.AsyncClient, member: Member) -> None:
    async def chunks():
        piece = b" " * (1 << 20)
        for _ in range(MAX_API_BODY_BYTES // len(piece) + 2):
            yield piece

    r = await http.post(
        "/v1/runs", content=chunks(), headers={**member.headers, "Content-Type": "application/json"}
    )
    assert_problem(r, 413)


async def test_unknown_routes_and_methods_are_problems(http: httpx.AsyncClient) -> None:
    assert_problem(await http.get("/v1/nothing-here"), 404)
    assert_problem(await http.put("/v1/runs", json={}), 405)


async def test_every_error_class_renders_the_pinned_shape() -> None:
    for cls in errors.ALL_ERRORS:
        exc = cls("something specific", errors=[{"field": "f", "message": "m"}])
        problem = exc.to_problem()
        assert set(problem) == PROBLEM_KEYS | {"errors"}
        assert problem["status"] == cls.status
        assert errors.error_for(cls.status, problem["type"].rsplit("/", 1)[-1]) is cls
