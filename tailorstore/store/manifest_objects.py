"""Manifests as immutable objects in the backend, so the SQLite index is only a cache.

A manifest counts as committed once its object exists: the object is written create-only
after every blob it names is durable, inside the index transaction that records it (a
failed put rolls the transaction back; a failed index commit deletes the object). Each
object holds everything the index knows about that manifest: its row, its files, atoms
and layers, and the rows of every blob it references. Layers name their source manifest
by object key, not by the local id, which differs from host to host.

Keys (docs/FORMAT.md):

- ``manifests/<run>/step-<step:020d>-v<n>.json.zst``: a commit; ``--force`` writes v(n+1)
  and then deletes v(n); a reader takes the highest version of a step;
- ``manifests/<run>/merge-<token>.json.zst``: a merge;
- ``refs/tags/<tag>``: the object key a tag names (mutable; tag bytes outside
  ``[A-Za-z0-9._-]`` are written ``=XX``);
- ``refs/pins/<manifest object name>``: present while the manifest is pinned.

:func:`sync` brings the index up to date with the backend (new manifests of other hosts,
manifests another host's gc dropped, tags and pins); :func:`rebuild` recreates it.
"""

from __future__ import annotations

import json
import re
import secrets
import sqlite3
import time
from collections.abc import Iterable
from typing import Any

import zstandard

from ..errors import CorruptStoreError
from .backend import Backend, check_key
from .packs import pack_names, read_trailer

MANIFEST_PREFIX = "manifests/"
TAG_PREFIX = "refs/tags/"
PIN_PREFIX = "refs/pins/"
DOC_VERSION = 1
RUN = "main"
_COMMIT_KEY = re.compile(r"manifests/([A-Za-z0-9._-]+)/step-(\d{20})-v(\d+)\.json\.zst")
_MERGE_KEY = re.compile(r"manifests/([A-Za-z0-9._-]+)/merge-[0-9a-f]+\.json\.zst")
_MANIFEST_COLUMNS = (
    "step, origin, created_at, layout, ds_tag, zero_stage, world_size, policy, exact, raw_bytes, new_bytes, source"
)
_FILE_COLUMNS = ("path", "file_key", "kind", "rank", "blob", "raw_size", "mode", "trusted", "container")
_ATOM_COLUMNS = (
    "path", "slot", "offset", "numel", "dtype", "shape", "param", "kind", "rank", "start", "nbytes",
    "layer", "blob", "derived", "file_offset",
)  # fmt: skip
_LAYER_COLUMNS = ("layer", "source_step", "raw_bytes", "stored", "change")
_BLOB_COLUMNS = ("hash", "raw_size", "stored_size", "codec", "created_at", "pack", "pack_offset")


def tag_key(tag: str) -> str:
    escaped = "".join(
        chr(b) if chr(b).isascii() and (chr(b).isalnum() or chr(b) in "._-") else f"={b:02X}" for b in tag.encode()
    )
    return check_key(TAG_PREFIX + escaped)


def tag_of_key(key: str) -> str:
    escaped = key[len(TAG_PREFIX) :]
    return re.sub(rb"=([0-9A-F]{2})", lambda m: bytes([int(m.group(1), 16)]), escaped.encode()).decode()


def pin_key(object_key: str) -> str:
    return PIN_PREFIX + object_key.rsplit("/", 1)[-1]


def is_manifest_key(key: str) -> bool:
    return bool(_COMMIT_KEY.fullmatch(key) or _MERGE_KEY.fullmatch(key))


def new_key(backend: Backend, conn: sqlite3.Connection, manifest: int) -> str:
    """The key a manifest's object gets: by step and version for a commit, random for a merge."""
    row = conn.execute("SELECT step, origin FROM manifests WHERE id=?", (manifest,)).fetchone()
    if row["origin"] != "commit":
        return f"{MANIFEST_PREFIX}{RUN}/merge-{secrets.token_hex(8)}.json.zst"
    versions = [
        int(m.group(3))
        for key in backend.list(f"{MANIFEST_PREFIX}{RUN}/")
        if (m := _COMMIT_KEY.fullmatch(key)) and int(m.group(2)) == row["step"]
    ]
    return f"{MANIFEST_PREFIX}{RUN}/step-{row['step']:020d}-v{max(versions, default=0) + 1}.json.zst"


def _rows(conn: sqlite3.Connection, query: str, args: tuple, columns: Iterable[str]) -> list[list[Any]]:
    return [[r[c] for c in columns] for r in conn.execute(query, args)]


def document(conn: sqlite3.Connection, manifest: int) -> dict[str, Any]:
    """Everything the index holds about one manifest, as a self-contained JSON document."""
    row = conn.execute(f"SELECT {_MANIFEST_COLUMNS} FROM manifests WHERE id=?", (manifest,)).fetchone()
    layers = conn.execute(
        "SELECT l.*, m.object_key AS source_key FROM layers l JOIN manifests m ON m.id=l.source WHERE l.manifest=?",
        (manifest,),
    ).fetchall()
    blobs = _rows(
        conn,
        "SELECT * FROM blobs WHERE hash IN (SELECT blob FROM files WHERE manifest=?1"
        " UNION SELECT container FROM files WHERE manifest=?1"
        " UNION SELECT blob FROM atoms WHERE manifest=?1 AND derived IS NULL) ORDER BY hash",
        (manifest,),
        _BLOB_COLUMNS,
    )
    return {
        "tailorstore_manifest": DOC_VERSION,
        "manifest": dict(row),
        "files": {"columns": _FILE_COLUMNS, "rows": _rows(
            conn, "SELECT * FROM files WHERE manifest=? ORDER BY path", (manifest,), _FILE_COLUMNS)},
        "atoms": {"columns": _ATOM_COLUMNS, "rows": _rows(
            conn, "SELECT * FROM atoms WHERE manifest=? ORDER BY path, slot, offset", (manifest,), _ATOM_COLUMNS)},
        "layers": {"columns": (*_LAYER_COLUMNS, "source"), "rows": [
            [*(r[c] for c in _LAYER_COLUMNS), None if r["source"] == manifest else r["source_key"]] for r in layers]},
        "blobs": {"columns": _BLOB_COLUMNS, "rows": blobs},
    }  # fmt: skip


def encode(doc: dict[str, Any]) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(json.dumps(doc, separators=(",", ":")).encode())


def decode(data: bytes, key: str) -> dict[str, Any]:
    try:
        doc = json.loads(zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 31))
    except (zstandard.ZstdError, ValueError) as exc:
        raise CorruptStoreError(f"manifest object {key} is damaged ({exc}); restore it from a backup") from None
    if not isinstance(doc, dict) or doc.get("tailorstore_manifest") != DOC_VERSION:
        raise CorruptStoreError(f"manifest object {key} is not a manifest this tailorstore reads; upgrade tailorstore")
    return doc


def publish(backend: Backend, conn: sqlite3.Connection, manifest: int) -> str:
    """Write the manifest's object, create-only, from inside the transaction that records it.

    Its tag and pin objects go first: they name a key that does not exist yet, which readers
    ignore, so a crash before the manifest object leaves nothing that counts.
    """
    key = new_key(backend, conn, manifest)
    conn.execute("UPDATE manifests SET object_key=? WHERE id=?", (key, manifest))
    write_refs(backend, conn, [manifest])
    backend.put(key, encode(document(conn, manifest)), create_only=True)
    return key


def unpublish(backend: Backend, keys: Iterable[str | None]) -> None:
    """Delete manifest objects (and their pins) that are no longer wanted."""
    for key in keys:
        if key:
            backend.delete(key)
            backend.delete(pin_key(key))


def write_refs(backend: Backend, conn: sqlite3.Connection, manifests: Iterable[int]) -> None:
    """Make the tag and pin objects of these manifests say what the index says."""
    for m in manifests:
        row = conn.execute("SELECT tag, pinned, object_key FROM manifests WHERE id=?", (m,)).fetchone()
        if row is None or row["object_key"] is None:
            continue
        if row["tag"]:
            backend.put(tag_key(row["tag"]), row["object_key"].encode())
        if row["pinned"]:
            backend.put(pin_key(row["object_key"]), b"")
        else:
            backend.delete(pin_key(row["object_key"]))


def drop_tag(backend: Backend, tag: str) -> None:
    backend.delete(tag_key(tag))


def import_document(conn: sqlite3.Connection, key: str, doc: dict[str, Any], ids: dict[str, int]) -> int:
    """Insert one manifest object's rows; ``ids`` maps object keys already in the index to local ids."""
    m = doc["manifest"]
    columns = [c for c in doc["blobs"]["columns"] if c in _BLOB_COLUMNS]  # a location is a hint; packs decide
    conn.executemany(
        f"INSERT OR IGNORE INTO blobs({', '.join(columns)}) VALUES ({','.join('?' * len(columns))})",
        [r[: len(columns)] for r in doc["blobs"]["rows"]],
    )
    names = [c.strip() for c in _MANIFEST_COLUMNS.split(",")]
    manifest = conn.execute(
        f"INSERT INTO manifests({_MANIFEST_COLUMNS}, object_key) VALUES ({','.join('?' * (len(names) + 1))})",
        (*(m[n] for n in names), key),
    ).lastrowid
    assert manifest is not None
    ids[key] = manifest
    conn.executemany(
        f"INSERT INTO files(manifest, {', '.join(_FILE_COLUMNS)}) VALUES ({','.join('?' * (len(_FILE_COLUMNS) + 1))})",
        [(manifest, *r) for r in doc["files"]["rows"]],
    )
    conn.executemany(
        f"INSERT INTO atoms(manifest, {', '.join(_ATOM_COLUMNS)}) VALUES ({','.join('?' * (len(_ATOM_COLUMNS) + 1))})",
        [(manifest, *r) for r in doc["atoms"]["rows"]],
    )
    layer_rows = []
    for *values, source_key in doc["layers"]["rows"]:
        source = manifest if source_key is None else ids.get(source_key)
        if source is None:
            raise CorruptStoreError(
                f"manifest object {key} inherits from {source_key}, which the store no longer holds; "
                "restore that object from a backup."
            )
        layer_rows.append((manifest, source, *values))
    conn.executemany(
        f"INSERT INTO layers(manifest, source, {', '.join(_LAYER_COLUMNS)}) VALUES (?,?,?,?,?,?,?)", layer_rows
    )
    return manifest


def _order(keys: list[str], docs: dict[str, dict[str, Any]]) -> list[str]:
    """Sources before the manifests that inherit from them (sources are always older)."""
    return sorted(keys, key=lambda k: (docs[k]["manifest"]["created_at"], k))


def _current_versions(keys: Iterable[str]) -> set[str]:
    """Of several versions of one step (a --force interrupted before it deleted the old one), the highest."""
    best: dict[tuple[str, int], tuple[int, str]] = {}
    out = set()
    for key in keys:
        match = _COMMIT_KEY.fullmatch(key)
        if match is None:
            if _MERGE_KEY.fullmatch(key):
                out.add(key)
            continue
        slot = (match.group(1), int(match.group(2)))
        version = int(match.group(3))
        if slot not in best or best[slot][0] < version:
            best[slot] = (version, key)
    return out | {key for _, key in best.values()}


def sync(backend: Backend, conn: sqlite3.Connection) -> tuple[int, int]:
    """Import the manifests the backend holds and the index lacks, drop those it no longer holds,
    and take tags and pins from the backend. Returns (imported, dropped).

    Reads first and writes only when something differs, so opening an unchanged store takes
    no write lock: one LIST of manifests and refs, and one GET per tag.
    """
    listed_packs = set(pack_names(backend))
    known_packs = {r[0] for r in conn.execute("SELECT name FROM packs")}
    present = _current_versions(k for k in backend.list(MANIFEST_PREFIX) if is_manifest_key(k))
    rows = conn.execute("SELECT id, object_key, tag, pinned FROM manifests").fetchall()
    indexed = {r["object_key"]: r["id"] for r in rows if r["object_key"] is not None}
    gone = [mid for key, mid in indexed.items() if key not in present]
    new = sorted(present - indexed.keys())
    tags = _listed_tags(backend)
    pins = set(backend.list(PIN_PREFIX))
    want = {r["id"]: (r["tag"], r["pinned"]) for r in rows if r["object_key"] in present}
    have = {mid: (tags.get(key), int(pin_key(key) in pins)) for key, mid in indexed.items() if key in present}
    if not gone and not new and want == have and listed_packs == known_packs:
        return 0, 0
    docs = {k: decode(backend.get(k), k) for k in new}
    trailers = {name: read_trailer(backend, name) for name in sorted(listed_packs - known_packs)}
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.executemany("DELETE FROM packs WHERE name=?", [(n,) for n in known_packs - listed_packs])
        for name, (size, entries) in trailers.items():  # where each blob is: packs are the truth
            conn.execute("INSERT INTO packs(name, size) VALUES (?,?)", (name, size))
            conn.executemany(
                "INSERT INTO blobs(hash, raw_size, stored_size, codec, created_at, pack, pack_offset)"
                " VALUES (?,?,?,?,?,?,?) ON CONFLICT(hash) DO UPDATE SET pack=excluded.pack,"
                " pack_offset=excluded.pack_offset, stored_size=excluded.stored_size, codec=excluded.codec",
                [(e.hash, e.raw_size, e.stored_size, e.codec, time.time(), name, e.offset) for e in entries],
            )
        conn.executemany("DELETE FROM manifests WHERE id=?", [(m,) for m in gone])
        ids = {k: v for k, v in indexed.items() if k in present}
        for key in _order(new, docs):
            if conn.execute("SELECT 1 FROM manifests WHERE object_key=?", (key,)).fetchone() is None:
                import_document(conn, key, docs[key], ids)
        conn.execute("UPDATE manifests SET tag=NULL WHERE object_key IS NOT NULL")  # tags are unique: clear first
        for key, mid in ids.items():
            conn.execute(
                "UPDATE manifests SET tag=?, pinned=? WHERE id=?", (tags.get(key), int(pin_key(key) in pins), mid)
            )
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return len(new), len(gone)


def _listed_tags(backend: Backend) -> dict[str, str]:
    """Manifest object key -> tag, from the tag objects."""
    out: dict[str, str] = {}
    for key in backend.list(TAG_PREFIX):
        try:
            out[backend.get(key).decode()] = tag_of_key(key)
        except FileNotFoundError:  # untagged while we listed
            continue
    return out
