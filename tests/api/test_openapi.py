"""The checked-in OpenAPI document is the code's, and the server keeps to it (schemathesis)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from ephemeral.api.spec import render
from ephemeral.settings import Settings
from tests.api.server import LiveServer, live_server

DOC = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"


def test_checked_in_openapi_matches_the_code() -> None:
    current = render()
    assert DOC.read_text() == current, (
        "docs/openapi.json is stale: run `python -m ephemeral.api.spec > docs/openapi.json`"
    )


def test_every_route_documents_its_errors_as_problem_json() -> None:
    doc = json.loads(DOC.read_text())
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            if path == "/healthz":
                continue
            assert "401" in op["responses"], (method, path)
            for status, response in op["responses"].items():
                if int(status) >= 400:
                    assert list(response["content"]) == ["application/problem+json"], (path, status)


@pytest.fixture
def server(api_settings: Settings) -> Iterator[LiveServer]:
    with live_server(api_settings) as srv:
        yield srv


@pytest.mark.sandbox
@pytest.mark.slow
def test_schemathesis_finds_no_server_errors_or_contract_breaks(server: LiveServer) -> None:
    key = server.member("fuzz", usd_micros=10_000_000)
    schema = schemathesis.openapi.from_dict(json.loads(DOC.read_text()))
    auth = {"Authorization": f"Bearer {key}"}
    checked = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path == "/v1/isolation":
            continue  # probes every isolation level (tested in test_runs_api, marked slow)

        @settings(
            max_examples=8,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def check(case: schemathesis.Case) -> None:
            # Schema-valid is not always acceptable: base64 content, path rules, the balance, the
            # host's isolation levels and the price book are checked beyond JSON Schema (422/402).
            case.call_and_validate(
                base_url=server.url,
                headers=auth,
                timeout=30,
                excluded_checks=[positive_data_acceptance],
            )

        check()
        checked += 1
    assert checked >= 6
