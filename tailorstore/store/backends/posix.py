"""The POSIX backend: objects as files under the store directory.

A key ``blobs/ab/<hash>`` is the file ``STORE/blobs/ab/<hash>``. Every object is written
to a temp file under ``STORE/tmp/`` and renamed into place, so it appears whole or not at
all. A single ``put`` fsyncs its file and directory; a :class:`PosixBatch` (one commit's
blobs) flushes all its temp files with one ``syncfs`` before any rename and makes the
renames durable with a second one. One flush for the whole batch costs what ``cp -r`` plus
``sync`` costs, where an fsync per blob costs a journal commit per blob.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import xxhash

from tailorstore.core.errors import CorruptStoreError, ObjectExistsError
from tailorstore.core.failpoints import request
from tailorstore.store.backends.base import BytesLike, Chunks, as_chunks, check_key
from tailorstore.store.backends.direct_io import DirectReader, SequentialWriter

_SYNC_FILE_RANGE_WRITE = 2
_DIRECT_FROM = 1 << 20  # objects of at least this size are written with O_DIRECT
_libc = ctypes.CDLL(None, use_errno=True)
TMP_DIR = "tmp"


def syncfs(path: Path) -> None:
    """Flush every dirty page and inode of the file system holding ``path`` (one call, not one per file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), "syncfs failed", str(path))
    except AttributeError:  # no syncfs on this platform
        os.sync()
    finally:
        os.close(fd)


def start_writeback(fd: int, offset: int = 0, length: int = 0) -> None:
    """Ask the kernel to start writing these dirty pages (length 0: to the end) now, without waiting.

    The disk then works while we compress the next blobs, and the closing syncfs only
    waits for the tail. Where sync_file_range does not exist this is a no-op.
    """
    try:
        _libc.sync_file_range(fd, ctypes.c_int64(offset), ctypes.c_int64(length), _SYNC_FILE_RANGE_WRITE)
    except AttributeError:
        pass


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path (a directory: so the names created in it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_object(path: Path) -> BinaryIO:
    """An object's file for reading, never through a link (one swapped in after the check)."""
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb")


class PosixBackend:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.location = str(self.root)
        self.tmp_dir = self.root / TMP_DIR
        self._real_root = os.path.realpath(self.root)  # the store itself may be reached through a link

    def path(self, key: str) -> Path:
        """Where ``key``'s object lives, refused when a folder on the way is a link: one planted in
        the store (``manifests/main``, ``refs/tags``) sent writes and listings outside it."""
        path = self.root / check_key(key)
        self._inside(path.parent)
        return path

    def _inside(self, folder: Path) -> None:
        rel = os.path.relpath(folder, self.root)
        if rel == ".":
            return
        real = os.path.realpath(folder)
        if real != os.path.join(self._real_root, rel):
            raise CorruptStoreError(
                f"{folder}: a link where the store keeps a folder (it leads to {real[:200]}); "
                "the store writes and reads only its own folders: move the link away and retry."
            )

    def _write_temp(self, key: str, chunks: Chunks, size_hint: int, *, sync: bool) -> Path:
        tmp = self.tmp_dir / f"{key.rsplit('/', 1)[-1]}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        try:
            out = SequentialWriter(tmp, direct=size_hint >= _DIRECT_FROM)
        except FileNotFoundError:
            self.tmp_dir.mkdir(parents=True, exist_ok=True)
            out = SequentialWriter(tmp, direct=size_hint >= _DIRECT_FROM)
        except NotADirectoryError:
            raise CorruptStoreError(
                f"{self.tmp_dir}: is not a directory, where the store writes its temp files; move it away and retry."
            ) from None
        try:
            for chunk in chunks:
                out.write(chunk)
            if not sync and not out.direct:
                start_writeback(out.fd)
        except BaseException:
            with contextlib.suppress(OSError):  # closing writes the tail, which may fail the same way
                out.close()
            tmp.unlink(missing_ok=True)
            raise
        try:
            out.close(durable=sync)  # the fsync after the tail: every byte and the size on disk
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def _place(self, tmp: Path, key: str, *, create_only: bool) -> None:
        final = self.path(key)
        for attempt in range(2):
            try:
                if create_only:
                    os.link(tmp, final)  # fails if the name exists: never replaces
                    tmp.unlink()
                else:
                    os.replace(tmp, final)
                return
            except FileNotFoundError:
                if attempt:
                    raise
                final.parent.mkdir(parents=True, exist_ok=True)
            except FileExistsError:
                tmp.unlink(missing_ok=True)
                raise ObjectExistsError(f"{self.location}: {key} already exists") from None

    def put(
        self, key: str, data: BytesLike | Chunks, *, create_only: bool = False, fence: Callable[[], None] | None = None
    ) -> None:
        request("put-create" if create_only else "put")
        chunks = as_chunks(data)
        size = sum(len(c) for c in chunks) if isinstance(chunks, list) else 0
        self._write_and_place(key, chunks, size, create_only=create_only, fence=fence)

    def _write_and_place(
        self, key: str, chunks: Chunks, size: int, *, create_only: bool, fence: Callable[[], None] | None
    ) -> None:
        """A put's body, after its request's failpoint: the temp file, durable; the fence; the rename."""
        tmp = self._write_temp(key, chunks, size, sync=True)
        if fence is not None:
            try:
                fence()  # after the failpoint and the temp file: just before the object appears
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        self._place(tmp, key, create_only=create_only)
        fsync_path(self.path(key).parent)

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """The object's bytes, and their hash as the token ``put_if`` compares."""
        data = self.get(key)
        return data, xxhash.xxh3_128_hexdigest(data)

    def put_if(self, key: str, data: bytes, version: str, *, fence: Callable[[], None] | None = None) -> bool:
        """Replace the object only while its bytes still hash to ``version``; False when they do not
        (or it is gone). The compare and the rename are two steps: on a local store every ref edit runs
        inside the shared index's write transaction, which is what keeps another writer out between them."""
        request("put-if")
        try:
            with _open_object(self._object(key)) as f:
                now = xxhash.xxh3_128_hexdigest(f.read())
        except FileNotFoundError:
            return False
        if now != version:
            return False
        self._write_and_place(key, [data], len(data), create_only=False, fence=fence)
        return True

    def get(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        request("get")
        with _open_object(self._object(key)) as f:
            f.seek(start)
            return f.read() if length is None else f.read(length)

    def reader(self, key: str, start: int = 0, length: int | None = None) -> BinaryIO:
        request("get")
        return DirectReader(self._object(key), start, length)  # type: ignore[return-value]

    def _object(self, key: str) -> Path:
        """The object's path, or FileNotFoundError when no file is there: a directory or a device
        put in an object's place is no object (a directory opens, and its reads failed later as
        'Is a directory', naming no file, with the exit code of bad input)."""
        path = self.path(key)
        if not stat.S_ISREG(os.lstat(path).st_mode):  # a link in an object's place is no object either
            raise FileNotFoundError(errno.ENOENT, "not a file where the store keeps an object", str(path))
        return path

    def exists(self, key: str) -> bool:
        request("head")
        try:
            return stat.S_ISREG(os.lstat(self.path(key)).st_mode)
        except FileNotFoundError:
            return False

    def size(self, key: str) -> int:
        request("head")
        return os.lstat(self._object(key)).st_size

    def list(self, prefix: str) -> Iterator[str]:
        """Every key under ``prefix`` (a folder path ending in '/'), sorted, temp files excluded."""
        for _, key in self._walk(prefix):
            yield key

    def sizes(self, prefix: str) -> Iterator[tuple[str, int]]:
        for path, key in self._walk(prefix):
            try:
                yield key, path.stat().st_size
            except FileNotFoundError:  # deleted since the walk saw it (gc): not there any more
                continue

    def stamps(self, prefix: str) -> Iterator[tuple[str, float]]:
        """Every key under ``prefix`` with its modification time (the file system's clock)."""
        for path, key in self._walk(prefix):
            try:
                yield key, path.stat().st_mtime
            except FileNotFoundError:
                continue

    def _walk(self, prefix: str) -> Iterator[tuple[Path, str]]:
        request("list")
        base = self.root / prefix.rstrip("/") if prefix else self.root
        if not base.is_dir():
            return
        self._inside(base)
        for dirpath, dirnames, filenames in os.walk(base):
            rel_dir = Path(dirpath).relative_to(self.root).as_posix()
            if rel_dir == TMP_DIR:
                dirnames.clear()
                continue
            dirnames.sort()
            for name in sorted(filenames):
                if os.path.islink(os.path.join(dirpath, name)):
                    continue  # a link is no object of the store's: never listed, so never read through
                yield Path(dirpath) / name, name if rel_dir == "." else f"{rel_dir}/{name}"

    def delete(self, key: str, fence: Callable[[], None] | None = None) -> None:
        request("delete")
        if fence is not None:
            fence()
        self.path(key).unlink(missing_ok=True)

    def delete_many(self, keys: Iterable[str], *, fence: Callable[[], None] | None = None) -> None:
        """One unlink a key. ``fence`` as on S3 (store/backends/s3.py); under ``flock`` it holds throughout."""
        for key in keys:
            self.delete(key, fence)

    def batch(self) -> PosixBatch:
        return PosixBatch(self)

    def leftovers(self) -> list[str]:
        """Temp files of writes that never finished (a killed commit)."""
        return sorted(p.name for p in self.tmp_dir.glob("*.tmp")) if self.tmp_dir.is_dir() else []

    def leftover_bytes(self, names: list[str]) -> int:
        """What the temp files ``names`` hold (gc counts them in what it frees)."""
        total = 0
        for name in names:
            try:
                total += (self.tmp_dir / Path(name).name).stat().st_size
            except FileNotFoundError:
                pass
        return total

    def clear_leftovers(self, names: list[str]) -> None:
        for name in names:
            (self.tmp_dir / Path(name).name).unlink(missing_ok=True)


class PosixBatch:
    """One commit's (or gc's) objects: temp files now, durable renames at ``publish``."""

    def __init__(self, backend: PosixBackend) -> None:
        self.backend = backend
        self._staged: dict[str, Path] = {}
        self._deleted: list[str] = []
        self._lock = threading.Lock()

    def put(self, key: str, chunks: Chunks, size_hint: int = 0) -> None:
        """Write a temp file; ``size_hint`` (the object's raw size) picks direct or buffered I/O."""
        check_key(key)
        tmp = self.backend._write_temp(key, chunks, size_hint, sync=False)
        with self._lock:
            old = self._staged.pop(key, None)
            self._staged[key] = tmp
        if old is not None:
            old.unlink(missing_ok=True)

    def delete(self, key: str) -> None:
        check_key(key)
        self._deleted.append(key)

    def publish(self, fence: Callable[[], None] | None = None) -> None:
        """Durable temp files, then renames into place, then durable renames and deletions
        (``fence`` before each deletion, as ``delete_many``)."""
        if not self._staged and not self._deleted:
            return
        root = self.backend.root
        if self._staged:
            syncfs(root)
        for key, tmp in self._staged.items():
            request("put")
            self.backend._place(tmp, key, create_only=False)
        self._staged.clear()
        self.backend.delete_many(self._deleted, fence=fence)
        self._deleted.clear()
        syncfs(root)

    def discard(self) -> None:
        """Drop the temp files of a batch that will not be published."""
        for tmp in self._staged.values():
            with contextlib.suppress(OSError):
                tmp.unlink()
        self._staged.clear()
        self._deleted.clear()
