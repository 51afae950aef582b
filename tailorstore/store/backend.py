"""Where blob bytes live: a deliberately narrow interface.

Everything above this module speaks only of named, immutable blobs. That keeps an object
storage backend (S3 API) a matter of one more class: ``put`` must make a blob appear
whole or not at all, which a POSIX file system gives us by writing a temp file, fsyncing
it and renaming it into place.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, Protocol

BytesLike = bytes | bytearray | memoryview


class BlobBackend(Protocol):
    def put(self, name: str, chunks: Sequence[BytesLike]) -> None: ...
    def open(self, name: str) -> BinaryIO: ...
    def exists(self, name: str) -> bool: ...
    def size(self, name: str) -> int: ...
    def delete(self, name: str) -> None: ...
    def names(self) -> Iterator[str]: ...
    def sync(self) -> None: ...


class PosixBackend:
    """Blobs as files ``blobs/<first two hex digits>/<name>``; temp files under ``tmp/``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.blob_dir = self.root / "blobs"
        self.tmp_dir = self.root / "tmp"
        self._dirty_dirs: set[Path] = set()

    def path(self, name: str) -> Path:
        return self.blob_dir / name[:2] / name

    def put(self, name: str, chunks: Sequence[BytesLike]) -> None:
        final = self.path(name)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.tmp_dir / f"{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, final)
        self._dirty_dirs.add(final.parent)

    def sync(self) -> None:
        """Make the renames durable: fsync every blob folder we renamed into, once."""
        for folder in sorted(self._dirty_dirs):
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._dirty_dirs.clear()

    def open(self, name: str) -> BinaryIO:
        return open(self.path(name), "rb")

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
                    yield f.name

    def temp_files(self) -> list[Path]:
        return sorted(self.tmp_dir.glob("*.tmp")) if self.tmp_dir.is_dir() else []
