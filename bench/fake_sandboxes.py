"""``python -m bench.fake_sandboxes serve|worker …``: ``ephemeral`` whose every sandbox is the
in-tree ``fake`` double (``ephemeral/testing/sandbox.py``: nothing boots, commands are
interpreted in memory), for ``bench/scaleout.py --ceiling``. The CPU then goes to the control
plane alone: admission, the store, Prefect, the workers' run bodies and the agent loop.
"""

from __future__ import annotations

import sys


def install() -> None:
    # Every level the runtime asks for resolves to ``fake``; the registry's get_driver then
    # returns the fake driver. Importing the source module does not import Prefect (which
    # reads its settings once, before ``configure`` would set them).
    from ephemeral.sandbox import registry, source

    async def fake(requested: str, settings: object) -> str:
        return registry.FAKE

    source.resolve_isolation = fake  # type: ignore[assignment]


if __name__ == "__main__":
    install()
    sys.argv = ["ephemeral", *sys.argv[1:]]
    from ephemeral.cli import main

    main()
