"""Decoding ahead of a writer, in bounded memory.

A writer of one long file (export's ``model.safetensors``) wants the next bytes decoded while
it writes the current ones: zstd, xxh3, numpy and file writes release the GIL, so a helper
thread keeps the second core busy. Reading whole tensors ahead would hold the largest tensor
(and whatever is queued behind it) in memory; here the helper streams each source chunk by
chunk into a fixed set of reused slots instead, so memory stays at ``slots * slot_bytes``
whatever the model's size, and no page is faulted in twice.

Sources are taken in order. A source that must run on the caller's thread (one that queries
the SQLite index, which is bound to that thread) is skipped by the helper and run in place
when the caller reaches it. An error on the helper is raised in the caller, at the chunk
where it happened; leaving early stops the helper.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

SLOTS = 8
SLOT_BYTES = 4 << 20
_WAKE_SECONDS = 0.1  # how often a blocked helper checks whether the caller has left

Source = Callable[[], Iterable[memoryview]]


class ReadAhead:
    """Runs ``sources[i]()`` for every ``i`` with ``ahead[i]`` on a helper thread, in order;
    :meth:`chunks` hands their chunks to the caller in the same order. Each yielded view is
    valid until the next one."""

    def __init__(
        self, sources: Sequence[Source], ahead: Sequence[bool], *, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES
    ) -> None:
        if len(sources) != len(ahead):
            raise ValueError("one `ahead` flag per source")
        self._sources, self._ahead, self._slot_bytes = list(sources), list(ahead), slot_bytes
        self._free: queue.Queue[memoryview] = queue.Queue()
        for _ in range(slots):
            self._free.put(memoryview(np.empty(slot_bytes, dtype=np.uint8)))  # pages touched only when used
        self._filled: queue.SimpleQueue[tuple[int, memoryview | BaseException | None, int]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="tailor-read-ahead", daemon=True)
        self._next = 0

    def __enter__(self) -> ReadAhead:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def chunks(self, i: int) -> Iterator[memoryview]:
        """Source ``i``'s chunks; sources must be asked for in order, each once."""
        if i != self._next:
            raise ValueError(f"source {i} asked for out of order (expected {self._next})")
        self._next += 1
        if not self._ahead[i]:
            yield from self._sources[i]()
            return
        while True:
            index, item, nbytes = self._filled.get()
            if isinstance(item, BaseException):
                raise item
            if index != i:
                raise RuntimeError(f"read-ahead out of step: got source {index} while reading {i}")
            if item is None:
                return
            try:
                yield item[:nbytes]
            finally:
                self._free.put(item)

    def _produce(self) -> None:
        try:
            for i, (source, ahead) in enumerate(zip(self._sources, self._ahead, strict=True)):
                if not ahead:
                    continue
                for chunk in source():
                    for pos in range(0, len(chunk), self._slot_bytes):
                        piece = chunk[pos : pos + self._slot_bytes]
                        slot = self._take_slot()
                        if slot is None:
                            return  # the caller has left
                        slot[: len(piece)] = piece
                        self._filled.put((i, slot, len(piece)))
                self._filled.put((i, None, 0))
        except BaseException as exc:  # handed to the caller, who raises it where it reads
            self._filled.put((-1, exc, 0))

    def _take_slot(self) -> memoryview | None:
        while not self._stop.is_set():
            try:
                return self._free.get(timeout=_WAKE_SECONDS)
            except queue.Empty:
                continue
        return None
