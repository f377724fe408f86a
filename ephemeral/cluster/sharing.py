"""What every process of a scale-out cluster must share, checked when ``serve`` (dispatch mode)
and ``ephemeral worker`` start (docs/deploy.md, "Scale-out").

- **The records root.** Prefect keeps each dispatched run's task parameters under it (unless a
  storage block is named) and every host's records go there. A host with a root of its own
  would never read the parameters the API stored, and its runs would wait forever. The first
  process writes a marker file holding a fresh id into the root (created exclusively) and the
  same id into the store; a process whose root holds another id, or none it can create to
  match, refuses to start, naming ``EPHEMERAL_RECORDS_DIR``. A local root on every host
  therefore fails on every host but the first, whatever its path.
- **The seal key.** A zero-data-retention prompt sealed by the API must open on the worker. The
  store keeps a one-way fingerprint of the first process's key; another key is refused, naming
  ``EPHEMERAL_SEAL_KEY_FILE``.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

from ephemeral import errors
from ephemeral.settings import Settings
from ephemeral.store import Store

MARKER = ".ephemeral-cluster"
DOCS = "every API process and worker of a cluster must share it (docs/deploy.md, Scale-out)"


async def check(settings: Settings) -> None:
    """Refuse (an error naming the setting) a records root or seal key no other process of
    this cluster shares; the first process to start records its own."""
    from ephemeral.broker.secrets import Sealer

    store = await Store.open(settings.db_url)
    try:
        await _check_dir(store, "records_root", settings.records_dir, "EPHEMERAL_RECORDS_DIR")
        tasks = os.environ.get("PREFECT_RESULTS_LOCAL_STORAGE_PATH")
        if (
            tasks
            and not os.environ.get("PREFECT_TASKS_SCHEDULING_DEFAULT_STORAGE_BLOCK")
            and not tasks.startswith(f"{settings.records_dir}{os.sep}")
        ):
            await _check_dir(
                store, "prefect_task_storage", Path(tasks), "PREFECT_RESULTS_LOCAL_STORAGE_PATH"
            )
        mine = Sealer.for_settings(settings).fingerprint()
        if await store.facts.put_first("seal_key", mine) != mine:
            raise errors.InvalidRequest.field(
                "EPHEMERAL_SEAL_KEY_FILE",
                f"{settings.seal_key_path} is not the key the other processes of this cluster "
                f"seal with (its fingerprint differs from the one in the store); {DOCS}",
            )
    finally:
        await store.close()


async def _check_dir(store: Store, fact: str, root: Path, setting: str) -> None:
    try:
        here = await asyncio.to_thread(_marker, root)
    except OSError as exc:
        raise errors.InvalidRequest.field(setting, f"{root}: {exc}") from exc
    cluster = await store.facts.put_first(fact, here)
    if here != cluster:
        raise errors.InvalidRequest.field(
            setting,
            f"{root} is not the directory the other processes of this cluster use: its "
            f"{MARKER} holds {here}, the store's cluster {cluster}; {DOCS}",
        )


def _marker(root: Path) -> str:
    """The id in the root's marker, which this call creates (exclusively) if it is missing."""
    marker = root / MARKER
    root.mkdir(parents=True, exist_ok=True)
    try:
        with marker.open("x") as out:  # exclusive: of two first processes, one writes it
            out.write(uuid.uuid4().hex + "\n")
    except FileExistsError:
        pass
    return marker.read_text().strip()
