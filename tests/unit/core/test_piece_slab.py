"""The slab that private copies of input pieces come from: reused, never while anything reads it."""

from __future__ import annotations

import gc
import os
import subprocess
import threading

import numpy as np
import pytest

from tailorstore.core import host_memory
from tailorstore.core.piece_slab import Slab

MB = 1 << 20


def fill(view: memoryview, value: int) -> np.ndarray:
    array = np.frombuffer(view, dtype=np.uint8)
    array[:] = value
    return array


def test_a_piece_is_not_handed_out_again_while_any_view_of_it_lives() -> None:
    slab = Slab(4 * MB)
    first = slab.take(3 * MB)
    kept = np.frombuffer(first, dtype=np.uint8)[MB:].view(np.uint32)  # a numpy view of a memoryview slice
    kept[:] = 0x01010101
    del first
    gc.collect()
    second = slab.take(3 * MB)  # no room left beside the live piece: fresh memory, not the same bytes
    fill(second, 0xEE)
    assert (kept == 0x01010101).all()
    assert slab.free_bytes() == MB
    del kept
    gc.collect()
    assert slab.free_bytes() == 4 * MB  # everything back once the last view died (second is fresh memory)
    del second
    third = slab.take(3 * MB)  # now the slab's own bytes again
    assert slab.free_bytes() == MB
    fill(third, 7)


def test_returned_ranges_merge_so_a_large_piece_fits_again() -> None:
    slab = Slab(4 * MB)
    pieces = [slab.take(MB) for _ in range(4)]
    assert slab.free_bytes() == 0
    for i in (1, 3, 0, 2):  # out of order, as compression finishes
        pieces[i] = None  # type: ignore[call-overload]
    whole = slab.take(4 * MB)
    assert slab.free_bytes() == 0, "the four returned ranges merged into one"
    assert len(whole) == 4 * MB


def test_small_and_oversized_pieces_are_ordinary_memory() -> None:
    slab = Slab(2 * MB)
    small, big = slab.take(100), slab.take(3 * MB)
    assert (len(small), len(big)) == (100, 3 * MB)
    assert slab.free_bytes() == 2 * MB


def test_threads_taking_and_dropping_pieces_never_see_each_others_bytes() -> None:
    slab = Slab(8 * MB)
    errors: list[str] = []

    def worker(tag: int) -> None:
        for round_ in range(200):
            size = (64 << 10) * (1 + (tag * 7 + round_) % 24)
            view = slab.take(size)
            value = (tag * 31 + round_) % 251
            array = fill(view, value)
            threading.Event().wait(0.0001)
            if not (array == value).all():
                errors.append(f"thread {tag} round {round_}: its piece was overwritten")
            del array, view

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert errors == []
    assert slab.free_bytes() == 8 * MB


def test_tuning_the_allocator_starts_no_other_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command that opens a store tunes glibc first; finding libc by name ran `ldconfig -p`
    in a child process each time (ctypes.util.find_library)."""

    def no_programs(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a program was started: {args[:1]}")

    host_memory._libc.cache_clear()
    monkeypatch.setattr(subprocess, "Popen", no_programs)
    monkeypatch.setattr(os, "posix_spawn", no_programs)
    try:
        assert host_memory.reuse_freed_memory()
    finally:
        host_memory._libc.cache_clear()
