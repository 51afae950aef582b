"""Deleting a save once it is committed: only what the commit took, only once every blob is there.

``delete_after_commit`` (the API, the DeepSpeed helper, the HF callback) frees the raw save as
soon as the store holds it. Only after the manifest is durable, and every blob it names has
been found with its recorded size (on an object store, with a listing rather than a request
per blob), are the files deleted; and only the files the commit read, never anything beside
them that training may have written since.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path, PurePosixPath

from tailorstore.access.contents import Contents
from tailorstore.core.errors import Call, CorruptStoreError
from tailorstore.core.paths import safe_join
from tailorstore.formats import megatron as mg
from tailorstore.formats.layout import DCP_FOLDER, DEEPSPEED, DEEPSPEED_TAG, MEGATRON, PLAIN_FILE, PLAIN_FOLDER
from tailorstore.store.repo import Repository, StepReader

logger = logging.getLogger("tailorstore")
_UNDER_PARENT = (DEEPSPEED_TAG, DCP_FOLDER, PLAIN_FILE, PLAIN_FOLDER)  # layouts rooted at the folder's parent


def delete_once_durable(repo: Repository, manifest: int, path: Path) -> None:
    """``delete_after_commit``: every blob of the manifest is checked present, then the files go."""
    check_blobs_present(repo, manifest)
    delete_committed(repo, manifest, path)


def check_blobs_present(repo: StepReader, manifest: int) -> None:
    """Every blob the manifest names exists in the backend with its recorded size."""
    rows = {digest: repo.blob(digest) for digest in sorted(repo.view(Contents).referenced_hashes(manifest))}
    stored_bytes = repo.size_lookup([r for r in rows.values() if r is not None])
    for digest, row in rows.items():
        if row is None or stored_bytes(row) != row.stored_size:
            raise CorruptStoreError(
                f"blob {digest} of the commit just made is missing or cut short in {repo.location}; "
                "the original checkpoint was kept. Run ",
                Call("verify"),
                " and commit it again.",
            )


def delete_committed(repo: StepReader, manifest: int, path: Path) -> None:
    """Delete what the commit took from ``path``, and the folders it leaves empty.

    For a DeepSpeed save directory only the step's tag folder goes: ``latest`` and the
    scripts beside it belong to the save directory, and training may already have
    pointed ``latest`` at a newer step.

    This runs after the step is durable, so it is clean-up: a file that cannot be deleted (a
    staging folder remounted read-only, EROFS) is one warning, never a failed commit. Reported as
    a failure, it would stop training with the step committed (I3, docs/FORMAT.md 8.1).
    """
    try:
        _delete_committed(repo, manifest, path)
    except OSError as exc:
        logger.warning(
            "tailorstore: step %d is committed, but its files in %s could not all be deleted (%s); delete them by hand",
            repo.manifest(manifest).step,
            path,
            exc,
        )


def _delete_committed(repo: StepReader, manifest: int, path: Path) -> None:
    row = repo.manifest(manifest)
    path = path.resolve()
    # what the recorded paths are relative to: the folder's parent for every layout that names the
    # folder itself in its paths (a plain folder's files were recorded as "save/ckpt.pt", so they were
    # looked for in save/save/ and nothing was deleted)
    files = [f.path for f in repo.view(Contents).files(manifest)]
    # a Megatron step is rooted at the iteration folder's parent either way: its run folder, or the
    # folder that holds the iteration folder committed by itself
    under_parent = row.layout in _UNDER_PARENT or (row.layout == MEGATRON and mg.TRACKER not in files)
    root = path.parent if under_parent else path
    if row.layout in (DEEPSPEED, MEGATRON):  # the run's tracker (`latest`, Megatron's) stays: training owns it
        files = [f for f in files if PurePosixPath(f).parts[0] == row.ds_tag]
    folders: set[Path] = set()
    for rel in files:
        target = safe_join(root, rel)
        if target != path and path not in target.parents:
            continue  # never anything outside what was committed
        target.unlink(missing_ok=True)
        folders.update(p for p in target.parents if p == path or path in p.parents)
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        if folder.is_dir() and not any(folder.iterdir()) and (folder != path or row.layout != DEEPSPEED):
            folder.rmdir()
    if row.layout != DEEPSPEED and path.is_dir():
        logger.info("tailorstore: %s kept files the commit did not take: %s", path, sorted(os.listdir(path)))
