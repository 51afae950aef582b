"""Private copies of input pieces in memory that is touched once and handed out again.

A commit copies every piece it stores out of its input file into private memory (the copy
that is hashed is the copy that is compressed: formats/source.py). Fresh memory is far slower
to touch than memory already mapped, and glibc returns large freed buffers to the kernel. The
command line tunes glibc to keep them (host_memory.py), but a library must not change its host's
allocator: inside a training process the same commit faulted in many times as many pages, on
the cores the training loop needs (docs/PERFORMANCE.md, "Fresh pages").

So pieces come from one slab per process, allocated on first use and kept: a commit inside
training faults it in once, and every later commit reuses the same pages. A piece is an
ndarray view of the slab that carries a lease; the lease returns its bytes to the slab when
CPython frees the last view of the piece (a memoryview or numpy view of it keeps it alive),
so no caller releases anything by hand and no piece can be reused while anything still reads
it. When the slab has no room (a piece larger than it, or more pieces alive than it holds),
the piece is ordinary fresh memory, as before: never a wait, never a failure.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

SLAB_BYTES = 128 << 20  # the writer queues at most this much (store/packs/writer.py)
_ALIGN = 64  # every piece starts on a cache line, so word views of it are aligned
_SMALLEST = 64 << 10  # smaller pieces come from the allocator's own free lists cheaply


class _Lease:
    """Bytes [start, start + size) of a slab, handed back when the piece holding this dies.

    ``__del__`` may run in any thread at any allocation (even inside :meth:`Slab.take`), so it
    only appends to a deque, which needs no lock; ``take`` folds the returns in."""

    __slots__ = ("returned", "size", "start")

    def __init__(self, returned: deque[tuple[int, int]], start: int, size: int) -> None:
        self.returned, self.start, self.size = returned, start, size

    def __del__(self) -> None:
        self.returned.append((self.start, self.size))


class _Piece(np.ndarray):
    """A view of the slab that holds its lease. Only memoryviews of it leave this module: they
    keep it alive through the buffer protocol, and so does any numpy array made from them."""

    _lease: _Lease | None = None


class Slab:
    """First fit over a list of free ranges, merged as they come back; thread-safe."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._memory: np.ndarray | None = None
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (start, size), sorted by start
        self._returned: deque[tuple[int, int]] = deque()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        """``nbytes`` of private memory as a flat byte memoryview: slab memory when there is room,
        fresh memory otherwise."""
        if nbytes < _SMALLEST or nbytes > self.capacity:
            return memoryview(np.empty(nbytes, dtype=np.uint8)).cast("B")
        if self._memory is None:
            with self._lock:
                if self._memory is None:
                    self._memory = np.empty(self.capacity, dtype=np.uint8)
        size = -(-nbytes // _ALIGN) * _ALIGN
        with self._lock:
            self._fold_returns()
            start = self._first_fit(size)
        if start is None:
            return memoryview(np.empty(nbytes, dtype=np.uint8)).cast("B")
        piece = self._memory[start : start + nbytes].view(_Piece)
        piece._lease = _Lease(self._returned, start, size)
        return memoryview(piece).cast("B")

    def _first_fit(self, size: int) -> int | None:
        for i, (start, room) in enumerate(self._free):
            if room >= size:
                if room > size:
                    self._free[i] = (start + size, room - size)
                else:
                    del self._free[i]
                return start
        return None

    def _fold_returns(self) -> None:
        """Merge the ranges given back since the last call into the sorted free list."""
        if not self._returned:
            return
        ranges = self._free
        while self._returned:
            ranges.append(self._returned.popleft())
        ranges.sort()
        merged: list[tuple[int, int]] = []
        for start, size in ranges:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self._free = merged

    def free_bytes(self) -> int:
        with self._lock:
            self._fold_returns()
            return sum(size for _, size in self._free)


PIECES = Slab(SLAB_BYTES)


def private_copy_buffer(nbytes: int) -> memoryview:
    """Room for a commit's private copy of a piece (formats/source.py) or of its rounded form
    (rounding.py), as a byte memoryview."""
    return PIECES.take(nbytes)
