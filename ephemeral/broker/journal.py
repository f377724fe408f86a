"""Egress charges made but not yet in the ledger: one append-only file per run.

The egress proxy decides a byte or request charge against the run's budget in memory and
writes the ledger row later, in a batch with its neighbours (``attach.WebCharges``): a SQLite
commit per request or per MiB cost more than the request. Between the decision and the batch's
commit the charge lives here: one line ``key<TAB>micros`` written with a single ``write(2)`` to
a file opened ``O_APPEND``, *before* the bytes it pays for move. A process that dies after that
(a crash, ``kill -9``, the OOM killer) leaves the line in the kernel; whoever settles the run on
this host afterwards (the watchdog, a lease sweep, ``Runtime.recover``) replays the file into
the ledger first (:func:`replay`; ledger keys are idempotent, so lines already written count
once). Power loss can drop the file's last lines, as it can the store's last commits
(``synchronous=NORMAL``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ephemeral import errors

if TYPE_CHECKING:
    from ephemeral.store import Store

log = logging.getLogger("ephemeral.broker")

DIRNAME = "egress-charges"
MAX_LINE_MICROS = 10**12  # a line claiming more is not ours
_RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,80}$")


def path_for(state_dir: Path, run_id: str) -> Path:
    if not _RUN_ID.match(run_id):
        raise errors.InvalidRequest.field("run_id", "is not a run id")
    return state_dir / DIRNAME / f"{run_id}.log"


class ChargeJournal:
    """The run's journal, opened on its first line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def write(self, key: str, micros: int) -> None:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(self._fd, f"{key}\t{micros}\n".encode())

    def remove(self) -> None:
        """Every line is in the ledger: the file goes."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def read(path: Path, run_id: str) -> list[tuple[str, int]]:
    """The journal's charges; lines that are not a charge of this run are skipped (a torn last
    line from a crash mid-write is one)."""
    try:
        text = path.read_text("utf-8", errors="replace")
    except FileNotFoundError:
        return []
    out = []
    for line in text.split("\n"):
        key, sep, micros = line.partition("\t")
        if not sep or not key.startswith(f"{run_id}:") or not micros.isdigit():
            continue
        if int(micros) <= MAX_LINE_MICROS:
            out.append((key, int(micros)))
    return out


async def replay(store: Store, state_dir: Path, run_id: str) -> int:
    """Write the run's journalled charges into the ledger (before it is settled), then drop the
    file; returns the number of lines replayed. Lines already in the ledger count once."""
    path = path_for(state_dir, run_id)
    charges = read(path, run_id)
    if charges:
        try:
            await store.money.charge_batch(run_id, "web", charges)
        except (errors.Conflict, errors.BudgetExhausted) as exc:
            # Settled already (by another process), or past the reservation: nothing to add.
            log.error("%s: journalled egress charges not replayed: %s", run_id, exc)
            return 0
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        log.warning("%s: %d journalled egress charges replayed", run_id, len(charges))
        return len(charges)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return 0
