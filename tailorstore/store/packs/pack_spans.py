"""Reading the small blobs of packs with few requests, on an object store.

Why: on S3 every GET is a round trip (tens of milliseconds to the first byte on AWS), and
a checkout of the 23M benchmark model reads 122 packed blobs, one ranged GET each. An
operation that knows which blobs it will read says so first (:meth:`Repository.reading`):
the packed ones are grouped by pack, sorted by offset and merged into spans while the
bytes nobody asked for between two neighbours stay under :data:`GAP` and a span under
:data:`SPAN_MOST`, as restic reads the blobs of a pack in one request.

A span is fetched once, by the first reader that needs it (other threads wait for that
fetch). Fetched spans stay under :data:`BUDGET` bytes: past it, spans whose blobs have all
been read go first (kept until then, since a blob several tensors share is read again),
then the least recently used, and the blobs of a span gone are read on their own. A fetch
that fails leaves the blob to be read on its own too, so its error is the one a plain read
gives. The bytes are the stored bytes:
decoding and the hash check come after, as for any read, so a damaged span is caught
exactly as a damaged blob is.
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tailorstore.core.object_keys import pack_key
from tailorstore.core.records import BlobRecord
from tailorstore.store.backends.base import Backend

GAP = 256 << 10  # unwanted bytes a span may carry between two wanted blobs
SPAN_MOST = 16 << 20  # largest span (about one pack)
BUDGET = 64 << 20  # fetched spans held at once, at most


@dataclass(eq=False)
class _Span:
    pack: str
    start: int
    end: int
    unread: set[str] = field(default_factory=set)  # blobs of the span not read yet
    data: bytes | None = None
    fetching: bool = False
    gone: bool = False  # evicted, or its fetch failed: its blobs are read on their own
    ready: threading.Event = field(default_factory=threading.Event)


class ViewReader(io.RawIOBase):
    """A file over bytes already in memory, read without copying them first."""

    def __init__(self, view: memoryview) -> None:
        self._view = view

    def readable(self) -> bool:
        return True

    def readinto(self, dest: memoryview | bytearray) -> int:  # type: ignore[override]
        n = min(len(dest), len(self._view))
        memoryview(dest).cast("B")[:n] = self._view[:n]
        self._view = self._view[n:]
        return n


def plan_spans(rows: Iterable[BlobRecord], gap: int = GAP, most: int = SPAN_MOST) -> dict[str, _Span]:
    """Each packed blob of ``rows`` -> the span of its pack it is read with."""
    by_pack: dict[str, dict[str, BlobRecord]] = {}
    for row in rows:
        if row.pack is not None:
            by_pack.setdefault(row.pack, {})[row.hash] = row
    where: dict[str, _Span] = {}
    for pack, blobs in by_pack.items():
        span: _Span | None = None
        for row in sorted(blobs.values(), key=lambda r: r.pack_offset or 0):
            lo = row.pack_offset or 0
            hi = lo + row.stored_size
            if span is None or lo - span.end > gap or hi - span.start > most:
                span = _Span(pack, lo, hi)
            span.end = max(span.end, hi)
            span.unread.add(row.hash)
            where[row.hash] = span
    return where


class PackSpans:
    """The spans of one operation's planned reads, shared by its threads."""

    def __init__(
        self,
        backend: Backend,
        rows: Iterable[BlobRecord],
        budget: int = BUDGET,
        fetch: Callable[[str, int, int], bytes] | None = None,
    ) -> None:
        self._backend = backend
        self._get = fetch or backend.get  # the node's shared windows (node_windows.py), or the backend
        self._where = plan_spans(rows)
        self._budget = budget
        self._lock = threading.Lock()
        self._held: OrderedDict[int, _Span] = OrderedDict()  # fetched, not used up; least recent first
        self._held_bytes = 0
        self.fetches = 0  # requests made, for tests and benchmarks

    def open(self, row: BlobRecord) -> io.RawIOBase | None:
        """A reader of the row's stored bytes from its span, or None: read it on its own."""
        span = self._where.get(row.hash)
        if span is None or row.pack != span.pack:
            return None
        with self._lock:
            if span.gone:
                return None
            fetch = not span.fetching
            span.fetching = True
        if fetch:
            self._fetch(span)
        span.ready.wait()
        with self._lock:
            data = span.data
            if data is None:
                return None
            span.unread.discard(row.hash)
            if id(span) in self._held:
                # a span used up goes first when room is needed; kept until then, as a blob that
                # several tensors share (dedup) is read again
                self._held.move_to_end(id(span), last=bool(span.unread))
        lo = (row.pack_offset or 0) - span.start
        return ViewReader(memoryview(data)[lo : lo + row.stored_size])

    def _fetch(self, span: _Span) -> None:
        try:
            data = self._get(pack_key(span.pack), span.start, span.end - span.start)
        except Exception:  # the blob's own read says what went wrong
            with self._lock:
                span.gone = True
            span.ready.set()
            return
        with self._lock:
            self.fetches += 1
            span.data = data
            self._held[id(span)] = span
            self._held_bytes += len(data)
            while self._held_bytes > self._budget and len(self._held) > 1:
                oldest = next(iter(self._held.values()))
                self._drop(oldest if oldest is not span else list(self._held.values())[1])
        span.ready.set()

    def _drop(self, span: _Span) -> None:
        """Forget a span's bytes (readers already given a view keep theirs alive); lock held."""
        if self._held.pop(id(span), None) is not None and span.data is not None:
            self._held_bytes -= len(span.data)
        span.data = None
        span.gone = True
