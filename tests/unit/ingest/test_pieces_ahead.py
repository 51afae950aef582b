"""A commit on many cores prepares its pieces (read, named, rounded) on helper threads, ahead of
its loop: in order, within a byte budget, each error raised where its piece is taken, and the
store it leaves is the one a commit without helpers leaves."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import tailorstore
from tailorstore.core.rounding import ROUND_FROM_MASTER
from tailorstore.ingest.pieces_ahead import ROUND_SLICE, PiecesAhead, prepare, read_helpers
from tailorstore.store.codec import content_hash
from tests.conftest import TEST_DATA, manifest_rows

CHECKPOINT = TEST_DATA / "format1" / "checkpoint"


class Reads:
    """Reads of ``n`` pieces of ``size`` bytes that record when they run, and on which thread."""

    def __init__(self, n: int, size: int, fail_at: int | None = None) -> None:
        self.size, self.fail_at = size, fail_at
        self.started: list[int] = []
        self.threads: set[str] = set()
        self.lock = threading.Lock()
        self.jobs = [(lambda i=i: prepare(self.reader(i)), size) for i in range(n)]

    def reader(self, i: int):  # type: ignore[no-untyped-def]
        def read() -> memoryview:
            with self.lock:
                self.started.append(i)
                self.threads.add(threading.current_thread().name)
            time.sleep(0.002)
            if i == self.fail_at:
                raise OSError(f"read {i} failed")
            return memoryview(bytes([i % 256]) * self.size)

        return read


def test_helpers_only_where_there_are_cores_to_spare() -> None:
    assert [read_helpers(t) for t in (1, 2, 3, 4, 5, 9, 17, 65)] == [0, 0, 0, 1, 1, 2, 4, 4]


def test_pieces_come_named_and_in_order_from_helpers_within_the_budget() -> None:
    reads = Reads(40, 1000)
    seen = []
    with PiecesAhead(reads.jobs, helpers=3, budget=4000) as pieces:
        for i in range(40):
            piece = pieces.take()
            assert piece.digest == content_hash(piece.data)
            seen.append(piece.data[0])
            with reads.lock:
                ahead = len(reads.started) - (i + 1)
            assert ahead <= 4, f"{ahead} pieces read ahead of piece {i}, over the budget of 4"
    assert seen == [i % 256 for i in range(40)]
    assert reads.threads and all(name.startswith("tailor-read") for name in reads.threads)


def test_without_helpers_each_piece_is_prepared_when_taken() -> None:
    reads = Reads(3, 10)
    with PiecesAhead(reads.jobs, helpers=0) as pieces:
        pieces.take()
        assert reads.started == [0]
        pieces.take()
    assert reads.threads == {threading.current_thread().name}


def test_a_failed_read_is_raised_where_its_piece_is_taken() -> None:
    reads = Reads(10, 10, fail_at=5)
    with PiecesAhead(reads.jobs, helpers=2, budget=1000) as pieces:
        for i in range(5):
            assert pieces.take().data[0] == i
        with pytest.raises(OSError, match="read 5 failed"):
            pieces.take()


def test_leaving_early_drops_the_pieces_not_started() -> None:
    reads = Reads(200, 10)
    with PiecesAhead(reads.jobs, helpers=1, budget=50) as pieces:
        pieces.take()
    assert len(reads.started) <= 10, "the helpers stopped with the loop, not at the end of the file"


def test_a_whole_master_is_named_rounded_and_a_part_of_one_kept_rounded() -> None:
    """A whole parameter's master needs only the name of its rounded bytes: rounded and hashed a
    slice at a time, with no copy kept. A part is held rounded until its parameter is whole."""
    import torch

    master = torch.randn(300_001)  # three slices and a bit: the name runs over slice boundaries
    assert master.numel() * 4 > 2 * ROUND_SLICE
    data = memoryview(master.numpy()).cast("B")
    expected = bytes(memoryview(master.to(torch.bfloat16).view(torch.int16).numpy()).cast("B"))
    whole = prepare(lambda: data, "bfloat16", True)
    assert whole.rounded is None and whole.rounded_digest == content_hash(expected)
    assert whole.digest == content_hash(data)
    part = prepare(lambda: data, "bfloat16", False)
    assert part.rounded is not None and bytes(part.rounded) == expected and part.rounded_digest is None


def test_a_commit_with_helpers_stores_what_one_without_stores(tmp_path: Path, thread_starts: list[str]) -> None:
    started = thread_starts
    found = {}
    for threads in (1, 9):  # 9 compressing threads: two helpers
        started.clear()
        with tailorstore.Store.init(tmp_path / f"store{threads}") as store:
            store.commit(CHECKPOINT, threads=threads)
            found[threads] = manifest_rows(store, store.log()[0].step)
            store.checkout("latest", tmp_path / f"out{threads}")
        helpers = {n for n in started if n.startswith("tailor-read")}
        assert len(helpers) == read_helpers(threads), helpers
    assert any(atom[13] == ROUND_FROM_MASTER for atom in found[9]["atoms"]), "weights derive from masters rounded ahead"
    assert found[1] == found[9]  # every file and atom with its blob's name (packs may differ: blobs land in any order)
    for original in CHECKPOINT.rglob("*"):
        if original.is_file():
            assert (tmp_path / "out9" / original.relative_to(CHECKPOINT)).read_bytes() == original.read_bytes()
