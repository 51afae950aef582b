"""A file's pieces prepared ahead of the commit's loop, on helper threads, in bounded memory.

The commit's loop decides, piece by piece and in order, what becomes of each piece: a new blob,
a known one, or a weight derived from its master. Before that it must have the piece's private
copy (formats/source.py), its xxh3-128 name and, for an FP32 master whose weight may be derived,
the master rounded to the weight's dtype. Those three are pure work on the one private copy, and
they were the loop's own time: on a 16-core GPU node a commit stopped scaling from 4 threads
on, whatever the compressing pool could do (docs/PERFORMANCE.md, "Byte planes"). Here helpers
prepare the pieces in parallel, in the loop's order and at most ``budget`` bytes ahead; the
loop then only decides, looks blobs up in the index (bound to its thread) and queues them. A
blob is still named and compressed from the same single copy.

With no helpers (fewer than four compressing threads, so fewer than four cores) each piece is
prepared on the loop's thread when taken, as before: there the preparation already overlaps the
compression of earlier pieces, and helpers only compete for the same cores.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

from tailorstore.core.rounding import rounded, rounded_chunks
from tailorstore.store.codec import content_hash

AHEAD_BYTES = 64 << 20  # prepared, not yet taken; the writer's own queue (store/packs/writer.py) comes on top
MAX_HELPERS = 4


@dataclass(frozen=True)
class Prepared:
    """One piece, ready for the loop's decision."""

    data: memoryview  # the private copy: what is hashed is what is compressed
    digest: str  # xxh3-128 of ``data``: the blob's name if it is stored
    # ``data`` rounded to its weight's dtype, where that weight may derive from it and this piece is
    # only part of its parameter (held until the parameter is whole: derive.py)
    rounded: memoryview | None = None
    rounded_digest: str | None = None  # the rounded bytes' name, where this piece is its parameter's whole master


def prepare(read: Callable[[], memoryview], round_to: str | None = None, whole: bool = False) -> Prepared:
    data = read()
    if round_to is None:
        return Prepared(data, content_hash(data))
    if whole:  # only the rounded bytes' name is needed: no copy of them is kept
        return Prepared(data, content_hash(data), rounded_digest=rounded_name(data, round_to))
    return Prepared(data, content_hash(data), rounded(data, round_to))


#: FP32 bytes rounded and hashed at a time: their rounded half stays in the L2 cache for the hash.
ROUND_SLICE = 512 << 10


def rounded_name(master: memoryview, dtype: str) -> str:
    """The xxh3-128 of ``master`` rounded to ``dtype``, rounded a slice at a time into this
    thread's buffer (``rounded_chunks``) and hashed while the slice is in cache. Keeping the whole
    rounded copy only to hash it cost a fresh buffer of half the master's size, and fresh pages
    are slow to touch (docs/PERFORMANCE.md, "Fresh pages")."""
    digest = xxhash.xxh3_128()
    whole = memoryview(master).cast("B")
    slices = (whole[at : at + ROUND_SLICE] for at in range(0, len(whole), ROUND_SLICE))
    for out in rounded_chunks(slices, dtype, "rounded-name"):
        digest.update(out)
    return digest.hexdigest()


def read_helpers(threads: int) -> int:
    """Helpers for a commit whose compressing pool has ``threads`` threads (one a core)."""
    return 0 if threads < 4 else min(MAX_HELPERS, threads // 4)


Job = Callable[[], Prepared]


class PiecesAhead:
    """``jobs`` (each a preparation and the bytes it holds) run ahead on ``helpers`` threads;
    :meth:`take` returns their results in order. With no helpers each runs when taken."""

    def __init__(self, jobs: Sequence[tuple[Job, int]], helpers: int, budget: int = AHEAD_BYTES) -> None:
        self._jobs = jobs
        self._budget = budget
        self._submitted = 0
        self._taken = 0
        self._ahead: deque[tuple[Future[Prepared], int]] = deque()
        self._ahead_bytes = 0
        self._pool = ThreadPoolExecutor(helpers, thread_name_prefix="tailor-read") if helpers > 0 else None

    def take(self) -> Prepared:
        """The next piece; its preparation's error, if it failed, is raised here."""
        if self._pool is None:
            job, _ = self._jobs[self._taken]
            self._taken += 1
            return job()
        self._fill()
        future, size = self._ahead.popleft()
        self._ahead_bytes -= size
        self._taken += 1
        self._fill()  # the next pieces are prepared while the loop handles this one
        return future.result()

    def _fill(self) -> None:
        assert self._pool is not None
        while self._submitted < len(self._jobs):
            job, size = self._jobs[self._submitted]
            if self._ahead and self._ahead_bytes + size > self._budget:
                return
            self._ahead.append((self._pool.submit(job), size))
            self._ahead_bytes += size
            self._submitted += 1

    def close(self) -> None:
        """Stop: pieces not started are dropped, those under way end (into memory nobody keeps)."""
        if self._pool is not None:
            for future, _ in self._ahead:
                future.cancel()
            self._ahead.clear()
            self._pool.shutdown(wait=True)

    def __enter__(self) -> PiecesAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
