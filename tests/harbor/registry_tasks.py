"""Terminal-Bench-shaped tasks whose ``docker_image`` lives on the loopback registry, and the
settings (environment variables) that let Ephemeral reach it: its CA, the loopback host and the
test user's credentials sealed in the state directory."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from textwrap import dedent

from ephemeral.oci.credentials import Credential, CredentialStore
from ephemeral.settings import Settings
from tests.drivers import built_image
from tests.harbor.tasks import REWARD, _toml, _write
from tests.oci import layouts as L
from tests.oci.conftest import PASSWORD, USER, Registry


@dataclass
class Pushed:
    registry: Registry
    base: list[bytes]  # the default image's rootfs as two layers (it has Python and bash)

    def push(self, tmp: Path, repo_tag: str, files: dict[str, str], workdir: str = "/app") -> str:
        """``<registry>/repo_tag``: the base and a layer of ``files``; returns the reference."""
        top = L.tar([L.directory(workdir.lstrip("/"))] + [L.file(p, t) for p, t in files.items()])
        config = {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "WorkingDir": workdir}
        self.registry.push_image(tmp, repo_tag, [*self.base, top], config=config)
        return f"{self.registry.host}/{repo_tag}"


def base_layers() -> list[bytes]:
    root = built_image(Settings.load(), "default").rootfs
    rest = sorted(p.name for p in root.iterdir() if p.name != "usr")
    return [L.tar_of_tree(root, ["usr"]), L.tar_of_tree(root, rest)]


def env_for(registry: Registry, state: Path) -> dict[str, str]:
    """What a process (Harbor, the CLI) needs in its environment to pull from the registry;
    the credentials are stored (sealed) in ``state``."""
    settings = Settings.load(state_dir=state)
    CredentialStore(settings).set(registry.host, Credential(username=USER, password=PASSWORD))
    return {
        "EPHEMERAL_STATE_DIR": str(state),
        "EPHEMERAL_REGISTRY_CA_FILE": str(registry.ca_file),
        "EPHEMERAL_REGISTRY_PRIVATE_HOSTS": json.dumps([registry.host]),
    }


def unique() -> str:
    return uuid.uuid4().hex[:12]


def pulled_task(root: Path, name: str, reference: str) -> Path:
    """Terminal-Bench's shape: ``docker_image`` and no Dockerfile; the image holds /app/seed.txt
    and its WORKDIR is /app. The solution starts a server on localhost (13 of TB2's tasks do)
    and writes what it served; the verifier checks it against the seed."""
    _write(root / name, {
        "task.toml": _toml(name, f'docker_image = "{reference}"\n'),
        "instruction.md": "Serve /app/seed.txt on localhost and save what it serves.\n",
        "solution/solve.sh": dedent("""\
            #!/bin/bash
            set -euo pipefail
            cd /app
            (python3 -m http.server 8123 --bind 127.0.0.1 >/tmp/server.log 2>&1 &)
            # up to 120 s for the server: on a loaded host its start alone took over 10 s
            end=$((SECONDS + 120))
            until python3 -c 'import urllib.request as u; print(u.urlopen(
                  "http://localhost:8123/seed.txt").read().decode(), end="")' > served.txt; do
              [ "$SECONDS" -lt "$end" ] || exit 1
              sleep 0.2
            done
            """),
        "tests/test.sh": (
            "#!/bin/bash\n"
            'served=$(cat /app/served.txt 2>/dev/null)\n'
            'if [ "$PWD" = /app ] && [ "$served" = "$(cat /app/seed.txt)" ]; ' + REWARD
        ),
    })  # fmt: skip
    return root / name


def dockerfile_task(root: Path, name: str, dockerfile: str) -> Path:
    _write(root / name, {
        "task.toml": _toml(name, ""),
        "instruction.md": "Nothing.\n",
        "environment/Dockerfile": dockerfile,
        "solution/solve.sh": "#!/bin/bash\ntrue\n",
        "tests/test.sh": "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n",
    })  # fmt: skip
    return root / name


def ours_task(root: Path, name: str) -> Path:
    """``docker_image`` naming Debian bookworm: our ``default`` image (built, never pulled)."""
    _write(root / name, {
        "task.toml": _toml(name, 'docker_image = "debian:bookworm"\n'),
        "instruction.md": "Nothing.\n",
        "solution/solve.sh": "#!/bin/bash\ntrue\n",
        "tests/test.sh": "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n",
    })  # fmt: skip
    return root / name


def cli_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPHEMERAL_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    return env | extra
