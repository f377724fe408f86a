"""A sandbox's ``/etc`` as a container has it (issue 36, item 6): ``localhost`` resolves, a
server a command starts on ``localhost:PORT`` answers the sandbox's other commands, the hostname
is in ``/etc/hostname``, and a name lookup with no network fails instead of waiting for a server.

Real sandboxes on ``namespaces`` and ``gvisor`` (``microvm`` lays out its own root)."""

from __future__ import annotations

import pytest

from ephemeral.sandbox import writable_root
from tests.sandbox.conftest import Factory

pytestmark = pytest.mark.sandbox

# curl knows localhost itself (never asks the resolver); Python's client asks getaddrinfo
SERVE = (
    "cd /tmp && echo served-here > page.txt && "
    "(python3 -m http.server {port} --bind {bind} >/tmp/server.log 2>&1 &) && "
    "for i in $(seq 100); do "
    "  curl -sf --noproxy '*' http://localhost:{port}/page.txt && break; sleep 0.1; "
    "done && python3 -c 'import urllib.request as u; "
    'print(u.urlopen("http://localhost:{port}/page.txt").read().decode(), end="")\' '
    "|| {{ cat /tmp/server.log; exit 1; }}"
)


def _process_driver(driver: object) -> None:
    if getattr(driver, "isolation", "").startswith("microvm"):
        pytest.skip("the microVM's root is its guest's own (not the writable_root layers)")


async def test_etc_is_a_containers(make_sandbox: Factory, driver: object) -> None:
    _process_driver(driver)
    sbx = await make_sandbox()
    for name, text in writable_root.CONTAINER_ETC.items():
        seen = await sbx.exec(["cat", f"/etc/{name}"])
        assert (seen.exit_code, seen.stdout) == (0, text), seen.stderr
    resolved = await sbx.exec(
        "getent hosts localhost ip6-localhost; hostname; "
        "python3 -c 'import socket; print(socket.gethostbyname(\"localhost\"))'"
    )
    assert resolved.exit_code == 0, resolved.stderr
    assert "127.0.0.1" in resolved.stdout and "::1" in resolved.stdout
    assert f"\n{writable_root.HOSTNAME}\n127.0.0.1\n" in resolved.stdout, resolved.stdout
    # no DNS server anywhere: the lookup is refused (exit 2), well within the exec's bound
    lookup = await sbx.exec("getent hosts example.com", timeout=30)
    assert lookup.exit_code == 2, (lookup.exit_code, lookup.stdout, lookup.stderr)
    # root may change them, as in a container (its own upper layer)
    added = await sbx.exec(
        "echo '127.0.0.1 db.internal' >> /etc/hosts && getent hosts db.internal", user="root"
    )
    assert added.exit_code == 0 and "127.0.0.1" in added.stdout, added.stderr


@pytest.mark.parametrize("bind", ["127.0.0.1", "::"])
async def test_a_server_on_localhost_answers_the_sandboxs_commands(
    make_sandbox: Factory, driver: object, bind: str
) -> None:
    _process_driver(driver)
    sbx = await make_sandbox()
    got = await sbx.exec(SERVE.format(port=8765, bind=bind), timeout=60)
    assert (got.exit_code, got.stdout) == (0, "served-here\n" * 2), got.stderr
