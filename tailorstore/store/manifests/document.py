"""A manifest object's bytes: the document codec.

Each object holds everything the index knows about that manifest: its row, its files, atoms
and layers, and the rows of every blob it references (docs/FORMAT.md 3.1). Layers name their
source manifest by object key, not by the local id, which differs from host to host.
:func:`document` builds the document from the index, :func:`encode` compresses it, and
:func:`decode` reads one back, every row a checked record, refusing a damaged object whole
before any of it reaches the index.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import zstandard

from tailorstore.core import metric_values
from tailorstore.core.errors import Call, CorruptStoreError, RecordError
from tailorstore.core.records import (
    ATOM_COLUMNS,
    DOC_BLOB_COLUMNS,
    FILE_COLUMNS,
    MANIFEST_DOC_FIELDS,
    THIN_ARCHIVE,
    AtomRecord,
    BlobRecord,
    FileRecord,
    LayerRecord,
    ManifestRecord,
    check_rows,
    from_table,
    record,
    to_table,
)
from tailorstore.store.codec import decompress_bounded
from tailorstore.store.index._index import Index
from tailorstore.store.manifests.keys import COMMIT_KEY, run_of_key

DOC_VERSION = 2  # 2 adds the manifest's run; version 1 objects are all of run 'main'
THINNED_DOC_VERSION = 3  # a thinned manifest: a reader that does not know tiers must not check it out
# an archived manifest: a reader that does not know archive chains must refuse it, or its gc would
# take the chains' links for dead (FORMAT.md 7.2.1)
ARCHIVED_DOC_VERSION = 4
READABLE_DOC_VERSIONS = (1, 2, 3, 4)
# Columns of the tables inside a manifest object, in their order there (docs/FORMAT.md 3.1).
_LAYER_COLUMNS = ("layer", "source_step", "raw_bytes", "stored", "change")


def _doc_version(tier: str | None) -> int:
    if tier is None:
        return DOC_VERSION
    return ARCHIVED_DOC_VERSION if tier == THIN_ARCHIVE else THINNED_DOC_VERSION


def document(index: Index, manifest: int) -> dict[str, Any]:
    """Everything the index holds about one manifest, as a self-contained JSON document."""
    record = index.manifest(manifest)
    assert record is not None
    layers = index.layers(manifest)
    layers.sort(key=lambda x: x.layer)
    source_keys = index.object_keys({x.source for x in layers if x.source != manifest})
    layer_rows = to_table(layers, _LAYER_COLUMNS)["rows"]
    return {
        "tailorstore_manifest": _doc_version(record.tier),
        "manifest": dict(zip(MANIFEST_DOC_FIELDS, to_table([record], MANIFEST_DOC_FIELDS)["rows"][0], strict=True)),
        "files": to_table(index.files(manifest), FILE_COLUMNS),
        "atoms": to_table(index.atoms(manifest), ATOM_COLUMNS),
        "layers": {
            "columns": (*_LAYER_COLUMNS, "source"),
            "rows": [
                [*row, None if x.source == manifest else source_keys.get(x.source)]  # gone: its own (FORMAT.md 7)
                for x, row in zip(layers, layer_rows, strict=True)
            ],
        },
        "blobs": to_table(index.referenced_blobs(manifest), DOC_BLOB_COLUMNS),
    }


def encode(doc: dict[str, Any]) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(json.dumps(doc, separators=(",", ":")).encode())


@dataclass(frozen=True)
class ManifestDocument:
    """A manifest object read back, every row a checked record (``records.record``): a damaged
    object is refused as a whole, naming itself, before any of it reaches the index."""

    manifest: ManifestRecord  # without tag, pin or local id: the refs and the index hold those
    files: list[FileRecord]
    atoms: list[AtomRecord]
    blobs: list[BlobRecord]
    layers: list[tuple[LayerRecord, str | None]]  # each with the object key of its source (None: itself)


def decode(data: bytes, key: str) -> ManifestDocument:
    try:
        doc = json.loads(decompress_bounded(data, 1 << 31))
    except (zstandard.ZstdError, ValueError, RecursionError) as exc:
        raise CorruptStoreError(f"manifest object {key} is damaged ({exc}); restore it from a backup") from None
    if not isinstance(doc, dict) or doc.get("tailorstore_manifest") not in READABLE_DOC_VERSIONS:
        raise CorruptStoreError(f"manifest object {key} is not a manifest this tailorstore reads; upgrade tailorstore")
    try:
        typed = _typed_document(doc, key)
    except RecordError as exc:
        raise CorruptStoreError(
            f"manifest object {key} is damaged ({exc}); restore it from a backup, or delete it "
            "(its step is then gone) and run ",
            Call("rebuild_index"),
        ) from None
    _check_named(typed, key)
    return typed


def _check_named(doc: ManifestDocument, key: str) -> None:
    """A commit's manifest object holds the step its name says (its run is checked with the rows). The
    name is what every host lists and orders by (versions, refs); an object copied or renamed under
    another step's name (by anyone with access to the bucket) would otherwise be recorded as a step
    it is not."""
    named = COMMIT_KEY.search(key)
    if named is not None and doc.manifest.step != int(named.group(2)):
        raise CorruptStoreError(
            f"manifest object {key} holds step {doc.manifest.step} of run {doc.manifest.run!r}, where its name "
            f"says step {int(named.group(2))} of run {named.group(1)!r}: it was copied or changed behind the "
            "store's back. Restore it from a backup, or delete it (its step is then gone) and run ",
            Call("rebuild_index"),
        )


@dataclass(frozen=True)
class LayerRow:
    """A layer as a manifest object writes it: its source named by object key (None: the manifest itself)."""

    layer: str
    source_step: int
    raw_bytes: int
    stored: bool
    change: float | None
    source: str | None = None


def _typed_document(doc: dict[str, Any], key: str) -> ManifestDocument:
    m = doc.get("manifest")
    if not isinstance(m, dict):
        raise RecordError("it holds no manifest row")
    m = {**m, "run": m.get("run", run_of_key(key)), "tier": m.get("tier")}  # version 1 objects have neither
    m["metrics"] = m.get("metrics")  # objects written before metrics have none
    manifest = record(ManifestRecord, {c: m[c] for c in MANIFEST_DOC_FIELDS if c in m})
    try:
        metric_values.decode(manifest.metrics)
    except metric_values.MetricError as exc:
        raise RecordError(f"metrics: {exc}") from None
    if not 0 <= manifest.step < 1 << 63:  # what the index (SQLite) and every selector can hold
        raise RecordError(f"step {manifest.step}")
    for name in ("raw_bytes", "new_bytes", "world_size", "zero_stage"):
        value = getattr(manifest, name)
        if value is not None and not 0 <= value < 1 << 62:
            raise RecordError(f"{name} {value}")
    if manifest.run != run_of_key(key):  # FORMAT.md: a reader MUST refuse it
        raise RecordError(f"it says run {manifest.run!r}, but its key is of run {run_of_key(key)!r}")
    files = from_table(doc.get("files"), FileRecord)
    atoms = from_table(doc.get("atoms"), AtomRecord)
    blobs = from_table(doc.get("blobs"), BlobRecord)
    check_rows(files, atoms, blobs)
    layers = [
        (LayerRecord(row.layer, 0, row.source_step, row.raw_bytes, row.stored, row.change), row.source)
        for row in from_table(doc.get("layers"), LayerRow)
    ]  # each source's local id is set at import
    return ManifestDocument(manifest, files, atoms, blobs, layers)
