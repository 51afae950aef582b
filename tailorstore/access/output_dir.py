"""Writing a directory of results so that it appears whole or not at all.

Checkout and export both write into a hidden sibling directory, fsync every file, and rename
it to the requested name only when everything matched its hash; a failed or killed run never
leaves a directory that looks complete under that name. The writer holds a lock on the hidden
directory, so the next run to write that name can tell one a killed run left (and delete it)
from one another process is still writing.
"""

from __future__ import annotations

import errno
import glob
import os
import secrets
import shutil
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

from tailorstore.access.read_ahead import ReadAhead
from tailorstore.core.dir_locks import hold_dir, removed, take_abandoned
from tailorstore.core.errors import StoreError, is_out_of_space
from tailorstore.core.threads import sync_threads
from tailorstore.formats.torch_save_writer import Parts, TensorOut, dumps, write_pickled_to
from tailorstore.store.backends.direct_io import RewritableWriter
from tailorstore.store.backends.posix import fsync_path
from tailorstore.store.repo import Repository, StepReader

PARTIAL = ".tailor-partial-"  # .NAME.tailor-partial-<random>: where NAME is written before it is renamed


def refuse_inside_store(out: Path, repo: StepReader) -> None:
    """Nothing we write goes into the store's own folders (its blobs or its index cache), where
    gc and verify would take it for the store's."""
    resolved = out.resolve()
    for root in repo.local_folders():
        if resolved == root or root in resolved.parents:
            raise StoreError(f"{out}: lies inside the store {root}; write somewhere outside it.")


def prepare_out(out: Path, repo: StepReader) -> tuple[Path, int]:
    """The hidden sibling to write into, once ``out`` is known to be a new or empty directory outside the
    store, with the fd that holds its lock until the caller closes it."""
    if out.is_symlink():
        raise StoreError(f"{out}: is a symbolic link; name a new directory to write into, not a link.")
    refuse_inside_store(out, repo)
    if out.exists() and not out.is_dir():
        raise StoreError(f"{out}: is a file, not a directory; name a new directory to write into.")
    if out.exists() and any(out.iterdir()):
        raise StoreError(f"{out}: already exists and is not empty; name a new directory, or remove it.")
    if out.exists() and os.path.ismount(out):
        raise StoreError(f"{out}: is a mount point, which cannot be replaced; name a new directory inside it.")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)
    while True:
        tmp = out.parent / f"{partial_prefix(out)}{secrets.token_hex(4)}"
        tmp.mkdir()
        fd = hold_dir(tmp)
        if not removed(fd):
            return tmp, fd
        os.close(fd)


def partial_prefix(out: Path) -> str:
    return f".{out.name}{PARTIAL}"


def remove_stale_partials(out: Path) -> int:
    """Delete the hidden partial directories of ``out`` that a killed checkout or export left
    (a whole checkpoint's bytes each: a preempted job would otherwise leave them for good);
    those a live process is writing hold its lock and stay. Returns how many were deleted."""
    count = 0
    for found in out.parent.glob(f"{glob.escape(partial_prefix(out))}*"):
        fd = take_abandoned(found)
        if fd is None:
            continue
        try:
            shutil.rmtree(found, ignore_errors=True)
            count += 1
        finally:
            os.close(fd)
    return count


def write_torch_file(path: Path, tree: Any) -> None:
    """A torch file of the output, tensors given as chunks streamed straight through, written
    around the page cache (:class:`RewritableWriter`): new page-cache pages cost the kernel
    several times the system time of writing around it (docs/PERFORMANCE.md, "Through the page
    cache or around it"), and the closing :func:`fsync_tree` finds the data already on disk.

    Tensors marked ``any_thread`` are decoded on helper threads ahead of the writer
    (:mod:`read_ahead`, in bounded memory): a resharded optimizer file is one long run of
    them, and decoding it on the writer's thread left the disk and the other core idle. A
    tensor given as :class:`Parts` (a flat partition of many parameters' pieces) is handed to
    the helpers part by part, so that both decode it."""
    pickled, tensors = dumps(tree)
    sources: list[Callable[[], Iterable[memoryview]]] = []
    ahead: list[bool] = []
    spans: list[range] = []  # tensor -> its sources (a tensor given as Parts has several)
    for t in tensors:
        parts = t.data.streams if t.any_thread and isinstance(t.data, Parts) else (t.chunks,)
        spans.append(range(len(sources), len(sources) + len(parts)))
        sources += parts
        ahead += [t.any_thread] * len(parts)
    reading = ReadAhead(sources, ahead) if any(ahead) else nullcontext()
    with RewritableWriter(path) as f, reading as reader:
        chunks_of = partial(_joined, reader, spans, tensors) if reader else None
        write_pickled_to(f, path.stem or "archive", pickled, tensors, chunks_of)


def _joined(reader: ReadAhead, spans: list[range], tensors: list[TensorOut], i: int) -> Iterator[memoryview]:
    """Tensor ``i``'s chunks from the read-ahead, its sources in order; its size checked."""
    total = 0
    for source in spans[i]:
        for chunk in reader.chunks(source):
            total += len(chunk)
            yield chunk
    if total != tensors[i].nbytes:
        raise ValueError(f"{total} bytes for a {tensors[i].dtype} tensor of shape {tensors[i].shape}")


def tree_bytes(root: Path) -> int:
    """The bytes of every file under ``root`` (one stat per file: a universal checkpoint has hundreds)."""
    total = 0
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                total += tree_bytes(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root``, many at once: each fsync of a new file waits for
    a journal commit, and concurrent ones share commits (hundreds of small files of a universal
    checkpoint take one or two commits' time instead of one each; a ``syncfs`` would also flush
    whatever else on that file system is dirty, such as a training run's own saves)."""
    paths: list[Path] = []
    folders: list[Path] = []
    for folder, _dirs, names in os.walk(root):
        paths += [Path(folder) / name for name in names]
        folders.append(Path(folder))
    with ThreadPoolExecutor(sync_threads(), thread_name_prefix="tailor-fsync") as pool:
        list(pool.map(fsync_path, paths))
        list(pool.map(fsync_path, folders))


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
def staged(out: Path, repo: Repository) -> Iterator[Path]:
    """A hidden directory to fill; on a clean exit it is fsynced and renamed to ``out``, on any
    error (or a kill signal turned into an exception) it is removed and ``out`` left as it was."""
    tmp, lock = prepare_out(out, repo)
    try:
        yield tmp
        fsync_tree(tmp)
        publish(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_out_of_space(exc):
            raise StoreError(f"{out}: no space left on the device; nothing was written there.") from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(lock)
