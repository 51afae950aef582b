"""Decoding ahead of a writer, in bounded memory.

A writer of one long file (export's ``model.safetensors``) wants the next bytes decoded while
it writes the current ones: zstd, xxh3, numpy and file writes release the GIL, so helper
threads keep the other core busy. Reading whole tensors ahead would hold the largest tensor
(and whatever is queued behind it) in memory; here each helper streams its source chunk by
chunk into a fixed set of reused slots instead, so memory stays at ``slots * slot_bytes``
whatever the model's size, and no page is faulted in twice.

Why more than one helper: one helper reading and decoding every tensor in turn was the slower
side of export, busy nearly all of it while the writer waited; with two, export is faster, and
a third or fourth gained nothing (reads and writes then share the disk; docs/PERFORMANCE.md,
"Decoding ahead of a writer"). Helpers take sources in order, each
source whole, and each helper fills only its own slots. That is what keeps it free of
deadlock: when the caller reaches source ``i``, every earlier source has been read and its
slots given back, so the helper holding ``i`` always has room to go on.

Sources are handed to the caller in order. A source that must run on the caller's thread (one
that queries the SQLite index, which is bound to that thread) is skipped by the helpers and
run in place when the caller reaches it. An error on a helper is raised in the caller, at the
chunk where it happened; leaving early stops the helpers.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

SLOTS = 8
SLOT_BYTES = 4 << 20
HELPERS = 2
_WAKE_SECONDS = 0.1  # how often a blocked helper checks whether the caller has left

Source = Callable[[], Iterable[memoryview]]
_Item = tuple["queue.Queue[memoryview]", memoryview, int] | BaseException | None


class ReadAhead:
    """Runs ``sources[i]()`` for every ``i`` with ``ahead[i]`` on helper threads;
    :meth:`chunks` hands their chunks to the caller in order. Each yielded view is valid
    until the next one. ``slots`` are shared out between the ``helpers`` (at least one each)."""

    def __init__(
        self,
        sources: Sequence[Source],
        ahead: Sequence[bool],
        *,
        slots: int = SLOTS,
        slot_bytes: int = SLOT_BYTES,
        helpers: int = HELPERS,
    ) -> None:
        if len(sources) != len(ahead):
            raise ValueError("one `ahead` flag per source")
        self._sources, self._ahead, self._slot_bytes = list(sources), list(ahead), slot_bytes
        self._out: dict[int, queue.SimpleQueue[_Item]] = {i: queue.SimpleQueue() for i, a in enumerate(ahead) if a}
        self._pending = iter(list(self._out))  # the helpers' sources, taken in order
        self._claim = threading.Lock()
        self._stop = threading.Event()
        count = min(max(1, helpers), len(self._out))
        per_helper = max(1, slots // max(1, count))
        self._threads = [
            threading.Thread(target=self._produce, args=(per_helper,), name="tailor-read-ahead", daemon=True)
            for _ in range(count)
        ]
        self._next = 0

    def __enter__(self) -> ReadAhead:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def chunks(self, i: int) -> Iterator[memoryview]:
        """Source ``i``'s chunks; sources must be asked for in order, each once."""
        if i != self._next:
            raise ValueError(f"source {i} asked for out of order (expected {self._next})")
        self._next += 1
        if not self._ahead[i]:
            yield from self._sources[i]()
            return
        out = self._out[i]
        while True:
            item = out.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                return
            free, slot, nbytes = item
            try:
                yield slot[:nbytes]
            finally:
                free.put(slot)

    def _produce(self, slots: int) -> None:
        free: queue.Queue[memoryview] = queue.Queue()
        for _ in range(slots):
            free.put(memoryview(np.empty(self._slot_bytes, dtype=np.uint8)))  # pages touched only when used
        while not self._stop.is_set():
            with self._claim:
                i = next(self._pending, None)
            if i is None:
                return
            out = self._out[i]
            try:
                for chunk in self._sources[i]():
                    for pos in range(0, len(chunk), self._slot_bytes):
                        piece = chunk[pos : pos + self._slot_bytes]
                        slot = self._take_slot(free)
                        if slot is None:
                            return  # the caller has left
                        slot[: len(piece)] = piece
                        out.put((free, slot, len(piece)))
                out.put(None)
            except BaseException as exc:  # handed to the caller, who raises it where it reads
                out.put(exc)
                return

    def _take_slot(self, free: queue.Queue[memoryview]) -> memoryview | None:
        while not self._stop.is_set():
            try:
                return free.get(timeout=_WAKE_SECONDS)
            except queue.Empty:
                continue
        return None
