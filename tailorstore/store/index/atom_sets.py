"""A manifest's atoms as the index keeps them: its layout's rows once, its blobs beside them.

The rows that say what each piece of each tensor is and where it sits (every column of an atom
but its blob) are the same from one step of a run to the next; only the blobs change, and the
names of the files, which hold the step's folder (``global_step300/...``, ``step-300/...``). So
the rows are stored once per distinct layout, named by the digest of the rows, a file in them
by its place among the manifest's files in path order, and each manifest keeps only which
layout it has and its blobs, 16 bytes an atom (docs/FORMAT.md, section 3).

These functions take the connection, not the ``Index``: the upgrade from format 7 runs them
inside its own transaction before any ``Index`` exists.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Sequence

import xxhash

from tailorstore.core.records import ATOM_COLUMNS, AtomRecord, values

SEGMENT = 250  # blobs an atom_blobs row holds: 4,000 bytes, within a 4 KiB page of a rowid table
HASH_BYTES = 16
LAYOUT_COLUMNS = ("file", *(c for c in ATOM_COLUMNS if c not in ("path", "blob")))
_LAYOUT_INSERT = (
    f"INSERT INTO layout_atoms(layout, {', '.join(LAYOUT_COLUMNS)}, pos)"
    f" VALUES ({','.join('?' * (len(LAYOUT_COLUMNS) + 2))})"
)


def number_files(conn: sqlite3.Connection, manifest: int) -> None:
    """Give the manifest's files their ordinals (their place in path order): what its layout
    names them by. Run after its files change, before its atoms are set."""
    paths = [r[0] for r in conn.execute("SELECT path FROM files WHERE manifest=? ORDER BY path", (manifest,))]
    conn.executemany(
        "UPDATE files SET ordinal=? WHERE manifest=? AND path=? AND ordinal<>?",
        [(ordinal, manifest, path, ordinal) for ordinal, path in enumerate(paths)],
    )


def layout_digest(rows: Sequence[tuple[object, ...]]) -> str:
    """The name of a layout: the xxh3-128 of its rows (``LAYOUT_COLUMNS``, in (file, slot,
    offset) order) as one compact JSON array. Two manifests with equal rows share them."""
    return xxhash.xxh3_128_hexdigest(json.dumps(rows, separators=(",", ":"), ensure_ascii=False).encode())


def set_atoms(conn: sqlite3.Connection, manifest: int, atoms: Iterable[AtomRecord]) -> None:
    """Make ``atoms`` the manifest's atoms (none before, or all of them replaced).

    Raises ``sqlite3.IntegrityError`` where format 7's table would have: two atoms at one place
    of one file, or an atom of a file the manifest does not have."""
    conn.execute("DELETE FROM atom_sets WHERE manifest=?", (manifest,))  # its atom_blobs go with it
    ordered = sorted(atoms, key=lambda a: (a.path, a.slot, a.offset))
    if ordered:
        ordinals = _check_places(conn, manifest, ordered)
        rows = [(ordinals[a.path], *values(a, LAYOUT_COLUMNS[1:])) for a in ordered]
        layout = _layout_id(conn, rows)
        conn.execute("INSERT INTO atom_sets(manifest, layout) VALUES (?, ?)", (manifest, layout))
        try:
            hashes = [bytes.fromhex(a.blob) for a in ordered]
        except ValueError:
            raise sqlite3.IntegrityError("CHECK constraint failed: an atom's blob is not 32 hex digits") from None
        if any(len(h) != HASH_BYTES for h in hashes):
            raise sqlite3.IntegrityError("CHECK constraint failed: an atom's blob is not 32 hex digits")
        conn.executemany(
            "INSERT INTO atom_blobs(manifest, segment, blobs) VALUES (?, ?, ?)",
            [(manifest, i // SEGMENT, b"".join(hashes[i : i + SEGMENT])) for i in range(0, len(hashes), SEGMENT)],
        )
    drop_unused_layouts(conn)


def _check_places(conn: sqlite3.Connection, manifest: int, ordered: list[AtomRecord]) -> dict[str, int]:
    """Each file's ordinal, once every atom is known to sit in one of the files at a place of its own."""
    files = {r[0]: r[1] for r in conn.execute("SELECT path, ordinal FROM files WHERE manifest=?", (manifest,))}
    for before, atom in zip([None, *ordered], ordered, strict=False):
        if atom.path not in files:
            raise sqlite3.IntegrityError("FOREIGN KEY constraint failed: an atom of a file the manifest lacks")
        if before is not None and (before.path, before.slot, before.offset) == (atom.path, atom.slot, atom.offset):
            raise sqlite3.IntegrityError("UNIQUE constraint failed: atoms.path, atoms.slot, atoms.offset")
    return files


def _layout_id(conn: sqlite3.Connection, rows: list[tuple[object, ...]]) -> int:
    """The id of the layout of these rows, recorded first if no manifest has it yet."""
    digest = layout_digest(rows)
    found = conn.execute("SELECT id FROM atom_layouts WHERE digest=?", (digest,)).fetchone()
    if found is not None:
        return int(found[0])
    layout = conn.execute("INSERT INTO atom_layouts(digest, atoms) VALUES (?, ?)", (digest, len(rows))).lastrowid
    assert layout is not None
    conn.executemany(_LAYOUT_INSERT, [(layout, *row, pos) for pos, row in enumerate(rows)])
    return int(layout)


def drop_unused_layouts(conn: sqlite3.Connection) -> None:
    """A layout no manifest has any more goes, its rows with it."""
    conn.execute("DELETE FROM atom_layouts WHERE id NOT IN (SELECT layout FROM atom_sets)")


def blobs_of(conn: sqlite3.Connection, manifest: int) -> bytes:
    """The manifest's atom blobs, 16 bytes each, in its layout's ``pos`` order."""
    rows = conn.execute("SELECT blobs FROM atom_blobs WHERE manifest=? ORDER BY segment", (manifest,))
    return b"".join(r[0] for r in rows)


def atoms_into_layouts(conn: sqlite3.Connection, tables: Sequence[str]) -> None:
    """Part of the upgrade from format 7 (``upgrade_8.py``), its files numbered already: the layout
    tables created (``tables``), every manifest's atom rows moved into them, the old table dropped."""
    for statement in tables:
        conn.execute(statement)
    columns = ", ".join(ATOM_COLUMNS)
    manifests = [r[0] for r in conn.execute("SELECT DISTINCT manifest FROM atoms")]
    for manifest in manifests:
        rows = conn.execute(f"SELECT {columns} FROM atoms WHERE manifest=?", (manifest,)).fetchall()
        set_atoms(conn, manifest, [AtomRecord(*r) for r in rows])
    for statement in ("DROP INDEX IF EXISTS atoms_blob", "DROP INDEX IF EXISTS atoms_layer", "DROP TABLE atoms"):
        conn.execute(statement)
