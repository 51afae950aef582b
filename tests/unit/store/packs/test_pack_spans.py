"""Planned reads of packed blobs (store/packs/pack_spans.py): neighbours merged into spans, each
span fetched once however many threads want it, memory held under a budget, and any
trouble left to the blob's own read. Real packs (sealed by packs.py) on a real directory."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from tailorstore.core.object_keys import pack_key
from tailorstore.core.records import BlobRecord
from tailorstore.store.backends.base import Backend
from tailorstore.store.backends.location import resolve
from tailorstore.store.packs.pack import seal
from tailorstore.store.packs.pack_spans import GAP, SPAN_MOST, PackSpans, plan_spans


class CountingBackend:
    """A real POSIX backend that counts the ranged gets made of it."""

    def __init__(self, inner: Backend) -> None:
        self.inner, self.gets = inner, 0
        self._lock = threading.Lock()

    def get(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        with self._lock:
            self.gets += 1
        return self.inner.get(key, start, length)


def a_pack(backend: Backend, sizes: list[int]) -> tuple[list[BlobRecord], dict[str, bytes]]:
    """A sealed pack of random blobs of ``sizes``, put on ``backend``; its rows and bytes."""
    blobs = [(os.urandom(16).hex(), os.urandom(n)) for n in sizes]
    name, chunks, placed = seal([(digest, data, len(data), "raw") for digest, data in blobs])
    backend.put(pack_key(name), chunks)
    rows = [BlobRecord(e.hash, e.raw_size, e.stored_size, e.codec, name, e.offset) for e in placed]
    return rows, dict(blobs)


def read(spans: PackSpans, row: BlobRecord) -> bytes | None:
    reader = spans.open(row)
    return None if reader is None else reader.read()


def test_neighbours_merge_into_spans_below_the_gap_and_the_size_limit() -> None:
    def row(i: int, offset: int, size: int, pack: str = "p" * 32) -> BlobRecord:
        return BlobRecord(f"{i:032x}", size, size, "raw", pack, offset)

    rows = [
        row(0, 0, 100),
        row(1, 100 + GAP, 100),  # exactly GAP unwanted bytes after blob 0: same span
        row(2, 200 + 2 * GAP + 1, 100),  # one byte more: a new span
        row(3, SPAN_MOST, 100),  # would take that span past SPAN_MOST: a new one
        row(4, 0, 10, pack="q" * 32),  # another pack, its own span
        BlobRecord(f"{5:032x}", 10, 10, "raw"),  # loose: not planned
    ]
    where = plan_spans(reversed(rows))  # order of the plan does not matter
    span = [where.get(r.hash) for r in rows]
    assert span[0] is span[1] and span[1] is not span[2] and span[2] is not span[3]
    assert span[4] is not None and span[4].pack == "q" * 32 and span[5] is None
    assert (span[0].start, span[0].end) == (0, 200 + GAP)
    assert all(s.end - s.start <= SPAN_MOST for s in where.values())


def test_a_span_is_fetched_once_for_many_threads_and_each_blob_gets_its_bytes(tmp_path: Path) -> None:
    backend = CountingBackend(resolve(tmp_path / "store").backend)
    rows, data = a_pack(backend.inner, [1000 + 37 * i for i in range(40)])
    spans = PackSpans(backend, rows)  # type: ignore[arg-type]
    got: dict[str, bytes | None] = {}
    barrier = threading.Barrier(8)

    def worker(part: list[BlobRecord]) -> None:
        barrier.wait()
        for row in part:
            got[row.hash] = read(spans, row)

    threads = [threading.Thread(target=worker, args=(rows[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == data, "every blob read back exactly"
    assert backend.gets == 1 and spans.fetches == 1, "40 blobs, one request"
    assert read(spans, rows[0]) == data[rows[0].hash] and backend.gets == 1, "a blob read again (dedup): no request"


def test_spans_beyond_the_budget_are_dropped_and_their_blobs_read_on_their_own(tmp_path: Path) -> None:
    backend = CountingBackend(resolve(tmp_path / "store").backend)
    rows_a, data_a = a_pack(backend.inner, [4000] * 3)
    rows_b, data_b = a_pack(backend.inner, [4000] * 3)
    spans = PackSpans(backend, rows_a + rows_b, budget=15_000)  # room for one span of 12,000 bytes
    assert read(spans, rows_a[0]) == data_a[rows_a[0].hash]
    assert read(spans, rows_b[0]) == data_b[rows_b[0].hash]  # fetching B drops A, least recently used
    assert read(spans, rows_a[1]) is None
    assert read(spans, rows_b[1]) == data_b[rows_b[1].hash]
    assert backend.gets == 2


def test_spans_used_up_go_before_spans_still_wanted(tmp_path: Path) -> None:
    backend = CountingBackend(resolve(tmp_path / "store").backend)
    packs = [a_pack(backend.inner, [4000] * 2) for _ in range(3)]
    spans = PackSpans(backend, [r for rows, _ in packs for r in rows], budget=17_000)  # two spans of 8,000
    (a, data_a), (b, data_b), (c, data_c) = packs
    assert read(spans, b[0]) == data_b[b[0].hash]  # B fetched first, still wanted
    assert read(spans, a[0]) == data_a[a[0].hash] and read(spans, a[1]) == data_a[a[1].hash]  # A used up
    assert read(spans, c[0]) == data_c[c[0].hash]  # C needs room: A goes, though B is older
    assert read(spans, b[1]) == data_b[b[1].hash] and read(spans, a[0]) is None
    assert backend.gets == 3


def test_a_failed_fetch_leaves_the_blob_to_its_own_read(tmp_path: Path) -> None:
    backend = CountingBackend(resolve(tmp_path / "store").backend)
    rows, _ = a_pack(backend.inner, [500, 500])
    backend.inner.delete(pack_key(rows[0].pack or ""))
    spans = PackSpans(backend, rows)  # type: ignore[arg-type]
    assert read(spans, rows[0]) is None and read(spans, rows[1]) is None
    assert spans.fetches == 0


def test_a_blob_moved_to_another_pack_since_the_plan_is_read_on_its_own(tmp_path: Path) -> None:
    backend = CountingBackend(resolve(tmp_path / "store").backend)
    rows, _ = a_pack(backend.inner, [500, 500])
    spans = PackSpans(backend, rows)  # type: ignore[arg-type]
    moved = BlobRecord(rows[0].hash, 500, 500, "raw", "f" * 32, 0)
    assert spans.open(moved) is None and backend.gets == 0
