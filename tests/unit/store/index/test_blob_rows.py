"""Blob rows as format 8 keeps them: codecs and packs by number, names kept while a row names them.

The view ``blobs`` reads every row as format 7's table held it; a move to another pack or a delete
takes the names no row names any more with it; a hand edit through the view lands in the rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tailorstore.core.records import BlobRecord
from tailorstore.store.index._index import Index

RAW, ZSTD = '{"id": "raw", "v": 1}', '{"id": "zstd", "level": 1, "v": 1}'


@pytest.fixture
def index(tmp_path: Path) -> Index:
    index = Index.create(tmp_path / "index.sqlite")
    yield index
    index.close()


def _count(index: Index, table: str) -> int:
    return index.conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def test_rows_read_back_as_written_and_names_go_with_their_last_row(index: Index) -> None:
    blobs = [
        BlobRecord(f"{n:032x}", 10 + n, 5 + n, ZSTD if n % 2 else RAW, f"{n % 3:032x}" if n < 6 else None, n, 1.5)
        for n in range(8)
    ]
    with index.transaction():
        index.add_blobs(blobs)
        index.add_blobs([BlobRecord(blobs[0].hash, 1, 1, ZSTD, None, None, 9.0)])  # known: keeps its row
    assert [index.blob(b.hash) for b in blobs] == blobs
    assert _count(index, "codecs") == 2 and _count(index, "pack_names") == 3
    with index.transaction():
        index.move_blobs({b.hash: ("f" * 32, i) for i, b in enumerate(blobs[:6])})  # repacked into one pack
    assert {index.blob(b.hash).pack for b in blobs[:6]} == {"f" * 32}
    assert [r[0] for r in index.conn.execute("SELECT name FROM pack_names")] == ["f" * 32]
    with index.transaction():
        index.upsert_blobs([BlobRecord(blobs[7].hash, 17, 3, RAW, None, None, 1.5)])  # repaired: new codec
        index.delete_blobs([b.hash for b in blobs if b.codec == RAW])
    assert index.blob(blobs[7].hash).stored_size == 3
    assert _count(index, "codecs") == 2 and _count(index, "blob_rows") == 4  # blob 7 is raw now
    with index.transaction():
        index.delete_blobs([blobs[7].hash])
    assert [r[0] for r in index.conn.execute("SELECT descriptor FROM codecs")] == [ZSTD]


def test_a_hand_edit_through_the_view_lands_in_the_rows(index: Index) -> None:
    with index.transaction():
        index.add_blobs([BlobRecord("a" * 32, 1, 1, RAW, None, None, 0.0)])
    index.conn.execute("UPDATE blobs SET pack=?, pack_offset=7 WHERE hash=?", ("b" * 32, "a" * 32))
    assert index.blob("a" * 32) == BlobRecord("a" * 32, 1, 1, RAW, "b" * 32, 7, 0.0)
    index.conn.execute("INSERT INTO blobs(hash, raw_size, stored_size, codec, created_at) VALUES (?, 2, 2, ?, 0)",
                       ("c" * 32, ZSTD))  # fmt: skip
    assert index.blob("c" * 32).codec == ZSTD
    index.conn.execute("DELETE FROM blobs WHERE hash=?", ("a" * 32,))
    assert index.blob("a" * 32) is None and index.counts().blobs == 1
