"""The repository (store/repo.py): step numbers in range, and what opening and resolving refuse."""

from __future__ import annotations

from pathlib import Path

import pytest

from tailorstore.core.errors import CorruptStoreError, StoreError, UnknownStepError
from tailorstore.store.repo import Repository, check_step


def test_steps_out_of_range() -> None:
    assert check_step(0) == 0
    for bad in (-7, 1 << 63):
        with pytest.raises(StoreError, match="out of range"):
            check_step(bad)


def test_store_open_and_resolve_refusals(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="not a directory"):
        Repository.init(tmp_path / "file")
    with Repository.init(tmp_path / "st") as st:
        refusals = (
            ("latest", "no steps yet"),
            ("id=3", "at least 4"),
            ("id=abcd", "no manifest has id abcd"),
            ("id=../x", "names no manifest"),
            ("step=x", "cannot read"),
        )
        for selector, message in refusals:
            with pytest.raises(UnknownStepError, match=message):
                st.resolve(selector)
    (tmp_path / "st" / "index.sqlite").write_bytes(b"\0" * 4096)
    for side in ("index.sqlite-wal", "index.sqlite-shm"):
        (tmp_path / "st" / side).unlink(missing_ok=True)
    with pytest.raises(CorruptStoreError, match="damaged"):
        Repository.open(tmp_path / "st")
