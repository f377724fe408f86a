"""What a client sends a session is a module of its own (``ephemeral.sessions.requests``): the
HTTP client, the Inspect provider and Harbor's adapter build and validate a request without
loading the session manager, the sandbox layer, the broker or the store."""

from __future__ import annotations

import subprocess
import sys

HEAVY = (
    "ephemeral.sessions.manager",
    "ephemeral.sandbox",
    "ephemeral.broker",
    "ephemeral.store",
    "ephemeral.engine",
)


def test_a_request_is_built_without_the_manager() -> None:
    code = (
        "import sys\n"
        "from ephemeral.client import _exec_body\n"
        "from ephemeral.sessions.requests import SessionRequest\n"
        "assert _exec_body(['true'], {'stdin': b'x'})['stdin_base64'] == 'eA=='\n"
        "SessionRequest.model_validate({'isolation': 'namespaces', 'timeout_seconds': 60})\n"
        f"bad = sorted(m for m in sys.modules if m.startswith({HEAVY!r}))\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_an_exec_request_names_the_bad_field() -> None:
    from pydantic import ValidationError

    from ephemeral.sessions.requests import MAX_EXEC_OUTPUT, ExecRequest

    try:
        ExecRequest.model_validate({"command": ["true"], "max_output_bytes": MAX_EXEC_OUTPUT + 1})
    except ValidationError as exc:
        assert exc.errors()[0]["loc"] == ("max_output_bytes",)
    else:
        raise AssertionError("accepted an output cap past MAX_EXEC_OUTPUT")
