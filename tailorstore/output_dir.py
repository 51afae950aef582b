"""Writing a directory of results so that it appears whole or not at all.

Checkout and export both write into a hidden sibling directory, fsync every file, and rename
it to the requested name only when everything matched its hash; a failed or killed run never
leaves a directory that looks complete under that name.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import StoreError
from .store.posix import fsync_path
from .store.repo import Repository


def prepare_out(out: Path, store: Repository) -> Path:
    """The hidden sibling to write into, once ``out`` is known to be a new or empty directory outside the store."""
    if out.is_symlink():
        raise StoreError(f"{out}: is a symbolic link; name a new directory to write into, not a link.")
    resolved = out.resolve()
    for root in filter(None, (store.root, store.where.index_path.parent)):
        root = root.resolve()
        if resolved == root or root in resolved.parents:
            raise StoreError(f"{out}: lies inside the store {root}; write somewhere outside it.")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise StoreError(f"{out}: already exists and is not empty; name a new directory, or remove it.")
    if out.exists() and os.path.ismount(out):
        raise StoreError(f"{out}: is a mount point, which cannot be replaced; name a new directory inside it.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tailor-partial-{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp


def fsync_tree(root: Path) -> None:
    for folder, _dirs, names in os.walk(root):
        for name in names:
            fsync_path(Path(folder) / name)
        fsync_path(Path(folder))


def publish(tmp: Path, out: Path) -> None:
    """Rename the finished directory into place; refuse if another process filled ``out`` meanwhile."""
    try:
        if out.exists():
            out.rmdir()  # empty, checked before writing
        os.rename(tmp, out)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise StoreError(
                f"{out}: another process wrote into it meanwhile; nothing of ours was left there. "
                "Choose another directory."
            ) from None
        raise
    fsync_path(out.parent)


@contextmanager
def staged(out: Path, store: Repository) -> Iterator[Path]:
    """A hidden directory to fill; on a clean exit it is fsynced and renamed to ``out``, on any
    error (or a kill signal turned into an exception) it is removed and ``out`` left as it was."""
    tmp = prepare_out(out, store)
    try:
        yield tmp
        fsync_tree(tmp)
        publish(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreError(f"{out}: no space left on the device; nothing was written there.") from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
