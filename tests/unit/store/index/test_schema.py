"""A real format-1 store, written by tailorstore 0.1, is upgraded on open and still checks out exactly.

``tests/data/format1/store`` was made by the 0.1 code (git 8832a07, format 1) committing
``tests/data/format1/checkpoint``, a 2-rank ZeRO-2 bf16 DeepSpeed save of a tiny model; the
index was switched from WAL to a single file so that it ships as one file. Nothing in it is
rebuilt from today's schema: the upgrade meets the tables as 0.1 created them. A format version
that is not a number is a damaged store.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from tailorstore.core.errors import CorruptStoreError
from tailorstore.formats.safe_load import load_torch_file
from tailorstore.ingest.commit import commit_checkpoint
from tailorstore.ingest.commit_options import CommitOptions
from tailorstore.report.verify import verify
from tailorstore.restore.checkout import checkout_step
from tailorstore.store.index._index import Index
from tailorstore.store.index.schema import FORMAT_VERSION
from tailorstore.store.repo import Repository
from testbed.compare import differences
from tests.conftest import TEST_DATA, index_db

DATA = TEST_DATA / "format1"


def test_format_1_store_of_tailorstore_0_1_is_upgraded_and_checks_out(tmp_path: Path) -> None:
    root = shutil.copytree(DATA / "store", tmp_path / "store")
    probe = sqlite3.connect(root / "index.sqlite")
    assert probe.execute("SELECT value FROM meta WHERE key='format_version'").fetchone()[0] == "1"
    assert "container" not in [r[1] for r in probe.execute("PRAGMA table_info(files)")]
    assert "file_offset" not in [r[1] for r in probe.execute("PRAGMA table_info(atoms)")]
    probe.close()

    with Repository.open(root) as store:  # upgrades
        version = index_db(store).execute("SELECT value FROM meta WHERE key='format_version'").fetchone()[0]
        assert int(version) == FORMAT_VERSION == 8
        runs = {r[0] for r in index_db(store).execute("SELECT run FROM manifests")}
        assert runs == {"main"}, "format 4: every earlier step is main's"
        tiers = {r[0] for r in index_db(store).execute("SELECT tier FROM manifests")}
        assert tiers == {None}, "format 5: every earlier step is whole"
        metrics = {r[0] for r in index_db(store).execute("SELECT metrics FROM manifests")}
        assert metrics == {None}, "format 6: no earlier step recorded metrics"
        assert index_db(store).execute("SELECT count(*) FROM tags").fetchone()[0] == 0, "format 7: it had no tag"
        keys = [r[0] for r in index_db(store).execute("SELECT object_key FROM manifests")]
        assert keys and all(key and (root / key).is_file() for key in keys), "the upgrade wrote every manifest object"
        assert index_db(store).execute("SELECT count(*) FROM files WHERE container IS NOT NULL").fetchone()[0] == 0
        assert index_db(store).execute("SELECT count(*) FROM atoms WHERE file_offset IS NOT NULL").fetchone()[0] == 0
        assert index_db(store).execute("SELECT count(*) FROM atoms WHERE derived IS NOT NULL").fetchone()[0] > 0
        assert verify(store, deep=True).ok
        out = tmp_path / "out"
        checkout_step(store, "step=3", out)  # through the skeletons, as format 1 did
    originals = sorted((DATA / "checkpoint" / "global_step3").iterdir())
    assert len(originals) == 3
    for original in originals:
        restored = out / "global_step3" / original.name
        assert not differences(load_torch_file(original)[0], load_torch_file(restored)[0]), original.name
    assert (out / "latest").read_text() == "global_step3"
    with Repository.open(root) as store:  # a second open finds nothing to do
        assert int(index_db(store).execute("SELECT value FROM meta WHERE key='format_version'").fetchone()[0]) == 8
        assert store.refresh() == (0, 0)

    # the upgraded store's index is now a cache: lose it, rebuild it from the objects, check out again
    for f in root.glob("index.sqlite*"):
        f.unlink()
    blob_files = [p for p in (root / "blobs").rglob("*") if p.is_file()]
    assert Repository.rebuild_index(root) == (1, len(blob_files))
    with Repository.open(root) as store:
        assert verify(store, deep=True).ok
        again = tmp_path / "again"
        checkout_step(store, "step=3", again)
    for original in originals:
        restored = again / "global_step3" / original.name
        assert not differences(load_torch_file(original)[0], load_torch_file(restored)[0]), original.name


_FORMAT_7_ATOMS = (
    """CREATE TABLE atoms (
    manifest INTEGER NOT NULL, path TEXT NOT NULL, slot INTEGER NOT NULL, offset INTEGER NOT NULL,
    numel INTEGER NOT NULL, dtype TEXT NOT NULL, shape TEXT NOT NULL, param TEXT NOT NULL, kind TEXT NOT NULL,
    rank INTEGER NOT NULL, start INTEGER NOT NULL, nbytes INTEGER NOT NULL, layer TEXT NOT NULL,
    blob TEXT NOT NULL, derived TEXT, file_offset INTEGER,
    PRIMARY KEY (manifest, path, slot, offset),
    FOREIGN KEY (manifest, path) REFERENCES files(manifest, path) ON DELETE CASCADE
) WITHOUT ROWID""",
    "CREATE INDEX atoms_blob ON atoms(blob)",
    "CREATE INDEX atoms_layer ON atoms(manifest, layer)",
)


_FORMAT_7_BLOBS_AND_FILES = (
    """CREATE TABLE blobs (hash TEXT PRIMARY KEY, raw_size INTEGER NOT NULL, stored_size INTEGER NOT NULL,
    codec TEXT NOT NULL, created_at REAL NOT NULL, pack TEXT, pack_offset INTEGER)""",
    "CREATE INDEX blobs_pack ON blobs(pack)",
    """CREATE TABLE files_then (manifest INTEGER NOT NULL REFERENCES manifests(id) ON DELETE CASCADE,
    path TEXT NOT NULL, file_key TEXT NOT NULL, kind TEXT NOT NULL, rank INTEGER,
    blob TEXT NOT NULL REFERENCES blobs(hash), raw_size INTEGER NOT NULL, mode INTEGER NOT NULL,
    trusted INTEGER NOT NULL DEFAULT 0, container TEXT REFERENCES blobs(hash), PRIMARY KEY (manifest, path))""",
)


def as_format_7(conn: sqlite3.Connection) -> None:
    """Give a current index format 7's shape, rows kept: one atoms row a piece a manifest and one
    blobs row a blob, as format 7 wrote them (the views of the same names read exactly those rows),
    and ``files`` naming ``blobs``. Run with foreign keys off (the default of a plain connection)."""
    conn.execute("CREATE TEMP TABLE atoms_then AS SELECT * FROM atoms")
    conn.execute("CREATE TEMP TABLE blobs_then AS SELECT * FROM blobs")
    for statement in ("DROP VIEW atoms", "DROP TABLE atom_blobs", "DROP TABLE atom_sets", "DROP TABLE layout_atoms"):
        conn.execute(statement)
    for statement in ("DROP TABLE atom_layouts", "DROP VIEW blobs", "DROP TABLE blob_rows", "DROP TABLE codecs"):
        conn.execute(statement)
    conn.execute("DROP TABLE pack_names")
    for statement in _FORMAT_7_BLOBS_AND_FILES:
        conn.execute(statement)
    conn.execute("INSERT INTO blobs SELECT * FROM blobs_then")
    columns = "manifest, path, file_key, kind, rank, blob, raw_size, mode, trusted, container"
    conn.execute(f"INSERT INTO files_then({columns}) SELECT {columns} FROM files")
    conn.execute("DROP TABLE files")
    conn.execute("ALTER TABLE files_then RENAME TO files")
    conn.execute("CREATE INDEX files_blob ON files(blob)")
    for statement in _FORMAT_7_ATOMS:
        conn.execute(statement)
    conn.execute("INSERT INTO atoms SELECT * FROM atoms_then")
    conn.execute("UPDATE meta SET value='7' WHERE key='format_version'")


def test_a_format_7_index_keeps_every_atom_and_shares_the_layout_after_the_upgrade(
    tmp_path: Path, small_store: Path
) -> None:
    """Format 7 kept an atoms row a piece a step; format 8 keeps a layout's rows once. The upgrade
    carries every atom over as it was (the rows read through the view equal format 7's rows) and
    two steps with one layout share it."""
    root = tmp_path / "st"
    shutil.copytree(small_store, root)
    with Repository.open(root) as store:  # the same save again as step 4: the same layout
        commit_checkpoint(store, DATA / "checkpoint", CommitOptions(step=4))
        before = index_db(store).execute("SELECT * FROM atoms ORDER BY manifest, path, slot, offset").fetchall()
        blobs_before = index_db(store).execute("SELECT * FROM blobs ORDER BY hash").fetchall()
        steps = index_db(store).execute("SELECT count(*) FROM manifests").fetchone()[0]
    assert steps >= 2 and before
    conn = sqlite3.connect(root / "index.sqlite")
    as_format_7(conn)
    conn.commit()
    assert conn.execute("SELECT count(*) FROM atoms").fetchone()[0] == len(before)
    conn.close()
    with Repository.open(root) as store:
        db = index_db(store)
        assert int(db.execute("SELECT value FROM meta WHERE key='format_version'").fetchone()[0]) == 8
        assert db.execute("SELECT * FROM atoms ORDER BY manifest, path, slot, offset").fetchall() == before
        assert db.execute("SELECT * FROM blobs ORDER BY hash").fetchall() == blobs_before
        assert db.execute("SELECT count(*) FROM pack_names").fetchone()[0] == len(
            {r["pack"] for r in blobs_before} - {None}
        )
        assert not db.execute("PRAGMA foreign_key_check").fetchall()
        assert "blob_rows" in db.execute("SELECT sql FROM sqlite_schema WHERE name='files'").fetchone()[0]
        layouts = db.execute("SELECT count(*) FROM atom_layouts").fetchone()[0]
        assert 1 <= layouts < steps
        assert verify(store, deep=True).ok


def test_a_format_6_index_keeps_its_tags_in_the_tags_table_after_the_upgrade(tmp_path: Path) -> None:
    """Format 6 held one tag a step in ``manifests.tag``; format 7 holds any number in ``tags``. The
    upgrade alone (before any sync from the ref objects) carries each tag over: a store whose ref
    objects were lost or never written (a format-2 upgrade's) keeps them."""
    Repository.init(tmp_path / "st").close()
    conn = sqlite3.connect(tmp_path / "st" / "index.sqlite")
    now = 1.0
    for step in (1, 2):
        conn.execute(
            "INSERT INTO manifests(step, origin, created_at, layout, policy, exact, raw_bytes, new_bytes, source)"
            " VALUES (?, 'commit', ?, 'plain', '{}', 1, 0, 0, 'x')",
            (step, now),
        )
    # the format-6 shape: a tag column, unique; no tags table
    as_format_7(conn)
    conn.execute("DROP TABLE tags")
    conn.execute("ALTER TABLE manifests ADD COLUMN tag TEXT")
    conn.execute("CREATE UNIQUE INDEX manifests_tag ON manifests(tag)")
    conn.execute("UPDATE manifests SET tag='best' WHERE step=2")
    conn.execute("UPDATE meta SET value='6' WHERE key='format_version'")
    conn.commit()
    conn.close()
    index = Index.open(tmp_path / "st" / "index.sqlite")
    try:
        held = index.tagged("best")
        assert held is not None and held.step == 2 and held.tags == ("best",)
        index.add_tag(held.id, "second")  # a step holds several now; the old column is left NULL
        assert index.manifest(held.id).tags == ("best", "second")
        assert [m.tags for m in index.manifests()] == [(), ("best", "second")]
    finally:
        index.conn.close()


def test_format_version_that_is_not_a_number(tmp_path: Path) -> None:
    Repository.init(tmp_path / "st").close()
    conn = sqlite3.connect(tmp_path / "st" / "index.sqlite")
    conn.execute("UPDATE meta SET value='abc' WHERE key='format_version'")
    conn.commit()
    conn.close()
    with pytest.raises(CorruptStoreError, match="format_version"):
        Repository.open(tmp_path / "st")
