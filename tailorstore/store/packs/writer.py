"""Writing blobs: dedup first, then compress and write on both cores.

The caller copies each piece out of its input file into private memory, hashes that copy
(xxh3 runs many times faster than compression, so the main thread keeps up) and asks :meth:`BlobWriter.add`;
the same copy is compressed, so a blob's bytes always match its name. A blob the index or
this commit already has is never compressed or written again. New blobs go to a small
thread pool: numpy, zstandard and os.write release the GIL, so compression and I/O of
several blobs overlap on both cores. Each blob is compressed one chunk at a time and every
chunk is written as soon as it exists, so a worker holds one chunk, never a whole
compressed blob; the raw bytes queued are bounded too (a piece larger than the budget
waits until it is alone). Files too large to copy whole (:meth:`BlobWriter.add_stream`)
are read twice in chunks: once to name them, once to compress them, hashing again as they
go and refusing the commit if the two differ.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Protocol

from tailorstore.core.errors import BackendError, Call, InputChangedError, StoreError, is_out_of_space
from tailorstore.core.object_keys import blob_key
from tailorstore.core.piece_slab import SLAB_BYTES
from tailorstore.core.records import BlobRecord
from tailorstore.core.threads import compute_threads
from tailorstore.store import codec
from tailorstore.store.backends.base import Backend, BytesLike
from tailorstore.store.packs.pack import PACK_BELOW, PackWriter

# Raw bytes queued for compression at once: what the slab of reused piece memory holds
# (piece_slab.py). A piece read while the queue holds more than the slab is fresh memory,
# whose pages the kernel must zero on first touch: twice the slab queued cost a commit nearly
# twice the system time, and a higher peak RSS (docs/PERFORMANCE.md, "The blob writer's queue").
IN_FLIGHT_BYTES = SLAB_BYTES
# Pieces queued or being compressed at once, beyond the compression threads: one, read and
# waiting for the next free thread. The loop reads faster than the threads compress, so a queue
# bounded by bytes alone always filled all 128 MB, and in a fresh process (a `tailor commit`)
# every byte of it was a fresh page to zero: with at most threads + 1 pieces, a commit spends
# less system time and less peak RSS at the same wall time (docs/PERFORMANCE.md, "The blob
# writer's queue").
SPARE_PIECES = 1


def disk_full(location: str) -> StoreError:
    return StoreError(
        f"{location}: no space left on the device while writing the commit. The commit was not "
        "recorded and the store is as it was; free some space (",
        Call("gc"),
        " frees what no step uses) and commit again.",
    )


class RangeSource(Protocol):
    """What the writer needs of an input file to store a range of it as one blob: its hash, and
    its bytes in chunks checked against that hash as they are read (an input that changes in
    between is refused by the source). The store knows no input format: formats/source.py's
    ``InputFile`` is one such source."""

    def hash(self, offset: int, length: int) -> str: ...
    def verified_chunks(self, offset: int, length: int, digest: str) -> Iterable[BytesLike]: ...


class BlobStore(Protocol):
    """What the writer asks of the store it writes into (``Repository`` is one): where its bytes go,
    and which blobs it holds already. Named here so that packs/ needs nothing above it."""

    location: str
    backend: Backend

    def blob(self, digest: str) -> BlobRecord | None: ...
    def stored_bytes(self, row: BlobRecord) -> int | None: ...
    def object_size(self, key: str) -> int | None: ...


class BlobWriter:
    def __init__(
        self,
        repo: BlobStore,
        *,
        level: int = codec.DEFAULT_LEVEL,
        threads: int | None = None,
        in_flight: int = IN_FLIGHT_BYTES,
        elsewhere: frozenset[str] = frozenset(),
    ) -> None:
        self.store = repo
        self.elsewhere = elsewhere  # blobs another rank of the same rank-parallel commit writes
        self.batch = repo.backend.batch()  # this commit's blobs, durable together at finish()
        self.packs = PackWriter(self.batch)  # small blobs share pack objects
        self._pack_sizes: dict[str, int | None] = {}  # packs of earlier commits, looked up once per commit
        self.level = level
        self.threads = compute_threads(threads)  # from the usable cores unless given (core/threads.py)
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="tailor-blob")
        self._budget = in_flight
        self._queued = 0
        self._slots = self.threads + SPARE_PIECES
        self._count = 0
        self._room = threading.Condition()
        self._pending: dict[str, Future[BlobRecord]] = {}
        self._known: set[str] = set()
        self._failure: StoreError | None = None  # the first failed write; later blobs are not attempted
        self.reused_bytes = 0

    def add(self, data: memoryview, *, itemsize: int = 1, is_float: bool = False, digest: str | None = None) -> str:
        """Name ``data`` and write it if new. ``data`` must be private memory that nothing changes:
        it is hashed here (unless ``digest``, its xxh3-128 from the same memory, is given) and
        compressed later, on a worker thread."""
        if self._failure is not None:
            raise self._failure
        digest = digest or codec.content_hash(data)
        if self._known_blob(digest, len(data)):
            return digest
        self._reserve(len(data))
        future = self._pool.submit(self._write, digest, data, itemsize, is_float)
        future.add_done_callback(lambda _f, n=len(data): self._release(n))
        self._pending[digest] = future
        return digest

    def add_stream(self, src: RangeSource, offset: int, length: int) -> str:
        """Name a large range of an input file and write it if new, in chunks, on this thread."""
        if self._failure is not None:
            raise self._failure
        digest = src.hash(offset, length)
        if self._known_blob(digest, length):
            return digest
        future: Future[BlobRecord] = Future()
        self._pending[digest] = future
        try:
            encoded = codec.encode_stream(src.verified_chunks(offset, length, digest), level=self.level)
            self._put(digest, encoded, length)
        except BaseException as exc:
            future.set_exception(exc)
            raise
        future.set_result(BlobRecord(digest, length, encoded.size, encoded.descriptor, created_at=time.time()))
        return digest

    def add_encoded(self, raw: bytearray, stored: bytes, descriptor: str) -> str:
        """Name ``raw`` and, if new, store ``stored``, bytes another codec already made from it (the
        archive codec, whose encoding needs a base blob). On this thread: archiving is gc's, not a
        commit's, work."""
        if self._failure is not None:
            raise self._failure
        digest = codec.content_hash(raw)
        if self._known_blob(digest, len(raw)):
            return digest
        future: Future[BlobRecord] = Future()
        self._pending[digest] = future
        try:
            future.set_result(self._place(digest, len(raw), codec.Encoded(descriptor, [stored])))
        except BaseException as exc:
            future.set_exception(exc)
            raise
        return digest

    def _known_blob(self, digest: str, size: int) -> bool:
        if digest in self._pending or digest in self._known or digest in self.elsewhere:
            self.reused_bytes += size
            return True
        row = self.store.blob(digest)
        if row is not None and self._present(row):
            self._known.add(digest)
            self.reused_bytes += size
            return True
        return False  # new, or indexed but missing or cut short: (re)written, and its row updated

    def _present(self, row: BlobRecord) -> bool:
        if row.pack is None:
            return self.store.stored_bytes(row) == row.stored_size
        if row.pack not in self._pack_sizes:
            self._pack_sizes[row.pack] = self.store.object_size(row.key())
        size = self._pack_sizes[row.pack]
        return size is not None and (row.pack_offset or 0) + row.stored_size <= size

    def _reserve(self, n: int) -> None:
        """Wait until the queue has room for ``n`` bytes and one more piece; a piece larger than
        the budget goes alone."""
        with self._room:
            self._room.wait_for(
                lambda: self._queued == 0 or (self._queued + n <= self._budget and self._count < self._slots)
            )
            self._queued += n
            self._count += 1

    def _release(self, n: int) -> None:
        with self._room:
            self._queued -= n
            self._count -= 1
            self._room.notify_all()

    def _write(self, digest: str, data: memoryview, itemsize: int, is_float: bool) -> BlobRecord:
        if self._failure is not None:
            raise self._failure
        return self._place(
            digest, len(data), codec.encode(data, itemsize=itemsize, is_float=is_float, level=self.level)
        )

    def _place(self, digest: str, raw_size: int, encoded: codec.Encoded) -> BlobRecord:
        """Write an encoded blob: into a pack when it is small, else as an object of its own,
        encoded chunk by chunk as it is written."""
        if raw_size < PACK_BELOW:
            stored = b"".join(bytes(c) for c in encoded)
            self._guard(digest, lambda: self.packs.add(digest, stored, raw_size, encoded.descriptor))
            return BlobRecord(digest, raw_size, len(stored), encoded.descriptor, created_at=time.time())
        self._put(digest, encoded, raw_size)
        return BlobRecord(digest, raw_size, encoded.size, encoded.descriptor, created_at=time.time())

    def _put(self, digest: str, encoded: codec.Encoded, raw_size: int) -> None:
        self._guard(digest, lambda: self.batch.put(blob_key(digest), encoded, raw_size))

    def _guard(self, digest: str, write: Callable[[], None]) -> None:
        """Run a write; turn its failure into the commit's one clear error (the first one wins)."""
        try:
            write()
        except (InputChangedError, BackendError) as exc:
            self._failure = exc
            raise
        except OSError as exc:
            if is_out_of_space(exc):
                self._failure = disk_full(self.store.location)
            else:
                self._failure = StoreError(
                    f"{self.store.location}: writing blob {digest} failed ({exc}); the commit was not recorded."
                )
            raise self._failure from None

    def finish(self) -> list[BlobRecord]:
        """Wait for every write, then make the renames durable. Raises the first failure."""
        try:
            blobs = [f.result() for f in self._pending.values()]
        finally:
            self._pool.shutdown(wait=True)
        self._guard("(last pack)", self.packs.flush)
        self.batch.publish()
        placed = self.packs.placed
        return [
            replace(b, pack=placed[b.hash][0], pack_offset=placed[b.hash][1]) if b.hash in placed else b for b in blobs
        ]

    def new_packs(self) -> list[tuple[str, int]]:
        """(name, size) of the packs this commit wrote."""
        return list(self.packs.sealed)

    def hash_only(self, data: memoryview) -> str:
        """The name these bytes would have, for atoms that are rebuilt instead of stored."""
        return codec.content_hash(data)

    def written(self) -> list[str]:
        """Digests of the blobs this writer put (or may have put) into the backend."""
        return list(self._pending)

    def written_packs(self) -> list[str]:
        return [name for name, _ in self.packs.sealed]

    def abort(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pool.shutdown(wait=True)
        self.batch.discard()
