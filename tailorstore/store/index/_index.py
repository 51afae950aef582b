"""The SQLite index: the one class that holds every SQL statement of tailorstore.

The index is a cache of the manifest objects in the backend (``store/manifests/``): what it
adds is fast lookups (which blobs a manifest needs, where a layer was last stored, where a
blob sits in a pack). Callers above ``store/`` see typed records (``core/records.py``), never rows.

Settings that make its promises hold: WAL lets readers (checkout, log, show) work while a
commit writes; ``synchronous=FULL`` makes a committed transaction survive power loss;
foreign keys keep manifests consistent; ``BEGIN IMMEDIATE`` makes two writers queue
instead of failing midway. A store this process cannot write is opened read-only and
immutable, so the read commands still work on it.

sqlite-utils is not used: importing it costs more than `tailor log` may spend in total
(docs/PERFORMANCE.md, "Start-up: importing on first use"), and what it would give (bulk inserts,
schema creation) is a few lines here.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import secrets
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tailorstore.core.errors import (
    Call,
    CorruptStoreError,
    FormatVersionError,
    LockTimeoutError,
    StoreError,
    TailorError,
)
from tailorstore.core.records import (
    COMMIT,
    FILE_COLUMNS,
    MAIN_RUN,
    MANIFEST_DOC_FIELDS,
    AtomContent,
    AtomKey,
    AtomRecord,
    BlobRecord,
    BlobUse,
    FileContent,
    FileRecord,
    IndexCounts,
    KindTotals,
    LayerRecord,
    LayerTotals,
    ManifestRecord,
    RunRecord,
    StoredLayer,
    values,
)
from tailorstore.store.index.atom_sets import (
    HASH_BYTES,
    LAYOUT_COLUMNS,
    blobs_of,
    drop_unused_layouts,
    number_files,
    set_atoms,
)
from tailorstore.store.index.schema import FORMAT_VERSION, MIGRATIONS, SCHEMA
from tailorstore.store.index.upgrade_8 import FOREIGN_KEYS_OFF

INDEX_NAME = "index.sqlite"

_MANIFEST_COLUMNS = (*MANIFEST_DOC_FIELDS, "pinned", "object_key")
# A manifest's row with its tags (any number a step, table ``tags``), as every manifest read takes it.
# An index upgraded from format 6 still has the old ``manifests.tag`` column, always NULL now.
_MANIFESTS = (
    "(SELECT m.*, (SELECT json_group_array(name) FROM (SELECT name FROM tags WHERE manifest=m.id ORDER BY name))"
    " AS tag_names FROM manifests m)"
)
_LAYER_COLUMNS = ("layer", "source", "source_step", "raw_bytes", "stored", "change")
_BLOB_COLUMNS = ("hash", "raw_size", "stored_size", "codec", "pack", "pack_offset", "created_at")
_BLOB_ROW_INSERT = (
    "INSERT INTO blob_rows(hash, raw_size, stored_size, codec, created_at, pack, pack_offset) VALUES (?,?,?,?,?,?,?)"
)
# A manifest's atoms without their blobs (those come from atom_blobs, by ``pos``), with their file's key.
_LAYOUT_WITH_KEY = (
    f"SELECT a.pos, f.path, {', '.join('a.' + c for c in LAYOUT_COLUMNS[1:])}, f.file_key FROM atom_sets s"
    " JOIN layout_atoms a ON a.layout=s.layout JOIN files f ON f.manifest=s.manifest AND f.ordinal=a.file"
    " WHERE s.manifest=?"
)
_BLOB_AT = 2 + LAYOUT_COLUMNS.index("layer")  # in such a row (pos, then path for file), after layer


def _insert(table: str, columns: tuple[str, ...], suffix: str = "") -> str:
    return f"INSERT INTO {table}({', '.join(columns)}) VALUES ({','.join('?' * len(columns))}){suffix}"


def _manifest(row: sqlite3.Row) -> ManifestRecord:
    return ManifestRecord(
        **{c: row[c] for c in MANIFEST_DOC_FIELDS if c != "exact"},
        exact=bool(row["exact"]),
        tags=tuple(json.loads(row["tag_names"])),
        pinned=bool(row["pinned"]),
        object_key=row["object_key"],
        id=row["id"],
    )


def _file(row: sqlite3.Row) -> FileRecord:
    return FileRecord(*(row[c] for c in FILE_COLUMNS[:7]), trusted=bool(row["trusted"]), container=row["container"])


def _layer(row: sqlite3.Row, manifest: int) -> LayerRecord:
    return LayerRecord(
        row["layer"], row["source"], row["source_step"], row["raw_bytes"], bool(row["stored"]), row["change"], manifest
    )


def _blob(row: sqlite3.Row) -> BlobRecord:
    return BlobRecord(*(row[c] for c in _BLOB_COLUMNS))


OPENING_WAIT = 2.0  # seconds a new connection waits for another process's write lock


class Index:
    """One open index. Reads return records; writes happen inside :meth:`transaction`."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self.conn = conn  # tests inspect the raw index through this; product code uses the methods
        self.path = path

    # -- opening -------------------------------------------------------------------------
    @staticmethod
    def connect(path: Path, *, read_only: bool = False) -> sqlite3.Connection:
        """A connection; ``read_only`` for a store this process cannot write (nobody changes it under us)."""
        if read_only:
            conn = sqlite3.connect(
                f"{path.resolve().as_uri()}?mode=ro&immutable=1",
                uri=True,
                isolation_level=None,
                check_same_thread=False,
            )
        else:
            # the first statements (and the refresh of an opening store) wait little for another
            # process's lock, as a stalled one may hold the index; once open, the store waits longer
            conn = sqlite3.connect(path, isolation_level=None, timeout=OPENING_WAIT, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        if read_only:
            conn.execute("PRAGMA query_only=ON")  # so callers can tell, and nothing tries to write
        conn.row_factory = sqlite3.Row
        return conn

    @classmethod
    def create(cls, path: Path) -> Index:
        """A new, empty index of the current format; the whole schema lands in one transaction."""
        conn = cls.connect(path)
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in SCHEMA:
                conn.execute(statement)
            conn.execute("INSERT INTO meta(key, value) VALUES ('format_version', ?)", (str(FORMAT_VERSION),))
            conn.execute("INSERT INTO meta(key, value) VALUES ('created_at', ?)", (repr(time.time()),))
        except BaseException:
            conn.execute("ROLLBACK")
            conn.close()
            raise
        conn.execute("COMMIT")
        return cls(conn, path)

    @classmethod
    def create_if_absent(cls, path: Path) -> None:
        """An empty index at ``path`` unless one is there, safe beside other processes doing the
        same (every rank of a node opening a remote store with one fresh cache): built under a
        name of its own, then linked into place, which fails where another process's index came
        first. Creating it in place let one process read the file another was still filling
        ("no such table: meta") or create its tables twice."""
        tmp = path.with_name(f"{path.name}.new-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            cls.create(tmp).close()  # the last connection's close folds its WAL into the file
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process's index is the one
            except OSError:  # a file system without hard links: rename, unless one came first
                if not path.exists():
                    os.replace(tmp, path)
        finally:
            for leftover in path.parent.glob(f"{tmp.name}*"):
                leftover.unlink(missing_ok=True)

    @classmethod
    def open(cls, path: Path) -> Index:
        """The index at ``path``, upgraded to this format if it is older; refused clearly if damaged."""
        if not path.is_file():
            if (path.parent / "blobs").is_dir():
                raise CorruptStoreError(
                    f"{path.parent}: the store's index ({path.name}) is missing, though its blobs are there. "
                    "Recreate it from the manifest objects with ",
                    Call("rebuild_index"),
                    ".",
                )
            raise StoreError(f"{path.parent}: no tailorstore here. Create one: ", Call("init", str(path.parent)), ".")
        read_only = not os.access(path.parent, os.W_OK) or not os.access(path, os.W_OK)
        try:
            conn = cls.connect(path, read_only=read_only)
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
                raise FormatVersionError(
                    f"{path}: format {version} needs an upgrade, which a read-only store cannot take."
                )
            _migrate(conn, path, version)
        return cls(conn, path)

    @property
    def read_only(self) -> bool:
        return bool(self.conn.execute("PRAGMA query_only").fetchone()[0])

    def meta(self, key: str) -> str | None:
        row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row["value"])

    def set_meta(self, key: str, value: str) -> None:
        with self.transaction():
            self.conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value))

    def close(self) -> None:
        self.conn.close()
        self.conn = _Closed()  # type: ignore[assignment]

    def checkpoint(self) -> None:
        """Fold the WAL into the main file (before the file is renamed into place)."""
        self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def refuse_writes(self) -> None:
        """Raise, naming why, when this store cannot be changed from here."""
        if self.read_only:
            raise StoreError(
                f"{self.path.parent}: the store is read-only here (its files or their file system), and this "
                "changes it; run it where the store is writable."
            )

    def wait_for_writers(self, seconds: float) -> None:
        """How long a write waits while another process holds the index's write lock."""
        if not self.conn.in_transaction:
            self.conn.execute(f"PRAGMA busy_timeout={int(max(0.0, min(seconds, 86_400.0)) * 1000)}")

    @contextmanager
    def transaction(self) -> Iterator[Index]:
        """One write transaction; IMMEDIATE so two writers queue instead of failing midway."""
        self.refuse_writes()
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except sqlite3.DatabaseError as exc:
            raise index_failed(self.path, exc) from None
        try:
            yield self
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        try:
            self.conn.execute("COMMIT")
        except BaseException as exc:  # a COMMIT that fails (a deferred constraint, a full disk) leaves it open
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.DatabaseError):
                raise index_failed(self.path, exc) from None
            raise

    def integrity_problems(self) -> list[str]:
        """What SQLite itself finds wrong: page-level damage and dangling foreign keys."""
        out = [f"index: SQLite reports {m}" for (m,) in self.conn.execute("PRAGMA quick_check") if m != "ok"]
        out += [
            f"index: row {r[1]} of table {r[0]} points at a missing {r[2]} row"
            for r in self.conn.execute("PRAGMA foreign_key_check")
        ]
        return out

    def counts(self) -> IndexCounts:
        return IndexCounts(
            self.conn.execute("SELECT count(*) FROM manifests").fetchone()[0],
            self.conn.execute("SELECT count(*) FROM blobs").fetchone()[0],
        )

    # -- manifests -----------------------------------------------------------------------
    def manifest(self, manifest: int) -> ManifestRecord | None:
        row = self.conn.execute(f"SELECT * FROM {_MANIFESTS} WHERE id=?", (manifest,)).fetchone()
        return _manifest(row) if row else None

    def manifests(self, run: str | None = None) -> list[ManifestRecord]:
        """Every manifest (of one run, if given), by step, then in the order they were recorded."""
        if run is None:
            return [_manifest(r) for r in self.conn.execute(f"SELECT * FROM {_MANIFESTS} ORDER BY step, id")]
        return [
            _manifest(r) for r in self.conn.execute(f"SELECT * FROM {_MANIFESTS} WHERE run=? ORDER BY step, id", (run,))
        ]

    def manifests_at(self, step: int, run: str) -> list[ManifestRecord]:
        return [
            _manifest(r)
            for r in self.conn.execute(f"SELECT * FROM {_MANIFESTS} WHERE step=? AND run=? ORDER BY id", (step, run))
        ]

    def commit_at(self, step: int, run: str) -> ManifestRecord | None:
        row = self.conn.execute(
            f"SELECT * FROM {_MANIFESTS} WHERE step=? AND run=? AND origin=?", (step, run, COMMIT)
        ).fetchone()
        return _manifest(row) if row else None

    def tagged(self, tag: str) -> ManifestRecord | None:
        row = self.conn.execute(
            f"SELECT * FROM {_MANIFESTS} WHERE id=(SELECT manifest FROM tags WHERE name=?)", (tag,)
        ).fetchone()
        return _manifest(row) if row else None

    def by_object_key(self, key: str) -> ManifestRecord | None:
        row = self.conn.execute(f"SELECT * FROM {_MANIFESTS} WHERE object_key=?", (key,)).fetchone()
        return _manifest(row) if row else None

    def highest_step_commit(self, run: str) -> ManifestRecord | None:
        """The run's commit of the highest step."""
        row = self.conn.execute(
            f"SELECT * FROM {_MANIFESTS} WHERE origin=? AND run=? ORDER BY step DESC LIMIT 1", (COMMIT, run)
        ).fetchone()
        return _manifest(row) if row else None

    def last_recorded_commit(self, run: str) -> ManifestRecord | None:
        """The run's commit recorded last, whatever its step."""
        row = self.conn.execute(
            f"SELECT * FROM {_MANIFESTS} WHERE origin=? AND run=? ORDER BY id DESC LIMIT 1", (COMMIT, run)
        ).fetchone()
        return _manifest(row) if row else None

    def commits_before(self, step: int, run: str) -> int:
        return self.conn.execute(
            "SELECT count(*) FROM manifests WHERE origin=? AND run=? AND step<?", (COMMIT, run, step)
        ).fetchone()[0]

    # -- runs ----------------------------------------------------------------------------
    def created_runs(self) -> dict[str, RunRecord]:
        """The runs created by name (each has an object in the backend), by name."""
        return {
            r["name"]: RunRecord(r["name"], r["created_at"], r["base"]) for r in self.conn.execute("SELECT * FROM runs")
        }

    def runs(self) -> list[RunRecord]:
        """Every run: those created by name and those that only have manifests ('main' among them)."""
        rows = self.created_runs()
        for name, first in self.conn.execute("SELECT run, min(created_at) FROM manifests GROUP BY run"):
            rows.setdefault(name, RunRecord(name, first))
        return sorted(rows.values(), key=lambda r: (r.name != MAIN_RUN, r.name))

    def run(self, name: str) -> RunRecord | None:
        row = self.conn.execute("SELECT * FROM runs WHERE name=?", (name,)).fetchone()
        return RunRecord(row["name"], row["created_at"], row["base"]) if row else None

    def set_runs(self, runs: Iterable[RunRecord]) -> None:
        """Replace the run rows with these (the backend's run objects are the truth)."""
        self.conn.execute("DELETE FROM runs")
        self.conn.executemany(
            "INSERT INTO runs(name, created_at, base) VALUES (?,?,?)", [(r.name, r.created_at, r.base) for r in runs]
        )

    def unpublished(self) -> list[int]:
        """Manifests without an object yet (a store upgraded from format 2), oldest first."""
        return [r[0] for r in self.conn.execute("SELECT id FROM manifests WHERE object_key IS NULL ORDER BY id")]

    def has_object(self, key: str) -> bool:
        return self.conn.execute("SELECT 1 FROM manifests WHERE object_key=?", (key,)).fetchone() is not None

    def insert_manifest(self, record: ManifestRecord) -> int:
        """Record a manifest (its ``id`` is ignored); returns the new local id."""
        row = self.conn.execute(
            _insert("manifests", _MANIFEST_COLUMNS),
            (*values(record, MANIFEST_DOC_FIELDS), int(record.pinned), record.object_key),
        )
        assert row.lastrowid is not None
        for tag in record.tags:
            self.add_tag(int(row.lastrowid), tag)
        return int(row.lastrowid)

    def delete_manifests(self, manifests: Iterable[int]) -> None:
        """Drop manifests; their files, atoms and layers go with them (foreign keys cascade)."""
        self.conn.executemany("DELETE FROM manifests WHERE id=?", [(m,) for m in manifests])
        self._adopt_orphaned_layers()
        drop_unused_layouts(self.conn)

    def delete_commit_at(self, step: int, run: str) -> None:
        self.conn.execute("DELETE FROM manifests WHERE step=? AND run=? AND origin=?", (step, run, COMMIT))
        self._adopt_orphaned_layers()
        drop_unused_layouts(self.conn)

    def _adopt_orphaned_layers(self) -> None:
        """A layer whose source manifest is gone becomes its manifest's own: its atom rows are
        already its own, and ``source_step`` still says where it came from. Without this, a
        later commit inheriting the layer would name a manifest that no longer exists."""
        self.conn.execute("UPDATE layers SET source=manifest WHERE source NOT IN (SELECT id FROM manifests)")

    def set_tier(self, manifest: int, tier: str | None) -> None:
        self.conn.execute("UPDATE manifests SET tier=? WHERE id=?", (tier, manifest))

    def set_metrics(self, manifest: int, metrics: str | None) -> None:
        self.conn.execute("UPDATE manifests SET metrics=? WHERE id=?", (metrics, manifest))

    def replace_contents(self, manifest: int, files: list[FileRecord], atoms: list[AtomRecord]) -> None:
        """A manifest's file and atom rows, all replaced (thinning keeps a subset of them)."""
        self.conn.execute("DELETE FROM atom_sets WHERE manifest=?", (manifest,))
        self.conn.execute("DELETE FROM files WHERE manifest=?", (manifest,))
        self.insert_files(manifest, files)
        set_atoms(self.conn, manifest, atoms)

    def add_tag(self, manifest: int, tag: str) -> None:
        """Tag a manifest; a tag names one manifest, so one that named another moves here. A
        manifest holds any number of tags (as a git commit does)."""
        self.conn.execute("INSERT OR REPLACE INTO tags(name, manifest) VALUES (?, ?)", (tag, manifest))

    def drop_tag(self, tag: str) -> None:
        self.conn.execute("DELETE FROM tags WHERE name=?", (tag,))

    def set_pinned(self, manifest: int, pinned: bool) -> None:
        self.conn.execute("UPDATE manifests SET pinned=? WHERE id=?", (int(pinned), manifest))

    def set_object_key(self, manifest: int, key: str) -> None:
        self.conn.execute("UPDATE manifests SET object_key=? WHERE id=?", (key, manifest))

    def set_refs(self, refs: dict[int, tuple[tuple[str, ...], bool]]) -> None:
        """Tags and pins of published manifests, all at once (the tags of these are cleared first)."""
        self.conn.execute("DELETE FROM tags WHERE manifest IN (SELECT id FROM manifests WHERE object_key IS NOT NULL)")
        self.conn.executemany("UPDATE manifests SET pinned=? WHERE id=?", [(int(p), m) for m, (_, p) in refs.items()])
        self.conn.executemany(
            "INSERT OR REPLACE INTO tags(name, manifest) VALUES (?, ?)",
            [(tag, m) for m, (tags, _) in refs.items() for tag in tags],
        )

    # -- files ---------------------------------------------------------------------------
    def files(self, manifest: int) -> list[FileRecord]:
        return [_file(r) for r in self.conn.execute("SELECT * FROM files WHERE manifest=? ORDER BY path", (manifest,))]

    def insert_files(self, manifest: int, files: Iterable[FileRecord]) -> None:
        """Record files of a manifest. Its layout names files by their place in path order, so
        atoms it has already are set again over the files renumbered."""
        held = self.atoms(manifest)
        self.conn.executemany(
            _insert("files", ("manifest", *FILE_COLUMNS)),
            [(manifest, *values(f, FILE_COLUMNS[:7]), int(f.trusted), f.container) for f in files],
        )
        number_files(self.conn, manifest)
        if held:
            set_atoms(self.conn, manifest, held)

    def content_rows(self, manifest: int) -> tuple[list[FileContent], list[AtomContent]]:
        """What a content digest reads (store/digest.py): the manifest's files by path, and its
        atoms by path, slot and offset (the atoms' primary key: a range read, no sort)."""
        files = self.conn.execute(
            "SELECT path, kind, raw_size, blob, container FROM files WHERE manifest=? ORDER BY path", (manifest,)
        )
        blobs = blobs_of(self.conn, manifest)
        atoms = [
            AtomContent(r[1], r[2], r[3], r[4], blobs[r[0] * HASH_BYTES : (r[0] + 1) * HASH_BYTES].hex())
            for r in self.conn.execute(
                "SELECT a.pos, f.path, a.slot, a.offset, a.nbytes FROM atom_sets s JOIN layout_atoms a"
                " ON a.layout=s.layout JOIN files f ON f.manifest=s.manifest AND f.ordinal=a.file"
                " WHERE s.manifest=? ORDER BY a.file, a.slot, a.offset",
                (manifest,),
            )
        ]
        return [FileContent(*r) for r in files], atoms

    # -- atoms ---------------------------------------------------------------------------
    def atoms(
        self,
        manifest: int,
        *,
        layer: str | None = None,
        path: str | None = None,
        param: str | None = None,
        kind: str | None = None,
        derived: bool | None = None,
    ) -> list[AtomRecord]:
        """A manifest's atoms, by file, tensor slot and offset, optionally filtered;
        ``derived`` True or False keeps only derived or only stored pieces."""
        query, args = _LAYOUT_WITH_KEY, [manifest]
        for column, value in (("a.layer", layer), ("f.path", path), ("a.param", param), ("a.kind", kind)):
            if value is not None:
                query += f" AND {column}=?"
                args.append(value)
        if derived is not None:
            query += " AND a.derived IS NOT NULL" if derived else " AND a.derived IS NULL"
        query += " ORDER BY a.file, a.slot, a.offset"
        rows = self.conn.execute(query, args).fetchall()
        blobs = blobs_of(self.conn, manifest) if rows else b""
        return [
            AtomRecord(*r[1:_BLOB_AT], blobs[r[0] * HASH_BYTES : (r[0] + 1) * HASH_BYTES].hex(), *r[_BLOB_AT:])
            for r in rows
        ]

    def atoms_by_key(self, manifest: int, layer: str | None = None) -> dict[AtomKey, AtomRecord]:
        """The manifest's atoms (optionally of one layer) by what they are, not where they sit."""
        return {a.key(): a for a in self.atoms(manifest, layer=layer)}

    def count_atoms(self, manifest: int, layer: str, kind: str) -> int:
        return self.conn.execute(
            "SELECT count(*) FROM atoms WHERE manifest=? AND layer=? AND kind=?", (manifest, layer, kind)
        ).fetchone()[0]

    def insert_atoms(self, manifest: int, atoms: Iterable[AtomRecord]) -> None:
        """Record a manifest's atoms (added to any it has: a layout is of the whole set)."""
        atoms = list(atoms)
        if self.conn.execute("SELECT 1 FROM atom_sets WHERE manifest=?", (manifest,)).fetchone():
            atoms = [*self.atoms(manifest), *atoms]
        set_atoms(self.conn, manifest, atoms)

    def param_sizes(self, manifest: int, kinds: tuple[str, str]) -> dict[str, int]:
        """Each parameter's element count (the end of its furthest piece of the given kinds)."""
        return {
            r[0]: r[1]
            for r in self.conn.execute(
                "SELECT param, max(start + numel) FROM atoms WHERE manifest=? AND kind IN (?, ?) AND numel > 0"
                " GROUP BY param",
                (manifest, *kinds),
            )
        }

    # -- layers --------------------------------------------------------------------------
    def layers(self, manifest: int) -> list[LayerRecord]:
        return [_layer(r, manifest) for r in self.conn.execute("SELECT * FROM layers WHERE manifest=?", (manifest,))]

    def layer(self, manifest: int, layer: str) -> LayerRecord | None:
        row = self.conn.execute("SELECT * FROM layers WHERE manifest=? AND layer=?", (manifest, layer)).fetchone()
        return _layer(row, manifest) if row else None

    def layer_history(self, before_step: int, run: str) -> list[StoredLayer]:
        """Every layer of every whole commit of the run before ``before_step``, newest step first (for
        inheritance: a thinned step keeps no optimizer state to inherit)."""
        return [
            StoredLayer(r["step"], _layer(r, r["manifest"]))
            for r in self.conn.execute(
                "SELECT l.*, m.step FROM layers l JOIN manifests m ON m.id=l.manifest"
                " WHERE m.origin=? AND m.run=? AND m.step<? AND m.tier IS NULL ORDER BY m.step DESC",
                (COMMIT, run, before_step),
            )
        ]

    def layer_names(self) -> set[str]:
        return {r[0] for r in self.conn.execute("SELECT DISTINCT layer FROM layers")}

    def insert_layers(self, manifest: int, layers: Iterable[LayerRecord]) -> None:
        self.conn.executemany(
            _insert("layers", ("manifest", *_LAYER_COLUMNS)),
            [(manifest, *values(x, _LAYER_COLUMNS[:4]), int(x.stored), x.change) for x in layers],
        )

    def object_keys(self, manifests: Iterable[int]) -> dict[int, str | None]:
        marks = list(manifests)
        rows = self.conn.execute(
            f"SELECT id, object_key FROM manifests WHERE id IN ({','.join('?' * len(marks))})", marks
        )
        return {r[0]: r[1] for r in rows}

    # -- blobs and packs -----------------------------------------------------------------
    def blob(self, digest: str) -> BlobRecord | None:
        row = self.conn.execute("SELECT * FROM blobs WHERE hash=?", (digest,)).fetchone()
        return _blob(row) if row else None

    def loose_blob_count(self) -> int:
        return self.conn.execute("SELECT count(*) FROM blobs WHERE pack IS NULL").fetchone()[0]

    def blob_hashes(self, *, loose_only: bool = False) -> set[str]:
        query = "SELECT hash FROM blobs" + (" WHERE pack IS NULL" if loose_only else "")
        return {r[0] for r in self.conn.execute(query)}

    def referenced_blobs(self, manifest: int) -> list[BlobRecord]:
        """The blob rows a manifest needs: file contents, skeletons, containers and stored atoms."""
        return [
            _blob(r)
            for r in self.conn.execute(
                "SELECT * FROM blobs WHERE hash IN ("
                + _with_bases(
                    "SELECT blob FROM files WHERE manifest=?1 UNION SELECT container FROM files WHERE manifest=?1"
                    " UNION SELECT blob FROM atoms WHERE manifest=?1 AND derived IS NULL"
                )
                + ") ORDER BY hash",
                (manifest,),
            )
        ]

    def referenced_hashes(self, manifest: int) -> set[str]:
        """The hashes a manifest needs, whether or not they have a blob row."""
        return {
            r[0]
            for r in self.conn.execute(
                _with_bases(
                    "SELECT blob FROM files WHERE manifest=?1 UNION SELECT container FROM files WHERE manifest=?1"
                    " AND container IS NOT NULL UNION SELECT blob FROM atoms WHERE manifest=?1 AND derived IS NULL"
                ),
                (manifest,),
            )
        }

    def _temp_set(self, table: str, column: str, values: Iterable[object]) -> None:
        """A one-column temporary table holding ``values``, for ``IN (SELECT ...)`` over sets too
        large for bound parameters. ``table`` and ``column`` are ours, never user input."""
        name = column.split()[0]
        read_only = self.read_only  # a temporary table is this connection's own, on a read-only store too
        if read_only:
            self.conn.execute("PRAGMA query_only=OFF")
        try:
            self.conn.execute(f"CREATE TEMP TABLE IF NOT EXISTS {table}({column} PRIMARY KEY)")
            self.conn.execute(f"DELETE FROM {table}")
            self.conn.executemany(f"INSERT INTO {table}({name}) VALUES (?)", [(v,) for v in values])
        finally:
            if read_only:
                self.conn.execute("PRAGMA query_only=ON")

    def blobs_unused_by(self, keep: Iterable[int]) -> list[BlobRecord]:
        """Blob rows that none of the ``keep`` manifests needs (what gc may drop)."""
        self._temp_set("keep_set", "id INTEGER", keep)
        return [
            _blob(r)
            for r in self.conn.execute(
                "SELECT * FROM blobs WHERE hash NOT IN ("
                + _with_bases(
                    "SELECT blob FROM files WHERE manifest IN (SELECT id FROM keep_set)"
                    " UNION SELECT container FROM files WHERE container IS NOT NULL"
                    " AND manifest IN (SELECT id FROM keep_set)"
                    " UNION SELECT blob FROM atoms WHERE derived IS NULL AND manifest IN (SELECT id FROM keep_set)"
                )
                + ")"
            )
        ]

    def blob_uses(self, manifests: list[int]) -> list[BlobUse]:
        """Where each blob of the given manifests is used, in words (for verify's messages)."""
        marks = ",".join("?" * len(manifests))
        out: list[BlobUse] = []
        for r in self.conn.execute(
            f"SELECT m.step, f.path, f.blob, f.container FROM files f JOIN manifests m ON m.id=f.manifest"
            f" WHERE f.manifest IN ({marks})",
            manifests,
        ):
            out.append(BlobUse(r["blob"], f"step {r['step']}, file {r['path']}"))
            if r["container"] is not None:
                out.append(BlobUse(r["container"], f"step {r['step']}, file {r['path']} (container)"))
        for r in self.conn.execute(
            f"SELECT DISTINCT m.step, a.layer, a.path, a.blob FROM atoms a JOIN manifests m ON m.id=a.manifest"
            f" WHERE a.manifest IN ({marks}) AND a.derived IS NULL",
            manifests,
        ):
            out.append(BlobUse(r["blob"], f"step {r['step']}, layer {r['layer']}, file {r['path']}"))
        for r in self.conn.execute(  # the chains archived atoms are built on (archive_codec.py)
            f"SELECT DISTINCT m.step, a.layer, a.path, a.blob, j.value AS base FROM atoms a"
            f" JOIN manifests m ON m.id=a.manifest JOIN blobs b ON b.hash=a.blob, {_CHAIN}"
            f" WHERE a.manifest IN ({marks}) AND a.derived IS NULL AND {_ARCHIVED}",
            manifests,
        ):
            where = f"step {r['step']}, layer {r['layer']}, file {r['path']}"
            out.append(BlobUse(r["base"], f"{where} (the archive chain of blob {r['blob']})"))
        return out

    def upsert_blobs(self, blobs: Iterable[BlobRecord]) -> None:
        """Record blobs; a blob already known takes the new location (a repaired or repacked blob)."""
        self.conn.executemany(
            _BLOB_ROW_INSERT + " ON CONFLICT(hash) DO UPDATE SET stored_size=excluded.stored_size,"
            " codec=excluded.codec, pack=excluded.pack, pack_offset=excluded.pack_offset",
            self._blob_rows(list(blobs)),
        )

    def add_blobs(self, blobs: Iterable[BlobRecord]) -> None:
        """Record blobs not known yet; a known blob keeps its row (where it is, packs decide)."""
        self.conn.executemany(_BLOB_ROW_INSERT + " ON CONFLICT(hash) DO NOTHING", self._blob_rows(list(blobs)))

    def _blob_rows(self, blobs: list[BlobRecord]) -> list[tuple[object, ...]]:
        """``blob_rows`` rows of these records, their codecs and packs recorded by number first."""
        codecs = self._numbers("codecs", "descriptor", {b.codec for b in blobs})
        packs = self._numbers("pack_names", "name", {b.pack for b in blobs if b.pack is not None})
        return [
            (b.hash, b.raw_size, b.stored_size, codecs[b.codec], b.created_at, packs.get(b.pack), b.pack_offset)
            for b in blobs
        ]

    def _numbers(self, table: str, column: str, names: set[str]) -> dict[str, int]:
        """The number of each name in ``table`` (``codecs``, ``pack_names``: ours), recorded if new."""
        self.conn.executemany(f"INSERT OR IGNORE INTO {table}({column}) VALUES (?)", [(n,) for n in names])
        return {n: self.conn.execute(f"SELECT id FROM {table} WHERE {column}=?", (n,)).fetchone()[0] for n in names}

    def _drop_unused_names(self) -> None:
        """Packs and codecs no blob row names any more: their names go (a pack's name is kept only while
        a row names it, and archived blobs have a codec each)."""
        self.conn.execute("DELETE FROM pack_names WHERE id NOT IN (SELECT pack FROM blob_rows WHERE pack IS NOT NULL)")
        self.conn.execute("DELETE FROM codecs WHERE id NOT IN (SELECT codec FROM blob_rows)")

    def delete_blobs(self, hashes: Iterable[str]) -> None:
        self.conn.executemany("DELETE FROM blob_rows WHERE hash=?", [(h,) for h in hashes])
        self._drop_unused_names()

    def move_blobs(self, placed: dict[str, tuple[str, int]]) -> None:
        """Point blobs at their new pack and offset (after a repack)."""
        packs = self._numbers("pack_names", "name", {p for p, _ in placed.values()})
        self.conn.executemany(
            "UPDATE blob_rows SET pack=?, pack_offset=? WHERE hash=?",
            [(packs[p], o, h) for h, (p, o) in placed.items()],
        )
        self._drop_unused_names()

    def packs_named_by_blobs(self) -> set[str]:
        """Every pack some blob row names (read from the ``blobs_pack`` index)."""
        return {r[0] for r in self.conn.execute("SELECT DISTINCT pack FROM blobs WHERE pack IS NOT NULL")}

    def blobs_packed_outside(self, packs: Iterable[str]) -> list[BlobRecord]:
        """Packed blob rows whose pack is not among ``packs`` (the packs the backend holds): rows
        left pointing at a pack that is gone, which only the packs' trailers can place again."""
        self._temp_set("pack_set", "name TEXT", packs)
        return [
            _blob(r)
            for r in self.conn.execute(
                "SELECT * FROM blobs WHERE pack IS NOT NULL AND pack NOT IN (SELECT name FROM pack_set)"
            )
        ]

    def blobs_in_pack(self, name: str) -> list[BlobRecord]:
        return [_blob(r) for r in self.conn.execute("SELECT * FROM blobs WHERE pack=? ORDER BY pack_offset", (name,))]

    def packs(self) -> dict[str, int]:
        """Pack name -> size of its object."""
        return {r[0]: r[1] for r in self.conn.execute("SELECT name, size FROM packs ORDER BY name")}

    def has_pack(self, name: str) -> bool:
        return self.conn.execute("SELECT 1 FROM packs WHERE name=?", (name,)).fetchone() is not None

    def add_packs(self, packs: Iterable[tuple[str, int]]) -> None:
        self.conn.executemany("INSERT INTO packs(name, size) VALUES (?,?) ON CONFLICT(name) DO NOTHING", packs)

    def delete_packs(self, names: Iterable[str]) -> None:
        self.conn.executemany("DELETE FROM packs WHERE name=?", [(n,) for n in names])

    # -- summaries (log, show, du) -------------------------------------------------------
    def layer_totals(self, manifest: int) -> list[LayerTotals]:
        """Per layer of a manifest: its kinds, raw bytes, and bytes derived rather than stored."""
        return [
            LayerTotals(r[0], sorted(set(r[1].split(","))), r[2], r[3])
            for r in self.conn.execute(
                "SELECT layer, group_concat(DISTINCT kind), sum(nbytes),"
                " sum(CASE WHEN derived IS NULL THEN 0 ELSE nbytes END) FROM atoms WHERE manifest=? GROUP BY layer",
                (manifest,),
            )
        ]

    def layer_stored_bytes(self, manifest: int) -> dict[str, int]:
        """Per layer of a manifest: stored bytes of the distinct blobs it uses."""
        return {
            r[0]: r[1]
            for r in self.conn.execute(
                "SELECT layer, sum(stored_size) FROM (SELECT DISTINCT a.layer, a.blob, b.stored_size"
                " FROM atoms a JOIN blobs b ON b.hash = a.blob WHERE a.manifest=? AND a.derived IS NULL)"
                " GROUP BY layer",
                (manifest,),
            )
        }

    def blob_object_bytes(self) -> int:
        """What the backend holds for blobs: loose blob objects and whole packs."""
        return (
            self.conn.execute("SELECT coalesce(sum(stored_size), 0) FROM blobs WHERE pack IS NULL").fetchone()[0]
            + self.conn.execute("SELECT coalesce(sum(size), 0) FROM packs").fetchone()[0]
        )

    def kind_totals(self) -> list[KindTotals]:
        """Per atom kind over all manifests: raw bytes, derived bytes, stored bytes of its blobs."""
        stored = {
            r[0]: r[1]
            for r in self.conn.execute(
                "SELECT k.kind, sum(b.stored_size) FROM (SELECT blob, min(kind) AS kind FROM atoms"
                " WHERE derived IS NULL GROUP BY blob) k JOIN blobs b ON b.hash = k.blob GROUP BY k.kind"
            )
        }
        return [
            KindTotals(r[0], r[1], r[2], stored.get(r[0], 0))
            for r in self.conn.execute(
                "SELECT kind, sum(nbytes), sum(CASE WHEN derived IS NULL THEN 0 ELSE nbytes END) FROM atoms"
                " GROUP BY kind"
            )
        ]

    def non_atom_blob_bytes(self) -> int:
        """Stored bytes of blobs no atom uses: whole files, skeletons, headers and containers."""
        return self.conn.execute(
            "SELECT coalesce(sum(stored_size), 0) FROM blobs WHERE hash NOT IN (SELECT blob FROM atoms)"
        ).fetchone()[0]

    def bytes_alone(self) -> dict[int, int]:
        """Per manifest: stored bytes of the blobs no other manifest uses."""
        return {
            r[0]: r[1]
            for r in self.conn.execute(
                "WITH refs AS (SELECT blob, manifest FROM atoms WHERE derived IS NULL UNION SELECT blob, manifest"
                " FROM files UNION SELECT container, manifest FROM files WHERE container IS NOT NULL),"
                " lone AS (SELECT blob, min(manifest) AS manifest FROM refs GROUP BY blob HAVING count(*) = 1)"
                " SELECT lone.manifest, sum(b.stored_size) FROM lone JOIN blobs b ON b.hash = lone.blob"
                " GROUP BY lone.manifest"
            )
        }


_CHAIN = "json_each(CASE WHEN json_valid(b.codec) THEN b.codec ELSE '{}' END, '$.bases') j"
_ARCHIVED = "b.codec LIKE '%\"archive-delta\"%'"  # json_each reads only valid JSON (a hostile row reads as {})


def _with_bases(hashes: str) -> str:
    """A query of the hashes ``hashes`` selects and of every blob their archived blobs are built
    on. An archived blob's descriptor lists its whole chain (``bases``), so one level suffices."""
    return (
        f"WITH direct(h) AS ({hashes}) SELECT h FROM direct UNION SELECT j.value FROM blobs b"
        f" JOIN direct ON b.hash = direct.h, {_CHAIN} WHERE {_ARCHIVED}"
    )


def damaged(path: Path, exc: BaseException) -> CorruptStoreError:
    return CorruptStoreError(
        f"{path}: the index is damaged or unreadable ({exc}). The blobs and manifest objects are untouched; "
        "recreate the index (",
        Call("rebuild_index"),
        "), then check the store (",
        Call("verify", deep=True),
        ").",
    )


def _migrate(conn: sqlite3.Connection, path: Path, version: int) -> None:
    """Bring an older index up to this format, one version per transaction.

    Each step only adds what the newer format needs and bumps the version in the same
    transaction, so an interrupted upgrade leaves a consistent index of some version, and
    the next open goes on from there. Older tailorstore versions then refuse the store.
    """
    while version < FORMAT_VERSION:
        statements = MIGRATIONS.get(version)
        if statements is None:
            conn.close()
            raise FormatVersionError(f"{path}: no upgrade from format version {version}; restore from a backup.")
        keys_off = version in FOREIGN_KEYS_OFF  # a pragma a transaction cannot change: set before it
        try:
            if keys_off:
                conn.execute("PRAGMA foreign_keys=OFF")
            conn.execute("BEGIN IMMEDIATE")  # another process may be upgrading the same index
            now = int(conn.execute("SELECT value FROM meta WHERE key='format_version'").fetchone()[0])
            if now == version:
                if callable(statements):
                    statements(conn)
                else:
                    for statement in statements:
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
        if keys_off:
            conn.execute("PRAGMA foreign_keys=ON")
        version = now


class _Closed:
    """The connection of a closed index: any use says so in our terms (it was sqlite3's
    ProgrammingError, "Cannot operate on a closed database")."""

    def __getattr__(self, name: str) -> Any:
        if name == "close":
            return lambda: None
        raise StoreError("this store is closed; open it again to use it.")


def index_failed(path: Path, exc: sqlite3.DatabaseError) -> TailorError:
    """What SQLite raised, as this library's error: the operation was not carried out, and why
    (a full disk, a read-only file, a damaged index, a constraint the rows broke)."""
    text = str(exc)
    if "database is locked" in text or "database table is locked" in text:
        return LockTimeoutError(
            f"{path}: another process held the store's index for longer than the lock timeout (a tailor process "
            "that is stalled or slow in its write); the operation was not carried out. Run it again once that "
            "process has ended, or give it longer with ",
            Call(lock_timeout="SECONDS"),
            ".",
        )
    if "disk is full" in text or "disk I/O error" in text:  # the index is where the store was, but cannot grow
        return CorruptStoreError(
            f"{path}: the store's index could not be written ({text}); the operation was not carried out. "
            "Free some space and run it again."
        )
    if "readonly" in text:
        return StoreError(f"{path}: the store's index is read-only here ({text}); the operation was not carried out.")
    return CorruptStoreError(
        f"{path}: the store's index failed ({text}); the operation was not carried out. If it is damaged, recreate "
        "it (",
        Call("rebuild_index"),
        ") and check the store (",
        Call("verify", deep=True),
        ").",
    )


def _speaking_our_errors(cls: type) -> type:
    """Every query and change of the index raises this library's errors, never sqlite3's: the
    layers above the store (and the command line) know no SQL."""
    for name, member in list(vars(cls).items()):
        if name.startswith("_") or name == "transaction" or not inspect.isfunction(member):
            continue  # staticmethods, classmethods and properties translate their own (open: damaged)

        def translated(*args: Any, __member: Callable[..., Any] = member, **kwargs: Any) -> Any:
            try:
                return __member(*args, **kwargs)
            except sqlite3.DatabaseError as exc:
                raise index_failed(args[0].path, exc) from None

        functools.update_wrapper(translated, member)
        setattr(cls, name, translated)
    return cls


Index = _speaking_our_errors(Index)
