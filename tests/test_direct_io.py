"""Writes and reads around the page cache: exact bytes, with O_DIRECT and with the buffered fallback."""

from __future__ import annotations

import itertools
import os
import random
import threading
from pathlib import Path

import pytest

from tailorstore.store.direct_io import ALIGN, BLOCK, DirectReader, PlacedWriter, SequentialWriter

MODES = [("direct", True), ("buffered", False)]


def force(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """ "buffered": the path taken where the file system refuses O_DIRECT (as if the flag did not exist)."""
    if mode == "buffered":
        monkeypatch.setattr(os, "O_DIRECT", 0, raising=False)


@pytest.mark.parametrize(("mode", "direct"), MODES)
@pytest.mark.parametrize("size", [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, BLOCK - 3, BLOCK, 3 * BLOCK + 12345])
def test_sequential_writer_writes_exact_bytes(
    mode: str, direct: bool, size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    force(mode, monkeypatch)
    base = tmp_path
    data = random.Random(size).randbytes(size)
    path = base / "blob"
    out = SequentialWriter(path)
    assert out.direct == direct
    rng = random.Random(1)
    at = 0
    while at < size:  # pieces of every size, as the codec hands them over
        n = min(size - at, rng.choice([1, 7, ALIGN, ALIGN + 3, BLOCK // 3, BLOCK + 1]))
        out.write(memoryview(data)[at : at + n])
        at += n
    out.close()
    assert path.read_bytes() == data
    with DirectReader(path) as reader:
        parts = [reader.read(5), bytes(reader.read(ALIGN)), reader.read()]
    assert b"".join(parts) == data


@pytest.mark.parametrize(("mode", "direct"), MODES)
def test_placed_writer_from_two_threads_in_any_order(
    mode: str, direct: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranges of every size and alignment, sharing blocks, written by two threads in random order."""
    force(mode, monkeypatch)
    base = tmp_path
    rng = random.Random(7)
    size = 3 * BLOCK + 5000
    data = rng.randbytes(size)
    cuts = sorted({0, size, *(rng.randrange(size) for _ in range(60)), ALIGN, 2 * ALIGN + 1})
    ranges = [(a, b) for a, b in itertools.pairwise(cuts) if b > a]
    rng.shuffle(ranges)
    path = base / "file"
    out = PlacedWriter(path, size)
    assert (out.direct_fd is not None) == direct

    def work(part: list[tuple[int, int]]) -> None:
        for a, b in part:
            out.pwrite(memoryview(data)[a:b], a)

    threads = [threading.Thread(target=work, args=(ranges[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    back = bytearray(ALIGN * 3 + 17)
    out.pread_into(memoryview(back), ALIGN - 5)
    assert bytes(back) == data[ALIGN - 5 : ALIGN - 5 + len(back)]
    os.fsync(out.fd)
    out.close()
    assert path.read_bytes() == data


def _bytes_read() -> int:
    """Bytes this process has had from read system calls (the kernel's own count)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux's /proc/self/io")
@pytest.mark.parametrize(("mode", "direct"), MODES)
@pytest.mark.parametrize(("start", "length"), [(5000, 10_000), (ALIGN, ALIGN), (3 * BLOCK - 7, BLOCK + 9)])
def test_a_range_reads_its_own_blocks_not_a_whole_block_beyond(
    mode: str, direct: bool, start: int, length: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small blob inside a large pack: only the aligned blocks around it are read from disk."""
    force(mode, monkeypatch)
    data = random.Random(7).randbytes(6 * BLOCK)
    path = tmp_path / "pack"
    path.write_bytes(data)
    before = _bytes_read()
    with DirectReader(path, start, length) as reader:
        got = reader.read()
    read = _bytes_read() - before
    assert got == data[start : start + length]
    aligned = (start + length + ALIGN - 1) // ALIGN * ALIGN - start // ALIGN * ALIGN
    assert aligned <= read <= aligned + ALIGN
