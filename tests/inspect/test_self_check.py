"""Inspect AI's own provider conformance battery (``inspect_ai.util._sandbox.self_check``, 44
checks in 0.3.285) against the ``ephemeral`` provider on gvisor and namespaces in process (and
microvm-tcg, in the slow set), on gvisor through a real server's session API
(``EPHEMERAL_URL``), and against Inspect's ``local`` provider for comparison. Results and
reasons: docs/integrations.md.

The checks are Inspect's code, imported as-is; this module only supplies the ``sandbox_env``
fixture the way Inspect's own runner does: ``task_init`` + ``sample_init`` once per provider
(module scope, one event loop), and each check marks the failures known for its provider as
strict xfails, each with its reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

pytest.importorskip("inspect_ai", reason="the inspect extra is not installed")

from inspect_ai.util import ExecResult, SandboxEnvironment
from inspect_ai.util._sandbox.local import LocalSandboxEnvironment
from inspect_ai.util._sandbox.self_check import *  # noqa: F403

from ephemeral.inspect_provider import EphemeralSandboxConfig, EphemeralSandboxEnvironment
from ephemeral.sandbox.registry import probe_level
from ephemeral.settings import Settings
from tests.api.server import live_server
from tests.drivers import unavailable
from tests.patience import PATIENCE

pytestmark = [pytest.mark.sandbox, pytest.mark.asyncio(loop_scope="module")]

# check name -> reason, per provider. Everything else must pass: on every level of ours all 44
# (the writable root of issue 23 lets `adduser` run as root, then exec as the new user).
KNOWN_FAILURES: dict[str, dict[str, str]] = {
    "gvisor": {},
    "gvisor-http": {},
    "microvm-tcg": {},
    "namespaces": {},
    "local": {
        # Inspect's local provider runs commands as the invoking user on the host
        "test_exec_as_user": "local refuses any user but the current one "
        "(SandboxUserUnsupportedError)",
        "test_exec_timeout_not_raised_on_fast_signal_death": "local reports a command killed by "
        "SIGTERM as returncode -15 (Python's subprocess convention), not the shell's 143",
    },
}
if os.geteuid() == 0:  # as root (make test here, CI) local bypasses file permissions
    KNOWN_FAILURES["local"] |= {
        "test_read_file_not_allowed": "run as root: root reads a chmod -r file",
        "test_write_text_file_without_permissions": "run as root: root writes a chmod -w file",
        "test_write_binary_file_without_permissions": "run as root: root writes a chmod -w file",
    }
# Checks whose exec timeout bounds a hang, not a speed: there it is PATIENCE. Inspect's
# test_exec_as_user gives adduser 10 s ("in one case adduser decided to ask for input which
# caused the test to hang indefinitely"), and adduser (a Perl script) on microvm-tcg at load 20
# took longer. The checks of timeouts themselves (test_exec_timeout*) keep theirs.
HANG_BOUNDS = {"test_exec_as_user"}
# microvm-tcg (software emulation) is slow: in the slow set, like the other TCG tests
PROVIDERS = [
    "gvisor",
    "namespaces",
    "gvisor-http",
    pytest.param("microvm-tcg", marks=pytest.mark.slow),
    "local",
]


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=PROVIDERS)
async def provider_env(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[str, SandboxEnvironment]]:
    name = str(request.param)
    task = f"self-check-{name}"
    if name == "local":
        await LocalSandboxEnvironment.task_init(task, None)
        envs = await LocalSandboxEnvironment.sample_init(task, None, {})
        yield name, envs["default"]
        await LocalSandboxEnvironment.sample_cleanup(task, None, envs, False)
        await LocalSandboxEnvironment.task_cleanup(task, None, True)
        return
    level = name.removesuffix("-http")
    state = tmp_path_factory.mktemp(f"state-{name}")
    settings = Settings.load(state_dir=Path(state), use_prefect=False, pool_size=1)
    why = await probe_level(level, settings)
    if why is not None:
        unavailable(f"{level}: {why}", level)
    mp = pytest.MonkeyPatch()
    server = contextlib.ExitStack()
    mp.setenv("EPHEMERAL_STATE_DIR", str(state))
    mp.delenv("EPHEMERAL_URL", raising=False)
    if name.endswith("-http"):
        live = server.enter_context(live_server(settings, warm_pool=True))
        mp.setenv("EPHEMERAL_URL", live.url)
        mp.setenv("EPHEMERAL_API_KEY", await asyncio.to_thread(live.member, "inspect"))
    config = EphemeralSandboxConfig(isolation=level, timeout_seconds=1800, pool_size=1)
    try:
        await EphemeralSandboxEnvironment.task_init(task, config)
        envs = await EphemeralSandboxEnvironment.sample_init(task, config, {})
        yield name, envs["default"]
        await EphemeralSandboxEnvironment.sample_cleanup(task, config, envs, False)
        await EphemeralSandboxEnvironment.task_cleanup(task, config, True)
    finally:
        mp.undo()
        server.close()


@pytest_asyncio.fixture(loop_scope="module")
async def sandbox_env(
    request: pytest.FixtureRequest,
    provider_env: tuple[str, SandboxEnvironment],
    monkeypatch: pytest.MonkeyPatch,
) -> SandboxEnvironment:
    name, env = provider_env
    reason = KNOWN_FAILURES[name].get(request.node.originalname)
    if reason is not None:
        request.node.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    if request.node.originalname in HANG_BOUNDS:
        bounded = env.exec

        async def exec(cmd: list[str], timeout: int | None = None, **kw: Any) -> ExecResult[str]:
            return await bounded(cmd, timeout=None if timeout is None else int(PATIENCE), **kw)

        monkeypatch.setattr(env, "exec", exec)  # this check only: the env is the module's
    return env
