"""``python -m bench.fake_sandboxes serve|worker …``: ``ephemeral`` whose every sandbox is the
in-tree ``fake`` double (``ephemeral/testing/sandbox.py``: nothing boots, commands are
interpreted in memory), for ``bench/scaleout.py --ceiling``. The CPU then goes to the control
plane alone: admission, the store, Prefect, the workers' run bodies and the agent loop.
"""

from __future__ import annotations

import sys


def install() -> None:
    # Every level the runtime asks for resolves to ``fake`` and every driver the source asks
    # for is the fake one (the sandbox registry knows only real drivers: the fakes are not
    # shipped into it). Importing the source module does not import Prefect (which reads its
    # settings once, before ``configure`` would set them).
    from ephemeral.sandbox import source
    from ephemeral.testing.sandbox import FakeDriver

    async def fake(requested: str, settings: object) -> str:
        return FakeDriver.isolation

    source.resolve_isolation = fake  # type: ignore[assignment]
    source.get_driver = lambda isolation, settings: FakeDriver()  # type: ignore[assignment]


if __name__ == "__main__":
    install()
    sys.argv = ["ephemeral", *sys.argv[1:]]
    from ephemeral.cli import main

    main()
