"""The SQLite index: schema and format version.

The index is a cache of the manifest objects in the backend (store/manifests/). docs/FORMAT.md
describes every table; this file is the executable form of that description.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from tailorstore.store.index.atom_sets import SEGMENT
from tailorstore.store.index.upgrade_8 import FOREIGN_KEYS_OFF, upgrade

FORMAT_VERSION = 8

# Atoms (format 8). A step's layout (which pieces of which tensors sit where in which file) is almost
# always the layout of the step before, and only each piece's blob changes; rows per atom per step
# made the index grow by the whole layout every step (docs/benchmarks.md, "The metadata at scale").
# So a layout's rows are kept once (``layout_atoms``, named by the digest of its rows; a file there is
# its place among the manifest's files, as the names hold the step's folder) and a manifest
# holds which layout it has (``atom_sets``) and its atoms' blobs, 16 bytes each in the layout's
# ``pos`` order, SEGMENT to a row (``atom_blobs``: one row fills one page without spilling, so that
# reading one hash never reads an overflow chain and no page is half empty). ``atoms`` is a view of
# the rows as format 7 had them.
ATOM_TABLES_TEXT = f"""
CREATE TABLE atom_layouts (
    id       INTEGER PRIMARY KEY,
    digest   TEXT NOT NULL UNIQUE,  -- xxh3-128 of the layout's rows (store/index/atom_sets.py)
    atoms    INTEGER NOT NULL       -- how many rows it has
);
CREATE TABLE layout_atoms (
    layout   INTEGER NOT NULL REFERENCES atom_layouts(id) ON DELETE CASCADE,
    file     INTEGER NOT NULL,      -- the ordinal of its file (files.ordinal): names differ from step to step
    slot     INTEGER NOT NULL,      -- tensor slot in the file's skeleton
    offset   INTEGER NOT NULL,      -- first element within that tensor
    numel    INTEGER NOT NULL,
    dtype    TEXT NOT NULL,
    shape    TEXT NOT NULL,         -- JSON list: the piece's shape
    param    TEXT NOT NULL,
    kind     TEXT NOT NULL,
    rank     INTEGER NOT NULL,
    start    INTEGER NOT NULL,      -- first element within the parameter
    nbytes   INTEGER NOT NULL,      -- raw size of the piece
    layer    TEXT NOT NULL,
    derived  TEXT,                  -- NULL, or how checkout rebuilds the bytes (round-from-master)
    file_offset INTEGER,            -- where the piece's bytes sit in the file; NULL when it has no container
    pos      INTEGER NOT NULL,      -- where its blob sits in each manifest's atom_blobs
    PRIMARY KEY (layout, file, slot, offset)
) WITHOUT ROWID;
CREATE INDEX layout_atoms_layer ON layout_atoms(layout, layer);
CREATE TABLE atom_sets (
    manifest INTEGER PRIMARY KEY REFERENCES manifests(id) ON DELETE CASCADE,
    layout   INTEGER NOT NULL REFERENCES atom_layouts(id)
);
CREATE INDEX atom_sets_layout ON atom_sets(layout);
CREATE TABLE atom_blobs (
    id       INTEGER PRIMARY KEY,   -- a rowid table: a row of 4,000 bytes stays within its page
    manifest INTEGER NOT NULL REFERENCES atom_sets(manifest) ON DELETE CASCADE,
    segment  INTEGER NOT NULL,      -- the atoms of pos SEGMENT * segment onwards
    blobs    BLOB NOT NULL          -- 16 bytes an atom: the xxh3-128 of its raw bytes
);
CREATE UNIQUE INDEX atom_blobs_segment ON atom_blobs(manifest, segment);
CREATE VIEW atoms AS SELECT s.manifest AS manifest, f.path, a.slot, a.offset, a.numel, a.dtype, a.shape,
    a.param, a.kind, a.rank, a.start, a.nbytes, a.layer,
    lower(hex(substr(b.blobs, (a.pos % {SEGMENT}) * 16 + 1, 16))) AS blob, a.derived, a.file_offset
    FROM atom_sets s JOIN layout_atoms a ON a.layout = s.layout
    JOIN files f ON f.manifest = s.manifest AND f.ordinal = a.file
    JOIN atom_blobs b ON b.manifest = s.manifest AND b.segment = a.pos / {SEGMENT};
"""

# Blobs (format 8). A step of a training adds a blob an atom, so the blob rows grow with the step's
# chunks as the layout did: each row named its codec by its JSON descriptor and its pack by its 32-hex
# name, twice with the pack's index, beside a second index of the hash. The rows now name both by a
# number (``codecs``, ``pack_names``: a name is kept while a row names it), in a table keyed by the
# hash itself (WITHOUT ROWID: no second index). ``blobs`` is a view of the rows as format 7 had them,
# writable as that table was (its triggers), for a hand edit of the index.
BLOB_TABLES_TEXT = """
CREATE TABLE codecs (
    id          INTEGER PRIMARY KEY,
    descriptor  TEXT NOT NULL UNIQUE  -- JSON codec descriptor
);
CREATE TABLE pack_names (
    id          INTEGER PRIMARY KEY,
    name        TEXT NOT NULL UNIQUE  -- a pack's name; kept while a blob row names it
);
CREATE TABLE blob_rows (
    hash        TEXT PRIMARY KEY,   -- xxh3-128 of the raw bytes, 32 lowercase hex digits
    raw_size    INTEGER NOT NULL,
    stored_size INTEGER NOT NULL,
    codec       INTEGER NOT NULL REFERENCES codecs(id),
    created_at  REAL NOT NULL,
    pack        INTEGER REFERENCES pack_names(id),  -- the pack holding it, or NULL for a loose blob object
    pack_offset INTEGER             -- where its bytes start in that pack
) WITHOUT ROWID;
CREATE INDEX blob_rows_pack ON blob_rows(pack);
"""
BLOB_VIEW_TEXT = """
CREATE VIEW blobs AS SELECT b.hash AS hash, b.raw_size AS raw_size, b.stored_size AS stored_size,
    c.descriptor AS codec, b.created_at AS created_at, p.name AS pack, b.pack_offset AS pack_offset
    FROM blob_rows b JOIN codecs c ON c.id = b.codec LEFT JOIN pack_names p ON p.id = b.pack;
CREATE TRIGGER blobs_insert INSTEAD OF INSERT ON blobs BEGIN
    INSERT OR IGNORE INTO codecs(descriptor) VALUES (NEW.codec);
    INSERT OR IGNORE INTO pack_names(name) SELECT NEW.pack WHERE NEW.pack IS NOT NULL;
    INSERT INTO blob_rows(hash, raw_size, stored_size, codec, created_at, pack, pack_offset)
        VALUES (NEW.hash, NEW.raw_size, NEW.stored_size, (SELECT id FROM codecs WHERE descriptor = NEW.codec),
                NEW.created_at, (SELECT id FROM pack_names WHERE name = NEW.pack), NEW.pack_offset);
END;
CREATE TRIGGER blobs_update INSTEAD OF UPDATE ON blobs BEGIN
    INSERT OR IGNORE INTO codecs(descriptor) VALUES (NEW.codec);
    INSERT OR IGNORE INTO pack_names(name) SELECT NEW.pack WHERE NEW.pack IS NOT NULL;
    UPDATE blob_rows SET hash = NEW.hash, raw_size = NEW.raw_size, stored_size = NEW.stored_size,
        codec = (SELECT id FROM codecs WHERE descriptor = NEW.codec), created_at = NEW.created_at,
        pack = (SELECT id FROM pack_names WHERE name = NEW.pack), pack_offset = NEW.pack_offset
        WHERE hash = OLD.hash;
END;
CREATE TRIGGER blobs_delete INSTEAD OF DELETE ON blobs BEGIN
    DELETE FROM blob_rows WHERE hash = OLD.hash;
END;
"""

_TAGS_TABLE = (
    "CREATE TABLE tags (name TEXT PRIMARY KEY, manifest INTEGER NOT NULL REFERENCES manifests(id) ON DELETE CASCADE)"
)

# Upgrades from an older format: each runs in one transaction with the version bump (those in
# FOREIGN_KEYS_OFF with foreign keys off, as they rebuild tables other tables name, checked before
# the commit).
MIGRATIONS: dict[int, tuple[str, ...] | Callable[[sqlite3.Connection], None]] = {
    # 1 -> 2: byte-exact checkout. Rows written by format 1 keep NULL in both columns and are
    # checked out by re-pickling their skeleton, as format 1 did.
    1: (
        "ALTER TABLE files ADD COLUMN container TEXT REFERENCES blobs(hash)",
        "ALTER TABLE atoms ADD COLUMN file_offset INTEGER",
    ),
    # 2 -> 3: manifests become objects in the backend; opening the store writes the objects
    # of the manifests it holds (object_key NULL) before anything else.
    # Packs: blobs may live inside pack objects.
    2: (
        "ALTER TABLE manifests ADD COLUMN object_key TEXT",
        "CREATE UNIQUE INDEX manifests_object_key ON manifests(object_key)",
        "ALTER TABLE blobs ADD COLUMN pack TEXT",
        "ALTER TABLE blobs ADD COLUMN pack_offset INTEGER",
        "CREATE TABLE packs (name TEXT PRIMARY KEY, size INTEGER NOT NULL)",
        "CREATE INDEX blobs_pack ON blobs(pack)",
    ),
    # 3 -> 4: runs. Every manifest so far belongs to run 'main'; steps are unique per run.
    3: (
        "ALTER TABLE manifests ADD COLUMN run TEXT NOT NULL DEFAULT 'main'",
        "DROP INDEX manifests_commit_step",
        "CREATE UNIQUE INDEX manifests_commit_step ON manifests(run, step) WHERE origin = 'commit'",
        "CREATE TABLE runs (name TEXT PRIMARY KEY, created_at REAL NOT NULL, base TEXT)",
    ),
    # 4 -> 5: retention tiers. Every manifest so far is whole (NULL).
    4: ("ALTER TABLE manifests ADD COLUMN tier TEXT",),
    # 5 -> 6: metrics recorded with a step. Every manifest so far has none (NULL).
    5: ("ALTER TABLE manifests ADD COLUMN metrics TEXT",),
    # 6 -> 7: any number of tags a step (a retag is one object, docs/FORMAT.md 8.1, I3). The old
    # column stays, NULL (SQLite cannot drop a UNIQUE column).
    6: (
        _TAGS_TABLE,
        "CREATE INDEX tags_manifest ON tags(manifest)",
        "INSERT INTO tags(name, manifest) SELECT tag, id FROM manifests WHERE tag IS NOT NULL",
        "UPDATE manifests SET tag=NULL",
    ),
    # 7 -> 8: a layout's atom rows kept once, a manifest's blobs beside them (ATOM_TABLES_TEXT).
    7: lambda conn: upgrade(
        conn,
        _statements(_SCHEMA_TEXT),
        _statements(ATOM_TABLES_TEXT),
        _statements(BLOB_TABLES_TEXT),
        _statements(BLOB_VIEW_TEXT),
    ),
}

_SCHEMA_TEXT = (
    (
        """
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
{BLOB_TABLES}
CREATE TABLE packs (
    name        TEXT PRIMARY KEY,   -- xxh3-128 of the pack's bytes
    size        INTEGER NOT NULL    -- bytes of the pack object, trailer included
);
CREATE TABLE manifests (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    step        INTEGER NOT NULL,   -- training step; for a merge, the base step's
    origin      TEXT NOT NULL,      -- commit | merge
    created_at  REAL NOT NULL,
    layout      TEXT NOT NULL,      -- deepspeed | deepspeed-tag | hf-trainer | accelerate | dcp | plain | plain-file
    ds_tag      TEXT,               -- the DeepSpeed tag folder, e.g. global_step300
    zero_stage  INTEGER,
    world_size  INTEGER,
    policy      TEXT NOT NULL,      -- JSON: the policy (or merge spec) that chose the layers
    exact       INTEGER NOT NULL,   -- 1 when every layer comes from this manifest's own step
    pinned      INTEGER NOT NULL DEFAULT 0,
    raw_bytes   INTEGER NOT NULL,   -- bytes of the checkpoint this manifest checks out to
    new_bytes   INTEGER NOT NULL,   -- stored bytes of blobs this commit wrote first
    source      TEXT NOT NULL,      -- the directory committed, or the merge spec file
    object_key  TEXT,               -- the manifest's object in the backend (manifests/...)
    run         TEXT NOT NULL DEFAULT 'main',  -- the run whose step this is
    tier        TEXT,               -- NULL: whole; master | weights: thinned by gc to that tier
    metrics     TEXT                -- NULL, or a JSON object of the step's metrics (name -> number or null)
);
CREATE UNIQUE INDEX manifests_commit_step ON manifests(run, step) WHERE origin = 'commit';
CREATE UNIQUE INDEX manifests_object_key ON manifests(object_key);
CREATE TABLE tags (
    name        TEXT PRIMARY KEY,   -- a tag names one manifest; a manifest holds any number
    manifest    INTEGER NOT NULL REFERENCES manifests(id) ON DELETE CASCADE
);
CREATE INDEX tags_manifest ON tags(manifest);
CREATE TABLE runs (
    name        TEXT PRIMARY KEY,   -- [A-Za-z0-9._-]+; 'main' exists without a row
    created_at  REAL NOT NULL,
    base        TEXT                -- object key of the manifest the run branched from, or NULL
);
CREATE TABLE files (
    manifest  INTEGER NOT NULL REFERENCES manifests(id) ON DELETE CASCADE,
    path      TEXT NOT NULL,        -- relative, '/'-separated, never absolute, no '..'
    file_key  TEXT NOT NULL,        -- path with the tag folder written as {tag}
    kind      TEXT NOT NULL,        -- raw | torch | safetensors
    rank      INTEGER,
    blob      TEXT NOT NULL REFERENCES blob_rows(hash),  -- content / skeleton / header
    raw_size  INTEGER NOT NULL,     -- size of the file as committed
    mode      INTEGER NOT NULL,
    trusted   INTEGER NOT NULL DEFAULT 0,  -- the skeleton loads only when pickles are trusted
    container TEXT REFERENCES blob_rows(hash),  -- the file's bytes outside its atoms; NULL: re-pickle the skeleton
    ordinal   INTEGER NOT NULL DEFAULT 0,  -- format 8: its place among the manifest's files by path, from 0
    PRIMARY KEY (manifest, path)
);
CREATE INDEX files_ordinal ON files(manifest, ordinal);
{ATOM_TABLES}
CREATE INDEX files_blob ON files(blob);
CREATE TABLE layers (
    manifest    INTEGER NOT NULL REFERENCES manifests(id) ON DELETE CASCADE,
    layer       TEXT NOT NULL,
    source      INTEGER NOT NULL,   -- the manifest whose atoms this layer uses (itself when stored)
    source_step INTEGER NOT NULL,   -- that manifest's step, kept here so reads need no join
    raw_bytes   INTEGER NOT NULL,
    stored      INTEGER NOT NULL,   -- 1 when this commit wrote (or deduplicated) the layer itself
    change      REAL,               -- relative change of the FP32 master since its last stored version
    PRIMARY KEY (manifest, layer)
);
"""
    )
    .replace("{ATOM_TABLES}", ATOM_TABLES_TEXT)
    .replace("{BLOB_TABLES}", BLOB_TABLES_TEXT + BLOB_VIEW_TEXT)
)


def _statements(script: str) -> tuple[str, ...]:
    """Split a script where SQLite's own tokenizer says a statement ends (comments and strings
    may hold ';'), so the index can run them one by one inside its own transaction."""
    out: list[str] = []
    pending = ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            out.append(pending.strip())
            pending = ""
    if pending.strip():
        raise ValueError(f"incomplete statement at the end of the schema: {pending.strip()[:60]}")
    return tuple(out)


SCHEMA: tuple[str, ...] = _statements(_SCHEMA_TEXT)


FOREIGN_KEYS_OFF.add(7)  # 7 -> 8 rebuilds ``files`` and replaces ``blobs`` (store/index/upgrade_8.py)
