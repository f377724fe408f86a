"""Harbor builds a task's Dockerfile ``FROM`` a registry image whose ``RUN`` installs a tool with
``curl … | sh`` (530 of 1,487 public Harbor Dockerfiles do), through the build's proxy, from a
loopback server the operator's ``build_allow_hosts`` lets in (issue 36, item 5): oracle scores
1.0 and nop 0.0; the image is built once and the request is recorded beside it."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from textwrap import dedent

import pytest

from ephemeral.settings import Settings
from tests.harbor import registry_tasks as rt
from tests.harbor import tasks
from tests.harbor.tasks import REWARD, _toml, _write, trials
from tests.oci.conftest import Registry

pytestmark = pytest.mark.sandbox


@pytest.fixture
def installer() -> Iterator[tuple[str, list[str]]]:
    """A loopback server of ``/install.sh`` (it writes ``/opt/tool/answer``); yields
    ``localhost:PORT`` and the paths it served."""
    served: list[str] = []
    tag = rt.unique()
    script = f"mkdir -p /opt/tool && echo {tag} > /opt/tool/answer\n".encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            served.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(len(script)))
            self.end_headers()
            self.wfile.write(script)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"localhost:{server.server_address[1]}", served
    finally:
        server.shutdown()
        server.server_close()


def _task(root: Path, base: str, web: str) -> Path:
    _write(root / "curl-sh", {
        "task.toml": _toml("curl-sh", ""),
        "instruction.md": "Copy the tool's answer to /app/out.txt.\n",
        "environment/Dockerfile": (
            f"FROM {base}\nRUN curl -fsSL http://{web}/install.sh | sh\nWORKDIR /app\n"
        ),
        "solution/solve.sh": "#!/bin/bash\ncp /opt/tool/answer /app/out.txt\n",
        "tests/test.sh": dedent("""\
            #!/bin/bash
            if [ -s /app/out.txt ] && [ "$(cat /app/out.txt)" = "$(cat /opt/tool/answer)" ]; """)
        + REWARD,
    })  # fmt: skip
    return root / "curl-sh"


def test_a_dockerfile_from_a_registry_image_installs_through_the_proxy(
    tmp_path: Path, registry: Registry, isolation: str, installer: tuple[str, list[str]]
) -> None:
    why = tasks.harbor_missing()
    if why is not None:
        pytest.skip(why)
    web, served = installer
    base = rt.Pushed(registry, rt.base_layers()).push(
        tmp_path, f"tb/build-base:{rt.unique()}", {"app/.keep": ""}
    )
    root = tmp_path / "tasks"
    _task(root, base, web)
    state, jobs = tmp_path / "state", tmp_path / "jobs"
    env = rt.env_for(registry, state) | {
        "EPHEMERAL_BUILD_ALLOW_HOSTS": json.dumps(["localhost"]),
        "EPHEMERAL_BROKER_ALLOW_PRIVATE_HOSTS": "true",
    }
    done = tasks.run_job(
        sorted(root.iterdir()), jobs, state, agents=["oracle", "nop"],
        ek={"isolation": isolation}, n=2, timeout=1800, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = {(t.task, t.agent): t for t in trials(jobs)}
    oracle, nop = found["curl-sh", "oracle"], found["curl-sh", "nop"]
    assert (oracle.reward, oracle.exception) == (1.0, None), oracle.message
    assert (nop.reward, nop.exception) == (0.0, None), nop.message
    assert served == ["/install.sh"]  # built once for both trials
    port = int(web.split(":")[1])
    records = [
        json.loads(p.read_text())
        for p in Settings.load().image_cache_dir.glob("harbor-*/network.json")
    ]
    assert any(
        {"method": "GET", "host": "localhost", "port": port, "allowed": True}.items() <= r.items()
        for rec in records
        for r in rec["requests"]
    )
