"""The admin commands (orgs, keys) against a real store in a temp state dir."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ephemeral.cli import app
from ephemeral.errors import Unauthorized
from ephemeral.settings import Settings
from ephemeral.store import Principal, Store


@pytest.fixture
def cli(tmp_path: Path):
    runner = CliRunner()
    env = {"EPHEMERAL_STATE_DIR": str(tmp_path / "state"), "EPHEMERAL_DATABASE_URL": ""}

    def invoke(*args: str):
        return runner.invoke(app, list(args), env=env)

    invoke.state_dir = tmp_path / "state"  # type: ignore[attr-defined]
    return invoke


def _authenticate(state_dir: Path, plaintext: str) -> Principal:
    async def go() -> Principal:
        store = await Store.open(Settings.load(state_dir=state_dir).db_url)
        try:
            return await store.keys.authenticate(plaintext)
        finally:
            await store.close()

    return asyncio.run(go())


def test_org_lifecycle(cli) -> None:
    made = cli("orgs", "create", "acme")
    assert made.exit_code == 0, made.output
    assert "acme (org_" in made.output and "balance   $0.00 (0 micros)" in made.output
    credited = cli("orgs", "credit", "acme", "--usd", "10")
    assert credited.exit_code == 0, credited.output
    assert "balance   $10.00 (10000000 micros)" in credited.output
    assert cli("orgs", "credit", "acme", "--micros", "250").exit_code == 0
    shown = cli("orgs", "show", "acme")
    assert shown.exit_code == 0 and "10000250 micros" in shown.output
    assert "available $10.00025" in shown.output
    assert (Path(cli.state_dir) / "ephemeral.db").exists()


def test_org_errors_exit_nonzero_with_reason(cli) -> None:
    assert cli("orgs", "create", "acme").exit_code == 0
    dup = cli("orgs", "create", "acme")
    assert dup.exit_code == 3 and "already exists" in dup.output
    missing = cli("orgs", "show", "nope")
    assert missing.exit_code == 3 and "not found" in missing.output
    both = cli("orgs", "credit", "acme", "--usd", "1", "--micros", "1")
    assert both.exit_code == 2 and "exactly one" in both.output
    fine = cli("orgs", "credit", "acme", "--usd", "0.0000001")
    assert fine.exit_code == 2 and "--usd" in fine.output  # bad input


def test_keys_create_json_list_revoke(cli) -> None:
    assert cli("orgs", "create", "acme").exit_code == 0
    made = cli("keys", "create", "--org", "acme", "--member", "ada@example.com", "--json")
    assert made.exit_code == 0, made.output
    plaintext = json.loads(made.output)["key"]
    principal = _authenticate(cli.state_dir, plaintext)
    assert principal.member == "ada@example.com"

    human = cli("keys", "create", "--org", "acme", "--member", "bob@example.com")
    assert human.exit_code == 0 and "shown once" in human.output

    listed = cli("keys", "list", "--org", "acme")
    assert listed.exit_code == 0
    assert principal.key_id in listed.output and plaintext[:12] in listed.output
    assert plaintext not in listed.output

    revoked = cli("keys", "revoke", principal.key_id)
    assert revoked.exit_code == 0, revoked.output
    with pytest.raises(Unauthorized):
        _authenticate(cli.state_dir, plaintext)
    assert cli("keys", "revoke", "key_nope").exit_code == 3


def test_credit_reads_dollars_exactly_and_allows_a_debit(cli) -> None:
    # The parser itself is tested in tests/test_money.py; here the CLI wiring.
    assert cli("orgs", "create", "acme").exit_code == 0
    assert cli("orgs", "credit", "acme", "--usd", "$1.5").exit_code == 0
    debit = cli("orgs", "credit", "acme", "--usd", "-0.25")
    assert debit.exit_code == 0, debit.output
    assert "balance   $1.25 (1250000 micros)" in debit.output
