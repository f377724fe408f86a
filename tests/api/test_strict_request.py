"""The run request is strict: every field refuses every JSON type it is not, naming the field.

A permission is a JSON boolean and a limit a JSON integer: ``"web": "yes"``, ``"shell": 1`` or
``"timeout_seconds": "30"`` are refused with 422, never coerced. The same policy model serves the
recipes (tests/recipes/test_recipe_errors.py checks them with file and line).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from ephemeral.policy import Connection, FileSpec, Policy, RunRequest
from tests.api.conftest import SAMPLE_BODY, Member
from tests.api.test_errors import assert_problem

# One value of each JSON type; numbers come as an integer and as a fraction.
JSON_VALUES: dict[str, list[Any]] = {
    "string": ["30", "true", "yes"],
    "integer": [1, 0],
    "fraction": [30.5],
    "boolean": [True, False],
    "null": [None],
    "array": [[]],
    "object": [{}],
}

# The JSON types each field accepts (everything else must be a 422 naming it).
REQUEST_FIELDS: dict[str, set[str]] = {
    "prompt": {"string"},
    "model": {"string", "null"},
    "web": {"boolean"},
    "shell": {"boolean"},
    "zero_data_retention": {"boolean"},
    "timeout_seconds": {"integer"},
    "max_cost_micros": {"integer"},
    "isolation": {"string"},
    "files": {"array"},
    "connections": {"array"},
    "image": {"string", "null"},
    "disk_mib": {"integer", "null"},
    "setup": {"array"},
    "verify": {"array"},
    "verify_timeout_seconds": {"integer", "null"},
    "verify_files": {"array"},
    "models": {"array"},
    "agent": {"object", "null"},
    "labels": {"object"},
}
FILE_FIELDS = {"path": {"string"}, "content_base64": {"string"}}
CONNECTION_FIELDS = {"name": {"string"}, "methods": {"array"}, "paths": {"array"}}


def _body(field: str, value: Any) -> dict[str, Any]:
    if field.startswith("files[0]."):
        item = {"path": "a.txt", "content_base64": "", field.removeprefix("files[0]."): value}
        return {**SAMPLE_BODY, "files": [item]}
    if field.startswith("connections[0]."):
        item = {"name": "gh", field.removeprefix("connections[0]."): value}
        return {**SAMPLE_BODY, "connections": [item]}
    return {**SAMPLE_BODY, field: value}


def _cases() -> list[tuple[str, str, Any]]:
    fields = {
        **REQUEST_FIELDS,
        **{f"files[0].{k}": v for k, v in FILE_FIELDS.items()},
        **{f"connections[0].{k}": v for k, v in CONNECTION_FIELDS.items()},
        "files[0]": {"object"},
        "connections[0]": {"object"},
    }
    cases = []
    for field, accepted in fields.items():
        for kind, values in JSON_VALUES.items():
            if kind in accepted:
                continue
            for value in values:
                cases.append((field, kind, value))
    return cases


def test_the_table_covers_every_field_of_the_request() -> None:
    assert set(REQUEST_FIELDS) == set(RunRequest.model_fields)
    assert set(RunRequest.model_fields) - {"prompt", "model", "labels"} == set(Policy.model_fields)
    assert set(FILE_FIELDS) == set(FileSpec.model_fields)
    assert set(CONNECTION_FIELDS) == set(Connection.model_fields)


@pytest.mark.parametrize(("field", "kind", "value"), _cases())
async def test_every_wrong_json_type_is_422_naming_the_field(
    http: httpx.AsyncClient, member: Member, field: str, kind: str, value: Any
) -> None:
    if field in ("files[0]", "connections[0]"):
        body = {**SAMPLE_BODY, field.removesuffix("[0]"): [value]}
    else:
        body = _body(field, value)
    r = await http.post("/v1/runs", json=body, headers=member.headers)
    problem = assert_problem(r, 422)
    named = {e["field"] for e in problem["errors"]}
    assert named == {field}, (kind, value, problem)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("web", "yes", "must be a JSON boolean (true or false)"),
        ("shell", 1, "must be a JSON boolean (true or false)"),
        ("timeout_seconds", "30", "must be a JSON integer"),
    ],
)
async def test_coercions_of_the_issue_are_refused(
    http: httpx.AsyncClient, member: Member, field: str, value: Any, message: str
) -> None:
    r = await http.post("/v1/runs", json={**SAMPLE_BODY, field: value}, headers=member.headers)
    problem = assert_problem(r, 422, [field])
    assert problem["errors"][0]["message"] == message


async def test_two_files_with_one_path_are_422_naming_the_second(
    http: httpx.AsyncClient, member: Member
) -> None:
    same = {"path": "data.csv", "content_base64": ""}
    body = {**SAMPLE_BODY, "files": [same, same]}
    r = await http.post("/v1/runs", json=body, headers=member.headers)
    problem = assert_problem(r, 422, ["files[1].path"])
    assert "duplicate path" in problem["errors"][0]["message"]
    assert "files[0]" in problem["errors"][0]["message"]


async def test_two_connections_with_one_name_are_422_naming_the_second(
    http: httpx.AsyncClient, member: Member
) -> None:
    body = {**SAMPLE_BODY, "connections": [{"name": "gh"}, {"name": "gh"}]}
    r = await http.post("/v1/runs", json=body, headers=member.headers)
    assert_problem(r, 422, ["connections[1].name"])


def test_a_request_carries_exactly_its_policy() -> None:
    request = RunRequest(prompt="p", web=True, timeout_seconds=30)
    policy = request.policy()
    assert type(policy) is Policy
    assert policy == Policy(web=True, timeout_seconds=30)
