"""Opening the SQLite index with the settings that make its promises hold.

WAL lets readers (checkout, log, show) work while a commit writes; synchronous=FULL makes
a committed transaction survive power loss; foreign keys keep manifests consistent.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from ..errors import CorruptStoreError, FormatVersionError, StoreError
from .schema import FORMAT_VERSION, MIGRATIONS, SCHEMA

INDEX_NAME = "index.sqlite"


def connect(path: Path, *, read_only: bool = False) -> sqlite3.Connection:
    """A connection; ``read_only`` for a store this process cannot write (nobody changes it under us)."""
    if read_only:
        conn = sqlite3.connect(
            f"{path.resolve().as_uri()}?mode=ro&immutable=1", uri=True, isolation_level=None, check_same_thread=False
        )
    else:
        conn = sqlite3.connect(path, isolation_level=None, timeout=60.0, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    if read_only:
        conn.execute("PRAGMA query_only=ON")  # so callers can tell, and nothing tries to write
    conn.row_factory = sqlite3.Row
    return conn


def damaged(path: Path, exc: BaseException) -> CorruptStoreError:
    return CorruptStoreError(
        f"{path}: the index is damaged or unreadable ({exc}). The blobs and manifest objects are untouched; "
        "recreate the index with `tailor index rebuild`, then run `tailor verify --deep`."
    )


def create(path: Path) -> None:
    conn = connect(path)
    try:
        # One script, one transaction: a store either has its whole schema or none.
        conn.executescript(
            f"BEGIN;\n{SCHEMA}\n"
            f"INSERT INTO meta(key, value) VALUES ('format_version', '{FORMAT_VERSION}');\n"
            f"INSERT INTO meta(key, value) VALUES ('created_at', '{time.time()!r}');\nCOMMIT;"
        )
    finally:
        conn.close()


def is_read_only(conn: sqlite3.Connection) -> bool:
    return bool(conn.execute("PRAGMA query_only").fetchone()[0])


def open_index(path: Path) -> sqlite3.Connection:
    if not path.is_file():
        if (path.parent / "blobs").is_dir():
            raise CorruptStoreError(
                f"{path.parent}: the store's index ({path.name}) is missing, though its blobs are there. Recreate "
                "it from the manifest objects with `tailor index rebuild`."
            )
        raise StoreError(f"{path.parent}: no tailorstore here. Create one with `tailor init {path.parent}`.")
    read_only = not os.access(path.parent, os.W_OK) or not os.access(path, os.W_OK)
    try:
        conn = connect(path, read_only=read_only)
        row = conn.execute("SELECT value FROM meta WHERE key='format_version'").fetchone()
    except sqlite3.DatabaseError as exc:
        raise damaged(path, exc) from None
    try:
        version = int(row["value"]) if row else 0
    except ValueError:
        conn.close()
        raise damaged(path, ValueError(f"format_version is {row['value']!r}")) from None
    if version > FORMAT_VERSION:
        conn.close()
        raise FormatVersionError(
            f"{path}: written by format version {version}, but this tailorstore reads up to version "
            f"{FORMAT_VERSION}. Upgrade tailorstore (pip install -U tailorstore) to open it."
        )
    if version < 1:
        conn.close()
        raise FormatVersionError(f"{path}: no format version recorded; this is not a tailorstore index.")
    if version < FORMAT_VERSION:
        if read_only:
            conn.close()
            raise FormatVersionError(f"{path}: format {version} needs an upgrade, which a read-only store cannot take.")
        _migrate(conn, path, version)
    return conn


def _migrate(conn: sqlite3.Connection, path: Path, version: int) -> None:
    """Bring an older index up to this format, one version per transaction.

    Each step only adds what the newer format needs and bumps the version in the same
    transaction, so an interrupted upgrade leaves a consistent index of some version, and
    the next open goes on from there. Older tailorstore versions then refuse the store.
    """
    while version < FORMAT_VERSION:
        script = MIGRATIONS.get(version)
        if script is None:
            conn.close()
            raise FormatVersionError(f"{path}: no upgrade from format version {version}; restore from a backup.")
        try:
            conn.execute("BEGIN IMMEDIATE")  # another process may be upgrading the same index
            now = int(conn.execute("SELECT value FROM meta WHERE key='format_version'").fetchone()[0])
            if now == version:
                for statement in filter(None, (part.strip() for part in script.split(";"))):
                    conn.execute(statement)
                conn.execute("UPDATE meta SET value=? WHERE key='format_version'", (str(version + 1),))
                now = version + 1
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            conn.close()
            raise StoreError(
                f"{path}: upgrading the index from format {version} failed ({exc}); it is unchanged."
            ) from None
        version = now
