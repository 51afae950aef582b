"""Where blob bytes live: a deliberately narrow interface.

Everything above this module speaks only of named, immutable blobs. That keeps an object
storage backend (S3 API) a matter of one more class: ``put`` must make a blob appear
whole or not at all, which a POSIX file system gives us by writing a temp file, fsyncing
it and renaming it into place.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

from ..errors import CorruptStoreError
from .direct_io import DirectReader, SequentialWriter

_HASH = re.compile(r"[0-9a-f]{32}")


def check_name(name: str) -> str:
    """A blob name is 32 lowercase hex digits, checked before it becomes a path: an index row
    such as ``../../tmp/x`` must never let gc delete, or checkout read, a file outside the store."""
    if not isinstance(name, str) or not _HASH.fullmatch(name):
        raise CorruptStoreError(
            f"the index names a blob {name!r}, which is not a 32-digit hex hash; the index is damaged. "
            "Restore index.sqlite from a backup; nothing was deleted."
        )
    return name


BytesLike = bytes | bytearray | memoryview


class BlobBackend(Protocol):
    def put(self, name: str, chunks: Iterable[BytesLike], size_hint: int = 0) -> None: ...
    def publish(self) -> None: ...
    def discard(self) -> None: ...
    def open(self, name: str) -> BinaryIO: ...
    def exists(self, name: str) -> bool: ...
    def size(self, name: str) -> int: ...
    def delete(self, name: str) -> None: ...
    def names(self) -> Iterator[str]: ...


def _syncfs(path: Path) -> None:
    """Flush every dirty page and inode of the file system holding ``path`` (one call, not one per file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), "syncfs failed", str(path))
    except AttributeError:  # no syncfs on this platform
        os.sync()
    finally:
        os.close(fd)


_SYNC_FILE_RANGE_WRITE = 2
_DIRECT_FROM = 1 << 20  # blobs of at least this raw size are written with O_DIRECT
_libc = ctypes.CDLL(None, use_errno=True)


def start_writeback(fd: int, offset: int = 0, length: int = 0) -> None:
    """Ask the kernel to start writing these dirty pages (length 0: to the end) now, without waiting.

    The disk then works while we compress the next blobs, and the closing syncfs only
    waits for the tail; ``cp -r`` followed by ``sync`` pays its whole flush at the end.
    Where sync_file_range does not exist this is a no-op and syncfs does all the work.
    """
    try:
        _libc.sync_file_range(fd, ctypes.c_int64(offset), ctypes.c_int64(length), _SYNC_FILE_RANGE_WRITE)
    except AttributeError:
        pass


class PosixBackend:
    """Blobs as files ``blobs/<first two hex digits>/<name>``; temp files under ``tmp/``.

    ``put`` writes a temp file; ``publish`` makes every temp file durable with one syncfs,
    renames each into place and makes the renames durable with a second syncfs. One flush
    for the whole batch costs what ``cp -r`` plus ``sync`` costs, where an fsync per blob
    costs a journal commit per blob. A blob appears under its name only once its bytes are
    durable, exactly as with an fsync per file.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.blob_dir = self.root / "blobs"
        self.tmp_dir = self.root / "tmp"
        self._staged: dict[str, Path] = {}
        self._lock = threading.Lock()

    def path(self, name: str) -> Path:
        return self.blob_dir / name[:2] / check_name(name)

    def put(self, name: str, chunks: Iterable[BytesLike], size_hint: int = 0) -> None:
        """Write a temp file for the blob; ``size_hint`` (its raw size) picks direct or buffered I/O."""
        tmp = self.tmp_dir / f"{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        out = SequentialWriter(tmp, direct=size_hint >= _DIRECT_FROM)
        try:
            for chunk in chunks:
                out.write(chunk)
            if not out.direct:
                start_writeback(out.fd)
        except BaseException:
            with contextlib.suppress(OSError):  # closing writes the tail, which may fail the same way
                out.close()
            tmp.unlink(missing_ok=True)
            raise
        try:
            out.close()
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self._staged[name] = tmp

    def publish(self) -> None:
        """Durable temp files, then renames into place, then durable renames."""
        if not self._staged:
            return
        _syncfs(self.root)
        for name, tmp in self._staged.items():
            final = self.path(name)
            try:
                os.replace(tmp, final)
            except FileNotFoundError:  # the first blob under this prefix
                final.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, final)
        self._staged.clear()
        _syncfs(self.root)

    def discard(self) -> None:
        """Drop the temp files of a batch that will not be published."""
        for tmp in self._staged.values():
            tmp.unlink(missing_ok=True)
        self._staged.clear()

    def open(self, name: str) -> BinaryIO:
        return DirectReader(self.path(name))  # type: ignore[return-value]

    def exists(self, name: str) -> bool:
        return self.path(name).is_file()

    def size(self, name: str) -> int:
        return self.path(name).stat().st_size

    def delete(self, name: str) -> None:
        self.path(name).unlink(missing_ok=True)

    def names(self) -> Iterator[str]:
        if not self.blob_dir.is_dir():
            return
        for folder in sorted(self.blob_dir.iterdir()):
            if folder.is_dir():
                for f in sorted(folder.iterdir()):
                    if _HASH.fullmatch(f.name) and f.name[:2] == folder.name:
                        yield f.name

    def temp_files(self) -> list[Path]:
        return sorted(self.tmp_dir.glob("*.tmp")) if self.tmp_dir.is_dir() else []
