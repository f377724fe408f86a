"""Real tools through egress on the ``python-dev`` image (git, pip): ``git clone`` from a local
smart-HTTP server and ``pip install`` from a local index, each with a web allow list; and the
pip recipe end to end through ``ephemeral eval``.

These need a run to name an image (the ``image`` field) and ``python-dev`` built; where either is
missing they skip with the reason.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from ephemeral.engine.runtime import Runtime
from ephemeral.settings import Settings
from tests.broker.conftest import events_of
from tests.drivers import built_image
from tests.egress.conftest import Names, provisioned, sh
from tests.egress.servers import PACKAGE, git_http, make_repo, package_index
from tests.evals.conftest import REPO, cli

pytestmark = [pytest.mark.sandbox]

RECIPE_PORT = 38517  # fixed in recipes/evals/pip-from-allowed-index.yaml and its cassette


async def test_git_clone_over_smart_http(
    runtime: Runtime, names: Names, isolation: str, tmp_path: Path
) -> None:
    built_image(runtime.settings, "python-dev")
    names.set("git.test", "127.0.0.1")
    make_repo(tmp_path)
    with git_http(tmp_path) as (port, seen):
        async with provisioned(
            runtime, isolation, image="python-dev", web={"allow": ["git.test"]}
        ) as agent:
            res = await sh(
                agent,
                f"git clone -q http://git.test:{port}/probe.git /tmp/c && cat /tmp/c/README",
                timeout=60,
            )
            assert res.exit_code == 0, res.stderr
            assert res.stdout == "cloned through the broker\n"
            refused = await sh(agent, f"git clone -q http://other.test:{port}/probe.git /tmp/d")
            assert refused.exit_code != 0
    assert seen[0] == "GET /probe.git/info/refs?service=git-upload-pack"
    assert any(s.startswith("POST /probe.git/git-upload-pack") for s in seen)
    requested = [e.data for e in await events_of(agent, "web.requested")]
    assert requested and all(r["host"] == "git.test" for r in requested)
    assert all("?" not in r.get("path", "") for r in requested)  # no query string recorded


@pytest.mark.timeout(420)
async def test_pip_install_from_a_local_index(
    runtime: Runtime, names: Names, isolation: str
) -> None:
    built_image(runtime.settings, "python-dev")
    names.set("pkgs.test", "127.0.0.1")
    with package_index() as (port, seen):
        # Compute is charged by the sandbox's wall seconds: under TCG the venv alone takes
        # most of a minute, past what the default $0.04 buys (the proxy then refuses with 402).
        async with provisioned(
            runtime,
            isolation,
            image="python-dev",
            web={"allow": ["pkgs.test"]},
            max_cost_micros=400_000,
        ) as agent:
            res = await sh(
                agent,
                "python3 -m venv /tmp/v && PIP_NO_INDEX=0 /tmp/v/bin/pip install -q "
                "--trusted-host pkgs.test "
                f"--index-url http://pkgs.test:{port}/simple/ {PACKAGE} && "
                "/tmp/v/bin/python -c 'import ephemeral_egress_probe as m; print(m.ANSWER)'",
                timeout=240,  # 44 s alone under TCG, past 120 s on a loaded host
            )
            assert res.exit_code == 0, res.stderr
            assert res.stdout.strip().endswith("egress-probe-ok")
    assert seen[0].startswith(f"/simple/{PACKAGE}")
    assert any(s.startswith("/files/") for s in seen)


# Two requests on one kept connection to the proxy, as pip's pool makes them. http.client
# reuses a connection whose response did not say `Connection: close` without checking it, so
# this fails at once ("Remote end closed connection without response") where pip fails now
# and then: the proxy serves one request per connection.
TWO_ON_ONE = """
import http.client, sys
c = http.client.HTTPConnection("127.0.0.1", 3128, timeout=30)
for path in ("/simple/{pkg}/", "/files/none"):
    c.request("GET", "http://pkgs.test:{port}" + path)
    r = c.getresponse()
    r.read()
    print(r.status, r.getheader("Connection"), r.getheader("Content-Length"))
"""


async def test_a_keep_alive_upstream_answers_one_request_per_connection(
    runtime: Runtime, names: Names, isolation: str
) -> None:
    names.set("pkgs.test", "127.0.0.1")
    with package_index() as (port, seen):
        async with provisioned(runtime, isolation, web={"allow": ["pkgs.test"]}) as agent:
            assert agent.sandbox is not None
            await agent.sandbox.put_file(
                "/tmp/two.py", TWO_ON_ONE.format(pkg=PACKAGE, port=port).encode()
            )
            res = await sh(agent, "python3 /tmp/two.py", timeout=60)
    assert res.exit_code == 0, res.stderr
    first, second = res.stdout.splitlines()
    assert first.split()[:2] == ["200", "close"] and int(first.split()[2]) > 0
    assert second.split() == ["404", "close", "0"]  # the upstream's own headers are kept
    assert seen == [f"/simple/{PACKAGE}/", "/files/none"]


def test_pip_recipe_end_to_end(tmp_path: Path) -> None:
    state = tmp_path / "state"
    built_image(Settings.load(state_dir=state), "python-dev")
    probe = socket.socket()
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will
    try:
        probe.bind(("127.0.0.1", RECIPE_PORT))
    except OSError:
        pytest.skip(f"port {RECIPE_PORT} (fixed in the recipe) is busy on this host")
    finally:
        probe.close()
    with package_index(RECIPE_PORT) as (_, seen):
        done = cli(
            state,
            "eval",
            str(REPO / "recipes" / "evals" / "pip-from-allowed-index.yaml"),
            "--no-prefect",
            "--json",
            EPHEMERAL_BROKER_ALLOW_PRIVATE_HOSTS="true",
            timeout=400,
        )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["passed"] is True, report
    assert any(s.startswith("/files/") for s in seen)
