"""The local store's lock file (store/lock.py): taken only as the store's own regular file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tailorstore.core.errors import CorruptStoreError
from tailorstore.store.lock import store_lock


def test_the_lock_is_never_taken_through_a_link_or_on_something_not_a_file(tmp_path: Path) -> None:
    """A dangling link planted as the lock file made every locking command create a file outside
    the store (O_CREAT followed it); a FIFO there would have blocked the open forever."""
    outside = tmp_path / "outside" / "planted"
    outside.parent.mkdir()
    lock = tmp_path / "lock"
    lock.symlink_to(outside)
    with pytest.raises(CorruptStoreError, match="is a link"):
        with store_lock(lock, exclusive=False, timeout=0):
            pass
    assert not outside.exists()
    lock.unlink()
    os.mkfifo(lock)
    with pytest.raises(CorruptStoreError, match="not a regular file"):
        with store_lock(lock, exclusive=True, timeout=0):
            pass
    lock.unlink()
    with store_lock(lock, exclusive=True, timeout=0) as held:  # the store's own file: taken
        assert held is not None
    assert lock.is_file() and not lock.is_symlink()
