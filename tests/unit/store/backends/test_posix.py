"""A local store's folders are its own (store/backends/posix.py): a link planted where the store
keeps a folder or an object is never followed, by a write, a read or a listing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tailorstore.core.errors import CorruptStoreError
from tailorstore.store.backends.posix import PosixBackend
from tests.conftest import one_line, tailor


def test_a_linked_folder_or_object_in_the_store_is_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "tags").mkdir(parents=True)
    (outside / "tags" / "planted").write_bytes(b"manifests/main/step-1.json.zst")
    (outside / "secret").write_bytes(b"not the store's")
    root = tmp_path / "store"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "tags").symlink_to(outside / "tags")
    (root / "manifests").mkdir()
    (root / "manifests" / "main").symlink_to(outside)
    (root / "blobs").mkdir()
    (root / "blobs" / "object").symlink_to(outside / "secret")
    backend = PosixBackend(root)
    with pytest.raises(CorruptStoreError, match="a link where the store keeps a folder"):
        backend.put("manifests/main/step-2.json.zst", b"written outside?")
    with pytest.raises(CorruptStoreError, match="a link where the store keeps a folder"):
        list(backend.list("refs/tags/"))
    assert "blobs/object" not in list(backend.list("blobs/")) and not backend.exists("blobs/object")
    with pytest.raises(FileNotFoundError):
        backend.get("blobs/object")
    assert sorted(p.name for p in outside.iterdir()) == ["secret", "tags"]  # nothing was written there


def test_a_commit_into_a_store_with_a_planted_folder_link_fails_in_one_line(tmp_path: Path) -> None:
    store = tmp_path / "store"
    assert tailor("init", str(store)).returncode == 0
    outside = tmp_path / "outside"
    outside.mkdir()
    (store / "manifests").mkdir(exist_ok=True)
    (store / "manifests" / "main").symlink_to(outside)
    save = tmp_path / "save"
    save.mkdir()
    torch.save({"model": {"w": torch.ones(8, 8)}}, save / "model.pt")
    one_line(tailor("commit", str(save), "--step", "1", store=store), 3, "a link where the store keeps a folder")
    assert list(outside.iterdir()) == []
