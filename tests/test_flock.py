"""ephemeral/flock.py, the one flock helper of the layer store and the records' compactors: an
exclusive lock excludes every other, shared ones share, a non-waiting take says it got nothing,
and closing the block releases it. Each take opens the file anew, so two takes in one process
contend as two processes would (flock locks belong to the open file description)."""

from __future__ import annotations

import threading
from pathlib import Path

from ephemeral import flock


def test_an_exclusive_lock_excludes_and_is_released_at_the_end_of_its_block(
    tmp_path: Path,
) -> None:
    lock = tmp_path / "x.lock"
    with flock.held(lock) as got:
        assert got and lock.stat().st_mode & 0o777 == 0o600
        with flock.held(lock, wait=False) as other:
            assert other is False
        with flock.held(lock, exclusive=False, wait=False) as reader:
            assert reader is False
    with flock.held(lock, wait=False) as again:
        assert again is True


def test_shared_locks_share_and_keep_out_an_exclusive_one(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    with flock.held(lock, exclusive=False) as one, flock.held(lock, exclusive=False) as two:
        assert one and two
        with flock.held(lock, wait=False) as writer:
            assert writer is False


def test_a_waiting_take_gets_the_lock_once_the_holder_lets_go(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    order: list[str] = []
    holding = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with flock.held(lock):
            holding.set()
            release.wait(30)
            order.append("released")

    t = threading.Thread(target=holder)
    t.start()
    assert holding.wait(30)
    release.set()
    with flock.held(lock) as got:  # blocks until the holder's block has ended
        order.append("taken")
        assert got
    t.join(30)
    assert order == ["released", "taken"]
