"""The upgrade of an index from format 7 to 8 (docs/FORMAT.md section 9).

Format 8 keeps a layout's atom rows once and each manifest's blobs beside them (``atom_sets.py``),
and the blob rows with their codec and pack by number. Both replace tables other tables name
(``files`` named ``blobs``), so the upgrade rebuilds ``files`` and runs with foreign keys off,
checking every reference before its transaction commits. It takes the statements to run as
arguments: ``schema.py`` holds them and lists this upgrade among its migrations.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from tailorstore.store.index.atom_sets import atoms_into_layouts, number_files

FOREIGN_KEYS_OFF: set[int] = set()  # versions whose upgrade runs with foreign keys off (schema.py adds them)
_FILE_COLUMNS = "manifest, path, file_key, kind, rank, blob, raw_size, mode, trusted, container, ordinal"


def upgrade(
    conn: sqlite3.Connection,
    schema: Sequence[str],
    atom_tables: Sequence[str],
    blob_tables: Sequence[str],
    blob_view: Sequence[str],
) -> None:
    """7 -> 8: ``files`` numbered and rebuilt to name ``blob_rows``; the atoms into layouts; the blobs
    into ``blob_rows``; the views of both tables as format 7 had them; then every reference checked."""
    conn.execute("ALTER TABLE files ADD COLUMN ordinal INTEGER NOT NULL DEFAULT 0")
    files = next(t for t in schema if t.startswith("CREATE TABLE files ("))
    conn.execute(files.replace("CREATE TABLE files (", "CREATE TABLE files_new (", 1))
    conn.execute(f"INSERT INTO files_new({_FILE_COLUMNS}) SELECT {_FILE_COLUMNS} FROM files")
    conn.execute("DROP TABLE files")
    conn.execute("ALTER TABLE files_new RENAME TO files")
    for statement in schema:
        if statement.startswith("CREATE INDEX files_"):
            conn.execute(statement)
    for (manifest,) in conn.execute("SELECT DISTINCT manifest FROM files").fetchall():
        number_files(conn, manifest)
    views = [t for t in atom_tables if t.startswith("CREATE VIEW")]
    atoms_into_layouts(conn, [t for t in atom_tables if t not in views])
    for statement in blob_tables:
        conn.execute(statement)
    conn.execute("INSERT OR IGNORE INTO codecs(descriptor) SELECT DISTINCT codec FROM blobs")
    conn.execute("INSERT OR IGNORE INTO pack_names(name) SELECT DISTINCT pack FROM blobs WHERE pack IS NOT NULL")
    conn.execute(
        "INSERT INTO blob_rows(hash, raw_size, stored_size, codec, created_at, pack, pack_offset)"
        " SELECT b.hash, b.raw_size, b.stored_size, c.id, b.created_at, p.id, b.pack_offset FROM blobs b"
        " JOIN codecs c ON c.descriptor = b.codec LEFT JOIN pack_names p ON p.name = b.pack"
    )
    conn.execute("DROP INDEX IF EXISTS blobs_pack")
    conn.execute("DROP TABLE blobs")
    for statement in (*views, *blob_view):
        conn.execute(statement)
    broken = conn.execute("PRAGMA foreign_key_check").fetchall()
    if broken:
        raise sqlite3.IntegrityError(
            f"FOREIGN KEY constraint failed after the upgrade: {len(broken)} rows, e.g. {tuple(broken[0])}"
        )
