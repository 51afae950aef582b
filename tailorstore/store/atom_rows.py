"""Atom rows of a manifest, looked up by what they are rather than where they sit.

Inheritance at commit and composition at merge both find "the same piece" in another
manifest: same file (by ``file_key``), parameter, kind, rank, first element and length.
"""

from __future__ import annotations

import sqlite3

AtomKey = tuple[str, str, str, int, int, int]  # file_key, param, kind, rank, start, numel

INSERT_ATOMS = (
    "INSERT INTO atoms(manifest, path, slot, offset, numel, dtype, shape, param, kind, rank, start, nbytes,"
    " layer, blob, derived, file_offset) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
)


def atom_key(row: sqlite3.Row) -> AtomKey:
    return (row["file_key"], row["param"], row["kind"], row["rank"], row["start"], row["numel"])


def atoms_by_key(conn: sqlite3.Connection, manifest: int, layer: str | None = None) -> dict[AtomKey, sqlite3.Row]:
    """The manifest's atom rows (with their file's ``file_key``), optionally of one layer only."""
    query = (
        "SELECT a.*, f.file_key FROM atoms a JOIN files f ON f.manifest=a.manifest AND f.path=a.path WHERE a.manifest=?"
    )
    args: tuple = (manifest,)
    if layer is not None:
        query += " AND a.layer=?"
        args = (manifest, layer)
    return {atom_key(row): row for row in conn.execute(query, args)}
