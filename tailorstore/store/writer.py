"""Writing blobs: dedup first, then compress and write on both cores.

The caller hashes (xxh3 runs at about 15 GB/s, so the main thread keeps up) and asks
:meth:`BlobWriter.add`; a blob the index or this commit already has is never compressed
or written again. New blobs go to a small thread pool: numpy, zstandard and os.write
release the GIL, so compression and I/O of several blobs overlap on both cores. Each blob
is compressed one chunk at a time and every chunk is written as soon as it exists, so a
worker holds one chunk, never a whole compressed blob; the number of blobs queued is
bounded too.
"""

from __future__ import annotations

import errno
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from .. import codec
from ..errors import StoreError
from ..memory import drop_mapped_pages
from .repo import Store


@dataclass(frozen=True)
class NewBlob:
    hash: str
    raw_size: int
    stored_size: int
    codec: str
    created_at: float


class BlobWriter:
    def __init__(self, store: Store, *, level: int = codec.DEFAULT_LEVEL, threads: int = 2, in_flight: int = 4) -> None:
        self.store = store
        self.level = level
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tailor-blob")
        self._slots = threading.BoundedSemaphore(in_flight)
        self._pending: dict[str, Future[NewBlob]] = {}
        self._known: set[str] = set()
        self._failure: StoreError | None = None  # the first failed write; later blobs are not attempted
        self.reused_bytes = 0

    def add(self, data: memoryview, *, itemsize: int = 1, is_float: bool = False, mapped: bool = False) -> str:
        """Name ``data`` and write it if new. ``mapped``: it lies in a memory-mapped input file,
        whose pages are dropped from this process once the bytes are stored."""
        if self._failure is not None:
            raise self._failure
        digest = codec.content_hash(data)
        if digest in self._pending or digest in self._known:
            self.reused_bytes += len(data)
            if mapped:
                drop_mapped_pages(data)
            return digest
        if self.store.blob(digest) is not None:
            self._known.add(digest)
            self.reused_bytes += len(data)
            if mapped:
                drop_mapped_pages(data)
            return digest
        self._slots.acquire()
        future = self._pool.submit(self._write, digest, data, itemsize, is_float, mapped)
        future.add_done_callback(lambda _f: self._slots.release())
        self._pending[digest] = future
        return digest

    def _write(self, digest: str, data: memoryview, itemsize: int, is_float: bool, mapped: bool) -> NewBlob:
        if self._failure is not None:
            raise self._failure
        encoded = codec.encode(data, itemsize=itemsize, is_float=is_float, level=self.level)
        try:
            self.store.backend.put(digest, encoded, len(data))  # compresses chunk by chunk as it writes
            if mapped:
                drop_mapped_pages(data)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self._failure = StoreError(
                    f"{self.store.root}: no space left on the device while writing blobs. The commit was not "
                    "recorded and the store is as it was; free some space (or run `tailor gc`) and commit again."
                )
            else:
                self._failure = StoreError(
                    f"{self.store.root}: writing blob {digest} failed ({exc}); the commit was not recorded."
                )
            raise self._failure from None
        return NewBlob(digest, len(data), encoded.size, encoded.descriptor, time.time())

    def finish(self) -> list[NewBlob]:
        """Wait for every write, then make the renames durable. Raises the first failure."""
        try:
            blobs = [f.result() for f in self._pending.values()]
        finally:
            self._pool.shutdown(wait=True)
        self.store.backend.publish()
        return blobs

    def hash_only(self, data: memoryview) -> str:
        """The name these bytes would have, for atoms that are rebuilt instead of stored."""
        return codec.content_hash(data)

    def written(self) -> list[str]:
        """Digests of the blobs this writer put (or may have put) into the backend."""
        return list(self._pending)

    def abort(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pool.shutdown(wait=True)
        self.store.backend.discard()
