"""Writes and reads around the page cache: exact bytes, with O_DIRECT and with the buffered fallback."""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import random
import threading
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tailorstore.store.backends.direct_io import (
    ALIGN,
    BLOCK,
    DirectReader,
    PlacedWriter,
    RewritableWriter,
    SequentialWriter,
)

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


@pytest.mark.parametrize(("mode", "direct"), MODES)
def test_a_rewritable_writer_overwrites_bytes_written_out_and_still_staged(
    mode: str, direct: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """zipfile goes back to each record's header once its CRC is known: the header may already
    have gone out direct, may still sit in the staging buffer, or straddle the two."""
    force(mode, monkeypatch)
    rng = random.Random(3)
    expect = bytearray()
    out = RewritableWriter(tmp_path / "file")
    assert out.direct == direct
    for _ in range(40):
        piece = rng.randbytes(rng.choice([1, 30, ALIGN + 5, BLOCK // 3, BLOCK + 7]))
        out.write(piece)
        expect += piece
        assert out.tell() == len(expect)
        back = rng.choice([0, 3, len(expect) // 2, len(expect) - BLOCK // 2, len(expect) - 20])
        patch = rng.randbytes(min(40, len(expect) - max(back, 0)))
        out.seek(max(back, 0))
        out.write(patch)
        expect[max(back, 0) : max(back, 0) + len(patch)] = patch
        out.seek(0, os.SEEK_END)
    with pytest.raises(OSError):
        out.seek(len(expect) + 1)  # past the end: nothing there to overwrite
    out.close()
    assert (tmp_path / "file").read_bytes() == bytes(expect)


def test_a_rewritable_writer_refused_direct_midway_keeps_every_overwrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system may take O_DIRECT at open and refuse it at a later write (EINVAL): the writer
    goes on through the page cache (on e3d4e2b the write that met the refusal went on filling a
    staging buffer it had just dropped: TypeError), and an overwrite made to a kept page before the
    refusal and one made after it both land, in the order they were made."""
    from tailorstore.store.backends import direct_io

    real_write_all = direct_io._write_all
    flushes = 0

    def refuse_the_third(fd: int, data: memoryview) -> None:
        nonlocal flushes
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and len(data) == BLOCK:
            flushes += 1
            if flushes == 3:
                raise OSError(errno.EINVAL, "direct I/O refused here")
        real_write_all(fd, data)

    monkeypatch.setattr(direct_io, "_write_all", refuse_the_third)
    expect = bytearray()
    out = RewritableWriter(tmp_path / "file")
    headers = []
    for i in range(6):
        headers.append(out.tell())  # as zipfile does before a record's header
        piece = bytes([i]) * 100 + random.Random(i).randbytes(BLOCK - 50)
        out.write(piece)
        expect += piece
        for n, at in enumerate(headers):  # every header rewritten again after each record
            patch = bytes([0xA0 + i, n]) * 8
            out.seek(at)
            out.write(patch)
            expect[at : at + len(patch)] = patch
        out.seek(0, os.SEEK_END)
    out.close()
    assert flushes >= 3  # the refusal came, after two blocks had gone out direct
    assert (tmp_path / "file").read_bytes() == bytes(expect)


@pytest.mark.parametrize(("mode", "direct"), MODES)
def test_a_zip_written_through_a_rewritable_writer_is_the_same_zip(
    mode: str, direct: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Torch files are zips of stored records: through the writer byte for byte what a plain file gets."""
    force(mode, monkeypatch)
    rng = random.Random(5)
    records = [
        (f"archive/data/{i}", rng.randbytes(rng.choice([3, ALIGN - 1, BLOCK + 11, 2 * BLOCK]))) for i in range(7)
    ]

    def write(f: Any) -> None:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as zf:
            for name, data in records:
                with zf.open(zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0)), "w") as member:
                    for at in range(0, len(data), 1 << 20):
                        member.write(data[at : at + (1 << 20)])

    with open(tmp_path / "plain.zip", "wb") as plain:
        write(plain)
    with RewritableWriter(tmp_path / "ours.zip") as ours:
        write(ours)
    assert (tmp_path / "ours.zip").read_bytes() == (tmp_path / "plain.zip").read_bytes()
    with zipfile.ZipFile(tmp_path / "ours.zip") as zf:
        assert zf.testzip() is None and [zf.read(n) for n, _ in records] == [d for _, d in records]


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux's /proc/self/io")
def test_a_zips_header_rewrites_read_nothing_back_from_disk(tmp_path: Path) -> None:
    """Each record's header is rewritten once its CRC is known, after the header's page has gone out
    direct. From a kept copy of that page, the rewrite reads nothing; through the page cache it made
    the kernel read the page from disk first (and cutting the file to size, its last page): these 12
    records cost 14 page reads on e3d4e2b. A few reads are allowed for the file system's metadata."""
    records = [(f"archive/data/{i}", bytes([i]) * (BLOCK + 11)) for i in range(12)]
    out = RewritableWriter(tmp_path / "ours.zip")
    if not out.direct:
        out.close()
        pytest.skip("this file system refuses O_DIRECT")
    before = _disk_reads()
    with out, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        for name, data in records:
            with zf.open(zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0)), "w") as member:
                member.write(data)
    assert _disk_reads() - before <= 3 * ALIGN
    with zipfile.ZipFile(tmp_path / "ours.zip") as zf:
        assert zf.testzip() is None and [zf.read(n) for n, _ in records] == [d for _, d in records]


def _disk_reads() -> int:
    """Bytes this process has had the kernel fetch from the disk (a page read in order to change
    part of it counts; page-cache hits do not)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/self/io")


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


@pytest.mark.parametrize(("mode", "direct"), MODES)
def test_a_write_abandoned_by_an_error_raises_that_error_and_frees_the_buffer(
    mode: str, direct: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Leaving the block on an error closes the file without writing its tail: the caller discards
    it, and the error raised is the one that stopped the write, whatever writing the tail would say."""
    force(mode, monkeypatch)
    from tailorstore.store.backends import direct_io

    with pytest.raises(KeyError, match="stopped"), RewritableWriter(tmp_path / "file") as out:
        out.write(b"x" * (BLOCK + 5))
        os.close(out.fd)  # the tail's write would now fail with EBADF
        out.fd = os.open(tmp_path / "file", os.O_RDONLY)
        raise KeyError("stopped")
    assert "write" not in getattr(direct_io._local, "busy", set())  # the staging buffer is reused next time
    assert (tmp_path / "file").stat().st_size == (BLOCK if direct else BLOCK + 5)  # no tail written


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs Linux's /proc/self/fd")
@pytest.mark.parametrize(("mode", "direct"), MODES)
def test_a_durable_put_is_synced_after_its_last_byte(
    mode: str, direct: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``PosixBackend.put`` (index parts, manifests: objects the store trusts once renamed into
    place) fsyncs after the file's last byte and its size are written, never before its tail."""
    force(mode, monkeypatch)
    from tailorstore.store.backends.location import resolve

    backend = resolve(tmp_path / "store").backend
    data = random.Random(9).randbytes(BLOCK + (1 << 20) + 12345)  # direct, with a partial last page
    events: list[str] = []
    real = {name: getattr(os, name) for name in ("write", "pwrite", "ftruncate", "fsync")}

    def spy(name: str) -> Any:
        def call(fd: int, *args: Any) -> Any:
            if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):  # the object's temp file, not its folder
                events.append(name)
            return real[name](fd, *args)

        return call

    for name in real:
        monkeypatch.setattr(os, name, spy(name))
    backend.put("blobs/ab/" + "ab" * 8, data)
    monkeypatch.undo()
    assert (tmp_path / "store" / "blobs" / "ab" / ("ab" * 8)).read_bytes() == data
    assert events.count("fsync") == 1 and events[-1] == "fsync", events
    assert events.count("write") >= 2 if direct else events.count("write") >= 1


@pytest.mark.parametrize(("mode", "direct"), MODES)
@pytest.mark.parametrize(("start", "length"), [(0, None), (5000, 2 * BLOCK + 17), (BLOCK - 1, BLOCK + 2)])
def test_a_reader_reads_the_next_block_ahead_on_the_pool(
    mode: str, direct: bool, start: int, length: int | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a whole block, the next is read on a prefetch thread while the caller works on this one:
    the same bytes come out, in pieces of any size, and no read goes past the range."""
    force(mode, monkeypatch)
    data = random.Random(3).randbytes(3 * BLOCK + 4321)
    path = tmp_path / "blob"
    path.write_bytes(data)
    readers: list[str] = []
    real = os.preadv

    def preadv(fd: int, buffers: list, offset: int) -> int:
        readers.append(threading.current_thread().name)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    sizes = random.Random(9)
    with DirectReader(path, start, length) as reader:
        got = b"".join(iter(lambda: reader.read(sizes.choice([7, ALIGN + 3, BLOCK // 3, BLOCK + 5])), b""))
    end = len(data) if length is None else start + length
    assert got == data[start:end]
    ahead = [name for name in readers if name.startswith("tailor-prefetch")]
    assert ahead and readers[0] == threading.current_thread().name, readers  # the first read is the caller's


def test_an_error_in_a_read_ahead_is_raised_to_the_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "blob"
    path.write_bytes(bytes(3 * BLOCK))
    real = os.preadv

    def failing(fd: int, buffers: list, offset: int) -> int:
        if offset >= BLOCK:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", failing)
    with DirectReader(path) as reader:
        assert len(reader.read(BLOCK)) == BLOCK
        with pytest.raises(OSError, match="Input/output error"):
            reader.read(1)
    with DirectReader(path) as reader:  # closed with a read ahead in flight: it waits, then frees its buffers
        reader.read(1)


def test_a_forked_child_reads_with_its_own_prefetch_threads(tmp_path: Path) -> None:
    """A fork copies no threads: a child handing reads ahead to its parent's pool would wait forever."""
    data = random.Random(5).randbytes(2 * BLOCK + 99)
    path = tmp_path / "blob"
    path.write_bytes(data)
    with DirectReader(path) as reader:  # the parent's pool exists now
        assert reader.read() == data
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only when it read the same bytes
        try:
            with DirectReader(path) as reader:
                os._exit(0 if reader.read() == data else 1)
        finally:
            os._exit(2)
    for _ in range(600):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        threading.Event().wait(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung reading ahead")
