"""What the app's own start leaves for the collector: nothing it loaded (a full collection
re-scanning the startup heap held every request ~170 ms, docs/deploy.md "Seventh pass")."""

from __future__ import annotations

import gc
from pathlib import Path

from ephemeral.api import create_app
from ephemeral.settings import Settings


async def test_the_startup_heap_is_frozen_out_of_collections(tmp_path: Path) -> None:
    settings = Settings.load(state_dir=tmp_path / "state", use_prefect=False)
    app = create_app(settings, warm_pool=False)
    gc.unfreeze()
    try:
        async with app.router.lifespan_context(app):
            runtime = app.state.runtime
            assert runtime is not None and gc.get_freeze_count() > 0
            # The runtime it started is frozen: no collection will scan it again.
            assert not any(o is runtime for o in gc.get_objects())
    finally:
        gc.unfreeze()
