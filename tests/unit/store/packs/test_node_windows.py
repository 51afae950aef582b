"""Reads shared by the ranks of a node (store/packs/node_windows.py): any range read back exactly
from aligned windows, each window fetched once for every reader of one folder, a damaged or
planted kept copy fetched again, a folder that cannot keep copies costing no read. A real
POSIX backend, counted."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import xxhash

from tailorstore.store.backends.location import resolve
from tailorstore.store.packs.node_windows import NodeWindows, prune
from tests.unit.store.packs.test_pack_spans import CountingBackend

WINDOW = 1 << 16


@pytest.fixture
def stored(tmp_path: Path) -> tuple[CountingBackend, bytes]:
    backend = CountingBackend(resolve(str(tmp_path / "store")).backend)
    data = os.urandom(5 * WINDOW + 123)  # a short last window
    backend.inner.put("packs/ab/abcd", data)
    return backend, data


def test_any_range_reads_back_exactly(stored: tuple[CountingBackend, bytes], tmp_path: Path) -> None:
    backend, data = stored
    windows = NodeWindows(backend, tmp_path / "node", window=WINDOW)  # type: ignore[arg-type]
    for start, length in [(0, 1), (0, len(data)), (WINDOW - 3, 7), (3 * WINDOW, WINDOW), (len(data) - 5, 5)]:
        assert windows.read("packs/ab/abcd", start, length) == data[start : start + length]
        with windows.reader("packs/ab/abcd", start, length) as f:
            assert f.read() == data[start : start + length]
    assert backend.gets == 6 and windows.fetched == 6  # each window once, whatever the ranges


def test_readers_of_one_folder_fetch_each_window_once(stored: tuple[CountingBackend, bytes], tmp_path: Path) -> None:
    backend, data = stored
    readers = [NodeWindows(backend, tmp_path / "node", window=WINDOW) for _ in range(4)]  # type: ignore[arg-type]
    got: list[bytes] = []
    threads = [threading.Thread(target=lambda w=w: got.append(w.read("packs/ab/abcd", 0, len(data)))) for w in readers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [data] * 4
    assert backend.gets == 6, "every window fetched by one reader, the others read its copy"
    assert sum(w.shared for w in readers) == 18


def test_a_damaged_or_planted_copy_is_fetched_again(stored: tuple[CountingBackend, bytes], tmp_path: Path) -> None:
    backend, data = stored
    folder = tmp_path / "node"
    NodeWindows(backend, folder, window=WINDOW).read("packs/ab/abcd", 0, WINDOW)  # type: ignore[arg-type]
    (kept,) = [p for p in folder.iterdir() if p.suffix != ".lock"]
    raw = bytearray(kept.read_bytes())
    raw[10] ^= 1
    kept.write_bytes(bytes(raw))
    again = NodeWindows(backend, folder, window=WINDOW)  # type: ignore[arg-type]
    assert again.read("packs/ab/abcd", 0, WINDOW) == data[:WINDOW] and again.fetched == 1
    kept.unlink()
    third = NodeWindows(backend, folder, window=WINDOW)  # type: ignore[arg-type]
    assert third.read("packs/ab/abcd", WINDOW, WINDOW) == data[WINDOW : 2 * WINDOW]  # window 1 kept now
    kept.symlink_to(folder / "packs_ab_abcd.1")  # a link to another window, its trailer valid: no window
    assert third.read("packs/ab/abcd", 0, WINDOW) == data[:WINDOW] and third.fetched == 2
    half = data[: WINDOW // 2]  # a kept copy cut short, its trailer made for what is left
    kept.unlink()
    kept.write_bytes(half + xxhash.xxh3_128_digest(half))
    fourth = NodeWindows(backend, folder, window=WINDOW)  # type: ignore[arg-type]
    assert fourth.read("packs/ab/abcd", 0, WINDOW) == data[:WINDOW] and fourth.fetched == 1
    with fourth.reader("packs/ab/abcd", 0, WINDOW) as f:
        assert f.read() == data[:WINDOW]


def test_an_object_shorter_than_the_read_is_a_damaged_store(
    stored: tuple[CountingBackend, bytes], tmp_path: Path
) -> None:
    from tailorstore.core.errors import CorruptStoreError

    backend, data = stored
    windows = NodeWindows(backend, tmp_path / "node", window=WINDOW)  # type: ignore[arg-type]
    with pytest.raises(CorruptStoreError, match="ends at byte"):
        windows.read("packs/ab/abcd", len(data) - 5, 10)


def test_a_folder_that_keeps_nothing_costs_no_read(stored: tuple[CountingBackend, bytes], tmp_path: Path) -> None:
    """Keeping a copy is never a read's failure: where no window can be written (a folder in each
    one's place here; a full disk alike), every read still returns its bytes, fetched itself."""
    backend, data = stored
    folder = tmp_path / "node"
    windows = NodeWindows(backend, folder, window=WINDOW)  # type: ignore[arg-type]
    for k in range(6):
        (folder / f"packs_ab_abcd.{k}").mkdir()
    assert windows.read("packs/ab/abcd", 0, len(data)) == data
    assert windows.read("packs/ab/abcd", 0, len(data)) == data
    assert windows.fetched == 12 and windows.shared == 0


def test_prune_deletes_old_windows_only(stored: tuple[CountingBackend, bytes], tmp_path: Path) -> None:
    backend, _ = stored
    folder = tmp_path / "node"
    NodeWindows(backend, folder, window=WINDOW).read("packs/ab/abcd", 0, 2 * WINDOW)  # type: ignore[arg-type]
    files = sorted(folder.iterdir())
    old = files[0]
    os.utime(old, (1.0, 1.0))
    assert prune(folder, keep_seconds=3600) == 1
    assert sorted(folder.iterdir()) == files[1:]
